"""Many concurrent decode streams over one codec: per-stream state, batched by chunk length.

A job is one chunk of one stream: `(key, stream_id, codes [frames, num_codebooks], start, final)`.
`start` opens the stream (a fresh decoder state); a later chunk continues the stream's state, so
chunks join without seams; `final` releases it. A chunk for a stream that is not open (never
started, already finished, or dropped after `idle_timeout_s`) is an error, never a silent restart
(which would put an audible seam in the audio); so is a `start` for a stream that is open.

A codec computing in fp16 (the GPU default) can overflow. With a `fallback` (the same codec in
fp32), a chunk whose audio or new state is not finite is decoded again in fp32 from the stream's
previous state, and that stream stays in fp32 until it ends.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import torch

from .codec import StreamState
from .errors import S2Error, invalid

log = logging.getLogger("s2tts")


class StreamDecoder:
    def __init__(self, codec, idle_timeout_s: float = 600.0, fallback=None):
        self.codec = codec
        self.fallback = fallback  # the codec in fp32, when `codec` computes in fp16 / bf16
        self.idle_timeout_s = idle_timeout_s
        self.states: dict[str, tuple[object, float]] = {}  # stream id -> (decoder state, last used)
        self.in_fp32: set[str] = set()  # streams moved to the fallback after a non-finite chunk
        self.redone = 0  # chunks decoded again in fp32
        self.batches: list[int] = []  # streams decoded together, one entry per codec call since the host last took them
        self.device = next(codec.parameters()).device
        self.C = codec.config.num_codebooks

    def _check(self, sid: str, codes: np.ndarray, start: bool) -> S2Error | None:
        if codes.ndim != 2 or codes.shape[1] != self.C:
            return invalid(f"codes must be [frames, {self.C}], got {list(codes.shape)}", "codes")
        if start and sid in self.states:
            return S2Error("already_exists", f"codec stream {sid!r} is already open: start each stream once "
                                             "(or end it with final=true first)", "stream_id")
        if not start and sid not in self.states:
            return S2Error("not_found", f"codec stream {sid!r} is not open: it was never started (start=true on its "
                                        f"first chunk), already ended, or dropped after {self.idle_timeout_s:g} s "
                                        "without a chunk", "stream_id")
        return None

    @torch.inference_mode()
    def decode_many(self, jobs, now: float) -> dict:
        """jobs: [(key, stream_id, codes [n, C] int, start, final)] -> {key: float32 audio [n * frame_length] or
        S2Error}. Jobs of one stream must come in order; a stream appears at most once per call."""
        out: dict = {}
        seen = set()
        groups = defaultdict(list)
        for key, sid, codes, start, final in jobs:
            err = self._check(sid, codes, start) if sid not in seen else \
                invalid(f"codec stream {sid!r} sent two chunks at once: send one chunk at a time", "stream_id")
            seen.add(sid)
            if err is not None:
                out[key] = err
                continue
            if start:
                self.states[sid] = (self.codec.new_stream_state(1), now)
            if codes.shape[0] == 0:
                out[key] = np.zeros(0, np.float32)
                self.states[sid] = (self.states[sid][0], now)
            else:
                groups[(codes.shape[0], sid in self.in_fp32)].append((key, sid, codes))
        for (n, wide), group in groups.items():
            codes = torch.as_tensor(np.stack([g[2] for g in group]), dtype=torch.int64, device=self.device)
            codes = codes.transpose(1, 2)  # the codec computes on [B, C, n]
            states = [self.states[sid][0] for _, sid, _ in group]
            self.batches.append(len(group))
            try:
                audio, new_states, finite = self._decode(self.fallback if wide else self.codec, codes, states,
                                                         check=self.fallback is not None and not wide)
                for b in np.flatnonzero(~finite):  # fp16 overflowed: this chunk again in fp32, and the rest of it
                    key, sid, _ = group[b]
                    wide_state = StreamState({k: t.float() if t.is_floating_point() else t
                                              for k, t in states[b].tensors.items()})
                    a, st, ok = self._decode(self.fallback, codes[b : b + 1], [wide_state], check=True)
                    if not ok[0]:
                        raise FloatingPointError(f"codec stream {sid!r}: the chunk's audio is not finite, in fp32 too")
                    audio[b], new_states[b] = a[0], st[0]
                    self.in_fp32.add(sid)
                    self.redone += 1
                    log.warning("dac_decoder: stream %s: a chunk of %d frames overflowed in %s; decoded again in fp32 "
                                "(the stream stays in fp32)", sid, n, next(self.codec.parameters()).dtype)
            except Exception as e:  # noqa: BLE001 - this group's streams fail; their state is gone
                from .errors import from_exception

                err = from_exception(e, "dac_decoder")
                for key, sid, _ in group:
                    out[key] = err
                    self._drop(sid)
                continue
            for b, (key, sid, _) in enumerate(group):
                out[key] = audio[b]
                self.states[sid] = (new_states[b], now)
        for key, sid, codes, start, final in jobs:
            if final and not isinstance(out.get(key), S2Error):
                self._drop(sid)
        self._collect(now)
        return out

    @staticmethod
    def _decode(codec, codes, states: list[StreamState], check: bool):
        """-> float32 audio [B, samples] (host), new states, finite [B] (audio and new state; all True unless
        `check`). One device-to-host copy: the finite flags travel with the audio."""
        if len(states) > 1:
            audio, state = codec.decode_stream(codes, StreamState.stack(states))
            new_states = state.split()
        else:
            audio, state = codec.decode_stream(codes, states[0])
            new_states = [state]
        audio = audio[:, 0].float()
        if not check:
            return audio.cpu().numpy(), new_states, np.ones(len(states), bool)
        finite = audio.isfinite().all(dim=1)
        for t in state.tensors.values():
            if t.is_floating_point():
                finite &= t.isfinite().flatten(1).all(dim=1)
        host = torch.cat([audio, finite[:, None].float()], dim=1).cpu().numpy()
        return host[:, :-1], new_states, host[:, -1] > 0

    def _drop(self, sid: str) -> None:
        self.states.pop(sid, None)
        self.in_fp32.discard(sid)

    def _collect(self, now: float) -> None:
        """Drop streams nobody finished (a client that vanished without a final chunk)."""
        stale = [sid for sid, (_, t) in self.states.items() if now - t > self.idle_timeout_s]
        for sid in stale:
            self._drop(sid)
