#!/bin/bash
# Session 19 on 2 GPUs: the session's tree (after) against its start (before, 11a97db), interleaved:
# FSDP2-sharded GPT-2 6L Hessian (layer walk) and GGN products, the FSDP training step, and DDP
# products (bench_sharded), two rounds; then one GPU's products (bench_engines), one round.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site bench_out/whl/*.whl
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=8 PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
ROOT=$(pwd)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/gpus.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> $O/gpus.txt
cat $O/gpus.txt
for r in 1 2; do
  for tree in before after; do
    mkdir -p $O/sh_${tree}_r$r
    (cd $ROOT/bench_out/trees/$tree && PYTHONPATH=$ROOT/bench_out/trees/$tree:/tmp/site timeout 200 torchrun --standalone --nproc_per_node=2 benchmarks/bench_sharded.py --workload gpt2_6l --sections products,train,ddp --out $O/sh_${tree}_r$r 2>&1 | grep bench_sharded | cut -c1-600)
    echo "== $tree r$r rc=$?"
  done
done
export PYTHONPATH=/tmp/site
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 -m benchmarks.before_after --trees bench_out/trees/before bench_out/trees/after --module bench_engines \
  --workloads mlp gpt2 --out $O/engines.jsonl --timeout 130 -- --engines autograd,functional --reps 20 > /dev/null 2>&1
echo "engines rc=$?"
cd $O && tar czf sharded.tgz sh_* && rm -rf sh_*
