"""Many concurrent decode streams over one codec: per-stream state, batched by chunk length.

A job is one chunk of one stream: `(key, stream_id, codes [frames, num_codebooks], start, final)`.
`start` opens the stream (a fresh decoder state); a later chunk continues the stream's state, so
chunks join without seams; `final` releases it. A chunk for a stream that is not open (never
started, already finished, or dropped after `idle_timeout_s`) is an error, never a silent restart
(which would put an audible seam in the audio); so is a `start` for a stream that is open.

A codec computing in fp16 (the GPU default) can overflow. With a `fallback` (the same codec in
fp32), a chunk whose audio or new state is not finite is decoded again in fp32 from the stream's
previous state, and that stream stays in fp32 until it ends.

With a `SlotPool` (the default in dac_decoder: `codec_max_streams` slots) every open stream's state is a row of
one set of device tensors, and on a GPU each batch runs as a CUDA graph; streams beyond the pool's size, and those
moved to fp32, keep a state of their own (`StreamState`) and run eagerly, as everything does with no pool.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import S2Error, from_exception, internal, invalid
from ..gpu import jit
from ..gpu.cuda_graphs import capture as capture_graph, own_stream
from ..gpu.device import resolve_device
from ..gpu.transfer import copy_in, upload
from .loading import codec_dtype_for, load_codec_from_dir
from .model import StreamState, use_triton_kernels

log = logging.getLogger("s2tts")


@dataclass
class _Stream:
    used: float  # when its last chunk came
    slot: int | None = None  # its row in the pool, or
    state: StreamState | None = None  # its own state (no pool, pool full, or moved to fp32)
    fresh: bool = True  # nothing decoded yet: a pooled stream's row still holds an earlier stream's state


class StreamDecoder:
    def __init__(self, codec, idle_timeout_s: float = 600.0, fallback=None, pool_size: int = 0, graphs: bool | None = None,
                 buckets: tuple[int, ...] | None = None):
        self.codec = codec
        self.fallback = fallback  # the codec in fp32, when `codec` computes in fp16 / bf16
        self.idle_timeout_s = idle_timeout_s
        self.states: dict[str, _Stream] = {}  # open streams by id
        self.in_fp32: set[str] = set()  # streams moved to the fallback after a non-finite chunk
        self.redone = 0  # chunks decoded again in fp32
        self.batches: list[int] = []  # streams decoded together, one entry per codec call since the host last took them
        self.device = next(codec.parameters()).device
        self.C = codec.config.num_codebooks
        # (semantic, residual) codebook sizes, where the codec states them (an exported graph's manifest does not)
        self.sizes = (getattr(codec.config, "semantic_codebook_size", None), getattr(codec.config, "codebook_size", None))
        self.pool = SlotPool(codec, pool_size, graphs, buckets) if pool_size > 0 else None
        self.making: dict = {}  # {part: (seconds, GPU MiB or None)} as `open_stream_decoder` measured them
        self._lock = threading.Lock()

    def _check(self, sid: str, codes: np.ndarray, start: bool) -> S2Error | None:
        if codes.ndim != 2 or codes.shape[1] != self.C:
            return invalid(f"codes must be [frames, {self.C}], got {list(codes.shape)}", "codes")
        sem, res = self.sizes
        if codes.size and sem and (codes.min() < 0 or codes[:, 0].max() >= sem or codes[:, 1:].max() >= res):
            return invalid(f"codes out of range: codebook 0 (semantic) takes 0 to {sem - 1}, codebooks 1-{self.C - 1} "
                           f"take 0 to {res - 1} (the codec would clamp them: send codes it made)", "codes")
        if start and sid in self.states:
            return S2Error("already_exists", f"codec stream {sid!r} is already open: start each stream once "
                                             "(or end it with final=true first)", "stream_id")
        if not start and sid not in self.states:
            return S2Error("not_found", f"codec stream {sid!r} is not open: it was never started (start=true on its "
                                        f"first chunk), already ended, or dropped after {self.idle_timeout_s:g} s "
                                        "without a chunk", "stream_id")
        return None

    def _open(self, now: float) -> _Stream:
        slot = self.pool.take() if self.pool is not None else None
        return _Stream(now, slot=slot, state=None if slot is not None else self.codec.new_stream_state(1))

    @torch.inference_mode()
    def decode_many(self, jobs, now: float, queued: Callable[[], None] | None = None) -> dict:
        """jobs: [(key, stream_id, codes [n, C] int, start, final)] -> {key: float32 audio [n * frame_length] or
        S2Error}. Jobs of one stream must come in order; a stream appears at most once per call. One call at a time
        (callers on other threads wait): the pool's graphs and buffers serve every call. `queued` is called once
        per call: on a GPU as soon as the device work of the call's first group of streams is queued, before the
        host waits for its audio (device work the caller queues then runs behind it while the host takes the audio:
        the engine's next step), at the latest before returning."""
        once = _Once(queued)
        with self._lock:
            out = self._decode_many(jobs, now, once)
        once()
        return out

    def _decode_many(self, jobs, now: float, queued: Callable[[], None]) -> dict:
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
                self.states[sid] = self._open(now)
            st = self.states[sid]
            st.used = now
            n = codes.shape[0]
            if n == 0:
                out[key] = np.zeros(0, np.float32)
            elif st.slot is not None:
                n_at = self.pool.padded(n) if final else n  # a graph's length; the padding decodes to nothing kept
                if n_at > n:
                    codes = np.concatenate([codes, np.zeros((n_at - n, codes.shape[1]), codes.dtype)])
                groups[(n_at, "pool")].append((key, sid, codes, n))
            else:
                groups[(n, "fp32" if sid in self.in_fp32 else "own")].append((key, sid, codes, n))
        for (n, path), group in groups.items():
            codes = upload(torch.as_tensor(np.stack([g[2] for g in group]), dtype=torch.int64), self.device)
            codes = codes.transpose(1, 2)  # the codec computes on [B, C, n]
            self.batches.append(len(group))
            try:
                if path == "pool":
                    self._decode_pooled(group, codes, out, queued)
                else:
                    self._decode_own(group, codes, out, wide=path == "fp32")
            except Exception as e:  # noqa: BLE001 - this group's streams fail; their state is gone

                err = from_exception(e, "dac_decoder")
                for key, sid, *_ in group:
                    out[key] = err
                    self._drop(sid)
        for key, sid, codes, start, final in jobs:
            if final and not isinstance(out.get(key), S2Error):
                self._drop(sid)
        self._collect(now)
        return out

    def _decode_pooled(self, group, codes, out, queued: Callable[[], None]) -> None:
        streams = [self.states[sid] for _, sid, *_ in group]
        audio, finite, old = self.pool.decode([s.slot for s in streams], codes, [not s.fresh for s in streams], queued)
        hop = audio.shape[1] // codes.shape[-1]
        for b, ((key, sid, _, n), st) in enumerate(zip(group, streams)):
            st.fresh = False
            if not finite[b] and self.fallback is not None:  # fp16 overflowed: this chunk again in fp32, and the rest
                redone = self._redo(sid, codes[b : b + 1], {k: v[b : b + 1] for k, v in old.items()})
                self.pool.give(st.slot)
                st.slot = None
                if isinstance(redone, S2Error):
                    out[key] = redone
                    self._drop(sid)
                    continue
                audio_b, st.state = redone
                out[key] = audio_b[: n * hop]
            else:
                out[key] = audio[b, : n * hop]

    def _decode_own(self, group, codes, out, wide: bool) -> None:
        states = [self.states[sid].state for _, sid, *_ in group]
        audio, new_states, finite = self._decode(self.fallback if wide else self.codec, codes, states,
                                                 check=self.fallback is not None and not wide)
        for b, (key, sid, *_) in enumerate(group):
            st = self.states[sid]
            st.fresh = False
            if not finite[b]:  # fp16 overflowed: this chunk again in fp32, and the rest of it
                redone = self._redo(sid, codes[b : b + 1], states[b].tensors)
                if isinstance(redone, S2Error):
                    out[key] = redone
                    self._drop(sid)
                    continue
                audio[b], new_states[b] = redone
            out[key] = audio[b]
            st.state = new_states[b]

    def _redo(self, sid: str, codes, state: dict):
        """The chunk again in fp32 from the stream's state before it (its tensors, widened here) -> (audio, state),
        or the error that ends this stream alone when its audio is not finite in fp32 either."""
        wide = StreamState({k: t.float() if t.is_floating_point() else t for k, t in state.items()})
        a, st, ok = self._decode(self.fallback, codes, [wide], check=True)
        if not ok[0]:
            log.warning("dac_decoder: stream %s: a chunk of %d frames is not finite in fp32 either; the stream ends",
                        sid, codes.shape[-1])
            return internal(f"dac_decoder: codec stream {sid!r}: the chunk's audio is not finite, in fp32 too")
        self.in_fp32.add(sid)
        self.redone += 1
        log.warning("dac_decoder: stream %s: a chunk of %d frames overflowed in %s; decoded again in fp32 "
                    "(the stream stays in fp32)", sid, codes.shape[-1], next(self.codec.parameters()).dtype)
        return a[0], st[0]

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
        host = _with_finite(audio, state.tensors).cpu().numpy()
        return host[:, :-1], new_states, host[:, -1] > 0

    def joins(self, n: int) -> bool:
        """Whether a chunk of n frames decodes as fast as its parts would: any length without CUDA graphs, else a
        length the pool prepared (others run eagerly)."""
        return self.pool is None or not self.pool.use_graphs or n in self.pool.lengths

    def slices(self, n: int, final: bool = False) -> list[int]:
        """How to decode a stream's next n frames in the fewest calls that each run fast: one call where the codec
        decodes that length as well (`joins`; a stream's last frames are padded to a prepared length), else the
        longest prepared lengths that fit, the rest eagerly."""
        if self.joins(n):
            return [n]
        top = max(self.pool.lengths, default=0)
        out = []
        while n > 0:
            # a stream's last frames pad to a prepared length; else the longest prepared length that fits
            k = n if final and n <= top else max((L for L in self.pool.lengths if L <= n), default=n)
            out.append(k)
            n -= k
        return out

    def close(self, sid: str) -> None:
        """End stream `sid` (its state dropped) if it is open (after a call under way)."""
        with self._lock:
            self._drop(sid)

    def _drop(self, sid: str) -> None:
        st = self.states.pop(sid, None)
        if st is not None and st.slot is not None:
            self.pool.give(st.slot)
        self.in_fp32.discard(sid)

    def _collect(self, now: float) -> None:
        """Drop streams nobody finished (a client that vanished without a final chunk)."""
        stale = [sid for sid, st in self.states.items() if now - st.used > self.idle_timeout_s]
        for sid in stale:
            self._drop(sid)


def open_stream_decoder(checkpoint, device, codec_dtype: str, pool_size: int, idle_timeout_s: float,
                        lengths: list[int], max_batch: int, max_frames: int | None = None
                        ) -> tuple[StreamDecoder, str, int]:
    """The decoder a server runs (dac_decoder, or slow_ar with codec_in_engine): `codec_dtype` as it resolves for the
    decoder on `device` (`auto`: fp16 on a GPU), with the fp32 codec as its fallback when that is not fp32, and a
    pool of `pool_size` stream slots warmed for these chunk lengths at up to `max_batch` streams a call, at most
    `max_frames` frames a call (`SlotPool.warm`; CUDA graphs on a GPU). The caller sets the process's fp32 precision
    (TF32) first. Its kernels compile in worker processes (`gpu.jit.compile_workers`, those of a caller's if it holds
    them). -> (decoder, dtype, graphs captured)."""
    dtype = codec_dtype_for(codec_dtype, device, "decoder")
    making = _Making(device)
    with jit.compile_workers(device) if pool_size else contextlib.nullcontext():
        codec = load_codec_from_dir(checkpoint, device, dtype).drop_encoding()
        making.mark("weights")
        fallback = None if dtype == "fp32" else load_codec_from_dir(checkpoint, device, "fp32").drop_encoding()
        making.mark("fp32 fallback")
        tune_for_device(device, codec, fallback)
        making.mark("kernels chosen")
        decoder = StreamDecoder(codec, idle_timeout_s=idle_timeout_s, fallback=fallback, pool_size=pool_size)
        making.mark("stream slots")
        graphs = decoder.pool.warm(lengths, max(1, max_batch), max_frames, mark=making.mark) \
            if decoder.pool is not None else 0
        making.mark("warm-up")
    decoder.making = making.parts
    return decoder, dtype, graphs


def making_line(parts: dict[str, tuple[float, float | None]]) -> str:
    """A decoder's `making` as the end of a log line: each part's seconds, and on a GPU the memory it took."""
    if not parts:
        return ""
    gpu = all(mib is not None for _, mib in parts.values())
    line = "; made in: " + ", ".join(f"{k} {s:.1f} s" + (f" ({mib:.0f} MiB)" if gpu else "")
                                       for k, (s, mib) in parts.items())
    return line + (f"; GPU memory held: {sum(m for _, m in parts.values()) / 1024:.2f} GiB" if gpu else "")


class _Making:
    """What each part of a decoder's making took: seconds, and on a GPU the memory PyTorch holds that it added
    (`parts`: {part: (seconds, MiB or None)}), for the log line that says where a server's start and memory went."""

    def __init__(self, device):
        dev = resolve_device(device)
        self.cuda = dev.type == "cuda"
        self.dev, self.parts = dev, {}
        self.t = time.monotonic()
        self.held = torch.cuda.memory_reserved(dev) if self.cuda else 0

    def mark(self, part: str) -> None:
        now = time.monotonic()
        held = torch.cuda.memory_reserved(self.dev) if self.cuda else 0
        self.parts[part] = (now - self.t, (held - self.held) / 2**20 if self.cuda else None)
        self.t, self.held = now, held


def tune_for_device(device, *codecs) -> None:
    """How a serving process runs its streaming decoders on a GPU: the codec's Triton kernels (`use_triton_kernels`).
    Nothing changes on a CPU. `device`: as the settings name it (`auto` included)."""
    if resolve_device(device).type != "cuda":
        return
    if jit.available():
        for c in codecs:
            if c is not None:
                use_triton_kernels(c)
    # what the caller dropped (`DAC.drop_encoding`) and the old storage of the transformers' w1 and w3 (now one tensor
    # each) back to the driver: in the caching allocator they stayed reserved
    torch.cuda.empty_cache()


def _with_finite(audio: torch.Tensor, state: dict) -> torch.Tensor:
    """audio [B, samples] float32 -> [B, samples + 1]: the last column 1.0 where the row's audio and new state are
    all finite (it travels to the host with the audio, in one copy)."""
    finite = audio.isfinite().all(dim=1)
    for t in state.values():
        if t.is_floating_point():
            finite &= t.isfinite().flatten(1).all(dim=1)
    return torch.cat([audio, finite[:, None].float()], dim=1)


class _Once:
    """A callable calling `fn` (None: nothing) the first time only."""

    def __init__(self, fn: Callable[[], None] | None):
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


class SlotPool:
    """The decoder states of up to `size` streams in one set of device tensors (row i = slot i, the extra last row
    is scratch for the padded rows of a batch; a row holds all of a stream's state tensors of one dtype). A batch of
    B streams gathers its rows, decodes with the new states written into fresh rows, and writes those back in
    place: no per-stream tensors, no stack/split per call. On a GPU each (batch bucket, chunk length)
    runs as one CUDA graph (the shapes `warm` prepared; others run eagerly), which takes the CPU cost of launching the
    codec's hundreds of small kernels per call (milliseconds of host time) off the serving path.

    The body also reports, per row, whether the audio and the new state are finite, and keeps the gathered old
    states until the next call (the fp32 fallback decodes an overflowed chunk again from them)."""

    BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    def __init__(self, codec, size: int, graphs: bool | None = None, buckets: tuple[int, ...] | None = None):
        if buckets is not None:
            self.BUCKETS = tuple(sorted(set(buckets)))
        proto = codec.new_stream_state(1).tensors
        self.codec, self.size, self.scratch = codec, size, size
        # every state tensor of a stream is a span of its row in one buffer per dtype: a batch gathers, checks and
        # writes back its states with a few kernels, not a few per state tensor (the codec has ~40)
        self.layout: dict[torch.dtype, list[tuple[str, tuple[int, ...], int, int]]] = defaultdict(list)
        widths: dict[torch.dtype, int] = defaultdict(int)
        for k, t in proto.items():
            n = t[0].numel()
            self.layout[t.dtype].append((k, tuple(t.shape[1:]), widths[t.dtype], n))
            widths[t.dtype] += n
        self.rows = {dt: proto[spans[0][0]].new_zeros(size + 1, widths[dt]) for dt, spans in self.layout.items()}
        self.free = list(range(size - 1, -1, -1))
        self.device = next(iter(self.rows.values())).device
        self.C = codec.config.num_codebooks
        self.use_graphs = self.device.type == "cuda" and graphs is not False  # CUDA graphs need a GPU
        self.graphs: dict[tuple[int, int], tuple[object, dict]] = {}  # (batch bucket, frames) -> (graph, buffers)
        self.lengths: list[int] = []  # the chunk lengths `warm` prepared
        self._mempool = self._stream = None  # `_capture`'s graphs' memory pool and capture stream
        # the gathered old states of the last call, for every shape up to the largest bucket `warm` prepared: one
        # buffer, not one per graph (64 S2 Pro streams hold ~280 MB of state)
        self.old_rows: dict[torch.dtype, torch.Tensor] = {}
        self.cap: dict[int, int] = {}  # chunk length -> the most streams one call decodes (`warm`'s max_frames)
        self._host: torch.Tensor | None = None  # page-locked: a call's audio on its way to the host (GPU)

    # The pool's shape rules, pure functions of its buckets and lengths (perf/bench_host.py counts calls by them)
    @staticmethod
    def batch_buckets(buckets: tuple[int, ...], max_batch: int) -> list[int]:
        """The batch buckets a pool warmed for `max_batch` streams a call holds: up to the first that holds it."""
        out = []
        for b in buckets:
            out.append(b)
            if b >= max_batch:
                break
        return out

    @staticmethod
    def call_caps(lengths: list[int], buckets: list[int], max_frames: int | None) -> dict[int, int]:
        """Chunk length -> the most streams one call decodes: the largest bucket within `max_frames` frames (at
        least the smallest bucket)."""
        return {n: max([b for b in buckets if max_frames is None or b * n <= max_frames] or buckets[:1])
                for n in lengths}

    @staticmethod
    def bucket_for(buckets: tuple[int, ...], rows: int) -> int:
        """The batch a call of `rows` streams runs at: the first bucket that holds them (rows itself past the last)."""
        return next((b for b in buckets if b >= rows), rows)

    @staticmethod
    def padded_to(lengths: list[int], n: int) -> int:
        """The length a final chunk of n frames decodes at: the first prepared length that holds it (n past them)."""
        return next((L for L in lengths if L >= n), n)

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def give(self, slot: int) -> None:
        self.free.append(slot)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rows.values())

    def _views(self, rows: dict) -> dict:
        """{dtype: [B, width]} -> {state key: [B, *shape]}, views into those rows."""
        return {k: rows[dt][:, off : off + n].view(-1, *shape) for dt, spans in self.layout.items()
                for k, shape, off, n in spans}

    def _buffers(self, B: int, n: int) -> dict:
        return {"codes": torch.zeros(B, self.C, n, dtype=torch.int64, device=self.device),
                "idx": torch.full((B,), self.scratch, dtype=torch.int64, device=self.device),
                "keep": torch.zeros(B, dtype=torch.bool, device=self.device)}

    def _body(self, bufs: dict) -> None:
        idx, keep = bufs["idx"], bufs["keep"]
        B = idx.shape[0]
        old, new = {}, {}
        for dt, t in self.rows.items():
            g = t.index_select(0, idx)
            zero = torch.zeros((), dtype=dt, device=g.device)
            shared = self.old_rows.get(dt)
            if shared is not None and B <= shared.shape[0]:  # one buffer for every shape (calls run one at a time)
                old[dt] = torch.where(keep[:, None], g, zero, out=shared[:B])
            else:
                old[dt] = torch.where(keep[:, None], g, zero)
            new[dt] = torch.empty_like(g)
        olds = self._views(old)
        audio, _ = self.codec.decode_stream(bufs["codes"], StreamState(olds), dest=self._views(new))
        for dt, t in self.rows.items():
            t.index_copy_(0, idx, new[dt])
        bufs["out"] = _with_finite(audio[:, 0].float(), new)
        bufs["old"] = olds

    def _capture(self, Bp: int, n: int) -> None:
        """One graph, on the pool's own capture stream (`gpu.cuda_graphs.own_stream`: the engine's graphs may replay
        beside these and must not share their cuBLAS workspace)."""
        bufs = self._buffers(Bp, n)  # idx: all scratch, so the warm-up and capture write no stream's state
        try:
            if self._mempool is None:
                self._mempool, self._stream = torch.cuda.graph_pool_handle(), own_stream(self.device)
            graph, _ = capture_graph(lambda: self._body(bufs), self._stream, self._mempool,
                                     warm=lambda: self._body(dict(bufs)))
        except Exception as e:  # noqa: BLE001 - that shape runs eagerly
            log.warning("dac_decoder: no CUDA graph for batch %d x %d frames (%s); it runs eagerly", Bp, n, e)
            return
        self.graphs[(Bp, n)] = (graph, bufs)

    def warm(self, lengths: list[int], max_batch: int, max_frames: int | None = None,
             mark: Callable[[str], None] | None = None) -> int:
        """Prepare these chunk lengths: on a GPU, capture a graph for each with every batch bucket up to
        `max_batch` (other shapes run eagerly); a stream's final chunk of another length is padded to the next one
        (the codec is causal: the frames added change no sample of the real ones). `max_frames`: the most frames
        one call decodes (streams x length; at least one bucket a length): a call of more streams runs as several
        (`cap`), so that the graphs' memory (the activations of their largest call: ~6 GB for S2 Pro at 64 x 16
        frames in fp16) follows the frames a held call decodes, not the longest length. `mark(part)`: called as
        each part of a GPU's warm-up ends (the compiles side by side, the captures). -> graphs made."""
        self.lengths = sorted(set(lengths))
        buckets = self.batch_buckets(self.BUCKETS, max_batch)
        self.cap = self.call_caps(self.lengths, buckets, max_frames)
        self.old_rows = {dt: t.new_zeros(buckets[-1], t.shape[1]) for dt, t in self.rows.items()}
        if self.use_graphs:
            torch.cuda.set_device(self.device)  # capture on this device (the current one is per thread)
            # the largest first: the smaller captures reuse the blocks it freed in the shared pool
            shapes = [(Bp, n) for n in reversed(self.lengths) for Bp in reversed(buckets) if Bp <= self.cap[n]]
            # every shape's kernels compiled first, all at once (each shape's decode run with its launches turned
            # into compiles), then captured one by one with their kernels at hand
            jit.compile_only([lambda Bp=Bp, n=n: self._body(self._buffers(Bp, n)) for Bp, n in shapes])
            if mark is not None:
                mark("kernels compiled side by side")
            for Bp, n in shapes:
                self._capture(Bp, n)
            if mark is not None:
                mark("CUDA graphs")
            torch.cuda.empty_cache()  # the eager warm-up runs' blocks, outside the graphs' pool, back to the driver
        return len(self.graphs)

    def padded(self, n: int) -> int:
        """The length a final chunk of n frames decodes at."""
        return self.padded_to(self.lengths, n)

    def decode(self, slots: list[int], codes: torch.Tensor, keep: list[bool], queued=None):
        """See `_decode`; on a GPU, with the pool's device current (graphs replay on the current device)."""
        queued = queued or (lambda: None)
        if self.device.type != "cuda":
            return self._decode(slots, codes, keep, queued)
        with torch.cuda.device(self.device):
            return self._decode(slots, codes, keep, queued)

    def _decode(self, slots: list[int], codes: torch.Tensor, keep: list[bool], queued: Callable[[], None]):
        """codes [B, C, n] (device, int64) of the streams in `slots`; keep[b] False: start from a fresh state.
        -> (audio float32 [B, n * hop] host, finite [B] host, old states {key: [B, ...]} on the device). More
        streams than `cap` allows for n run as several calls. `queued()` once the device work and the audio's copy
        to the host are queued (on a GPU: before the host waits for them)."""
        B, n = codes.shape[0], codes.shape[-1]
        cap = self.cap.get(n)
        if cap is not None and B > cap:
            parts = []
            for i in range(0, B, cap):
                audio, finite, old = self._decode(slots[i : i + cap], codes[i : i + cap], keep[i : i + cap], queued)
                parts.append((audio, finite, {k: v.clone() for k, v in old.items()}))  # the next call reuses the buffer
            return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                    {k: torch.cat([p[2][k] for p in parts]) for k in parts[0][2]})
        Bp = self.bucket_for(self.BUCKETS, B)
        idx = torch.tensor(slots + [self.scratch] * (Bp - B), dtype=torch.int64)
        kp = torch.tensor(keep + [False] * (Bp - B), dtype=torch.bool)
        graph, bufs = self.graphs.get((Bp, n)) or (None, self._buffers(Bp, n))
        bufs["codes"][B:].zero_()  # padded rows (a graph's buffer holds the last call's)
        bufs["codes"][:B].copy_(codes)
        copy_in(bufs["idx"], idx)
        copy_in(bufs["keep"], kp)
        if graph is not None:
            graph.replay()
        else:
            self._body(bufs)
        if self.device.type != "cuda":
            host = bufs["out"][:B].cpu().numpy()
            queued()
        else:  # the copy queued behind the decode into page-locked memory, then the caller's device work behind it
            out = bufs["out"][:B]
            if self._host is None or self._host.numel() < out.numel():  # one buffer, grown to the largest call
                self._host = torch.empty(out.numel(), dtype=out.dtype, pin_memory=True)
            pinned = self._host[: out.numel()].view(out.shape)
            pinned.copy_(out, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            queued()
            ready.synchronize()
            host = pinned.numpy().copy()  # (the page-locked buffer serves the next call of this shape)
        return host[:, :-1], host[:, -1] > 0, {k: v[:B] for k, v in bufs["old"].items()}
