"""One schema for every setting and every request field: type, default, range, where it applies, doc.

Everything else reads from here:
- repository rendering (`resolve`: types, ranges, defaults and the rules that span models),
- the models' adapters (`model_values`: each model's own keys from its config.pbtxt, defaults from here),
- the settings table of docs/SETTINGS.md (`markdown_table`, checked by a test),
- the gateway's limits (it reads the served values from s2pro's config, with these as fallback),
- request validation in the models and the gateway (`REQUEST_FIELDS`, `check_field`), and the request inputs of
  s2pro's and slow_ar's config.pbtxt (`pbtxt_inputs`: `python -m s2tts.repository --write-pbtxt` rewrites them,
  a test checks them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import S2Error, invalid
from .layout import Layout

MODELS = ("s2pro", "slow_ar", "fast_ar", "dac_encoder", "dac_decoder")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(text: str) -> bool | None:
    """The one reader of a boolean word (true/false, yes/no, on/off, 1/0, any case); None when `text` is none."""
    low = text.strip().lower()
    return True if low in _TRUE else False if low in _FALSE else None


@dataclass(frozen=True)
class Setting:
    key: str
    type: type  # int, float, bool or str
    default: Any  # None: unset (auto / required / derived)
    models: tuple[str, ...]  # the models whose config.pbtxt declares it; () = tritonserver itself or rendering
    doc: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    required: bool = False
    derived_from: str | None = None  # unset: takes this other setting's value
    auto: bool = False  # unset means "decide at run time" (shown as `auto`)

    def parse(self, raw: Any) -> Any:
        """A raw value (a string from --set or config.pbtxt, or a Python value) -> typed and checked."""
        if isinstance(raw, str):
            text = raw.strip()
            if self.auto and text.lower() == "auto":
                return None
            if self.type is bool:
                value = parse_bool(text)
                if value is None:
                    raise invalid(f"setting {self.key}={raw!r}: use true or false", self.key)
            elif self.type is str:
                value = text
            else:
                try:
                    value = self.type(text)
                except ValueError:
                    raise invalid(f"setting {self.key}={raw!r} is not a valid {self.type.__name__}", self.key) from None
        else:
            value = raw
        if value is None:
            return None
        if self.choices is not None and value not in self.choices:
            raise invalid(f"setting {self.key}={value!r}: use one of {', '.join(self.choices)}", self.key)
        if self.min is not None and value < self.min:
            raise invalid(f"setting {self.key}={value} is below its minimum {self.min:g}", self.key)
        if self.max is not None and value > self.max:
            raise invalid(f"setting {self.key}={value} is above its maximum {self.max:g}", self.key)
        return value

    def format(self, value: Any) -> str:
        if value is None:
            return "auto" if self.auto else ""
        if isinstance(value, bool):
            return "true" if value else "false"
        return f"{value:g}" if isinstance(value, float) else str(value)

    def default_text(self) -> str:
        if self.required:
            return "(required)"
        if self.derived_from:
            return f"= `{self.derived_from}`"
        if self.default is None:
            return "`auto`" if self.auto else "(unset)"
        return f"`{self.format(self.default)}`"


_ALL = ("slow_ar", "fast_ar", "dac_encoder", "dac_decoder", "s2pro")
SETTINGS: tuple[Setting, ...] = (
    Setting("checkpoint", str, None, _ALL, "S2 Pro checkpoint directory (official layout)", required=True),
    Setting("backend", str, "python", (), "`python`, `tensorrt` (NGC container, engines built) or `onnxruntime`: "
            "what runs the fast AR and the codec (docs/TENSORRT.md)", choices=("python", "tensorrt", "onnxruntime")),
    Setting("engine_dir", str, None, (), "exported graphs / TensorRT engines for backend=tensorrt or onnxruntime "
            "(default CHECKPOINT/engines)"),
    Setting("address", str, "127.0.0.1", (), "the address tritonserver's HTTP, gRPC and metrics ports listen on when "
            "this project starts it; `0.0.0.0` exposes them (they have no authentication: the gateway's API key does "
            "not cover them)"),
    Setting("device", str, "auto", ("slow_ar", "fast_ar", "s2pro"), "`cpu`, `cuda`, `cuda:N`, `auto` (CUDA when "
            "present): the one CPU/GPU switch. A comma-separated list runs one engine per entry (`cuda:0,cuda:1`: "
            "`slow_ar` and `slow_ar_1`); s2pro spreads requests over them (README: Several GPUs)"),
    Setting("codec_device", str, None, ("dac_encoder", "dac_decoder", "s2pro", "slow_ar"), "where the codec runs, e.g. `cuda:1`; "
            "a list gives one decoder per entry, engine i using decoder i mod their number (default: each engine's "
            "codec beside it)", derived_from="device"),
    Setting("dtype", str, "bf16", ("slow_ar", "fast_ar", "s2pro"), "AR weights/activations", choices=("bf16", "fp16", "fp32")),
    Setting("ar_weights", str, "dtype", ("slow_ar", "s2pro"), "`dtype`: the AR's matrices in `dtype`; `fp8`: slow_ar's "
            "layers' matrices (both ARs; embeddings, norms and heads stay, and the `fast_ar` model of fast_ar=bls keeps "
            "`dtype`) in FP8 e4m3 with a scale per output row: half the weight bytes a step of up to 16 streams reads, "
            "so shorter steps there; a pass of more rows multiplies by the same weights widened to `dtype` (a copy "
            "kept beside them on a GPU: 1.5 times `dtype`'s weight memory), as fast as `dtype` (a setting for "
            "latency, perf/STATUS.md). Check its effect on speech with the real checkpoint first (perf/fp8_effect.py)",
            choices=("dtype", "fp8")),
    Setting("codec_dtype", str, "auto", ("dac_encoder", "dac_decoder", "slow_ar", "s2pro"), "codec precision; `auto`: fp16 "
            "for the decoder on a GPU (a chunk whose audio or state is not finite is decoded again in fp32 and its "
            "stream stays fp32), fp32 for the encoder and on a CPU. `fp32` is the exact one; `bf16` is no faster than "
            "fp16 and far less accurate (perf/STATUS.md)", choices=("auto", "fp32", "fp16", "bf16")),
    Setting("codec_tf32", bool, True, ("dac_encoder", "dac_decoder", "slow_ar", "s2pro"), "let cuDNN use TF32 for the "
            "fp32 codec on GPUs: faster, the audio no longer exact"),
    Setting("max_batch", int, 8, ("slow_ar", "s2pro"), "live requests decoded together (KV-cache slots); on a GPU, "
            "unless set, the most of 16, 32, 64 and 128 that the GPU's memory holds (`s2tts/sizing.py`; the "
            "launcher's first line says what it chose)", min=1, max=1024),
    Setting("max_seq_len", int, 4096, ("slow_ar", "s2pro"), "tokens per request (prompt + frames); a request holds KV "
            "memory only for the tokens it has (`kv_cache_tokens`)", min=64, max=32768),
    Setting("kv_cache_tokens", int, None, ("slow_ar", "s2pro"), "the KV cache's size in tokens, shared by all requests in "
            "blocks (147 KB a token on the full-size model); a request holds the blocks of the tokens it has. When "
            "running requests outgrow it the one admitted last pauses and resumes where it stopped (unset: "
            "max_batch x 2048, at least max_seq_len)", min=64),
    Setting("kv_cache_memory_gb", float, None, ("slow_ar", "s2pro"), "the KV cache's size in GiB instead of tokens: the "
            "tokens it holds follow from the checkpoint's layers, heads and dtype (the full-size model in bf16: "
            "147 KB a token, 7,300 tokens a GiB); not with kv_cache_tokens", min=0.0001, max=4096.0),
    Setting("gpu_memory_utilization", float, None, ("slow_ar", "s2pro"), "the share of its GPU's memory an engine's "
            "process may take, as vLLM's: its weights, its codec (with codec_in_engine), room for its CUDA graphs, and "
            "a KV cache of what is left (slow_ar's log says how it split); on a GPU that other models share, leave "
            "them theirs. On a GPU, when no setting sizes the KV cache, 0.9; on a CPU the KV cache takes its "
            "default. Not with kv_cache_tokens or kv_cache_memory_gb",
            min=0.01, max=1.0),
    Setting("kv_block_tokens", int, 32, ("slow_ar", "s2pro"), "tokens per KV-cache block; 0 = one block of max_seq_len per "
            "request (the unpaged slot layout)", min=0, max=32768),
    Setting("max_queued_requests", int, 64, ("slow_ar", "s2pro"), "requests waiting for a KV slot; more are refused at once "
            "with `unavailable`; on a GPU, unless set, an engine's share of `max_concurrent_requests` beyond its "
            "`max_batch`", min=0, max=100000),
    Setting("fast_ar", str, "inprocess", ("slow_ar", "fast_ar"), "`inprocess`, or `bls` (slow_ar calls the `fast_ar` "
            "model per frame; otherwise that model serves direct callers only and loads its weights on their first "
            "request)",
            choices=("inprocess", "bls")),
    Setting("fast_ar_max_batch", int, None, ("fast_ar",), "rows the `fast_ar` model takes per request; must be at "
            "least `max_batch` when fast_ar=bls", min=1, max=1024, derived_from="max_batch"),
    Setting("prefix_cache_mb", int, 512, ("slow_ar", "s2pro"), "KV cache of voice prefixes (system turn + reference codes), "
            "reused by later requests of that voice; 0 = off", min=0),
    Setting("max_prefill_tokens", int, 512, ("slow_ar", "s2pro"), "prompt tokens an engine step adds to the running "
            "streams' pass over the weights (chunked prefill: a longer prompt takes several steps); bounds how much "
            "arrivals lengthen a step, and sets the largest captured pass (`max_batch` + this many rows)", min=16,
            max=8192),
    Setting("admit_every_steps", int, 1, ("slow_ar", "s2pro"), "while streams are decoding, new requests join the batch only "
            "every this many steps, so that their prefills run together (one pass over the weights for several "
            "prompts); each waits at most that many steps more for its first audio", min=1, max=64),
    Setting("adaptive_chunks", bool, True, ("slow_ar", "s2pro"), "later chunks grow from `first_chunk_frames` to "
            "`chunk_frames` only as fast as playback allows at the measured pace (the slower of slow_ar's step and the "
            "whole pipeline's, reported by s2pro), and under load the first chunk grows to the next chunk length that "
            "covers the second's making, so a stream played from its first chunk does not run dry; false: the first "
            "chunk is `first_chunk_frames` and every later one `chunk_frames`"),
    Setting("load_chunk_frames", int, 8, ("slow_ar", "s2pro"), "with `adaptive_chunks`, under load (from a measured pace of "
            "0.35 s of work a second of audio until its one-second average falls below 0.28; with codec_in_engine also "
            "while requests fill three quarters of `max_batch`, or number 48) a stream's first chunk is at least this many frames "
            "(rounded up to a chunk length), so that more audio is in hand while the next is made: fewer streams run "
            "dry under load, their first audio later; 0: off", min=0, max=4096),
    Setting("stream_idle_timeout_s", float, 60.0, ("slow_ar",), "a stream whose reader (s2pro) takes none of its "
            "responses for this long is cancelled and dropped", min=1),
    Setting("batch_invariant", bool, False, ("slow_ar", "s2pro"), "a seeded request gives the same codes alone and beside "
            "any others: on a GPU every matrix product goes through a row-invariant kernel (no cost at one stream, "
            "longer steps at many); on a CPU steps run at one padded shape"),
    Setting("codec_in_engine", bool, None, ("slow_ar", "dac_decoder", "s2pro"), "decode audio in slow_ar's own loop: after "
            "each step the chunks all streams finished go through the codec in batched calls and leave with their "
            "codes, with no `dac_decoder` call per chunk (dac_decoder then serves direct callers only and loads its "
            "codec on the first). `auto`: on when every engine runs on a GPU with its codec on that device; off on a "
            "CPU (separate processes use more cores), with `codec_device` elsewhere, and with "
            "backend=tensorrt/onnxruntime (their codec is the `dac_decoder` model)", auto=True),
    Setting("codec_batch_steps", int, 8, ("slow_ar", "s2pro"), "with codec_in_engine, under load (the pace of "
            "`load_chunk_frames`) the codec decodes every stream's new frames together once every this many engine "
            "steps, in slices of this many frames: one codec call of one length for all streams, a chunk leaving once "
            "its frames are decoded (up to about twice this many steps later); best equal to `load_chunk_frames`. "
            "More: fewer, larger codec calls and later audio. At a lighter load, and with 1, each chunk is decoded as "
            "soon as it is complete", min=1, max=64),
    Setting("codec_final_steps", int, 0, ("slow_ar", "s2pro"), "with codec_in_engine, while calls are held "
            "(`codec_batch_steps`): a finished request's last frames wait at most this many engine steps for the next "
            "held call, then go in a call of the finished requests alone (its client's next request waits for that "
            "audio, and its slot for that request); 0: in the step its request ends; `codec_batch_steps` or more: "
            "always the held call (fewer, larger codec calls, slots left idle meanwhile)", min=0, max=64),
    Setting("codec_first_steps", int, 8, ("slow_ar", "s2pro"), "with codec_in_engine, while calls are held "
            "(`codec_batch_steps`): a stream's first chunk waits at most this many engine steps for the next held "
            "call, then goes in a call between them (with the finished requests' last frames, if any), and its "
            "second chunk once complete; 0: in the step it is complete: first audio sooner under load, at the cost "
            "of more, smaller codec calls and less throughput; `codec_batch_steps` or more (the default): always "
            "the held call", min=0, max=64),
    Setting("cuda_graphs", bool, None, ("slow_ar", "s2pro"), "CUDA graphs for the decode step; on by default on a GPU",
            auto=True),
    Setting("launch_ahead", bool, None, ("slow_ar", "s2pro"), "the engine keeps two steps in flight: it launches the "
            "next step before it finishes the last one and routes its frames, so that the device does not wait for the "
            "host's work (a row of a request that ended meanwhile is dropped; with codec_in_engine the next step is "
            "also launched behind a held codec call, and at a light load only once every request in flight has sent "
            "audio). `auto`: on a GPU; off on a CPU (there a step runs as it is launched)", auto=True),
    Setting("codec_concurrent", bool, None, ("slow_ar", "s2pro"), "with codec_in_engine, the codec's calls are made "
            "by a thread of their own on a CUDA stream of their own, beside the engine's steps, whose stream has the "
            "higher priority: a call's kernels fill what a step leaves of the GPU instead of waiting behind it (the "
            "two share the GPU: the gain is those gaps). `auto`: on a GPU; off on a CPU", auto=True),
    Setting("dependent_launch", bool, None, ("slow_ar", "s2pro"), "the decode step's Triton kernels start while the "
            "kernel before each ends (programmatic dependent launch; the small matrix products read their first "
            "weights meanwhile), in passes of up to 2 rows (one or two streams): a shorter step at one stream. `auto`: "
            "on a GPU of compute capability 9.0 or newer whose Triton supports it; off elsewhere", auto=True),
    Setting("engine_in_s2pro", bool, False, ("s2pro",), "run the engine (and, with `codec_in_engine`, its codec) in "
            "s2pro's own process: a chunk crosses processes twice between the engine and the client instead of six "
            "times and no `slow_ar` model is loaded; one engine (one `device`) with fast_ar=inprocess; an engine fault "
            "unloads s2pro instead of s2pro reloading slow_ar. Off by default: s2pro's per-request Python then shares "
            "one interpreter lock with the engine thread, which under load costs more than the crossings save "
            "(perf/STATUS.md)"),
    Setting("pull_groups", bool, True, ("s2pro",), "s2pro takes the later chunks of all its requests from slow_ar in "
            "one call (each answer holds every chunk ready) instead of one call a chunk: slow_ar then sends one response "
            "a pass, not one a chunk, which under load its engine thread's Python would hold up"),
    Setting("max_concurrent_requests", int, 64, ("s2pro",), "requests s2pro serves at once (all its instances "
            "together); more are refused at once with `unavailable` (gateway: 503 + Retry-After); on a GPU, unless set, twice "
            "`max_batch` for each engine", min=1, max=100000),
    Setting("s2pro_instances", int, None, ("s2pro",), "s2pro processes (Triton instances of the model; each request "
            "goes to one): unset: one per engine `device` lists (1 with `engine_in_s2pro`). Every chunk crosses s2pro, "
            "whose Python shares one interpreter lock, so with several engines a process each keeps their chunks "
            "from waiting for it. The instances share `max_concurrent_requests` and the text sessions (text for a "
            "session another instance holds is relayed to it over a Unix socket)", min=1, max=64),
    Setting("first_chunk_frames", int, 1, ("s2pro", "dac_decoder", "slow_ar"), "default frames in the first audio chunk "
            "(1 frame = 2048 samples = 46 ms): fewer make the first audio sooner, in more and smaller chunks (under "
            "load first chunks grow to `load_chunk_frames` whatever this is)", min=1),
    Setting("chunk_frames", int, 16, ("s2pro", "dac_decoder", "slow_ar"), "default frames in later chunks (the largest, "
            "with `adaptive_chunks`); unset: 16 for each engine `device` lists (at most `max_chunk_frames`): s2pro "
            "relays every engine's chunks at a fixed cost a response, so with more engines its chunks grow", min=1),
    Setting("max_chunk_frames", int, 256, ("s2pro",), "the largest chunk a request may ask for", min=1, max=4096),
    Setting("max_text_chars", int, 100000, ("s2pro",), "longest text accepted (characters); a long text is spoken "
            "segment after segment (`chunk_length`)", min=1, max=10000000),
    Setting("chunk_length", int, 200, ("s2pro",), "default UTF-8 bytes of text per segment: a longer text (or a "
            "dialogue) is spoken segment after segment, each with the earlier ones in context, in one audio stream "
            "(upstream's API: 200)", min=16, max=100000),
    Setting("max_reference_seconds", float, 30.0, ("s2pro", "dac_encoder"), "longest reference clip accepted",
            min=0.5, max=600),
    Setting("min_reference_seconds", float, 0.2, ("s2pro",), "shortest reference clip accepted (5-15 s of clean "
            "speech clone a voice best)", min=0.01, max=60),
    Setting("default_max_new_tokens", int, 1024, ("s2pro",), "frames generated at most when a request does not say "
            "(unset: at most `max_new_tokens_limit`)", min=1),
    Setting("max_new_tokens_limit", int, 2048, ("s2pro",), "the most frames a request may ask for (unset: at most "
            "half of `max_seq_len`)", min=1),
    Setting("request_timeout_s", float, 600.0, ("s2pro",), "a request, or each text segment of a long one, still "
            "running after this long ends with `deadline_exceeded` and its generation is cancelled", min=1),
    Setting("session_idle_timeout_s", float, 30.0, ("s2pro",), "a text session (`session_id`) that has received no "
            "text for this long, with everything it had spoken, ends (its final response: finish reason `end`)",
            min=0.1),
    Setting("stall_timeout_s", float, 20.0, ("s2pro",), "silence from slow_ar or the codec after which s2pro checks "
            "that they are alive (a dead model fails its requests with `unavailable`)", min=0.5),
    Setting("auto_recover", bool, True, ("s2pro",), "reload a model of the pipeline whose process died or that "
            "reported an unrecoverable fault (needs --model-control-mode=explicit, which this project's launcher "
            "uses)"),
    Setting("codec_max_streams", int, 256, ("dac_decoder", "slow_ar", "s2pro"), "decoder states held in one pool on the codec's "
            "device (4.4 MB a stream in fp16); on a GPU each batch of the default chunk lengths runs as a CUDA graph, "
            "captured at start. Streams beyond it run eagerly on their own state; 0 = no pool (slow_ar with "
            "codec_in_engine: at most 2 x max_batch)", min=0, max=4096),
    Setting("codec_queue_delay_us", int, 3000, ("dac_decoder",), "how long dac_decoder's batcher waits for chunks of "
            "other streams to decode them together (microseconds): longer makes bigger batches under load",
            min=0, max=1000000),
    Setting("codec_idle_timeout_s", float, 600.0, ("dac_decoder", "slow_ar", "s2pro"), "decoder state of a stream that sends no chunk "
            "for this long is dropped", min=1),
)
SCHEMA: dict[str, Setting] = {s.key: s for s in SETTINGS}


def _unknown(keys) -> S2Error:
    return invalid(f"unknown setting(s) {sorted(keys)}: the settings are {', '.join(sorted(SCHEMA))} "
                   "(docs/SETTINGS.md)", sorted(keys)[0])


def resolve(given: dict[str, Any]) -> dict[str, Any]:
    """Every setting's value: the given ones parsed and checked, the rest from their defaults (derived ones
    from their source). Raises S2Error naming what to change; checks the rules that span models."""
    unknown = set(given) - set(SCHEMA)
    if unknown:
        raise _unknown(unknown)
    out: dict[str, Any] = {}
    for s in SETTINGS:
        raw = given.get(s.key)
        out[s.key] = s.parse(raw) if raw is not None and raw != "" else None
    for s in SETTINGS:
        if out[s.key] is None:
            if s.derived_from:
                out[s.key] = out[s.derived_from] if out[s.derived_from] is not None else SCHEMA[s.derived_from].default
            elif s.default is not None:
                out[s.key] = s.default
    if out["checkpoint"] is None:
        raise invalid("setting checkpoint is required: an S2 Pro checkpoint directory", "checkpoint")
    # defaults that follow a smaller KV cache: half of max_seq_len for the frames, the rest for the prompt
    if given.get("max_new_tokens_limit") in (None, ""):
        out["max_new_tokens_limit"] = min(out["max_new_tokens_limit"], out["max_seq_len"] // 2)
    if given.get("default_max_new_tokens") in (None, ""):
        out["default_max_new_tokens"] = min(out["default_max_new_tokens"], out["max_new_tokens_limit"])
    sizes = [k for k in KV_SIZES if out[k] is not None]
    if len(sizes) > 1:
        together = "both" if len(sizes) == 2 else "all"
        raise invalid(" and ".join(f"{k}={out[k]}" for k in sizes) + f" {together} size the KV cache: set one of them",
                      sizes[-1])
    if not sizes:
        out["kv_cache_tokens"] = default_kv_tokens(out)

    layout = Layout.from_values(out)  # raises on a bad device list
    if given.get("chunk_frames") in (None, ""):  # later chunks: the default's frames for each engine s2pro relays for
        out["chunk_frames"] = min(out["max_chunk_frames"], out["chunk_frames"] * layout.replicas)
    if out["s2pro_instances"] is None:  # one s2pro process for each engine's chunks
        out["s2pro_instances"] = 1 if out["engine_in_s2pro"] else layout.replicas
    check_rules(out)
    if out["codec_in_engine"] is None:  # decided here, so that slow_ar and dac_decoder agree
        out["codec_in_engine"] = layout.codec_beside_engines()
    return out


KV_SIZES = ("kv_cache_tokens", "kv_cache_memory_gb", "gpu_memory_utilization")  # at most one sizes the KV cache
STREAM_KV_TOKENS = 2048  # KV-cache tokens a stream is counted at when sizing (a 10 s voice prompt, ~60 s of speech)


def default_kv_tokens(v) -> int:
    """The KV cache's size when no setting sizes it: `max_batch` x `STREAM_KV_TOKENS` tokens, at least one
    request of `max_seq_len` (`v`: settings as a dict or as `model_values`)."""
    get = v.get if isinstance(v, dict) else lambda k: getattr(v, k)
    return max(get("max_seq_len"), get("max_batch") * STREAM_KV_TOKENS)


def check_rules(v: dict[str, Any]) -> None:
    """Rules between settings (of one model or of several)."""
    def need(ok: bool, msg: str, key: str):
        if not ok:
            raise invalid(msg, key)

    need(v["fast_ar"] != "bls" or v["fast_ar_max_batch"] >= v["max_batch"],
         f"fast_ar_max_batch={v['fast_ar_max_batch']} is below max_batch={v['max_batch']}: with fast_ar=bls slow_ar "
         f"sends up to max_batch rows per call; raise fast_ar_max_batch or leave it unset", "fast_ar_max_batch")

    layout = Layout.from_values(v)  # raises on a bad device list
    need(v["fast_ar"] != "bls" or layout.replicas == 1,
         f"fast_ar=bls runs one fast_ar model, but device={v['device']} asks for {layout.replicas} engines: use "
         "fast_ar=inprocess (the default) with several devices", "fast_ar")
    need(not v["engine_in_s2pro"] or (layout.replicas == 1 and v["fast_ar"] == "inprocess"),
         f"engine_in_s2pro=true holds one engine in s2pro's process with its fast AR: it needs one device (device="
         f"{v['device']}) and fast_ar=inprocess (fast_ar={v['fast_ar']}); leave engine_in_s2pro unset or false",
         "engine_in_s2pro")
    need(not v["engine_in_s2pro"] or v["s2pro_instances"] in (None, 1),
         f"engine_in_s2pro=true holds the engine in s2pro's process: one instance of it (s2pro_instances="
         f"{v['s2pro_instances']}); leave s2pro_instances unset or 1", "s2pro_instances")
    need(v["first_chunk_frames"] <= v["max_chunk_frames"] and v["chunk_frames"] <= v["max_chunk_frames"],
         f"first_chunk_frames={v['first_chunk_frames']} and chunk_frames={v['chunk_frames']} must be at most "
         f"max_chunk_frames={v['max_chunk_frames']}", "chunk_frames")
    need(v["default_max_new_tokens"] <= v["max_new_tokens_limit"],
         f"default_max_new_tokens={v['default_max_new_tokens']} is above max_new_tokens_limit="
         f"{v['max_new_tokens_limit']}", "default_max_new_tokens")
    need(v["kv_cache_tokens"] is None or v["kv_cache_tokens"] >= v["max_seq_len"],
         f"kv_cache_tokens={v['kv_cache_tokens']} cannot hold one request of max_seq_len={v['max_seq_len']} tokens: "
         "raise kv_cache_tokens or lower max_seq_len", "kv_cache_tokens")
    need(v["max_new_tokens_limit"] < v["max_seq_len"],
         f"max_new_tokens_limit={v['max_new_tokens_limit']} must be below max_seq_len={v['max_seq_len']} (the prompt "
         "shares the sequence): raise max_seq_len or lower max_new_tokens_limit", "max_new_tokens_limit")


def render_values(given: dict[str, Any]) -> dict[str, str]:
    """`resolve` as the strings that fill the `${key}` placeholders of config.pbtxt ("" for unset)."""
    v = resolve(given)
    return {k: SCHEMA[k].format(x) for k, x in v.items()}


class Values(dict):
    """A model's settings: `values.max_batch` or `values["max_batch"]`."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def model_values(model_config: dict | str, model: str) -> Values:
    """The settings of `model` from its parsed config (the `parameters` of config.pbtxt), defaults from the
    schema. A value left as a `${...}` placeholder or empty counts as unset. Bad values raise S2Error."""
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    params = model_config.get("parameters", {}) or {}
    out = Values()
    for s in SETTINGS:
        if model not in s.models:
            continue
        raw = (params.get(s.key) or {}).get("string_value")
        if raw is not None and (raw.startswith("${") or raw.strip() == ""):
            raw = None
        value = s.parse(raw) if raw is not None else None
        if value is None and not s.auto:
            if s.derived_from:
                src = SCHEMA[s.derived_from]
                sraw = (params.get(src.key) or {}).get("string_value")
                value = src.parse(sraw) if sraw and not sraw.startswith("${") else src.default
            else:
                value = s.default
        if value is None and s.required:
            raise invalid(f"{model}: set the `{s.key}` parameter in config.pbtxt ({s.doc})", s.key)
        out[s.key] = value
    return out


def model_keys(model: str) -> set[str]:
    return {s.key for s in SETTINGS if model in s.models}


def markdown_table() -> str:
    rows = ["| key | models | default | range | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        where = ", ".join(s.models) if s.models else "(server launch)"
        if set(s.models) == set(_ALL):
            where = "all"
        if s.choices:
            rng = " / ".join(f"`{c}`" for c in s.choices)
        elif s.min is not None or s.max is not None:
            lo = "" if s.min is None else f"{s.min:g}"
            hi = "" if s.max is None else f"{s.max:g}"
            rng = f"{lo} .. {hi}".strip()
        else:
            rng = ""
        rows.append(f"| `{s.key}` | {where} | {s.default_text()} | {rng} | {s.doc} |")
    return "\n".join(rows)


# ---- request fields (the s2pro inputs; the gateway's names in `http`) -------------------------------------------
ENGINE_STAGES = ("s2pro", "slow_ar")  # fields s2pro passes on to the engine
@dataclass(frozen=True)
class Field:
    name: str  # the s2pro input
    http: str  # the field of POST /v1/audio/speech that carries it
    type: type
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    default: Any = None
    max_setting: str | None = None  # the upper bound is this setting's value
    doc: str = ""
    triton: str = ""  # its Triton data type (config.pbtxt)
    dims: str = "[ 1 ]"
    stages: tuple[str, ...] = ("s2pro",)  # the models that take it as an input
    required: bool = False
    default_setting: str | None = None  # the default is this setting's value (else `default`)


REQUEST_FIELDS: dict[str, Field] = {f.name: f for f in (
    Field("text", "input", str, doc="the text to speak", triton="TYPE_STRING", required=True),
    Field("reference_audio", "ref_audio", bytes, doc="reference clip (voice cloning)", triton="TYPE_FP32",
          dims="[ -1 ]"),
    Field("reference_sample_rate", "ref_audio", int, 8000, 192000, doc="its sample rate", triton="TYPE_INT32"),
    Field("reference_text", "ref_text", str, doc="transcript of the reference", triton="TYPE_STRING"),
    Field("reference_codes", "voice", bytes, doc="codes of a registered voice", triton="TYPE_INT32", dims="[ -1, -1 ]"),
    Field("seed", "seed", int, 0, 2**63 - 1, doc="random seed; unset: random (reported in the stats)",
          triton="TYPE_INT64", stages=ENGINE_STAGES),
    Field("temperature", "temperature", float, 0.0, 2.0, default=0.8, doc="0 = greedy", triton="TYPE_FP32",
          stages=ENGINE_STAGES),
    Field("top_p", "top_p", float, 0.0, 1.0, min_open=True, default=0.8, triton="TYPE_FP32", stages=ENGINE_STAGES),
    Field("top_k", "top_k", int, 0, 4096, default=30, doc="0 = greedy (upstream's meaning); 4096 = no top-k",
          triton="TYPE_INT32", stages=ENGINE_STAGES),
    Field("max_new_tokens", "max_new_tokens", int, 1, None, max_setting="max_new_tokens_limit",
          doc="frames to generate at most", triton="TYPE_INT32", stages=ENGINE_STAGES,
          default_setting="default_max_new_tokens"),
    Field("first_chunk_frames", "first_chunk_frames", int, 1, None, max_setting="max_chunk_frames",
          triton="TYPE_INT32", stages=ENGINE_STAGES, default_setting="first_chunk_frames"),
    Field("chunk_frames", "chunk_frames", int, 1, None, max_setting="max_chunk_frames", triton="TYPE_INT32",
          stages=ENGINE_STAGES, default_setting="chunk_frames"),
    Field("ignore_eos", "ignore_eos", bool, triton="TYPE_BOOL", stages=ENGINE_STAGES),
    Field("chunk_length", "chunk_length", int, 16, 100000, doc="UTF-8 bytes of text per segment", triton="TYPE_INT32",
          default_setting="chunk_length"),
    Field("session_id", "session_id", str, doc="a text session: text that arrives in pieces, spoken as it comes "
          "(`text_event`)", triton="TYPE_STRING"),
    Field("text_event", "text_event", str, doc="with session_id: open (the request that streams the session's "
          "audio; the default) | text | flush | end (append to an open session; answered at once)",
          triton="TYPE_STRING"),
)}
TEXT_EVENTS = ("open", "text", "flush", "end")


def field_default(name: str, values: dict | None = None):
    """A request field's value when the request leaves it out: its setting's value in `values` (a model's settings)
    where it has one (`default_setting`), else its own `default` (None: unset)."""
    f = REQUEST_FIELDS[name]
    if f.default_setting is not None:
        return (values or {}).get(f.default_setting, SCHEMA[f.default_setting].default)
    return f.default


def stage_fields(stage: str) -> list[Field]:
    """The request fields model `stage` takes, in declaration order."""
    return [f for f in REQUEST_FIELDS.values() if stage in f.stages]


# the numeric fields the gateway takes under the same name as s2pro (the rest it builds: text, voices)
HTTP_NUMBERS = tuple(f.name for f in REQUEST_FIELDS.values() if f.type in (int, float) and f.http == f.name)
SAMPLING_FIELDS = ("seed", "temperature", "top_p", "top_k", "max_new_tokens")  # -> sampling.SamplingParams


def pbtxt_inputs(stage: str) -> str:
    """The `input [ ... ]` entries of the request fields that model `stage` takes, in declaration order, one a line
    (no trailing comma): the block between the `request-fields` markers of its config.pbtxt (a test checks it)."""
    lines = []
    for f in stage_fields(stage):
        opt = "" if f.required else " optional: true"
        lines.append(f'  {{ name: "{f.name}" data_type: {f.triton} dims: {f.dims}{opt} }}')
    return ",\n".join(lines)


def check_field(name: str, value, limits: dict | None = None, http: bool = False):
    """Check a numeric request field against its range (upper bound from `limits[max_setting]` where it has
    one). Raises S2Error(invalid_argument) naming the field as the caller knows it (`http`: the gateway's name)."""
    f = REQUEST_FIELDS[name]
    label = f.http if http else f.name
    if value is None:
        return None
    hi = f.max
    if f.max_setting is not None:
        hi = (limits or {}).get(f.max_setting, SCHEMA[f.max_setting].default)
    ok_lo = f.min is None or (value > f.min if f.min_open else value >= f.min)
    ok_hi = hi is None or value <= hi
    if not (ok_lo and ok_hi):
        fmt = (lambda x: str(int(x))) if f.type is int else (lambda x: f"{x:g}")
        lo_s = "" if f.min is None else f"{'(' if f.min_open else '['}{fmt(f.min)}"
        hi_s = "" if hi is None else f"{fmt(hi)}]"
        kind = "an integer" if f.type is int else "a number"
        if hi is None:
            raise invalid(f"{label}={value} is out of range: use {kind} {'above' if f.min_open else 'of at least'} "
                          f"{fmt(f.min)}", label)
        raise invalid(f"{label}={value} is out of range: use {kind} in {lo_s}, {hi_s}", label)
    return value
