#!/usr/bin/env python3
"""perf/served_gap.sh's table: each run's throughput and steady state, served runs beside the loop alone.

    python perf/gap_table.py RESULTS_DIR [served pinned ...]   -> RESULTS_DIR/gap.md (and printed)

A served run (a run_gpu.sh result folder under RESULTS_DIR) gives its level's audio-s/s (loadgen.json) and its steady
state from slow_ar's loop lines in its summary.md: of the 10 s lines, the one that made the most frames a step. The
loop alone gives a row per perf/bench_loop.py run (RESULTS_DIR/loop.json).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# slow_ar's loop line (s2tts.engine.stats.LoopStats), the parts this table reads
LINE = re.compile(r"(\d+) steps of ([\d.]+) ms making ([\d.]+) frames each, then ([\d.]+) ms a step .*? slots held "
                  r"([\d.]+), requests waiting ([\d.]+) a step; (\d+)% of the steps with prompt rows ending \(([\d.]+) "
                  r"ms, the others ([\d.]+)(?:; launching ([\d.]+) and waiting ([\d.]+) ms of it, the others "
                  r"([\d.]+) and ([\d.]+); (\d+)% of them launched behind a codec call)?\); last frame to final response "
                  r"(?:([\d.]+) ms p50|-)"
                  r"(?: \(\d+ requests\); the engine thread off its CPU ([\d.]+) ms a step)?")
HEAD = ("| run | audio-s/s | pass ms (step + codec and routing) | frames a step | slots held | steps ending a prompt "
        "(their step ms / the others') | their launch + wait ms / the others' (behind a codec call) | "
        "last frame -> final p50 ms | engine thread off its CPU, ms a step |\n"
        "|---|---|---|---|---|---|---|---|---|")


def served_row(res: Path, run: str) -> str:
    lg = res / run / "loadgen.json"
    level = json.loads(lg.read_text())["levels"][0] if lg.is_file() else {}
    summary = res / run / "summary.md"
    lines = [m.groups() for m in LINE.finditer(summary.read_text(errors="replace"))] if summary.is_file() else []
    if not lines:
        return f"| {run} | {level.get('audio_s_per_s', '-')} | (no loop line over 10 s) | | | | | | |"
    steady = max(lines, key=lambda g: float(g[2]))  # the window with the most frames a step
    _, step, frames, rest, held, _, pct, pms, oms, pl, pw, ol, ow, behind, tail, off = steady
    split = f"{pl} + {pw} / {ol} + {ow} ({behind}%)" if pl is not None else "-"
    return (f"| {run} | {level.get('audio_s_per_s', '-')} | {float(step) + float(rest):.2f} ({step} + {rest}) | "
            f"{frames} | {held} | {pct}% ({pms} / {oms}) | {split} | {tail or '-'} | {off or '-'} |")


def loop_row(r: dict) -> str:
    rs, jitter = r.get("resubmit_ms") or 0, r.get("resubmit_jitter_ms") or 0
    what = "loop" + (f", resubmit {rs:g}" + (f" +- {jitter:g}" if jitter else "") + " ms" if rs or jitter else "") + \
        (f", Python beside {r['gil_load']}" if r.get("gil_load") else "") + (", launch ahead" if r.get("launch_ahead") else "") + \
        (f", final steps {r['final_steps']}" if r.get("final_steps") else "")  # named unless 0, the default
    p = r["prompt_steps"]

    def others(mean: float, prompt_mean: float) -> float:  # the steps not ending a prompt, from the mean of all
        return (mean - p * prompt_mean) / (1 - p) if p < 1 else 0.0

    tail = r["tail_ms_p50"] if r["tail_ms_p50"] is not None else "-"
    split = "-"
    if "launch_ms" in r:  # (loop.json of runs before the split was timed lack it)
        ol, ow = others(r["launch_ms"], r["prompt_launch_ms"]), others(r["wait_ms"], r["prompt_wait_ms"])
        split = (f"{r['prompt_launch_ms']} + {r['prompt_wait_ms']} / {ol:.2f} + {ow:.2f} "
                 f"({100 * r['prompt_behind_codec']:.0f}%)")
    other_step = others(r["step_ms"], r["prompt_step_ms"])
    return (f"| {what} | {r['audio_s_per_s']} | {r['step_ms'] + r['rest_ms']:.2f} ({r['step_ms']} + {r['rest_ms']}) | "
            f"{r['frames_per_step']} | {r['slots_held']} | {100 * p:.0f}% ({r['prompt_step_ms']} / {other_step:.2f}) | "
            f"{split} | {tail} | {r.get('off_cpu_ms', '-')} |")


def table(res: Path, runs: list[str]) -> str:
    loop = json.loads((res / "loop.json").read_text()) if (res / "loop.json").is_file() else []
    return "\n".join([HEAD] + [served_row(res, run) for run in runs] + [loop_row(r) for r in loop])


def main() -> int:
    res = Path(sys.argv[1])
    out = table(res, sys.argv[2:])
    (res / "gap.md").write_text(out + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
