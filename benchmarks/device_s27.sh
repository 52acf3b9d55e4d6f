#!/usr/bin/env bash
# Session 27's device runs: the 16-core host of the lent GPU machine; dask/distributed, tpchgen-cli and the packages
# its image lacks carried as wheels in .whl; mpshuffle from src/. STEP is
#   fill   fill numba's cache once (every device call starts with an empty one)
#   li16   issue 23's real data: TPC-H lineitem SF 1 (16 parquet parts) at 16 workers x 1 thread through the config
#          line, a fresh cluster's first and second shuffle per method, then 3 rounds of the four methods in turns
#   li16d  the same files as dask.dataframe.read_parquet gives them (decimals, date32[pyarrow]), fresh clusters first
#   cfg16r the config line at 16 workers again, 2 rounds, no fresh clusters (a second run of the marks)
#   cfg16  the config line at 16 workers x 1 thread, 0.7 GB per worker, 120 -> 120, fresh clusters first, 2 rounds
#   cfg8   the same at 8 workers, 1 round, no fresh clusters
#   cfg2   the same at 2 workers, 2 rounds
#   tl16   where the 16 workers' wall time goes (worker_timeline.py), the config line, P2P and tasks, 1 round
#   gpu    the GPU tests and the engine's ndarray/memory tests -> $OUT/gpu_tests.txt
# Results go to $OUT (the run tool's output folder). Run from the repository root.
set -u
source benchmarks/device_env.sh
ROWS16=$(( 700000000 * 16 / 44 / 120 ))
for step in "$@"; do
  echo "=== $step $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  case $step in
    fill) python3 -c "from mpshuffle.table.warm import warm_up; print('warm-up s', round(warm_up(), 2))" ;;
    li16) timeout -k 10 300 python3 benchmarks/config_line_bench.py --data lineitem --sf 1 --parts 16 --workers 16 \
            --memory-limit 6 --repeats 3 --first --out "$OUT/config_line-lineitem-h100-16w-s27.json" 2>&1 | quiet | tail -24 ;;
    li16d) timeout -k 10 200 python3 benchmarks/config_line_bench.py --data lineitem-dask --sf 1 --parts 16 --workers 16 \
             --memory-limit 6 --repeats 2 --first --out "$OUT/config_line-lineitem-dask-h100-16w-first-s27.json" 2>&1 \
             | quiet | tail -18 ;;
    cfg16r) timeout -k 10 200 python3 benchmarks/config_line_bench.py --workers 16 --partitions 120 --rows $ROWS16 \
             --memory-limit 6 --repeats 2 --out "$OUT/config_line-h100-16w-s27-r2.json" 2>&1 | quiet | tail -12 ;;
    cfg16) timeout -k 10 560 python3 benchmarks/config_line_bench.py --workers 16 --partitions 120 --rows $ROWS16 \
             --memory-limit 6 --repeats 2 --first --out "$OUT/config_line-h100-16w-s27.json" 2>&1 | quiet | tail -24 ;;
    cfg8) timeout -k 10 300 python3 benchmarks/config_line_bench.py --workers 8 --partitions 120 --rows $(( ROWS16 / 2 )) \
            --memory-limit 12 --repeats 1 --out "$OUT/config_line-h100-8w-s27.json" 2>&1 | quiet | tail -14 ;;
    cfg2) timeout -k 10 300 python3 benchmarks/config_line_bench.py --workers 2 --partitions 120 --rows $(( ROWS16 / 8 )) \
            --memory-limit 12 --repeats 2 --out "$OUT/config_line-h100-2w-s27.json" 2>&1 | quiet | tail -14 ;;
    tl16) timeout -k 10 300 python3 benchmarks/worker_timeline.py --workers 16 --partitions 120 --rows $ROWS16 \
            --memory-limit 6 --repeats 1 --methods config p2p tasks --out "$OUT/worker_timeline-h100-16w-s27.json" 2>&1 \
            | quiet | tail -40 ;;
    gpu) (set -o pipefail; timeout -k 10 300 python3 -m pytest -p no:cacheprovider -o timeout=300 -q -rs \
            tests/gpu tests/engine/test_device_*.py tests/engine/test_ndarray_adapter.py tests/engine/test_memory.py 2>&1 \
            | tee "$OUT/gpu_tests.txt" | tail -25) ;;
  esac
done
