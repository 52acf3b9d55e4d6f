#!/usr/bin/env bash
# Session 19's device runs (16-core host of the lent GPU machine; dask/distributed carried as wheels in .whl,
# mpshuffle from src/, an earlier tree from .ab/base/src where a step compares): STEP is
#   fill        fill numba's cache once per source tree (every device call starts with an empty one)
#   timeline16  16 workers, 120 -> 120, 0.7 GB per worker: benchmarks/worker_timeline.py, config line, P2P, tasks
#   timeline2   2 workers, the 2.11 GB: worker_timeline.py, config line and mpshuffle's function
#   ab16        16 workers: the config line before (.ab/base), after (src/) and .ab/chunk4 (a variant) in turns, twice
#   ab2         2 workers, the 2.11 GB: config line and function, before and after in turns, twice
#   ratio16     16 workers, after only: the four methods in turns, 2 rounds (config_line_bench.py)
#   ratio2      2 workers, the 2.11 GB: the four methods in turns, 3 rounds, --first
#   tpch2       TPC-H lineitem SF 1 (16 parts), 2 workers: the four methods, 2 rounds, --first
#   tpch16      lineitem SF 1 at 16 workers, the four methods, 2 rounds
# Results go to $OUT (the run tool's output folder). Run from the repository root.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"
OUT=${OUT:-/tmp/out}
quiet() { grep -v "^distributed\|Warning\|warn\|^20[0-9][0-9]-" ; }
src() { case $1 in after) echo "$PWD/src:/tmp/site" ;; before) echo "$PWD/.ab/base/src:/tmp/site" ;; *) echo "$PWD/.ab/$1/src:/tmp/site" ;; esac; }
bench() {  # bench VERSION NAME ARGS...: config_line_bench.py with that version's source first on the path
  local v=$1 name=$2; shift 2
  PYTHONPATH=$(src "$v") timeout 500 python3 benchmarks/config_line_bench.py "$@" --out "$OUT/$name-$v.json" 2>&1 \
    | quiet | grep -E "^round|MB/s|x P2P|x tasks|peak|/" | sed "s/^/[$v] /" | tail -24
}
W16="--workers 16 --partitions 120 --rows 2121212 --memory-limit 6"
W2="--workers 2 --partitions 60 --rows 800000 --memory-limit 8"
for step in "$@"; do
  echo "=== $step $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  case $step in
    fill) for v in ${FILL:-after before chunk4}; do PYTHONPATH=$(src $v) python3 -c \
            "from mpshuffle.table.warm import warm_up; print('$v warm-up s', round(warm_up(), 2))"; done ;;
    timeline16) PYTHONPATH=$(src after) timeout 500 python3 benchmarks/worker_timeline.py $W16 --repeats 2 \
            --methods ${TL_METHODS:-config p2p tasks} --out "$OUT/worker_timeline-h100-16w-s19${TL_SUFFIX:-}.json" 2>&1 | quiet | tail -40 ;;
    timeline2) PYTHONPATH=$(src after) timeout 300 python3 benchmarks/worker_timeline.py $W2 --repeats 2 \
            --methods config function --out "$OUT/worker_timeline-h100-2w-s19.json" 2>&1 | quiet | tail -24 ;;
    ab16) for r in $(seq 1 ${AB_ROUNDS:-2}); do for v in ${AB_VARIANTS:-before after chunk4}; do
           bench $v config_line-h100-16w-s19-ab$r $W16 --repeats 2 --methods config; done; done ;;
    ab2) for r in 1 2; do for v in before after; do
           bench $v config_line-h100-2w-s19-ab$r $W2 --repeats 3 --methods config function; done; done ;;
    ratio16) bench after config_line-h100-16w-s19 $W16 --repeats 2 ;;
    ratio2) bench after config_line-h100-2w-s19 $W2 --repeats 3 --first ;;
    tpch2) bench after config_line-lineitem-h100-2w-s19 --data lineitem --sf 1 --parts 16 --workers 2 \
             --memory-limit 8 --repeats 2 --first ;;
    tpch16) bench after config_line-lineitem-h100-16w-s19 --data lineitem --sf 1 --parts 16 --workers 16 \
             --memory-limit 6 --repeats 2 ;;
  esac
done
