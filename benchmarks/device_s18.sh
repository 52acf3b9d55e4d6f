#!/usr/bin/env bash
# Session 18's device run (16-core host of the lent GPU machine; dask/distributed carried as wheels in
# .whl, mpshuffle from src/, the code before this session's page changes from .ab/base/src): STEP is
#   fill      fill numba's cache once per source tree (every device call starts with an empty one)
#   ab2       the 2.11 GB (60 -> 60, 800,000 rows) through the config line and mpshuffle's
#             function, 2 workers x 1 thread, 3 runs each, before (.ab/base) and after (src/) in turns, twice
#   ratio2    the same data, after only: the config line, P2P and tasks in turns, 2 rounds
#   ab16      16 workers, 120 -> 120, 0.7 GB per worker: the config line before and after in turns, twice
#   ratio16   16 workers, after only: the four methods in turns, 2 rounds
#   tpch2     TPC-H lineitem SF 1 (16 parts) through the config line, 2 workers, after only, with P2P and tasks
#   tpch2first  the same with a fresh cluster's first and second shuffle per method first (--first)
#   tpch16    lineitem SF 1 at 16 workers, the four methods in turns, 2 rounds
#   parts16   10,000 -> 10,000 partitions of 20,000 rows (3.2 GB) at 16 workers: mpshuffle and Dask's floor (fused)
# Results go to $OUT (the run tool's output folder). Run from the repository root.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"
OUT=${OUT:-/tmp/out}
quiet() { grep -v "^distributed\|Warning\|warn\|^20[0-9][0-9]-" ; }
src() { if [ "$1" = before ]; then echo "$PWD/.ab/base/src:/tmp/site"; else echo "$PWD/src:/tmp/site"; fi; }
bench() {  # bench VERSION NAME ARGS...: config_line_bench.py with that version's source first on the path
  local v=$1 name=$2; shift 2
  PYTHONPATH=$(src "$v") timeout 400 python3 benchmarks/config_line_bench.py "$@" --out "$OUT/$name-$v.json" 2>&1 \
    | quiet | grep -E "^round|MB/s|x P2P|x tasks|peak" | sed "s/^/[$v] /" | tail -14
}
for step in "$@"; do
  echo "=== $step $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  case $step in
    fill) for v in before after; do PYTHONPATH=$(src $v) python3 -c \
            "from mpshuffle.table.warm import warm_up; print('$v warm-up s', round(warm_up(), 2))"; done ;;
    ab2) for r in 1 2; do for v in before after; do
           bench $v config_line-h100-2w-s18-ab$r --workers 2 --partitions 60 --rows 800000 --memory-limit 8 \
             --repeats 3 --methods config function; done; done ;;
    ratio2) bench after config_line-h100-2w-s18 --workers 2 --partitions 60 --rows 800000 --memory-limit 8 \
             --repeats 2 --methods config p2p tasks ;;
    ab16) for r in 1 2; do for v in before after; do
           bench $v config_line-h100-16w-s18-ab$r --workers 16 --partitions 120 --rows 2121212 --memory-limit 6 \
             --repeats 2 --methods config; done; done ;;
    ratio16) bench after config_line-h100-16w-s18 --workers 16 --partitions 120 --rows 2121212 --memory-limit 6 \
             --repeats 2 ;;
    tpch2) bench after config_line-lineitem-h100-2w-s18 --data lineitem --sf 1 --parts 16 --workers 2 \
             --memory-limit 8 --repeats 2 ;;
    tpch2first) bench after config_line-lineitem-h100-2w-s18-first --data lineitem --sf 1 --parts 16 --workers 2 \
             --memory-limit 8 --repeats 1 --first ;;
    tpch16) bench after config_line-lineitem-h100-16w-s18 --data lineitem --sf 1 --parts 16 --workers 16 \
             --memory-limit 6 --repeats 2 ;;
    parts16) PYTHONPATH=$(src after) timeout 480 python3 benchmarks/partitions_bench.py --workers 16 --rows 20000 \
             --sizes 10000 --methods mpshuffle floor-fused --out "$OUT/partitions-h100-16w-s18.json" 2>&1 | quiet | tail -12 ;;
  esac
done
