"""Many concurrent decode streams over one codec: per-stream state, batched by chunk length."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from .codec import StreamState


class StreamDecoder:
    def __init__(self, codec, idle_timeout_s: float = 600.0):
        self.codec = codec
        self.idle_timeout_s = idle_timeout_s
        self.states: dict[str, tuple[object, float]] = {}  # stream id -> (decoder state, last used)
        self.device = next(codec.parameters()).device
        self.C = codec.config.num_codebooks

    @torch.inference_mode()
    def decode_many(self, jobs, now: float) -> dict:
        """jobs: [(key, stream_id, codes [C, n] int, final)] -> {key: float32 audio [n * frame_length]}.

        Jobs of one stream must come in order; a stream appears at most once per call.
        """
        sids = [j[1] for j in jobs]
        if len(set(sids)) != len(sids):
            raise ValueError("a stream may send one chunk at a time")
        out = {}
        groups = defaultdict(list)
        for key, sid, codes, final in jobs:
            if codes.ndim != 2 or codes.shape[0] != self.C:
                raise ValueError(f"codes must be [{self.C}, frames], got {list(codes.shape)}")
            if codes.shape[1] == 0:
                out[key] = np.zeros(0, np.float32)
            else:
                groups[codes.shape[1]].append((key, sid, codes))
        for n, group in groups.items():
            codes = torch.as_tensor(np.stack([g[2] for g in group]), dtype=torch.int64, device=self.device)
            states = [self._state(sid) for _, sid, _ in group]
            if len(group) > 1:
                audio, state = self.codec.decode_stream(codes, StreamState.stack(states))
                new_states = state.split()
            else:
                audio, state = self.codec.decode_stream(codes, states[0])
                new_states = [state]
            audio = audio[:, 0].float().cpu().numpy()
            for b, (key, sid, _) in enumerate(group):
                out[key] = audio[b]
                self.states[sid] = (new_states[b], now)
        for key, sid, codes, final in jobs:
            if final:
                self.states.pop(sid, None)
        self._collect(now)
        return out

    def _state(self, sid):
        entry = self.states.get(sid)
        return entry[0] if entry else self.codec.new_stream_state(1)

    def _collect(self, now: float) -> None:
        """Drop streams nobody finished (a client that vanished without a final chunk)."""
        stale = [sid for sid, (_, t) in self.states.items() if now - t > self.idle_timeout_s]
        for sid in stale:
            del self.states[sid]
