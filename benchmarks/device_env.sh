# Sourced by the device scripts from session 26 on (benchmarks/device_s26.sh): the wheels carried in .whl
# installed into /tmp/site, mpshuffle from src/, NVLink multicast off, $OUT, and `quiet` (drops Dask's log lines).
# Run from the repository root on the lent machine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH" PYTHONPATH="$PWD/src:/tmp/site" NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
quiet() { grep -v "^distributed\|Warning\|warn\|^20[0-9][0-9]-" ; }
