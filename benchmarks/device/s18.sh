#!/bin/bash
# Issue 27 on one GPU, session 18: where auto's short runs lose (per-product times and the host
# work of a switch, benchmarks/auto_overhead.py), a script run again from fresh processes
# (benchmarks/auto_fresh.py), and first/second runs of auto against the best fixed engine
# (bench_defaults through s17.sh), this tree against the session's starting tree.
# Usage: bash benchmarks/device/s18.sh overhead|fresh|ab ARGS...   (carry .whl and
# .bench_trees/s18, with benchmarks/auto_overhead.py and auto_fresh.py copied into it)
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
    # WORKLOAD LENGTHS LANCZOS_LENGTHS ENGINES CURVS: s17.sh's first and second runs against
    # .bench_trees/$BEFORE (default s18: 346feb8), one file back
    BEFORE=${BEFORE:-s18} bash benchmarks/device/s17.sh ab "$@"
    # one file back (the device returns a few files a call)
    (cd $O && tar czf ab_$1_${TAG:-call}.tgz ab_$1_*.jsonl ab_$1_*.err gpus.txt && rm -f ab_$1_*.jsonl ab_$1_*.err)
    ;;
esac
