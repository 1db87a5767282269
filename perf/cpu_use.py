#!/usr/bin/env python3
"""Where a serving host's CPUs go while a load runs: CPU time of tritonserver, of each model's Python stub, of the
load generator and of everything else, and how busy the machine's CPUs were, from /proc (Linux).

    python perf/cpu_use.py --json cpu.json --markdown cpu.md &   # until SIGTERM / SIGINT, or --seconds
    ... the load ...
    kill -INT %1; wait

A process's share is its user + system CPU time over the window, in cores (1.0 = one CPU busy all the time); the
stub of a model is named by its model.py's folder (slow_ar, s2pro, ...), the load generator by its script (the worker
processes it spawns, `--procs`, counted with it: `processes` says how many); processes
that started or ended inside the window count the part they ran. `busy` is the share of all CPUs not idle over the
window (/proc/stat), `cpus` their number. The heaviest threads of each server process are listed too (their kernel
names: Python threads share the process's name unless they set one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from collections import defaultdict

TICK = os.sysconf("SC_CLK_TCK")


def _cputime(path: str) -> float | None:
    """user + system seconds of /proc/<pid>[/task/<tid>]/stat."""
    try:
        fields = open(f"{path}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15 of stat)


def role(pid: str) -> str | None:
    """tritonserver, a model's stub (its model name), a perf script (its name), or None (not of the load)."""
    try:
        cmd = [c.decode(errors="replace") for c in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0") if c]
    except OSError:
        return None
    if not cmd:
        return None
    exe = os.path.basename(cmd[0])
    if exe == "tritonserver":
        return "tritonserver"
    if exe == "triton_python_backend_stub":
        m = re.search(r"/([A-Za-z_0-9]+)/\d+/model\.py", " ".join(cmd))
        return m.group(1) if m else "stub"
    for c in cmd[1:3]:
        if c.endswith(".py") and "/perf/" in f"/{c}":
            return os.path.basename(c)[:-3]
    if "--multiprocessing-fork" in cmd:  # a spawned worker (loadgen's --procs): its parent's role
        try:
            ppid = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            return None
        return role(ppid) if ppid != pid else None
    return None


def machine() -> tuple[float, float]:
    """(busy, total) CPU seconds of all CPUs so far."""
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return (sum(v) - idle) / TICK, sum(v) / TICK


class Sampler:
    def __init__(self, interval: float):
        self.interval = interval
        self.first: dict[str, tuple[str, float]] = {}  # pid -> (role, cpu seconds when first seen)
        self.last: dict[str, float] = {}
        self.threads_first: dict[tuple[str, str], float] = {}
        self.threads_last: dict[tuple[str, str], tuple[str, float]] = {}
        self.t0 = time.monotonic()
        self.m0 = machine()
        self.stop = threading.Event()

    def sample(self) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == str(os.getpid()):
                continue
            if pid not in self.first:
                r = role(pid)
                if r is None:
                    self.first[pid] = ("", 0.0)
                    continue
                t = _cputime(f"/proc/{pid}")
                if t is None:
                    continue
                self.first[pid] = (r, t)
            r = self.first[pid][0]
            if not r:
                continue
            t = _cputime(f"/proc/{pid}")
            if t is not None:
                self.last[pid] = t
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                tt = _cputime(f"/proc/{pid}/task/{tid}")
                if tt is None:
                    continue
                key = (pid, tid)
                self.threads_first.setdefault(key, tt)
                try:
                    name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
                except OSError:
                    name = "?"
                self.threads_last[key] = (name, tt)

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.interval)

    def report(self) -> dict:
        self.sample()
        wall = time.monotonic() - self.t0
        b1, t1 = machine()
        cpus = os.cpu_count() or 1
        by_role: dict[str, float] = defaultdict(float)
        procs: dict[str, int] = defaultdict(int)
        for pid, (r, t) in self.first.items():
            if r and pid in self.last:
                by_role[r] += self.last[pid] - t
                procs[r] += 1
        threads: dict[str, list] = defaultdict(list)
        for (pid, tid), (name, t) in self.threads_last.items():
            r = self.first.get(pid, ("", 0))[0]
            if r and not r.endswith(("loadgen", "live_load", "cpu_use")):
                threads[r].append((t - self.threads_first[(pid, tid)], f"{name}/{tid}"))
        return {"seconds": round(wall, 2), "cpus": cpus,
                "busy": round((b1 - self.m0[0]) / max(1e-9, t1 - self.m0[1]), 4),
                "cores": {r: round(s / max(wall, 1e-9), 3) for r, s in sorted(by_role.items(), key=lambda kv: -kv[1])},
                "processes": dict(procs),
                "top_threads": {r: [[n, round(s / max(wall, 1e-9), 3)] for s, n in sorted(v, reverse=True)[:5]]
                                for r, v in threads.items()}}


def markdown(rep: dict) -> str:
    lines = [f"CPU use over {rep['seconds']} s: the machine's {rep['cpus']} CPUs {100 * rep['busy']:.0f}% busy "
             f"({rep['busy'] * rep['cpus']:.1f} cores)", "", "| process | cores | its busiest threads (cores) |",
             "|---|---|---|"]
    for r, c in rep["cores"].items():
        top = ", ".join(f"{n} {s:.2f}" for n, s in rep["top_threads"].get(r, []))
        n = rep.get("processes", {}).get(r, 1)
        lines.append(f"| {r}{f' ({n} processes)' if n > 1 else ''} | {c:.2f} | {top} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long (default: at SIGINT/SIGTERM)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples of the process list")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args(argv)
    if not os.path.exists("/proc/stat"):
        print("cpu_use: no /proc/stat (Linux only)", file=sys.stderr)
        return 2
    s = Sampler(a.interval)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: s.stop.set())
    t = threading.Thread(target=s.run, daemon=True)
    t.start()
    s.stop.wait(a.seconds)
    s.stop.set()
    t.join()
    rep = s.report()
    md = markdown(rep)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
