#!/bin/bash
# Session 23's one-GPU call (about 9 minutes on an H100):
#   0. float64 eigh of GPT-2's factors one by one and on 2-8 streams (the candidate of fb23245,
#      reverted until measured), ~0.3 min;
#   1. where our influence run goes, phase by phase (float32), ~1.2 min;
#   2. influence beside Kronfluence 1.0.1, float32 (bfloat16 last) (issue 40's targets: float32
#      wall <= 0.70x, peak <= Kronfluence's), ~2.5 + 1.8 min;
#   3. the bf16 policy on the Llama-3.2-1B shape (issue 39 goal 2), 2 x 1024 tokens, the basis
#      of 10 vectors on the GPU (5 GB each; ncv 20 would be 99 GB), ~2 min.
# Carry bench_out (bench_out/whl: deprecation, kronfluence 1.0.1 and einconv wheels).
# Each part writes its JSON as it ends, so a cut call keeps the rest.
set -u
source benchmarks/device/common.sh
timeout 30 python3 benchmarks/eigh_streams.py --layers 3 --repeats 1 --out $O/eigh_streams.json 2>&1 | tail -12
[ -n "${SKIP_PHASES:-}" ] || timeout 100 python3 benchmarks/influence_phases.py --out $O/phases_fp32.json 2>&1 | grep -v -i warn | tail -3
influence() {
  timeout $2 python3 benchmarks/influence_gpu.py --dtype $1 --out $O/influence_$1.json 2>&1 \
    | grep -v -i "warn\|GradScaler" | tail -8
}
influence fp32 170
[ -n "${SKIP_POLICY:-}" ] || timeout 125 python3 benchmarks/bf16_policy.py --batch 2 --ncv 10 --max-iter ${POLICY_ITER:-60} --repeats 3 \
  --out $O/bf16_policy.json 2>&1 | grep -v -i warn | cut -c1-600 | tail -6
[ -n "${SKIP_BF16:-}" ] || influence bf16 120
