"""perf/codec_start.py on the CPU (a smoke test: on a GPU it times the in-engine codec's start with an empty Triton
cache and counts the kernels compiled; perf/RESULTS.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_codec_start_script_on_the_cpu(tiny_ckpt, tmp_path):
    out = tmp_path / "start.json"
    p = subprocess.run([sys.executable, str(ROOT / "perf" / "codec_start.py"), "--checkpoint", str(tiny_ckpt),
                        "--device", "cpu", "--max-batch", "2", "--streams", "3", "--frames", "4", "--calls", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["device"] == "cpu" and rep["graphs"] == 0 and rep["kernels_compiled"] == 0, rep
    assert list(rep["parts_s"]) == ["weights", "fp32 fallback", "kernels chosen", "stream slots",
                                    "warm-up and CUDA graphs"], rep
    assert rep["made_s"] >= sum(rep["parts_s"].values()) - 0.05 and rep["call_ms_median"] > 0, rep
    assert json.loads(p.stdout.strip().splitlines()[-1]) == rep
