"""The sizes a GPU decides (`s2tts.sizing`): the batch that fits its memory, the admission limits that follow from
the batch, the KV pool's share, and that a given setting is kept. No GPU needed: the GPU's memory is passed in."""

from __future__ import annotations

import subprocess

import pytest

from s2tts import settings as schema
from s2tts import sizing
from s2tts.checkpoint_config import S2Config
from s2tts.repository import render_model_repository
from s2tts.server import python_backend_threads

GIB = 1 << 30


def stream_bytes(ckpt) -> int:
    cfg = S2Config.from_dir(ckpt).text
    return schema.STREAM_KV_TOKENS * sizing.kv_token_bytes(cfg, 2) + sizing.CODEC_STREAM_BYTES


def gpu_holding(ckpt, streams: int, util: float = sizing.GPU_MEMORY_UTILIZATION) -> int:
    """The smallest GPU whose `util` share holds the checkpoint's weights, the engine's reserve and `streams`."""
    need = sizing.weights_bytes(ckpt) + sizing.ENGINE_RESERVE_GIB * GIB + streams * stream_bytes(ckpt)
    return int(need / util) + 1


def test_the_batch_is_the_largest_that_fits(tiny_ckpt):
    cfg = S2Config.from_dir(tiny_ckpt).text
    w, t = sizing.weights_bytes(tiny_ckpt), sizing.kv_token_bytes(cfg, 2)
    assert w > 0 and t == 2 * cfg.n_layer * cfg.n_local_heads * cfg.head_dim * 2
    for b in sizing.GPU_BATCHES:
        assert sizing.batch_for_gpu(gpu_holding(tiny_ckpt, b), w, t) == b
    # just short of a batch's need: the batch below it (none below the smallest)
    for lo, hi in zip((None, *sizing.GPU_BATCHES), sizing.GPU_BATCHES):
        assert sizing.batch_for_gpu(gpu_holding(tiny_ckpt, hi) - 4096, w, t) == lo
    big = sizing.batch_for_gpu(gpu_holding(tiny_ckpt, 10 * sizing.GPU_BATCHES[-1]), w, t)
    assert big == sizing.GPU_BATCHES[-1]  # more memory never passes the largest batch
    # a smaller share of the same GPU: a smaller batch
    total = gpu_holding(tiny_ckpt, 64)
    assert sizing.batch_for_gpu(total, w, t, util=0.5) < 64


def test_a_gpu_sizes_what_no_setting_gives(tiny_ckpt):
    total = gpu_holding(tiny_ckpt, 64)
    given = {"checkpoint": str(tiny_ckpt), "device": "cuda"}
    sized, line = sizing.with_gpu_sizes(given, gpu_memory=lambda: total)
    assert given == {"checkpoint": str(tiny_ckpt), "device": "cuda"}  # the caller's dict is left as it was
    assert sized["max_batch"] == "64"
    assert sized["max_concurrent_requests"] == str(sizing.ADMITTED_PER_SLOT * 64)
    assert sized["max_queued_requests"] == str((sizing.ADMITTED_PER_SLOT - 1) * 64)
    assert float(sized["gpu_memory_utilization"]) == sizing.GPU_MEMORY_UTILIZATION
    assert "max_batch=64" in line and f"{total / GIB:.1f} GiB" in line
    v = schema.resolve(sized)  # the schema takes them: the KV pool is the GPU's share, not max_batch x 2048 tokens
    assert v["max_batch"] == 64 and v["kv_cache_tokens"] is None
    assert v["max_concurrent_requests"] == 128 and v["max_queued_requests"] == 64
    assert python_backend_threads(sized) == 128 + 32


def test_given_settings_are_kept_and_the_rest_follow(tiny_ckpt):
    total = gpu_holding(tiny_ckpt, 128)
    base = {"checkpoint": str(tiny_ckpt), "device": "cuda:0"}
    sized, _ = sizing.with_gpu_sizes({**base, "max_batch": "24"}, gpu_memory=lambda: total)
    assert (sized["max_batch"], sized["max_concurrent_requests"], sized["max_queued_requests"]) == ("24", "48", "24")
    sized, _ = sizing.with_gpu_sizes({**base, "max_concurrent_requests": "512"}, gpu_memory=lambda: total)
    assert (sized["max_batch"], sized["max_concurrent_requests"], sized["max_queued_requests"]) == ("128", "512", "384")
    sized, _ = sizing.with_gpu_sizes({**base, "kv_cache_tokens": "65536"}, gpu_memory=lambda: total)
    assert "gpu_memory_utilization" not in sized and sized["kv_cache_tokens"] == "65536"
    schema.resolve(sized)  # one KV size, so the schema's rule holds
    # a given share sizes the batch too
    sized, _ = sizing.with_gpu_sizes({**base, "gpu_memory_utilization": "0.45"}, gpu_memory=lambda: total)
    assert int(sized["max_batch"]) < 128 and sized["gpu_memory_utilization"] == "0.45"
    every = {**base, **{k: "1" if k != "gpu_memory_utilization" else "0.5" for k in sizing.SIZED}}
    assert sizing.with_gpu_sizes(every, gpu_memory=lambda: pytest.fail("nothing to size: no GPU query")) == (every, None)


def test_two_engines_share_the_admission_limit(tiny_ckpt):
    total = gpu_holding(tiny_ckpt, 32)
    sized, _ = sizing.with_gpu_sizes({"checkpoint": str(tiny_ckpt), "device": "cuda:0,cuda:1"},
                                     gpu_memory=lambda: total)
    assert sized["max_batch"] == "32"
    assert sized["max_concurrent_requests"] == str(sizing.ADMITTED_PER_SLOT * 32 * 2)
    assert sized["max_queued_requests"] == "32"  # each engine's share beyond its batch


def test_a_cpu_or_an_unreadable_gpu_keeps_the_defaults(tiny_ckpt):
    cpu = {"checkpoint": str(tiny_ckpt), "device": "cpu"}
    assert sizing.with_gpu_sizes(cpu, gpu_memory=lambda: pytest.fail("a CPU asks no GPU")) == (cpu, None)
    cuda = {"checkpoint": str(tiny_ckpt), "device": "cuda"}
    kept, line = sizing.with_gpu_sizes(cuda, gpu_memory=lambda: None)
    assert kept == cuda and "no GPU's memory could be read" in line and "set them" in line
    v = schema.resolve(cpu)
    assert v["max_batch"] == schema.SCHEMA["max_batch"].default
    assert v["max_concurrent_requests"] == schema.SCHEMA["max_concurrent_requests"].default


def test_a_bad_given_size_gets_the_schemas_error(tiny_ckpt):
    from s2tts.errors import S2Error

    with pytest.raises(S2Error, match="max_batch='many' is not a valid int"):
        sizing.with_gpu_sizes({"checkpoint": str(tiny_ckpt), "device": "cuda", "max_batch": "many"},
                              gpu_memory=lambda: 80 * GIB)


def test_a_gpu_too_small_for_the_weights_says_what_to_set(tiny_ckpt):
    small = sizing.weights_bytes(tiny_ckpt)  # not even the weights and the reserve fit
    with pytest.raises(ValueError, match="set max_batch"):
        sizing.with_gpu_sizes({"checkpoint": str(tiny_ckpt), "device": "cuda"}, gpu_memory=lambda: small)


def test_the_rendered_repository_carries_the_sizes(tiny_ckpt, tmp_path):
    total = gpu_holding(tiny_ckpt, 32)
    sized, _ = sizing.with_gpu_sizes({"checkpoint": str(tiny_ckpt), "device": "cuda"}, gpu_memory=lambda: total)
    repo = render_model_repository(tmp_path / "repo", sized)
    slow = (repo / "slow_ar" / "config.pbtxt").read_text()
    s2pro = (repo / "s2pro" / "config.pbtxt").read_text()
    assert 'key: "max_batch" value { string_value: "32" }' in slow
    assert 'key: "gpu_memory_utilization" value { string_value: "0.9" }' in slow
    assert 'key: "max_concurrent_requests" value { string_value: "64" }' in s2pro


def test_gpu_memory_reads_nvidia_smi(monkeypatch, tmp_path):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="81559\n143771\n", stderr="")

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert sizing.gpu_memory_bytes(run) == 81559 << 20  # the smallest
    assert not any(a.startswith("--id") for a in calls[-1])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1, 3")
    sizing.gpu_memory_bytes(run)
    assert "--id=1,3" in calls[-1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert sizing.gpu_memory_bytes(run) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert sizing.gpu_memory_bytes(lambda cmd, **kw: subprocess.CompletedProcess(cmd, 9, "", "no devices")) is None
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert sizing.gpu_memory_bytes(run) is None
