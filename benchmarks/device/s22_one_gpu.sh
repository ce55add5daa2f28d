#!/bin/bash
# The one-GPU work left by session 21, in one device call (about 8-9 minutes on an H100):
#   1. influence beside Kronfluence 1.0.1, float32 then bfloat16 (issue 40's targets: float32
#      wall <= 0.70x, peak <= Kronfluence's; HEAD has the layer-by-layer scores and blocks of 512,
#      neither measured on a GPU yet), ~2.2 + 1.8 min;
#   2. the bf16 policy on the Llama-3.2-1B shape (issue 39 goal 2: top-5 GGN eigenvalues of the
#      fp32 model, of the bf16 model under the default float32 products and under
#      precision="model"; seconds per product and peaks), ~3-4 min.
# Carry bench_out (bench_out/whl: deprecation, kronfluence 1.0.1 and einconv wheels; see
# s20_influence.sh). Each part prints and writes its JSON as it ends, so a cut call keeps the rest.
set -u
source benchmarks/device/common.sh
for d in fp32 bf16; do
  timeout 170 python3 benchmarks/influence_gpu.py --dtype $d --out $O/influence_$d.json 2>&1 \
    | grep -v -i "warn\|GradScaler" | tail -8
done
timeout 240 python3 benchmarks/bf16_policy.py --max-iter 40 --repeats 2 --out $O/bf16_policy.json 2>&1 \
  | grep -v -i warn | cut -c1-800 | tail -6
