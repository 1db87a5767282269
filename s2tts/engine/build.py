"""An `EngineService` built from a model's settings: what slow_ar runs, or s2pro holding the engine itself
(`engine_in_s2pro`): the AR's weights, the codec beside them when the layout says so, the KV pool sized by the
settings (or by a share of the GPU), the engine and its CUDA graphs, and the loop around them."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from ..ar.loading import load_model
from ..codec.loading import codec_codebook_sizes, codec_frame_seconds
from ..codec.stream import making_line, open_stream_decoder
from ..errors import S2Error
from ..gpu import jit
from ..layout import Layout
from ..settings import default_kv_tokens
from ..sizing import ENGINE_RESERVE_GIB
from .config import EngineConfig
from .core import Engine
from .runner import ModelRunner
from .service import EngineService

log = logging.getLogger("s2tts")


def codec_here(v, device) -> bool:
    """`codec_in_engine` as rendering decided it; a config left unrendered takes the same rule (layout.py)."""
    if v.codec_in_engine is not None:
        return v.codec_in_engine
    return Layout((str(device),), (v.codec_device or str(device),)).codec_beside_engines()


def serve_engine(v, make_response: Callable[..., Any], make_error: Callable[[S2Error], Any], name: str,
                 on_unhealthy: Callable[[str], None] | None = None,
                 on_tick: Callable[["EngineService"], None] | None = None, fast_ar=None,
                 direct_send: bool = False, on_sent: Callable[[], None] | None = None) -> EngineService:
    """An `EngineService` built from a model's settings `v` (`settings.model_values`): the AR weights on `v.device`,
    with `codec_in_engine` the served stream decoder on the same device (warmed for the chunk lengths the chunker
    makes and the slices held calls decode), then the `Engine` with its KV pool (sized by `kv_cache_tokens`,
    `kv_cache_memory_gb` or `gpu_memory_utilization`: `kv_pool_gib`) and CUDA graphs. `fast_ar`: a `HostFastAR`
    replacing the in-process fast AR (slow_ar's fast_ar=bls); `on_sent`: as `EngineService`'s."""
    t0 = time.perf_counter()
    with jit.compile_workers(v.device):  # started first: their imports overlap the weights' loading
        model = load_model(v.checkpoint, v.device, v.dtype, weights=v.ar_weights)
        device = next(model.parameters()).device
        t1 = time.perf_counter()
        codec = _engine_codec(v, device, name) if codec_here(v, device) else None  # before the KV pool takes the rest
        t2 = time.perf_counter()
        config = EngineConfig.from_values(v)
        if v.gpu_memory_utilization is not None:  # the pool in GiB from what the GPU has left (a CPU: the default)
            config = config.replace(kv_cache_tokens=None, kv_cache_memory_gb=kv_pool_gib(v, model, device, name,
                                                                                         codec is not None))
        engine = Engine(model, codec_codebook_sizes(v.checkpoint)[1], config, fast_ar=fast_ar)
    t3 = time.perf_counter()
    if v.gpu_memory_utilization is not None and device.type == "cuda":
        log.info("%s: with its KV cache and CUDA graphs this process holds %.1f GiB of the GPU (PyTorch's; "
                 "gpu_memory_utilization=%g: %.1f GiB)", name, torch.cuda.memory_reserved(device) / (1 << 30),
                 v.gpu_memory_utilization, v.gpu_memory_utilization * torch.cuda.mem_get_info(device)[1] / (1 << 30))
    service = EngineService(engine, make_response, make_error, name=name, on_unhealthy=on_unhealthy, on_tick=on_tick,
                            frame_seconds=codec_frame_seconds(v.checkpoint), codec=codec, direct_send=direct_send,
                            on_sent=on_sent)
    warm = "".join(f", {k} {v:.1f} s" for k, v in engine.runner.warm_s.items())
    log.info("%s ready in %.1f s (weights %.1f s, codec %.1f s, engine and its CUDA graphs %.1f s%s; the GPU kernels' "
             "first compile falls in the last two): device=%s dtype=%s ar_weights=%s max_batch=%d max_seq_len=%d "
             "kv_cache=%d tokens in blocks of %d cuda_graphs=%s prefix_cache=%d MiB batch_invariant=%s "
             "adaptive_chunks=%s codec_in_engine=%s launch_ahead=%s dependent_launch=%s", name, t3 - t0, t1 - t0, t2 - t1, t3 - t2, warm,
             engine.device,
             engine.dtype, v.ar_weights, engine.max_batch, engine.max_seq_len, engine.kv_capacity_tokens,
             engine.blocks.block_size, sorted(engine.graphs), engine.prefix_cache.max_bytes >> 20,
             engine.batch_invariant, v.adaptive_chunks, codec is not None, service.launch_ahead,
             engine.runner.dependent_launch)
    return service


def kv_pool_gib(v, model, device, name: str, with_codec: bool = False) -> float | None:
    """The KV pool's GiB under `gpu_memory_utilization` (None on a CPU: the default pool), from what this process
    already holds on the engine's GPU (`device`: the weights, the codec) -> `kv_gib_for_utilization`."""
    if device.type != "cuda":
        log.info("%s: gpu_memory_utilization applies to a GPU; on %s the KV cache takes its default, %d tokens", name,
                 device, default_kv_tokens(v))
        return None
    total, held = torch.cuda.mem_get_info(device)[1], torch.cuda.memory_reserved(device)
    gib = kv_gib_for_utilization(v.gpu_memory_utilization, total, held, model.s2.text, next(model.parameters()).dtype,
                                 v.max_seq_len, v.kv_block_tokens or v.max_seq_len)
    log.info("%s: gpu_memory_utilization=%g of %.1f GiB: %.1f GiB held (weights%s), %.1f GiB kept for CUDA graphs, "
             "activations and the context: a KV cache of %.2f GiB", name, v.gpu_memory_utilization, total / (1 << 30),
             held / (1 << 30), " and codec" if with_codec else "", ENGINE_RESERVE_GIB, gib)
    return gib


def kv_gib_for_utilization(util: float, total: int, held: int, cfg, dtype, max_seq_len: int, block: int = 1) -> float:
    """GiB for the KV pool when an engine may take `util` of a GPU of `total` bytes and already holds `held` (its
    weights and codec), keeping `ENGINE_RESERVE_GIB`. ValueError naming the least utilization that works when
    that is not one request of `max_seq_len` tokens in whole blocks of `block` (as `ModelRunner.kv_tokens_in`
    counts them; the slow AR's `cfg`, the cache in `dtype`)."""
    one = -(-max_seq_len // block) * block * ModelRunner.kv_token_bytes(cfg, dtype)
    gib = (util * total - held) / (1 << 30) - ENGINE_RESERVE_GIB
    if gib * (1 << 30) < one:
        least = (held + one) / total + ENGINE_RESERVE_GIB * (1 << 30) / total
        raise ValueError(f"gpu_memory_utilization={util:g} gives this engine {util * total / (1 << 30):.1f} GiB of "
                         f"its GPU's {total / (1 << 30):.1f} GiB, and it already holds {held / (1 << 30):.1f} GiB "
                         f"(weights and codec) and keeps {ENGINE_RESERVE_GIB:g} GiB for its CUDA graphs: no room "
                         f"for one request of max_seq_len={max_seq_len} in its KV cache; raise gpu_memory_utilization "
                         f"to at least {min(1.0, least + 0.005):.2f} or lower max_seq_len")
    return gib


def _engine_codec(v, device, name: str):
    """The served stream decoder (`codec.stream.open_stream_decoder`) on the engine's device, warmed for the chunk
    lengths the chunker makes and the slices held calls decode (`codec_batch_steps`, and twice that for a stream
    catching up), at up to max_batch streams per call."""
    t0 = time.monotonic()
    torch.backends.cudnn.allow_tf32 = v.codec_tf32  # the fp32 codec's convolutions (the AR has none)
    # streams open here: the live requests, and a long text's stream between two of its segments
    slots = min(v.codec_max_streams, 2 * v.max_batch)
    # a held call decodes a slice of codec_batch_steps frames of up to max_batch streams: a longer one (a stream
    # catching up) of that many streams runs as two calls rather than doubling the graphs' memory
    K = v.codec_batch_steps
    decoder, dtype, graphs = open_stream_decoder(v.checkpoint, device, v.codec_dtype, slots,
                                                 v.codec_idle_timeout_s,
                                                 EngineService.codec_lengths(v.first_chunk_frames, v.chunk_frames, K),
                                                 v.max_batch, v.max_batch * K if K > 1 else None)
    log.info("%s: codec in the engine's loop: dtype=%s%s, %d stream slots, %d CUDA graphs, in %.1f s%s", name, dtype,
             " (fp32 fallback)" if decoder.fallback is not None else "", slots, graphs, time.monotonic() - t0,
             making_line(decoder.making))
    return decoder
