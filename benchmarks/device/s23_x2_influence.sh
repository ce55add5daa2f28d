#!/bin/bash
# Issue 40 on 2 GPUs (nvidia-h100-x2), one device call: hessian_eigenthings.influence on the
# Llama-3.2-1B shape (benchmarks/influence_ranks.py): EK-FAC with Monte-Carlo labels fitted on 2
# NCCL ranks (each its 1,000 of the 2,000 training sequences x 512 tokens, factors summed over
# the ranks), then each rank scores its sequences against 16 queries at rank 64. A warm-up at
# 64 sequences first (NCCL, cuBLAS, the allocator; a shape or memory failure shows in ~2 minutes
# instead of after the full fit), then the full run. Each writes its JSON under $OUT (a partial
# one, "complete": false, once its factors are fitted) and a log.
#
# Usage: bash benchmarks/device/s23_x2_influence.sh [bf16|fp32] [n_train] [warmup: 1|0] [more
# arguments of the script, which win over the ones below] (default bf16 2000 1). Carry bench_out (bench_out/whl: the deprecation wheel; see
# s20_influence.sh).
#
# Time, ESTIMATED (nothing here has run on a GPU; figures scaled from session 21's GPT-2 run on
# one H100, float32, TF32 off: 36 s of factor passes for ~1.4 PFLOP, ~38 TFLOP/s):
#   - start: torchrun, NCCL, the 1.24 B model built on each rank's CPU and moved: ~0.5 min;
#   - fit, per GPU (512 K tokens): ~29 GFLOP a token (two forward+backward passes at 6 x 1.24 G,
#     the factors' moments, the eigenbasis rotations and per-sequence sums) = 15 PFLOP: ~6.5 min
#     in float32, ~4 min in bfloat16 (GPT-2's bf16/fp32 ratio, 0.6: the factors stay float32);
#     plus the eigenbases, every rank decomposing the 224 factors of the 112 layers in float32
#     (48 of them 8192 x 8192): ~1-2 min (--factor-placement by_module splits them between the ranks);
#   - scores, per GPU: a forward+backward a sequence (7.4 GFLOP a token: ~1.5 min fp32, ~0.5 min
#     bf16), the 16 queries' gradients and their 1,792 SVDs (~1 min), the low-rank contraction;
#   - warm-up (64 sequences, the same 16 queries): ~2 min.
# So bf16 at 2,000: ~7-9 min with the warm-up, near the 10-minute call: if the full run is cut,
# its partial JSON keeps the fit, and the next call runs `... bf16 2000 0` (no warm-up). fp32 at
# 2,000 (~9-11 min alone) does not fit one call: run `... fp32 1000 0` (each rank streams its
# sequences; the per-1,000 figure is what the issue asks for).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site bench_out/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/gpus.txt
python3 -c "import torch,transformers;print(torch.__version__,torch.cuda.nccl.version(),transformers.__version__)" >> $O/gpus.txt
cat $O/gpus.txt
dtype=${1:-bf16}; n=${2:-2000}; warm=${3:-1}; extra=("${@:4}")

run() {  # tag, seconds, then the script's own arguments
  local tag=$1 limit=$2; shift 2
  timeout -k 15 $limit torchrun --standalone --nproc-per-node 2 benchmarks/influence_ranks.py \
    --workload llama1b --length 512 --queries 16 --batch 8 --rank 64 --dtype $dtype \
    --out $O/influence_x2_${dtype}_$tag.json "$@" "${extra[@]}" 2>&1 \
    | grep -v -i "warn" | cut -c1-400 > $O/influence_x2_${dtype}_$tag.log
  echo "== $tag rc=${PIPESTATUS[0]}"; tail -6 $O/influence_x2_${dtype}_$tag.log
}
if [ "$warm" = 1 ]; then run warmup 150 --n-train 64; fi
run n$n $(( warm == 1 ? 400 : 560 )) --n-train $n
