#!/bin/bash
# Issue 27 on one GPU, session 16: auto deciding from records (before/after on the same card) and
# programs compiled ahead of time (AOTInductor) loaded by a fresh process.
# Usage: bash benchmarks/device/s16.sh STAGE ARGS...   (carry .whl; for ab also .bench_trees/s15,
# the tree of b53ad4b, the session's starting commit)
set -u
source benchmarks/device/setup.sh
stage=$1; shift
case "$stage" in
  aoti)
    # WORKLOAD:CURVATURE ... (each with its own timeout T, default 240 s)
    for wc in "$@"; do
      w=${wc%%:*}; c=${wc##*:}
      timeout ${T:-240} python3 -m benchmarks.aoti_reuse $w --curvature $c --dir /tmp/aoti_${w}_$c > $O/aoti_${w}_$c.jsonl 2> $O/aoti_${w}_$c.err
      echo "rc=$? $w $c"; cut -c1-600 $O/aoti_${w}_$c.jsonl; tail -3 $O/aoti_${w}_$c.err | cut -c1-300
    done
    ;;
  ab)
    # WORKLOAD LENGTHS LANCZOS_LENGTHS ENGINES CURVS: as s17.sh's ab, against .bench_trees/s15
    BEFORE=${BEFORE:-s15} bash benchmarks/device/s17.sh ab "$@"
    ;;
esac
