#!/usr/bin/env bash
# Session 22's device runs (16-core host of the lent GPU machine; dask/distributed carried as wheels in .whl,
# pytest and its plugins in .whlt where the image has none; mpshuffle from src/). STEP is
#   fill      fill numba's cache once (every device call starts with an empty one)
#   gpu       the GPU tests: tests/gpu, the device-run engine tests, test_warm.py, test_pool.py -> $OUT/gpu_tests.txt
#   ratio16   16 workers x 1 thread, 120 -> 120, 0.7 GB per worker: config line, function, P2P, tasks in turns, 2 rounds
#   ratio8    8 workers, same per worker: the four methods, 1 round
#   ratio2    2 workers, the 2.11 GB: the four methods in turns, 2 rounds, --first
#   tpch16    TPC-H lineitem SF 1 (16 parts), 16 workers: the four methods, 2 rounds
#   parts16   issue 24: 10,000 -> 10,000 partitions of 20,000 rows (3.2 GB), 16 workers: mpshuffle, then P2P
#             (partitions_bench.py; P2P under its own time limit, PARTS_P2P_S seconds)
# Results go to $OUT (the run tool's output folder). Run from the repository root.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site .whlt/*.whl || exit 1
export PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH" PYTHONPATH="$PWD/src:/tmp/site" NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
quiet() { grep -v "^distributed\|Warning\|warn\|^20[0-9][0-9]-" ; }
bench() {  # bench NAME SECONDS ARGS...: config_line_bench.py
  local name=$1 limit=$2; shift 2
  timeout -k 10 "$limit" python3 benchmarks/config_line_bench.py "$@" --out "$OUT/$name.json" 2>&1 \
    | quiet | grep -E "^round|MB/s|x P2P|x tasks|peak|/" | tail -24
}
W16="--workers 16 --partitions 120 --rows 2121212 --memory-limit 6"
for step in "$@"; do
  echo "=== $step $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  case $step in
    fill) python3 -c "from mpshuffle.table.warm import warm_up; print('warm-up s', round(warm_up(), 2))" ;;
    gpu) (set -o pipefail; timeout -k 10 200 python3 -m pytest -p no:cacheprovider -o timeout=200 -q -rs \
            tests/gpu tests/engine/test_device_*.py tests/engine/test_warm.py tests/engine/test_pool.py 2>&1 \
            | tee "$OUT/gpu_tests.txt" | tail -15) ;;
    ratio16) bench config_line-h100-16w-s22 230 $W16 --repeats 2 ;;
    ratio8) bench config_line-h100-8w-s22 120 --workers 8 --partitions 120 --rows 1060606 --memory-limit 12 --repeats 1 ;;
    ratio2) bench config_line-h100-2w-s22 200 --workers 2 --partitions 60 --rows 800000 --memory-limit 8 --repeats 2 --first ;;
    tpch16) bench config_line-lineitem-h100-16w-s22 150 --data lineitem --sf 1 --parts 16 --workers 16 \
              --memory-limit 6 --repeats 2 ;;
    parts16) for m in mpshuffle p2p; do
               lim=180; [ "$m" = p2p ] && lim=${PARTS_P2P_S:-300}
               timeout -k 10 "$lim" python3 benchmarks/partitions_bench.py --workers 16 --memory-limit 6GiB --sizes 10000 \
                 --rows 20000 --methods "$m" --out "$OUT/partitions-h100-16w-10000-s22-$m.json" 2>&1 \
                 | quiet | grep '^{"method' ; echo "$m rc=$?"
             done ;;
  esac
done
