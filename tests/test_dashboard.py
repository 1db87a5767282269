"""The Grafana dashboard (`deploy/grafana/s2tts.json`) against a real Prometheus (Debian's `prometheus` package)
scraping the running tritonserver's metrics port and a gateway's /metrics: every panel's query answers with data
after requests have run, and the main ones with the values those requests imply."""

import json
import math
import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from s2tts.serving.metrics import METRICS

from servers import Gateway, free_port

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "s2tts.json"
GATEWAY_METRICS = {"s2tts_gateway_requests_total", "s2tts_gateway_request_seconds", "s2tts_gateway_speech_in_flight",
                   "s2tts_gateway_overload_refusals_total"}
PROMETHEUS = shutil.which("prometheus")


def _exprs():
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_dashboard_is_valid_and_uses_only_real_metrics():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["panels"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in dash["templating"]["list"])
    for p in dash["panels"]:
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    used = set()
    for _, expr in _exprs():
        for name in re.findall(r"\b(s2tts_[a-z_0-9]+)", expr):
            used.add(re.sub(r"_(bucket|sum|count)$", "", name) if name not in METRICS else name)
    unknown = used - set(METRICS) - GATEWAY_METRICS
    assert not unknown, f"the dashboard queries metrics nobody exports: {unknown}"
    for must in ("s2tts_time_to_first_audio_seconds", "s2tts_audio_seconds_total", "s2tts_engine_kv_tokens",
                 "s2tts_codec_batch_size", "s2tts_gateway_requests_total"):
        assert must in used, must


@pytest.fixture
def prometheus(triton_server, tmp_path):
    if not PROMETHEUS:
        if os.environ.get("CI"):
            pytest.fail("CI needs Debian's prometheus package (.ci/run installs it)")
        pytest.skip("needs Debian's prometheus package: apt-get install prometheus")
    # Prometheus first: it scrapes nothing for its first ~5 s whatever the interval (its scrape manager's reload
    # throttle), time in which the gateway starts
    gw_port, port = free_port(), free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(f"""global:
  scrape_interval: 500ms
scrape_configs:
  - job_name: triton
    static_configs: [{{targets: ["{triton_server.host}:{triton_server.metrics_port}"]}}]
  - job_name: gateway
    static_configs: [{{targets: ["127.0.0.1:{gw_port}"]}}]
""")
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    gw = None
    try:
        gw = Gateway(triton_server.grpc_url, tmp_path / "voices.sqlite3", tmp_path / "gateway.log", port=gw_port)
        deadline = time.time() + 60
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield url, gw
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        if gw is not None:
            gw.stop()


def _query(url: str, expr: str) -> list:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr.replace("$__rate_interval", "1m")}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _wait_scraped(url: str, timeout: float = 30.0) -> None:
    """Both targets up and scraped a few times."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        up = _query(url, "count_over_time(up[1m])")
        if len(up) == 2 and all(float(s["value"][1]) >= 3 for s in up):
            return
        time.sleep(0.5)
    raise AssertionError(f"prometheus did not scrape both targets: {_query(url, 'up')}")


def test_every_dashboard_panel_answers(prometheus, triton_server):
    url, gw = prometheus
    _wait_scraped(url)
    ok_expr = 'sum(s2tts_requests_finished_total{model="s2pro",outcome="ok"}) or vector(0)'
    ok_before = float(_query(url, ok_expr)[0]["value"][1])
    for _ in range(20):  # earlier tests' requests may still be counted (the models report every 0.2 s)
        time.sleep(1.2)
        now = float(_query(url, ok_expr)[0]["value"][1])
        if now == ok_before:
            break
        ok_before = now
    def speak(i):  # 24 frames in chunks of 4: s2pro measures the pipeline's pace between a stream's middle chunks
        # (not its first nor its last), which the pace panel shows
        return httpx.post(f"{gw.url}/v1/audio/speech", timeout=120,
                          json={"model": "s2-pro", "voice": "default", "input": f"Dashboard request {i}.",
                                "response_format": "wav", "stream": False, "seed": i, "max_new_tokens": 24,
                                "first_chunk_frames": 4, "chunk_frames": 4})

    with ThreadPoolExecutor(3) as ex:  # three at once
        for r in ex.map(speak, range(3)):
            assert r.status_code == 200, r.text

    def value(expr):
        return float(_query(url, expr)[0]["value"][1])

    def problems() -> list:
        """What Prometheus does not show yet: every panel answers, the main ones with a positive value, and the ok
        count grew by the three requests."""
        out = [("empty", title, expr) for title, expr in _exprs() if not _query(url, expr)]
        for title, expr in _exprs():
            if title in ("Time to first audio", "Audio produced (audio-seconds per second)", "Request duration") \
                    and not out:
                v = value(expr)
                if not (math.isfinite(v) and v > 0):
                    out.append(("value", title, expr, v))
        if value(ok_expr) - ok_before != 3:
            out.append(("ok requests", value(ok_expr) - ok_before))
        return out

    deadline = time.time() + 30  # polled until Prometheus has scraped what the requests reported (every 0.5 s)
    while problems() and time.time() < deadline:
        time.sleep(0.5)
    assert not problems(), problems()  # the three requests, as Prometheus saw them, on every panel
    statuses = {s["metric"]["status"] for s in _query(url, "s2tts_gateway_requests_total")}
    assert "200" in statuses
