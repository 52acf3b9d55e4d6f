#!/usr/bin/env bash
# Session 23's device run (the lent GPU machine; dask/distributed and the packages its image lacks carried as
# wheels in .whl; mpshuffle from src/). STEP is
#   fill  fill numba's cache once (every device call starts with an empty one)
#   gpu   the GPU tests: tests/gpu, the device-run engine tests, test_warm.py, test_pool.py, and the engine's
#         table and store tests (this session changed the pandas index path and the spill read) -> $OUT/gpu_tests.txt
# Results go to $OUT (the run tool's output folder). Run from the repository root.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH" PYTHONPATH="$PWD/src:/tmp/site" NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
for step in "$@"; do
  echo "=== $step $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  case $step in
    fill) python3 -c "from mpshuffle.table.warm import warm_up; print('warm-up s', round(warm_up(), 2))" ;;
    gpu) (set -o pipefail; timeout -k 10 400 python3 -m pytest -p no:cacheprovider -o timeout=300 -q -rs \
            tests/gpu tests/engine/test_device_*.py tests/engine/test_warm.py tests/engine/test_pool.py \
            tests/engine/test_table.py tests/engine/test_store.py tests/engine/test_memory.py 2>&1 \
            | tee "$OUT/gpu_tests.txt" | tail -25) ;;
  esac
done
