#!/bin/bash
# Issue #39 goal 1: the Llama-3-8B shape (8.03 B parameters, 4 x 1024 tokens) FSDP2-sharded over
# the 4 GPUs of one nvidia-h100-x4 node. One device call a piece, each under 9 minutes:
#
#   bash benchmarks/device/s21_x4.sh time     # training step, Hessian and GGN products, peaks
#   bash benchmarks/device/s21_x4.sh slq      # Hessian density, 1 probe x 30 steps, and its figure
#   bash benchmarks/device/s21_x4.sh top      # top Hessian eigenvalue; again until "complete"
#   bash benchmarks/device/s21_x4.sh ggn      # top-5 GGN eigenvalues (see the warning below)
#
# The checkpoints live in /tmp/s21 on the device machine, which keeps them only while it stays
# warm (30 s after a call): make the next call at once. `top` stops itself at the first saved
# point after DEADLINE seconds (NOTE [runs across commands] in bench_sharded.py) and writes its
# JSON with "complete": false; the same call again resumes it (every rank from its own file)
# and skips what is done. $OUT gets each piece's JSON, log and (slq) the density and its PNG.
#
# ESTIMATES, NOT MEASUREMENTS. Scaled from the Llama-3.2-1B shape on 2 x H100, float32 (1.24 B
# parameters, 8 x 1024 tokens = 4096 tokens a rank: training step 0.765 s, Hessian walk 3.32 s,
# GGN walk 1.93 s a product, top-5 GGN lanczos 79 products) by parameters x tokens a rank
# (8.03 / 1.24 x 1024 / 4096 = 1.62; communication and the untied 0.53 B head ignored):
# training step ~1.2 s, Hessian product ~5.4 s, GGN product ~3.1 s (benchmarks/cost_model.py
# predicts 4.56 / 19.9 / 11.6 s at 4096 tokens a rank, a quarter of which agrees; each walk
# also all-gathers ~96-120 GB a GPU, well under a second on NVLink). Host basis
# (--basis-device cpu): a vector is 2.0 B numbers a rank (8.0 GB); streaming it costs about
# 0.44 s a step at ncv 20 for 0.1 B numbers on one H100 (NOTE [basis off the device] in
# algorithms/basis.py), so ~8.9 s a step at ncv 20 here, ~2.7 s at ncv 6, ~4.5 s at ncv 10,
# if the four GPUs stream from host memory at once as fast as one did (unmeasured).
# Start-up (torchrun, imports, NCCL, the meta build and the seeded fill of 2 B numbers a rank)
# ~1 minute a call.
#
# Memory (exact arithmetic): one Krylov vector is 32 GB over the node whatever the rank count.
# - SLQ with full reorthogonalization keeps 30 of them (960 GB): more than the node's 512 GiB,
#   so `slq` runs --slq-reorth none (two vectors a probe, on the GPU; no basis to move).
# - top (k 1, ncv 6): 7 rows = 224 GB pinned host memory; its checkpoint at a thick restart holds
#   3 rows (2 kept + 1): 96 GB on the 235 GiB disk (24 GB a rank; lanczos's default save point,
#   where the basis is smallest; a save elsewhere could hold 7 rows, 224 GB, which does not fit).
# - ggn (k 5, ncv 10): 11 rows = 352 GB pinned; a checkpoint at a restart holds 7-9 rows,
#   224-288 GB: more than the disk, and while it is written the host holds two more copies
#   (HostBasis.to_cpu), more than the node's memory. So `ggn` runs without a checkpoint and
#   must finish in one call: ~80-110 products x (3.1 + 4.5) s ~ 10-14 minutes, MORE than one
#   call allows on 4 GPUs. On nvidia-h100-x8 (NPROC=8; per rank half the tokens and half of
#   each vector) the estimate is ~80-110 x (1.6 + 2.3) s ~ 5-7 minutes: run it there.
#
# Pieces (estimates): time ~1.5 min; slq ~30 x 5.4 s + 1 min ~ 3.7 min; top: 40-80 products x
# (5.4 + 2.7) s plus ~15 s a save every ~4 products ~ 7-14 min, two calls; ggn: above. time +
# slq + top fit the 30 minutes of device time of one session with the machine's start; ggn
# needs a second session (x8).
set -u
. benchmarks/device/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NPROC=${NPROC:-4}
DEADLINE=${DEADLINE:-450}  # seconds after the script's start: a save and the exit follow
CK=/tmp/s21
mkdir -p $CK
df -h /tmp | tail -1 > $O/disk.txt
free -g | head -2 >> $O/disk.txt
cat $O/disk.txt
TR="torchrun --standalone --nproc_per_node=$NPROC benchmarks/bench_sharded.py --workload llama8b --out $O"
case "${1:-}" in
  time)
    set -o pipefail
    timeout 500 $TR --sections train,products --warmup 1 --repeats 3 2>&1 | grep -v Warning | tee $O/time.log | grep bench_sharded
    ;;
  slq)
    set -o pipefail
    timeout 560 $TR --sections slq --probes 1 --slq-steps 30 --slq-reorth none --basis-device cpu \
      --checkpoint-dir $CK/slq --deadline-s $DEADLINE 2>&1 | grep -v Warning | tee $O/slq.log | grep bench_sharded
    ;;
  top)
    set -o pipefail
    timeout 580 $TR --sections top_hessian --top-ncv 6 --tol 1e-4 --basis-device cpu \
      --checkpoint-dir $CK/top --deadline-s $DEADLINE 2>&1 | grep -v Warning | tee $O/top.log | grep bench_sharded
    ls -la $CK/top
    ;;
  ggn)
    set -o pipefail
    timeout 590 $TR --sections lanczos --ops ggn --k 5 --ncv 10 --tol 1e-4 --basis-device cpu \
      2>&1 | grep -v Warning | tee $O/ggn.log | grep bench_sharded
    ;;
  *)
    echo "usage: bash benchmarks/device/s21_x4.sh time|slq|top|ggn" >&2
    exit 2
    ;;
esac
