"""The engine core: continuous-batching generation for S2 Pro (slow AR + fast AR), one step at a time.

A frame is one slow-AR token plus the fast AR's residual codes: `[num_codebooks]` codes. Callers on any thread
`submit` requests and `cancel` them; both go into one ordered command queue. The thread that owns the engine calls
`step()`, which does five things in order:

1. take the commands queued since the last step, in the order they came (a request submitted and then cancelled
   before this step never runs; a cancel for an id not (yet) submitted is ignored: callers that may see those in
   either order keep tombstones, as `EngineService` does);
2. schedule (`scheduler.Scheduler`, plain Python): admissions, KV blocks, preemption, the step's rows -> `StepPlan`;
3. run it (`runner.ModelRunner`, the device): one pass over the slow AR's weights, sampling and the fast AR ->
   `StepResult`;
4. process the result (`Scheduler.update`): lengths, frames, requests that ended;
5. return every request's `Output` of this step (new frames, or its end with a reason).

`step_ahead()` keeps two steps in flight: it launches the next (1-3) before it finishes the last (4, 5), so that the
device never waits for the host's bookkeeping nor for the caller's work on the outputs (routing, chunking,
responses). The scheduler plans a step on the lengths its launched steps will leave (`Scheduler.advance`) and
records their frames when they come (`Scheduler.complete`).

A step is all or nothing per group of requests: if the pass that holds prompt rows fails (and the device is still
usable), the requests of those rows end with an error and the decode rows run again by themselves; if the decode
rows fail, their requests end with an error and the requests being prefilled go back to the head of the queue
(they have sent nothing; they start their prefill again). Either way the step returns every output and frees every
slot it took; the exception is kept in `last_fault` (None after a clean call: each fault is reported by
the call that met it, once) for the caller to judge.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ..ar.model import S2Model
from ..ar.sampling import SamplingParams
from ..errors import is_fatal_device_error
from .config import EngineConfig
from .prompt import Prompt
from .runner import Launched, ModelRunner
from .scheduler import Output, Request, Scheduler, StepPlan


@dataclass(frozen=True)
class Add:
    """A command: admit this request."""

    request: Request


@dataclass(frozen=True)
class Abort:
    """A command: end the request of this id, wherever it is (a FINISH_CANCELLED output)."""

    request_id: str


class Engine:
    def __init__(self, model: S2Model, residual_size: int, config: EngineConfig = EngineConfig(), fast_ar=None):
        """An engine over `model` as `config` says (`EngineConfig`: the settings of the same names; its docs say what
        each does). `residual_size`: the codec's residual codebook size (the fast AR samples its codes below it).
        `fast_ar`: a runner of the fast AR out of this process (`HostFastAR`) instead of the model's own.

        A step adds at most `max_prefill_tokens` prompt tokens to the running streams' rows (chunked prefill): it
        bounds how much arrivals lengthen the step and sets the largest pass (`max_batch` + that many rows). While
        requests are decoding, waiting ones join every `admit_every_steps` steps (arrivals spread over those steps
        start their prefill together); an idle engine admits at once.

        `batch_invariant`: a request's numbers do not depend on the requests beside it. With the attention kernel
        (GPU), every matrix product of both ARs goes through the row-invariant kernel (`kernels.linear`: its tiling
        depends on the weight's shape, never on the rows) and the attention kernel splits every row's keys the same
        way. Without it (CPU), decode rows run in a pass of their own at one shape (`max_batch` rows), each prompt
        chunk in a pass of its own, cut at points that depend on that request alone (its voice prefix always by
        itself, so a prefix-cache hit leaves the same keys and values as a miss), and sampling always at `max_batch`
        rows. Sampling is per request already (seed, step)."""
        s2 = model.s2
        self.model, self.s2, self.batch_invariant = model, s2, config.batch_invariant
        # the checkpoint's own bound applies whatever the settings say
        self.config = config = config.replace(max_seq_len=min(config.max_seq_len, s2.text.max_seq_len))
        self.max_batch, self.max_seq_len = config.max_batch, config.max_seq_len
        Scheduler.check_prefill_budget(config.max_prefill_tokens)  # before the runner takes the device's memory
        self.runner = r = ModelRunner(model, residual_size, config, fast_ar=fast_ar)
        self.scheduler = Scheduler(config, num_codebooks=s2.num_codebooks, semantic_start_id=s2.semantic_start_id,
                                   num_blocks=r.num_blocks, block_size=r.block_size, block_bytes=r.block_bytes,
                                   prefix_apart=r.apart)
        r.apply(self.scheduler.pool)
        model.engine_owner = self  # the caches (and graphs over them) are this engine's until another is made
        self.device, self.dtype = r.device, r.dtype
        self.fault_hook = None  # optional fn(phase "decode" | "prefill", requests) called before device work (tests)
        self.last_fault: BaseException | None = None
        # launched steps not yet finished, each with whether `launch_next` launched it (engine thread)
        self._inflight: deque[tuple[StepPlan, Launched, bool]] = deque()
        self._launching_next = False
        self.finished_next = False  # whether the step the last `_finish` finished was launched by `launch_next`
        # host seconds spent launching steps (commands, the plan, its device work queued) and waiting for launched
        # steps' frames, summed (engine thread; a caller's statistics read the differences)
        self.launch_s = self.wait_s = 0.0

        self._lock = threading.Lock()  # the command queue, the ids, and the scheduler's state while others read it
        self._work = threading.Condition(self._lock)
        self._commands: deque[Add | Abort] = deque()  # in the order they came
        self._ids: set[str] = set()  # requests submitted and not yet ended

    # ---- commands, from any thread -----------------------------------------------------------
    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        """Queue a request. Raises ValueError (with what to change) if it can never run, or if a request of this id
        is still live."""
        req = self.scheduler.make_request(request_id, prompt, params)
        with self._work:
            if request_id in self._ids:
                raise ValueError(f"request id {request_id!r} is already live")
            self._ids.add(request_id)
            self._commands.append(Add(req))
            self._work.notify()
        return req

    def cancel(self, request_id: str) -> None:
        """End the request at the next step (with a FINISH_CANCELLED output), wherever it is."""
        with self._work:
            self._commands.append(Abort(request_id))
            self._work.notify()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        with self._work:
            if not self.has_work():
                self._work.wait(timeout)
            return self.has_work()

    def wake(self) -> None:
        with self._work:
            self._work.notify_all()

    # ---- what it holds, from any thread ---------------------------------------------------------
    def where(self, request_id: str) -> str:
        """"waiting" (for a KV slot), "live" (decoding) or "unknown"."""
        with self._lock:
            if any(isinstance(c, Add) and c.request.id == request_id for c in self._commands):
                return "waiting"
            return self.scheduler.where(request_id)

    def decoding(self) -> bool:
        """Whether some request is past its prompt (a step then makes frames; one of only prompt rows makes none)."""
        with self._lock:
            return self.scheduler.decoding()

    def has_work(self) -> bool:
        return bool(self._commands) or self.scheduler.has_work()

    def counts(self) -> dict:
        with self._lock:
            c = self.scheduler.counts()
            c["waiting"] += sum(isinstance(cmd, Add) for cmd in self._commands)
            return c

    def slots(self) -> tuple[int, int]:
        """(requests holding a slot, requests waiting for one): the scheduler's counts as they stand (no lock: a
        reading for statistics and load, not for decisions)."""
        return len(self.scheduler.live), len(self.scheduler.waiting)

    def slots_wanted(self) -> int:
        """Requests holding a slot or waiting for one."""
        return sum(self.slots())

    @property
    def kv_capacity_tokens(self) -> int:
        return self.scheduler.pool.capacity * self.scheduler.pool.block_size

    # the parts, for tools and tests
    blocks = property(lambda self: self.scheduler.pool)
    prefix_cache = property(lambda self: self.scheduler.prefix_cache)
    live = property(lambda self: self.scheduler.live)
    preemptions = property(lambda self: self.scheduler.preemptions)
    block_bytes = property(lambda self: self.runner.block_bytes)
    graphs = property(lambda self: self.runner.graphs)

    @property
    def logits_hook(self):
        """Optional observer fn(request_ids, logits [B, V]) of each sampling batch (tests, debugging; no graphs)."""
        return self.runner.logits_hook

    @logits_hook.setter
    def logits_hook(self, fn) -> None:
        self.runner.logits_hook = fn

    # ---- the loop, on the engine's thread ---------------------------------------------------------
    def step(self) -> list[Output]:
        """One step (the module's doc), waited for. On a GPU it runs with the engine's device current (the current
        device is per thread; Triton kernels and graphs launch on it, so an engine on cuda:1 stepped from a thread
        left on cuda:0 would hand them pointers they cannot use). With a step in flight (`step_ahead`) it finishes
        that one."""
        def go():
            self.last_fault = None
            return self._finish() if self._inflight else self._launch() + self._finish()

        return self._on_device(go)

    def step_ahead(self) -> list[Output]:
        """Launch the next step, then finish the one before it, and return without waiting for the new one -> the
        finished step's outputs (with those the launch made at once: requests cancelled before they ran, prompt
        rows that failed). Two steps are in flight: the device runs the next one while the host finishes the last
        (its frames to the host, the scheduler's bookkeeping) and the caller handles its outputs. The next step is
        planned before the last one's frames are known (`Scheduler.advance`): a request that samples its end token
        in one step has a row in the next that is dropped, and a command (submit, cancel) is taken at the next
        launch. After a failed step nothing more is launched until the steps in flight are finished."""

        def go():
            held = self.last_fault is not None  # the last call's step failed: what is in flight finishes first
            self.last_fault = None  # (a fault is this call's alone: the caller judges each once)
            outputs = [] if self._inflight else self._launch()
            if not held and self.last_fault is None and len(self._inflight) < 2 and self.has_work():
                outputs += self._launch()
            return outputs + self._finish()

        return self._on_device(go)

    def launch_next(self) -> list[Output]:
        """Launch the next step now if one step is in flight (`step_ahead`'s state between calls) and nothing failed,
        without finishing any -> the outputs the launch made at once. For a caller about to wait for other device
        work queued behind the step in flight (the codec's call): the device goes on to this step meanwhile, and the
        next `step_ahead` finishes the older step without launching."""

        def go():
            if len(self._inflight) == 1 and self.last_fault is None and self.has_work():
                self._launching_next = True
                try:
                    return self._launch()
                finally:
                    self._launching_next = False
            return []

        return self._on_device(go)

    def _on_device(self, fn) -> list[Output]:
        if self.model.engine_owner is not self:
            raise RuntimeError("another Engine was made over this model since this one: its KV cache (and the CUDA "
                               "graphs that read it) now belong to that one; use one Engine per model")
        if self.device.type != "cuda":
            return self._ended(fn())
        with torch.cuda.device(self.device):
            return self._ended(fn())

    def _launch(self) -> list[Output]:
        """Steps 1-3: commands, the plan, its device work queued (kept in `_inflight` for `_finish`) -> the outputs
        known at once (cancels, failures)."""
        t0 = time.perf_counter()
        try:
            return self._launch_plan()
        finally:
            self.launch_s += time.perf_counter() - t0

    @torch.inference_mode()
    def _launch_plan(self) -> list[Output]:
        self.last_fault = None
        with self._lock:
            outputs = self._take_commands()
            plan = self.scheduler.schedule()
        hook = self.fault_hook
        if plan.prefill:
            chunked = [c.request for c in plan.prefill]
            try:
                if hook is not None and plan.decode:
                    hook("decode", plan.decode)
            except Exception as e:  # noqa: BLE001 - judged by the caller through last_fault
                return outputs + self._decode_failed(plan, e)
            try:
                if hook is not None:
                    hook("prefill", chunked)
                self._run(plan)
                return outputs
            except Exception as e:  # noqa: BLE001
                self.last_fault = e
                if is_fatal_device_error(e):
                    return outputs + self._fail(plan.decode + chunked, e)
                outputs += self._fail(chunked, e)  # the prompt rows' fault: their requests end, the others go on
        if plan.decode:
            try:
                if hook is not None:
                    hook("decode", plan.decode)
                self._run(plan.decode_only())
            except Exception as e:  # noqa: BLE001
                outputs += self._decode_failed(plan.decode_only(), e)
        return outputs

    @torch.inference_mode()
    def _finish(self) -> list[Output]:
        """Steps 4-5 of the oldest launched step: wait for its frames, complete it in the scheduler -> its outputs. A
        fault seen only now (the device's, at the wait) ends every request of the step still running."""
        if not self._inflight:
            return []
        plan, launched, self.finished_next = self._inflight.popleft()
        t0 = time.perf_counter()
        try:
            result = self.runner.collect(launched)
        except Exception as e:  # noqa: BLE001 - judged by the caller through last_fault
            self.last_fault = e
            return self._fail(plan.decode + [c.request for c in plan.prefill], e)
        finally:
            self.wait_s += time.perf_counter() - t0
        with self._lock:
            return self.scheduler.complete(plan, result)

    def _take_commands(self) -> list[Output]:
        """Apply the queued commands in order (under the lock)."""
        outputs = []
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, Add):
                self.scheduler.add(cmd.request)
            else:
                outputs += self.scheduler.abort({cmd.request_id})
        return outputs

    def _run(self, plan: StepPlan) -> None:
        """Launch the plan and advance the scheduler past it (the next plan builds on it)."""
        self.runner.apply(self.scheduler.pool)
        launched = self.runner.launch(plan)
        with self._lock:
            self.scheduler.advance(plan)
        self._inflight.append((plan, launched, self._launching_next))

    def _decode_failed(self, plan: StepPlan, e: BaseException) -> list[Output]:
        """The decode rows failed: their requests end; the plan's prompt rows' requests start again later."""
        self.last_fault = e
        with self._lock:
            self.scheduler.requeue([c.request for c in plan.prefill])
        return self._fail(plan.decode, e)

    def _fail(self, reqs: list[Request], e: BaseException) -> list[Output]:
        with self._lock:
            return self.scheduler.fail(reqs, e)

    def _ended(self, outputs: list[Output]) -> list[Output]:
        """The step's outputs, after forgetting the ids of the requests they end."""
        done = [o.request_id for o in outputs if o.finished]
        if done:
            with self._lock:
                self._ids.difference_update(done)
        return outputs

    def fail_all(self, message: str) -> list[Output]:
        """End every request, queued, waiting or live, with an error output and free every slot (an unrecoverable
        fault, shutdown); call it on the engine's thread. Pending cancellations are dropped: those requests end here
        too."""
        while self._inflight:  # their frames are not wanted: wait for the device to be done with their buffers
            try:
                self.runner.collect(self._inflight.popleft()[1])
            except Exception:  # noqa: BLE001 - the requests end here anyway
                pass
        with self._lock:
            for cmd in self._commands:
                if isinstance(cmd, Add):
                    self.scheduler.add(cmd.request)
            self._commands.clear()
            self._ids.clear()
            return self.scheduler.fail_all(message)

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
