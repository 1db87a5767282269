"""Offline text -> waveform, the whole chain in one process (used by the CLI and tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .ar.loading import load_model
from .ar.sampling import SamplingParams
from .codec.audio import prepare_audio
from .codec.loading import load_codec_from_dir
from .codec.model import codec_precision
from .engine import Engine, EngineConfig
from .frontend.prompt_builder import PromptBuilder
from .frontend.segment import (
    DEFAULT_CHUNK_LENGTH,
    batches,
    clean_text,
    overall_finish_reason,
)
from .gpu.device import resolve_device


@dataclass
class Synthesis:
    audio: np.ndarray  # float32 [samples]
    sample_rate: int
    codes: np.ndarray  # [num_codebooks, frames]
    finish_reason: str


class S2Pipeline:
    def __init__(self, checkpoint: str | Path, device="auto", dtype="bf16", codec_dtype="fp32",
                 max_batch: int = 4, max_seq_len: int = 4096):
        self.device = resolve_device(device)
        self.model = load_model(checkpoint, self.device, dtype)
        self.s2 = self.model.s2

        codec_precision(codec_dtype, tf32=False)  # offline: the exact result
        self.codec = load_codec_from_dir(checkpoint, self.device, codec_dtype)
        if self.codec.config.semantic_codebook_size != self.s2.num_semantic:
            raise ValueError(
                f"codec.pth has {self.codec.config.semantic_codebook_size} semantic codes but config.json has {self.s2.num_semantic}")
        self.prompts = PromptBuilder.from_dir(checkpoint, self.s2)
        self.engine = Engine(self.model, self.codec.config.codebook_size, EngineConfig(max_batch=max_batch,
                                                                                       max_seq_len=max_seq_len))

    @property
    def sample_rate(self) -> int:
        return self.s2.sample_rate

    @torch.inference_mode()
    def encode_reference(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        """Reference waveform ([T], [T, C] or [C, T]) at any rate -> codes [num_codebooks, frames]."""
        wav = prepare_audio(audio, sample_rate, self.codec.config.sample_rate).to(self.device)
        return self.codec.encode(wav)[0].cpu().numpy().astype(np.int32)

    @torch.inference_mode()
    def decode(self, codes: np.ndarray) -> np.ndarray:
        c = torch.as_tensor(codes, dtype=torch.int64, device=self.device)[None]
        return self.codec.decode(c)[0, 0].float().cpu().numpy()

    def synthesize(self, text: str, params: SamplingParams, ref_codes=None, ref_text: str | None = None,
                   chunk_length: int = DEFAULT_CHUNK_LENGTH) -> Synthesis:
        """As s2pro does: a text over `chunk_length` UTF-8 bytes (or a dialogue) segment after segment, each with
        the earlier ones and their codes in context; `max_new_tokens` per segment; one decode of all the codes."""
        segments = batches(clean_text(text), chunk_length) or [text]
        room = min(self.engine.max_seq_len, self.s2.text.max_seq_len) - params.max_new_tokens - 1
        history, parts, reason, cut = [], [], "", False
        for k, segment in enumerate(segments):
            prompt = self.prompts.build_segment(segment, ref_codes, ref_text, history, room)
            if prompt.history_dropped:
                cut, history = True, history[prompt.history_dropped:]
            codes, reason = self.engine.generate(prompt, params, request_id=f"offline-{k}")
            cut = cut or reason == "length"
            parts.append(codes)
            history.append((segment, codes.T))
        codes = np.concatenate(parts, axis=1)
        reason = overall_finish_reason(reason, cut)
        audio = self.decode(codes) if codes.shape[1] else np.zeros(0, dtype=np.float32)
        return Synthesis(audio, self.sample_rate, codes, reason)
