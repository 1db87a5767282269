#!/usr/bin/env python3
"""Write an S2-shaped checkpoint with random weights (official layout, file and tensor names).

    python scripts/make_checkpoint.py checkpoints/tiny                 # tiny dims, seconds on a CPU
    python scripts/make_checkpoint.py /tmp/s2-full --size full --device cuda   # real S2 Pro shapes, ~9.1 GB
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2tts.random_checkpoint import write_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory to write")
    ap.add_argument("--size", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where random tensors are drawn (cuda is faster for --size full)")
    args = ap.parse_args()
    print(write_checkpoint(args.out, args.size, args.seed, args.device))


if __name__ == "__main__":
    main()
