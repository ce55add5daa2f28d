#!/bin/bash
# Issue 39 goal 3 on 2 GPUs (nvidia-h100-x2): the sharded layer walk with its next stage's
# all-gather prefetched against the same walk waiting each collective (NOTE [prefetched
# gathers]), in one process per rank (`--prefetch both` checks the two give the same bits), on
# the Llama-3.2-1B shape beside its FSDP2 training step (targets: Hessian <= 3.3 steps, GGN
# <= 2.2; measured before the prefetch: 4.34 and 2.52, session 18). Then the 6-layer GPT-2 as a
# smaller second point. Estimated 4-6 min (the 1B build and its products ~3 min in session 18).
# Run from the tree's root (a `git archive` snapshot); each run writes its JSON as it ends.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=8 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/gpus.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> $O/gpus.txt
cat $O/gpus.txt
for w in llama1b gpt2_6l; do
  mkdir -p $O/walk_$w
  timeout 300 torchrun --standalone --nproc_per_node=2 benchmarks/bench_sharded.py --workload $w \
    --sections products,train --prefetch both --out $O/walk_$w 2>&1 | grep bench_sharded | cut -c1-600
  echo "== $w rc=$?"
done
