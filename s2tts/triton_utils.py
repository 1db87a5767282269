"""Small helpers shared by the `model.py` adapters of the model repository.

They take plain values (the parsed model config, numpy arrays) so they can be
tested without Triton; `pb_utils` is imported lazily where a Triton type is needed.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time

import numpy as np

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def get_param(model_config: dict | str, key: str, kind=str, default=None):
    """The one typed reader of `parameters { key: ... }` in config.pbtxt.

    Values left as `${...}` placeholders count as unset.
    """
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    raw = model_config.get("parameters", {}).get(key, {}).get("string_value")
    if raw is None or raw.startswith("${"):
        return default
    raw = raw.strip()
    if kind is bool:
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"config.pbtxt parameter {key}={raw!r}: use true or false")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"config.pbtxt parameter {key}={raw!r} is not a valid {kind.__name__}") from None


def codec_precision(dtype: str, tf32: bool) -> None:
    """Process-wide matmul/convolution precision for a codec process running fp32: `tf32=False` gives
    fp32-exact convolutions (~2e-5 from the CPU result on an H200), `tf32=True` lets cuDNN use TF32
    (about 2x faster for the decoder at batch 32-64; see perf/RESULTS.md for its deviation)."""
    if dtype in ("fp32", "float32"):
        import torch

        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32


_EXIT_REGISTERED = False


def exit_without_teardown() -> None:
    """At the model process's exit (after Triton's finalize, once every other exit handler registered after this
    one has run), flush stdout and stderr and end the process at once: the interpreter's teardown of PyTorch and
    the other modules took ~2 s of each model's unload on a CPU, which every server stop, restart and model reload
    waits for. Nothing is lost: the model's `finalize` and the exit handlers registered later (the stack sampler's
    report) run first."""
    global _EXIT_REGISTERED
    if _EXIT_REGISTERED:
        return
    _EXIT_REGISTERED = True

    def _exit() -> None:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
                pass
        os._exit(0)

    atexit.register(_exit)


def setup_logging(name: str) -> logging.Logger:
    """Log lines from a model process go to stderr with the model's name, which Triton passes through. A model
    process that crashes (a fatal signal) prints every thread's Python stack there first (faulthandler), and one
    sent SIGUSR1 prints them and goes on (where a model seems stuck: `kill -USR1 <its triton_python_backend_stub>`;
    unless the process already handles that signal). With `S2TTS_PROFILE_DIR` set, the process also samples its
    threads' stacks there (`sampler.StackSampler`). Once Triton has finalized the model, its process exits without
    the interpreter's teardown (`exit_without_teardown`)."""
    import faulthandler
    import signal

    from .sampler import start_from_env

    exit_without_teardown()
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:  # (SIG_DFL: it would end)
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    log = logging.getLogger("s2tts")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(f"[s2tts:{name}] %(levelname)s %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    sampler = start_from_env(name)
    if sampler is not None:
        log.info("%s: sampling thread stacks every %g ms into %s", name, sampler.interval_s * 1e3, sampler.text_path)
    return log


def optional_input(request, name: str):
    """numpy array of an optional input, or None (pb_utils is imported by the caller's process)."""
    import triton_python_backend_utils as pb_utils

    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def scalar(request, name: str, kind, default):
    from .errors import invalid

    arr = optional_input(request, name)
    if arr is None or arr.size == 0:
        return default
    if arr.size != 1:
        raise invalid(f"{name} must hold one value, got {arr.size}", name)
    v = arr.reshape(-1)[0]
    if kind is str:
        try:
            return v.decode("utf-8", errors="strict") if isinstance(v, bytes) else str(v)
        except UnicodeDecodeError:
            raise invalid(f"{name} is not valid UTF-8 text", name) from None
    if kind is bool:
        return bool(v)
    if kind is float and not np.isfinite(v):
        raise invalid(f"{name} must be a finite number", name)
    return kind(v)


def read_fields(request, stage: str, values: dict | None = None) -> dict:
    """Every request field model `stage` takes (`settings.REQUEST_FIELDS`), as the schema declares it: a scalar as
    its Python type, an array as sent (numpy); a field left out is its default (`settings.field_default`: the
    model's setting `values` where the field has one). Ranges are checked where the fields are used
    (`sampling_params`, `request.TTSRequest.validate`)."""
    from .settings import field_default, stage_fields

    out = {}
    for f in stage_fields(stage):
        if f.dims == "[ 1 ]":
            out[f.name] = scalar(request, f.name, f.type, field_default(f.name, values))
        else:
            out[f.name] = optional_input(request, f.name)
    return out


def sampling_params(fields: dict, limits: dict | None = None, check: bool = True):
    """The sampling fields of a request (`read_fields`) -> `SamplingParams`, each checked against its range in
    `settings.REQUEST_FIELDS` (upper bounds from `limits`, a model's settings; None where a bound is not this
    model's to check); S2Error names the input that is wrong. `check=False` for a caller that checks them with the
    rest of its request (s2pro: `TTSRequest.validate`)."""
    from .sampling import SamplingParams
    from .settings import SAMPLING_FIELDS, check_field

    for name in SAMPLING_FIELDS if check else ():
        check_field(name, fields[name], limits)
    return SamplingParams(temperature=fields["temperature"], top_p=fields["top_p"], top_k=fields["top_k"],
                          max_new_tokens=fields["max_new_tokens"], seed=fields["seed"],
                          ignore_end=bool(fields["ignore_eos"]))


class TritonResponder:
    """A request's response sender as a `lifecycle.Responder` (final = the FINAL flag); `times` (a
    `timing.CallTimes`): how long each send took, under "send"."""

    def __init__(self, request, times=None):
        self.request = request
        self.sender = request.get_response_sender()
        self.times = times

    def send(self, response, final: bool) -> None:
        import triton_python_backend_utils as pb_utils

        t = time.perf_counter()
        if final:
            self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            self.sender.send(response)
        if self.times is not None:
            self.times.add("send", time.perf_counter() - t)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


def s2_error_response(err):
    """An error response carrying the S2Error's class tag (`[s2tts:code:param] message`) and Triton code."""
    return error_response(err.wire(), err.triton_code)


def load_on_first_request(load, requests, name: str, log, what: str) -> list | None:
    """A model that holds its weights only once a direct caller comes: `load()` them now -> None, or, if that
    failed, one error response per request (the next request tries again)."""
    try:
        load()
        return None
    except Exception as e:  # noqa: BLE001 - these requests fail; the next one tries again
        from .errors import from_exception

        err = from_exception(e, name)
        log.error("%s: loading %s failed: %s", name, what, err.wire())
        return [s2_error_response(err) for _ in requests]


def unload_self(name: str, log) -> bool:
    """Ask Triton to unload this model (so readiness reports it), which works with --model-control-mode=explicit;
    otherwise say what the operator must do."""
    import triton_python_backend_utils as pb_utils

    try:
        pb_utils.unload_model(name)
        log.error("%s: unloading itself after an unrecoverable fault; Triton reports it not ready until it is "
                  "loaded again (s2pro reloads it when auto_recover=true)", name)
        return True
    except Exception as e:  # noqa: BLE001 - not in explicit model control mode
        log.error("%s: could not unload itself (%s): it refuses every request with `unavailable`; restart "
                  "tritonserver, or run it with --model-control-mode=explicit so the model can be reloaded", name, e)
        return False


def reload_model(name: str, timeout_s: float = 600.0) -> None:
    """Unload `name` (if loaded) and load it again: a new process, a fresh device context. Needs
    --model-control-mode=explicit."""
    import time

    import triton_python_backend_utils as pb_utils

    try:
        pb_utils.unload_model(model_name=name)
    except Exception:  # noqa: BLE001 - already unloaded (it may have unloaded itself)
        pass
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and pb_utils.is_model_ready(model_name=name):
        time.sleep(0.2)
    pb_utils.load_model(model_name=name)
    deadline = time.monotonic() + timeout_s
    while not pb_utils.is_model_ready(model_name=name):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not ready {timeout_s:g} s after its reload")
        time.sleep(0.2)


def error_response(message: str, code: str = "INVALID_ARG"):
    import triton_python_backend_utils as pb_utils

    err_code = getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL)
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, err_code))


def tensor(name: str, array):
    import triton_python_backend_utils as pb_utils

    return pb_utils.Tensor(name, np.ascontiguousarray(array))


def string_tensor(name: str, s: str):
    return tensor(name, np.array([s.encode("utf-8")], dtype=object))


def read_waveform(request, max_seconds: float) -> tuple[np.ndarray, int]:
    """The `waveform` + `sample_rate` inputs of a dac_encoder request, checked (S2Error says what to change)."""
    from .errors import invalid

    wav = optional_input(request, "waveform")
    sr = scalar(request, "sample_rate", int, None)
    if wav is None or wav.size == 0:
        raise invalid("waveform is empty: send the samples of the reference clip", "waveform")
    if sr is None or not (8000 <= sr <= 192000):
        raise invalid(f"sample_rate must be between 8000 and 192000 Hz (got {sr})", "sample_rate")
    wav = wav.astype(np.float32).reshape(-1)
    if not np.all(np.isfinite(wav)):
        raise invalid("waveform holds NaN or infinite samples: send float PCM in [-1, 1]", "waveform")
    if wav.size / sr > max_seconds:
        raise invalid(f"waveform is {wav.size / sr:.1f} s long, over the limit of {max_seconds:g} s: trim it", "waveform")
    return wav, sr


def read_fast_rows(request, dim: int, num_semantic: int, max_rows: int) -> dict[str, np.ndarray]:
    """A fast_ar request's inputs, checked (S2Error says what to change): `hidden` [B, dim], and one value a row of
    `code0` (a semantic code, in [0, num_semantic)), `temperature`, `top_p`, `top_k`, `seed` (each in its request
    field's range, `settings.REQUEST_FIELDS`) and `step` (>= 0). A code outside the embedding table would be a
    device-side assert on a GPU, which ends the model's process for every caller."""
    from .errors import invalid
    from .settings import check_field

    hidden = optional_input(request, "hidden")
    if hidden is None or hidden.ndim != 2 or hidden.shape[1] != dim or hidden.shape[0] == 0:
        raise invalid(f"hidden must be [rows, {dim}] with at least one row, got "
                      f"{None if hidden is None else list(hidden.shape)}", "hidden")
    B = hidden.shape[0]
    if B > max_rows:
        raise invalid(f"at most {max_rows} rows per request (got {B}): raise the setting fast_ar_max_batch", "hidden")
    out = {"hidden": hidden}
    for name in ("code0", "temperature", "top_p", "top_k", "seed", "step"):
        a = optional_input(request, name)
        if a is None or a.size != B:
            raise invalid(f"{name} must hold one value a row ({B}), got {0 if a is None else a.size}", name)
        out[name] = a = a.reshape(-1)
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise invalid(f"{name} must be finite numbers", name)
    if out["code0"].min() < 0 or out["code0"].max() >= num_semantic:
        raise invalid(f"code0 must be semantic codes in [0, {num_semantic})", "code0")
    for name in ("temperature", "top_p", "top_k", "seed"):
        a = out[name]
        for v in (a.min(), a.max()):
            check_field(name, v.item())
    if out["step"].min() < 0:
        raise invalid("step must be >= 0 (the frame's index in its request)", "step")
    return out


def decode_chunk_requests(decoder, requests, now: float, name: str = "dac_decoder") -> list:
    """dac_decoder's execute over a StreamDecoder: one chunk per request (`codes` [1, frames, C], `stream_id`,
    `start`, `final`), decoded together; a bad request or a failed decode gets an error response (with its class),
    the others their audio."""
    import triton_python_backend_utils as pb_utils

    from .errors import S2Error, from_exception, internal, invalid

    jobs, results = [], {}
    for i, request in enumerate(requests):
        try:
            codes = pb_utils.get_input_tensor_by_name(request, "codes").as_numpy()
            sid = scalar(request, "stream_id", str, None)
            if not sid:
                raise invalid("stream_id is required", "stream_id")
            start = scalar(request, "start", bool, False)
            final = scalar(request, "final", bool, False)
            if codes.ndim < 2:
                raise invalid(f"codes must be [frames, num_codebooks], got {list(codes.shape)}", "codes")
            jobs.append((i, sid, codes.reshape(codes.shape[-2], codes.shape[-1]), start, final))
        except Exception as e:  # noqa: BLE001
            results[i] = from_exception(e, name)
    try:
        results.update(decoder.decode_many(jobs, now=now))
    except Exception as e:  # noqa: BLE001
        err = from_exception(e, name)
        results.update({i: err for i, *_ in jobs if i not in results})
    out = []
    sids = {i: sid for i, sid, *_ in jobs}
    for i in range(len(requests)):
        r = results.get(i)
        if isinstance(r, np.ndarray):
            out.append(pb_utils.InferenceResponse(output_tensors=[tensor("audio", r[None])]))
        else:
            err = r if isinstance(r, S2Error) else internal(f"{name}: no result for this chunk")
            logging.getLogger("s2tts").warning("%s: stream %s (request %s) failed: %s", name, sids.get(i, "?"),
                                               requests[i].request_id(), err.wire())
            out.append(s2_error_response(err))
    return out


# ---- metrics: what each model reports on Triton's /metrics endpoint (next to Triton's own) -----------------------
TIME_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0)  # seconds to first audio
DURATION_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)  # seconds per request
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # streams per codec call
CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)  # seconds per call

METRICS = {  # name -> (kind, help[, histogram buckets])
    "s2tts_requests_in_flight": ("gauge", "requests a model is serving now"),
    "s2tts_requests_finished_total": ("counter", "requests that ended, by model and outcome (ok, cancelled, "
                                      "error:<class>)"),
    "s2tts_requests_refused_total": ("counter", "requests refused at admission (busy, duplicate id, unhealthy)"),
    "s2tts_time_to_first_audio_seconds": ("histogram", "s2pro: from a request's arrival to its first audio chunk "
                                          "(requests that produced audio)", TIME_BUCKETS),
    "s2tts_request_duration_seconds": ("histogram", "s2pro: from a request's arrival to its final response "
                                       "(requests that ended ok or cancelled)", DURATION_BUCKETS),
    "s2tts_audio_seconds_total": ("counter", "s2pro: seconds of audio sent to clients"),
    "s2tts_pipeline_call_seconds": ("histogram", "s2pro: its calls out of its process, by `call`: BLS calls to the "
                                    "pipeline's models (slow_ar_first_chunk: waits for a KV slot and the first chunk; "
                                    "slow_ar_next_chunk: for the next chunk; slow_ar_<control>; dac_encoder; "
                                    "dac_decoder) and responses sent to clients (send). Sends or control calls of "
                                    "more than a few ms: s2pro waits for tritonserver's Python-backend threads "
                                    "(thread-pool-size, README)", CALL_BUCKETS),
    "s2tts_frames_total": ("counter", "s2pro: codec frames generated for clients (21.5 per second of audio)"),
    "s2tts_engine_requests_waiting": ("gauge", "slow_ar requests waiting for a KV-cache slot"),
    "s2tts_engine_slots_used": ("gauge", "slow_ar KV-cache slots in use"),
    "s2tts_engine_slots_total": ("gauge", "slow_ar KV-cache slots (max_batch)"),
    "s2tts_engine_kv_tokens": ("gauge", "slow_ar tokens held in the KV cache by live requests"),
    "s2tts_engine_kv_capacity_tokens": ("gauge", "slow_ar KV-cache capacity in tokens (kv_cache_tokens, whole blocks)"),
    "s2tts_engine_kv_blocks_used": ("gauge", "slow_ar KV-cache blocks held (live requests and cached voice prefixes)"),
    "s2tts_engine_preemptions_total": ("counter", "slow_ar requests paused because the KV cache ran out of blocks "
                                       "(each resumes where it stopped; raise kv_cache_tokens if this grows)"),
    "s2tts_engine_prefix_cache_hits_total": ("counter", "slow_ar prompts whose voice prefix was in the prefix cache"),
    "s2tts_engine_prefix_cache_misses_total": ("counter", "slow_ar prompts with a voice prefix that had to be prefilled"),
    "s2tts_engine_streams_open": ("gauge", "slow_ar streams whose reader has not taken the last chunk yet"),
    "s2tts_engine_step_seconds": ("gauge", "slow_ar's moving average of a decode step (one frame for every live "
                                  "stream); above the audio of one frame, streams fall behind real time"),
    "s2tts_session_text_relayed_total": ("counter", "s2pro: text for a session held by another s2pro instance, passed "
                                         "to it (s2pro_instances > 1)"),
    "s2tts_stream_pace": ("gauge", "s2pro's moving average of the seconds between a stream's audio chunks per second "
                          "of their audio; at 1 or more, streams play slower than real time"),
    "s2tts_codec_streams_open": ("gauge", "dac_decoder (or slow_ar, codec_in_engine) streams whose decoder state is held"),
    "s2tts_codec_batch_size": ("histogram", "dac_decoder (or slow_ar, codec_in_engine) streams decoded together in one codec "
                               "call", BATCH_BUCKETS),
    "s2tts_codec_fp32_redo_total": ("counter", "dac_decoder (or slow_ar, codec_in_engine) chunks that overflowed in fp16 and were "
                                    "decoded again in fp32"),
    "s2tts_model_healthy": ("gauge", "1 while the model serves, 0 after an unrecoverable fault"),
}


class Metrics:
    """Custom metrics through the Python backend's MetricFamily API (Triton 24.10 has gauges, counters and
    histograms); a no-op where it is missing. Observations for histograms are buffered (`observe`, from any
    thread) and sent by `flush`, from the model's reporting thread: a request never waits on the metrics IPC."""

    def __init__(self, model: str, families_of: "Metrics | None" = None, labels: dict | None = None):
        """`families_of`: another `Metrics` of this process whose families these series join (a family is made once
        per process: s2pro holding the engine reports it under the engine's model name). `labels`: on every series
        besides `model` (several instances of one model: `instance`, or their gauges would overwrite each other's)."""
        self.model = model
        self.labels = {"model": model, **(labels or {})}
        self._families: dict = {}
        self._metrics: dict = {}
        self._last: dict = {}
        self._pending: list = []  # (name, value, labels) waiting for flush
        self._lock = threading.Lock()
        if families_of is not None:
            self._families = families_of._families
            return
        try:
            import os

            import triton_python_backend_utils as pb_utils

            if os.environ.get("S2TTS_METRICS", "1") == "0":
                raise RuntimeError("metrics off")
            kinds = {"gauge": pb_utils.MetricFamily.GAUGE, "counter": pb_utils.MetricFamily.COUNTER,
                     "histogram": getattr(pb_utils.MetricFamily, "HISTOGRAM", None)}
            for name, (kind, help_, *_buckets) in METRICS.items():
                if kinds[kind] is not None:
                    self._families[name] = pb_utils.MetricFamily(name=name, description=help_, kind=kinds[kind])
        except Exception:  # noqa: BLE001 - an older backend, or no Triton at all
            self._families = {}

    def _metric(self, name: str, labels: dict):
        key = (name, tuple(sorted(labels.items())))
        m = self._metrics.get(key)
        if m is None and name in self._families:
            spec = METRICS[name]
            kw = {"buckets": [float(b) for b in spec[2]]} if spec[0] == "histogram" else {}
            m = self._metrics[key] = self._families[name].Metric(labels={**self.labels, **labels}, **kw)
        return m

    def declare(self, *names: str) -> None:
        """Make these metrics' series now (a histogram at zero): Prometheus's rate() needs a series to exist before
        its first event, or a dashboard shows nothing until the second."""
        for name in names:
            self._metric(name, {})

    def observe(self, name: str, value: float, **labels) -> None:
        """A histogram observation, sent at the next `flush`."""
        if name in self._families:
            with self._lock:
                self._pending.append((name, float(value), labels))

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for name, value, labels in pending:
            m = self._metric(name, labels)
            try:
                m.observe(value)
            except Exception:  # noqa: BLE001
                pass

    def set(self, name: str, value: float, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        if self._last.get(key) == value:
            return
        m = self._metric(name, labels)
        if m is not None:
            try:
                m.set(float(value))
                self._last[key] = value
            except Exception:  # noqa: BLE001
                pass

    def report_engine(self, service, streams_open: int | None = None) -> None:
        """An `engine.service.EngineService`'s numbers: its requests, the engine's slots, KV cache, preemptions and
        prefix cache, its step time, and its codec's when it decodes in the engine's loop."""
        engine = service.engine
        counts = engine.counts()
        self.report_table(service.table)
        if streams_open is not None:
            self.set("s2tts_engine_streams_open", streams_open)
        self.set("s2tts_engine_requests_waiting", counts["waiting"])
        self.set("s2tts_engine_slots_used", counts["live"])
        self.set("s2tts_engine_slots_total", engine.max_batch)
        self.set("s2tts_engine_kv_tokens", counts["kv_tokens"])
        self.set("s2tts_engine_kv_capacity_tokens", engine.kv_capacity_tokens)
        self.set("s2tts_engine_kv_blocks_used", counts["kv_blocks_used"])
        self.count_to("s2tts_engine_preemptions_total", counts["preemptions"])
        self.count_to("s2tts_engine_prefix_cache_hits_total", engine.prefix_cache.hits)
        self.count_to("s2tts_engine_prefix_cache_misses_total", engine.prefix_cache.misses)
        if service.step_s is not None:
            self.set("s2tts_engine_step_seconds", round(service.step_s, 4))
        if service.codec is not None:  # codec_in_engine: the codec's metrics, under the engine's model name
            self.report_codec(service.codec)
            self.flush()

    def report_codec(self, decoder) -> None:
        """A `codec.stream.StreamDecoder`'s numbers: streams open, chunks redone in fp32, and the batch size of every
        codec call since the last report (sent at the next `flush`)."""
        self.set("s2tts_codec_streams_open", len(decoder.states))
        self.count_to("s2tts_codec_fp32_redo_total", decoder.redone)
        n = len(decoder.batches)  # the engine thread appends meanwhile: take the first n, leave what comes after
        batches = decoder.batches[:n]
        del decoder.batches[:n]
        for b in batches:
            self.observe("s2tts_codec_batch_size", b)

    def count_to(self, name: str, total: float, **labels) -> None:
        """Bring a counter up to `total` (the models keep their own totals)."""
        key = (name, tuple(sorted(labels.items())))
        done = self._last.get(key, 0)
        m = self._metric(name, labels)
        if m is not None and total > done:
            try:
                m.increment(float(total - done))
                self._last[key] = total
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        """Release the metric objects while the Python backend's stub still exists (call from `finalize`): the
        ones left for the interpreter's last garbage collection crash the stub at unload (a segmentation
        fault in every model process that had metrics, at every shutdown). Without metric objects (metrics off, or
        a backend without the API) there is nothing to collect, and a full collection costs ~0.1 s."""
        held = bool(self._metrics or self._families)
        self._metrics.clear()
        self._families.clear()
        if held:
            import gc

            gc.collect()

    def report_table(self, table) -> None:
        """The counts of a lifecycle.RequestTable."""
        st = table.stats()
        self.set("s2tts_requests_in_flight", st["in_flight"])
        self.set("s2tts_model_healthy", 1 if st["healthy"] else 0)
        self.count_to("s2tts_requests_refused_total", st["refused"])
        for outcome, n in table.outcomes().items():
            self.count_to("s2tts_requests_finished_total", n, outcome=outcome)
