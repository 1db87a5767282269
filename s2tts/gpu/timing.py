"""The GPU's own time of a piece of work, between CUDA events (what a run-time plan compares)."""

from __future__ import annotations

import torch


def gpu_time_ms(fn, calls: int = 1, queued: bool = True) -> float:
    """Milliseconds between CUDA events around `calls` calls of fn. `queued`: the calls are queued behind a GPU sleep
    first, so that the time is the GPU's alone (as in a CUDA graph), not that of launching them (without torch's
    private `torch.cuda._sleep` the launch time is counted too); otherwise launches count, as an eager caller sees."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep = getattr(torch.cuda, "_sleep", None) if queued else None
    if sleep is not None:
        sleep(10_000_000)  # ~5 ms: the calls below are queued before the GPU reaches them
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
