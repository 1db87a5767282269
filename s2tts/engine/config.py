"""`EngineConfig`: everything an engine and its serving loop are told, built once and handed down.

The served path builds it from a model's settings (`EngineConfig.from_values`); a benchmark, a test or the offline
pipeline builds it with the fields it changes (`EngineConfig(max_batch=64)`): every other field is the setting's
own default from `s2tts.settings.SCHEMA`, so no caller restates one and none can differ from the served path by a
default. `Engine`, `ModelRunner`, `Scheduler` and `EngineService` read it; none has defaults of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..settings import SCHEMA, default_kv_tokens


def _setting(key: str):
    return field(default=SCHEMA[key].default, metadata={"setting": key})


@dataclass(frozen=True)
class EngineConfig:
    # the batch and the KV cache (settings of the same names)
    max_batch: int = _setting("max_batch")
    max_seq_len: int = _setting("max_seq_len")
    max_prefill_tokens: int = _setting("max_prefill_tokens")
    kv_block_tokens: int = _setting("kv_block_tokens")
    kv_cache_tokens: int | None = _setting("kv_cache_tokens")  # None (and no kv_cache_memory_gb): `kv_tokens`
    kv_cache_memory_gb: float | None = _setting("kv_cache_memory_gb")
    prefix_cache_mb: int = _setting("prefix_cache_mb")
    admit_every_steps: int = _setting("admit_every_steps")
    batch_invariant: bool = _setting("batch_invariant")
    # the device's work (None: on where the device supports it)
    cuda_graphs: bool | None = _setting("cuda_graphs")
    dependent_launch: bool | None = _setting("dependent_launch")
    # the serving loop (`EngineService`)
    max_queued_requests: int = _setting("max_queued_requests")
    adaptive_chunks: bool = _setting("adaptive_chunks")
    load_chunk_frames: int = _setting("load_chunk_frames")
    launch_ahead: bool | None = _setting("launch_ahead")
    codec_batch_steps: int = _setting("codec_batch_steps")
    codec_final_steps: int = _setting("codec_final_steps")
    codec_first_steps: int = _setting("codec_first_steps")
    codec_concurrent: bool | None = _setting("codec_concurrent")
    # tuning a benchmark or a test may change; no setting (None: decided from the device)
    decode_kernel: bool | None = None  # Triton attention over the paged cache (on a GPU)
    fused_kernels: bool | None = None  # Triton norms, RoPE and SwiGLU (with decode_kernel)
    row_buckets: bool | None = None  # passes padded to `ModelRunner.ROW_BUCKETS` (with cuda_graphs)
    decode_splits: int | None = None  # programs sharing a long row's keys (`ModelRunner.default_splits`)
    cancel_poll_s: float = 0.05  # how often the sender thread asks whether clients cancelled
    max_step_faults: int = 3  # failed steps in a row that make the service unhealthy

    @classmethod
    def from_values(cls, values, **changes) -> "EngineConfig":
        """The config a model's settings (`settings.model_values`, or a dict of resolved settings) describe, with
        `changes` on top."""
        get = values.get if isinstance(values, dict) else lambda k: getattr(values, k)
        given = {f.name: get(f.metadata["setting"]) for f in dataclasses.fields(cls) if "setting" in f.metadata}
        return cls(**{**given, **changes})

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def kv_tokens(self) -> int | None:
        """The KV pool's size in tokens when tokens size it: `kv_cache_tokens`, or, with neither it nor
        `kv_cache_memory_gb` set, the settings' default pool (`settings.default_kv_tokens`). None: GiB size it."""
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens
        return None if self.kv_cache_memory_gb is not None else default_kv_tokens(
            {"max_seq_len": self.max_seq_len, "max_batch": self.max_batch})

    @property
    def prefix_cache_bytes(self) -> int:
        return self.prefix_cache_mb << 20
