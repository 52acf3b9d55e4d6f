#!/usr/bin/env bash
# Session 17's device run (16-core host of the lent GPU machine; dask/distributed carried as wheels
# in .whl, mpshuffle from src/): STEP is one of
#   cold16    benchmarks/first_shuffle_tasks.py at 16 workers on the machine's empty numba cache
#             (as every device call starts): the first shuffle's task stream against the second's
#   fill      fill numba's cache once in one process (warm_up: every insert and extract kernel)
#   warm16    first_shuffle_tasks.py at 16 workers again, numba's cache filled (as a user's machine
#             after its first run), then bootstrap_phases.py --no-wait (bootstrap while the kernels load)
#   ab16      the config line alone at 16 workers, 3 runs each: as config_line_bench runs it (gc.collect
#             and malloc_trim after each run, the workers' RSS sampled every 20 ms), without the trim,
#             and without the sampling: which of them doubles the CPU per GB against first_shuffle_tasks
#   config16  the config line at 16 workers, 120 -> 120, 0.7 GB per worker, 2 rounds of the four
#             methods in turns
#   first16   a fresh cluster's first and second shuffle at 16 workers (config line, function)
#   tpch2     TPC-H lineitem at SF 1 (16 parquet parts, 16 -> 16) through the config line, 2 workers: a
#             fresh cluster's first shuffle per method, then 2 rounds of the four methods in turns
#   tpch16    the same at 16 workers, 2 rounds of the four methods (tpchgen-cli carried as a wheel)
#   config2   the same at 2 workers (the per-worker figure that 16 workers are held against)
# Results go to $OUT (the run tool's output folder). Run from the repository root.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"
OUT=${OUT:-/tmp/out}
quiet() { grep -v "^distributed\|Warning\|warn\|^20[0-9][0-9]-" ; }
for step in "$@"; do
  echo "=== $step $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  case $step in
    cold16) timeout 200 python3 benchmarks/first_shuffle_tasks.py --workers 16 \
              --json "$OUT/first_tasks-16w-s17-cold.json" 2>&1 | quiet | tail -30 ;;
    fill) python3 -c "from mpshuffle.table.warm import warm_up; print('warm-up (compiling) s', round(warm_up(), 2))"
          python3 -c "from mpshuffle.table.warm import warm_up; print('warm-up (from cache) s', round(warm_up(), 2))" ;;
    warm16) timeout 200 python3 benchmarks/first_shuffle_tasks.py --workers 16 \
              --json "$OUT/first_tasks-16w-s17-warm.json" 2>&1 | quiet | tail -30
            timeout 200 python3 benchmarks/bootstrap_phases.py --workers 16 --no-wait \
              --json "$OUT/bootstrap_phases-16w-s17.json" 2>&1 | quiet | tail -45 ;;
    ab16) for v in default --no-trim "--sample 0"; do echo "--- $v"; timeout 200 python3 benchmarks/config_line_bench.py \
                --workers 16 --partitions 120 --rows 2121212 --memory-limit 6 --repeats 3 --methods config \
                $( [ "$v" = default ] || echo $v ) --out "$OUT/config_line-16w-s17-ab-${v//[ -]/}.json" 2>&1 | quiet | tail -8; done ;;
    config16) timeout 300 python3 benchmarks/config_line_bench.py --workers 16 --partitions 120 \
                --rows 2121212 --memory-limit 6 --repeats 2 \
                --out "$OUT/config_line-h200-16w-s17.json" 2>&1 | quiet | tail -16 ;;
    first16) timeout 300 python3 benchmarks/config_line_bench.py --workers 16 --partitions 120 \
                --rows 2121212 --memory-limit 6 --repeats 1 --first --methods config function \
                --out "$OUT/config_line-h200-16w-first-s17.json" 2>&1 | quiet | tail -4 ;;
    tpch2) timeout 300 python3 benchmarks/config_line_bench.py --data lineitem --sf 1 --parts 16 --workers 2 \
                --memory-limit 8 --repeats 2 --first --out "$OUT/config_line-lineitem-h100-2w-s17.json" 2>&1 | quiet | tail -14 ;;
    tpch16) timeout 200 python3 benchmarks/config_line_bench.py --data lineitem --sf 1 --parts 16 --workers 16 \
                --memory-limit 6 --repeats 2 --out "$OUT/config_line-lineitem-h100-16w-s17.json" 2>&1 | quiet | tail -10 ;;
    config2) timeout 400 python3 benchmarks/config_line_bench.py --workers 2 --partitions 120 \
                --rows 265151 --memory-limit 6 --repeats 3 --first \
                --out "$OUT/config_line-h200-2w-s17.json" 2>&1 | quiet | tail -40 ;;
  esac
done
