#!/usr/bin/env bash
# This tree beside another commit of the project, measured on one GPU machine in one run: what a change did.
# On the development machine, archive the other commit into baseline/ (git-ignored; carried beside .whl and .gpu):
#
#   rm -rf baseline && mkdir baseline && git archive <commit> | tar -x -C baseline
#
# then from the repository root on the GPU machine, a part a call (each fits in 10 minutes):
#
#   BASE_REV=<commit> bash perf/compare_gpu.sh serve     # served levels (LEVELS, default 1,64), a voice's first use
#   BASE_REV=<commit> bash perf/compare_gpu.sh kernels   # the decode step at 1 and 64 rows, bf16 and fp8; one codec
#                                                        # call of 64 streams x 8 frames
#   BASE_REV=<commit> bash perf/compare_gpu.sh fp8       # served c=1 with ar_weights=fp8
#   BASE_REV=<commit> bash perf/compare_gpu.sh scale     # two engines at c=128 (a two-GPU machine)
#
# Each tree runs its own scripts (perf/run_gpu.sh, bench_engine.py, bench_codec.py, scale_gpus.sh) with its own
# defaults, this tree first. The last lines printed are both trees' tables of the part (summary.md's loadgen rows).
#
# Environment (default):
#   TREES    ("final base")  which trees: final = this one, base = $BASE_DIR
#   BASE_DIR (baseline)      where the other commit's tree is
#   BASE_REV (required with base)  the commit baseline/ was archived from: its name in $OUT/base/tree.txt
#   CKPT     (/tmp/s2-full)  the full-size random checkpoint both use (run_gpu.sh writes it if missing)
#   OUT      (perf/out)      results: $OUT/<tree>/<part>/, each part's log as $OUT/<tree>/<part>.log
#   LEVELS   (1,64)          serve's loadgen levels (a level may repeat: 64,64,64 measures it three times), and
#   REQUESTS (1:24,64:1280)  its requests a level (loadgen's --requests-per-level)
#   MAX_BATCH, MAX_SEQ_LEN (64, 1024)  the served settings, the same for both trees (run_gpu.sh's knobs)
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:-}"
case "$part" in serve | kernels | fp8 | scale) ;; *)
  echo "usage: BASE_REV=<commit> bash perf/compare_gpu.sh serve|kernels|fp8|scale   (see the head of this file)" >&2
  exit 2;;
esac
OUT="${OUT:-perf/out}"
OUT="$(mkdir -p "$OUT" && cd "$OUT" && pwd)"
export CKPT="${CKPT:-/tmp/s2-full}" STOP_NOW=1 PA=0 LEVEL_TIMEOUT=90
export MAX_BATCH="${MAX_BATCH:-64}" MAX_SEQ_LEN="${MAX_SEQ_LEN:-1024}"
BASE_DIR="${BASE_DIR:-baseline}"
if [[ " ${TREES:-final base} " == *" base "* ]]; then
  if [ ! -d "$BASE_DIR/perf" ] || [ -z "${BASE_REV:-}" ]; then
    echo "the base tree needs $BASE_DIR/ (git archive <commit> | tar -x -C $BASE_DIR, on the development machine," \
         "carried) and BASE_REV=<that commit>; or run with TREES=final" >&2
    exit 2
  fi
  for d in .whl .gpu; do [ -e "$d" ] && ln -sfn "$PWD/$d" "$BASE_DIR/$d"; done
fi
here="$PWD"
for tree in ${TREES:-final base}; do
  dir=.; [ "$tree" = base ] && dir="$BASE_DIR"
  res="$OUT/$tree"; mkdir -p "$res"
  if [ "$tree" = base ]; then  # (baseline/ is no checkout: git must not answer for it with this one's commit)
    echo "$BASE_DIR/ = git archive $BASE_REV" > "$res/tree.txt"
  elif git rev-parse -q --verify HEAD > /dev/null 2>&1; then
    { git log -1 --format='commit %h %s'; git diff --quiet HEAD || echo " + uncommitted changes"; } | tr -d '\n' \
      > "$res/tree.txt"
  else
    echo "this tree (not a git checkout)" > "$res/tree.txt"
  fi
  t=$(date +%s)
  (
    cd "$dir" || exit 1
    [ "$tree" = base ] && export GIT_CEILING_DIRECTORIES="$here"
    case "$part" in
      serve)
        OUT="$res/serve" CONCURRENCY="${LEVELS:-1,64}" CLONE_CONCURRENCY= CLONE_FIRST_CONCURRENCY=1 \
          LOADGEN_ARGS="--requests-per-level ${REQUESTS:-1:24,64:1280}" bash perf/run_gpu.sh;;
      fp8)
        OUT="$res/serve_fp8" SETTINGS="ar_weights=fp8" CONCURRENCY=1 CLONE_CONCURRENCY= CLONE_FIRST_CONCURRENCY= \
          LOADGEN_ARGS="--requests-per-level 24" bash perf/run_gpu.sh;;
      kernels)
        # shellcheck disable=SC1091
        [ -f scripts/gpu_env.sh ] && [ -d .whl ] && source scripts/gpu_env.sh
        python3 perf/bench_engine.py --checkpoint "$CKPT" --make-full --batches 1,64 --frames 100 \
          --weights dtype,fp8 --json "$res/engine.json" \
          && python3 perf/bench_codec.py --checkpoint "$CKPT" --served-only --paths served --chunk 8 --batches 64 \
            --json "$res/codec.json";;
      scale)
        OUT="$res/scale" GPUS="2" C_PER_GPU=64 LOADGEN_ARGS="--requests-per-level 1280" LEVEL_TIMEOUT=60 \
          bash perf/scale_gpus.sh;;
    esac
  ) > "$res/$part.log" 2>&1
  echo "== $tree $part rc=$? $(( $(date +%s) - t )) s ($(cat "$res/tree.txt"); log: $res/$part.log)"
  cd "$here" || exit 1
done
for tree in ${TREES:-final base}; do  # the tables, for the reply's tail
  for f in "$OUT/$tree"/*/summary.md; do
    [ -f "$f" ] && { echo "== $tree: $f"; grep -E '^\| (c|[0-9]+) \|' "$f"; }
  done
  for f in "$OUT/$tree"/*.json; do
    [ -f "$f" ] && { echo "== $tree: $f"; head -c 2000 "$f"; echo; }
  done
done
exit 0
