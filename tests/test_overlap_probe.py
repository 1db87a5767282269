"""perf/overlap_probe.py on the CPU (a smoke test: on a GPU it says whether the AR's steps and the codec's held
calls gain from running at once on two CUDA streams; perf/RESULTS.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overlap_probe_script_on_the_cpu(tiny_ckpt, tmp_path):
    out = tmp_path / "overlap.json"
    p = subprocess.run([sys.executable, str(ROOT / "perf" / "overlap_probe.py"), "--checkpoint", str(tiny_ckpt),
                        "--device", "cpu", "--rows", "2", "--streams", "2", "--frames", "4", "--seconds", "0.3",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["device"] == "cpu" and rep["rows"] == 2 and rep["streams"] == 2, rep
    for k in ("step_ms_alone", "codec_call_ms_alone", "step_ms_together", "codec_call_ms_together"):
        assert rep[k] > 0, rep
    # the serial pass is k steps and one call at their own rates; the work done together is each rate's share
    k = rep["steps_per_call"]
    assert abs(rep["pass_ms_serial"] - (k * rep["step_ms_alone"] + rep["codec_call_ms_alone"])) < 0.05 * rep["pass_ms_serial"]
    assert 0 < rep["work_together"] <= 2.2 and rep["frames_per_s_serial"] > 0, rep
    assert json.loads(p.stdout.strip().splitlines()[-1]) == rep
