"""What each model reports on Triton's /metrics endpoint beside Triton's own: the metric families and their
buckets, and `Metrics`, which registers and updates them."""

from __future__ import annotations

import gc
import os
import threading

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
    "s2tts_engine_frames_per_step": ("gauge", "slow_ar: frames a decoding step made (how many slots decoded), the mean "
                                     "of its last loop window"),
    "s2tts_engine_loop_rest_seconds": ("gauge", "slow_ar: routing and decoding audio after each step, the mean of its "
                                       "last loop window"),
    "s2tts_engine_under_load_ratio": ("gauge", "slow_ar: share of the steps of its last loop window taken under load "
                                      "(first chunks grow, codec calls held)"),
    "s2tts_engine_final_tail_seconds": ("gauge", "slow_ar: from a request's last frame to its final response handed "
                                        "out, the median of its last loop window"),
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
        if service.load.step_s is not None:
            self.set("s2tts_engine_step_seconds", round(service.load.step_s, 4))
        window = service.loop.last
        if window is not None:
            self.set("s2tts_engine_frames_per_step", round(window.frames_per_step, 2))
            self.set("s2tts_engine_loop_rest_seconds", round(window.rest_ms / 1e3, 5))
            self.set("s2tts_engine_under_load_ratio", round(window.under_load, 3))
            if window.final_tail_ms is not None:
                self.set("s2tts_engine_final_tail_seconds", round(window.final_tail_ms / 1e3, 5))
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
            gc.collect()

    def report_table(self, table) -> None:
        """The counts of a lifecycle.RequestTable."""
        st = table.stats()
        self.set("s2tts_requests_in_flight", st["in_flight"])
        self.set("s2tts_model_healthy", 1 if st["healthy"] else 0)
        self.count_to("s2tts_requests_refused_total", st["refused"])
        for outcome, n in table.outcomes().items():
            self.count_to("s2tts_requests_finished_total", n, outcome=outcome)
