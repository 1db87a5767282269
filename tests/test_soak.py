"""perf/soak.py, briefly, against the real server: random cancels and disconnects under load; every request ends,
nothing leaks (KV slots, codec states, requests in flight all back to zero), every model stays healthy."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_short_soak(triton_server, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "perf/soak.py", "--url", triton_server.grpc_url, "--metrics", triton_server.metrics_url,
           "--minutes", "0.1", "--concurrency", "6", "--frames", "5,30", "--cancel", "0.3", "--disconnect", "0.2",
           "--first-chunk-frames", "2", "--chunk-frames", "4", "--sample", "3", "--settle", "30", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    o = res["outcomes"]
    assert o.get("completed", 0) > 0 and o.get("cancelled", 0) > 0 and o.get("disconnected", 0) > 0, o
    assert not res["hung"] and not res["leaks"] and not res["unhealthy"]
    g = res["final"]["gauges"]
    assert g["s2tts_engine_slots_used/slow_ar"] == 0 and g["s2tts_codec_streams_open/dac_decoder"] == 0
    assert g["s2tts_model_healthy/slow_ar"] == 1 and g["s2tts_model_healthy/s2pro"] == 1
    assert set(res["final"]["rss_mb"]) >= {"tritonserver", "slow_ar", "s2pro", "dac_decoder"}
