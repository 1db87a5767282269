"""Continuous-batching generation engine for S2 Pro (slow AR + fast AR).

Each live request owns a slot (a row of the KV block table and of the per-slot sampling
state: seed, temperature, ... in device tensors) and the KV blocks it has filled
(s2tts/paged.py): blocks for its prompt at admission, one more each time it crosses a
block boundary, all freed when it ends. `step()` admits waiting requests (batched prefill,
which also yields their first frame), then runs one batched decode step for every other
live request, and returns what each request produced. A frame is one slow-AR token plus
the fast AR's residual codes: `[num_codebooks]` codes.

When the pool runs out of blocks for the running requests, the prefix cache gives its
blocks back first; then the request admitted last is preempted: its blocks are freed and it
waits at the head of the queue, to be prefilled again with the frames it has produced as
part of its prompt and go on where it stopped (same seed and steps: its stream just pauses).

Thread-safety: `submit` and `cancel` may be called from any thread; `step` from one.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .model import S2Model
from .prefix_cache import PrefixCache
from .prompt import Prompt
from .sampling import RAS_WINDOW, SamplingParams, sample, sample_semantic

FINISH_END, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "end", "length", "cancelled", "error"


@dataclass
class Request:
    id: str
    prompt: Prompt
    params: SamplingParams
    # engine-owned state
    slot: int = -1
    length: int = 0  # tokens in this request's KV cache
    generated: int = 0  # frames produced
    frames: list = field(default_factory=list)  # the frames produced, kept to resume after a preemption
    start: int = 0  # prompt tokens already in its blocks at admission (a cached voice prefix)
    prefix_key: str | None = None  # set when its prefilled prefix should enter the prefix cache
    max_new: int = 0
    seed: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None  # when it got a KV slot


@dataclass
class Output:
    """What one request produced in one `step()`."""

    request_id: str
    codes: np.ndarray  # [n, num_codebooks] int32 new frames (n may be 0)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    exception: BaseException | None = None  # with FINISH_ERROR: what failed
    queue_s: float | None = None  # on a request's first output: seconds it waited for a KV slot


class InProcessFastAR:
    """Runs the fast AR in the engine's process: (hidden, code0, sampling tensors) -> residual codes."""

    def __init__(self, model: S2Model, residual_size: int, kernel: bool = False):
        self.model = model
        self.residual_size = residual_size
        self.kernel = kernel  # Triton sampling kernel (set by the engine on GPU)

    def __call__(self, hidden, code0, temperature, top_p, top_k, seed, step):
        def sample_fn(logits, k):
            return sample(logits, temperature, top_p, top_k, seed, step, stream=1 + k, kernel=self.kernel)

        return self.model.fast.generate(hidden, code0, sample_fn, self.residual_size)


class HostFastAR:
    """Marker base for fast-AR runners that leave the device (e.g. BLS): no CUDA graphs around them."""


class Engine:
    GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
    # prefill graphs: (batch, prompt tokens, keys) shapes; keys > tokens serve prompts after a cached voice prefix
    PREFILL_BATCH = (1, 2, 4)
    PREFILL_TOKENS = (32, 64, 128, 256)
    PREFILL_KEYS = (512, 1024)
    SPLIT_FROM = 2048  # keys of the longest request above which a decode step splits each row's keys

    def __init__(self, model: S2Model, residual_size: int, max_batch: int = 8, max_seq_len: int = 2048,
                 fast_ar=None, max_prefill_tokens: int = 8192, cuda_graphs: bool | None = None,
                 decode_kernel: bool | None = None, fused_kernels: bool | None = None, prefix_cache_bytes: int = 0,
                 prefill_buckets: bool | None = None, batch_invariant: bool = False, kv_block_tokens: int = 32,
                 kv_cache_tokens: int | None = None, decode_splits: int | None = None, admit_every: int = 1):
        """`cuda_graphs`, `decode_kernel` (Triton attention over the cache), `fused_kernels` (Triton norm/RoPE/SwiGLU):
        None = on when the model is on a CUDA device.

        KV cache: a pool of `kv_cache_tokens` positions (default `max_batch` x `max_seq_len`: every slot can fill
        its sequence) in blocks of `kv_block_tokens` (0: one block of `max_seq_len` per request, the slot layout).
        `decode_splits`: programs that share one request's keys in the decode-attention kernel (a power of two;
        default: 1 up to max_seq_len 2048, then one per 2048 tokens of max_seq_len, at most 16), so that a long
        context is read by many programs at once. A step uses them only while some request has more than
        SPLIT_FROM tokens (their extra programs cost ~15% of a step of short requests); with `batch_invariant`,
        always.

        `batch_invariant`: a request's numbers do not depend on the requests beside it. Every decode step
        runs at one shape (`max_batch` rows, keys up to `max_seq_len`; padding rows use the scratch slot),
        each admitted request is prefilled on its own, and a voice prefix is always prefilled by itself, so
        a prefix-cache hit leaves the same keys and values as a miss. Matrix products then see the same
        shapes for every step of a request, whatever runs beside it; sampling is already per request
        (seed, step). The cost is the padded rows at low load.

        `admit_every`: while requests are decoding, waiting ones join only every this many steps, so that arrivals
        spread over those steps are prefilled together (one pass over the weights instead of one each; a request
        waits at most that many steps more). An idle engine admits at once."""
        s2 = model.s2
        self.model, self.s2 = model, s2
        self.max_batch, self.max_seq_len = max_batch, min(max_seq_len, s2.text.max_seq_len)
        self.max_prefill_tokens = max_prefill_tokens
        self.admit_every = max(1, admit_every)
        self._steps_since_admit = 0
        self.batch_invariant = batch_invariant
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        on_cuda = self.device.type == "cuda"
        if on_cuda:  # Triton kernels and CUDA graphs run on the thread's current device: make it this one
            torch.cuda.set_device(self.device)
        # one extra slot: padded rows of a CUDA-graph bucket read and write it, never a live request's
        self.scratch = max_batch
        block = kv_block_tokens or self.max_seq_len
        kv_tokens = kv_cache_tokens or max_batch * self.max_seq_len
        if kv_tokens < self.max_seq_len:
            raise ValueError(f"kv_cache_tokens={kv_tokens} cannot hold one request of max_seq_len={self.max_seq_len} "
                             "tokens: raise kv_cache_tokens or lower max_seq_len")
        stack = model.slow.stack
        self.blocks = stack.setup_caches(max_batch + 1, self.max_seq_len, self.dtype, self.device, block_size=block,
                                         num_blocks=-(-kv_tokens // block) + 1)
        self.block_bytes = 2 * stack.k_pool[:, 0].nbytes  # keys and values of one block in every layer
        self.prefix_cache = PrefixCache(prefix_cache_bytes, self.blocks, self.block_bytes, stack.copy_blocks)
        self.preemptions = 0
        model.fast.setup_caches(max_batch + 1, self.dtype, self.device)
        model.engine_owner = self  # the caches (and graphs over them) are this engine's until another is made
        self.fast_ar = fast_ar or InProcessFastAR(model, residual_size)
        if decode_kernel is None:
            from . import kernels

            decode_kernel = on_cuda and kernels.available()
        if decode_splits is None:
            decode_splits = min(16, 1 << max(0, -(-self.max_seq_len // self.SPLIT_FROM) - 1).bit_length())
        if decode_splits < 1 or decode_splits & (decode_splits - 1):
            raise ValueError(f"decode_splits={decode_splits}: use a power of two")
        self.decode_splits = decode_splits
        for stack in (model.slow.stack, model.fast.stack):
            for layer in stack.layers:
                layer.attention.decode_kernel = decode_kernel
                layer.attention.decode_splits = 1
        if fused_kernels is None:
            fused_kernels = decode_kernel
        from .model import use_triton_kernels

        use_triton_kernels(model, bool(fused_kernels))
        self.sample_kernel = bool(fused_kernels)
        if isinstance(self.fast_ar, InProcessFastAR):
            self.fast_ar.kernel = self.sample_kernel
        self.logits_hook = None  # optional observer: fn(request_ids, logits [B, V]) (tests, debugging)
        self.fault_hook = None  # optional fn(phase "decode" | "prefill", requests) called before device work (tests)
        self.last_fault: BaseException | None = None

        dev, C, n = self.device, s2.num_codebooks, max_batch + 1
        # per-slot device state
        self.last_codes = torch.zeros(n, C, dtype=torch.int64, device=dev)
        self.recent = torch.full((n, RAS_WINDOW), -1, dtype=torch.int64, device=dev)
        self.temperature = torch.zeros(n, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seed = torch.zeros(n, dtype=torch.int64, device=dev)
        self.allow_end = torch.ones(n, dtype=torch.bool, device=dev)

        self.graphs: dict[tuple[int, int], tuple] = {}  # (batch bucket, decode splits) -> captured decode step
        self.frame_graphs: dict[int, tuple] = {}  # batch bucket -> captured first frame after prefill
        self.prefill_graphs: dict[tuple, tuple] = {}  # (batch, tokens, keys) -> captured prefill
        if cuda_graphs is None:
            cuda_graphs = on_cuda and decode_kernel and not isinstance(self.fast_ar, HostFastAR)
        self.prefill_shapes = self._prefill_shape_list() if (cuda_graphs if prefill_buckets is None else prefill_buckets) else []
        if cuda_graphs:
            if not decode_kernel:
                raise ValueError("cuda_graphs needs decode_kernel (attention over a length held on the device)")
            self._capture_graphs()

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._waiting: deque[Request] = deque()
        self._cancel: set[str] = set()
        self.live: dict[int, Request] = {}  # slot -> request
        self._free = list(range(max_batch - 1, -1, -1))

    # ---- API used from other threads -------------------------------------------------
    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        """Queue a request. Raises ValueError (with what to change) if it can never run."""
        params.validate()
        n = len(prompt)
        if n + 1 >= self.max_seq_len:
            raise ValueError(f"prompt is {n} tokens, over this server's limit of {self.max_seq_len - 2}: shorten the text or the reference")
        req = Request(request_id, prompt, params)
        req.max_new = min(params.max_new_tokens, self.max_seq_len - n - 1)
        req.seed = params.seed if params.seed is not None else random.getrandbits(63)
        with self._work:
            if any(r.id == request_id for r in self._all()):
                raise ValueError(f"request id {request_id!r} is already live")
            self._waiting.append(req)
            self._work.notify()
        return req

    def cancel(self, request_id: str) -> None:
        with self._work:
            self._cancel.add(request_id)
            self._work.notify()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        with self._work:
            if not self.has_work():
                self._work.wait(timeout)
            return self.has_work()

    def wake(self) -> None:
        with self._work:
            self._work.notify_all()

    def where(self, request_id: str) -> str:
        """"waiting" (for a KV slot), "live" (decoding) or "unknown"."""
        with self._lock:
            if any(r.id == request_id for r in self._waiting):
                return "waiting"
            if any(r.id == request_id for r in self.live.values()):
                return "live"
        return "unknown"

    def has_work(self) -> bool:
        return bool(self._waiting or self.live or self._cancel)

    def _all(self):
        return list(self._waiting) + list(self.live.values())

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[Output]:
        """See `_step`. On a GPU the step runs with the engine's device current (the current device is per thread;
        Triton kernels and graphs launch on it, so an engine on cuda:1 stepped from a thread left on cuda:0 would hand
        them pointers they cannot use)."""
        if self.device.type != "cuda":
            return self._step()
        with torch.cuda.device(self.device):
            return self._step()

    @torch.inference_mode()
    def _step(self) -> list[Output]:
        """One engine step, all or nothing per group of requests.

        Cancellations collected since the last step are applied first (so none is lost, whatever the
        device does next), and requests admitted in this step are live before any device work. A
        failure of the batched decode ends the decoding requests with an error output and puts the
        requests admitted in this step back at the head of the queue (they were not touched); a failure
        of their prefill ends just them. Either way the step returns every output and frees every slot
        it took; the exception is kept in `last_fault` (None after a clean step) for the caller to judge.
        """
        if self.model.engine_owner is not self:
            raise RuntimeError("another Engine was made over this model since this one: its KV cache (and the CUDA "
                               "graphs that read it) now belong to that one; use one Engine per model")
        outputs: list[Output] = []
        self.last_fault = None
        with self._lock:
            cancels, self._cancel = self._cancel, set()
            if cancels:
                kept = deque()
                for r in self._waiting:
                    (outputs.append(Output(r.id, self._empty(), True, FINISH_CANCELLED)) if r.id in cancels else kept.append(r))
                self._waiting = kept
            for r in [r for r in self.live.values() if r.id in cancels]:
                outputs.append(Output(r.id, self._empty(), True, FINISH_CANCELLED))
                self._release(r)
            self._grow()
            admitted = self._admit()
            decoding = sorted(s for s, r in self.live.items() if r not in admitted)
        if decoding:
            reqs = [self.live[s] for s in decoding]
            try:
                if self.fault_hook is not None:
                    self.fault_hook("decode", reqs)
                outputs += self._decode(decoding)
            except Exception as e:  # noqa: BLE001 - judged by the caller through last_fault
                self.last_fault = e
                outputs += self._fail(reqs, e)
                with self._lock:
                    for r in reversed(admitted):
                        self._release(r)
                        r.slot = -1
                        self._waiting.appendleft(r)
                return outputs
        if admitted:
            try:
                if self.fault_hook is not None:
                    self.fault_hook("prefill", admitted)
                outputs += self._prefill(admitted)
            except Exception as e:  # noqa: BLE001
                self.last_fault = e
                outputs += self._fail([r for r in admitted if r.slot in self.live and self.live[r.slot] is r], e)
        return outputs

    def _grow(self) -> None:
        """Give every live request that crosses into a new block this step its block (the table row updated before
        the step runs); when blocks are short, drop cached prefixes, then preempt the request admitted last."""
        pool = self.blocks
        needy = [r for r in self.live.values() if r.length // pool.block_size >= pool.holds(r.slot)]
        if not needy:
            return
        self.prefix_cache.evict_until(len(needy))
        while len(needy) > pool.free:
            victim = max(self.live.values(), key=lambda r: (r.admitted_at, r.slot))
            self._preempt(victim)
            if victim in needy:
                needy.remove(victim)
        pool.extend(list(zip([r.slot for r in needy], pool.alloc(len(needy)))))

    def _preempt(self, r: Request) -> None:
        """Free the request's slot and blocks; it waits at the head of the queue to resume (see the module doc)."""
        self._release(r)
        r.slot, r.length, r.start, r.prefix_key = -1, 0, 0, None
        self.preemptions += 1
        self._waiting.appendleft(r)

    def _admit(self) -> list[Request]:
        """Take waiting requests into free slots while the prefill budget and the KV pool allow (in order: a request
        short of blocks waits, and so do those behind it); give each its prompt's blocks, a cached prefix shared."""
        pool, admitted = self.blocks, []
        budget = self.max_prefill_tokens
        self._steps_since_admit += 1
        if self.live and self._steps_since_admit < self.admit_every:
            return admitted
        self._steps_since_admit = 0
        while self._waiting and self._free:
            r = self._waiting[0]
            n = self._source_len(r)
            if admitted and n > budget:
                break
            need = pool.blocks_for(n)  # enough with or without a prefix hit
            if need > pool.free:
                self.prefix_cache.evict_until(need)
                if need > pool.free:
                    break
            self._waiting.popleft()
            budget -= n
            r.slot = self._free.pop()
            if r.admitted_at is None:
                r.admitted_at = time.monotonic()
            self.live[r.slot] = r
            self._place(r, n)
            admitted.append(r)
        return admitted

    def _place(self, r: Request, n: int) -> None:
        """The request's first blocks: a cached voice prefix's (shared), then fresh ones for the rest of its prompt."""
        pool = self.blocks
        key = self.prefix_cache.key(r.prompt)
        hit = self.prefix_cache.get(key)
        blocks = self.prefix_cache.attach(hit) if hit is not None else []
        r.start = hit.length if hit is not None else 0
        r.prefix_key = key if hit is None else None
        blocks += pool.alloc(pool.blocks_for(n) - len(blocks))
        pool.assign(r.slot, blocks)

    @staticmethod
    def _source_len(r: Request) -> int:
        """len(self._source(r)), without building it (one token per frame produced)."""
        return len(r.prompt) + len(r.frames)

    def _source(self, r: Request) -> Prompt:
        """What a request prefills: its prompt, and after a preemption also the frames it has produced."""
        if not r.frames:
            return r.prompt
        frames = torch.from_numpy(np.concatenate(r.frames)).long()
        p = r.prompt
        return Prompt(torch.cat([p.tokens, frames[:, 0] + self.s2.semantic_start_id]), torch.cat([p.codes, frames]),
                      torch.cat([p.semantic, torch.ones(len(frames), dtype=torch.bool)]), p.prefix_len, p.history_dropped)

    def _fail(self, reqs: list[Request], e: BaseException) -> list[Output]:
        with self._lock:
            for r in reqs:
                self._release(r)
        msg = f"{type(e).__name__}: {e}"
        return [Output(r.id, self._empty(), True, FINISH_ERROR, error=msg, exception=e) for r in reqs]

    def _empty(self):
        return np.zeros((0, self.s2.num_codebooks), dtype=np.int32)

    def _release(self, r: Request) -> None:
        if r.slot >= 0 and self.live.get(r.slot) is r:
            del self.live[r.slot]
            self.blocks.free_slot(r.slot)
            self._free.append(r.slot)

    def _set_slot_params(self, reqs: list[Request]) -> torch.Tensor:
        dev = self.device
        slots = torch.tensor([r.slot for r in reqs], device=dev)
        self.temperature[slots] = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=dev)
        self.top_p[slots] = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32, device=dev)
        self.top_k[slots] = torch.tensor([r.params.top_k for r in reqs], dtype=torch.int64, device=dev)
        self.seed[slots] = torch.tensor([r.seed for r in reqs], dtype=torch.int64, device=dev)
        self.allow_end[slots] = torch.tensor([not r.params.ignore_end for r in reqs], dtype=torch.bool, device=dev)
        self.recent[slots] = -1
        return slots

    def _prefill(self, reqs: list[Request]) -> list[Output]:
        """Batched prefill (right-padded) of the new requests, each from where its blocks start (a cached voice
        prefix is shared, not recomputed); a resumed request (preempted earlier) is prefilled on its own, and so is
        a prompt longer than `max_prefill_tokens`, in chunks of that many tokens (attention memory stays bounded).

        With prefill buckets (GPU), the batch is padded to a captured (batch, tokens, keys) shape and replayed
        as a CUDA graph; otherwise it runs eagerly at its own shape."""
        resumed = any(r.frames for r in reqs)
        long = any(self._source_len(r) - r.start > self.max_prefill_tokens for r in reqs)
        if len(reqs) > 1 and (resumed or long or self.batch_invariant):
            return [o for r in reqs for o in self._prefill([r])]
        slots = self._set_slot_params(reqs)
        sources = [self._source(r) for r in reqs]
        starts = [r.start for r in reqs]
        r0 = reqs[0]
        if self.batch_invariant and starts[0] == 0 and 0 < r0.prompt.prefix_len < len(r0.prompt):
            P = r0.prompt.prefix_len  # the voice prefix by itself: the same keys and values as a cache hit
            self._prefill_pass(reqs, sources, [0], [P])
            starts = [P]
        while len(sources[0]) - starts[0] > self.max_prefill_tokens:  # a long prompt, in chunks: bounded memory
            end = starts[0] + self.max_prefill_tokens
            self._prefill_pass(reqs, sources, starts, [end])
            starts = [end]
        hidden, logits = self._prefill_pass(reqs, sources, starts, [len(p) for p in sources])
        for r, src in zip(reqs, sources):
            r.length = len(src)
            if r.prefix_key is not None:
                self.prefix_cache.put(r.prefix_key, self.blocks.owned[r.slot], r.prompt.prefix_len)
                r.prefix_key = None
        if self.logits_hook is not None:
            self.logits_hook([r.id for r in reqs], logits)
        if resumed:  # go on at step `generated`, the RAS window as it was (code 0 of the decoded frames)
            r = r0
            recent = [-1] * RAS_WINDOW + [int(f[0, 0]) for f in r.frames[1:]]
            self.recent[r.slot] = torch.tensor(recent[-RAS_WINDOW:], dtype=torch.int64, device=self.device)
            step = torch.full((1,), r.generated, dtype=torch.int64, device=self.device)
            frame, end = self._sample_frame(slots, hidden, logits, step)
        else:
            frame, end = self._first_frame(slots, hidden, logits)
        return self._emit(reqs, frame, end)

    def _prefill_pass(self, reqs: list[Request], sources: list[Prompt], starts: list[int], ends: list[int]):
        """Prefill prompt tokens [start, end) of each request into its slot -> hidden, logits at each row's last."""
        dev, C = self.device, self.s2.num_codebooks
        lens = [e - s for s, e in zip(starts, ends)]
        shape = self._prefill_bucket(len(reqs), max(lens), max(starts))
        B, T, L = shape if shape else (len(reqs), max(lens), None)
        tokens = torch.zeros(B, T, dtype=torch.int64)
        codes = torch.zeros(B, T, C, dtype=torch.int64)
        semantic = torch.zeros(B, T, dtype=torch.bool)
        row_slots = torch.full((B,), self.scratch, dtype=torch.int64)
        last = torch.zeros(B, dtype=torch.int64)
        pos = torch.arange(T)[None, :].repeat(B, 1)
        for i, r in enumerate(reqs):
            s0, n = starts[i], lens[i]
            e = ends[i]
            p = sources[i]
            tokens[i, :n], codes[i, :n], semantic[i, :n] = p.tokens[s0:e], p.codes[s0:e], p.semantic[s0:e]
            row_slots[i], last[i] = r.slot, n - 1
            pos[i] += s0
        pos = pos.clamp(max=self.max_seq_len - 1)
        args = (tokens, codes, semantic, pos, row_slots, last)
        if shape in self.prefill_graphs:
            graph, bufs, out = self.prefill_graphs[shape]
            for buf, a in zip(bufs, args):
                buf.copy_(a, non_blocking=True)
            graph.replay()
            hidden, logits = out
        else:
            hidden, logits = self._prefill_core(*(a.to(dev) for a in args), kv_len_max=L or int(pos.max()) + 1)
        return hidden[: len(reqs)], logits[: len(reqs)]

    def _prefill_core(self, tokens, codes, semantic, pos, slots, last, kv_len_max):
        """Device part of a prefill (what the prefill graphs capture) -> hidden, logits at each row's last token."""
        x = self.model.embed(tokens, codes, semantic)
        hidden, logits = self.model.slow(x, pos, slots, kv_len_max=kv_len_max)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        return hidden[rows, last], logits[rows, last]

    def _prefill_bucket(self, B: int, T: int, max_start: int):
        """The smallest (batch, tokens, keys) prefill shape holding B rows of T tokens placed after cached
        prefixes of up to `max_start` tokens, or None."""
        fits = [s for s in self.prefill_shapes if s[0] >= B and s[1] >= T and s[2] >= max_start + s[1]]
        return min(fits, key=lambda s: (s[0] * s[1], s[2])) if fits else None

    def _prefill_shape_list(self) -> list[tuple[int, int, int]]:
        shapes = []
        for B in self.PREFILL_BATCH:
            for T in self.PREFILL_TOKENS:
                if B > self.max_batch or T > self.max_seq_len:
                    continue
                kv = [T] + ([L for L in self.PREFILL_KEYS if T < L <= self.max_seq_len] if B == 1 else [])
                shapes += [(B, T, L) for L in kv]
        return shapes

    def _first_frame(self, slots, hidden, logits):
        """Code 0 + fast AR for the requests just prefilled (step 0), through a captured graph when there is one."""
        B = slots.shape[0]
        bucket = next((b for b in sorted(self.frame_graphs) if b >= B), None)
        if bucket is None:
            return self._sample_frame(slots, hidden, logits, torch.zeros(B, dtype=torch.int64, device=self.device),
                                      remember=False)
        graph, io, hbuf, lbuf, out = self.frame_graphs[bucket]
        io[0].fill_(self.scratch)
        io[0][:B] = slots
        io[2].zero_()  # step 0
        hbuf[:B] = hidden
        lbuf[:B] = logits
        graph.replay()
        return out[0][:B], out[1][:B]

    def _decode(self, slot_list: list[int]) -> list[Output]:
        reqs = [self.live[s] for s in slot_list]
        B = len(reqs)
        host = [slot_list, [r.length for r in reqs], [r.generated for r in reqs]]
        rows = self.max_batch if self.batch_invariant else B  # the step's shape
        splits = self._splits_for(max(host[1]) + 1)
        bucket = next((b for b, n in sorted(self.graphs) if b >= rows and n == splits), None)
        pad = (rows if bucket is None else bucket) - B  # padding rows: the scratch slot, position 0, step 0
        padded = [host[0] + [self.scratch] * pad, host[1] + [0] * pad, host[2] + [0] * pad]
        if bucket is not None:
            graph, io, out = self.graphs[(bucket, splits)]
            io.copy_(torch.tensor(padded, dtype=torch.int64), non_blocking=True)
            graph.replay()
        else:
            self._use_splits(splits)
            io = torch.tensor(padded, dtype=torch.int64, device=self.device)
            kv_len_max = self.max_seq_len if self.batch_invariant else max(host[1]) + 1
            out = self._decode_core(io[0], io[1][:, None], io[2], kv_len_max=kv_len_max, hook_ids=[r.id for r in reqs])
        frame, end = out[0][:B], out[1][:B]
        for r in reqs:
            r.length += 1
        return self._emit(reqs, frame, end)

    def _splits_for(self, keys: int) -> int:
        """Decode splits of a step whose longest request attends to `keys` keys."""
        return self.decode_splits if self.batch_invariant or keys > self.SPLIT_FROM else 1

    def _use_splits(self, n: int) -> None:
        for layer in self.model.slow.layers:
            layer.attention.decode_splits = n

    def _decode_core(self, slots, pos, step, kv_len_max, hook_ids=None):
        """One batched decode step on the device (what the CUDA graphs capture): slots [B], pos [B, 1], step [B]."""
        frame = self.last_codes[slots]  # [B, C]: the previous frame is this step's input
        tokens = frame[:, :1] + self.s2.semantic_start_id
        x = self.model.embed(tokens, frame[:, None, :], torch.ones_like(tokens, dtype=torch.bool))
        hidden, logits = self.model.slow(x, pos, slots, kv_len_max=kv_len_max)
        if hook_ids is not None and self.logits_hook is not None:
            self.logits_hook(hook_ids, logits[: len(hook_ids), -1])
        return self._sample_frame(slots, hidden[:, -1], logits[:, -1], step)

    def _sample_frame(self, slots, hidden, logits, step, remember: bool = True):
        """Sample code 0 (or the end token) with RAS, run the fast AR, update slot state -> (frame [B, C], end [B]).
        `remember`: code 0 enters the RAS window; not for the first frame (sampled at prefill), as upstream, whose
        window starts empty at the first decode step."""
        temp, top_p, top_k, seed = self.temperature[slots], self.top_p[slots], self.top_k[slots], self.seed[slots]
        end_col = torch.arange(logits.shape[-1], device=logits.device) == self.model.slow.end_index
        logits = logits.masked_fill(end_col[None, :] & ~self.allow_end[slots][:, None], float("-inf"))
        idx = sample_semantic(logits, self.recent[slots], temp, top_p, top_k, seed, step, kernel=self.sample_kernel)
        end = idx == self.model.slow.end_index
        code0 = idx.clamp(max=self.s2.num_semantic - 1)
        residual = self.fast_ar(hidden, code0, temp, top_p, top_k, seed, step)
        frame = torch.cat([code0[:, None], residual.to(code0.dtype)], dim=1)
        self.last_codes[slots] = frame
        if remember:
            self.recent[slots] = torch.cat([self.recent[slots][:, 1:], code0[:, None]], dim=1)
        return frame, end

    def _capture_graphs(self) -> None:
        """Capture `_decode_core` once per batch bucket, on the scratch slot, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        dev = self.device
        buckets = (self.max_batch,) if self.batch_invariant else \
            sorted({b for b in self.GRAPH_BUCKETS if b < self.max_batch} | {self.max_batch})
        variants = sorted({self._splits_for(1), self._splits_for(self.max_seq_len)})
        for bucket in sorted(buckets, reverse=True):
            io = torch.zeros(3, bucket, dtype=torch.int64, device=dev)
            io[0] = self.scratch
            args = (io[0], io[1][:, None], io[2], None)
            stream = torch.cuda.Stream(dev)
            for splits in variants:  # one graph per way of splitting the keys (they share io)
                self._use_splits(splits)
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream), torch.inference_mode():
                    for _ in range(2):
                        self._decode_core(*args)
                torch.cuda.current_stream(dev).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                    out = self._decode_core(*args)
                self.graphs[(bucket, splits)] = (graph, io, out)
            # the first frame of newly prefilled requests: sampling + fast AR from given hidden/logits
            hbuf = torch.zeros(bucket, self.s2.text.dim, dtype=self.dtype, device=dev)
            lbuf = torch.zeros(bucket, self.s2.num_semantic + 1, dtype=torch.float32, device=dev)
            fargs = (io[0], hbuf, lbuf, io[2])
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):
                    self._sample_frame(*fargs, remember=False)
            torch.cuda.current_stream(dev).wait_stream(stream)
            fgraph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(fgraph, pool=pool), torch.inference_mode():
                fout = self._sample_frame(*fargs, remember=False)
            self.frame_graphs[bucket] = (fgraph, io, hbuf, lbuf, fout)
        for shape in sorted(self.prefill_shapes, key=lambda s: -s[0] * s[1] * s[2]):
            B, T, L = shape
            C = self.s2.num_codebooks
            bufs = (torch.zeros(B, T, dtype=torch.int64, device=dev), torch.zeros(B, T, C, dtype=torch.int64, device=dev),
                    torch.zeros(B, T, dtype=torch.bool, device=dev), torch.arange(T, device=dev)[None].repeat(B, 1),
                    torch.full((B,), self.scratch, dtype=torch.int64, device=dev), torch.zeros(B, dtype=torch.int64, device=dev))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):
                    self._prefill_core(*bufs, kv_len_max=L)
            torch.cuda.current_stream(dev).wait_stream(stream)
            pgraph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(pgraph, pool=pool), torch.inference_mode():
                pout = self._prefill_core(*bufs, kv_len_max=L)
            self.prefill_graphs[shape] = (pgraph, bufs, pout)
        torch.cuda.synchronize(dev)

    def _emit(self, reqs, frame, end) -> list[Output]:
        """Hand the step's frames to the host (the step's one synchronisation) and update request state."""
        host = torch.cat([frame, end[:, None].to(frame.dtype)], dim=1).to("cpu").numpy()
        outputs, done_reqs = [], []
        for i, r in enumerate(reqs):
            first = r.generated == 0
            if host[i, -1]:
                o = Output(r.id, self._empty(), True, FINISH_END)
                done_reqs.append(r)
            else:
                r.generated += 1
                done = r.generated >= r.max_new
                codes = host[i : i + 1, :-1].astype(np.int32)
                r.frames.append(codes)
                o = Output(r.id, codes, done, FINISH_LENGTH if done else None)
                if done:
                    done_reqs.append(r)
            if first and r.admitted_at is not None:
                o.queue_s = r.admitted_at - r.submitted_at
            outputs.append(o)
        if done_reqs:
            with self._lock:
                for r in done_reqs:
                    self._release(r)
        return outputs

    def fail_all(self, message: str) -> list[Output]:
        """End every request, waiting or live, with an error output and free every slot (an unrecoverable fault,
        shutdown). Pending cancellations are dropped: those requests end here too."""
        with self._lock:
            reqs = list(self._waiting) + list(self.live.values())
            self._waiting.clear()
            self._cancel.clear()
            for r in reqs:
                self._release(r)
        return [Output(r.id, self._empty(), True, FINISH_ERROR, error=message) for r in reqs]

    @property
    def kv_capacity_tokens(self) -> int:
        return self.blocks.capacity * self.blocks.block_size

    def counts(self) -> dict:
        with self._lock:
            return {"waiting": len(self._waiting), "live": len(self.live), "free_slots": len(self._free),
                    "kv_tokens": sum(r.length for r in self.live.values()),
                    "kv_blocks_used": self.blocks.used, "kv_blocks_total": self.blocks.capacity,
                    "preemptions": self.preemptions}

    # ---- convenience for offline use ----------------------------------------------------
    def generate(self, prompt: Prompt, params: SamplingParams, request_id: str = "offline") -> tuple[np.ndarray, str]:
        """Run one request to completion (others submitted meanwhile run beside it): codes [C, frames]."""
        self.submit(request_id, prompt, params)
        frames, reason = [], None
        while reason is None:
            for o in self.step():
                if o.request_id == request_id:
                    frames.append(o.codes)
                    if o.finished:
                        reason = o.finish_reason
        return np.concatenate(frames, axis=0).T, reason
