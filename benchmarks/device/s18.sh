#!/bin/bash
# Issue 27 on one GPU, session 18: where auto's short runs lose (per-product times and the host
# work of a switch, benchmarks/auto_overhead.py), and first/second runs of auto against the best
# fixed engine (bench_defaults), this tree against the session's starting tree.
# Usage: bash benchmarks/device/s18.sh STAGE ARGS...   (carry .whl; for ab, .bench_trees/s18)
set -u
source benchmarks/device/setup.sh
stage=$1; shift
case "$stage" in
  overhead)
    # WORKLOAD:CURVS:LENGTHS ...; TREES="after before" runs it on this tree and on
    # .bench_trees/$BEFORE (which needs benchmarks/auto_overhead.py copied in), alternated
    for r in $(seq 1 ${ROUNDS:-1}); do
    for tree in ${TREES:-after}; do
    dir=$ROOT; [ $tree = before ] && dir=$ROOT/.bench_trees/${BEFORE:-s18}
    for spec in "$@"; do
      IFS=: read w c n <<< "$spec"
      f=$O/overhead_${w}_${tree}_r$r
      (cd $dir && timeout ${T:-200} python3 -m benchmarks.auto_overhead $w --curvatures $c --lengths $n ${PROFILE:+--profile} --record-dir /tmp/ao_${w}_$tree > $f.jsonl 2> $f.err)
      echo "$w $tree r$r rc=$?"; tail -2 $f.err
      python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r['cell']!='env' and 'per_ms' in r:
        print(r['curvature'], r['engine'], r['length'], round(r['s']*1e3,1), r['active'], 'per', r['per_ms'][:6], 'med', sorted(r['per_ms'])[len(r['per_ms'])//2])
        print('    ', {k:(len(v), round(sum(v),2)) for k,v in r['spent_ms'].items()})
" $f.jsonl
    done
    done
    done
    (cd $O && tar czf overhead_${TAG:-call}.tgz overhead_*.jsonl overhead_*.err && rm -f overhead_*.jsonl overhead_*.err)
    ;;
  fresh)
    # WORKLOAD CURVS LENGTH: benchmarks/auto_fresh.py on this tree and on .bench_trees/$BEFORE
    # (which needs benchmarks/auto_fresh.py copied in), alternated, ROUNDS rounds
    for r in $(seq 1 ${ROUNDS:-1}); do
      for tree in ${TREES:-after before}; do
        dir=$ROOT; [ $tree = before ] && dir=$ROOT/.bench_trees/${BEFORE:-s18}
        f=$O/fresh_$1_${tree}_r$r.jsonl
        (cd $dir && timeout ${T:-280} python3 -m benchmarks.auto_fresh $1 --curvatures $2 --length $3 --record-dir /tmp/fresh_$tree > $f 2> ${f%.jsonl}.err)
        echo "$tree r$r rc=$?"
        python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); rep=r.get('report') or {}; a=rep.get('auto') or {}
    print('$tree', r['curvature'], r['engine'], r['run'], r.get('loop_s'), r.get('process_wall_s'), rep.get('active'), a.get('reason','')[:50], r.get('error'))
" $f
      done
    done
    ;;
  ab)
    # WORKLOAD LENGTHS LANCZOS_LENGTHS ENGINES CURVS: cold then rerun, this tree (after) and
    # .bench_trees/$BEFORE (before), alternated, ROUNDS rounds
    for r in $(seq 1 ${ROUNDS:-1}); do
      for tree in after before; do
        dir=$ROOT; [ $tree = before ] && dir=$ROOT/.bench_trees/${BEFORE:-s18}
        rm -rf /tmp/rec_$1_$tree
        for st in cold rerun; do
          (cd $dir && timeout ${T:-200} python3 -m benchmarks.bench_defaults $1 --record $st --record-dir /tmp/rec_$1_$tree --lengths $2 --lanczos-lengths $3 --engines $4 --curvatures $5 > $O/ab_$1_${tree}_${st}_r$r.jsonl 2> $O/ab_$1_${tree}_${st}_r$r.err)
          grep default_vs_best $O/ab_$1_${tree}_${st}_r$r.jsonl | python3 -c "import sys,json;print('$tree $st r$r', ' '.join(r['cell'].split('_')[0]+':'+r['mode'][:3]+str(r['length'])+'='+str(round(r['ratio'],2))+('' if r['best']=='autograd' else '('+r['best'][:2]+')') for r in map(json.loads, sys.stdin)))"
        done
      done
    done
    # one file back (the device returns a few files a call)
    (cd $O && tar czf ab_$1_${TAG:-call}.tgz ab_$1_*.jsonl ab_$1_*.err gpus.txt && rm -f ab_$1_*.jsonl ab_$1_*.err)
    ;;
esac
