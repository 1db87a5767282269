"""What the perf tools share: locating and running `perf_analyzer` (shipped in the tritonclient==2.51.0 manylinux
wheel), the checkpoint a script runs on, timing a CUDA graph's replays, and ending a GPU run."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
import tritonclient

from .ar.loading import load_model
from .codec.loading import load_codec_from_dir
from .codec.stream import tune_for_device
from .random_checkpoint import write_checkpoint


def perf_analyzer_path() -> Path | None:
    base = Path(tritonclient.__file__).resolve().parents[1]
    for p in [*base.glob("tritonclient-*.data/data/bin/perf_analyzer"), Path(sys.prefix) / "bin" / "perf_analyzer"]:
        if p.is_file():
            return p
    w = shutil.which("perf_analyzer")
    return Path(w) if w else None


def perf_analyzer_env() -> dict:
    """The environment perf_analyzer needs: libcudart.so.12 from the nvidia-cuda-runtime-cu12 wheel on the library path
    (it loads it even for gRPC-only runs; libb64.so.0d comes from Debian's libb64-0d)."""
    env = dict(os.environ)
    dirs = []
    try:
        import nvidia.cuda_runtime

        dirs.append(str(Path(list(nvidia.cuda_runtime.__path__)[0]) / "lib"))
    except ImportError:
        pass
    if dirs:
        env["LD_LIBRARY_PATH"] = ":".join(dirs + [env.get("LD_LIBRARY_PATH", "")])
    return env


def checkpoint_arguments(ap, device: str = "cuda") -> None:
    """A perf script's --checkpoint, --make-full and --device (default `device`)."""
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--make-full", action="store_true", help="write a full-size random checkpoint there if missing")
    ap.add_argument("--device", default=device, help="cpu: a smoke run of the script on a tiny checkpoint")


def served_model_and_codec(ck: Path, device: str, tune: bool = True):
    """The AR model and the codec as slow_ar runs them, for a script's loop -> (model, codec, fallback): on a GPU
    bf16 weights and an fp16 codec with its fp32 redo, on a CPU fp32 and no redo; `tune`: the codec's kernels tiled
    for the device (`codec.stream.tune_for_device`, as the servers do)."""
    cuda = device.startswith("cuda")
    model = load_model(ck, device, "bf16" if cuda else "fp32")
    codec = load_codec_from_dir(ck, device, "fp16" if cuda else "fp32")
    fallback = load_codec_from_dir(ck, device, "fp32") if cuda else None
    if tune:
        tune_for_device(device, codec, fallback)
    return model, codec, fallback


def checkpoint_dir(args) -> Path:
    """args.checkpoint, where with --make-full a full-size random checkpoint (on args.device) is written first if
    none is there."""
    ck = Path(args.checkpoint)
    if args.make_full and not (ck / "config.json").is_file():
        write_checkpoint(ck, "full", seed=0, device=args.device)
    return ck


def graph_time_ms(fn, iters: int = 50, calls: int = 1) -> float:
    """Median milliseconds of one call of fn, `calls` calls of it captured in a CUDA graph (fn must be capturable)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return sorted(times)[len(times) // 2]


def set_variant(text: str) -> None:
    """A perf tool's `--variant MODULE.NAME=VALUE`: that module attribute set to the literal VALUE (a kernel table, a
    switch) before anything is built; SystemExit naming the form otherwise."""
    import ast
    import importlib

    target, eq, value = text.partition("=")
    module, dot, name = target.rpartition(".")
    if not (eq and dot):
        raise SystemExit(f"--variant {text!r}: give MODULE.NAME=VALUE, e.g. s2tts.codec.kernels.CONV_NWC_BY_SHAPE=False")
    setattr(importlib.import_module(module), name, ast.literal_eval(value))


def exit_now(rc: int = 0) -> None:
    """End a GPU benchmark with `rc` once its results are written, without the interpreter's teardown: with several
    engines' CUDA graphs and Triton's loaded modules in one process, that teardown (freeing them after the CUDA
    context) crashed with SIGSEGV after everything had been printed, turning a good run's status into a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
