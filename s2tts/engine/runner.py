"""The engine's model runner: everything on the device. It runs the scheduler's `StepPlan`s.

It owns the model's KV pools and block table (`ar.model.Stack.setup_caches`), the per-slot sampling state (seed,
temperature, top-p/k, the RAS window, each slot's last frame) in device tensors, and the CUDA graphs. A step
(`launch`) is one pass over the slow AR's weights in which every token is a row with its own slot and position:
one row per decoding request (its last frame) and the plan's prompt rows (attention reads each row's keys from the
paged cache up to its own position, so prompt rows are causal); then one batch samples code 0 and runs the fast AR
for every request that gets a frame. The pass is captured as a CUDA graph per row bucket (and way of splitting the
keys), the sampling per batch bucket; the step's frames reach the host in one copy, its one synchronisation
(`launch` queues a step and returns; `collect` waits for its frames: the host may do other work in between).
Nothing in a launch waits for the device: host data goes up through `gpu.transfer.upload` / `copy_in`, and no Python
number is written through a device index (that is a copy from pageable memory, which waits for the step in flight;
tests/test_launch_ahead.py checks both).

Slot `max_batch` is the scratch slot: the padding rows of a graph's bucket read and write it, never a live
request's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import sizing
from ..ar import kernels
from ..ar.model import S2Model, use_invariant_linears, use_triton_kernels
from ..ar.sampling import RAS_WINDOW, sample, sample_semantic
from ..gpu import jit
from ..gpu.cuda_graphs import capture as capture_graph, own_stream
from ..gpu.transfer import copy_in, upload
from .config import EngineConfig
from .paged import BlockPool
from .scheduler import PrefillChunk, Request, StepPlan, StepResult


class InProcessFastAR:
    """Runs the fast AR in the engine's process: (hidden, code0, sampling tensors) -> residual codes."""

    def __init__(self, model: S2Model, residual_size: int, kernel: bool = False):
        self.model = model
        self.residual_size = residual_size
        self.kernel = kernel  # Triton sampling kernel (set by the runner on GPU)

    def __call__(self, hidden, code0, temperature, top_p, top_k, seed, step):
        def sample_fn(logits, k):
            return sample(logits, temperature, top_p, top_k, seed, step, stream=1 + k, kernel=self.kernel)

        return self.model.fast.generate(hidden, code0, sample_fn, self.residual_size)


class HostFastAR:
    """Marker base for fast-AR runners that leave the device (e.g. BLS): no CUDA graphs around them."""


@dataclass
class Launched:
    """A plan's device work, queued (`ModelRunner.launch`): its sampled rows' frames and end flags [B, C + 1] on
    their way to the host (None: the plan sampled nothing), and the event that says they are there (None on a CPU,
    where they already are)."""

    rows: torch.Tensor | None
    ready: object | None


class ModelRunner:
    # rows of a pass (decode rows + prompt tokens) and of a sampling batch are padded to one of these (CUDA graphs)
    ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1536, 2048,
                   3072, 4096, 6144, 8192)
    SPLIT_FROM = 2048  # keys of the longest row above which a pass splits each row's keys
    # A pass of up to FEW_ROWS rows (one to four streams decoding) splits each row's keys FEW_ROWS_SPLITS ways, in
    # parts of at least FEW_ROWS_MIN_SPLIT keys, at any length: its (rows x KV heads) programs would leave most SMs
    # idle (a shorter step at 1-4 rows even with short contexts). 0 rows: off.
    FEW_ROWS, FEW_ROWS_SPLITS, FEW_ROWS_MIN_SPLIT = 4, 4, 32
    # a pass's rows on the device, one column per row: [_F_ROWS + num_codebooks, rows] int64
    _SLOT, _POS, _TOKEN, _SEMANTIC, _FROM_LAST, _SRC, _DST, _F_ROWS = range(8)

    @staticmethod
    def kv_token_bytes(cfg, dtype) -> int:
        """Bytes of one token's keys and values in every layer of the slow AR."""
        return sizing.kv_token_bytes(cfg, torch.empty((), dtype=dtype).element_size())

    @classmethod
    def kv_tokens_in(cls, gib: float, cfg, dtype, block: int, max_seq_len: int) -> int:
        """The tokens a KV pool of `gib` GiB holds, in whole blocks (`kv_cache_memory_gb`); ValueError naming what
        to change when that is not one request of max_seq_len."""
        per = cls.kv_token_bytes(cfg, dtype)
        tokens = int(gib * (1 << 30)) // per // block * block
        if tokens < max_seq_len:
            raise ValueError(f"kv_cache_memory_gb={gib:g} holds {tokens} tokens ({per / 1024:.1f} KiB a token): not one "
                             f"request of max_seq_len={max_seq_len}; raise kv_cache_memory_gb to at least "
                             f"{max_seq_len * per / (1 << 30):.3g} or lower max_seq_len")
        return tokens

    def __init__(self, model: S2Model, residual_size: int, config: EngineConfig, fast_ar=None):
        """The device side of an engine as `config` says (`EngineConfig`; `Engine` bounds its max_seq_len by the
        checkpoint's). Allocates the KV pools (`num_blocks` of `block_size` tokens, one of them the null block) and,
        with `cuda_graphs`, captures the graphs. `decode_splits` (default `default_splits`): programs that share one
        row's keys in the attention kernel, used while some row has more than `SPLIT_FROM` keys (with
        `batch_invariant`, always); passes of up to `FEW_ROWS` rows split short rows too. `dependent_launch`: the
        decode step's kernels launched with programmatic dependent launch where the device supports it
        (`kernels.pdl_supported`), in passes of up to `kernels.GEMV_SMALL_ROWS` rows."""
        c = config
        max_batch, max_seq_len, max_prefill_tokens = c.max_batch, c.max_seq_len, c.max_prefill_tokens
        batch_invariant, cuda_graphs, decode_kernel = c.batch_invariant, c.cuda_graphs, c.decode_kernel
        fused_kernels, row_buckets, decode_splits = c.fused_kernels, c.row_buckets, c.decode_splits
        s2 = model.s2
        self.model, self.s2 = model, s2
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.batch_invariant = batch_invariant
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        on_cuda = self.device.type == "cuda"
        if on_cuda:  # Triton kernels and CUDA graphs run on the thread's current device: make it this one
            torch.cuda.set_device(self.device)
        self.scratch = max_batch
        self.block_size = c.kv_block_tokens or max_seq_len
        kv_tokens = c.kv_tokens
        if kv_tokens is None:
            kv_tokens = self.kv_tokens_in(c.kv_cache_memory_gb, model.slow.stack.cfg, self.dtype, self.block_size,
                                          max_seq_len)
        if kv_tokens < max_seq_len:
            raise ValueError(f"kv_cache_tokens={kv_tokens} cannot hold one request of max_seq_len={max_seq_len} "
                             "tokens: raise kv_cache_tokens or lower max_seq_len")
        self.num_blocks = -(-kv_tokens // self.block_size) + 1
        stack = model.slow.stack
        stack.setup_caches(max_batch + 1, max_seq_len, self.dtype, self.device, block_size=self.block_size,
                           num_blocks=self.num_blocks)
        self.block_bytes = 2 * stack.k_pool[:, 0].nbytes  # keys and values of one block in every layer
        model.fast.setup_caches(max_batch + 1, self.dtype, self.device)
        self.fast_ar = fast_ar or InProcessFastAR(model, residual_size)
        if decode_kernel is None:
            decode_kernel = on_cuda and jit.available()
        if decode_splits is None:
            decode_splits = self.default_splits(max_seq_len)
        if decode_splits < 1 or decode_splits & (decode_splits - 1):
            raise ValueError(f"decode_splits={decode_splits}: use a power of two")
        self.decode_splits = decode_splits
        self.min_split = model.slow.layers[0].attention.decode_min_split  # least keys a split takes (long rows)
        for st in (model.slow.stack, model.fast.stack):
            for layer in st.layers:
                layer.attention.decode_kernel = decode_kernel
                layer.attention.decode_splits = 1
                layer.attention.rows_invariant = batch_invariant
        if fused_kernels is None:
            fused_kernels = decode_kernel

        use_triton_kernels(model, bool(fused_kernels))
        if on_cuda and fused_kernels:
            self.dependent_launch = c.dependent_launch is not False and kernels.pdl_supported(self.device)
        else:
            self.dependent_launch = False
        self.sample_kernel = bool(fused_kernels)
        if isinstance(self.fast_ar, InProcessFastAR):
            self.fast_ar.kernel = self.sample_kernel
        self.logits_hook = None  # optional observer: fn(request_ids, logits [B, V]) (tests, debugging)
        self._host: list[torch.Tensor] = []  # page-locked buffers of launched plans' frames, used in turn (GPU)
        self._turn = 0

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
        # as usual; without it (CPU), decode rows and each prompt chunk in passes of their own, at one shape
        self.apart = batch_invariant and not decode_kernel
        limit = max(max_batch, max_prefill_tokens) if self.apart else max_batch + max_prefill_tokens
        use_invariant_linears(model, max(limit, 2 * max_batch) if batch_invariant and not self.apart else 0)
        # a pass's rows, and where each sampled row's final hidden goes: h_sel[dst] (its last row is scratch)
        self.row_sizes = self._buckets(limit)
        self.sample_sizes = (max_batch,) if self.apart else self._buckets(max_batch)
        self.h_sel = torch.zeros(self.row_sizes[-1] + 1, s2.text.dim, dtype=self.dtype, device=dev)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (rows, decode splits) -> captured pass over the slow AR
        self.warm_s: dict[str, float] = {}  # seconds of each part of the graphs' making (a GPU's)
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

    # ---- a step ---------------------------------------------------------------------------------
    def apply(self, pool: BlockPool) -> None:
        """Bring the device up to the pool's changes: its block copies, then its changed block-table rows."""
        copies, rows = pool.take_changes()
        stack = self.model.slow.stack
        if copies:
            stack.copy_blocks(copies)
        if rows:
            stack.block_table.index_copy_(0, upload(torch.tensor(rows, dtype=torch.int64), self.device),
                                          upload(torch.from_numpy(pool.table[rows]), self.device))

    def launch(self, plan: StepPlan) -> Launched:
        """Queue the plan's device work: the slow AR over its decode and prompt rows (one pass; `batch_invariant`
        without the attention kernel: decode rows and each chunk in passes of their own), then sampling and the fast
        AR for `plan.sampled`, and the copy of their frames to the host; on a GPU it returns before they are made.
        The caller has `apply`d the pool first, and `collect`s it before launching a third plan (the frames of two
        plans in flight wait in two host buffers; the graphs' outputs are copied before the next plan's run)."""
        if plan.starts:
            self._set_slot_params(plan.starts)
        if self.apart:
            passes = ([(plan.decode, [])] if plan.decode else []) + [([], [c]) for c in plan.prefill]
        else:
            passes = [(plan.decode, plan.prefill)]
        first = 0
        for dec, ch in passes:
            first += self._slow_pass(dec, ch, first)
        sampled = plan.sampled
        if not sampled:
            return Launched(None, None)
        done = sampled[len(plan.decode):]
        for r in done:
            if r.frames:  # resumed after a preemption: the RAS window as it was (code 0 of the frames decoded)
                recent = [-1] * RAS_WINDOW + [int(f[0, 0]) for f in r.frames[1:]]
                self.recent[r.slot] = upload(torch.tensor(recent[-RAS_WINDOW:], dtype=torch.int64), self.device)
        # code 0 of a first frame (step 0, sampled from the prompt) stays out of the RAS window, as upstream's
        steps = [r.generated for r in sampled]
        remember = [1] * len(plan.decode) + [int(bool(r.frames)) for r in done]
        frame, end = self._sample(sampled, steps, remember)
        rows = torch.cat([frame, end[:, None].to(frame.dtype)], dim=1)
        if self.device.type != "cuda":
            return Launched(rows, None)
        if not self._host:  # page-locked, so that the copy runs behind the step instead of waiting for it; two, for
            # two plans in flight (`Engine.step_ahead`)
            self._host = [torch.empty(self.max_batch + 1, rows.shape[1], dtype=rows.dtype, pin_memory=True)
                          for _ in range(2)]
        self._turn ^= 1
        host = self._host[self._turn][: rows.shape[0]]
        host.copy_(rows, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return Launched(host, ready)

    def collect(self, launched: Launched) -> StepResult:
        """Wait for a launched plan's frames -> its `StepResult` (arrays of its own: the host buffers are reused)."""
        if launched.rows is None:
            return StepResult(np.zeros((0, self.s2.num_codebooks), dtype=np.int32), np.zeros(0, dtype=bool))
        if launched.ready is not None:
            launched.ready.synchronize()
        host = launched.rows.numpy()
        return StepResult(host[:, :-1].astype(np.int32), host[:, -1].astype(bool))

    def _set_slot_params(self, reqs: list[Request]) -> None:
        """The starting requests' sampling parameters into their slots' rows: two uploads (integers, floats) queued
        behind the step in flight (`gpu.transfer.upload`), then scatters on the device; nothing here waits for the
        device."""
        ints = upload(torch.tensor([[r.slot, r.params.top_k, r.seed, int(not r.params.ignore_end)] for r in reqs],
                                   dtype=torch.int64), self.device)
        floats = upload(torch.tensor([[r.params.temperature, r.params.top_p] for r in reqs], dtype=torch.float32),
                        self.device)
        slots = ints[:, 0]
        self.temperature[slots], self.top_p[slots] = floats[:, 0], floats[:, 1]
        self.top_k[slots], self.seed[slots], self.allow_end[slots] = ints[:, 1], ints[:, 2], ints[:, 3].bool()
        # not `recent[slots] = -1`: a Python number put through a device index is copied from pageable host memory,
        # which waits for the step in flight (the prompt's first step would be launched late)
        self.recent.index_fill_(0, slots, -1)

    def _slow_pass(self, decoding: list[Request], chunks: list[PrefillChunk], first: int) -> int:
        """One pass over the slow AR: a row per decoding request (input: its last frame, at its length) and a row per
        prompt token of `chunks`; the final hidden of each sampled row (decode rows, the last row of a prompt that
        ends here) goes to h_sel[first + i] -> how many rows were sampled."""
        B = len(decoding)
        n = B + sum(e - s for _, s, e in chunks)
        rows = self.max_batch if self.apart and decoding else n
        keys = max([r.length + 1 for r in decoding] + [e for _, _, e in chunks])
        size = self._bucket(self.row_sizes, rows) if self.pad_rows else rows
        split = self._split_for(keys, size)
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
        graph = self.graphs.get((size, split))
        if graph is not None:
            copy_in(graph[1], io)
            graph[0].replay()
        else:
            self._use_split(split)
            self._slow_core(upload(io, self.device), None if self.flat else runs)
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
        with self._launch_mode(io.shape[1]):
            self._slow_body(io, runs)

    def _slow_body(self, io: torch.Tensor, runs) -> None:
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
        io = self._sample_io(size, "cpu")
        io[0, :B], io[1, :B], io[2, :B] = torch.tensor([r.slot for r in reqs]), torch.tensor(steps), torch.tensor(remember)
        graph = self.sample_graphs.get(size)
        if graph is not None:
            copy_in(graph[1], io)
            graph[0].replay()
            frame, end = graph[2]
        else:
            frame, end, logits = self._sample_core(upload(io, self.device))
            if self.logits_hook is not None:
                self.logits_hook([r.id for r in reqs], logits[:B])
        return frame[:B], end[:B]

    def _sample_core(self, io: torch.Tensor):
        """Device part of sampling (what the sample graphs capture): io [3, B] = slot, step, remember per row."""
        with self._launch_mode(io.shape[1]):
            return self._sample_body(io)

    def _sample_body(self, io: torch.Tensor):
        hidden = self.h_sel[: io.shape[1]]
        logits = self.model.slow.logits(hidden)
        frame, end = self._sample_frame(io[0], hidden, logits, io[1], io[2].bool())
        return frame, end, logits

    @staticmethod
    def _buckets(limit: int) -> tuple[int, ...]:
        return tuple(b for b in ModelRunner.ROW_BUCKETS if b < limit) + (limit,)

    @staticmethod
    def _bucket(sizes: tuple[int, ...], n: int) -> int:
        return next(b for b in sizes if b >= n)

    @classmethod
    def default_splits(cls, max_seq_len: int) -> int:
        """`decode_splits` when not given: enough programs a row that a row of max_seq_len keys is split in parts
        of about SPLIT_FROM keys (a power of two, at most 16)."""
        return min(16, 1 << max(0, -(-max_seq_len // cls.SPLIT_FROM) - 1).bit_length())

    def split_rule(self, keys: int, rows: int, decode_splits: int, min_split: int,
                   batch_invariant: bool = False) -> tuple[int, int]:
        """How a pass of `rows` rows (its row bucket) whose longest row attends to `keys` keys splits each row's keys
        in the attention kernel -> (programs, least keys each): `decode_splits` in parts of at least `min_split`
        past SPLIT_FROM keys (always with `batch_invariant`: never by the rows), else FEW_ROWS_SPLITS at up to
        FEW_ROWS rows, else none. `self`: a runner (its SPLIT_FROM and FEW_ROWS*), or the class itself for their
        defaults (`ModelRunner.split_rule(ModelRunner, ...)`)."""
        if batch_invariant or keys > self.SPLIT_FROM:
            return decode_splits, min_split
        if rows <= self.FEW_ROWS:
            return self.FEW_ROWS_SPLITS, self.FEW_ROWS_MIN_SPLIT
        return 1, min_split

    def _split_for(self, keys: int, rows: int) -> tuple[int, int]:
        """This engine's `split_rule`."""
        return self.split_rule(keys, rows, self.decode_splits, self.min_split, self.batch_invariant)

    def _use_split(self, split: tuple[int, int]) -> None:
        for layer in self.model.slow.layers:
            layer.attention.decode_splits, layer.attention.decode_min_split = split

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
        recent = self.recent[slots]
        idx = sample_semantic(logits, recent, temp, top_p, top_k, seed, step, kernel=self.sample_kernel,
                              end_index=self.model.slow.end_index, allow_end=self.allow_end[slots])
        end = idx == self.model.slow.end_index
        code0 = idx.clamp(max=self.s2.num_semantic - 1)
        residual = self.fast_ar(hidden, code0, temp, top_p, top_k, seed, step)
        frame = torch.cat([code0[:, None], residual.to(code0.dtype)], dim=1)
        self.last_codes[slots] = frame
        self.recent[slots] = torch.where(remember[:, None], torch.cat([recent[:, 1:], code0[:, None]], dim=1), recent)
        return frame, end

    def _launch_mode(self, rows: int):
        """Dependent launch for the kernels of a pass of `rows` rows (captured with it): only up to
        `kernels.GEMV_SMALL_ROWS`, where the products are Triton kernels that take part. Among cuBLAS's products (more
        rows) it saves nothing and the step's pieces take a little longer."""
        return kernels.dependent_launch(self.dependent_launch and rows <= kernels.GEMV_SMALL_ROWS)

    def _splits(self, size: int) -> set:
        """The ways of splitting the keys a pass of `size` rows is captured with (one graph each)."""
        return {self._split_for(1, size), self._split_for(self.max_seq_len, size)}

    def _sample_io(self, size: int, device) -> torch.Tensor:
        """Sampling's rows, all padding: [3, size] = slot (the scratch slot), step, remember."""
        io = torch.zeros(3, size, dtype=torch.int64, device=device)
        io[0] = self.scratch
        return io

    def _compile_ahead(self) -> None:
        """Every pass and sampling the graphs will hold compiled ahead, as compiles alone, all at once
        (`gpu.jit.compile_only`; sampling's draws are rank 0 meanwhile), each launching in its own pass's mode
        (`_launch_mode`)."""
        dev = self.device

        def slow_pass(s, split):
            def run():
                self._use_split(split)
                with torch.inference_mode():
                    self._slow_core(self._pass_io(s, dev))
            return run

        def sampling(s):
            def run():
                with torch.inference_mode():
                    self._sample_core(self._sample_io(s, dev))
            return run

        # nothing of either steers the host, and nothing they leave behind is read before the graphs' own runs
        jit.compile_only([slow_pass(s, split) for s in self.row_sizes for split in sorted(self._splits(s))]
                         + [sampling(s) for s in self.sample_sizes])

    def _capture_graphs(self) -> None:
        """Capture a pass per row bucket (and way of splitting keys) and sampling per batch bucket, on the scratch
        slot, sharing one memory pool, on the runner's own capture stream (`gpu.cuda_graphs.own_stream`: the codec's
        graphs may replay beside these and must not share their cuBLAS workspace)."""
        pool = torch.cuda.graph_pool_handle()
        dev = self.device
        stream = self._capture_stream = own_stream(dev)  # held while the graphs live

        def capture(fn):
            with torch.inference_mode():
                return capture_graph(fn, stream, pool)

        t0 = time.monotonic()
        self._compile_ahead()
        t1 = time.monotonic()
        for size in sorted(self.row_sizes, reverse=True):
            io = self._pass_io(size, dev)
            for split in sorted(self._splits(size)):
                self._use_split(split)  # one graph per way of splitting the keys (they share io)
                self.graphs[(size, split)] = (capture(lambda: self._slow_core(io))[0], io)
        for size in sorted(self.sample_sizes, reverse=True):
            io = self._sample_io(size, dev)
            graph, out = capture(lambda: self._sample_core(io)[:2])
            self.sample_graphs[size] = (graph, io, out)
        torch.cuda.synchronize(dev)
        self.warm_s = {"kernels compiled side by side": t1 - t0, "CUDA graphs": time.monotonic() - t1}
