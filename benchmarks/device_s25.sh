#!/usr/bin/env bash
# Session 25's device runs (16-core host of the lent GPU machine; dask/distributed and the packages its image lacks
# carried as wheels in .whl; mpshuffle from src/). STEP is
#   fill     fill numba's cache once (every device call starts with an empty one)
#   rech16ab issue 26 at 16 workers x 1 thread, time-to-space of float32 (1600, 1000, 1000) (6.4 GB): the code before
#            this session's per-piece change (old25/src: git archive cec1ecb src) against today's, mpshuffle and P2P
#            alternated, 2 rounds each
#   prof16   the same case, today's code: per run, every worker thread's CPU by thread group and Dask's task
#            stream by key prefix (rechunk_profile.py), mpshuffle and P2P, 2 rounds
#   rech2    the 2-worker case, float32 (400, 1000, 1000), time-to-space and its reverse, 3 rounds
#   gpu      the GPU tests and the engine's ndarray/memory tests -> $OUT/gpu_tests.txt
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
    rech16ab) for v in before after; do
                pp="$PWD/src:/tmp/site"; [ $v = before ] && pp="$PWD/old25/src:/tmp/site"
                PYTHONPATH="$pp" timeout -k 10 200 python3 benchmarks/rechunk_bench.py --cases time-to-space --t 1600 \
                  --workers 16 --repeat 2 --methods mpshuffle,p2p --name rechunk-h100-16w-s25-$v --out "$OUT" 2>&1 \
                  | quiet | grep -E "round" | sed "s/^/$v /"
              done ;;
    prof16) timeout -k 10 200 python3 benchmarks/rechunk_profile.py time-to-space --t 1600 --workers 16 --repeat 2 \
              --out "$OUT/rechunk-profile-h100-16w-s25.json" 2>&1 | quiet | grep '^{' | cut -c1-300 ;;
    rech2) timeout -k 10 300 python3 benchmarks/rechunk_bench.py --cases time-to-space,space-to-time --repeat 3 \
             --name rechunk-h100-2w-s25 --out "$OUT" 2>&1 | quiet | grep -E "round|^\{" ;;
    gpu) (set -o pipefail; timeout -k 10 300 python3 -m pytest -p no:cacheprovider -o timeout=300 -q -rs \
            tests/gpu tests/engine/test_device_*.py tests/engine/test_ndarray_adapter.py tests/engine/test_memory.py 2>&1 \
            | tee "$OUT/gpu_tests.txt" | tail -25) ;;
  esac
done
