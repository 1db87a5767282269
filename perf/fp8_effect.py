#!/usr/bin/env python3
"""What FP8 weights (`ar_weights=fp8`) change in what the model says, against the same checkpoint in `--dtype`.

    python perf/fp8_effect.py --checkpoint /tmp/s2-full --device cuda --frames 64 --seeds 0,1,2,3 --json fp8.json

For every prompt and seed:
1. **Sampled codes** (the engine, as served): the same request (prompt, seed, `--frames` frames, the end token never
   sampled) through an engine over each model -> the first frame where any code differs, and the share of codes
   equal per codebook over all frames (after a first difference the two continue from different contexts, so that
   share is mostly of the frames before it).
2. **Logits along the reference's frames** (teacher forcing, no sampling): the slow AR over the prompt and the
   reference model's frames in one causal pass (each model its own), and the fast AR for each of those frames fed the
   reference's codes -> relative L2 error of each model's logits against the reference's (slow AR: its semantic
   head; fast AR: each residual codebook), and how often the argmax agrees.
One JSON record per run (`--json`), the means printed. On random weights the codes say nothing of speech: what it
measures is how far the FP8 model's numbers move, not what that does to a real voice: run it on the real checkpoint
before serving `ar_weights=fp8`. On a CPU with the tiny checkpoint it is a smoke test (the kernels under Triton's interpreter are
not needed: FP8 weights are widened there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Streaming speech synthesis needs its first audio within a few tens of milliseconds.",
         "Eight bits of weight per parameter halve what every step reads from memory.",
         "Would you like to hear that sentence once more, a little slower this time?"]


def sampled(engine, prompt, seed: int, frames: int) -> np.ndarray:
    """The engine's codes [C, frames] for one request (end token never sampled)."""
    from s2tts.ar.sampling import SamplingParams

    codes, _ = engine.generate(prompt, SamplingParams(seed=seed, max_new_tokens=frames, ignore_end=True),
                               request_id=f"fp8-effect-{seed}")
    return codes


@torch.inference_mode()
def forced_logits(model, prompt, codes: np.ndarray, residual: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher forcing along `codes` [C, N]: (slow AR logits [N, semantic + 1] predicting frames 0..N-1, fast AR
    logits [N, C - 1, residual] predicting codes 1..C-1 of each frame), float32 on the CPU."""
    s2 = model.s2
    dev = next(model.parameters()).device
    frames = torch.from_numpy(codes.T.astype(np.int64))  # [N, C]
    n, p = frames.shape[0], len(prompt)
    tokens = torch.cat([prompt.tokens, frames[:, 0] + s2.semantic_start_id]).to(dev)
    all_codes = torch.cat([prompt.codes, frames]).to(dev)
    semantic = torch.cat([prompt.semantic, torch.ones(n, dtype=torch.bool)]).to(dev)
    x = model.embed(tokens[None], all_codes[None], semantic[None])
    hidden, logits = model.slow(x, torch.arange(p + n, device=dev)[None])
    rows = slice(p - 1, p - 1 + n)  # the prompt's last position predicts frame 0, frame i's position frame i + 1
    slow = logits[0, rows].float().cpu()
    model.fast.setup_caches(n, hidden.dtype, dev)
    teacher = frames.to(dev)
    fast = []

    def force(lg, k):
        fast.append(lg.float().cpu())
        return teacher[:, k]

    model.fast.generate(hidden[0, rows], teacher[:, 0], force, residual)
    return slow, torch.stack(fast, dim=1)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """b against the reference a (rows of logits on the last axis): mean relative L2 error, argmax agreement."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    rel = (b2 - a2).norm(dim=-1) / a2.norm(dim=-1).clamp_min(1e-12)
    return {"rel_err_mean": round(float(rel.mean()), 5), "rel_err_max": round(float(rel.max()), 5),
            "argmax_agree": round(float((a2.argmax(-1) == b2.argmax(-1)).float().mean()), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", help="the reference's dtype (and the FP8 model's other tensors)")
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--seeds", default="0,1,2,3", help="one run per seed, the prompts in turn")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args()

    from s2tts.codec.loading import codec_codebook_sizes
    from s2tts.ar.loading import load_model
    from s2tts.engine import Engine, EngineConfig
    from s2tts.frontend.prompt_builder import PromptBuilder

    ck, dev = args.checkpoint, args.device
    residual = codec_codebook_sizes(ck)[1]
    builder = PromptBuilder.from_dir(ck)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    prompts = [builder.build(TEXTS[i % len(TEXTS)]) for i in range(len(seeds))]
    t0 = time.time()
    models = {"ref": load_model(ck, dev, args.dtype), "fp8": load_model(ck, dev, args.dtype, weights="fp8")}
    codes = {}
    for name, model in models.items():  # 1. sampled, as served
        engine = Engine(model, residual, EngineConfig(max_batch=1, max_seq_len=args.max_seq_len, prefix_cache_mb=0))
        codes[name] = [sampled(engine, p, s, args.frames) for p, s in zip(prompts, seeds)]
        del engine
    records = []
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        ref, q = codes["ref"][i], codes["fp8"][i]
        differ = np.flatnonzero((ref != q).any(axis=0))
        logits = {name: forced_logits(m, prompt, ref, residual) for name, m in models.items()}  # 2. teacher forcing
        records.append({
            "seed": seed, "text": TEXTS[i % len(TEXTS)], "frames": args.frames, "prompt_tokens": len(prompt),
            "first_differing_frame": int(differ[0]) if differ.size else None,
            "codes_equal_per_codebook": [round(float(x), 4) for x in (ref == q).mean(axis=1)],
            "slow_logits": compare(logits["ref"][0], logits["fp8"][0]),
            "fast_logits": compare(logits["ref"][1], logits["fp8"][1])})
    firsts = [r["first_differing_frame"] for r in records]
    summary = {
        "checkpoint": ck, "device": str(dev), "dtype": args.dtype, "runs": len(records), "seconds": round(time.time() - t0, 1),
        "gpu": torch.cuda.get_device_name(0) if str(dev).startswith("cuda") else None,
        "runs_with_equal_codes": sum(f is None for f in firsts),
        "first_differing_frame_mean": round(float(np.mean([args.frames if f is None else f for f in firsts])), 1),
        "slow_rel_err_mean": round(float(np.mean([r["slow_logits"]["rel_err_mean"] for r in records])), 5),
        "slow_argmax_agree": round(float(np.mean([r["slow_logits"]["argmax_agree"] for r in records])), 4),
        "fast_rel_err_mean": round(float(np.mean([r["fast_logits"]["rel_err_mean"] for r in records])), 5),
        "fast_argmax_agree": round(float(np.mean([r["fast_logits"]["argmax_agree"] for r in records])), 4),
        "records": records}
    print(json.dumps({k: v for k, v in summary.items() if k != "records"}))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
