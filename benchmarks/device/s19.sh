#!/bin/bash
# Session 19, one GPU: this tree against the session's starting tree (11a97db), interleaved, two rounds.
# Carry bench_out (bench_out/trees/{before,after} from `git archive`, bench_out/whl with the deprecation wheel).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site bench_out/whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
export OMP_NUM_THREADS=8 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/gpus.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> $O/gpus.txt
cat $O/gpus.txt
for round in 1 2; do
python3 -m benchmarks.before_after --trees bench_out/trees/before bench_out/trees/after --module bench_engines \
  --workloads mlp resnet18 gpt2 --out $O/engines.jsonl --timeout 240 -- --engines autograd,functional --reps 20
done
python3 - <<'PY' $O/engines.jsonl
import json,sys,collections
rows=[json.loads(l) for l in open(sys.argv[1])]
agg=collections.defaultdict(list)
for r in rows:
    if 'ms' in r or 'median_ms' in r:
        k=(r.get('workload'),r.get('curvature'),r.get('engine'),r.get('cell'))
        agg[k+(r.get('tree'),)].append(r.get('ms', r.get('median_ms')))
for k,v in sorted(agg.items(), key=str): print(k, v)
print(rows[0].keys() if rows else None)
PY
