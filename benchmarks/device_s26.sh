#!/usr/bin/env bash
# Session 26's device runs (lent from ~22:10 of that session; lineitem at 16 workers was not reached): the 16-core
# host of the GPU machine; dask/distributed and the packages its image lacks carried as wheels in .whl; mpshuffle from
# src/. STEP is
#   fill     fill numba's cache once (every device call starts with an empty one)
#   rech16ab issue 26 at 16 workers x 1 thread, time-to-space of float32 (1600, 1000, 1000) (6.4 GB): session 25's
#            code (old26/src: git archive 79774ac src) against today's (chunks in flight, two ranges per
#            destination, partitions even over the workers), mpshuffle and P2P alternated, 2 rounds each
#   cfg16    issue 23: the config line at 16 workers x 1 thread, 0.7 GB per worker, 120 -> 120, all four methods
#   cfg2     the same at 2 workers (the per-worker figure at 16 is compared with it)
#   gpu      the GPU tests and the engine's ndarray/memory tests -> $OUT/gpu_tests.txt
# Results go to $OUT (the run tool's output folder). Run from the repository root.
set -u
source benchmarks/device_env.sh
for step in "$@"; do
  echo "=== $step $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  case $step in
    fill) python3 -c "from mpshuffle.table.warm import warm_up; print('warm-up s', round(warm_up(), 2))" ;;
    rech16ab) for v in before after; do
                pp="$PWD/src:/tmp/site"; [ $v = before ] && pp="$PWD/old26/src:/tmp/site"
                PYTHONPATH="$pp" timeout -k 10 200 python3 benchmarks/rechunk_bench.py --cases time-to-space --t 1600 \
                  --workers 16 --repeat 2 --methods mpshuffle,p2p --name rechunk-h100-16w-s26-$v --out "$OUT" 2>&1 \
                  | quiet | grep -E "round" | sed "s/^/$v /"
              done ;;
    cfg16) timeout -k 10 400 python3 benchmarks/config_line_bench.py --workers 16 --partitions 120 --rows $(( 700000000 * 16 / 44 / 120 )) \
             --memory-limit 6 --repeats 2 --out "$OUT/config_line-h100-16w-s26.json" 2>&1 | quiet | tail -12 ;;
    cfg2) timeout -k 10 300 python3 benchmarks/config_line_bench.py --workers 2 --partitions 120 --rows $(( 700000000 * 2 / 44 / 120 )) \
            --memory-limit 6 --repeats 2 --out "$OUT/config_line-h100-2w-s26.json" 2>&1 | quiet | tail -12 ;;
    gpu) (set -o pipefail; timeout -k 10 300 python3 -m pytest -p no:cacheprovider -o timeout=300 -q -rs \
            tests/gpu tests/engine/test_device_*.py tests/engine/test_ndarray_adapter.py tests/engine/test_memory.py 2>&1 \
            | tee "$OUT/gpu_tests.txt" | tail -25) ;;
  esac
done
