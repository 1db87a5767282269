"""The benchmark harness (perf/) against the real tritonserver on the tiny checkpoint (CPU).

loadgen: a two-level sweep with plain and voice-clone requests, checked for complete, sane numbers.
make_pa_inputs + run_perf_analyzer.sh: brief real perf_analyzer runs against fast_ar and dac_decoder.
"""

import contextlib
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

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
    assert got["c=64 throughput >= 300 audio-s/s"] == ("151.5 audio-s/s over 384/384 requests", "NOT met")
    assert got["c=64 TTFA p99 <= 1 s"][1] == "NOT met"
    assert got["no underrun at every level up to c=64"] == ("c=1: 0 of 8, c=16: 0 of 8, c=64: 1 of 384", "NOT met")
    assert got["c=64 peak GPU memory <= 30 GB (all models)"] == ("29,000 MiB = 30.4 GB (the run's peak)", "NOT met")
    assert got["c=1 TTFA p50 <= 45 ms"] == ("40.0 ms", "met") and got["c=1 RTF <= 0.15"][1] == "met"
    assert got["voice clone c=1, voice seen: TTFA p50 <= 50 ms"] == ("55.0 ms", "NOT met")
    assert got["voice clone c=1, first use of a 10 s reference: TTFA p50 <= 150 ms"] == ("111.0 ms", "met")
    assert got["server ready <= 60 s"] == ("37.1 s", "met")
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
    assert kinds == {"plain", "clone_codes", "clone_audio"}, kinds

    # the targets table from this run's own file: c=1 measured (a tiny model on a CPU meets none of the speed
    # targets), the levels and phases it did not run say so
    t = _run([sys.executable, "perf/targets.py", str(tmp_path)], timeout=60).stdout
    got = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[1:] for line in t.splitlines()[2:]}
    lv1 = r["levels"][0]
    assert got["c=1 TTFA p50 <= 45 ms"] == [f"{lv1['ttfa_ms_p50']} ms", "met" if lv1["ttfa_ms_p50"] <= 45 else "NOT met"]
    assert got["c=64 throughput >= 300 audio-s/s"] == ["-", "not run"]
    assert got["server ready <= 60 s"][1] == "not run" and got["no underrun at every level up to c=64"][1] == "not run"


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


def test_paged_mixed_script_on_the_cpu(tiny_ckpt, tmp_path):
    """perf/paged_mixed.py end to end on the tiny model: both layouts timed, the mixed load with long prompts run
    with and without split keys, and the JSON it writes."""
    out = tmp_path / "paged.json"
    _run([sys.executable, "perf/paged_mixed.py", "--checkpoint", str(tiny_ckpt), "--device", "cpu", "--short", "4",
          "--long", "2", "--long-tokens", "300", "--frames", "30", "--window", "5", "--max-seq", "512",
          "--json", str(out)], timeout=600)
    r = json.loads(out.read_text())
    for key in ("slot_step_ms", "paged_step_ms", "paged_splits16_step_ms", "mixed_splits1_step_ms"):
        assert r[key] > 0, key
    assert r["mixed_streams"] == 6 and r["mixed_splits1_steps_timed"] == 5 and r["mixed_splits1_preemptions"] == 0
    assert r["mixed_kv_pool_tokens"] >= 4 * 30 + 2 * 330


def test_admission_profile_script_on_the_cpu(tiny_ckpt, tmp_path):
    """perf/admission_profile.py end to end on the tiny model: the decode phase has no prompt rows, the arrivals
    phase one prompt ending a step (each step one request cancelled and one submitted) with its prompt's rows, every
    slot held in both."""
    out = tmp_path / "adm.json"
    _run([sys.executable, "perf/admission_profile.py", "--checkpoint", str(tiny_ckpt), "--device", "cpu",
          "--streams", "3", "--steps", "5", "--warm-steps", "3", "--json", str(out)], timeout=600)
    decode, arrivals = json.loads(out.read_text())
    assert decode["phase"] == "decode" and arrivals["phase"] == "arrivals"
    assert decode["prompt_rows_per_step"] == decode["prompts_ending_per_step"] == 0 and decode["slots_held"] == 3
    assert arrivals["prompts_ending_per_step"] == 1.0 and arrivals["prompt_rows_per_step"] > 10
    assert 0 < decode["wall_ms_p50"] and 0 < arrivals["wall_ms_p50"]


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


def test_stream_check_script_on_the_cpu(tiny_ckpt):
    """perf/stream_check.py end to end on the tiny model (on a CPU the codec's calls go to its own thread, with no
    streams of their own; the script checks both): every request served both ways, its codes alike and its audio
    within the tolerance, each request as long as it asked."""
    p = _run([sys.executable, "perf/stream_check.py", "--checkpoint", str(tiny_ckpt), "--device", "cpu",
              "--requests", "3", "--frames", "10"], timeout=600)
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [r["frames"] for r in rows] == [10, 17, 24]
    assert all(r["codes_equal"] and r["ok"] and r["audio_max_abs_diff"] <= 2e-3 and r["audio_rms"] > 0 for r in rows)
    assert "3 of 3 requests alike" in p.stdout


def test_attention_bench_on_the_cpu(tiny_ckpt, tmp_path):
    """perf/bench_attention.py in the Triton interpreter on the tiny model's heads: every tiling at every shape, the
    keys split as the engine's rule says (up to FEW_ROWS rows: FEW_ROWS_SPLITS ways; more rows: none), each tiling's
    output that of the first."""
    from s2tts.engine.runner import ModelRunner

    out = tmp_path / "attention.json"
    many = ModelRunner.FEW_ROWS + 1
    _run([sys.executable, "perf/bench_attention.py", "--checkpoint", str(tiny_ckpt), "--device", "cpu", "--rows",
          f"1,{many}", "--keys", "40", "--block", "8", "--config", "base=", "--config",
          "kvt=kv_together=1,num_stages=1", "--config", "bn16=block_n=16", "--json", str(out)], timeout=600,
         env=dict(os.environ, TRITON_INTERPRET="1"))
    r = json.loads(out.read_text())
    assert [(x["config"], x["rows"]) for x in r] == [(c, b) for b in (1, many) for c in ("base", "kvt", "bn16")]
    assert {x["splits"] for x in r if x["rows"] == 1} == {ModelRunner.FEW_ROWS_SPLITS}
    assert {x["splits"] for x in r if x["rows"] == many} == {1}
    assert all(x["max_rel_diff"] < 1e-5 and x["us"] > 0 for x in r), r
    # the fast AR's heads and cache, in the engine's tiling for them (short tiles) beside the default
    _run([sys.executable, "perf/bench_attention.py", "--checkpoint", str(tiny_ckpt), "--device", "cpu", "--ar", "fast",
          "--rows", f"1,{many}", "--keys", "3", "--config", "base=", "--config", "engine=engine", "--json", str(out)],
         timeout=600, env=dict(os.environ, TRITON_INTERPRET="1"))
    r = json.loads(out.read_text())
    assert [(x["config"], x["rows"], x["splits"]) for x in r] == [(c, b, 1) for b in (1, many)
                                                                  for c in ("base", "engine")]
    assert all(x["max_rel_diff"] < 1e-5 for x in r), r


def test_served_gap_script_on_the_cpu(tiny_ckpt, tmp_path):
    """perf/served_gap.sh end to end on the CPU without its served runs (run_gpu.sh is test_scale_gpus's): the
    serving loop with the codec alone (perf/bench_loop.py), streams out of step, two codec-batching settings, held
    admissions, a replacement 30 ms late and Python beside the loop (each knob's values with the first of the
    others): a table row per run; every run delivered audio from finished requests, with no error, its steady state
    in range."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SERVED": "0", "DEVICE": "cpu", "CKPT": str(tiny_ckpt),
           "PYTHON": sys.executable,
           "LOOP_ARGS": "--streams 3 --frames 12 --frames-jitter 3 --stagger-ms 20 --seconds 1.5 --warm-s 0.4 "
                        "--batch-steps 1,4 --admit-every 1,2 --resubmit-ms 0,30 --resubmit-jitter-ms 10 --gil-load 50:1 "
                        "--launch-ahead 1"}
    _run(["bash", "perf/served_gap.sh"], timeout=600, env=env)
    table = (tmp_path / "out" / "gap.md").read_text().splitlines()
    assert table[0].startswith("| run | audio-s/s | pass ms") and len(table) == 2 + 6, table
    # every row's nine cells, the steps' launch + wait among them (prompt steps / the others, share behind a call)
    assert all(row.count(" | ") == 8 for row in table[2:]), table
    split = re.compile(r"[\d.]+ \+ [\d.]+ / -?[\d.]+ \+ -?[\d.]+ \(\d+%\)")
    assert all(split.fullmatch(row.split(" | ")[6]) for row in table[2:]), table
    # (every replacement's delay within --resubmit-ms +- 10 ms)
    assert [row.split(" | ")[0] for row in table[2:5]] == ["| loop, resubmit 0 +- 10 ms"] * 3
    assert [row.split(" | ")[0] for row in table[5:]] == ["| loop, resubmit 30 +- 10 ms",
                                                         "| loop, resubmit 0 +- 10 ms, Python beside 50:1",
                                                         "| loop, resubmit 0 +- 10 ms, launch ahead"]
    rows = json.loads((tmp_path / "out" / "loop.json").read_text())
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


@contextlib.contextmanager
def _logged():
    """The s2tts logger's messages (INFO and up) while the block runs, as a list."""
    import logging

    lines = []
    keep = logging.Handler()
    keep.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("s2tts")
    level = log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(keep)
        log.setLevel(level)


def test_gap_table_reads_slow_ars_loop_line(tmp_path):
    """perf/gap_table.py reads a served run's steady state from the loop lines slow_ar writes (made here by its own
    LoopStats, as run_gpu.sh copies them into summary.md): of two 10 s windows, the one with more frames a step."""
    sys.path.insert(0, str(ROOT / "perf"))
    from gap_table import table

    from s2tts.engine.stats import LoopStats

    with _logged() as lines:
        for frames, step_s in ((30, 0.012), (58, 0.011)):  # a ramp's window, then the steady state
            stats = LoopStats(every_s=0.0, codec_calls=1, codec_streams=50, tails=[0.07, 0.08, 0.09])
            stats.add(step_s, 0.004, "slow_ar", frames, True, frames + 1, 2, True, off_cpu_s=frames / 1e5,
                      launch_s=0.002, wait_s=step_s - 0.003, early=True)
    # a step ending a prompt: its engine call's launch and wait, and that it ran behind a codec call
    assert "(11.0 ms, the others 0.0; launching 2.0 and waiting 8.0 ms of it, the others 0.0 and 0.0; 100% of them " \
           "launched behind a codec call)" in lines[-1], lines[-1]
    run = tmp_path / "served"
    run.mkdir()
    (run / "summary.md").write_text("## slow_ar's loop, from its log\n\n" + "".join(f"- {m}\n" for m in lines))
    (run / "loadgen.json").write_text(json.dumps({"levels": [{"audio_s_per_s": 171.5}]}))
    rows = table(tmp_path, ["served", "pinned"]).splitlines()
    assert rows[2] == ("| served | 171.5 | 15.00 (11.0 + 4.0) | 58.0 | 59.0 | 100% (11.0 / 0.0) | "
                       "2.0 + 8.0 / 0.0 + 0.0 (100%) | 80.0 | 0.58 |"), rows
    assert rows[3] == "| pinned | - | (no loop line over 10 s) | | | | | | |"


def test_send_probe_on_the_cpu(tmp_path):
    """perf/send_probe.py against the real tritonserver: every mode's responses arrive with what was sent (the script
    checks each one's content), each mode reports its sends, the switch interval the model ran with (the default, and
    the one asked for), and the busy thread's pace where there is one."""
    out = tmp_path / "probe.json"
    p = _run([sys.executable, "perf/send_probe.py", "--sends", "20", "--samples", "2048", "--interval-ms", "0.25",
              "--json", str(out)], timeout=180)
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["alone", "busy thread beside", "busy thread, short switch interval"]
    assert all(r["sends"] == 20 and r["samples"] == 2048 and r["send_ms"] > 0 for r in rows), rows
    assert rows[0]["interval_ms"] == rows[1]["interval_ms"] == 5.0 and rows[2]["interval_ms"] == 0.25, rows
    assert rows[0]["busy_pace"] is None and all(r["busy_pace"] > 0 for r in rows[1:]), rows
    assert sum(line.startswith("| ") for line in p.stdout.splitlines()) == 4  # the table: its header and three modes


def _loop_lines(frames_per_window) -> list[str]:
    """slow_ar's 10-s loop lines as its LoopStats writes them, one window for each frames-a-step figure."""
    from s2tts.engine.stats import LoopStats

    with _logged() as lines:
        for frames in frames_per_window:
            stats = LoopStats(every_s=0.0, codec_calls=1, codec_streams=50, tails=[0.07])
            stats.add(0.0075, 0.0025, "slow_ar", frames, True, frames + 1, 0, False, off_cpu_s=0.004)
    return [m for m in lines if "frames each" in m]


def _issue26_tree(tree: Path, *, c1, c64, first_use_ms, ready_s, windows, step_1, step_64, fp8_step_1, codec_ms,
                  two_gpu, fp8_served_rtf=None):
    """One tree's folder as perf/issue26_gpu.sh's parts leave it (the files' forms are the tools' own)."""
    def level(c, **kw):
        return {"concurrency": c, "requests": 24, "ok": 24, "errors": 0, "stall_fraction": 0.0,
                "gpu_mem_peak_mib": 20000.0, **kw}

    serve = tree / "serve"
    serve.mkdir(parents=True)
    (serve / "loadgen.json").write_text(json.dumps({"levels": [level(1, **c1), level(64, requests=1280, ok=1280, **c64)]}))
    (serve / "loadgen_clone_first.json").write_text(json.dumps({"levels": [level(1, ttfa_ms_p50=first_use_ms)]}))
    (serve / "run.log").write_text(f"[12:00:01] tritonserver ready in {ready_s} s: gRPC 127.0.0.1:8001\n")
    (serve / "summary.md").write_text("## slow_ar's loop, from its log\n\n" +
                                      "".join(f"- {m}\n" for m in _loop_lines(windows)))
    fps = 44100 / 2048
    (tree / "engine.json").write_text(json.dumps(
        [{"variant": "default", "weights": "dtype", "batch": 1, "graphs": True, "full_step_ms": step_1,
          "stream_rtf": round(step_1 * fps / 1e3, 4)},
         {"variant": "default", "weights": "dtype", "batch": 64, "graphs": True, "full_step_ms": step_64},
         {"variant": "default", "weights": "fp8", "batch": 1, "graphs": True, "full_step_ms": fp8_step_1,
          "stream_rtf": round(fp8_step_1 * fps / 1e3, 4)}]))
    (tree / "codec.json").write_text(json.dumps([{"path": "served", "warm_s": 9.0, "graphs": 21},
                                                 {"path": "served", "batch": 64, "chunk_frames": 8, "wall_ms": codec_ms}]))
    if two_gpu is not None:
        (tree / "scale").mkdir()
        (tree / "scale" / "scale.json").write_text(json.dumps([{"engines": 2, "concurrency": 128,
                                                                "audio_s_per_s": two_gpu}]))
    if fp8_served_rtf is not None:
        (tree / "serve_fp8").mkdir()
        (tree / "serve_fp8" / "loadgen.json").write_text(json.dumps({"levels": [level(1, rtf_mean=fp8_served_rtf)]}))


def _issue26_rows(md: str) -> dict[str, list[str]]:
    """perf/issue26.py's table -> {target: [the base's cell, this code's, "status |"]} (its body rows only)."""
    return {r.split(" | ")[0][2:]: r.split(" | ")[1:] for r in md.splitlines()[2:] if r.startswith("| ")}


def test_issue26_table_reads_both_trees(tmp_path):
    """perf/issue26.py: each of issue 26's targets from the files perf/issue26_gpu.sh's parts leave, the starting
    code beside this one, each row's status by this code's number; a part not run reads "-" / "not run"."""
    sys.path.insert(0, str(ROOT / "perf"))
    from issue26 import main, markdown

    _issue26_tree(tmp_path / "base", c1={"ttfa_ms_p50": 44.7, "rtf_mean": 0.19, "ttfa_ms_p99": 50.0},
                  c64={"audio_s_per_s": 148.6, "ttfa_ms_p50": 372.0, "ttfa_ms_p99": 498.0, "stall_fraction": 0.0,
                       "gpu_mem_peak_mib": 43400.0},
                  first_use_ms=156.0, ready_s=68.6, windows=[20, 29.7], step_1=8.3, step_64=11.0, fp8_step_1=7.9,
                  codec_ms=35.0, two_gpu=None)
    _issue26_tree(tmp_path / "final", c1={"ttfa_ms_p50": 21.7, "rtf_mean": 0.1195, "ttfa_ms_p99": 25.0},
                  c64={"audio_s_per_s": 279.9, "ttfa_ms_p50": 200.1, "ttfa_ms_p99": 311.2, "stall_fraction": 1 / 1280,
                       "gpu_mem_peak_mib": 27000.0},
                  first_use_ms=115.0, ready_s=41.0, windows=[48, 61.4, 55], step_1=5.31, step_64=7.53,
                  fp8_step_1=4.75, codec_ms=16.7, two_gpu=550.4)
    rows = _issue26_rows(markdown(tmp_path / "final", tmp_path / "base", "79c0cdb"))
    assert rows["c=1 decode step <= 5.5 ms at one row"] == ["8.30 ms", "5.31 ms", "met |"]
    assert rows["c=1 RTF <= 0.12 (served, mean)"] == ["0.1900", "0.1195", "met |"]
    assert rows["c=1 TTFA p50 <= 30 ms"] == ["44.7 ms", "21.7 ms", "met |"]
    assert rows["c=64 >= 300 audio-s/s (100-frame requests)"] == ["148.6 (1280/1280 requests)",
                                                                  "279.9 (1280/1280 requests)", "NOT met |"]
    assert rows["c=64 frames a step >= 58 (slow_ar's busiest 10 s)"] == ["29.7", "61.4", "met |"]
    assert rows["c=64 TTFA p99 <= 400 ms"] == ["498.0 ms", "311.2 ms", "met |"]
    assert rows["no underrun at any level"] == ["0 of 1304 ran dry", "1 of 1304 ran dry", "NOT met |"]
    assert rows["step at 64 rows <= 7.5 ms"] == ["11.00 ms", "7.53 ms", "NOT met |"]
    assert rows["codec's share of a 64-frame step <= 2.4 ms (64 x 8 frames a call / 8)"] == ["4.38 ms", "2.09 ms",
                                                                                             "met |"]
    assert rows["`ar_weights=fp8`: c=1 RTF <= 0.08 (the engine's step alone)"] == [
        "0.1701 (step 7.90 ms)", "0.1023 (step 4.75 ms)", "NOT met |"]
    assert rows["two GPUs of one host >= 500 audio-s/s at c=128"] == ["-", "550.4 at c=128", "met |"]
    assert rows["c=64 peak GPU memory <= 30 GB (all models, default KV pool)"] == ["45.5 GB", "28.3 GB", "met |"]
    assert rows["ready <= 45 s"] == ["68.6 s", "41.0 s", "met |"]
    assert rows["voice clone first use <= 120 ms at c=1 (10 s reference)"] == ["156.0 ms", "115.0 ms", "met |"]
    # a served fp8 run, where there is one, is the row's measure; parts not run read "-" and "not run"
    _issue26_tree(tmp_path / "only", c1={"ttfa_ms_p50": 21.0, "rtf_mean": 0.12}, c64={"audio_s_per_s": 300.5},
                  first_use_ms=119.0, ready_s=45.0, windows=[], step_1=5.0, step_64=7.5, fp8_step_1=3.6,
                  codec_ms=19.2, two_gpu=None, fp8_served_rtf=0.079)
    (tmp_path / "only" / "engine.json").unlink()
    rows = _issue26_rows(markdown(tmp_path / "only", None))
    assert rows["`ar_weights=fp8`: c=1 RTF <= 0.08"] == ["-", "0.0790", "met |"]
    assert rows["step at 64 rows <= 7.5 ms"] == ["-", "-", "not run |"]
    assert rows["c=64 frames a step >= 58 (slow_ar's busiest 10 s)"] == ["-", "-", "not run |"]
    assert rows["c=64 >= 300 audio-s/s (100-frame requests)"][2] == "met |"
    assert rows["ready <= 45 s"] == ["-", "45.0 s", "met |"]
    assert main([str(tmp_path / "nothing")]) == 2  # no final/ there: a message, not a table


def test_issue26_gpu_script_on_the_cpu(tiny_ckpt, tmp_path):
    """perf/issue26_gpu.sh's serve part on the CPU (this tree only, c=1, one request, run_gpu.sh's DEVICE=cpu): the
    folder it leaves is what perf/issue26.py reads, whose rows carry the run's own numbers."""
    from servers import free_port

    sys.path.insert(0, str(ROOT / "perf"))
    from issue26 import markdown

    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "TREES": "final", "LEVELS": "1", "REQUESTS": "1:1", "FRAMES": "4",
           "DEVICE": "cpu", "CKPT": str(tiny_ckpt), "CKPT_SIZE": "tiny", "PYTHON": sys.executable, "USE_CARRIED": "0",
           "MAX_BATCH": "2", "MAX_SEQ_LEN": "1024", "WORK": str(tmp_path / "work"), "GRPC_PORT": str(free_port()),
           "HTTP_PORT": str(free_port()), "METRICS_PORT": str(free_port())}
    p = _run(["bash", "perf/issue26_gpu.sh", "serve"], timeout=600, env=env)
    assert "== final serve rc=0" in p.stdout, p.stdout + (out / "final" / "serve.log").read_text()[-3000:]
    serve = out / "final" / "serve"
    c1 = json.loads((serve / "loadgen.json").read_text())["levels"][0]
    first = json.loads((serve / "loadgen_clone_first.json").read_text())["levels"][0]
    assert c1["concurrency"] == 1 and c1["ok"] == 1 and first["ok"] == 1, (c1, first)
    ready = float(re.findall(r"tritonserver ready in ([\d.]+) s", (serve / "run.log").read_text())[-1])
    rows = {target: cells[1] for target, cells in _issue26_rows(markdown(out / "final", None)).items()}
    assert rows["c=1 TTFA p50 <= 30 ms"] == f"{c1['ttfa_ms_p50']:.1f} ms"
    assert rows["c=1 RTF <= 0.12 (served, mean)"] == f"{c1['rtf_mean']:.4f}"
    assert rows["voice clone first use <= 120 ms at c=1 (10 s reference)"] == f"{first['ttfa_ms_p50']:.1f} ms"
    assert rows["ready <= 45 s"] == f"{ready:.1f} s"
    assert rows["c=64 >= 300 audio-s/s (100-frame requests)"] == "-"  # no level 64 in this run
    head = subprocess.run(["git", "log", "-1", "--format=commit %h %s"], cwd=ROOT, capture_output=True, text=True)
    assert f"\nthis code: {head.stdout.strip()}" in markdown(out / "final", None)  # what ran, under the table
    bad = subprocess.run(["bash", "perf/issue26_gpu.sh", "nothing"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "usage: bash perf/issue26_gpu.sh serve|kernels|fp8|scale" in bad.stderr
    if not (ROOT / "baseline" / "perf").is_dir():  # (a developer's checkout may hold one)
        none = subprocess.run(["bash", "perf/issue26_gpu.sh", "serve"], cwd=ROOT, capture_output=True, text=True,
                              env={**env, "TREES": "final base"})
        assert none.returncode == 2 and "no baseline/" in none.stderr, none.stderr
