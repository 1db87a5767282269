"""Serving Fish Audio S2 Pro (dual-AR TTS + DAC codec) on Triton Inference Server."""

__version__ = "0.1.0"
