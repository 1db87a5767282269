"""Continuous-batching generation engine for S2 Pro (slow AR + fast AR).

Each live request owns a slot (a row of the KV block table and of the per-slot sampling
state: seed, temperature, ... in device tensors) and the KV blocks it has filled
(s2tts/paged.py): blocks for its prompt at admission, one more each time it crosses a
block boundary, all freed when it ends. A frame is one slow-AR token plus the fast AR's
residual codes: `[num_codebooks]` codes.

`step()` runs one pass over the slow AR's weights in which every token is a row with its own
slot and position: one row per decoding request (its last frame) and, within a budget of
`max_prefill_tokens`, the next prompt tokens of requests being prefilled (chunked prefill: a long
prompt takes several steps, arrivals never get a pass of their own). Attention reads each row's
keys from the paged cache up to its own position, so prompt rows are causal. Then one batch
samples code 0 and runs the fast AR for every decoding request and every request whose prompt
ended in this step (its first frame). The pass is captured as a CUDA graph per row bucket, the
sampling per batch bucket.

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

from .errors import is_fatal_device_error
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
    source: Prompt | None = None  # what it still prefills (prompt, and produced frames after a preemption); None: decoding


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
    # rows of a pass (decode rows + prompt tokens) and of a sampling batch are padded to one of these (CUDA graphs)
    ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1536, 2048,
                   3072, 4096, 6144, 8192)
    SPLIT_FROM = 2048  # keys of the longest row above which a pass splits each row's keys
    # a pass's rows on the device, one column per row: [_F_ROWS + num_codebooks, rows] int64
    _SLOT, _POS, _TOKEN, _SEMANTIC, _FROM_LAST, _SRC, _DST, _F_ROWS = range(8)

    def __init__(self, model: S2Model, residual_size: int, max_batch: int = 8, max_seq_len: int = 2048,
                 fast_ar=None, max_prefill_tokens: int = 512, cuda_graphs: bool | None = None,
                 decode_kernel: bool | None = None, fused_kernels: bool | None = None, prefix_cache_bytes: int = 0,
                 row_buckets: bool | None = None, batch_invariant: bool = False, kv_block_tokens: int = 32,
                 kv_cache_tokens: int | None = None, decode_splits: int | None = None, admit_every: int = 1):
        """`cuda_graphs`, `decode_kernel` (Triton attention over the cache), `fused_kernels` (Triton norm/RoPE/SwiGLU):
        None = on when the model is on a CUDA device. `row_buckets` (default: with `cuda_graphs`): pad every pass and
        sampling batch to a bucket of ROW_BUCKETS (the shapes the graphs are captured at).

        `max_prefill_tokens`: prompt tokens a step adds to its pass (chunked prefill). It bounds how much arrivals
        lengthen the step of the running streams, and sets the largest pass: `max_batch` + this many rows.

        KV cache: a pool of `kv_cache_tokens` positions (default `max_batch` x `max_seq_len`: every slot can fill
        its sequence) in blocks of `kv_block_tokens` (0: one block of `max_seq_len` per request, the slot layout).
        `decode_splits`: programs that share one row's keys in the attention kernel (a power of two;
        default: 1 up to max_seq_len 2048, then one per 2048 tokens of max_seq_len, at most 16), so that a long
        context is read by many programs at once. A pass uses them only while some row has more than
        SPLIT_FROM keys (their extra programs cost ~15% of a step of short requests); with `batch_invariant`,
        always.

        `batch_invariant`: a request's numbers do not depend on the requests beside it. With the attention kernel
        (GPU), every matrix product of both ARs goes through the row-invariant kernel (`kernels.linear`: its tiling
        depends on the weight's shape, never on the rows) and the attention kernel splits every row's keys the same
        way, so every operation computes a row the same whatever rows are beside it, and passes are scheduled as
        usual. Without it (CPU), decode rows run in a pass of their own at one shape (`max_batch` rows; padding rows
        use the scratch slot), each prompt chunk in a pass of its own, cut at points that depend on that request
        alone (its voice prefix always by itself, so a prefix-cache hit leaves the same keys and values as a miss),
        and sampling always at `max_batch` rows. Sampling is per request already (seed, step).

        `admit_every`: while requests are decoding, waiting ones join only every this many steps, so that arrivals
        spread over those steps start their prefill together (a request waits at most that many steps more). An
        idle engine admits at once."""
        s2 = model.s2
        self.model, self.s2 = model, s2
        self.max_batch, self.max_seq_len = max_batch, min(max_seq_len, s2.text.max_seq_len)
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens}: use at least 1 (tokens of prompts per step)")
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

        # batch_invariant: with the attention kernel, every matrix product row-invariant (kernels.linear) and passes
        # scheduled as usual; without it (CPU), decode rows and each prompt chunk in passes of their own, at one shape
        self.apart = batch_invariant and not decode_kernel
        limit = max(max_batch, max_prefill_tokens) if self.apart else max_batch + max_prefill_tokens
        from .model import use_invariant_linears

        use_invariant_linears(model, max(limit, 2 * max_batch) if batch_invariant and not self.apart else 0)
        # a pass's rows, and where each sampled row's final hidden goes: h_sel[dst] (its last row is scratch)
        self.row_sizes = self._buckets(limit)
        self.sample_sizes = (max_batch,) if self.apart else self._buckets(max_batch)
        self.h_sel = torch.zeros(self.row_sizes[-1] + 1, s2.text.dim, dtype=self.dtype, device=dev)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (rows, decode splits) -> captured pass over the slow AR
        self.sample_graphs: dict[int, tuple] = {}  # rows -> captured sampling + fast AR
        self.passes = 0  # passes over the slow AR's weights so far
        if cuda_graphs is None:
            cuda_graphs = on_cuda and decode_kernel and not isinstance(self.fast_ar, HostFastAR)
        self.pad_rows = cuda_graphs if row_buckets is None else row_buckets
        # every token a row of one pass needs the attention kernel; without it a pass runs decode rows together and
        # each prompt chunk as a sequence
        self.flat = bool(decode_kernel)
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

    def decoding(self) -> bool:
        """Whether some request is past its prompt (a step then makes frames; one of only prompt rows makes none)."""
        with self._lock:
            return any(r.source is None for r in self.live.values())

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

        Cancellations collected since the last step are applied first (so none is lost, whatever the device does
        next), and requests admitted in this step are live before any device work. If the pass that holds prompt
        rows fails (and the device is still usable), the requests of those rows end with an error and the decode
        rows run again by themselves; if the decode rows fail, their requests end with an error and the requests
        being prefilled go back to the head of the queue (they have sent nothing; they start their prefill again).
        Either way the step returns every output and frees every slot it took; the exception is kept in
        `last_fault` (None after a clean step) for the caller to judge.
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
            self._admit()
            decoding = [self.live[s] for s in sorted(self.live) if self.live[s].source is None]
            prefilling = sorted((r for r in self.live.values() if r.source is not None),
                                key=lambda r: (r.admitted_at, r.slot))
        chunks = self._chunks(prefilling)
        if chunks:
            chunked = [r for r, _, _ in chunks]
            try:
                if self.fault_hook is not None and decoding:
                    self.fault_hook("decode", decoding)
            except Exception as e:  # noqa: BLE001 - judged by the caller through last_fault
                return outputs + self._decode_failed(decoding, chunked, e)
            try:
                if self.fault_hook is not None:
                    self.fault_hook("prefill", chunked)
                return outputs + self._forward(decoding, chunks)
            except Exception as e:  # noqa: BLE001
                self.last_fault = e
                if is_fatal_device_error(e):
                    return outputs + self._fail(decoding + chunked, e)
                outputs += self._fail(chunked, e)  # the prompt rows' fault: their requests end, the others go on
        if decoding:
            try:
                if self.fault_hook is not None:
                    self.fault_hook("decode", decoding)
                outputs += self._forward(decoding, [])
            except Exception as e:  # noqa: BLE001
                outputs += self._decode_failed(decoding, [], e)
        return outputs

    def _decode_failed(self, decoding: list[Request], prefilling: list[Request], e: BaseException) -> list[Output]:
        """The decode rows failed: their requests end; `prefilling` (this step's prompt rows) start again later."""
        self.last_fault = e
        with self._lock:
            for r in reversed(prefilling):
                if self.live.get(r.slot) is r:
                    self._requeue(r)
        return self._fail(decoding, e)

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
        self._requeue(r)
        self.preemptions += 1

    def _requeue(self, r: Request) -> None:
        """Back to the head of the queue with no slot, no blocks: prefilled again from its first token."""
        self._release(r)
        r.slot, r.length, r.start, r.prefix_key, r.source = -1, 0, 0, None, None
        self._waiting.appendleft(r)

    def _admit(self) -> list[Request]:
        """Take waiting requests into free slots while the KV pool allows (in order: a request short of blocks waits,
        and so do those behind it); give each its prompt's blocks, a cached prefix shared. Their prompts are then
        prefilled over the next steps, `max_prefill_tokens` a step (`_chunks`)."""
        pool, admitted = self.blocks, []
        self._steps_since_admit += 1
        if self.live and self._steps_since_admit < self.admit_every:
            return admitted
        self._steps_since_admit = 0
        while self._waiting and self._free:
            r = self._waiting[0]
            n = self._source_len(r)
            need = pool.blocks_for(n)  # enough with or without a prefix hit
            if need > pool.free:
                self.prefix_cache.evict_until(need)
                if need > pool.free:
                    break
            self._waiting.popleft()
            r.slot = self._free.pop()
            if r.admitted_at is None:
                r.admitted_at = time.monotonic()
            self.live[r.slot] = r
            self._place(r, n)
            r.source = self._source(r)
            r.length = r.start
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

    def _chunks(self, prefilling: list[Request]) -> list[tuple[Request, int, int]]:
        """This step's prompt rows: (request, start, end) of the requests being prefilled, oldest first, at most
        `max_prefill_tokens` in all (at least one row). With passes apart (`batch_invariant` without the attention
        kernel), a chunk is cut where the request alone decides (its voice prefix, then every `max_prefill_tokens`
        tokens), never by its neighbours' use of the budget."""
        budget, chunks = self.max_prefill_tokens, []
        for r in prefilling:
            n = len(r.source)
            s = r.length
            end = min(n, s + (self.max_prefill_tokens if self.apart else budget))
            P = r.prompt.prefix_len
            if self.apart and s < P < len(r.prompt):  # the voice prefix by itself: as a cache hit leaves it
                end = min(end, P)
            if chunks and end - s > budget:
                break
            chunks.append((r, s, end))
            budget -= end - s
            if budget <= 0:
                break
        return chunks

    def _forward(self, decoding: list[Request], chunks: list[tuple[Request, int, int]]) -> list[Output]:
        """The step's device work: the slow AR over the decode rows and the prompt rows (one pass; `batch_invariant`
        without the attention kernel: decode rows and each chunk in passes of their own), then sampling and the fast
        AR for every decoding request and every request whose prompt ends here -> their outputs."""
        done = [r for r, s, e in chunks if e == len(r.source)]
        sampled = decoding + done
        fresh = [r for r, s, e in chunks if s == r.start]
        if fresh:
            self._set_slot_params(fresh)
        if self.apart:
            passes = ([(decoding, [])] if decoding else []) + [([], [c]) for c in chunks]
        else:
            passes = [(decoding, chunks)]
        first = 0
        for dec, ch in passes:
            first += self._slow_pass(dec, ch, first)
        for r in done:
            if r.frames:  # resumed after a preemption: the RAS window as it was (code 0 of the frames decoded)
                recent = [-1] * RAS_WINDOW + [int(f[0, 0]) for f in r.frames[1:]]
                self.recent[r.slot] = torch.tensor(recent[-RAS_WINDOW:], dtype=torch.int64, device=self.device)
        # code 0 of a first frame (step 0, sampled from the prompt) stays out of the RAS window, as upstream's
        steps = [r.generated for r in sampled]
        remember = [1] * len(decoding) + [int(bool(r.frames)) for r in done]
        frame, end = self._sample(sampled, steps, remember) if sampled else (None, None)
        for r in decoding:
            r.length += 1
        for r, s, e in chunks:
            r.length = e
            if r.prefix_key is not None and e >= r.prompt.prefix_len:  # its voice prefix is in: later requests share it
                self.prefix_cache.put(r.prefix_key, self.blocks.owned[r.slot], r.prompt.prefix_len)
                r.prefix_key = None
        for r in done:
            r.source = None
        return self._emit(sampled, frame, end) if sampled else []

    def _slow_pass(self, decoding: list[Request], chunks: list[tuple[Request, int, int]], first: int) -> int:
        """One pass over the slow AR: a row per decoding request (input: its last frame, at its length) and a row per
        prompt token of `chunks`; the final hidden of each sampled row (decode rows, the last row of a prompt that
        ends here) goes to h_sel[first + i] -> how many rows were sampled."""
        C, B = self.s2.num_codebooks, len(decoding)
        n = B + sum(e - s for _, s, e in chunks)
        rows = self.max_batch if self.apart and decoding else n
        keys = max([r.length + 1 for r in decoding] + [e for _, _, e in chunks])
        splits = self._splits_for(keys)
        size = self._bucket(self.row_sizes, rows) if self.pad_rows else rows
        io = self._pass_io(size, "cpu")
        if B:
            io[self._SLOT, :B] = torch.tensor([r.slot for r in decoding])
            io[self._POS, :B] = torch.tensor([r.length for r in decoding])
            io[self._SRC, :B] = torch.arange(B)
            io[self._DST, :B] = torch.arange(first, first + B)
        row, k = B, first + B
        runs = [(0, rows if self.apart else B, None)] if B else []  # invariant: the padding rows run too
        for r, s, e in chunks:
            src, m = r.source, e - s
            cols = slice(row, row + m)
            io[self._SLOT, cols], io[self._POS, cols], io[self._FROM_LAST, cols] = r.slot, torch.arange(s, e), 0
            io[self._TOKEN, cols], io[self._SEMANTIC, cols] = src.tokens[s:e], src.semantic[s:e].long()
            io[self._F_ROWS:, cols] = src.codes[s:e].T
            if e == len(src):
                io[self._SRC, k - first], io[self._DST, k - first] = row + m - 1, k
                k += 1
            runs.append((row, m, e))
            row += m
        self.passes += 1
        graph = self.graphs.get((size, splits))
        if graph is not None:
            graph[1].copy_(io, non_blocking=True)
            graph[0].replay()
        else:
            self._use_splits(splits)
            self._slow_core(io.to(self.device), None if self.flat else runs)
        return k - first

    def _pass_io(self, size: int, device) -> torch.Tensor:
        """A pass's rows, all padding: the scratch slot at position 0, fed its last frame, its hidden put into
        h_sel's scratch row."""
        io = torch.zeros(self._F_ROWS + self.s2.num_codebooks, size, dtype=torch.int64, device=device)
        io[self._SLOT], io[self._FROM_LAST], io[self._DST] = self.scratch, 1, self.h_sel.shape[0] - 1
        return io

    def _slow_core(self, io: torch.Tensor, runs=None) -> None:
        """Device part of a pass (what the graphs capture): embed each row's token (a decode row's from its slot's
        last frame), run the slow AR, put the sampled rows' final hidden into h_sel. Every row is a one-token
        sequence at its own slot and position (the attention kernel reads each row's keys up to its position); without
        the kernel (`runs`: (first row, rows, keys) of the decode rows, None, and of each prompt chunk), the decode
        rows run as one batch and each chunk as a sequence."""
        slots, pos = io[self._SLOT], io[self._POS]
        prev = self.last_codes[slots]  # [N, C]
        last = io[self._FROM_LAST].bool()
        codes = torch.where(last[:, None], prev, io[self._F_ROWS:].T)
        tokens = torch.where(last, prev[:, 0] + self.s2.semantic_start_id, io[self._TOKEN])
        x = self.model.embed(tokens[:, None], codes[:, None, :], (last | io[self._SEMANTIC].bool())[:, None])
        stack = self.model.slow.stack
        if runs is None:
            hidden = stack.run(x, pos[:, None], slots)[:, 0]
        else:
            hidden = torch.empty(x.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
            for r0, m, keys in runs:
                if keys is None:  # decode rows (invariant: over every key position, whatever the neighbours' lengths)
                    p = pos[r0 : r0 + m, None]
                    keys = self.max_seq_len if self.apart else int(p.max()) + 1
                    hidden[r0 : r0 + m] = stack.run(x[r0 : r0 + m], p, slots[r0 : r0 + m], keys)[:, 0]
                else:
                    hidden[r0 : r0 + m] = stack.run(x[r0 : r0 + m].transpose(0, 1), pos[None, r0 : r0 + m],
                                                    slots[r0 : r0 + 1], keys)[0]
        self.h_sel.index_copy_(0, io[self._DST], hidden.index_select(0, io[self._SRC]))

    def _sample(self, reqs: list[Request], steps: list[int], remember: list[int]):
        """Code 0 and the fast AR for the rows h_sel[:len(reqs)] -> (frame [B, C], end [B])."""
        B = len(reqs)
        size = self._bucket(self.sample_sizes, B) if self.pad_rows or self.apart else B
        io = torch.zeros(3, size, dtype=torch.int64)
        io[0] = self.scratch
        io[0, :B], io[1, :B], io[2, :B] = torch.tensor([r.slot for r in reqs]), torch.tensor(steps), torch.tensor(remember)
        graph = self.sample_graphs.get(size)
        if graph is not None:
            graph[1].copy_(io, non_blocking=True)
            graph[0].replay()
            frame, end = graph[2]
        else:
            frame, end, logits = self._sample_core(io.to(self.device))
            if self.logits_hook is not None:
                self.logits_hook([r.id for r in reqs], logits[:B])
        return frame[:B], end[:B]

    def _sample_core(self, io: torch.Tensor):
        """Device part of sampling (what the sample graphs capture): io [3, B] = slot, step, remember per row."""
        hidden = self.h_sel[: io.shape[1]]
        logits = self.model.slow.logits(hidden)
        frame, end = self._sample_frame(io[0], hidden, logits, io[1], io[2].bool())
        return frame, end, logits

    @staticmethod
    def _buckets(limit: int) -> tuple[int, ...]:
        return tuple(b for b in Engine.ROW_BUCKETS if b < limit) + (limit,)

    @staticmethod
    def _bucket(sizes: tuple[int, ...], n: int) -> int:
        return next(b for b in sizes if b >= n)

    def _splits_for(self, keys: int) -> int:
        """Decode splits of a step whose longest request attends to `keys` keys."""
        return self.decode_splits if self.batch_invariant or keys > self.SPLIT_FROM else 1

    def _use_splits(self, n: int) -> None:
        for layer in self.model.slow.layers:
            layer.attention.decode_splits = n

    def _decode_core(self, slots, pos, step):
        """One decode step of the rows slots [B] at positions pos [B, 1] on the device (perf tools time this)."""
        B = slots.shape[0]
        io = self._pass_io(B, slots.device)
        io[self._SLOT], io[self._POS] = slots, pos[:, 0]
        io[self._SRC] = io[self._DST] = torch.arange(B, device=slots.device)
        self._slow_core(io)
        sio = torch.stack([slots, step, torch.ones_like(step)])
        return self._sample_core(sio)[:2]

    def _sample_frame(self, slots, hidden, logits, step, remember):
        """Sample code 0 (or the end token) with RAS, run the fast AR, update slot state -> (frame [B, C], end [B]).
        `remember` [B] bool: code 0 enters the row's RAS window (not for a first frame)."""
        temp, top_p, top_k, seed = self.temperature[slots], self.top_p[slots], self.top_k[slots], self.seed[slots]
        end_col = torch.arange(logits.shape[-1], device=logits.device) == self.model.slow.end_index
        logits = logits.masked_fill(end_col[None, :] & ~self.allow_end[slots][:, None], float("-inf"))
        recent = self.recent[slots]
        idx = sample_semantic(logits, recent, temp, top_p, top_k, seed, step, kernel=self.sample_kernel)
        end = idx == self.model.slow.end_index
        code0 = idx.clamp(max=self.s2.num_semantic - 1)
        residual = self.fast_ar(hidden, code0, temp, top_p, top_k, seed, step)
        frame = torch.cat([code0[:, None], residual.to(code0.dtype)], dim=1)
        self.last_codes[slots] = frame
        self.recent[slots] = torch.where(remember[:, None], torch.cat([recent[:, 1:], code0[:, None]], dim=1), recent)
        return frame, end

    def _capture_graphs(self) -> None:
        """Capture a pass per row bucket (and way of splitting keys) and sampling per batch bucket, on the scratch
        slot, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        dev, C = self.device, self.s2.num_codebooks
        stream = torch.cuda.Stream(dev)
        variants = sorted({self._splits_for(1), self._splits_for(self.max_seq_len)})

        def capture(fn):
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):
                    fn()
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                out = fn()
            return graph, out

        for size in sorted(self.row_sizes, reverse=True):
            io = self._pass_io(size, dev)
            for splits in variants:  # one graph per way of splitting the keys (they share io)
                self._use_splits(splits)
                self.graphs[(size, splits)] = (capture(lambda: self._slow_core(io))[0], io)
        for size in sorted(self.sample_sizes, reverse=True):
            io = torch.zeros(3, size, dtype=torch.int64, device=dev)
            io[0] = self.scratch
            graph, out = capture(lambda: self._sample_core(io)[:2])
            self.sample_graphs[size] = (graph, io, out)
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
                    "prefilling": sum(r.source is not None for r in self.live.values()),
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
