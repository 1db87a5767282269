#!/usr/bin/env python3
"""Text streamed in like an LLM writes it, audio streamed out: s2pro text sessions under load.

    python perf/live_load.py --url 127.0.0.1:8001 --concurrency 1,16 --sessions 8 --json live.json

Each session (over gRPC to Triton's `s2pro`, s2tts.client) opens a text session whose request streams the audio, then
sends its text a token at a time at --tokens-per-s (an LLM's pace: a token is a word with its space, or a 4-character
piece of a longer one), the last token of each sentence with a flush, the last one with the end. c sessions run at
once (closed loop); each has its own sentences and seed; each sentence makes --frames frames (`ignore_eos`, as
perf/loadgen.py: the benchmark's weights are random). Every audio chunk says which text segment it speaks (s2pro's
`segment` output), so the client sees when each sentence's audio begins.

Per level:
  first_ms     the first sentence: its last token sent -> its first audio; mean / p50 / p90 / max
  next_ms      a later sentence: the later of (its last token sent, the end of the audio made for the sentence before:
               the session generates one segment at a time) -> its first audio; p50 / p90 / max
  underrun     sessions whose audio, played from its first chunk's arrival, would have run dry; dry_ms_max the longest
  audio_s_per_s, sessions_per_s  totals over the level's wall time
The target: first_ms <= 60 at c=1; no underrun at c=16 while text keeps coming.
Output: --json FILE (config, per level the numbers and every session's record) and a markdown table, printed last.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from s2tts.client import AudioChunk, S2ProClient, TTSError, TTSInput  # noqa: E402

_SUBJECTS = ["The weather", "Our new product", "The quarterly report", "A friendly robot", "The train to Lyon",
             "This recipe", "The museum", "My neighbour's cat", "The football match", "A good night's sleep"]
_PREDICATES = ["looks better than anyone expected this morning", "arrives a little later than planned today",
               "needs a few more careful checks before we share it", "surprised everybody at the meeting yesterday",
               "will be ready for you by the end of the week", "is the best thing that happened to us this year"]


def session_text(i: int, sentences: int) -> str:
    """Session i's answer: `sentences` sentences, unique in the run."""
    return " ".join(f"{_SUBJECTS[(i + k) % len(_SUBJECTS)]} {_PREDICATES[(i * 7 + k) % len(_PREDICATES)]}, "
                    f"says note {i}.{k}." for k in range(sentences))


def tokens(text: str) -> list[str]:
    """An LLM's pieces of `text`: each word with the space after it, a long word in pieces of 4 characters."""
    out = []
    for word in re.findall(r"\S+\s*", text):
        core = word.rstrip()
        pieces = [core[j:j + 4] for j in range(0, len(core), 4)] if len(core) > 6 else [core]
        pieces[-1] += word[len(core):]
        out.extend(pieces)
    return out


def run_session(url: str, i: int, args) -> dict:
    """One session: the listener streams the audio while this thread sends the tokens. -> its record."""
    sid = f"live-load-{uuid.uuid4().hex[:12]}"
    text = session_text(i, args.sentences)
    toks = tokens(text)
    ends = [j for j, t in enumerate(toks) if re.search(r"[.!?]\s*$", t)]  # the last token of each sentence
    common = dict(seed=1000 + i, max_new_tokens=args.frames, ignore_eos=args.ignore_eos, chunk_length=args.chunk_length,
                  first_chunk_frames=args.first_chunk_frames, chunk_frames=args.chunk_frames)
    chunks: list[tuple[float, int, int]] = []  # (arrival, segment, samples)
    out: dict = {"session": i, "chars": len(text), "tokens": len(toks), "sentences": len(ends)}
    t0 = time.perf_counter()

    def listen():
        try:
            with S2ProClient(url) as c:
                for ev in c.stream(TTSInput(text="", session_id=sid, text_event="open", **common), timeout=120):
                    if isinstance(ev, AudioChunk) and ev.segment is not None:
                        chunks.append((time.perf_counter(), int(ev.segment["segment"]), int(ev.audio.size)))
                        out["sample_rate"] = ev.sample_rate
                    elif not isinstance(ev, AudioChunk):
                        out["stats"] = ev.stats
        except TTSError as e:
            out["error"] = str(e)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    sent_at = []
    with S2ProClient(url) as c:
        deadline = time.monotonic() + 60
        for j, tok in enumerate(toks):
            event = "end" if j == len(toks) - 1 else "flush" if j in ends else "text"
            while True:
                sending = time.perf_counter()  # before the send: its audio can only come after this
                try:
                    c.synthesize(TTSInput(text=tok, session_id=sid, text_event=event), timeout=60)
                    break
                except TTSError as e:  # the session's own request may not have reached s2pro yet
                    if e.code != "not_found" or time.monotonic() > deadline:
                        out["error"] = str(e)
                        break
                    time.sleep(0.005)
            if j in ends:
                sent_at.append(sending)
            if "error" in out:
                break
            time.sleep(max(0.0, t0 + (j + 1) / args.tokens_per_s - time.perf_counter()))
    listener.join(180)
    return _measure(out, chunks, sent_at, t0)


def _measure(out: dict, chunks, sent_at, t0) -> dict:
    sr = out.get("sample_rate", 44100)
    first = {}  # segment -> its first chunk's arrival
    last = {}  # segment -> its last chunk's arrival
    for t, seg, _ in chunks:
        first.setdefault(seg, t)
        last[seg] = t
    lat = []
    for k, t_sent in enumerate(sent_at):
        if k not in first:
            continue
        ready = t_sent if k == 0 else max(t_sent, last.get(k - 1, t_sent))
        lat.append(round((first[k] - ready) * 1000, 2))
    # playback from the first chunk's arrival: a chunk is late if it arrives after what came before it has played
    dry, played = 0.0, 0.0
    if chunks:
        clock = chunks[0][0]
        for t, _, n in chunks:
            due = clock + played / sr
            if t > due:
                dry = max(dry, t - due)
                clock += t - due  # the gap shifts what follows
            played += n
    out.update(latency_ms=lat, segments=len(first), audio_s=round(played / sr, 3), dry_ms=round(dry * 1000, 1),
               wall_s=round((chunks[-1][0] if chunks else time.perf_counter()) - t0, 3))
    return out


def _pct(xs, q):
    return round(float(np.percentile(xs, q)), 1) if xs else None


def run_level(url: str, c: int, args) -> dict:
    n = max(args.sessions, c)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        recs = list(pool.map(lambda i: run_session(url, i, args), range(n)))
    wall = time.perf_counter() - t0
    firsts = [r["latency_ms"][0] for r in recs if r["latency_ms"]]
    nexts = [x for r in recs for x in r["latency_ms"][1:]]
    under = [r for r in recs if r["dry_ms"] > args.underrun_ms]
    return {"concurrency": c, "sessions": n, "errors": sum("error" in r for r in recs),
            "first_ms_mean": round(float(np.mean(firsts)), 1) if firsts else None, "first_ms_p50": _pct(firsts, 50),
            "first_ms_p90": _pct(firsts, 90), "first_ms_max": max(firsts) if firsts else None,
            "next_ms_p50": _pct(nexts, 50), "next_ms_p90": _pct(nexts, 90), "next_ms_max": max(nexts) if nexts else None,
            "underrun": f"{len(under)}/{n}", "dry_ms_max": max((r["dry_ms"] for r in recs), default=0.0),
            "audio_s_per_s": round(sum(r["audio_s"] for r in recs) / wall, 2),
            "sessions_per_s": round(n / wall, 3), "wall_s": round(wall, 2), "records": recs}


COLUMNS = ["concurrency", "sessions", "errors", "first_ms_mean", "first_ms_p50", "first_ms_p90", "first_ms_max",
           "next_ms_p50", "next_ms_p90", "next_ms_max", "underrun", "dry_ms_max", "audio_s_per_s"]


def table(levels: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(lv[k]) for k in COLUMNS) + " |" for lv in levels]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="127.0.0.1:8001", help="Triton's gRPC address")
    ap.add_argument("--concurrency", default="1,16", help="sessions at once, per level")
    ap.add_argument("--sessions", type=int, default=8, help="sessions per level (at least the concurrency)")
    ap.add_argument("--sentences", type=int, default=3, help="sentences per session")
    ap.add_argument("--tokens-per-s", type=float, default=20.0, help="the LLM's pace")
    ap.add_argument("--frames", type=int, default=100, help="frames per sentence (max_new_tokens; 100 = 4.6 s, a "
                    "sentence's length at a speaking pace)")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let the model end sentences (by default each makes exactly --frames: random weights)")
    ap.add_argument("--chunk-length", type=int, default=200)
    ap.add_argument("--first-chunk-frames", type=int)
    ap.add_argument("--chunk-frames", type=int)
    ap.add_argument("--underrun-ms", type=float, default=0.0, help="a silence longer than this counts as an underrun")
    ap.add_argument("--warmup", type=int, default=1, help="sessions run alone first, not counted")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    for i in range(args.warmup):
        run_session(args.url, 10_000 + i, args)
    levels = [run_level(args.url, int(c), args) for c in args.concurrency.split(",") if c.strip()]
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "levels": levels}, indent=1))
    print(table(levels))
    return 0 if not any(lv["errors"] for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
