#!/usr/bin/env bash
# A/B through tritonserver: this tree against baseline/ (a `git archive` of the code to compare with), one
# perf/run_gpu.sh per run, alternating on one machine. On a development machine:
#   rm -rf baseline && mkdir baseline && git archive <old rev> | tar -x -C baseline   (ignored; carry it with .whl, .gpu)
# then on the GPU machine:
#   bash perf/ab_gpu.sh
#   C=4 LA="--requests-per-level 32" V="base new" bash perf/ab_gpu.sh
# Environment (default):
#   C      (1,64)                              loadgen levels
#   LA     (--requests-per-level 64:256)       loadgen options (per-level request counts: "1:24,64:1280")
#   V      (new base new2 base2)               the runs in order; a name starting with "base" runs baseline/, one
#                                              starting with "flip" the FLIP tree (below), any other this tree
#   STOP   (480)                               seconds after the first run's start past which no further run starts
#   CKPT   (/tmp/s2-full)                      the checkpoint both use (run_gpu.sh writes a full-size random one if
#                                              missing: once, before the first run)
#   FLIP   ("")                                "FILE:SED": a name starting with "flip" runs a copy of this tree with
#                                              sed -i SED applied to FILE (one default switched, e.g.
#                                              FLIP='s2tts/engine/chunking.py:s/^LOAD_SLOTS = 0.75/LOAD_SLOTS = 1.0/')
# Each run's summary.md goes to $OUT/<run>/ (the device tool brings $OUT back) and its level rows are printed.
[ -d baseline ] && { ln -sfn "$PWD/.whl" baseline/.whl; ln -sfn "$PWD/.gpu" baseline/.gpu; }
if [ -n "${FLIP:-}" ]; then  # this tree, one file changed by sed
  rm -rf /tmp/flip && mkdir /tmp/flip && tar -c --exclude=./baseline --exclude=./.whl --exclude=./.gpu --exclude=./.git . \
    | tar -x -C /tmp/flip && sed -i "${FLIP#*:}" "/tmp/flip/${FLIP%%:*}" && ln -sfn "$PWD/.whl" /tmp/flip/.whl \
    && ln -sfn "$PWD/.gpu" /tmp/flip/.gpu || { echo "FLIP=$FLIP: could not make the flipped tree"; exit 1; }
  if cmp -s "${FLIP%%:*}" "/tmp/flip/${FLIP%%:*}"; then echo "FLIP=$FLIP changed nothing"; exit 1; fi
fi
# STOP_NOW: each run's server and models killed at its end (a run whose engine hung leaves nothing on the GPU to slow
# the next one)
export CKPT="${CKPT:-/tmp/s2-full}" CONCURRENCY="${C:-1,64}" CLONE_CONCURRENCY= CLONE_FIRST_CONCURRENCY= PA=0 \
  LEVEL_TIMEOUT=90 LOADGEN_ARGS="${LA:---requests-per-level 64:256}" STOP_NOW=1
t0=$(date +%s)
for v in ${V:-new base new2 base2}; do
  d=.; case $v in base*) d=baseline;; flip*) d=/tmp/flip;; esac
  t=$(date +%s)
  (cd $d && OUT=/tmp/o_$v bash perf/run_gpu.sh > /tmp/log_$v 2>&1)
  echo "== $v ($d) rc=$? $(( $(date +%s) - t )) s"
  mkdir -p "${OUT:-/tmp/ab_out}/$v" && cp /tmp/o_$v/summary.md "${OUT:-/tmp/ab_out}/$v/" 2>/dev/null
  grep -E "^\| *[0-9]+ *\| *[0-9]+/" /tmp/o_$v/summary.md | head -4
  [ $(( $(date +%s) - t0 )) -gt "${STOP:-480}" ] && { echo "STOP: $(( $(date +%s) - t0 )) s spent"; break; }
done
