#!/usr/bin/env python3
"""Write perf_analyzer `--input-data` JSON files for this project's models, sized from a checkpoint.

    python perf/make_pa_inputs.py --checkpoint /tmp/s2-full --out perf/out/pa_inputs [--frames 100]

Files written (one `{"data": [...]}` each; several entries, which perf_analyzer cycles through):

| file | model | what each entry holds |
|---|---|---|
| `s2pro.json` | `s2pro` (decoupled, `--streaming`) | a unique text, `max_new_tokens`=--frames, `ignore_eos`, `seed` |
| `slow_ar.json` | `slow_ar` (request-response; no `request_id`: one answer with the whole generation) | `input_ids`/`input_codes`/`semantic_mask` of a real PromptBuilder prompt + sampling |
| `fast_ar_b{B}.json` | `fast_ar` | random `hidden` [B, dim] (dim from the checkpoint), random `code0` [B], sampling [B] |
| `dac_decoder.json` | `dac_decoder` (max_batch_size > 0: shapes without the batch dim) | random codes [--decode-frames, 10] within the codec's codebooks, a unique `stream_id`, `start`=`final`=true |
| `meta.json` | - | the dims used |

Only numpy, tokenizers and the `s2tts` package are needed (no torch model is loaded; the codec's codebook sizes
are read from codec.pth's tensor shapes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs back into the forest.",
    "Hello world, this is a test of streaming speech synthesis on the inference server.",
    "Streaming audio arrives in chunks; each chunk is decoded as soon as its frames exist.",
    "A voice reference is a short clip and its transcript, used to clone how someone sounds.",
    "Convert the provided text to speech, quickly and clearly, for everyone who is listening.",
    "Benchmarks measure the time to first audio and how much audio comes out every second.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "This sentence exists only to make the prompts differ from one request to the next one.",
]


def tensor(arr: np.ndarray, with_shape: bool = True) -> dict:
    arr = np.asarray(arr)
    if arr.dtype == object:
        content = [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in arr.reshape(-1)]
    elif arr.dtype == np.bool_:
        content = [bool(x) for x in arr.reshape(-1)]
    elif arr.dtype.kind == "f":
        content = [float(x) for x in arr.reshape(-1)]
    else:
        content = [int(x) for x in arr.reshape(-1)]
    d = {"content": content}
    if with_shape:
        d["shape"] = list(arr.shape)
    return d


def sampling(n: int, seed: int, rows: int | None = None) -> dict:
    """temperature/top_p/top_k/seed: shape [1] for s2pro/slow_ar, [rows] for fast_ar."""
    k = rows or 1
    return {"temperature": tensor(np.full(k, 0.8, np.float32)), "top_p": tensor(np.full(k, 0.8, np.float32)),
            "top_k": tensor(np.full(k, 30, np.int32)), "seed": tensor(np.arange(seed, seed + k, dtype=np.int64) + 1000 * n)}


def make(checkpoint: Path, out: Path, frames: int = 100, entries: int = 8, fast_ar_batches=(1, 8, 64),
         decode_frames: int = 25) -> dict[str, Path]:
    from s2tts.checkpoint_config import S2Config
    from s2tts.frontend.prompt_builder import PromptBuilder

    s2 = S2Config.from_dir(checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    C = s2.num_codebooks
    written: dict[str, Path] = {}

    def write(name: str, data: list[dict]) -> None:
        p = out / name
        p.write_text(json.dumps({"data": data}))
        written[name] = p

    # s2pro: text + a fixed frame count
    write("s2pro.json", [{
        "text": tensor(np.array([f"{TEXTS[i % len(TEXTS)]} Request {i}.".encode()], dtype=object)),
        "max_new_tokens": tensor(np.array([frames], np.int32)),
        "ignore_eos": tensor(np.array([True])),
        "seed": tensor(np.array([i], np.int64)),
    } for i in range(entries)])

    # slow_ar: a real prompt's token ids / codes / semantic mask
    pb = PromptBuilder.from_dir(checkpoint, s2)
    data = []
    for i in range(entries):
        p = pb.build(f"{TEXTS[i % len(TEXTS)]} Request {i}.")
        e = {"input_ids": tensor(p.tokens.numpy().astype(np.int32)),
             "input_codes": tensor(np.ascontiguousarray(p.codes.numpy().astype(np.int32))),  # [T, C]
             "semantic_mask": tensor(p.semantic.numpy().astype(np.bool_)),
             "max_new_tokens": tensor(np.array([frames], np.int32)),
             "ignore_eos": tensor(np.array([True]))}
        e.update(sampling(i, 0))
        data.append(e)
    write("slow_ar.json", data)

    # fast_ar: hidden [B, dim] (the slow AR's final-normed hidden state) + code0 [B] + per-row sampling
    dim = s2.text.dim
    for b in fast_ar_batches:
        data = []
        for i in range(min(entries, 4)):
            e = {"hidden": tensor(rng.standard_normal((b, dim), dtype=np.float32)),
                 "code0": tensor(rng.integers(0, s2.num_semantic, b).astype(np.int32)),
                 "step": tensor(np.full(b, 10 + i, np.int64))}
            e.update(sampling(i, 0, rows=b))
            data.append(e)
        write(f"fast_ar_b{b}.json", data)

    # dac_decoder: one chunk [n, C] per request (the batch dim is added by perf_analyzer, -b 1), a stream each; codes
    # within the codec's codebooks (it refuses others; the fast AR's vocabulary is larger than the residual codebooks)
    from s2tts.codec.loading import codec_codebook_sizes

    semantic, residual = codec_codebook_sizes(checkpoint)
    data = []
    for i in range(max(entries, 16)):
        codes = np.concatenate([rng.integers(0, semantic, (1, decode_frames)),
                                rng.integers(0, residual, (C - 1, decode_frames))]).T.astype(np.int32)
        data.append({"codes": tensor(np.ascontiguousarray(codes)), "stream_id": tensor(np.array([f"pa-{i}".encode()], dtype=object)),
                     "start": tensor(np.array([True])), "final": tensor(np.array([True]))})
    write("dac_decoder.json", data)

    meta = {"checkpoint": str(checkpoint), "num_codebooks": C, "dim": dim, "num_semantic": s2.num_semantic,
            "codebook_size": s2.codebook_size, "frames": frames, "decode_frames": decode_frames,
            "fast_ar_batches": list(fast_ar_batches), "prompt_tokens": int(len(pb.build(TEXTS[0] + " Request 0.")))}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    written["meta.json"] = out / "meta.json"
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="S2 Pro checkpoint directory (config.json, tokenizer.json)")
    ap.add_argument("--out", required=True, help="directory for the JSON files")
    ap.add_argument("--frames", type=int, default=100, help="frames per s2pro/slow_ar request (ignore_eos)")
    ap.add_argument("--entries", type=int, default=8, help="distinct data entries per file")
    ap.add_argument("--fast-ar-batches", default="1,8,64", help="row counts B of the fast_ar files")
    ap.add_argument("--decode-frames", type=int, default=25, help="frames per dac_decoder chunk")
    args = ap.parse_args(argv)
    written = make(Path(args.checkpoint), Path(args.out), args.frames, args.entries,
                   tuple(int(x) for x in args.fast_ar_batches.split(",") if x), args.decode_frames)
    for name, p in written.items():
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
