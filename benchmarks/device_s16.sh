#!/usr/bin/env bash
# Session 16's device run (16-core host of the lent GPU machine; dask/distributed carried as wheels
# in .whl, mpshuffle from src/): STEP is one of
#   config16  the config line at 16 workers, 120 -> 120, 0.7 GB per worker, a fresh cluster's first
#             shuffle per method (--first) with the client preload, then 2 rounds in turns
#   first16   benchmarks/first_shuffle_tasks.py at 16 workers: twice as a user's first shuffle, then
#             with --preload (bootstrap and kernels loaded first), task stream per prefix
#   parts10k  10,000 -> 10,000 partitions of 10,000 rows at 16 workers, mpshuffle and floor-fused:
#             time and the cluster's peak after the piece-layout change
# Results go to $OUT (the run tool's output folder). Run from the repository root.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
for step in "$@"; do
  echo "=== $step $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  case $step in
    config16) timeout 560 python3 benchmarks/config_line_bench.py --workers 16 --partitions 120 \
                --rows 2121212 --memory-limit 6 --repeats 2 --first --pregrow-gib 60 \
                --out "$OUT/config_line-h200-16w-s16.json" 2>&1 | grep -v "^distributed\|Warning\|warn" | tail -40 ;;
    first16) for tag in a b; do timeout 200 python3 benchmarks/first_shuffle_tasks.py --workers 16 \
                --json "$OUT/first_tasks-h200-16w-s16-$tag.json" 2>&1 | grep -v "^distributed\|Warning\|warn" | tail -30; done
              timeout 200 python3 benchmarks/first_shuffle_tasks.py --workers 16 --preload \
                --json "$OUT/first_tasks-h200-16w-s16-preload.json" 2>&1 | grep -v "^distributed\|Warning\|warn" | tail -30 ;;
    parts10k) timeout 560 python3 benchmarks/partitions_bench.py --workers 16 --rows 10000 --memory-limit 7GiB \
                --sizes 10000 --methods mpshuffle floor-fused --max-seconds 200 \
                --out "$OUT/partitions-h200-16w-10k-s16.json" 2>&1 | grep -v "^distributed\|Warning\|warn" | tail -40 ;;
  esac
done
