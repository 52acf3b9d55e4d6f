#!/usr/bin/env bash
# The config line (dataframe.shuffle.method = "mpshuffle") on the lent GPU machine's 16-core host,
# interleaved with mpshuffle.dask.shuffle, Dask P2P and tasks: 0.7 GB per worker, 120 -> 120
# partitions, 1 thread per worker, at 2, 8 and 16 workers; each run also starts a fresh cluster
# per method for its first and second shuffle (--first). Not run by the session that wrote it
# (the 16-core host is the lead engineer's); run from the repository root:
#     bash benchmarks/config_line_h200.sh
# Rows per partition = 0.7e9 * workers / 44 bytes per row / 120 partitions.
set -euo pipefail
py=${PYTHON:-.venv/bin/python}
for w in 2 8 16; do
    rows=$(( 700000000 * w / 44 / 120 ))
    "$py" benchmarks/config_line_bench.py --workers "$w" --partitions 120 --rows "$rows" \
        --memory-limit 6 --repeats 3 --first --out "benchmarks/results/config_line-h200-${w}w.json"
done
