#!/bin/bash
# Session 20, one GPU: hessian_eigenthings.influence beside Kronfluence 1.0.1 (benchmarks/influence_gpu.py).
# Carry bench_out (bench_out/whl: deprecation, kronfluence 1.0.1 and einconv wheels; the rest of
# Kronfluence's needs are on the device image). Usage: bash benchmarks/device/s20_influence.sh fp32 [args...]
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site bench_out/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
export OMP_NUM_THREADS=8 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/gpus.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> $O/gpus.txt
cat $O/gpus.txt
dtype=$1; shift
python3 benchmarks/influence_gpu.py --dtype $dtype --out $O/influence_$dtype.json "$@" 2>&1 | grep -v -i "warn\|GradScaler" | tee $O/influence_$dtype.log
