#!/usr/bin/env bash
# How benchmarks/results/gpu/ is produced on a lent 2-GPU machine that has no package index.
#
# Usage (repository root): bash benchmarks/gpu_lease.sh STEP...
#   setup   install the rapidsmpf 26.04 anchor's wheels (cudf, dask-cuda, rapidsmpf, ucxx,
#           dask/distributed 2026.1.1; staged in /tmp/stage as the anchor's README says)
#           with the anchor's setup.sh ($ANCHOR, default .rmpf/anchor), which writes /tmp/pp.env
#   tests   the GPU tests (two GPUs, dask-cuda, cudf) -> $OUT/gpu_tests.txt
#   peer    benchmarks/gpu_peer_bench.py: rapidsmpf and mpshuffle, same cluster and data
#   nodask  benchmarks/gpu_bench.py: no Dask, raw NCCL all-to-all and CuPy partition limits
#   ucxx    benchmarks/gpu_ucxx_bench.py: UCXX next to NCCL between the two GPUs
#   profile benchmarks/gpu_insert_profile.py --cudf: where a device insert's time goes
# On one GPU (nvidia-h200; dask/distributed carried as wheels on PYTHONPATH, no anchor needed):
#   tiers   benchmarks/gpu_tiers_bench.py: through Dask in memory, 3x the device budget, disk
#   nodask1 benchmarks/gpu_bench.py --nranks 1: partition + pack against CuPy's sort/scatter
#   copy    benchmarks/gpu_copy_bench.py: copies between the GPU and host memory by kind
# mpshuffle itself is not installed: src/ goes first on PYTHONPATH.
set -u
OUT=${OUT:-/tmp/gpu-out}
ANCHOR=${ANCHOR:-.rmpf/anchor}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
env_on() { source /tmp/pp.env && export PYTHONPATH="$PWD/src:$PYTHONPATH"; }
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    setup) bash "$ANCHOR/setup.sh" > "$OUT/setup.log" 2>&1; echo "setup rc=$?"; tail -40 "$OUT/setup.log" ;;
    tests) (env_on && set -o pipefail && timeout 300 python3 -m pytest -p no:cacheprovider -o timeout=300 -v -rs \
             tests/gpu \
             tests/engine/test_device_run_spill.py tests/engine/test_device_run_consolidate.py \
             tests/engine/test_device_turns.py tests/engine/test_device_run_faults.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -60) ;;
    peer) (env_on && timeout 560 python3 benchmarks/gpu_peer_bench.py --out "$OUT" ${PEER_ARGS:-} 2>&1 \
             | tee "$OUT/peer.log" | grep -v "^RESULT" | tail -30) ;;
    nodask) (env_on && timeout 300 python3 benchmarks/gpu_bench.py --gb 10 --reps 3 --spill 10 \
             --out "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/nodask.log" | tail -30) ;;
    ucxx) (env_on && timeout 200 python3 benchmarks/gpu_ucxx_bench.py --gb 1 4 --reps 3 --out "$OUT" 2>&1 \
             | tee "$OUT/ucxx.log" | tail -30) ;;
    profile) (env_on && timeout 200 python3 benchmarks/gpu_insert_profile.py --cudf 2>&1 \
             | tee "$OUT/profile.log" | tail -100) ;;
    tiers) (export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" && mkdir -p /var/tmp/mps-spill && timeout 400 python3 \
             benchmarks/gpu_tiers_bench.py --gb 24 --reps 3 --spill-dir /var/tmp/mps-spill --out "$OUT/tiers.json" 2>&1 \
             | tee "$OUT/tiers.log" | grep -vi warn | tail -40) ;;
    nodask1) (export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" && timeout 100 python3 benchmarks/gpu_bench.py --nranks 1 \
             --gb 10 --reps 5 --npartitions 32 --out "$OUT/gpu_bench_1gpu.json" 2>&1 | tee "$OUT/nodask1.log" | tail -30) ;;
    copy) (export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" && timeout 60 python3 benchmarks/gpu_copy_bench.py --gb 4.29 2>&1 \
             | tee "$OUT/copy.log") ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
