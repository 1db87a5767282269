"""The benchmark harness (perf/) against the real tritonserver on the tiny checkpoint (CPU).

loadgen: a two-level sweep with plain and voice-clone requests, checked for complete, sane numbers.
make_pa_inputs + run_perf_analyzer.sh: brief real perf_analyzer runs against fast_ar and dac_decoder.
"""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FRAMES = 12
HOP, SR = 2048, 44100


def _run(cmd, timeout, env=None):
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, f"{cmd[:3]} exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    return p


def test_requests_per_level_forms():
    sys.path.insert(0, str(ROOT / "perf"))
    from loadgen import parse_level_requests

    assert parse_level_requests("") == (None, {})
    assert parse_level_requests("8, 64:384,16:32") == (8, {64: 384, 16: 32})
    for bad in ("x", "64:", "0", "2:-1", "a:3"):
        with pytest.raises(ValueError, match="--requests-per-level"):
            parse_level_requests(bad)


def test_stall_finds_the_first_late_chunk_and_the_silence():
    """Chunks of 1, 0.5, 0.5 and 1 s of audio: the second comes in time, the third 0.25 s after the audio before it
    has played (a silence), the fourth in time again after that; the notes line names it."""
    sys.path.insert(0, str(ROOT / "perf"))
    from loadgen import _stall, chunk_notes

    stall, gap, at, dry = _stall([0.0, 0.9, 1.75, 2.0], [1.0, 0.5, 0.5, 1.0])
    assert stall and at == 2 and dry == pytest.approx(0.25) and gap == pytest.approx(0.9)
    assert _stall([0.0, 0.5, 1.0], [1.0, 1.0, 1.0]) == (False, 0.5, None, 0.0)
    lv = {"concurrency": 64, "chunks_per_request_mean": 8.3, "stall_at_chunk": {1: 2, 3: 1}, "dry_ms_max": 120.0}
    assert chunk_notes({"levels": [lv, {**lv, "concurrency": 1, "stall_at_chunk": {}, "client_processes": 1,
                                        "ttfa_parts_ms_p50": {"first frame": 20.0, "received": 45.0}},
                                   {**lv, "concurrency": 128, "stall_at_chunk": {}, "client_processes": 4}]}) == (
        "- c=64: 8.3 chunks a request; ran dry first at chunk 1: 2, chunk 3: 1; longest silence 120.0 ms\n"
        "- c=1: 8.3 chunks a request; first audio, p50 ms: first frame 20.0, received 45.0\n"
        "- c=128: 8.3 chunks a request (the client in 4 processes)")
    # with the level's records: when the streams that ran dry were sent, and their chunks up to the late one
    records = [{"t_send": 0.5, "stall_at_chunk": None, "chunk_frames": [8, 8]},
               {"t_send": 0.04, "stall_at_chunk": 1, "chunk_frames": [2, 6, 8]},
               {"t_send": 0.01, "stall_at_chunk": 3, "chunk_frames": [2, 4, 8, 8, 8]}]
    assert chunk_notes({"levels": [{**lv, "wall_s": 27.5, "records": records}]}) == (
        "- c=64: 8.3 chunks a request; ran dry first at chunk 1: 2, chunk 3: 1; longest silence 120.0 ms (sent "
        "0.01-0.04 s into the level's 27.5 s; chunks up to the late one, frames: 2/6, 2/4/8/8)")


def _level(c, audio, p99, dry=0, errors=0, not_run=0, n=4):
    """A level as loadgen.summarize writes it, with what the sweep reads."""
    return {"concurrency": c, "requests": n, "ok": n - errors - not_run, "errors": errors, "not_run": not_run,
            "audio_s_per_s": audio, "ttfa_ms_p50": p99 / 2, "ttfa_ms_p99": p99,
            "stall_at_chunk": {"1": dry} if dry else {}, "error_samples": ["RuntimeError: full"] if errors else []}


def test_sweep_plan_and_its_stop():
    """--sweep's levels (a step, or doubling; none above MAX), the SLO's three ways to break, and the verdict: the peak
    audio-s/s among the levels before the first that breaks it (not necessarily the last of them), that level and
    why, and what ended the sweep."""
    sys.path.insert(0, str(ROOT / "perf"))
    from loadgen import SWEEP_MAX, SweepPlan, parse_sweep, slo_breaks, sweep_markdown, sweep_summary

    assert list(parse_sweep("64:32:200").levels()) == [64, 96, 128, 160, 192]
    assert list(parse_sweep("16:16:16").levels()) == [16]
    assert list(parse_sweep("8").levels())[:4] == [8, 16, 32, 64] and parse_sweep("8").max == SWEEP_MAX
    assert parse_sweep("3:2") == SweepPlan(3, 2, SWEEP_MAX) and parse_sweep("5::20") == SweepPlan(5, None, 20)
    for bad in ("", "x", "0", "4:0", "8:1:4", "1:2:3:4", ":2"):
        with pytest.raises(ValueError, match="--sweep"):
            parse_sweep(bad)

    assert slo_breaks(_level(1, 2.0, 500.0), 500) == {}  # at the limit meets it
    assert slo_breaks(_level(1, 2.0, 500.1, dry=2), 500) == {"ttfa_p99": "TTFA p99 500.1 ms > 500 ms",
                                                             "underruns": "2 of 4 streams ran dry"}
    assert slo_breaks(_level(1, 2.0, 10.0, errors=1, not_run=2), 500) == {
        "requests": "1 of 4 requests failed, 2 not run (RuntimeError: full)"}

    plan = SweepPlan(1, 1, 4)
    levels = [_level(1, 3.0, 50.0), _level(2, 5.0, 90.0), _level(3, 4.0, 120.0), _level(4, 9.0, 700.0)]
    sw = sweep_summary(levels, plan, 500)
    assert sw["concurrencies"] == [1, 2, 3, 4] and sw["met"] == [1, 2, 3] and sw["stopped_by"] == "slo"
    assert sw["peak"] == {"concurrency": 2, "audio_s_per_s": 5.0, "audio_s_per_s_steady": None, "ttfa_ms_p50": 45.0,
                          "ttfa_ms_p99": 90.0, "underruns": 0, "ok": 4, "requests": 4}
    assert sw["broken"]["concurrency"] == 4 and sw["broken"]["reasons"] == {"ttfa_p99": "TTFA p99 700.0 ms > 500 ms"}
    assert sw["plan"] == {"start": 1, "step": 1, "max": 4, "rule": "1, then +1 each, up to 4"}
    assert sweep_markdown(sw).splitlines()[-1] == "| 2 | 5.0 | None | 45.0 | 90.0 | 0 | c=4: TTFA p99 700.0 ms > 500 ms |"

    assert sweep_summary(levels[:3], plan, 500, done=False)["stopped_by"] is None  # still running
    full = sweep_summary(levels[:3], SweepPlan(1, 1, 3), 500)
    assert full["stopped_by"] == "max" and full["broken"] is None and full["peak"]["concurrency"] == 2
    assert sweep_markdown(full).splitlines()[-1].endswith("| none up to c=3 (MAX reached) |")
    failed = sweep_summary([_level(8, 1.0, 10.0), _level(16, 2.0, 10.0, errors=1)], SweepPlan(8, None, 64), 500)
    assert failed["stopped_by"] == "requests" and failed["peak"]["concurrency"] == 8
    assert failed["plan"]["rule"] == "8, then x2 each, up to 64"
    first = sweep_summary([_level(1, 1.0, 10.0, dry=1)], plan, 500)
    assert first["peak"] is None and first["met"] == [] and first["broken"]["reasons"] == {
        "underruns": "1 of 4 streams ran dry"}
    assert sweep_markdown(first).splitlines()[-1] == "| none | - | - | - | - | - | c=1: 1 of 4 streams ran dry |"


def test_ramp_and_steady_window():
    """The ramp spreads a level's first requests over one request's time, estimated from each worker's warm-up (none
    without a ramp, a warm-up or company); the steady window runs from the last worker's first send to the first
    worker's last end and counts the audio of the chunks that arrived in it, over its length."""
    sys.path.insert(0, str(ROOT / "perf"))
    from loadgen import Options, Record, ramp_delay, steady

    o = Options(frames=100, warmup_frames=20)
    assert [ramp_delay(k, 4, 0.2, o) for k in range(4)] == pytest.approx([0.0, 0.25, 0.5, 0.75])  # 0.2 s x 100/20
    assert ramp_delay(3, 4, None, o) == 0.0 and ramp_delay(0, 1, 0.2, o) == 0.0
    assert ramp_delay(3, 4, 0.2, Options(frames=100, warmup_frames=20, ramp=False)) == 0.0

    def rec(worker, t_send, total, arrivals, audio=0.5, ok=True):
        return Record(0, "plain", ok=ok, worker=worker, t_send=t_send, total_s=total, arrivals=arrivals,
                      chunk_audio_s=[audio] * len(arrivals))

    records = [rec(0, 0.0, 1.0, [0.2, 0.9]), rec(0, 1.0, 1.0, [1.2, 1.9]),  # worker 0: ends last at 2.0
               rec(1, 0.5, 1.0, [0.7, 1.4]), rec(1, 1.5, 2.0, [1.8, 3.4]),  # worker 1: first sent at 0.5, ends 3.5
               rec(1, 1.6, 0.1, [1.65], audio=9.0, ok=False)]  # a failed request's audio is not counted
    t_s, t_e, rate = steady(records)
    assert (t_s, t_e) == (0.5, 2.0)
    assert rate == pytest.approx(0.5 * 6 / 1.5)  # the chunks at 0.7, 0.9, 1.2, 1.4, 1.8, 1.9
    assert steady([rec(0, 0.0, 1.0, [0.5]), rec(1, 2.0, 1.0, [2.5])]) is None  # worker 1 started after 0 ended
    assert steady([]) is None


def test_products_step_sum_takes_each_shapes_fastest_form():
    """bench_products' step sum: per shape the fastest of the forms asked for (a form that failed for a shape is
    left out), times the step's products of that shape; none when a shape has none of them."""
    sys.path.insert(0, str(ROOT / "perf"))
    from bench_products import PER_STEP, SHAPES, step_ms

    us = {"cublas": 10.0, "kernel": 12.0, "fp8_kernel": 7.0}
    results = [{"shape": s, "rows": 64, "form": f, "us": v + i} for i, s in enumerate(SHAPES) for f, v in us.items()
               if not (s == "w2" and f == "fp8_kernel")]
    per_shape = sum(range(len(SHAPES)))
    assert step_ms(results, 64, ["cublas"]) == pytest.approx((10.0 * len(SHAPES) + per_shape) * PER_STEP / 1e3)
    assert step_ms(results, 64, ["cublas", "kernel"]) == step_ms(results, 64, ["cublas"])
    best = (7.0 * (len(SHAPES) - 1) + 10.0 + per_shape) * PER_STEP / 1e3  # w2 has no fp8 timing: its cuBLAS one
    assert step_ms(results, 64, ["cublas", "fp8_kernel"]) == pytest.approx(best)
    assert step_ms(results, 64, ["fp8_kernel"]) is None and step_ms(results, 1, ["cublas"]) is None


def test_targets_table_reads_a_run(tmp_path):
    """perf/targets.py on a run_gpu.sh result directory: each target met or not by the numbers in its files."""
    sys.path.insert(0, str(ROOT / "perf"))
    from targets import rows

    def level(c, **kw):
        return {"concurrency": c, "requests": 8, "ok": 8, "errors": 0, "audio_s_per_s": 5.0, "ttfa_ms_p50": 40.0,
                "ttfa_ms_p99": 60.0, "rtf_mean": 0.14, "rtf_p50": 0.14, "stall_fraction": 0.0,
                "gpu_mem_peak_mib": 20000.0, **kw}

    levels = [level(1), level(16, ttfa_ms_p99=180.0), level(64, requests=384, ok=384, audio_s_per_s=151.5,
                                                             ttfa_ms_p99=1200.0, stall_fraction=1 / 384,
                                                             gpu_mem_peak_mib=29000.0)]
    (tmp_path / "loadgen.json").write_text(json.dumps({"levels": levels}))
    (tmp_path / "loadgen_clone.json").write_text(json.dumps({"levels": [level(1, ttfa_ms_p50=55.0)]}))
    (tmp_path / "loadgen_clone_first.json").write_text(json.dumps({"levels": [level(1, ttfa_ms_p50=111.0)]}))
    (tmp_path / "run.log").write_text("[x] tritonserver ready in 37.1 s: gRPC 127.0.0.1:8001\n")
    (tmp_path / "determinism.jsonl").write_text(
        json.dumps({"mode": "default", "changed": 4, "checked_alone": 4, "requests": 16, "max_batch": 64}) + "\n" +
        json.dumps({"mode": "batch_invariant", "changed": 0, "checked_alone": 4, "requests": 16, "max_batch": 64,
                    "step_ms_1": 6.6, "step_ms_64": 9.5}) + "\n")
    got = {t: (m, s) for t, m, s in rows(tmp_path)}
    assert got["c=64 throughput >= 450 audio-s/s"] == ("151.5 audio-s/s over 384/384 requests", "NOT met")
    assert got["peak within the SLO >= 800 audio-s/s (a sweep)"] == ("-", "not run")
    assert got["c=64 TTFA p99 <= 1 s"][1] == "NOT met"
    assert got["no underrun at every level up to c=64"] == ("c=1: 0 of 8, c=16: 0 of 8, c=64: 1 of 384", "NOT met")
    assert got["c=1 TTFA p50 <= 15 ms"] == ("40.0 ms", "NOT met") and got["c=1 RTF <= 0.09"][1] == "NOT met"
    assert got["voice clone c=1, voice seen: TTFA p50 <= 50 ms"] == ("55.0 ms", "NOT met")
    assert got["voice clone c=1, first use of a 10 s reference: TTFA p50 <= 150 ms"] == ("111.0 ms", "met")
    assert got["server ready <= 30 s"] == ("37.1 s", "NOT met")
    # a sweep's peak, and the level that broke the SLO
    sweep = {"peak": {"concurrency": 96, "audio_s_per_s": 812.5, "ttfa_ms_p99": 480.0}, "broken": {"concurrency": 128}}
    (tmp_path / "loadgen.json").write_text(json.dumps({"levels": levels, "sweep": sweep}))
    got = {t: (m, s) for t, m, s in rows(tmp_path)}
    assert got["peak within the SLO >= 800 audio-s/s (a sweep)"] == (
        "812.5 audio-s/s at c=96, TTFA p99 480.0 ms; first over the SLO: c=128", "met")
    sweep["peak"] = None
    (tmp_path / "loadgen.json").write_text(json.dumps({"levels": levels, "sweep": sweep}))
    got = {t: (m, s) for t, m, s in rows(tmp_path)}
    assert got["peak within the SLO >= 800 audio-s/s (a sweep)"] == ("no level within the SLO; first over the SLO: "
                                                                     "c=128", "NOT met")
    assert got["first wave of 16: no stream waits on a first use (c=16 first traffic after c=1)"][1] == "met"
    m, s = got["seeded determinism (bf16, alone vs beside others), batch_invariant=true"]
    assert s == "met" and m.startswith("0 of 4 changed beside 15 others") and "9.5 at 64" in m


def test_loadgen_sweep(triton_server, tmp_path):
    out = tmp_path / "loadgen.json"
    p = _run([sys.executable, "perf/loadgen.py", "--url", triton_server.grpc_url, "--concurrency", "1,2",
              "--requests-per-level", "3,2:4", "--frames", str(FRAMES), "--warmup", "1", "--warmup-frames", "4",
              "--clone-fraction", "0.5", "--clone-mode", "mixed", "--ref-seconds", "4", "--timeout", "120",
              "--json", str(out)], timeout=240)
    r = json.loads(out.read_text())

    # the markdown table is printed last: header, separator, one row per level
    tail = p.stdout.strip().splitlines()[-4:]
    assert tail[0].startswith("| c | reqs ok/n | TTFA mean ms"), p.stdout
    assert tail[2].startswith("| 1 | 3/3 |") and tail[3].startswith("| 2 | 4/4 |"), p.stdout  # 2:4 over 3

    assert r["config"]["frames"] == FRAMES and r["config"]["concurrency"] == [1, 2]
    assert r["warmup"]["ok"] == 1
    assert r["reference"]["codes_shape"][0] == 10 and r["reference"]["codes_shape"][1] > 0  # encoded once via dac_encoder
    assert r["gpu"]["monitor"] in ("n/a", "pynvml", "nvidia-smi")
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 2]
    audio_s = FRAMES * HOP / SR
    kinds = set()
    for lv in r["levels"]:
        n = {1: 3, 2: 4}[lv["concurrency"]]
        assert lv["requests"] == n and lv["ok"] == n and lv["errors"] == 0 and lv["not_run"] == 0, lv["error_samples"]
        assert lv["ttfa_ms_mean"] > 0 and 0 < lv["ttfa_ms_p50"] <= lv["ttfa_ms_p99"] <= lv["ttfa_ms_max"] + 1e-6
        assert lv["rtf_mean"] > 0 and lv["rtf_p50"] > 0
        assert lv["audio_s_per_s"] > 0 and lv["req_per_s"] > 0 and lv["frames_per_s"] > 0
        assert lv["frames_per_s"] == pytest.approx(lv["audio_s_per_s"] * SR / HOP, rel=0.01)
        assert lv["audio_s_per_s"] == pytest.approx(n * audio_s / lv["wall_s"], rel=0.01)
        assert lv["audio_s_per_request_mean"] == pytest.approx(audio_s, abs=1e-3)
        assert lv["frames_per_request_mean"] == FRAMES and lv["frames_short"] == 0
        assert lv["chunks_per_request_mean"] >= 1
        parts = lv["ttfa_parts_ms_p50"]
        assert list(parts) == ["to slow_ar", "queue", "first frame", "first chunk out of slow_ar", "sent by s2pro",
                               "at the client", "received"]
        # each request's first audio reached the client process after s2pro sent it and before a worker read it
        assert parts["first frame"] <= parts["first chunk out of slow_ar"] <= parts["sent by s2pro"] \
            <= parts["at the client"] <= parts["received"]
        relay = [(q["server"]["ttfa_s"] - q["server"]["to_engine_s"] - q["server"]["engine_first_audio_s"]) * 1e3
                 for q in lv["records"]]  # each request's first chunk, from slow_ar's sender to s2pro's send
        assert lv["first_chunk_relay_ms_p50"] == pytest.approx(float(np.percentile(relay, 50)), abs=0.06)
        assert lv["first_chunk_relay_ms_p50"] <= lv["first_chunk_relay_ms_p99"] <= max(relay) + 0.06
        assert 0 <= lv["stall_fraction"] <= 1
        assert sum(lv["stall_at_chunk"].values()) == round(lv["stall_fraction"] * n) and lv["dry_ms_max"] >= 0
        if r["gpu"]["monitor"] == "n/a":
            assert lv["gpu_mem_peak_mib"] == "n/a"
        assert len(lv["records"]) == n
        for q in lv["records"]:
            kinds.add(q["kind"])
            assert q["ok"] and q["error"] is None
            assert 0 < q["arrived_s"] <= q["ttfa_s"], q
            assert q["frames"] == FRAMES and q["samples"] == FRAMES * HOP and q["sample_rate"] == SR
            assert q["audio_s"] == pytest.approx(audio_s, abs=1e-4)
            assert 0 < q["ttfa_s"] <= q["total_s"] and q["rtf"] == pytest.approx(q["total_s"] / q["audio_s"], rel=1e-3)
            assert q["server"]["frames"] == FRAMES and q["server"]["finish_reason"] == "length"
            sv = q["server"]  # where the first audio's time went: s2pro -> slow_ar -> first frame -> first chunk
            assert 0 <= sv["to_engine_s"] and 0 <= sv["queue_s"] <= sv["engine_first_frame_s"]
            assert sv["engine_first_frame_s"] <= sv["engine_first_audio_s"]
            assert sv["to_engine_s"] + sv["engine_first_audio_s"] <= sv["ttfa_s"] + 1e-3 and sv["ttfa_s"] <= q["ttfa_s"]
            assert sum(q["chunk_frames"]) == FRAMES and len(q["chunk_frames"]) == q["chunks"]
            assert 0 <= q["t_send"] <= lv["wall_s"]
            assert q["arrivals"] == sorted(q["arrivals"]) and len(q["arrivals"]) == q["chunks"]
            assert q["t_send"] < q["arrivals"][0] <= q["t_send"] + q["total_s"] + 1e-3
            assert sum(q["chunk_audio_s"]) == pytest.approx(q["audio_s"], abs=1e-4)
        # the ramp: at c=2 the second worker's first request after the first worker's; the steady window from it
        first = {w: min(q["t_send"] for q in lv["records"] if q["worker"] == w) for w in range(lv["concurrency"])}
        if lv["concurrency"] == 2:
            assert first[1] > first[0]
        if lv["steady_window_s"] is not None:
            assert lv["steady_window_s"][0] == pytest.approx(max(first.values()), abs=1e-3)
            assert lv["audio_s_per_s_steady"] > 0
    assert kinds == {"plain", "clone_codes", "clone_audio"}, kinds

    # the targets table from this run's own file: c=1 measured (a tiny model on a CPU meets none of the speed
    # targets), the levels and phases it did not run say so
    t = _run([sys.executable, "perf/targets.py", str(tmp_path)], timeout=60).stdout
    got = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[1:] for line in t.splitlines()[2:]}
    lv1 = r["levels"][0]
    assert got["c=1 TTFA p50 <= 15 ms"] == [f"{lv1['ttfa_ms_p50']} ms", "met" if lv1["ttfa_ms_p50"] <= 15 else "NOT met"]
    assert got["c=64 throughput >= 450 audio-s/s"] == ["-", "not run"]
    assert got["server ready <= 30 s"][1] == "not run" and got["no underrun at every level up to c=64"][1] == "not run"


def test_loadgen_worker_processes(triton_server, tmp_path):
    """--procs: a level's workers split over spawned processes (one job queue, one start, the parent's clock): every
    request is run once and recorded with its audio, and each record's send time is on the parent's clock (within
    the level's wall time; a per-process clock would put them anywhere); a level smaller than --procs uses one
    process per worker."""
    out = tmp_path / "loadgen.json"
    _run([sys.executable, "perf/loadgen.py", "--url", triton_server.grpc_url, "--concurrency", "3,1",
          "--requests-per-level", "5,1:2", "--frames", str(FRAMES), "--warmup", "0", "--warmup-frames", "4",
          "--procs", "2", "--timeout", "120", "--json", str(out)], timeout=240)
    r = json.loads(out.read_text())
    assert r["config"]["procs"] == 2
    for lv, n in zip(r["levels"], (5, 2)):
        assert lv["requests"] == n and lv["ok"] == n and lv["not_run"] == 0, lv["error_samples"]
        assert lv["warmup_errors"] == 0
        recs = lv["records"]
        assert sorted(q["idx"] for q in recs) == sorted({q["idx"] for q in recs}) and len(recs) == n  # each once
        for q in recs:
            assert q["ok"] and q["frames"] == FRAMES and q["samples"] == FRAMES * HOP
            assert 0 <= q["t_send"] <= lv["wall_s"] and q["t_send"] + q["total_s"] <= lv["wall_s"] + 0.05
        assert lv["audio_s_per_s"] == pytest.approx(n * FRAMES * HOP / SR / lv["wall_s"], rel=0.01)
        # run by two processes (the level of one worker: in the loadgen process itself)
        assert len({q["pid"] for q in recs}) == min(2, lv["concurrency"]), recs


def _sweep(url, out, sweep, slo_ms, requests):
    """loadgen --sweep on the tiny server; every request one chunk (its first is all of it), so no stream can run dry
    and only TTFA and failures can break the SLO. -> (the JSON, stdout)."""
    p = _run([sys.executable, "perf/loadgen.py", "--url", url, "--sweep", sweep, "--slo-ttfa-p99-ms", str(slo_ms),
              "--requests-per-level", requests, "--frames", str(FRAMES), "--first-chunk-frames", str(FRAMES),
              "--chunk-frames", str(FRAMES), "--warmup", "0", "--warmup-frames", "4", "--timeout", "120",
              "--json", str(out)], timeout=300)
    return json.loads(out.read_text()), p.stdout


def _check_sweep_against_its_levels(r, stdout):
    """The sweep's verdict is the one its own levels give: each level before the broken one met the SLO, the peak is
    the highest audio-s/s among them with their numbers, the broken level's numbers and reasons are its own; the
    markdown's section has that row."""
    sw, levels = r["sweep"], r["levels"]
    slo = r["config"]["slo_ttfa_p99_ms"]
    assert r["partial"] is False and sw["slo"]["ttfa_ms_p99_max"] == slo
    assert sw["concurrencies"] == [lv["concurrency"] for lv in levels]
    met = levels[:-1] if sw["broken"] else levels
    assert sw["met"] == [lv["concurrency"] for lv in met]
    for lv in met:
        assert lv["ok"] == lv["requests"] and lv["ttfa_ms_p99"] <= slo and not lv["stall_at_chunk"], lv
    if met:
        best = max(met, key=lambda lv: lv["audio_s_per_s"])
        assert sw["peak"] == {"concurrency": best["concurrency"], "audio_s_per_s": best["audio_s_per_s"],
                              "audio_s_per_s_steady": best["audio_s_per_s_steady"], "ttfa_ms_p50": best["ttfa_ms_p50"],
                              "ttfa_ms_p99": best["ttfa_ms_p99"], "underruns": 0, "ok": best["ok"],
                              "requests": best["requests"]}
        row = [str(best[k]) for k in ("concurrency", "audio_s_per_s", "audio_s_per_s_steady", "ttfa_ms_p50",
                                      "ttfa_ms_p99")] + ["0"]
    else:
        assert sw["peak"] is None
        row = ["none", "-", "-", "-", "-", "-"]
    section = stdout.split("### peak within the SLO")[1].strip().splitlines()
    assert section[2].startswith("| c | audio-s/s |") and section[4].startswith("| " + " | ".join(row) + " | "), section
    return section[4]


def test_loadgen_sweep_finds_the_peak_within_the_slo(triton_server, tmp_path):
    """--sweep on the tiny server, twice. A TTFA limit no request meets: the sweep stops after its first level (its
    next would have been 2), which broke it by TTFA p99 alone, and no level met it. A limit every request meets: the
    levels 1, 2, 3 all run (three requests each, two at c=1) and the sweep stops at MAX, the peak the best of them."""
    strict, out = _sweep(triton_server.grpc_url, tmp_path / "strict.json", "1", 0.001, "2")
    assert strict["config"]["sweep"] == {"start": 1, "step": None, "max": 1024}
    assert strict["config"]["concurrency"] == []
    (lv,) = strict["levels"]
    assert lv["concurrency"] == 1 and lv["ok"] == lv["requests"] == 2, lv["error_samples"]
    b = strict["sweep"]["broken"]
    assert b["concurrency"] == 1 and b["reasons"] == {"ttfa_p99": f"TTFA p99 {lv['ttfa_ms_p99']} ms > 0.001 ms"}
    assert b["ttfa_ms_p99"] == lv["ttfa_ms_p99"] and b["audio_s_per_s"] == lv["audio_s_per_s"]
    assert strict["sweep"]["stopped_by"] == "slo" and strict["sweep"]["met"] == []
    row = _check_sweep_against_its_levels(strict, out)
    assert row.endswith(f"| c=1: TTFA p99 {lv['ttfa_ms_p99']} ms > 0.001 ms |"), row

    lenient, out = _sweep(triton_server.grpc_url, tmp_path / "lenient.json", "1:1:3", 1e6, "3,1:2")
    assert [(lv["concurrency"], lv["requests"]) for lv in lenient["levels"]] == [(1, 2), (2, 3), (3, 3)]
    assert lenient["sweep"]["stopped_by"] == "max" and lenient["sweep"]["broken"] is None
    assert lenient["sweep"]["met"] == [1, 2, 3]
    row = _check_sweep_against_its_levels(lenient, out)
    assert row.endswith("| none up to c=3 (MAX reached) |"), row
    # the per-level table above the section is the --concurrency mode's, one row a level
    assert "| 1 | 2/2 |" in out and "| 2 | 3/3 |" in out and "| 3 | 3/3 |" in out, out


def test_run_gpu_sweep_with_the_servers_own_settings(tiny_ckpt, tmp_path):
    """perf/run_gpu.sh on the CPU with SWEEP and no MAX_BATCH / MAX_SEQ_LEN: the server runs with its own defaults
    (no --set for them; the models' parameters say so), the plain phase is the sweep (loadgen.json's "sweep" over
    the levels SWEEP names) and summary.md has its section "peak within the SLO"."""
    from servers import free_port

    from s2tts.settings import SCHEMA

    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "SWEEP": "1:1:2", "SLO_TTFA_P99_MS": "1000000", "FRAMES": "6",
           "LOADGEN_ARGS": "--requests-per-level 2 --warmup 0 --first-chunk-frames 6 --chunk-frames 6",
           "CLONE_CONCURRENCY": "", "PA": "0", "CPU_USE": "0", "DEVICE": "cpu", "CKPT": str(tiny_ckpt),
           "CKPT_SIZE": "tiny", "PYTHON": sys.executable, "USE_CARRIED": "0", "WORK": str(tmp_path / "work"),
           "GRPC_PORT": str(free_port()), "HTTP_PORT": str(free_port()), "METRICS_PORT": str(free_port()),
           "STOP_NOW": "1"}
    for k in ("MAX_BATCH", "MAX_SEQ_LEN", "CONCURRENCY"):
        env.pop(k, None)
    _run(["bash", "perf/run_gpu.sh"], timeout=600, env=env)
    r = json.loads((out / "loadgen.json").read_text())
    for model in ("slow_ar", "s2pro"):
        assert r["server"][model]["max_batch"] == str(SCHEMA["max_batch"].default), r["server"]
        assert r["server"][model]["max_seq_len"] == str(SCHEMA["max_seq_len"].default), r["server"]
    assert r["config"]["sweep"] == {"start": 1, "step": 1, "max": 2} and r["config"]["slo_ttfa_p99_ms"] == 1e6
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 2] and r["sweep"]["stopped_by"] == "max"
    summary = (out / "summary.md").read_text()
    assert "--set max_batch" not in summary and "--set max_seq_len" not in summary, summary
    assert "## loadgen, plain prompts, a sweep of levels 1:1:2" in summary, summary
    _check_sweep_against_its_levels(r, summary)


def _perf_analyzer_runs() -> str | None:
    """None if perf_analyzer can start here, else why not."""
    from s2tts.perf_tools import perf_analyzer_env, perf_analyzer_path

    pa = perf_analyzer_path()
    if pa is None:
        return "no perf_analyzer binary (tritonclient==2.51.0 wheel)"
    p = subprocess.run([str(pa), "--help"], capture_output=True, text=True, env=perf_analyzer_env(), timeout=60)
    if "error while loading shared libraries" in p.stderr:
        return f"perf_analyzer cannot load its libraries: {p.stderr.strip()[:200]} (scripts/setup.sh installs them)"
    return None


def test_live_load_script(triton_server, tmp_path):
    """perf/live_load.py on the tiny server: text sessions fed a token at a time, two levels; every session's every
    sentence was heard (its first audio after its last token, the segments in order), the table has both levels."""
    out = tmp_path / "live.json"
    p = _run([sys.executable, "perf/live_load.py", "--url", triton_server.grpc_url, "--concurrency", "1,2",
              "--sessions", "2", "--sentences", "2", "--tokens-per-s", "200", "--frames", "4", "--warmup", "0",
              "--json", str(out)], timeout=300)
    levels = json.loads(out.read_text())["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2] and all(lv["errors"] == 0 for lv in levels), levels
    for lv in levels:
        for r in lv["records"]:
            assert r["sentences"] == 2 and r["segments"] == 2 and len(r["latency_ms"]) == 2, r
            assert all(x > 0 for x in r["latency_ms"]) and r["stats"]["frames"] == 8 and r["audio_s"] == round(
                8 * 2048 / 44100, 3)
        assert lv["first_ms_p50"] > 0 and lv["audio_s_per_s"] > 0
    assert "| concurrency | sessions |" in p.stdout and "\n| 2 | 2 |" in p.stdout


def test_make_pa_inputs_and_perf_analyzer(triton_server, tiny_ckpt, tmp_path):
    from s2tts.checkpoint_config import S2Config

    inputs, out = tmp_path / "pa_inputs", tmp_path / "pa"
    _run([sys.executable, "perf/make_pa_inputs.py", "--checkpoint", str(tiny_ckpt), "--out", str(inputs),
          "--frames", "8", "--entries", "2", "--fast-ar-batches", "1,4", "--decode-frames", "5"], timeout=120)
    s2 = S2Config.from_dir(tiny_ckpt)
    meta = json.loads((inputs / "meta.json").read_text())
    assert meta["dim"] == s2.text.dim and meta["num_codebooks"] == s2.num_codebooks == 10

    fa = json.loads((inputs / "fast_ar_b4.json").read_text())["data"]
    assert fa[0]["hidden"]["shape"] == [4, s2.text.dim] and len(fa[0]["hidden"]["content"]) == 4 * s2.text.dim
    assert all(fa[0][k]["shape"] == [4] for k in ("code0", "temperature", "top_p", "top_k", "seed", "step"))
    dec = json.loads((inputs / "dac_decoder.json").read_text())["data"]
    assert dec[0]["codes"]["shape"] == [5, 10] and dec[0]["final"]["content"] == [True]  # [frames, codebooks]
    assert dec[0]["start"]["content"] == [True]
    assert len({e["stream_id"]["content"][0] for e in dec}) == len(dec)
    sl = json.loads((inputs / "slow_ar.json").read_text())["data"][0]
    t = sl["input_ids"]["shape"][0]
    assert sl["input_codes"]["shape"] == [t, 10] and sl["semantic_mask"]["shape"] == [t] and t > 10
    assert json.loads((inputs / "s2pro.json").read_text())["data"][0]["max_new_tokens"]["content"] == [8]

    why = _perf_analyzer_runs()
    if why:
        pytest.skip(why)
    env = dict(os.environ, PYTHON=sys.executable, PA_WARMUP="1")
    p = _run(["bash", "perf/run_perf_analyzer.sh", "-u", triton_server.grpc_url, "-i", str(inputs), "-o", str(out),
              "-m", "fast_ar dac_decoder slow_ar", "-c", "1", "-n", "3", "-b", "4", "-t", "120"], timeout=300, env=env)
    for name in ("fast_ar_b4", "dac_decoder", "slow_ar"):  # slow_ar: request-response, one whole answer each
        rows = list(csv.DictReader((out / f"pa_{name}_c1.csv").open()))
        assert rows and float(rows[0]["Inferences/Second"]) > 0 and float(rows[0]["p50 latency"]) > 0, name
    summary = (out / "pa_summary.md").read_text()
    assert "| fast_ar_b4 | 1 |" in summary and "| dac_decoder | 1 |" in summary and "rows/s" in summary, summary
    assert "| slow_ar | 1 |" in summary and "frames/s" in summary, summary
    assert summary in p.stdout


def test_scale_gpus_script_on_the_cpu(tiny_ckpt, tmp_path):
    """perf/scale_gpus.sh end to end with `device=cpu` and `cpu,cpu` (what it runs as cuda:0 and cuda:0,cuda:1 on a
    GPU host): both layouts serve every request, and the two-engine server loaded slow_ar_1 and dac_decoder_1 and
    served through both engines and both codecs (the real tritonserver with two engines; what s2pro does with them
    is tests/test_layout.py's, on the fake), its load generator in worker processes (one per stream here)."""
    import tarfile

    from servers import free_port

    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPUS": "1 2", "C_PER_GPU": "1", "FRAMES": "6",
           "DEVICE_TYPE": "cpu", "CKPT": str(tiny_ckpt), "CKPT_SIZE": "tiny", "PYTHON": sys.executable, "USE_CARRIED": "0",
           "MAX_BATCH": "2", "MAX_SEQ_LEN": "1024", "WORK": str(tmp_path / "work"), "GRPC_PORT": str(free_port()),
           "HTTP_PORT": str(free_port()), "METRICS_PORT": str(free_port()),
           "STOP_NOW": "1",  # each run's server killed once its results are written: no graceful unload to wait for
           "CPU_USE": "0",  # no /proc sampler beside the load (tests/test_cpu_use.py checks it)
           # the server and the load generator pinned (taskset) to the CPUs this test may use
           "SERVER_CPUS": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
           "CLIENT_CPUS": str(min(os.sched_getaffinity(0)))}
    _run(["bash", "perf/scale_gpus.sh"], timeout=600, env=env)
    rows = json.loads((tmp_path / "out" / "scale.json").read_text())
    assert [(r["engines"], r["concurrency"]) for r in rows] == [(1, 1), (2, 2)]
    for n, procs in ((1, 1), (2, 2)):  # from two engines up the client runs in processes (PROCS_PER_GPU; min(c, 4) here)
        with tarfile.open(tmp_path / "out" / f"g{n}.tar.gz") as tar:
            level = json.loads(tar.extractfile(f"g{n}/loadgen.json").read())["levels"][-1]
        assert level["client_processes"] == procs, (n, level)
    assert all(r["ok"] == r["requests"] > 0 and r["audio_s_per_s"] > 0 for r in rows), rows
    assert rows[0]["efficiency"] == 1.0 and rows[1]["efficiency"] > 0
    with tarfile.open(tmp_path / "out" / "g1.tar.gz") as tar:
        run_log = tar.extractfile("g1/run.log").read().decode(errors="replace")
    assert f"CPUs: the server on {env['SERVER_CPUS']}, the load generators on {env['CLIENT_CPUS']}" in run_log
    with tarfile.open(tmp_path / "out" / "g2.tar.gz") as tar:
        log = tar.extractfile("g2/tritonserver.log").read().decode(errors="replace")
    assert "successfully loaded 'slow_ar_1'" in log and "successfully loaded 'dac_decoder_1'" in log
    assert re.search(r"slow_ar_1 ready in [\d.]+ s \(weights [\d.]+ s, .*\): device=cpu", log), log[-3000:]
    assert "dac_decoder_1 ready: device=cpu" in log
    with tarfile.open(tmp_path / "out" / "g2.tar.gz") as tar:  # Triton's statistics: both engines and codecs served
        stats = json.loads(tar.extractfile("g2/model_stats.json").read())["model_stats"]
    served = {m["name"]: int(m["inference_stats"]["success"].get("count", 0)) for m in stats}
    assert all(served[m] > 0 for m in ("slow_ar", "slow_ar_1", "dac_decoder", "dac_decoder_1")), served


def test_fp8_effect_script_on_the_cpu(tiny_ckpt, tmp_path):
    """perf/fp8_effect.py end to end on the tiny model: for each seed the sampled codes of both models compared
    codebook by codebook, and the teacher-forced logits of both ARs: FP8's error is above zero (the weights did
    change) and small (the rounding of eight bits), every number in its range."""
    out = tmp_path / "fp8.json"
    _run([sys.executable, "perf/fp8_effect.py", "--checkpoint", str(tiny_ckpt), "--device", "cpu", "--dtype", "fp32",
          "--frames", "12", "--seeds", "0,1", "--json", str(out)], timeout=600)
    r = json.loads(out.read_text())
    assert r["runs"] == len(r["records"]) == 2 and [x["seed"] for x in r["records"]] == [0, 1]
    C = len(r["records"][0]["codes_equal_per_codebook"])
    for x in r["records"]:
        assert x["first_differing_frame"] is None or 0 <= x["first_differing_frame"] < 12
        assert len(x["codes_equal_per_codebook"]) == C and all(0 <= v <= 1 for v in x["codes_equal_per_codebook"])
        for part in ("slow_logits", "fast_logits"):
            assert 0 < x[part]["rel_err_mean"] <= x[part]["rel_err_max"] < 0.2, x
            assert 0 <= x[part]["argmax_agree"] <= 1
    assert 0 < r["slow_rel_err_mean"] < 0.2 and 0 < r["fast_rel_err_mean"] < 0.2


def test_bench_loop_script_on_the_cpu(tiny_ckpt, tmp_path):
    """perf/bench_loop.py on the CPU: the serving loop with the codec in it, streams out of step, two codec-batching
    settings, held admissions, a replacement 30 ms late, Python beside the loop and launch ahead (each knob's values
    with the first of the others): every run delivered audio from finished requests, with no error, its steady state
    in range."""
    out = tmp_path / "loop.json"
    _run([sys.executable, "perf/bench_loop.py", "--checkpoint", str(tiny_ckpt), "--device", "cpu", "--streams", "3",
          "--frames", "12", "--frames-jitter", "3", "--stagger-ms", "20", "--seconds", "1.5", "--warm-s", "0.4",
          "--batch-steps", "1,4", "--admit-every", "1,2", "--resubmit-ms", "0,30", "--resubmit-jitter-ms", "10",
          "--gil-load", "50:1", "--launch-ahead", "1", "--json", str(out)], timeout=600)
    rows = json.loads(out.read_text())
    assert [(r["batch_steps"], r["admit_every"], r["resubmit_ms"], r["gil_load"], r["launch_ahead"]) for r in rows] == \
        [(1, 1, 0, None, False), (4, 1, 0, None, False), (1, 2, 0, None, False), (1, 1, 30, None, False),
         (1, 1, 0, "50:1", False), (1, 1, 0, None, True)]
    for r in rows:
        assert r["audio_s_per_s"] > 0 and r["requests_done"] > 0 and r["errors"] == 0 and r["resubmit_jitter_ms"] == 10, r
        assert r["step_ms"] > 0 and r["streams_per_call"] >= 1 and 0 <= r["stall_fraction"] <= 1
        assert sum(r["stall_at_chunk"].values()) == round(r["stall_fraction"] * r["requests_done"])
        # where the slots went (3 streams): frames and slots a step, steps with a prompt's end, last frame to final
        # (slots held: those live after a pass and the requests it ended, which for a pass that also takes the
        # outputs of the step launched during its codec call are two steps' ends: at most 2 x 3)
        assert 0 < r["frames_per_step"] <= r["slots_held"] <= 2 * 3 and 0 <= r["prompt_steps"] <= 1, r
        assert r["tail_ms_p50"] is None or r["tail_ms_p50"] >= 0
        assert 0 <= r["off_cpu_ms"] <= r["step_ms"] + r["rest_ms"], r  # of the pass, the engine thread off its CPU
        # the engine's calls split into launching and waiting for frames (within the pass; a launch behind a codec
        # call falls in rest_ms), the prompt steps' apart
        assert r["launch_ms"] > 0 and r["wait_ms"] >= 0 and r["launch_ms"] + r["wait_ms"] <= r["step_ms"] + r["rest_ms"], r
        assert r["prompt_launch_ms"] >= 0 and r["prompt_wait_ms"] >= 0 and 0 <= r["prompt_behind_codec"] <= 1, r
        assert r["prompt_behind_codec"] == 0 or r["launch_ahead"], r  # only launch ahead launches behind a call


def test_codec_bench_served_path_on_the_cpu(tiny_ckpt, tmp_path):
    """perf/bench_codec.py --served-only on the CPU: the decoder the servers open, one call of two streams' chunks
    timed, its audio seconds a second from the chunk's frames; --variant sets a module's switch, and names its form
    when given another."""
    out = tmp_path / "codec.json"
    _run([sys.executable, "perf/bench_codec.py", "--checkpoint", str(tiny_ckpt), "--served-only", "--device", "cpu",
          "--chunk", "4", "--batches", "2", "--paths", "served", "--variant", "s2tts.codec.model.DEPTHWISE_CUDNN=True",
          "--json", str(out)], timeout=300)
    made, call = json.loads(out.read_text())
    assert made["path"] == call["path"] == "served" and made["graphs"] == 0, made
    assert call["batch"] == 2 and call["chunk_frames"] == 4 and call["wall_ms"] > 0, call
    assert call["audio_s_per_s"] == pytest.approx(2 * 4 * HOP / SR / (call["wall_ms"] / 1e3), rel=0.05, abs=0.06), call
    bad = subprocess.run([sys.executable, "perf/bench_codec.py", "--checkpoint", str(tiny_ckpt), "--served-only",
                          "--variant", "DEPTHWISE_CUDNN"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "give MODULE.NAME=VALUE" in bad.stderr


def test_determinism_script_on_the_cpu(tiny_ckpt):
    """perf/determinism.py on the tiny model: one line per mode; with `batch_invariant` no seeded request's codes
    change beside the others."""
    p = _run([sys.executable, "perf/determinism.py", "--checkpoint", str(tiny_ckpt), "--requests", "3", "--max-batch",
              "3", "--frames", "6", "--alone", "2"], timeout=300)
    rows = {r["mode"]: r for r in (json.loads(line) for line in p.stdout.splitlines() if line.startswith("{"))}
    assert set(rows) == {"default", "batch_invariant"}, p.stdout
    assert all(r["requests"] == 3 and r["checked_alone"] == 2 and r["step_ms_1"] > 0 for r in rows.values()), rows
    assert rows["batch_invariant"]["changed"] == 0, rows


def test_compare_script_runs_both_trees_and_prints_their_tables(tiny_ckpt, tmp_path):
    """perf/compare_gpu.sh's serve part on the CPU (run_gpu.sh's DEVICE=cpu, c=1, one request a tree): this tree and
    another commit's archived tree each run their own run_gpu.sh, each folder says which tree ran, and the tables
    printed last are each tree's own numbers."""
    from servers import free_port

    base = tmp_path / "base"
    base.mkdir()
    archive = subprocess.run(f"git archive HEAD | tar -x -C {base}", shell=True, cwd=ROOT, capture_output=True, text=True)
    assert archive.returncode == 0, archive.stderr
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "BASE_DIR": str(base), "BASE_REV": "HEAD", "LEVELS": "1", "REQUESTS": "1:1",
           "FRAMES": "4", "DEVICE": "cpu", "CKPT": str(tiny_ckpt), "CKPT_SIZE": "tiny", "PYTHON": sys.executable,
           "USE_CARRIED": "0", "MAX_BATCH": "2", "MAX_SEQ_LEN": "1024", "WORK": str(tmp_path / "work"),
           "GRPC_PORT": str(free_port()), "HTTP_PORT": str(free_port()), "METRICS_PORT": str(free_port()),
           "CPU_USE": "0"}
    p = _run(["bash", "perf/compare_gpu.sh", "serve"], timeout=600, env=env)
    for tree in ("final", "base"):
        assert f"== {tree} serve rc=0" in p.stdout, p.stdout + (out / tree / "serve.log").read_text()[-3000:]
        level = json.loads((out / tree / "serve" / "loadgen.json").read_text())["levels"][0]
        assert level["concurrency"] == 1 and level["ok"] == 1, level
        table = p.stdout.split(f"== {tree}: {out / tree / 'serve' / 'summary.md'}")[1].split("==")[0]
        assert f"| 1 | 1/1 | {level['ttfa_ms_mean']} |" in table, table
    head = subprocess.run(["git", "log", "-1", "--format=commit %h %s"], cwd=ROOT, capture_output=True, text=True)
    assert (out / "final" / "tree.txt").read_text().startswith(head.stdout.strip())
    assert (out / "base" / "tree.txt").read_text().strip() == f"{base}/ = git archive HEAD"
    bad = subprocess.run(["bash", "perf/compare_gpu.sh", "nothing"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "usage: BASE_REV=<commit> bash perf/compare_gpu.sh serve|kernels|fp8|scale" in bad.stderr
    none = subprocess.run(["bash", "perf/compare_gpu.sh", "serve"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "BASE_DIR": str(tmp_path / "missing")})
    assert none.returncode == 2 and "the base tree needs" in none.stderr, none.stderr


def test_compare_sweep_serves_a_tree_and_prints_its_sweep(tiny_ckpt, tmp_path):
    """perf/compare_sweep.sh on the CPU with this tree alone (TREES=final): its server started on the given ports,
    swept by loadgen (a lenient SLO: one level, two requests) and stopped; the table printed last is the sweep's own.
    Asked for the base tree without one, it says what it needs."""
    from servers import free_port

    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "TREES": "final", "DEVICE": "cpu", "CKPT": str(tiny_ckpt),
           "PYTHON": sys.executable, "USE_CARRIED": "0", "SWEEP": "1:1:1", "REQUESTS": "2",
           # (each request's 4 frames in one chunk: no stream can run dry on a slow machine, so the level is the peak)
           "LOADGEN_ARGS": "--frames 4 --first-chunk-frames 4 --warmup 0 --slo-ttfa-p99-ms 1000000 --timeout 120",
           "FINAL_SETTINGS": "--set max_batch=2", "GRPC_PORT": str(free_port()), "HTTP_PORT": str(free_port()),
           "METRICS_PORT": str(free_port())}
    p = _run(["bash", "perf/compare_sweep.sh"], timeout=400, env=env)
    r = json.loads((out / "sweep_final.json").read_text())
    (lv,) = r["levels"]
    assert lv["concurrency"] == 1 and lv["ok"] == 2 and r["sweep"]["peak"]["concurrency"] == 1, lv["error_samples"]
    assert r["server"]  # the models' parameters read from the server it started
    table = p.stdout.split("== final")[1]
    assert f"| 1 | 2/2 | {lv['ttfa_ms_mean']} |" in table, p.stdout
    assert "tritonserver ready in" in p.stdout and (out / "work_final" / "tritonserver.log").is_file()
    none = subprocess.run(["bash", "perf/compare_sweep.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "TREES": "final base", "BASE_DIR": str(tmp_path / "missing")})
    assert none.returncode == 2 and "the base tree needs" in none.stderr, none.stderr


def test_scale_sweep_sweeps_each_layout_and_tables_their_peaks(tiny_ckpt, tmp_path):
    """perf/scale_sweep.sh on the CPU: each layout's server started and swept in turn (one with its codec's device
    named), a layout that needs GPUs the host lacks skipped, and one table of the peaks, each over the first layout's
    (two engines on the CPU: test_scale_gpus_script_on_the_cpu)."""
    from servers import free_port

    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "CKPT": str(tiny_ckpt), "PYTHON": sys.executable, "USE_CARRIED": "0",
           "LAYOUTS": "one=cpu@1:1:1 gpus=cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7,cuda:8@1 "
                      "split=cpu/cpu@1:1:1",
           # (each request's 4 frames in one chunk: no stream can run dry on a slow machine, so each level is a peak)
           "REQUESTS": "2",
           "LOADGEN_ARGS": "--frames 4 --first-chunk-frames 4 --warmup 0 --slo-ttfa-p99-ms 1000000 --timeout 120",
           "SETTINGS": "--set max_batch=2", "GRPC_PORT": str(free_port()), "HTTP_PORT": str(free_port()),
           "METRICS_PORT": str(free_port())}
    p = _run(["bash", "perf/scale_sweep.sh"], timeout=400, env=env)
    rows = json.loads((out / "scale_sweep.json").read_text())
    assert [(r["layout"], r["device"], r["codec_device"]) for r in rows] == [
        ("one", "cpu", "beside each engine"), ("split", "cpu", "cpu")]
    for r in rows:
        sw = json.loads((out / r["layout"] / "sweep_final.json").read_text())["sweep"]
        assert r["concurrency"] == 1 == sw["peak"]["concurrency"] and r["peak_audio_s_per_s"] == sw["peak"]["audio_s_per_s"] > 0
        assert r["underruns"] == 0 and r["first_over"] is None
    assert rows[0]["over_first"] == 1.0 and rows[1]["over_first"] == round(rows[1]["peak_audio_s_per_s"] /
                                                                           rows[0]["peak_audio_s_per_s"], 3)
    for name in ("one", "split"):  # each server read back: on a CPU the codec is on the CPU however it is named
        server = json.loads((out / name / "sweep_final.json").read_text())["server"]
        assert server["dac_decoder"]["codec_device"] == "cpu"
    assert not (out / "gpus").exists()
    assert (out / "scale_sweep.md").read_text().strip() in p.stdout


def test_host_bench_runs_the_serving_loop_over_an_idle_engine(tmp_path):
    """perf/bench_host.py: the loop's own Python at 8 streams, an engine and a codec that do nothing (its step 1 ms
    long, `--step-ms`). Requests of 12 frames end (their final responses reach their responders) and are replaced,
    about one for every 12 frames the passes made, and the times it reports agree with its counts."""
    out = tmp_path / "host.json"
    p = _run([sys.executable, "perf/bench_host.py", "--streams", "8", "--seconds", "1", "--frames", "12",
              "--step-ms", "1", "--json", str(out)], timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = json.loads(out.read_text())["levels"]
    assert row["streams"] == 8 and row["passes"] > 12, row
    assert 0.5 * row["passes"] * 8 / 12 <= row["requests_ended"] <= row["passes"] * 8 / 12 + 8, row
    assert row["host_ms_per_pass"] == pytest.approx(1e3 * row["seconds"] / row["passes"], rel=0.02)
    assert row["host_ms_per_pass"] >= 1  # each pass's step slept 1 ms
    assert row["frames_per_s"] == pytest.approx(row["passes"] * 8 / row["seconds"], rel=0.01)
    assert 0 < row["codec_calls_per_pass"] and 1 <= row["streams_per_codec_call"] <= 8, row
    assert 0 <= row["codec_padding_share"] < 1, row


def test_host_bench_counts_the_codec_calls_the_served_decoder_would_make():
    """bench_host's silent codec groups a call's jobs as `codec.stream` does: one call a chunk length (a final chunk
    at the next prepared length), streams padded to the pool's bucket, at most max_frames frames a call."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_host", ROOT / "perf" / "bench_host.py")
    bh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bh)
    codec = bh.SilentCodec([2, 8, 16], max_batch=64, max_frames=40)
    jobs = [(i, i, np.zeros((8, 10), np.int32), False, False) for i in range(6)]  # 6 x 8 frames: cap 4 a call
    jobs += [(10, 10, np.zeros((3, 10), np.int32), False, True)]  # a final of 3 frames, decoded at 8: one more
    out = codec.decode_many(jobs, 0.0)
    assert {k: a.size for k, a in out.items()} == {**{i: 8 * 2048 for i in range(6)}, 10: 3 * 2048}
    assert codec.calls == 2 and codec.streams == 7 and codec.frames == 51
    assert codec.computed == (4 + 4) * 8  # 7 streams of 8 frames: calls of 4 and 3, the 3 padded to bucket 4


def test_cold_start_builds_slow_ar_as_served_and_reports_its_parts(tiny_ckpt, tmp_path):
    """perf/cold_start.py on the CPU: slow_ar's engine built from a rendered repository's settings (the tiny
    checkpoint, the settings given), its parts and compiles written (none on a CPU: no kernel compiles there), where
    its main thread was by part, and a bad --variant refused before anything is built."""
    out = tmp_path / "cold.json"
    p = _run([sys.executable, "perf/cold_start.py", "--checkpoint", str(tiny_ckpt), "--device", "cpu",
              "--set", "max_batch=3", "--stacks", "--json", str(out)], timeout=300)
    got = json.loads(out.read_text())
    assert got["ready_s"] > 0 and got["compiles"] == 0 and got["settings"] == ["max_batch=3"], got
    rows = [r for part in got["stacks"].values() for r in part]  # where the main thread was, sampled
    assert rows and all(sec > 0 and isinstance(inner, str) and isinstance(ours, str) for sec, inner, ours in rows)
    assert set(got["stacks"]) <= {"before the codec", "codec: captures", "engine: captures"}, got["stacks"]
    assert any("slow_ar ready in" in line and "max_batch=3 " in line for line in got["log"]), got["log"]
    assert "0 Triton compiles" in p.stdout
    bad = subprocess.run([sys.executable, "perf/cold_start.py", "--checkpoint", str(tiny_ckpt), "--device", "cpu",
                          "--variant", "s2tts.codec.kernels.NO_SUCH_TABLE"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "give MODULE.NAME=VALUE" in bad.stderr


def test_cold_start_reports_how_many_compiles_ran_at_once():
    """cold_start.py's compile log: a part's wall time compiling counts overlapping compiles once, and its compiles
    at once are their summed seconds over that time."""
    sys.path.insert(0, str(ROOT / "perf"))
    from cold_start import CompileLog

    log = CompileLog()
    log.records = [("a", 2.0, "p", 0.0), ("b", 1.0, "p", 1.0), ("c", 1.0, "p", 5.0), ("a", 3.0, "q", 0.5)]
    got = log.summary(top=1)
    assert got["by_part"] == {"p": {"compiles": 3, "compile_s": 4.0, "busy_s": 3.0, "threads": 1.33},
                              "q": {"compiles": 1, "compile_s": 3.0, "busy_s": 3.0, "threads": 1.0}}
    assert got["compiles"] == 4 and got["kernels"] == {"a": {"compiles": 2, "compile_s": 5.0}}
