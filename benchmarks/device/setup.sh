# Sourced by the device scripts: the carried wheels (.whl) installed, the environment, the output
# folder O, the repository root ROOT, and the card and versions in $O/gpus.txt.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
export OMP_NUM_THREADS=8 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
ROOT=$(pwd)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/gpus.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> $O/gpus.txt
cat $O/gpus.txt
