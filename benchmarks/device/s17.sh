#!/bin/bash
# Issue 27 on one GPU, session 17: the fused kernel's variants (the sweeps reload, persistent and
# regs ran at commit 782e41e, whose kernel had those options; later trees keep none and full),
# traces on the GPU host (this tree against session 16's starting tree), a fresh process's first
# traced product, hardware counters of the kernel.
# Usage: bash benchmarks/device/s17.sh STAGE ARGS...   (for trace and reuse, carry the tree to
# compare with: .bench_trees/s15 (b53ad4b) or, with BEFORE=s17, .bench_trees/s17 (2e4afb3); and
# .whl, the deprecation wheel)
set -u
source benchmarks/device/setup.sh
stage=$1; shift
case "$stage" in
  kernels)
    # SWEEP SHAPES (comma-separated labels of bench_kernels)
    timeout ${T:-300} python3 benchmarks/bench_kernels.py --out $O/kernels --sweep ${1:-none} --shapes "${2:-B64 T256 V50304 bf16,B64 T256 V50304 fp32,B8 T1024 V128256 bf16}" --products-only --budget-s ${B:-240} > $O/kernels.log 2>&1
    grep -E "triton|floor" $O/kernels.log | cut -c1-200
    ;;
  trace)
    # WORKLOADS: bench_trace on this tree and on the starting tree, alternated, ROUNDS rounds
    for r in $(seq 1 ${ROUNDS:-1}); do
      for tree in after before; do
        dir=$ROOT; [ $tree = before ] && dir=$ROOT/.bench_trees/${BEFORE:-s15}
        (cd $dir && timeout ${T:-200} python3 -m benchmarks.bench_trace --workloads ${1:-gpt2_12l,resnet18,mlp} --repeats 2 > $O/trace_${tree}_r$r.jsonl 2> $O/trace_${tree}_r$r.err)
        echo "$tree r$r rc=$?"; cut -c1-300 $O/trace_${tree}_r$r.jsonl
      done
    done
    ;;
  reuse)
    # WORKLOAD ENGINES: first and second process, this tree then the starting tree
    for tree in after before; do
      dir=$ROOT; [ $tree = before ] && dir=$ROOT/.bench_trees/${BEFORE:-s15}
      (cd $dir && timeout ${T:-200} python3 -m benchmarks.bench_trace_reuse ${1:-gpt2_large} --engines ${2:-functional} --processes ${P:-2} --record-dir /tmp/reuse_$tree > $O/reuse_$tree.jsonl 2> $O/reuse_$tree.err)
      echo "$tree rc=$?"
      python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); rep=r.get('report',{})
    print('$tree', r['workload'], r['curvature'], r['engine'], r['process'], r.get('first_s'), r.get('second_ms'), r.get('autograd_ms'), rep.get('trace_s'), r.get('error'))
" $O/reuse_$tree.jsonl
    done
    ;;
  ab)
    # WORKLOAD LENGTHS LANCZOS_LENGTHS ENGINES CURVS: a first run (cold) and the same script again
    # (rerun), this tree (after) and .bench_trees/$BEFORE (before), alternated, ROUNDS rounds
    for r in $(seq 1 ${ROUNDS:-1}); do
      for tree in after before; do
        dir=$ROOT; [ $tree = before ] && dir=$ROOT/.bench_trees/${BEFORE:-s17}
        rm -rf /tmp/rec_$1_$tree
        for st in cold rerun; do
          (cd $dir && timeout ${T:-200} python3 -m benchmarks.bench_defaults $1 --record $st --record-dir /tmp/rec_$1_$tree --lengths $2 --lanczos-lengths $3 --engines $4 --curvatures $5 > $O/ab_$1_${tree}_${st}_r$r.jsonl 2> $O/ab_$1_${tree}_${st}_r$r.err)
          grep default_vs_best $O/ab_$1_${tree}_${st}_r$r.jsonl | python3 -c "import sys,json;print('$tree $st r$r', ' '.join(r['cell'].split('_')[0]+':'+r['mode'][:3]+str(r['length'])+'='+str(round(r['ratio'],2))+('' if r['best']=='autograd' else '('+r['best'][:2]+')') for r in map(json.loads, sys.stdin)))"
        done
      done
    done
    ;;
  final)
    # this tree alone: WORKLOAD:PROCESSES ... through bench_trace_reuse (functional engine)
    for wp in "$@"; do
      w=${wp%%:*}; n=${wp##*:}
      timeout ${T:-200} python3 -m benchmarks.bench_trace_reuse $w --engines functional --processes $n --record-dir /tmp/final_$w > $O/final_$w.jsonl 2> $O/final_$w.err
      python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); rep=r.get('report',{})
    print(r['workload'], r['curvature'], r['process'], r.get('first_s'), r.get('second_ms'), r.get('autograd_ms'), rep.get('trace_s'), r.get('rel_err_vs_autograd'), r.get('error'))
" $O/final_$w.jsonl
    done
    ;;
  ncu)
    # the fused kernel's hardware counters (default configuration, bf16 and fp32 at V50304)
    for dt in bf16 fp32; do
      timeout ${T:-150} ncu --clock-control none --set full -k regex:_ce_hvp -s 1 -c 1 python3 -m benchmarks.ce_kernel_ncu --dtype $dt > $O/ncu_$dt.txt 2>&1
      echo "ncu $dt rc=$?"
      grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|L2 Hit|L1/TEX Hit|Issued Ipc|Executed Ipc|One or More|No Eligible|Active Warps" $O/ncu_$dt.txt | head -40
    done
    ;;
esac
