set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site bench_out/whl/*.whl
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=8
O=${OUT:-/tmp/out}; ROOT=$(pwd)
for r in 1 2; do
for tree in before after fix; do
  (cd $ROOT/bench_out/trees/$tree && PYTHONPATH=$ROOT/bench_out/trees/$tree:/tmp/site timeout 100 torchrun --standalone --nproc_per_node=2 benchmarks/bench_sharded.py --workload gpt2_6l --sections products,train --repeats 5 --out $O/c_${tree}_$r 2>&1 | grep "walk\|step" | cut -c1-200)
  echo "== $tree r$r"
done
done
cd $O && tar czf peaks.tgz c_* && rm -rf c_*
