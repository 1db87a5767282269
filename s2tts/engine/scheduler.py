"""The engine's scheduler: which requests run in the next step, and with which rows. Plain Python, no device.

It owns the requests' queues and slots, the KV block pool (`paged.BlockPool`, host side) and the prefix cache, and
decides, step by step:
- admission: waiting requests take free slots, in order, while the pool has blocks for their prompts (a cached
  voice prefix shared); while requests decode, arrivals join every `admit_every` steps so that they start their
  prefill together;
- growth: a live request that crosses into a new block gets one; when blocks run short the prefix cache gives
  its blocks back first, then the request admitted last is preempted (its slot and blocks freed; it waits at the
  head of the queue, to be prefilled again with the frames it has produced as part of its prompt);
- the step's rows (`StepPlan`): one decode row per request past its prompt, and up to `max_prefill_tokens` prompt
  tokens of the requests being prefilled, oldest first (chunked prefill).

`schedule()` returns the plan, the model runner runs it (`runner.ModelRunner.launch`, then `collect` -> `StepResult`), and
`update(plan, result)` advances the requests and returns their `Output`s. A caller that launches the next plan
before the last one's frames are known calls `advance(plan)` at its launch and `complete(plan, result)` once its
frames are there: the next plan builds on the advanced lengths, and rows of requests that ended meanwhile (an end
token in the step before, a cancel, a preemption) are dropped. A request is a `Request` (the id the
caller chose, its prompt and sampling parameters, and what the scheduler tracks). Not thread-safe: the engine
core calls it from its one thread, under its lock.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from ..ar.sampling import SamplingParams
from .config import EngineConfig
from .paged import BlockPool
from .prefix_cache import PrefixCache
from .prompt import Prompt

FINISH_END, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "end", "length", "cancelled", "error"


@dataclass
class Request:
    id: str
    prompt: Prompt
    params: SamplingParams
    max_new: int  # frames it may produce (its params' limit, within the sequence length)
    seed: int
    # the scheduler's state
    slot: int = -1
    length: int = 0  # tokens in this request's KV cache
    generated: int = 0  # frames launched (steps planned and run or in flight that sample it)
    frames: list = field(default_factory=list)  # the frames produced, kept to resume after a preemption
    tenure: int = 0  # changes whenever it leaves its slot (ended, preempted): rows planned before are then stale
    start: int = 0  # prompt tokens already in its blocks at admission (a cached voice prefix)
    prefix_key: str | None = None  # set when its prefilled prefix should enter the prefix cache
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None  # when it got a KV slot
    source: Prompt | None = None  # what it still prefills (prompt, and produced frames after a preemption); None: decoding

    @property
    def planned_all(self) -> bool:
        """Its last frame (max_new) is launched: no more rows for it."""
        return self.generated >= self.max_new


@dataclass
class Output:
    """What one request produced in one step."""

    request_id: str
    codes: np.ndarray  # [n, num_codebooks] int32 new frames (n may be 0)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    exception: BaseException | None = None  # with FINISH_ERROR: what failed
    queue_s: float | None = None  # on a request's first output: seconds it waited for a KV slot


class PrefillChunk(NamedTuple):
    """Prompt rows of one request in a step: tokens [start, end) of its `source`."""

    request: Request
    start: int
    end: int

    @property
    def last(self) -> bool:
        """Whether its prompt ends here (its first frame is sampled in this step)."""
        return self.end == len(self.request.source)


@dataclass
class StepPlan:
    """What one step runs: a decode row per request in `decode` (its last frame, at its length), the prompt rows of
    `prefill`; `starts`: requests whose first prompt rows are in this step (their sampling state is set first)."""

    decode: list[Request]
    prefill: list[PrefillChunk]
    starts: list[Request]
    tenures: list[int] | None = None  # the sampled requests' tenures when it was launched (`Scheduler.advance`)

    @cached_property
    def sampled(self) -> list[Request]:
        """The requests that get a frame this step, in the order of `StepResult`'s rows (fixed when first asked:
        `Scheduler.advance` moves its requests past their prompts)."""
        return self.decode + [c.request for c in self.prefill if c.last]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    def decode_only(self) -> "StepPlan":
        return StepPlan(self.decode, [], [])


@dataclass
class StepResult:
    """What the model runner made for `plan.sampled`, one row each: the frame [B, C] int32 and whether the request's
    end token was sampled instead [B] bool (then its frame is not one)."""

    frames: np.ndarray
    ended: np.ndarray


class Scheduler:
    def __init__(self, config: EngineConfig, *, num_codebooks: int, semantic_start_id: int, num_blocks: int,
                 block_size: int, block_bytes: int, prefix_apart: bool = False):
        """`config.max_batch` slots (slot `max_batch` is the runner's scratch slot: never a request's); a pool of
        `num_blocks` KV blocks of `block_size` tokens (`block_bytes` each, for the prefix cache's budget of
        `config.prefix_cache_mb`); `prefix_apart`: a prompt chunk never spans the end of its voice prefix (so a
        prefix-cache hit leaves the same keys and values as a miss when each chunk runs by itself: `batch_invariant`
        without the attention kernel)."""
        self.check_prefill_budget(config.max_prefill_tokens)
        max_batch, max_seq_len = config.max_batch, config.max_seq_len
        self.max_batch, self.max_seq_len, self.C = max_batch, max_seq_len, num_codebooks
        self.semantic_start_id = semantic_start_id
        self.max_prefill_tokens, self.prefix_apart = config.max_prefill_tokens, prefix_apart
        self.admit_every = max(1, config.admit_every_steps)
        self.pool = BlockPool(num_blocks, block_size, max_batch + 1, max_seq_len)
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes, self.pool, block_bytes)
        self.waiting: deque[Request] = deque()
        self.live: dict[int, Request] = {}  # slot -> request
        self._free = list(range(max_batch - 1, -1, -1))
        self.preemptions = 0
        self._steps_since_admit = 0

    @staticmethod
    def check_prefill_budget(max_prefill_tokens: int) -> None:
        """Raises ValueError (with what to change) for a prefill budget a scheduler cannot use."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens}: use at least 1 (tokens of prompts per step)")

    # ---- requests in and out ---------------------------------------------------------------
    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        """A request for `add`. Raises ValueError (with what to change) if it can never run."""
        params.validate()
        n = len(prompt)
        if n + 1 >= self.max_seq_len:
            raise ValueError(f"prompt is {n} tokens, over this server's limit of {self.max_seq_len - 2}: shorten the "
                             "text or the reference")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return Request(request_id, prompt, params, max_new=min(params.max_new_tokens, self.max_seq_len - n - 1), seed=seed)

    def add(self, r: Request) -> None:
        self.waiting.append(r)

    def abort(self, ids: set[str]) -> list[Output]:
        """End the requests of these ids, waiting or live (ids of no request are ignored)."""
        out = [self._ended(r, FINISH_CANCELLED) for r in self.waiting if r.id in ids]
        if out:
            self.waiting = deque(r for r in self.waiting if r.id not in ids)
        for r in [r for r in self.live.values() if r.id in ids]:
            out.append(self._ended(r, FINISH_CANCELLED))
            self._release(r)
        return out

    def fail(self, reqs: list[Request], e: BaseException) -> list[Output]:
        """End these requests with an error (their step failed); those that already ended are left alone."""
        reqs = [r for r in reqs if self.live.get(r.slot) is r]
        for r in reqs:
            self._release(r)
        msg = f"{type(e).__name__}: {e}"
        return [self._ended(r, FINISH_ERROR, error=msg, exception=e) for r in reqs]

    def fail_all(self, message: str) -> list[Output]:
        """End every request, waiting or live, with an error and free every slot."""
        reqs = list(self.waiting) + list(self.live.values())
        self.waiting.clear()
        for r in reqs:
            self._release(r)
        return [self._ended(r, FINISH_ERROR, error=message) for r in reqs]

    def requeue(self, reqs: list[Request]) -> None:
        """Back to the head of the queue, in this order, with no slot and no blocks: prefilled again from their first
        token (requests whose prompt rows were in a step that failed for another reason)."""
        for r in reversed(reqs):
            if self.live.get(r.slot) is r:
                self._requeue(r)

    # ---- a step ---------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Blocks for the requests that cross into a new one (preempting if short), admissions, then this step's
        rows: every decoding request, and prompt chunks within `max_prefill_tokens`."""
        self._grow()
        self._admit()
        decode = [self.live[s] for s in sorted(self.live) if self.live[s].source is None and not self.live[s].planned_all]
        prefilling = sorted((r for r in self.live.values() if r.source is not None), key=lambda r: (r.admitted_at, r.slot))
        prefill = self._chunks(prefilling)
        starts = [c.request for c in prefill if c.start == c.request.start]
        return StepPlan(decode, prefill, starts)

    def update(self, plan: StepPlan, result: StepResult) -> list[Output]:
        """The plan ran: `advance` then `complete` (a caller that waits for each step before the next plan)."""
        self.advance(plan)
        return self.complete(plan, result)

    def advance(self, plan: StepPlan) -> None:
        """The plan is launched: its requests' lengths and frame counts become what they are once it has run, so that
        the next plan builds on it before its frames are known (a voice prefix now in the KV cache enters the prefix
        cache; a request whose last frame is launched gets no more rows)."""
        sampled = plan.sampled
        for r in plan.decode:
            r.length += 1
        for r, s, e in plan.prefill:
            r.length = e
            if r.prefix_key is not None and e >= r.prompt.prefix_len:  # its voice prefix is in: later requests share it
                self.prefix_cache.put(r.prefix_key, self.pool.owned[r.slot], r.prompt.prefix_len)
                r.prefix_key = None
        plan.tenures = [r.tenure for r in sampled]
        for r in sampled:
            r.source = None
            r.generated += 1

    def complete(self, plan: StepPlan, result: StepResult) -> list[Output]:
        """An advanced plan's frames are known: record them, end the requests that sampled their end token or
        reached their length. The row of a request that left its slot since the plan was launched (ended by an
        earlier step's end token, cancelled, preempted) is dropped."""
        outputs = []
        for i, r in enumerate(plan.sampled):
            if self.live.get(r.slot) is not r or r.tenure != plan.tenures[i]:
                continue
            first = not r.frames
            if result.ended[i]:
                o = self._ended(r, FINISH_END)
                self._release(r)
            else:
                codes = result.frames[i : i + 1]
                r.frames.append(codes)
                done = len(r.frames) >= r.max_new
                o = Output(r.id, codes, done, FINISH_LENGTH if done else None)
                if done:
                    self._release(r)
            if first and r.admitted_at is not None:
                o.queue_s = r.admitted_at - r.submitted_at
            outputs.append(o)
        return outputs

    # ---- what it holds ---------------------------------------------------------------------------
    def where(self, request_id: str) -> str:
        """"waiting" (for a KV slot), "live" or "unknown"."""
        if any(r.id == request_id for r in self.waiting):
            return "waiting"
        if any(r.id == request_id for r in self.live.values()):
            return "live"
        return "unknown"

    def decoding(self) -> bool:
        """Whether some request is past its prompt (a step then makes frames; one of only prompt rows makes none)."""
        return any(r.source is None for r in self.live.values())

    def has_work(self) -> bool:
        return bool(self.waiting or self.live)

    def counts(self) -> dict:
        return {"waiting": len(self.waiting), "live": len(self.live), "free_slots": len(self._free),
                "prefilling": sum(r.source is not None for r in self.live.values()),
                "kv_tokens": sum(r.length for r in self.live.values()),
                "kv_blocks_used": self.pool.used, "kv_blocks_total": self.pool.capacity,
                "preemptions": self.preemptions}

    # ---- inside ------------------------------------------------------------------------------------
    def _ended(self, r: Request, reason: str, **kw) -> Output:
        return Output(r.id, np.zeros((0, self.C), dtype=np.int32), True, reason, **kw)

    def _grow(self) -> None:
        """Give every live request that crosses into a new block this step its block; when blocks are short, drop
        cached prefixes, then preempt the request admitted last."""
        pool = self.pool
        needy = [r for r in self.live.values()
                 if not r.planned_all and r.length // pool.block_size >= pool.holds(r.slot)]
        if not needy:
            return
        self.prefix_cache.evict_until(len(needy))
        while len(needy) > pool.free:
            victim = max(self.live.values(), key=lambda r: (r.admitted_at, r.slot))
            self._requeue(victim)
            self.preemptions += 1
            if victim in needy:
                needy.remove(victim)
        pool.extend(list(zip([r.slot for r in needy], pool.alloc(len(needy)))))

    def _requeue(self, r: Request) -> None:
        self._release(r)
        r.slot, r.length, r.start, r.prefix_key, r.source = -1, 0, 0, None, None
        r.generated = len(r.frames)  # a frame of it still in flight is dropped (`complete`)
        self.waiting.appendleft(r)

    def _admit(self) -> None:
        """Take waiting requests into free slots while the KV pool allows (in order: a request short of blocks waits,
        and so do those behind it); give each its prompt's blocks, a cached prefix shared."""
        pool = self.pool
        self._steps_since_admit += 1
        if self.live and self._steps_since_admit < self.admit_every:
            return
        self._steps_since_admit = 0
        while self.waiting and self._free:
            r = self.waiting[0]
            n = len(r.prompt) + len(r.frames)  # its source's length (one token per frame produced)
            need = pool.blocks_for(n)  # enough with or without a prefix hit
            if need > pool.free:
                self.prefix_cache.evict_until(need)
                if need > pool.free:
                    break
            self.waiting.popleft()
            r.slot = self._free.pop()
            if r.admitted_at is None:
                r.admitted_at = time.monotonic()
            self.live[r.slot] = r
            self._place(r, n)
            r.source = self._source(r)
            r.length = r.start

    def _place(self, r: Request, n: int) -> None:
        """The request's first blocks: a cached voice prefix's (shared), then fresh ones for the rest of its prompt."""
        pool = self.pool
        key = self.prefix_cache.key(r.prompt)
        hit = self.prefix_cache.get(key)
        blocks = self.prefix_cache.attach(hit) if hit is not None else []
        r.start = hit.length if hit is not None else 0
        r.prefix_key = key if hit is None else None
        blocks += pool.alloc(pool.blocks_for(n) - len(blocks))
        pool.assign(r.slot, blocks)

    def _source(self, r: Request) -> Prompt:
        """What a request prefills: its prompt, and after a preemption also the frames it has produced."""
        if not r.frames:
            return r.prompt
        frames = torch.from_numpy(np.concatenate(r.frames)).long()
        p = r.prompt
        return Prompt(torch.cat([p.tokens, frames[:, 0] + self.semantic_start_id]), torch.cat([p.codes, frames]),
                      torch.cat([p.semantic, torch.ones(len(frames), dtype=torch.bool)]), p.prefix_len, p.history_dropped)

    def _chunks(self, prefilling: list[Request]) -> list[PrefillChunk]:
        """This step's prompt rows of the requests being prefilled, oldest first, at most `max_prefill_tokens` in all
        (at least one row). With `prefix_apart`, a chunk is cut where the request alone decides (its voice prefix,
        then every `max_prefill_tokens` tokens), never by its neighbours' use of the budget."""
        budget, chunks = self.max_prefill_tokens, []
        for r in prefilling:
            n = len(r.source)
            s = r.length
            end = min(n, s + (self.max_prefill_tokens if self.prefix_apart else budget))
            P = r.prompt.prefix_len
            if self.prefix_apart and s < P < len(r.prompt):  # the voice prefix by itself: as a cache hit leaves it
                end = min(end, P)
            if chunks and end - s > budget:
                break
            chunks.append(PrefillChunk(r, s, end))
            budget -= end - s
            if budget <= 0:
                break
        return chunks

    def _release(self, r: Request) -> None:
        if r.slot >= 0 and self.live.get(r.slot) is r:
            r.tenure += 1
            del self.live[r.slot]
            self.pool.free_slot(r.slot)
            self._free.append(r.slot)
