#!/bin/bash
# Session 13, #28 on 2 GPUs: one device call. Usage: bash benchmarks/device/s13_sharded.sh STAGE
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=8
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/gpus.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> $O/gpus.txt
TR="torchrun --standalone --nproc_per_node=2 benchmarks/bench_sharded.py"
case "$1" in
  one)
    timeout 300 $TR --workload gpt2_6l --out $O 2>&1 | grep -v Warning | tail -40
    timeout 150 $TR --workload gpt2_12l --sections products,train,reference --out $O 2>&1 | tail -15
    timeout 200 python3 benchmarks/bench_sharded.py --workload llama1b --out $O --repeats 2 2>&1 | tail -15
    timeout 200 $TR --workload llama1b --sections products,train --repeats 2 --out $O 2>&1 | tail -15
    ;;
  two)
    timeout 100 $TR --workload gpt2_6l --sections products,train,reference --profile --out $O 2>&1 | grep bench_sharded
    timeout 80 $TR --workload gpt2_12l --sections products,train,reference --out $O 2>&1 | grep bench_sharded
    timeout 100 python3 benchmarks/bench_sharded.py --workload llama1b --sections walk --ops hessian --repeats 2 --out $O 2>&1 | grep bench_sharded
    mv $O/bench_sharded_llama1b_single.json $O/bench_sharded_llama1b_single_walk_kept.json
    timeout 280 $TR --workload llama1b --sections products,train,lanczos --ops hessian --ncv 12 --repeats 2 --out $O 2>&1 | grep bench_sharded
    ;;
  three)
    # the Krylov basis: 20 vectors of 2.5 GB per rank fit beside the walk on an H200, 12 on an H100
    MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    NCV=12; [ "$MEM" -gt 100000 ] && NCV=20
    timeout 560 $TR --workload llama1b --sections lanczos --ops hessian,ggn --ncv $NCV --out $O 2>&1 | grep -v "Warning\|warn\|return func"
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
    for w in ${WORKLOADS:-mlp}; do
      timeout ${DEF_TIMEOUT:-200} python3 -m benchmarks.bench_defaults $w --lengths ${LENGTHS:-1,20,100,1000} > $O/defaults_$w.jsonl 2> $O/defaults_$w.err; tail -3 $O/defaults_$w.err
    done
    ;;
  five)
    python3 -m pytest tests/operators/test_layer_walk.py -q -x -p no:cacheprovider 2>&1 | tail -3
    timeout 100 $TR --workload gpt2_6l --sections products,train,reference --out $O 2>&1 | grep bench_sharded
    ;;
  four)
    timeout 200 $TR --workload gpt2_6l --sections products,train,reference,lanczos --out $O 2>&1 | grep bench_sharded
    ;;
esac
