"""The dual AR of S2 Pro: the slow AR (one semantic token a frame) and the fast AR (the frame's other codebooks),
their GPU kernels, sampling, and loading from a checkpoint."""
