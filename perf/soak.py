"""A bounded soak: many streams for N minutes with random cancels and disconnects; then every request must have
ended, every KV slot and codec state must be back, and memory must be flat.

    python perf/soak.py --url 127.0.0.1:8001 --metrics http://127.0.0.1:8002/metrics --minutes 10 --concurrency 64

Each of `--concurrency` workers loops: a request of random length (`--frames MIN,MAX`, ignore_eos), which it
either reads to the end, cancels after a random number of chunks (`--cancel`), or abandons by dropping its gRPC
connection without a word (`--disconnect`). Every request must end within `--request-timeout` s: with its final
response, a classified error (`TTSError.code`), or the client's own cancel; a request that does not is counted
as hung. Every `--sample` s the script reads the server's `s2tts_*` metrics (requests in flight, KV slots used,
requests waiting, codec streams open), the resident memory of tritonserver and its model processes, and GPU
memory (nvidia-smi, if present). After the load it waits for the server to go quiet and checks that all those
counts are zero. Exit code 0 only if no request hung, nothing leaked and no model became unhealthy.

Writes `--out` (JSON: config, per-outcome counts, error codes, samples, the final check) and prints a summary.
Not part of the CI run (it takes minutes); `tests/test_soak.py` runs it for a few seconds on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2tts.client import S2ProClient, TTSError, TTSInput, read_metrics  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Streaming speech should never stop mid-sentence.",
         "A short one.", "Numbers like 1, 2 and 3 are read out loud, one after another, with care.",
         "Every request ends exactly once, whatever happens to it on the way."]
GAUGES = ("s2tts_requests_in_flight", "s2tts_engine_slots_used", "s2tts_engine_requests_waiting",
          "s2tts_engine_streams_open", "s2tts_codec_streams_open", "s2tts_model_healthy")


def gauges(m: dict[str, float]) -> dict[str, float]:
    """name/model -> value for the gauges that must return to zero (and health)."""
    out = {}
    for k, v in m.items():
        name, _, labels = k.partition("{")
        if name in GAUGES:
            model = re.search(r'model="([^"]+)"', labels)
            out[f"{name}/{model.group(1) if model else '?'}"] = v
    return out


def server_rss_mb() -> dict[str, float]:
    """Resident memory (MB) of tritonserver and each python backend stub on this machine, by model."""
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        exe = os.path.basename(cmd[0].decode(errors="replace")) if cmd and cmd[0] else ""
        if exe == "tritonserver":
            key = "tritonserver"
        elif exe == "triton_python_backend_stub":
            m = re.search(r"/([a-z_0-9]+)/1/model\.py", b" ".join(cmd).decode(errors="replace"))
            key = m.group(1) if m else "stub"
        else:
            continue
        rss = re.search(r"VmRSS:\s+(\d+) kB", status)
        if rss:
            out[key] = out.get(key, 0.0) + int(rss.group(1)) / 1024
    return out


def gpu_mem_mb() -> float | None:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        return float(sum(int(x) for x in p.stdout.split())) if p.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


class Soak:
    def __init__(self, args):
        self.a = args
        self.outcomes: Counter = Counter()
        self.codes: Counter = Counter()
        self.hung: list[str] = []
        self.frames = 0
        self.audio_s = 0.0
        self.samples: list[dict] = []
        self.lock = threading.Lock()
        self.stop_at = time.monotonic() + args.minutes * 60
        self.n = 0

    def one(self, rng: random.Random, wid: int) -> None:
        a = self.a
        lo, hi = a.frames
        frames = rng.randint(lo, hi)
        what = rng.random()
        mode = "cancel" if what < a.cancel else "disconnect" if what < a.cancel + a.disconnect else "full"
        cut = rng.randint(0, 3) if mode != "full" else None
        with self.lock:
            self.n += 1
            rid = f"soak-{wid}-{self.n}"
        req = TTSInput(text=rng.choice(TEXTS), seed=rng.randrange(2**31), max_new_tokens=frames, ignore_eos=True,
                       first_chunk_frames=a.first_chunk_frames, chunk_frames=a.chunk_frames)
        t0 = time.monotonic()
        outcome = "?"
        try:
            c = S2ProClient(a.url)
            try:
                n = 0
                if mode == "full":
                    for ev in c.stream(req, timeout=a.request_timeout, request_id=rid):
                        if hasattr(ev, "stats"):
                            with self.lock:
                                self.frames += ev.stats.get("frames", 0)
                                self.audio_s += ev.stats.get("audio_seconds", 0.0)
                    outcome = "completed"
                elif mode == "cancel":
                    for _ in c.stream(req, timeout=a.request_timeout, cancel_after_chunks=cut, request_id=rid):
                        n += 1
                    outcome = "cancelled"
                else:  # drop the connection after `cut` chunks, without cancelling the stream first
                    it = c.stream(req, timeout=a.request_timeout, request_id=rid)
                    for _ in it:
                        n += 1
                        if n >= max(cut, 1):
                            break
                    # the connection itself: InferenceServerClient.close() would first wait for the stream to end
                    # (stop_stream without cancel), which is no disconnect at all
                    c.client._channel.close()
                    c._open = False
                    outcome = "disconnected"
            finally:
                try:
                    c.close(cancel=True)
                    c.client.close()
                except Exception:  # noqa: BLE001
                    pass
        except TTSError as e:
            outcome = "error"
            with self.lock:
                self.codes[e.code] += 1
                if e.code == "deadline_exceeded" and "no response within" in str(e):
                    self.hung.append(f"{rid}: {e}")
        except Exception as e:  # noqa: BLE001 - a client-side failure is a finding too
            outcome = "client_error"
            with self.lock:
                self.codes[type(e).__name__] += 1
        if time.monotonic() - t0 > a.request_timeout + 30:
            with self.lock:
                self.hung.append(f"{rid}: took {time.monotonic() - t0:.0f} s")
        with self.lock:
            self.outcomes[outcome] += 1

    def worker(self, wid: int) -> None:
        rng = random.Random(self.a.seed * 1000 + wid)
        while time.monotonic() < self.stop_at:
            self.one(rng, wid)

    def sample(self, t0: float) -> dict:
        s = {"t": round(time.monotonic() - t0, 1), "rss_mb": server_rss_mb(), "gpu_mb": gpu_mem_mb()}
        try:
            s["gauges"] = gauges(read_metrics(self.a.metrics))
        except OSError as e:
            s["gauges_error"] = str(e)
        with self.lock:
            s["outcomes"] = dict(self.outcomes)
        return s

    def run(self) -> dict:
        a = self.a
        t0 = time.monotonic()
        before = self.sample(t0)
        threads = [threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(a.concurrency)]
        for t in threads:
            t.start()
        next_sample = time.monotonic() + a.sample
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
            if time.monotonic() >= next_sample:
                s = self.sample(t0)
                self.samples.append(s)
                print(json.dumps({"t": s["t"], "outcomes": s["outcomes"], "gauges": s.get("gauges"),
                                  "gpu_mb": s["gpu_mb"], "rss_mb": {k: round(v) for k, v in s["rss_mb"].items()}}),
                      flush=True)
                next_sample += a.sample
            if time.monotonic() > self.stop_at + a.request_timeout + 60:
                self.hung.append(f"{sum(t.is_alive() for t in threads)} workers still busy after the load ended")
                break
        load_s = time.monotonic() - t0
        # quiescence: everything back to zero
        deadline = time.monotonic() + a.settle
        final = self.sample(t0)
        while time.monotonic() < deadline:
            g = final.get("gauges", {})
            if g and not any(v for k, v in g.items() if not k.startswith("s2tts_model_healthy")):
                break
            time.sleep(1)
            final = self.sample(t0)
        g = final.get("gauges", {})
        leaks = {k: v for k, v in g.items() if v and not k.startswith("s2tts_model_healthy")}
        unhealthy = [k for k, v in g.items() if k.startswith("s2tts_model_healthy") and v != 1]
        mid = self.samples[len(self.samples) // 2] if self.samples else before
        growth = {k: round(final["rss_mb"].get(k, 0) - mid["rss_mb"].get(k, 0), 1) for k in final["rss_mb"]}
        total = sum(self.outcomes.values())
        result = {
            "config": {k: v for k, v in vars(a).items()},
            "load_s": round(load_s, 1), "requests": total, "outcomes": dict(self.outcomes), "error_codes": dict(self.codes),
            "hung": self.hung, "frames_completed": self.frames, "audio_s_completed": round(self.audio_s, 1),
            "before": before, "final": final, "leaks": leaks, "unhealthy": unhealthy,
            "rss_growth_second_half_mb": growth,
            "gpu_mb": {"before": before["gpu_mb"], "mid": mid["gpu_mb"], "final": final["gpu_mb"]},
            "ok": not self.hung and not leaks and not unhealthy and "gauges" in final,
            "samples": self.samples,
        }
        return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address")
    ap.add_argument("--metrics", default="http://127.0.0.1:8002/metrics", help="Triton metrics URL")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--frames", default="20,200", help="MIN,MAX frames per request (ignore_eos)")
    ap.add_argument("--cancel", type=float, default=0.2, help="share of requests cancelled after 0-3 chunks")
    ap.add_argument("--disconnect", type=float, default=0.1, help="share whose connection is dropped after 1-3 chunks")
    ap.add_argument("--first-chunk-frames", type=int, default=4)
    ap.add_argument("--chunk-frames", type=int, default=16)
    ap.add_argument("--request-timeout", type=float, default=120.0, help="the longest wait for a response")
    ap.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds allowed for everything to return to zero")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="soak.json")
    args = ap.parse_args(argv)
    args.frames = tuple(int(x) for x in args.frames.split(","))
    res = Soak(args).run()
    Path(args.out).write_text(json.dumps(res, indent=1))
    o = res["outcomes"]
    print(f"\nsoak: {res['requests']} requests in {res['load_s']} s at c={args.concurrency}: {o}; error codes "
          f"{res['error_codes']}; {res['audio_s_completed']} audio-s completed")
    print(f"hung: {len(res['hung'])}; leaks after settling: {res['leaks'] or 'none'}; unhealthy: {res['unhealthy'] or 'none'}")
    print(f"RSS growth over the second half (MB): {res['rss_growth_second_half_mb']}; GPU MB {res['gpu_mb']}")
    print("OK" if res["ok"] else "FAILED")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
