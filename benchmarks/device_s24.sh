#!/usr/bin/env bash
# Session 24's device runs (16-core host of the lent GPU machine; dask/distributed and the packages its image lacks
# carried as wheels in .whl; mpshuffle from src/). STEP is
#   fill     fill numba's cache once (every device call starts with an empty one)
#   gpu      the GPU tests: tests/gpu, the device-run engine tests, test_warm.py, test_pool.py, and the engine's
#            table, store and memory tests (this session changed the pandas index path) -> $OUT/gpu_tests.txt
#   rech2    issue 26 on a host whose cores outnumber the workers' threads: time-to-space and its reverse,
#            float32 (400, 1000, 1000), 2 workers x 1 thread, mpshuffle / P2P / tasks alternated, 3 rounds
#   rech16   the same at 16 workers x 1 thread and (1600, 1000, 1000) (6.4 GB), time-to-space, 2 rounds
#   rech16ab the same, the code before this session's rechunk changes (old24/src: git archive 5d5717b src) against
#            today's, mpshuffle and P2P, 2 rounds each
#   partsize the 16-worker case with output partitions of PARTSIZES MiB (default "64 160"; 64 is the default), mpshuffle and P2P
#   ratio16  issue 23: 16 workers x 1 thread, 120 -> 120, 0.7 GB per worker, config line / function / P2P / tasks
# Results go to $OUT (the run tool's output folder). Run from the repository root.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH" PYTHONPATH="$PWD/src:/tmp/site" NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
quiet() { grep -v "^distributed\|Warning\|warn\|^20[0-9][0-9]-" ; }
for step in "$@"; do
  echo "=== $step $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  case $step in
    fill) python3 -c "from mpshuffle.table.warm import warm_up; print('warm-up s', round(warm_up(), 2))" ;;
    gpu) (set -o pipefail; timeout -k 10 300 python3 -m pytest -p no:cacheprovider -o timeout=300 -q -rs \
            tests/gpu tests/engine/test_device_*.py tests/engine/test_warm.py tests/engine/test_pool.py \
            tests/engine/test_table.py tests/engine/test_store.py tests/engine/test_memory.py 2>&1 \
            | tee "$OUT/gpu_tests.txt" | tail -25) ;;
    rech2) timeout -k 10 300 python3 benchmarks/rechunk_bench.py --cases time-to-space,space-to-time --repeat 3 \
             --name rechunk-h100-2w-s24 --out "$OUT" 2>&1 | quiet | grep -E "round|^\{" ;;
    rech16) timeout -k 10 400 python3 benchmarks/rechunk_bench.py --cases time-to-space --t 1600 --workers 16 \
              --repeat 2 --name rechunk-h100-16w-s24 --out "$OUT" 2>&1 | quiet | grep -E "round|^\{" ;;
    rech16ab) for v in before after; do
                pp="$PWD/src:/tmp/site"; [ $v = before ] && pp="$PWD/old24/src:/tmp/site"
                PYTHONPATH="$pp" timeout -k 10 200 python3 benchmarks/rechunk_bench.py --cases time-to-space --t 1600 \
                  --workers 16 --repeat 2 --methods mpshuffle,p2p --name rechunk-h100-16w-s24-$v --out "$OUT" 2>&1 \
                  | quiet | grep -E "round" | sed "s/^/$v /"
              done ;;
    partsize) for mib in ${PARTSIZES:-64 160}; do
                timeout -k 10 200 python3 benchmarks/rechunk_partition_bytes.py $mib --cases time-to-space --t 1600 \
                  --workers 16 --repeat 2 --methods mpshuffle,p2p --name rechunk-h100-16w-s24-part$mib --out "$OUT" 2>&1 \
                  | quiet | grep -E "round" | sed "s/^/$mib MiB /"
              done ;;
    ratio16) timeout -k 10 230 python3 benchmarks/config_line_bench.py --workers 16 --partitions 120 --rows 2121212 \
               --memory-limit 6 --repeats 2 --out "$OUT/config_line-h100-16w-s24.json" 2>&1 \
               | quiet | grep -E "^round|MB/s|x P2P|x tasks|peak|/" | tail -24 ;;
  esac
done
