"""The host postbox before and after the one store: add_chunk then pop, alternating in one process.

Not a test. ``--old`` names an older ``postbox.py`` (e.g. ``git show
1288683:src/mpshuffle/memory/postbox.py > /tmp/postbox_old.py``); both are
timed on the same pieces (800 chunks of 64 pieces of 4 KiB, 210 MB), in
memory (no host budget) and all to disk (a host budget of 1 byte), in
alternating order, 9 repeats; CPU-seconds of the process (``getrusage``),
min/median/max and the per-repeat ratio new/old. Run::

    python benchmarks/store_postbox_bench.py --old /tmp/postbox_old.py --json out.json
"""
import argparse
import importlib.util
import json
import os
import platform
import resource as rs
import statistics
import sys
import tempfile

import numpy as np

from mpshuffle.memory import BufferResource, MemoryType, PackedData
from mpshuffle.memory.postbox import Postbox as New

ap = argparse.ArgumentParser()
ap.add_argument("--old", required=True, help="path of the older postbox.py")
ap.add_argument("--json", required=True, help="where the figures go")
args = ap.parse_args()
spec = importlib.util.spec_from_file_location("mpshuffle.memory._old_postbox", args.old)
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
Old = old.Postbox
NP, NCH, PIECE = 64, 800, 4096  # 800 chunks of 64 pieces of 4 KiB: 210 MB
buf = np.random.default_rng(0).integers(0, 255, NP * PIECE, dtype=np.uint8)
chunk = [(p, 0, PackedData(b"m" * 40, buf[p * PIECE:(p + 1) * PIECE], 512)) for p in range(NP)]
def cpu():
    r = rs.getrusage(rs.RUSAGE_SELF); return r.ru_utime + r.ru_stime
def once(cls, limit, d):
    res = BufferResource({MemoryType.HOST: limit}, spill_dir=d, spill_prefix="pb")
    box = cls(res, "x")
    t = cpu()
    chunk_api = getattr(sys.modules.get(cls.__module__), "Chunk", None)  # postboxes since the Chunk record
    for c in range(NCH):
        if chunk_api is not None:
            box.add_chunk(chunk_api.of_pieces(c, "a", 0, 0, [(p, pk) for p, _, pk in chunk]))
        else:
            box.add_chunk([(p, c, pk) for p, _, pk in chunk])
    for p in range(NP):
        box.pop(p)
    t = cpu() - t
    box.clear()
    return t
out = {}
with tempfile.TemporaryDirectory() as d:
    for case, limit in (("memory", None), ("disk", 1)):
        times = {"old": [], "new": []}
        for r in range(9):
            for name, cls in (("old", Old), ("new", New)) if r % 2 else (("new", New), ("old", Old)):
                times[name].append(once(cls, limit, d))
        ratio = [n / o for n, o in zip(times["new"], times["old"])]
        out[case] = {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in times.items()}
        out[case]["ratio_new_over_old"] = {"min": min(ratio), "median": statistics.median(ratio), "max": max(ratio)}
        print(case, json.dumps(out[case]))
out["load"] = os.getloadavg(); out["machine"] = platform.platform(); out["python"] = sys.version.split()[0]
out["numpy"] = np.__version__; out["bytes_per_run"] = NP * NCH * PIECE
out["what"] = "Postbox.add_chunk of 800 chunks x 64 pieces of 4 KiB then pop of 64 partitions; CPU s of the process; old = main's postbox.py at 1288683, new = the store's"
with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
print("load", out["load"])
