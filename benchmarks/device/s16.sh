#!/bin/bash
# Issue 27 on one GPU, session 16: auto deciding from records (before/after on the same card) and
# programs compiled ahead of time (AOTInductor) loaded by a fresh process.
# Usage: bash benchmarks/device/s16.sh STAGE ARGS...   (carry .whl; for ab also .bench_trees/s15,
# the tree of b53ad4b, the session's starting commit)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>/dev/null \
  || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}; }
export OMP_NUM_THREADS=8 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
O=${OUT:-/tmp/out}; mkdir -p $O
ROOT=$(pwd)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/gpus.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> $O/gpus.txt
cat $O/gpus.txt
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
    # WORKLOAD LENGTHS LANCZOS_LENGTHS ENGINES CURVS: a first run and the same script again, this
    # tree (after) and the session's starting tree (before), alternated, ROUNDS rounds
    for r in $(seq 1 ${ROUNDS:-1}); do
      for tree in after before; do
        dir=$ROOT; [ $tree = before ] && dir=$ROOT/.bench_trees/s15
        rm -rf /tmp/rec_$1_$tree
        for st in cold rerun; do
          (cd $dir && timeout ${T:-200} python3 -m benchmarks.bench_defaults $1 --record $st --record-dir /tmp/rec_$1_$tree --lengths $2 --lanczos-lengths $3 --engines $4 --curvatures $5 > $O/ab_$1_${tree}_${st}_r$r.jsonl 2> $O/ab_$1_${tree}_${st}_r$r.err)
          grep default_vs_best $O/ab_$1_${tree}_${st}_r$r.jsonl | python3 -c "import sys,json;print('$tree $st r$r', ' '.join(r['cell'].split('_')[0]+':'+r['mode'][:3]+str(r['length'])+'='+str(round(r['ratio'],2))+('' if r['best']=='autograd' else '('+r['best'][:2]+')') for r in map(json.loads, sys.stdin)))"
        done
      done
    done
    ;;
esac
