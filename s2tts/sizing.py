"""The sizes a server takes from its GPU when no setting gives them: how many requests one engine decodes together
(`max_batch`), how many the server admits and queues, and the KV pool as a share of the GPU's memory.

The launcher decides them once, before rendering (`with_gpu_sizes`), from the smallest GPU an engine runs on (its
memory read with `nvidia-smi`, so the launcher imports no CUDA library): `max_batch` is the largest of `GPU_BATCHES`
whose weights, KV cache (`STREAM_KV_TOKENS` a stream) and codec state fit in `GPU_MEMORY_UTILIZATION` of that memory,
the server admits twice `max_batch` a request per engine and each engine queues the rest, and the KV pool is what is
left of that share once the weights, the codec and the graphs are loaded (slow_ar measures it: `kv_pool_gib`). The
largest batch is where one H200's decode step is still bound by reading the weights (perf/STATUS.md). On a CPU, and
where no GPU's memory can be read, the settings keep their schema defaults. A setting given by the operator is never
changed; the rest follow from it (a given `max_batch` sets the admission limits, a given KV size keeps the share unset).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from .checkpoint_config import S2Config
from .layout import Layout
from .settings import KV_SIZES, SCHEMA, STREAM_KV_TOKENS

GPU_MEMORY_UTILIZATION = 0.9  # the share of the GPU an engine's process takes unless a setting sizes its KV cache
GPU_BATCHES = (16, 32, 64, 128)  # the max_batch values a GPU may get, the largest that fits
CODEC_STREAM_BYTES = 64 << 20  # the in-engine codec's memory a stream: two state slots and its share of the graphs
ENGINE_RESERVE_GIB = 1.5  # what an engine keeps beside weights, codec and KV: CUDA graphs' pool, activations, context
ADMITTED_PER_SLOT = 2  # requests the server admits per KV slot: one decoding, one waiting for the slot
SIZED = ("max_batch", "max_concurrent_requests", "max_queued_requests", "gpu_memory_utilization")


def gpu_memory_bytes(run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> int | None:
    """The total memory of the smallest GPU this process may use (those `CUDA_VISIBLE_DEVICES` lists, else all),
    from nvidia-smi; None when there is no nvidia-smi or it lists no GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    cmd = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        if not ids:
            return None  # CUDA_VISIBLE_DEVICES="": no GPU for this process
        cmd.append(f"--id={','.join(ids)}")
    try:
        out = run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    mib = [int(x) for x in out.stdout.split() if x.strip().isdigit()] if out.returncode == 0 else []
    return min(mib) << 20 if mib else None


def weights_bytes(checkpoint: str | Path) -> int:
    """The bytes of the checkpoint's weight files (the AR's safetensors and the codec), as they load on a GPU."""
    path = Path(checkpoint)
    files = list(path.glob("*.safetensors")) + list(path.glob("*.pth"))
    return sum(f.stat().st_size for f in files)


def kv_token_bytes(cfg, value_bytes: int) -> int:
    """Bytes of one token's keys and values in every layer of the slow AR (`cfg`: its ARConfig), `value_bytes` a
    value."""
    return 2 * cfg.n_layer * cfg.n_local_heads * cfg.head_dim * value_bytes


def batch_for_gpu(total: int, weights: int, token_bytes: int, util: float = GPU_MEMORY_UTILIZATION) -> int | None:
    """The largest of `GPU_BATCHES` whose streams fit beside `weights` in `util` of a GPU of `total` bytes (None:
    not even the smallest)."""
    room = util * total - weights - ENGINE_RESERVE_GIB * (1 << 30)
    stream = STREAM_KV_TOKENS * token_bytes + CODEC_STREAM_BYTES
    fits = [b for b in GPU_BATCHES if b * stream <= room]
    return fits[-1] if fits else None


def with_gpu_sizes(settings: dict[str, str], gpu_memory: Callable[[], int | None] = gpu_memory_bytes
                   ) -> tuple[dict[str, str], str | None]:
    """`settings` (as given: key -> text) with the sizes of `SIZED` it leaves unset decided from the engines' GPU,
    and a line saying what was decided (None when nothing was to decide: a CPU, every size given; a line saying
    so when the GPU's memory could not be read).
    Raises ValueError when the weights leave no room for `GPU_BATCHES[0]` streams and max_batch is not given."""
    def given(key: str) -> bool:
        return settings.get(key) not in (None, "")

    layout = Layout.from_values(settings)
    if all(given(k) for k in SIZED) or not layout.engines_on_gpu():
        return settings, None
    total = gpu_memory()
    if total is None:
        return settings, ("sizes: no GPU's memory could be read (nvidia-smi), so max_batch and the admission limits "
                          "keep their CPU defaults (docs/SETTINGS.md): set them, and a KV size, for this GPU")
    def value(key: str):  # a given setting as the schema reads it (a bad one: the schema's error), else its default
        return SCHEMA[key].parse(settings[key]) if given(key) else SCHEMA[key].default

    out, decided = dict(settings), []
    util = value("gpu_memory_utilization") or GPU_MEMORY_UTILIZATION
    if not given("max_batch"):
        cfg = S2Config.from_dir(settings["checkpoint"]).text
        b = batch_for_gpu(total, weights_bytes(settings["checkpoint"]), kv_token_bytes(cfg, 4 if value("dtype") == "fp32" else 2), util)
        if b is None:
            raise ValueError(f"the checkpoint's weights leave no room for {GPU_BATCHES[0]} streams in {util:g} of this "
                             f"GPU's {total / (1 << 30):.1f} GiB: set max_batch (and a KV size) by hand, or raise "
                             "gpu_memory_utilization")
        out["max_batch"] = str(b)
        decided.append(f"max_batch={b}")
    batch = b if not given("max_batch") else value("max_batch")
    if not given("max_concurrent_requests"):
        out["max_concurrent_requests"] = str(ADMITTED_PER_SLOT * batch * layout.replicas)
        decided.append(f"max_concurrent_requests={out['max_concurrent_requests']}")
    if not given("max_queued_requests"):
        per_engine = -(-SCHEMA["max_concurrent_requests"].parse(out["max_concurrent_requests"]) // layout.replicas)
        out["max_queued_requests"] = str(max(0, per_engine - batch))
        decided.append(f"max_queued_requests={out['max_queued_requests']}")
    if not any(given(k) for k in KV_SIZES):
        out["gpu_memory_utilization"] = str(GPU_MEMORY_UTILIZATION)
        decided.append(f"gpu_memory_utilization={GPU_MEMORY_UTILIZATION:g}")
    line = (f"sizes from the GPU ({total / (1 << 30):.1f} GiB, the smallest an engine uses): " + " ".join(decided)
            + " (a --set of any of them keeps it)") if decided else None
    return out, line
