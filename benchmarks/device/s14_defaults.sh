#!/bin/bash
# Issue 27 on one GPU (written in session 14, not yet run: no device time was left): the recorded
# trace against make_fx, a first and a second process, auto's threshold, the facade in fresh
# processes.
# Usage: bash benchmarks/device/s14_defaults.sh STAGE   (the .whl and .real0x folders carried)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>/dev/null \
  || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}; }
export OMP_NUM_THREADS=8 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/gpus.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> $O/gpus.txt
cat $O/gpus.txt
case "$1" in
  cache)
    # session 15: inductor's graph cache reached (NOTE [inductor's caches for an aten graph])
    for w in gpt2 gpt2_large; do
      BENCH_TRACE_REUSE_PROFILE=${PROFILE:-} timeout ${T:-200} python3 -m benchmarks.bench_trace_reuse $w --curvatures hessian --engines compiled > $O/reuse_${w}_compiled.jsonl 2> $O/reuse_${w}_compiled.err
      python3 -c "import json,sys;[print({k:v for k,v in json.loads(l).items() if k in ('workload','process','first_s','second_ms','autograd_ms','inductor_counters','error')}, json.loads(l).get('report',{}).get('compile_s')) for l in open(sys.argv[1])]" $O/reuse_${w}_compiled.jsonl
    done
    ;;
  defaults)
    # session 15: a first run (cold) and the same script again (rerun): WORKLOAD LENGTHS ENGINES CURVS
    for st in cold rerun; do
      timeout ${T:-280} python3 -m benchmarks.bench_defaults $2 --record $st --record-dir /tmp/rec_$2 --lengths ${3:-1,20,100,1000} --engines ${4:-auto,autograd,functional,compiled} --curvatures ${5:-hessian,ggn,ef} > $O/defaults_$2_$st.jsonl 2> $O/defaults_$2_$st.err
      grep default_vs_best $O/defaults_$2_$st.jsonl | python3 -c "import sys,json;[print('$st', r['cell'], r['mode'], r['length'], r['best'], round(r['ratio'],2)) for r in map(json.loads, sys.stdin)]"
    done
    ;;
  perproduct)
    # session 15: per-product figures on this card (the compiled engine, the head's alignment,
    # KFAC's factor pass, the fused kernel's defaults)
    timeout 60 python3 -m benchmarks.head_alignment > $O/head_alignment.jsonl 2>&1; cat $O/head_alignment.jsonl
    timeout 120 python3 -m benchmarks.bench_kfac --device cuda --workloads resnet18 --factors --out $O/kfac.json > $O/kfac.log 2>&1; tail -12 $O/kfac.log
    for w in resnet18 gpt2 gpt2_large; do
      timeout ${T:-150} python3 -m benchmarks.bench_engines $w --curvatures hessian --engines autograd,functional,compiled --reps 5 > $O/engines_$w.jsonl 2> $O/engines_$w.err
      python3 -c "import json,sys;[print('$w', {k:v for k,v in json.loads(l).items() if k in ('cell','engine','ms','first_s','rel_diff','error')}) for l in open(sys.argv[1])]" $O/engines_$w.jsonl
    done
    timeout 150 python3 benchmarks/bench_kernels.py --out $O/kernels --sweep none > $O/kernels.log 2>&1; tail -25 $O/kernels.log
    ;;
  tests)
    python3 -m pytest tests/operators/test_trace_times.py tests/operators/test_engines.py -q -x -p no:cacheprovider 2>&1 | tail -2
    ;;
  one)
    timeout 170 python3 -m benchmarks.bench_trace --workloads gpt2_12l,resnet18,mlp --repeats 2 > $O/bench_trace.jsonl 2> $O/bench_trace.err
    timeout 230 python3 -m benchmarks.bench_trace_reuse gpt2_large --engines functional > $O/reuse_gpt2_large.jsonl 2> $O/reuse_gpt2_large.err
    timeout 150 python3 -m benchmarks.bench_trace_reuse gpt2 --curvatures hessian --engines compiled > $O/reuse_gpt2_compiled.jsonl 2> $O/reuse_gpt2_compiled.err
    cat $O/bench_trace.jsonl | cut -c1-400
    python3 - <<'PY'
import json, os
O = os.environ.get("OUT", "/tmp/out")
for f in ("reuse_gpt2_large.jsonl", "reuse_gpt2_compiled.jsonl"):
    for line in open(os.path.join(O, f)):
        r = json.loads(line); rep = r.get("report", {})
        print(r["workload"], r["curvature"], r["engine"], r["process"], r.get("first_s"), r.get("second_ms"),
              r.get("autograd_ms"), rep.get("trace_s"), rep.get("traces_reused"), rep.get("reuse_check_s"),
              rep.get("compile_s"), r.get("error"))
PY
    ;;
  facade)
    for i in $(seq 1 ${FRESH:-10}); do
      timeout 60 python3 -m benchmarks.real0x --real-0x .real0x --device cuda --repeats 1 --warmup 0 --only readme_cnn_default_gpu.py --out $O/fresh_$i > /dev/null 2>&1
    done
    python3 - <<'PY'
import json, os, glob
O = os.environ.get("OUT", "/tmp/out")
for f in sorted(glob.glob(os.path.join(O, "fresh_*", "real0x.json"))):
    r = json.load(open(f))["rows"][0]
    print(f.split("/")[-2], r["facade"]["median_s"], r["0x"]["median_s"], r["facade-aa"]["median_s"], r["ratio_facade_over_0x"], r["agrees"], r["0x"]["error"], r["facade"]["error"])
PY
    ;;
  three)
    for st in warm cold; do
      timeout 270 python3 -m benchmarks.bench_defaults resnet18 --record $st --lengths 1,20,100 > $O/defaults_resnet18_$st.jsonl 2> $O/defaults_resnet18_$st.err
      grep default_vs_best $O/defaults_resnet18_$st.jsonl | python3 -c "import sys,json;[print('$st', r['cell'], r['mode'], r['length'], r['best'], round(r['ratio'],2)) for r in map(json.loads, sys.stdin)]"
    done
    ;;
esac
