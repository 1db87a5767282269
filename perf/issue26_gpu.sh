#!/usr/bin/env bash
# Issue 26's "done when": this code and the issue's starting code measured on one machine, then one table
# (perf/issue26.py). Run from the repository root on the GPU machine, a part a device call (each fits in 10 minutes):
#
#   rm -rf baseline && mkdir baseline && git archive 79c0cdb | tar -x -C baseline   # on the development machine
#   bash perf/issue26_gpu.sh serve      # served c=1 and c=64, a voice's first use, ready time    (~6 min both trees)
#   bash perf/issue26_gpu.sh kernels    # the decode step at 1 and 64 rows, bf16 and fp8; one codec call of 64 x 8
#   bash perf/issue26_gpu.sh fp8        # served c=1 with ar_weights=fp8
#   bash perf/issue26_gpu.sh scale      # two engines at c=128 (a two-GPU kind; TREES=final unless the base's wanted)
#
# then, with the parts' $OUT folders merged into one RESULTS (final/ and base/ in it):
#   python3 perf/issue26.py RESULTS
#
# Environment (default):
#   TREES   ("final base")   which trees: final = this one, base = baseline/ (a `git archive` of the issue's start;
#                            carried beside .whl and .gpu, 1.6 MB)
#   CKPT    (/tmp/s2-full)   the full-size random checkpoint both use (run_gpu.sh writes it if missing)
#   BASE_REV (79c0cdb)       what baseline/ was archived from: its name in $OUT/base/tree.txt (each tree's folder
#                            says what ran in tree.txt)
#   OUT     (perf/out)       results: $OUT/<tree>/<part>, and each part's log as $OUT/<tree>/<part>.log
#   LEVELS  (1,64)           serve's loadgen levels, and REQUESTS (1:24,64:1280) its requests a level (the issue's
#                            c=64 rows read the level 64; a CPU smoke test runs smaller ones, with run_gpu.sh's
#                            DEVICE=cpu and a tiny CKPT passed through)
# Each tree runs its own scripts (perf/run_gpu.sh, bench_engine.py, bench_codec.py, scale_gpus.sh) with its own
# defaults: the comparison is of the two codes as they were, on one machine, in one session.
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:-}"
case "$part" in serve | kernels | fp8 | scale) ;; *)
  echo "usage: bash perf/issue26_gpu.sh serve|kernels|fp8|scale   (see the head of this file)" >&2; exit 2;;
esac
OUT="${OUT:-perf/out}"
OUT="$(mkdir -p "$OUT" && cd "$OUT" && pwd)"
export CKPT="${CKPT:-/tmp/s2-full}" STOP_NOW=1 PA=0 LEVEL_TIMEOUT=90
if [[ " ${TREES:-final base} " == *" base "* ]] && [ ! -d baseline/perf ]; then
  echo "no baseline/: make it on the development machine (git archive 79c0cdb | tar -x -C baseline) and carry it," \
       "or run with TREES=final" >&2
  exit 2
fi
[ -d baseline ] && { ln -sfn "$PWD/.whl" baseline/.whl; ln -sfn "$PWD/.gpu" baseline/.gpu; }
here="$PWD"
for tree in ${TREES:-final base}; do
  dir=.; [ "$tree" = base ] && dir=baseline
  res="$OUT/$tree"; mkdir -p "$res"
  if [ "$tree" = base ]; then  # (baseline/ is no checkout: git must not answer for it with this one's commit)
    echo "baseline/ = git archive ${BASE_REV:-79c0cdb}" > "$res/tree.txt"
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
  echo "== $tree $part rc=$? $(( $(date +%s) - t )) s (log: $res/$part.log)"
  cd "$here" || exit 1
done
python3 perf/issue26.py "$OUT" 2>/dev/null || true
