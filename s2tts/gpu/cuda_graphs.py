"""CUDA graph capture, each owner's graphs on a stream of its own.

A captured graph keeps the cuBLAS workspace of the (cuBLAS handle, stream) it was captured on: PyTorch hands each
such pair one workspace, and the products captured write their split-K partial sums and flags there on every replay.
`torch.cuda.graph`'s default capture stream is one for the whole process, so graphs captured on it by one thread
share one workspace; two of them replayed at once on different streams (the engine's step beside a codec call,
`codec_concurrent`) then race in it, and a step can hang. Graphs captured on streams of their own do not share it.
So the engine's runner and the codec's slot pool each capture on a stream from `own_stream`, through `capture`, and
the service's two replay streams come from `own_stream` too (neither is a capture stream).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

_lock = threading.Lock()
_taken: dict[tuple[int, int], weakref.ref] = {}  # (device index, stream id) -> the Stream object `own_stream` gave


def own_stream(device, priority: int = 0) -> torch.cuda.Stream:
    """A CUDA stream on `device` (of `priority`: lower runs first) that no other owner holds (PyTorch's pool hands
    out its streams in turn, the same one again after a round): for a capture, or for replays that must not run on
    another owner's capture stream. The owner keeps the returned object as long as it uses the stream (its graphs
    live): once that object is gone, the stream may go to another owner. Raises RuntimeError when every stream of
    the pool is held."""
    with _lock:
        for _ in range(256):  # a round of the pool is 32 streams
            s = torch.cuda.Stream(device, priority=priority)
            key = (s.device_index, s.stream_id)
            held = _taken.get(key)
            if held is None or held() is None:
                _taken[key] = weakref.ref(s)
                return s
    raise RuntimeError("no CUDA stream left for another owner of CUDA graphs: every stream of PyTorch's pool is held "
                       "by a live engine or codec pool of this process (create fewer of them at once)")


def capture(fn: Callable[[], object], stream: torch.cuda.Stream, pool, warm: Callable[[], object] | None = None):
    """Run `warm` (default `fn`) twice on `stream`, then capture `fn` on it into a new graph that draws its memory
    from `pool` (`torch.cuda.graph_pool_handle()`) -> (graph, what the captured call of fn returned). The current
    stream waits for the warm-up; the capture itself synchronizes the device, as `torch.cuda.graph` does."""
    warm = warm or fn
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for _ in range(2):
            warm()
    current.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    return graph, out
