"""slow_ar: the continuous-batching AR engine (slow AR + fast AR per frame), streamed by pulls.

A thin adapter: tensors in, `s2tts.engine.service.EngineService` does the rest (one
engine thread, one sender thread, every request ending in exactly one final response).
A generation request carries `request_id` (the caller's id: its stream, cancellation, status,
log lines) and is answered with its first chunk; `control`="next" with that id answers the
next chunk (`s2tts.serving.pull.PullStreams`), until the one with a finish reason. A generation request
that names a `pull_group` (s2pro's, one per process) and a `pull_key` (its number there) leaves its later chunks
to that group: `control`="next_group" with the group's name as `request_id` answers every chunk queued in any of
its streams, in one response (their codes and audio one after another, `items`, `stats` and `error_text` saying
whose each is: `s2tts.serving.wire.encode_group`). Without a
`request_id` the answer is the whole generation, in one response. `control`="cancel" cancels
that request; `control`="status" answers with the engine's health and where that request is
(waiting / live / unknown) in `stats`; `control`="pace=R" (from s2pro) tells the chunker the
pipeline's pace. Everything but codes travels as numbers (`s2tts.serving.wire`: `FINISH_CODES`,
`STATS_FIELDS`, `STATUS_FIELDS`). Request-response, not decoupled: see config.pbtxt.

With `codec_in_engine` (auto: on a GPU with the codec beside the engine) this process also loads the codec
and every answer carries its chunk's audio, decoded in the engine's loop (`EngineService`); `control`=
"close_codec" with a codec stream's id closes that stream (a caller that will not continue it).
"""

import itertools
import json
from typing import NamedTuple

import numpy as np
import triton_python_backend_utils as pb_utils

from s2tts import errors, settings
from s2tts.serving import triton_io as tio
from s2tts.serving.metrics import Metrics
from s2tts.serving.process import setup_logging, unload_self
from s2tts.engine import HostFastAR
from s2tts.serving.wire import FINISH_CODES, GROUP_COLUMNS, STATS_FIELDS, STATUS_FIELDS, encode_fields, encode_group
from s2tts.engine.service import CodecStream
from s2tts.engine.build import serve_engine
from s2tts.engine.prompt import Prompt
from s2tts.serving.pull import PullStreams


class Reply(NamedTuple):
    """One response as the engine's service makes it, turned into Triton's when it is sent (alone or in a group)."""

    codes: np.ndarray
    reason: str
    stats: np.ndarray  # encoded (`wire.encode_fields`), or empty
    audio: np.ndarray | None


class Rendered:
    """A request's response sender that turns what it is given (a `Reply`, a group's list of them, an `S2Error`)
    into Triton's response with `render`."""

    def __init__(self, sender, render):
        self.sender, self.render = sender, render

    def send(self, response, final: bool) -> None:
        self.sender.send(self.render(response), final)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


def _reply_bytes(item) -> int:
    return item.codes.nbytes + (item.audio.nbytes if item.audio is not None else 0) if isinstance(item, Reply) else 0


class BLSFastAR(HostFastAR):
    """Calls the `fast_ar` model through BLS instead of running the module in this process."""

    def __call__(self, hidden, code0, temperature, top_p, top_k, seed, step):
        import torch

        arrays = {"hidden": hidden.float(), "code0": code0.int(), "temperature": temperature, "top_p": top_p,
                  "top_k": top_k.int(), "seed": seed, "step": step}
        inputs = [tio.tensor(k, v.cpu().numpy()) for k, v in arrays.items()]
        resp = pb_utils.InferenceRequest(model_name="fast_ar", inputs=inputs, requested_output_names=["codes"]).exec()
        if resp.has_error():
            raise errors.parse(resp.error().message())
        codes = pb_utils.get_output_tensor_by_name(resp, "codes").as_numpy()
        return torch.from_numpy(codes).to(device=hidden.device, dtype=torch.int64)

class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.name = args.get("model_name", "slow_ar")
        self.log = setup_logging(self.name)
        v = self.values = settings.model_values(cfg, "slow_ar")  # (a request's defaults among them)
        # the service's responses stay as made (`Reply`, `S2Error`) until a sender renders them
        self.streams = PullStreams(self.name, lambda err: err, idle_timeout_s=v.stream_idle_timeout_s,
                                   nbytes=_reply_bytes)
        self._anonymous = itertools.count(1)
        self.metrics = Metrics(self.name)
        self.service = serve_engine(v, self._response, lambda err: err, self.name, on_unhealthy=self._unload,
                                    on_tick=self._report, fast_ar=BLSFastAR() if v.fast_ar == "bls" else None,
                                    on_sent=self.streams.flush)
        self.C = self.service.C
        if self.service.codec is not None:
            self.metrics.declare("s2tts_codec_batch_size")

    def execute(self, requests):
        for request in requests:
            triton = tio.TritonResponder(request)
            sender = Rendered(triton, self._render)
            label = rid = request.request_id() or ""  # Triton's request id names the request in log lines
            try:
                rid = tio.scalar(request, "request_id", str, "") or rid  # ... and this one keys its stream
                control = tio.scalar(request, "control", str, "")
                if control == "next_group":
                    self.streams.pull_group(rid, Rendered(triton, self._render_group))
                    continue
                if control:
                    self._control(control, rid, sender)
                    continue
                group, tag = tio.scalar(request, "pull_group", str, ""), tio.scalar(request, "pull_key", int, 0)
                prompt, params, first, size, codec_stream = self._parse(request)
            except Exception as e:  # noqa: BLE001 - never let one request take the model down
                err = errors.from_exception(e, self.name)
                self.log.info("slow_ar: request %s refused: %s", rid, err.wire())
                self.service.table.refuse(sender, err)
                continue
            if not rid:  # nobody can pull more: the whole generation in one answer
                rid = f"<whole {next(self._anonymous)}>"
                first = size = params.max_new_tokens + 1
            stream = self.streams.open(rid, sender, group, tag)
            if stream is not None:
                self.service.submit(rid, stream, prompt, params, first, size, codec_stream, label=label)
        return None

    def _control(self, control, rid, sender):
        if control == "next":
            self.streams.pull(rid, sender)
            return
        out = self.service.control(control, rid)  # raises `invalid` for an unknown word
        if control == "cancel":
            self.log.info("slow_ar: cancel for request %s (%s)", rid, "live" if out else "not in flight")
            answer = np.array([float(out)], np.float32)
        elif control == "status":
            if out.get("request") == "unknown" and self.streams.get(rid) is not None:
                out["request"] = "live"  # generation ended, its last chunks not read yet
            answer = encode_fields(out, STATUS_FIELDS)
        elif control == "close_codec":
            answer = np.zeros(0, np.float32)
        else:  # pace=R
            answer = np.array([out], np.float32)
        sender.send(self._answer(answer), True)

    def _answer(self, stats):
        """A control request's answer: no codes, the numbers in `stats`."""
        return self._response(np.zeros((0, self.C), np.int32), "", None, raw_stats=stats)

    def _parse(self, request):
        import torch

        ids = tio.optional_input(request, "input_ids")
        codes = tio.optional_input(request, "input_codes")
        mask = tio.optional_input(request, "semantic_mask")
        if ids is None or ids.size == 0:
            raise errors.invalid("input_ids is empty", "input_ids")
        ids = ids.reshape(-1).astype(np.int64)
        vocab = self.service.engine.s2.text.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:  # an id outside the table: a device-side assert on a GPU
            raise errors.invalid(f"input_ids must be token ids in [0, {vocab}) (this checkpoint's tokenizer), got "
                                 f"{int(ids.min())}..{int(ids.max())}", "input_ids")
        T = ids.shape[0]
        if codes is None:
            codes = np.zeros((T, self.C), dtype=np.int64)
        if mask is None:
            mask = np.zeros(T, dtype=bool)
        if codes.shape != (T, self.C) or mask.reshape(-1).shape != (T,):
            raise errors.invalid(f"input_codes must be [{T}, {self.C}] (frames, codebooks) and semantic_mask [{T}]",
                                 "input_codes")
        prefix_len = tio.scalar(request, "prefix_len", int, 0)
        if not (0 <= prefix_len <= T):
            raise errors.invalid(f"prefix_len must be between 0 and {T}", "prefix_len")
        prompt = Prompt(torch.from_numpy(ids), torch.from_numpy(codes.astype(np.int64)),
                        torch.from_numpy(mask.reshape(-1).astype(bool)), prefix_len)
        f = tio.read_fields(request, "slow_ar", self.values)  # as the schema declares them, defaults from its settings
        unbounded = {"max_new_tokens_limit": None, "max_chunk_frames": None}  # s2pro's limits, not the engine's
        params = tio.sampling_params(f, unbounded)
        first, size = f["first_chunk_frames"], f["chunk_frames"]
        for name in ("first_chunk_frames", "chunk_frames"):
            settings.check_field(name, f[name], unbounded)
        sid = tio.scalar(request, "codec_stream", str, "")
        codec_stream = CodecStream(sid, tio.scalar(request, "codec_start", bool, True),
                                   tio.scalar(request, "codec_final", bool, True)) if sid else None
        return prompt, params, first, size, codec_stream

    def _response(self, codes, reason, stats, audio=None, raw_stats=None) -> Reply:
        """The service's `make_response`: a `Reply`, rendered when sent; `audio` is None unless the codec runs here."""
        if raw_stats is None:
            raw_stats = encode_fields(stats, STATS_FIELDS) if stats is not None else np.zeros(0, np.float32)
        return Reply(codes, reason, raw_stats, audio)

    def _render(self, reply):
        """One answer (a `Reply` or an `S2Error`) as Triton's response: every answer carries all six outputs (a
        request-response model answers what was asked); `audio` is empty unless the codec runs here."""
        if not isinstance(reply, Reply):
            return tio.s2_error_response(reply)
        return self._outputs(reply.codes, reply.reason, reply.stats, reply.audio)

    def _render_group(self, items):
        """A group pull's answer: its (pull key, `Reply` or `S2Error`, final) items' codes and audio one after
        another, `items` / `stats` / `error_text` saying whose each is (`wire.encode_group`); or the `S2Error`
        that refused the pull."""
        if not isinstance(items, list):
            return tio.s2_error_response(items)
        rows, codes, audio = [], [], []
        for key, r, _final in items:
            if isinstance(r, Reply):
                codes.append(r.codes)
                if r.audio is not None:
                    audio.append(r.audio)
                rows.append((key, r.codes.shape[0], 0 if r.audio is None else r.audio.size, r.reason, r.stats, ""))
            else:
                rows.append((key, 0, 0, "", np.zeros(0, np.float32), r.wire()))
        table, stats, text = encode_group(rows)
        return self._outputs(np.concatenate(codes) if codes else np.zeros((0, self.C), np.int32), "", stats,
                             np.concatenate(audio) if audio else None, table, text)

    def _outputs(self, codes, reason, stats, audio, items=None, error_text=None):
        """Every answer's outputs (`wire.SLOW_AR_OUTPUTS`): `items` and `error_text` empty but in a group answer."""
        return pb_utils.InferenceResponse(output_tensors=[
            tio.tensor("codes", np.ascontiguousarray(codes, dtype=np.int32)),
            tio.tensor("finish_reason", np.array([FINISH_CODES[reason]], np.int32)),
            tio.tensor("stats", stats),
            tio.tensor("audio", np.zeros(0, np.float32) if audio is None else np.ascontiguousarray(audio, np.float32)),
            tio.tensor("items", np.zeros((0, len(GROUP_COLUMNS)), np.int32) if items is None else items),
            tio.tensor("error_text", np.zeros(0, np.int32) if error_text is None else error_text)])

    def _report(self, service):
        self.metrics.report_engine(service, streams_open=self.streams.sweep())

    def _unload(self, reason):
        unload_self(self.name, self.log)

    def finalize(self):
        n = self.service.shutdown()
        if n:
            self.log.info("slow_ar: %d requests in flight ended at shutdown", n)
        self.streams.close()
        self.metrics.close()
