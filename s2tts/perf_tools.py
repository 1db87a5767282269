"""Locating and running `perf_analyzer` (shipped in the tritonclient==2.51.0 manylinux wheel)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def perf_analyzer_path() -> Path | None:
    import tritonclient

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
