"""The engine in the process of the model clients call (`engine_in_s2pro`): generation with no process crossing.

    LocalEngines({"slow_ar": engine_service}, rest)

is s2pro's `frontend.orchestrator.Downstream` when s2pro holds the engine itself: `generate` and `control` go straight to
the `engine.service.EngineService` of this process (built with `direct_send`: the engine thread hands each
response to the request's inbox, which its worker reads), and `encode` / `decode` (`dac_encoder`, and
`dac_decoder` for chunks that come without audio) go to `rest`, the BLS calls. A chunk then crosses processes
twice between the engine and the client (s2pro's response to tritonserver, tritonserver's to the client) instead
of six, and its thread hand-offs are two (the engine thread to the request's worker, the worker's IPC send).

The names and the order between a request and its cancel are the engine service's, as through BLS: the request's
id keys it (a cancel for an id not seen yet is remembered), and a caller's codec stream is apart from the
engine's own. The engine is part of s2pro's process: a fault that makes it unhealthy ends its requests, and s2pro
then unloads itself (Triton reports it not ready; restart the server or load s2pro again): `reload` refuses.
"""

from __future__ import annotations

import queue
from typing import Any, Iterator

import numpy as np

from .. import errors
from ..engine.service import CodecStream, EngineService
from ..errors import S2Error
from .request import TTSRequest


class Inbox:
    """A request's `serving.lifecycle.Responder` inside this process: its responses, in order, for its worker."""

    def __init__(self):
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, response: Any, final: bool) -> None:
        self.items.put((response, final))

    def is_cancelled(self) -> bool:  # the worker sees its client's cancel and cancels through `control`
        return False


def local_response(codes: np.ndarray, reason: str, stats: dict | None, audio: np.ndarray | None = None):
    """`EngineService`'s `make_response` here: what `Downstream.generate` yields, (frames [n, C], their audio or
    None, finish reason or "", stats on the last)."""
    return codes, audio if audio is not None and audio.size else None, reason, stats


def local_error(err: S2Error) -> S2Error:
    """`EngineService`'s `make_error` here: the error itself, raised by the reading worker."""
    return err


class LocalEngines:
    """s2pro's `Downstream` with the engines in its own process (see the module's doc)."""

    def __init__(self, services: dict[str, EngineService], rest):
        self.services = services
        self.rest = rest
        self._reading: dict[str, Inbox] = {}  # request id -> its inbox, while its worker reads it

    def _service(self, engine: str) -> EngineService:
        try:
            return self.services[engine]
        except KeyError:
            raise errors.internal(f"no engine {engine!r} in this process (it holds {sorted(self.services)})") from None

    def generate(self, engine: str, rid: str, prompt, req: TTSRequest, codec: tuple[str, bool, bool],
                 label: str = "") -> Iterator[tuple[np.ndarray, np.ndarray | None, str, dict | None]]:
        svc = self._service(engine)
        inbox = Inbox()
        self._reading[rid] = inbox
        try:
            svc.submit(rid, inbox, prompt, req.params, req.first_chunk_frames, req.chunk_frames, CodecStream(*codec),
                       label=label or rid)
            while True:
                response, final = inbox.items.get()
                if isinstance(response, S2Error):
                    raise response
                yield response
                if final:
                    return
        finally:
            self._reading.pop(rid, None)

    def control(self, engine: str, rid: str, what: str) -> dict:
        out = self._service(engine).control(what, rid)
        if what != "status":
            return {}
        if out.get("request") == "unknown" and rid in self._reading:
            out["request"] = "live"  # generation ended, its last chunks not read yet
        return out

    def encode(self, audio, sample_rate, tag):
        return self.rest.encode(audio, sample_rate, tag)

    def decode(self, decoder, sid, frames, start, final, label=""):
        return self.rest.decode(decoder, sid, frames, start, final, label)

    def is_ready(self, model: str) -> bool:
        if model in self.services:
            return self.services[model].health.ok
        return self.rest.is_ready(model)

    def holds(self, model: str) -> bool:
        return model in self.services

    def reload(self, model: str) -> None:
        if model in self.services:
            raise errors.unavailable(f"the engine {model} runs in this process: it is not reloaded on its own (this "
                                     "model unloads itself; load it again or restart the server)")
        self.rest.reload(model)

    def shutdown(self) -> int:
        return sum(svc.shutdown() for svc in self.services.values())
