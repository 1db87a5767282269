"""s2pro: the decoupled BLS model clients call.

With `engine_in_s2pro` (opt-in, one engine) this process also holds the engine (`s2tts.frontend.local_engine`):
generation makes no BLS call, and there is no slow_ar model. Not the default: this process's requests then
share the engine thread's GIL, which under load costs more than the process crossings it saves (perf/STATUS.md).

text (+ reference audio or codes + transcript) -> prompt -> `slow_ar` stream of frames
-> `dac_decoder` (stateful per stream, so chunks join without seams) -> audio responses
(or, with codec_in_engine, slow_ar's chunks arrive with their audio: no dac_decoder call),
then one final response with stats. A thin adapter: `s2tts.frontend.orchestrator.TTSService`
owns each request's life (worker thread, deadlines, cancellation, recovery); this file
parses tensors, builds responses and makes the BLS calls (`BLSDownstream`).

Every BLS call here is request-response (`exec()`), slow_ar's stream included (pulled a
chunk at a time): Triton 24.10's Python backend frees a finished decoupled BLS stream on a
thread without the GIL and takes its locks in an order that can deadlock two reading threads,
which crashed or hung this process under load (perf/STATUS.md, decisions).
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from s2tts import errors, settings
from s2tts.serving import triton_io as tio
from s2tts.serving.metrics import Metrics
from s2tts.serving.process import reload_model, setup_logging, unload_self
from s2tts.checkpoint_config import S2Config
from s2tts.serving.wire import FINISH_NAMES, SLOW_AR_OUTPUTS, STATS_FIELDS, STATUS_FIELDS, decode_fields, decode_group
from s2tts.engine.build import serve_engine
from s2tts.frontend.instances import run_dir
from s2tts.frontend.local_engine import LocalEngines, local_error, local_response
from s2tts.frontend.orchestrator import TTSService
from s2tts.frontend.prompt_builder import PromptBuilder
from s2tts.frontend.pull_relay import PullRelay
from s2tts.frontend.request import Limits, TTSRequest
from s2tts.layout import ENGINE
from s2tts.serving.call_times import CallTimes


def _raise_for(resp, model: str):
    if resp.has_error():
        err = resp.error()
        code = next((n for n in ("UNAVAILABLE", "INVALID_ARG", "NOT_FOUND", "ALREADY_EXISTS", "CANCELLED", "INTERNAL")
                     if err.code() == getattr(pb_utils.TritonError, n, None)), None)
        e = errors.parse(err.message(), code)
        if e.code == "internal" and not e.message.startswith(model):
            e = errors.internal(f"{model}: {e.message}")
        raise e


class BLSDownstream:
    """The rest of the pipeline through BLS (see `s2tts.frontend.orchestrator.Downstream`); `times` (a
    `serving.call_times.CallTimes`): how long each kind of BLS call took, from the call to its answer.

    Every call carries a timeout (`timeout_s`, Triton's request timeout): Triton applies it while a request waits in
    a queue, not while a model runs it, so a call into a model process that died can still wait; `TTSService` ends
    such a request from its supervisor and replaces the waiting worker.

    `pull_groups`: a request's later chunks come through `PullRelay` (one group pull of slow_ar for all of this
    process's requests) instead of a `control`="next" call each."""

    def __init__(self, num_codebooks: int, times: CallTimes, timeout_s: float, pull_groups: bool):
        self.C = num_codebooks
        self.times = times
        self.timeout_us = int(timeout_s * 1e6)
        self.relay = PullRelay(self._next_group) if pull_groups else None
        self._relay_keys: dict[str, int] = {}  # rid -> its relay key, while its chunks come through the relay

    def encode(self, audio, sample_rate, tag):
        req = pb_utils.InferenceRequest(
            model_name="dac_encoder", requested_output_names=["codes"], request_id=tag, timeout=self.timeout_us,
            inputs=[tio.tensor("waveform", audio.astype(np.float32)), tio.tensor("sample_rate", np.array([sample_rate], np.int32))])
        with self.times.timed("dac_encoder"):
            resp = req.exec()
        if resp.has_error():
            e = errors.parse(resp.error().message())
            if e.code == "invalid_argument":  # name the s2pro input, not the encoder's
                raise errors.invalid(f"reference_audio could not be encoded: {e.message}", "reference_audio")
            _raise_for(resp, "dac_encoder")
        return pb_utils.get_output_tensor_by_name(resp, "codes").as_numpy().astype(np.int64)

    def generate(self, engine, rid, prompt, req: TTSRequest, codec, label=""):
        """The chunks of slow_ar replica `engine`, pulled one request at a time (slow_ar is request-response: see
        its config.pbtxt); their audio too when slow_ar decodes it (codec_in_engine), in codec stream `codec`
        = (id, start, final). The stream is keyed by the `request_id` input, `rid`; Triton's request id, `label`
        (the client's), names it in slow_ar's log lines."""
        p = req.params
        inputs = [
            tio.string_tensor("request_id", rid),
            tio.tensor("input_ids", prompt.tokens.numpy().astype(np.int32)),
            tio.tensor("input_codes", prompt.codes.numpy().astype(np.int32)),
            tio.tensor("semantic_mask", prompt.semantic.numpy()),
            tio.tensor("prefix_len", np.array([prompt.prefix_len], np.int32)),
            tio.tensor("seed", np.array([p.seed], np.int64)),
            tio.tensor("temperature", np.array([p.temperature], np.float32)),
            tio.tensor("top_p", np.array([p.top_p], np.float32)),
            tio.tensor("top_k", np.array([p.top_k], np.int32)),
            tio.tensor("max_new_tokens", np.array([p.max_new_tokens], np.int32)),
            tio.tensor("ignore_eos", np.array([p.ignore_end])),
            tio.tensor("first_chunk_frames", np.array([req.first_chunk_frames], np.int32)),
            tio.tensor("chunk_frames", np.array([req.chunk_frames], np.int32)),
            tio.string_tensor("codec_stream", codec[0]),
            tio.tensor("codec_start", np.array([codec[1]])),
            tio.tensor("codec_final", np.array([codec[2]])),
        ]
        key, inbox = self.relay.open(engine) if self.relay is not None else (None, None)
        if key is not None:
            inputs += [tio.string_tensor("pull_group", self.relay.group), tio.tensor("pull_key", np.array([key], np.int64))]
            self._relay_keys[rid] = key
        try:
            with self.times.timed("slow_ar_first_chunk"):
                resp = self._slow_ar(engine, label or rid, inputs)
            while True:
                _raise_for(resp, engine)
                codes = pb_utils.get_output_tensor_by_name(resp, "codes").as_numpy().reshape(-1, self.C)
                reason = FINISH_NAMES.get(int(pb_utils.get_output_tensor_by_name(resp, "finish_reason").as_numpy().reshape(-1)[0]), "")
                stats = pb_utils.get_output_tensor_by_name(resp, "stats").as_numpy()
                audio = pb_utils.get_output_tensor_by_name(resp, "audio").as_numpy().reshape(-1)
                if reason and key is not None:  # its last: nothing more comes through the relay (closed before the
                    self.relay.close(key)  # yield, which its reader may never resume)
                    key = None
                yield codes, audio if audio.size else None, reason, decode_fields(stats, STATS_FIELDS) if stats.size else None
                if reason:
                    return
                if inbox is not None:
                    break
                with self.times.timed("slow_ar_next_chunk"):
                    resp = self._slow_ar(engine, label or rid, [tio.string_tensor("request_id", rid),
                                                                tio.string_tensor("control", "next")])
            while True:  # the later chunks, from the relay's group pulls
                with self.times.timed("slow_ar_next_chunk"):
                    item = inbox.get()
                if isinstance(item, Exception) or item[2]:  # its last (the relay let go of it)
                    key = None
                if isinstance(item, Exception):
                    raise item
                yield item
                if item[2]:
                    return
        finally:
            if inbox is not None:
                self._relay_keys.pop(rid, None)
            if key is not None:
                self.relay.close(key)

    def _next_group(self, engine, group):
        """One group pull (`PullRelay`'s fetch): [(pull key, (codes, audio or None, reason, stats) or S2Error)]."""
        with self.times.timed("slow_ar_next_group"):
            resp = pb_utils.InferenceRequest(
                model_name=engine, request_id=group, timeout=self.timeout_us, requested_output_names=list(SLOW_AR_OUTPUTS),
                inputs=[tio.string_tensor("request_id", group), tio.string_tensor("control", "next_group")]).exec()
        _raise_for(resp, engine)
        out = lambda name: pb_utils.get_output_tensor_by_name(resp, name).as_numpy()  # noqa: E731
        codes, audio = out("codes").reshape(-1, self.C), out("audio").reshape(-1)
        items, at_f, at_a = [], 0, 0
        for key, frames, samples, reason, stats, err in decode_group(out("items"), out("stats"), out("error_text")):
            if err is not None:
                items.append((key, errors.parse(err)))
                continue
            a = audio[at_a:at_a + samples] if samples else None
            items.append((key, (codes[at_f:at_f + frames], a, reason, stats)))
            at_f, at_a = at_f + frames, at_a + samples
        return items

    def abandon(self, engine, rid):
        key = self._relay_keys.pop(rid, None)
        if key is not None:
            self.relay.abandon(key, errors.unavailable(f"{engine} no longer serves this request; retry"))

    def failed(self, model):
        if self.relay is not None:
            self.relay.failed(model, errors.unavailable(f"{model} failed while this request read its chunks; retry"))

    def control(self, engine, rid, what):
        with self.times.timed("slow_ar_" + what.split("=")[0]):
            resp = self._slow_ar(engine, rid, [tio.string_tensor("request_id", rid), tio.string_tensor("control", what)])
        _raise_for(resp, engine)
        if what != "status":
            return {}
        return decode_fields(pb_utils.get_output_tensor_by_name(resp, "stats").as_numpy(), STATUS_FIELDS)

    def _slow_ar(self, engine, rid, inputs):
        return pb_utils.InferenceRequest(model_name=engine, inputs=inputs, request_id=rid, timeout=self.timeout_us,
                                         requested_output_names=list(SLOW_AR_OUTPUTS)).exec()

    def decode(self, decoder, sid, frames, start, final, label=""):
        req = pb_utils.InferenceRequest(
            model_name=decoder, requested_output_names=["audio"], request_id=label or sid, timeout=self.timeout_us,
            inputs=[tio.tensor("codes", frames[None].astype(np.int32)),
                    tio.tensor("stream_id", np.array([[sid.encode()]], dtype=object)),
                    tio.tensor("start", np.array([[start]], dtype=bool)),
                    tio.tensor("final", np.array([[final]], dtype=bool))])
        with self.times.timed("dac_decoder"):
            resp = req.exec()
        _raise_for(resp, decoder)
        return pb_utils.get_output_tensor_by_name(resp, "audio").as_numpy().reshape(-1)

    def is_ready(self, model):
        try:
            return bool(pb_utils.is_model_ready(model_name=model))
        except Exception:  # noqa: BLE001
            return False

    def reload(self, model):
        reload_model(model)


class TritonPythonModel:
    def initialize(self, args):
        v = self.values = settings.model_values(json.loads(args["model_config"]), "s2pro")
        self.log = setup_logging("s2pro")
        self.s2 = S2Config.from_dir(v.checkpoint)
        self.limits = Limits.from_settings(v)
        # several s2pro processes (s2pro_instances): they share the admission limit and the text sessions through a
        # directory of this server's, and their series carry the instance's name
        shared = run_dir(args.get("model_repository") or v.checkpoint) if (v.s2pro_instances or 1) > 1 else None
        self.metrics = Metrics("s2pro", labels={"instance": args.get("model_instance_name", "")} if shared else None)
        self.metrics.declare("s2tts_time_to_first_audio_seconds", "s2tts_request_duration_seconds")
        self._sent = (0, 0)  # audio samples and frames sent to clients
        self._sent_lock = threading.Lock()
        # where a request's time goes outside this process: BLS calls, responses sent (a histogram by call, and a
        # log line every 10 s)
        self.times = CallTimes("s2pro", self.log.info,
                               observe=lambda call, s: self.metrics.observe("s2tts_pipeline_call_seconds", s, call=call))
        downstream = BLSDownstream(self.s2.num_codebooks, self.times, v.request_timeout_s, v.pull_groups)
        self.engine_metrics = None
        if v.engine_in_s2pro:  # the engine in this process (rendering left slow_ar out): no BLS call per chunk
            self.engine_metrics = Metrics(ENGINE, families_of=self.metrics)
            if v.codec_in_engine:
                self.engine_metrics.declare("s2tts_codec_batch_size")
            engine = serve_engine(v, local_response, local_error, ENGINE, on_unhealthy=self._unhealthy,
                                  on_tick=self.engine_metrics.report_engine, direct_send=True)
            downstream = LocalEngines({ENGINE: engine}, downstream)
        self.downstream = downstream
        self.service = TTSService(downstream, PromptBuilder.from_dir(v.checkpoint, self.s2), self.s2, v,
                                  self._chunk_response, self._final_response, tio.s2_error_response,
                                  on_tick=self._report, on_unhealthy=self._unhealthy, shared_dir=shared)

    def _unhealthy(self, reason):
        unload_self("s2pro", self.log)

    def _report(self, svc):
        self.metrics.report_table(svc.table)
        with self._sent_lock:
            samples, frames = self._sent
        self.metrics.count_to("s2tts_audio_seconds_total", round(samples / self.s2.sample_rate, 3))
        self.metrics.count_to("s2tts_frames_total", frames)
        if svc.relay is not None:
            self.metrics.count_to("s2tts_session_text_relayed_total", svc.relay.relayed)
        self.metrics.flush()
        if svc.pace is not None:
            self.metrics.set("s2tts_stream_pace", round(svc.pace, 3))

    def execute(self, requests):
        for request in requests:
            responder = tio.TritonResponder(request, self.times)
            client_id = request.request_id() or ""
            try:
                req = self._parse(request)
                if req.session_id is not None and req.text_event != "open":  # text for an open session: at once
                    info = self.service.append(req.session_id, req.text_event, req.text)
                    responder.send(self._answer(json.dumps(info)), True)
                    continue
            except Exception as e:  # noqa: BLE001 - a bad request gets one error; the model goes on
                err = errors.from_exception(e, "s2pro")
                self.log.info("s2pro: request %s refused: %s", client_id, err.wire())
                self.service.table.refuse(responder, err)
                continue
            self.service.submit(client_id, responder, req)
        return None

    def _parse(self, request) -> TTSRequest:
        """The request's fields as the schema declares them (`settings.REQUEST_FIELDS`, defaults from this model's
        settings), checked (`TTSRequest.validate`)."""
        f = tio.read_fields(request, "s2pro", self.values)
        params = tio.sampling_params(f, check=False)  # checked with the rest of the request by TTSRequest.validate
        if params.seed is None:
            import random

            params.seed = random.getrandbits(63)
        audio, codes = f["reference_audio"], f["reference_codes"]
        req = TTSRequest(
            text=f["text"] or "",
            params=params,
            first_chunk_frames=f["first_chunk_frames"],
            chunk_frames=f["chunk_frames"],
            chunk_length=f["chunk_length"],
            reference_audio=None if audio is None else audio.astype(np.float32).reshape(-1),
            reference_sample_rate=f["reference_sample_rate"],
            reference_text=f["reference_text"],
            reference_codes=None if codes is None else codes.astype(np.int64),
            session_id=f["session_id"],
            text_event=f["text_event"],
        )
        return req.validate(self.limits, self.s2.num_codebooks)

    def _chunk_response(self, audio, frames, seq, where):
        with self._sent_lock:
            self._sent = (self._sent[0] + audio.size, self._sent[1] + frames.shape[0])
        return pb_utils.InferenceResponse(output_tensors=[
            tio.tensor("audio", audio.astype(np.float32)),
            tio.tensor("codes", frames.astype(np.int32)),
            tio.tensor("sequence", np.array([seq], np.int64)),
            tio.tensor("sample_rate", np.array([self.s2.sample_rate], np.int32)),
            tio.string_tensor("stats", ""),
            tio.string_tensor("segment", json.dumps(where, ensure_ascii=False)),
        ])

    def _answer(self, stats_json: str):
        """The one (final) response to text for a session: no audio, `stats` = what the session holds."""
        return pb_utils.InferenceResponse(output_tensors=[
            tio.tensor("audio", np.zeros(0, np.float32)),
            tio.tensor("codes", np.zeros((0, self.s2.num_codebooks), np.int32)),
            tio.tensor("sequence", np.array([0], np.int64)),
            tio.tensor("sample_rate", np.array([self.s2.sample_rate], np.int32)),
            tio.string_tensor("stats", stats_json),
            tio.string_tensor("segment", ""),
        ])

    def _final_response(self, stats, seq):
        now = time.monotonic()
        if stats.first_audio is not None:
            self.metrics.observe("s2tts_time_to_first_audio_seconds", stats.first_audio - stats.started)
        self.metrics.observe("s2tts_request_duration_seconds", now - stats.started)
        return pb_utils.InferenceResponse(output_tensors=[
            tio.tensor("audio", np.zeros(0, np.float32)),
            tio.tensor("codes", np.zeros((0, self.s2.num_codebooks), np.int32)),
            tio.tensor("sequence", np.array([seq], np.int64)),
            tio.tensor("sample_rate", np.array([self.s2.sample_rate], np.int32)),
            tio.string_tensor("stats", stats.to_json(self.s2.sample_rate)),
            tio.string_tensor("segment", ""),
        ])

    def finalize(self):
        n = self.service.shutdown()
        if n:
            self.log.info("s2pro: %d requests in flight ended at shutdown", n)
        if isinstance(self.downstream, LocalEngines):
            self.downstream.shutdown()
            self.engine_metrics.close()
        elif self.downstream.relay is not None:  # its threads out of their calls before this process ends
            self.downstream.relay.shutdown(timeout=5)
        self.metrics.close()
