#!/usr/bin/env python3
"""What a step with prompt rows costs, engine level (no Triton, no codec): served c=64 spends ~20% of its steps
ending a prompt, at 9-10 ms against 5.3-7 for the others (slow_ar's loop line, perf/RESULTS.md), more than the
prompt's rows at the weights' bandwidth should add. Two phases at `--streams` slots, each `--steps` steps timed one
by one (`Engine.step`, waited for) and, with `--profile`, kernels by CUDA time for `--profile-steps` of them:

- decode: every slot decoding, no arrivals;
- arrivals: each step `--arrivals` decoding requests are cancelled and as many new ones submitted (prompts of
  `--text-words` words), so that their prompt rows join the next steps as served arrivals do.

    python3 perf/admission_profile.py --checkpoint /tmp/s2-full --make-full --profile /tmp/adm
    python3 perf/admission_profile.py --checkpoint /tmp/tinyck --device cpu --streams 4 --steps 6   (a smoke run)

Per phase: wall ms a step (p50, mean), the prompt rows and prompts ending a step, and with --profile the CUDA
kernel time a step and the kernels launched a step (from the profiler's table) beside the wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from s2tts.perf_tools import checkpoint_arguments, checkpoint_dir  # noqa: E402


def _kernel_table(fn, steps: int, path: Path) -> dict:
    """Profile `steps` calls of fn (CUDA kernels) -> CUDA time and kernel launches a step; the table to `path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    cuda_us = sum(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0) for e in events)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(events.table(sort_by="device_time_total", row_limit=40))
    return {"cuda_ms_per_step": round(cuda_us / 1e3 / steps, 3),
            "kernels_per_step": round(sum(e.count for e in events) / steps, 1)}


def run(args, model, residual, prompts) -> list[dict]:
    from s2tts.engine import Engine, EngineConfig
    from s2tts.ar.sampling import SamplingParams

    cuda = next(model.parameters()).device.type == "cuda"
    eng = Engine(model, residual, EngineConfig(max_batch=args.streams, max_seq_len=args.max_seq_len,
                                               kv_cache_tokens=args.kv_cache_tokens, prefix_cache_mb=0))
    made, live = [0], []
    seen: list[tuple[int, int]] = []  # each launched plan's (prompt rows, prompts ending)
    launch = eng.runner.launch

    def launch_seen(plan):
        seen.append((sum(c.end - c.start for c in plan.prefill),
                     sum(c.last for c in plan.prefill)))
        return launch(plan)

    eng.runner.launch = launch_seen

    def submit():
        made[0] += 1
        rid = f"r{made[0]}"
        eng.submit(rid, prompts[made[0] % len(prompts)],
                   SamplingParams(seed=made[0], max_new_tokens=args.max_seq_len, ignore_end=True))
        live.append(rid)

    def step():
        for o in eng.step():
            if o.finished and o.request_id in live:
                live.remove(o.request_id)
                submit()  # (random weights never end: only cancels and max_seq_len end requests here)

    def turn_over():
        for rid in live[: args.arrivals]:
            eng.cancel(rid)  # its slot frees at the next launch; its replacement waits for it
        step()

    for _ in range(args.streams):
        submit()
    while eng.counts()["waiting"] or eng.counts()["prefilling"]:
        step()
    rows = []
    for phase, fn in (("decode", step), ("arrivals", turn_over)):
        for _ in range(args.warm_steps):
            fn()
        seen.clear()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        times.sort()
        row = {"phase": phase, "streams": args.streams, "steps": args.steps,
               "wall_ms_p50": round(times[len(times) // 2] * 1e3, 3),
               "wall_ms_mean": round(sum(times) / len(times) * 1e3, 3),
               "prompt_rows_per_step": round(sum(r for r, _ in seen) / max(1, len(seen)), 1),
               "prompts_ending_per_step": round(sum(e for _, e in seen) / max(1, len(seen)), 2),
               "slots_held": len(eng.live)}
        if args.profile and cuda:
            row.update(_kernel_table(fn, args.profile_steps, Path(args.profile) / f"{phase}.txt"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_arguments(ap)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--arrivals", type=int, default=1, help="requests turned over a step in the arrivals phase")
    ap.add_argument("--text-words", type=int, default=12, help="words of each prompt's text")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warm-steps", type=int, default=20)
    ap.add_argument("--profile", help="directory for the kernel tables (GPU only)")
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    ap.add_argument("--json")
    args = ap.parse_args()

    from s2tts.codec.loading import codec_codebook_sizes
    from s2tts.ar.loading import load_model
    from s2tts.checkpoint_config import S2Config
    from s2tts.frontend.prompt import PromptBuilder

    ck = checkpoint_dir(args)
    model = load_model(ck, args.device, "bf16" if args.device.startswith("cuda") else "fp32")
    pb = PromptBuilder.from_dir(ck, S2Config.from_dir(ck))
    words = "one two three four five six seven eight nine ten eleven twelve".split()
    prompts = [pb.build(f"Stream {i}: " + " ".join(words[k % len(words)] for k in range(args.text_words)) + ".")
               for i in range(16)]
    print(json.dumps({"prompt_tokens": len(prompts[0])}), flush=True)
    rows = run(args, model, codec_codebook_sizes(ck)[1], prompts)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
