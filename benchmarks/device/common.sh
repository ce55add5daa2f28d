# Sourced by the device scripts: the wheels installed, the environment, the GPU and versions
# written to $O/gpus.txt. Carry bench_out (bench_out/whl: deprecation, kronfluence 1.0.1 and
# einconv wheels).
python3 -m pip install -q --no-index --no-deps --target /tmp/site bench_out/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/gpus.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> $O/gpus.txt
cat $O/gpus.txt
