#!/usr/bin/env bash
# Usage: git archive <old rev> | tar -x -C baseline   (ignored: carry it, with .whl and .gpu)
#        then, on the GPU machine: bash perf/ab_gpu.sh   (ROUNDS="1 2 3" for three rounds)
# A/B: this tree vs baseline/ (git archive of the previous main), alternating, same machine.
ln -sfn "$PWD/.whl" baseline/.whl; ln -sfn "$PWD/.gpu" baseline/.gpu
export CONCURRENCY=1,64 CLONE_CONCURRENCY= CLONE_FIRST_CONCURRENCY= PA=0 LEVEL_TIMEOUT=90 LOADGEN_ARGS="--requests-per-level 64:256"
for i in ${ROUNDS:-1 2}; do
  for v in new base; do
    d=.; [ $v = base ] && d=baseline
    t0=$(date +%s)
    (cd $d && OUT=/tmp/o_$v$i bash perf/run_gpu.sh > /tmp/log_$v$i 2>&1)
    echo "== $v$i rc=$? $(( $(date +%s) - t0 )) s"
    cp /tmp/o_$v$i/summary.md $OUT/summary_$v$i.md 2>/dev/null
    grep -E "^\| *(1|64) *\|" /tmp/o_$v$i/summary.md | head -4
    tail -3 /tmp/log_$v$i
  done
done
