"""Fish Audio's live WebSocket (`/v1/tts/live`, `/v1/tts/live/with-timestamp`): text in as it is written, audio out
as it is made, over one s2pro text session per session (issue 27).

The protocol (binary msgpack events): the client sends {event: start, request: {...}} (the fields of /v1/tts, `text`
may be empty), then {event: text, text} any number of times, {event: flush}, {event: stop}; the server sends
{event: audio, audio: bytes} as the audio is made and ends the session with {event: finish, reason: stop | error}
(`message` on an error; over the concurrency limit Fish's {event: error, error, max_concurrency} comes first). After
`finish stop` the connection takes another `start` (LiveKit's plugin pools its connections); after an error, or
`live_idle_timeout_s` with no session, it is closed. With timestamps each audio event also says which text segment
it speaks and where (`fish.alignment`, s2tts/gateway/alignment.py).

A session: its `start` opens an s2pro request with `session_id` (text_event open) whose responses are the audio;
each text / flush / stop event is a short s2pro request appending to it (answered at once). Both directions run at
once; the first error of either ends both; a disconnect cancels the s2pro request. A session that s2pro ends
before the client's stop (no text for its `session_idle_timeout_s`) finishes with an error that says so, not with
`stop`: text the client sends later would not be spoken.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Awaitable, Callable

import anyio
import ormsgpack
from fastapi import WebSocket, WebSocketDisconnect

from .alignment import Timeline
from .encoders import AudioPipeline
from .error_bodies import APIError, bad_request
from .fish import FishError, FishTTS, alignment as fish_alignment
from .options import GatewayConfig
from .triton import SynthesisRequest, TritonBackend

log = logging.getLogger("s2tts.gateway")

# (the start event's request, the `model` header, the session's id) -> the checked fields and s2pro's request
Prepare = Callable[[dict, str | None, str], Awaitable[tuple[FishTTS, SynthesisRequest]]]


class LiveConnection:
    """One accepted WebSocket: its sessions one after another (`run`)."""

    def __init__(self, ws: WebSocket, cfg: GatewayConfig, state, backend: TritonBackend, prepare: Prepare,
                 timestamps: bool):
        """`state`: the gateway's (its `limiter` and `metrics`); `prepare`: parses and checks a start event's
        request, resolves its voice, and builds s2pro's request (app.py, shared with /v1/tts)."""
        self.ws, self.cfg, self.state, self.backend = ws, cfg, state, backend
        self.prepare, self.timestamps = prepare, timestamps

    async def run(self) -> None:
        sessions = 0
        while await self._session(sessions):
            sessions += 1

    async def _send(self, event: dict) -> None:
        await self.ws.send_bytes(ormsgpack.packb(event))

    async def _finish(self, reason: str, message: str | None = None) -> None:
        """The session's last event; after an error the connection closes too."""
        event = {"event": "finish", "reason": reason}
        if message:
            event["message"] = message
        try:
            await self._send(event)
            if reason != "stop":
                await self.ws.close()
        except Exception:  # noqa: BLE001 - the client may be gone
            pass

    async def _receive(self) -> dict:
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        msg = message.get("bytes")
        if msg is None:
            raise bad_request("an event in a text frame: send each event as a binary frame of msgpack", "event")
        if len(msg) > self.cfg.max_json_body_bytes:
            raise bad_request(f"an event of {len(msg)} bytes: at most {self.cfg.max_json_body_bytes}", "event")
        try:
            event = ormsgpack.unpackb(msg)
        except (ormsgpack.MsgpackDecodeError, ValueError, TypeError):
            raise bad_request("an event that is not valid msgpack", "event") from None
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            raise bad_request("every event is a map with an `event` name", "event")
        return event

    async def _start_event(self, sessions: int) -> dict | None:
        """The next session's start event; None when the connection ends here (the client left after its sessions,
        or none came within live_idle_timeout_s)."""
        idle = self.cfg.live_idle_timeout_s
        try:
            with anyio.fail_after(idle):
                start = await self._receive()
        except WebSocketDisconnect:
            if sessions:
                return None
            raise
        except TimeoutError:
            log.info("live connection: no session for %g s, closed", idle)
            await self.ws.close(code=1000, reason=f"no session for {idle:g} s")
            return None
        if start["event"] != "start" or not isinstance(start.get("request"), dict):
            raise bad_request("a session begins with {event: start, request: {...}}", "event")
        return start

    async def _admit(self) -> None:
        limiter = self.state.limiter
        if limiter.try_acquire():
            return
        self.state.metrics.overload_refusals += 1
        try:  # Fish's service says it so first: an error event naming the limit
            await self._send({"event": "error", "error": "Concurrency limit exceeded", "max_concurrency": limiter.limit})
        except Exception:  # noqa: BLE001 - the client may be gone
            pass
        raise APIError(503, f"the server is busy: {limiter.limit} requests are in flight; retry",
                       code="server_overloaded")

    async def _session(self, sessions: int) -> bool:
        """One session: its start, its text in and audio out, its finish. -> whether the connection goes on."""
        stream, sid, held = None, f"live-{uuid.uuid4().hex}", False
        try:
            start = await self._start_event(sessions)
            if start is None:
                return False
            await self._admit()
            held, t0 = True, time.monotonic()
            f, req = await self.prepare(start["request"], self.ws.headers.get("model"), sid)
            timeline = Timeline(f.text, None, f.speed)  # its rate: the first chunk's
            stream, stopped = self.backend.open_stream(req), anyio.Event()
            await self._both(self._text_in(sid, timeline, stopped), self._audio_out(stream, f, timeline, t0))
            if not stopped.is_set():  # s2pro ended the session itself: it was idle (not the client's stop)
                raise APIError(408, "the session ended after receiving no text for s2pro's session_idle_timeout_s: "
                                    "send text or a flush more often, or start a new session; text sent after that "
                                    "was not spoken", param="event", code="session_idle")
            await self._finish("stop")
            return True
        except WebSocketDisconnect:
            log.info("live session %s: the client disconnected", sid)
        except APIError as e:
            e = FishError.of(e)  # (named as Fish's fields)
            log.info("live session %s ended with an error: %s", sid, e.message)
            await self._finish("error", e.message)
        except Exception:  # noqa: BLE001 - a session never takes the gateway down
            log.exception("live session %s failed", sid)
            await self._finish("error", "internal error in the gateway")
        finally:
            if stream is not None:
                stream.cancel()  # no-op after the final response
            if held:
                self.state.limiter.release()
        return False

    @staticmethod
    async def _both(text_in, audio_out) -> None:
        """Both directions at once; the session ends with the audio, or with the first error of either."""
        failed: list[BaseException] = []

        async def side(coro, scope):
            try:
                await coro
            except Exception as e:  # noqa: BLE001 - handed on below
                failed.append(e)
                scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(side, text_in, tg.cancel_scope)
            await side(audio_out, tg.cancel_scope)
            tg.cancel_scope.cancel()
        if failed:
            raise failed[0]

    async def _text_in(self, sid: str, timeline: Timeline, stopped: anyio.Event) -> None:
        """The client's events -> the session's text (each answered by s2pro at once); `stopped` is set once the
        client's stop came; after stop an event is an error, and a disconnect ends the session at once (the audio
        may still be coming)."""
        while True:
            event = await self._receive()
            kind = event["event"]
            if kind not in ("text", "flush", "stop"):
                raise bad_request(f"unknown event {kind!r}: send text, flush or stop", "event")
            if kind == "stop":
                stopped.set()
            text = event.get("text", "") if kind == "text" else ""
            if not isinstance(text, str):
                raise bad_request("a text event's text must be a string", "text")
            timeline.add_text(text)
            await self._append(SynthesisRequest(text=text, request_id=f"{sid}-{kind}", session_id=sid,
                                                text_event={"stop": "end"}.get(kind, kind)))
            if kind == "stop":
                break
        event = await self._receive()
        raise bad_request(f"{event['event']!r} after stop: the session takes no more text; start another", "event")

    async def _append(self, piece: SynthesisRequest) -> None:
        """One text event to s2pro, retried while s2pro has not yet opened the session (its request may be queued)."""
        for attempt in range(100):
            ack = self.backend.open_stream(piece)
            try:
                while await ack.next() is not None:
                    pass
                return
            except APIError as e:
                if e.code != "not_found" or attempt == 99:
                    raise
                await anyio.sleep(0.05)
            finally:
                ack.cancel()  # its stream half-closes (or is cancelled when we were)

    async def _audio_out(self, stream, f: FishTTS, timeline: Timeline, t0: float) -> None:
        """s2pro's audio -> encoded audio events, with their place when asked, until the final response."""
        pipeline = None
        while True:
            chunk = await stream.next()
            if chunk is None:
                return
            if pipeline is None:
                rate = chunk.sample_rate
                pipeline = AudioPipeline(f.format, rate, f.speed, True, f.gain, f.bit_rate, f.sample_rate)
                timeline.sample_rate = rate
            timeline.push(chunk.audio, chunk.segment)
            data = await anyio.to_thread.run_sync(pipeline.push, chunk.audio)
            if chunk.final:
                data += await anyio.to_thread.run_sync(pipeline.finish)
            if data or (self.timestamps and chunk.segment):
                event = {"event": "audio", "audio": data}
                if self.timestamps and timeline.current is not None:
                    event.update(fish_alignment(timeline.current), time=round((time.monotonic() - t0) * 1000))
                await self._send(event)
            if chunk.final:
                return
