"""Where a config-line shuffle's peak memory is: each worker's RSS and postbox over time.

Not a test. One ``LocalCluster`` (``--workers`` x 1 thread), one persisted
input of ``config_line_bench``'s synthetic partitions, and ``--repeats``
shuffles through the config line (``dataframe.shuffle.method`` set to
``"mpshuffle"``, ``df.shuffle(..., ignore_index=True)``, persisted). A thread
in every worker samples every ``--interval`` seconds its RSS (``/proc``'s
``RssAnon``, ``RssFile``, ``RssShmem``), the bytes its postboxes hold in
memory (what :attr:`~mpshuffle.memory.postbox.Postbox.nbytes` counts) and
how many partitions it has extracted so far, and records the order of its
extracts. Writes ``--out`` (JSON: every sample of every worker and run) and
prints, per run and worker, the peak RSS, what the postbox held and how many
partitions were extracted at that moment, what the postbox held at a
quarter, half and three quarters of the extracts, and the extract order.

Run: ``python benchmarks/extract_timeline.py [--partitions 120] [--rows 100000] [--out PATH]``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import dask
from distributed import Client, LocalCluster, wait

import mpshuffle.dask  # noqa: F401 -- installs the shuffle method

try:  # run as a script from the repository root or from benchmarks/
    from config_line_bench import synthetic
except ImportError:  # pragma: no cover
    from benchmarks.config_line_bench import synthetic


def _install(interval: float, dask_worker: Any) -> None:
    """In a worker: count postboxes and extracts, and sample RSS and postbox bytes on a thread."""
    import threading
    import weakref

    from mpshuffle.memory import postbox
    from mpshuffle.shuffler import host

    state: dict[str, Any] = {"boxes": weakref.WeakSet(), "extracted": 0, "samples": [], "order": [], "on": False}
    init, extract = postbox.Postbox.__init__, host.Shuffler.extract

    def counting_init(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        state["boxes"].add(self)

    def counting_extract(self: Any, partition_id: int) -> Any:
        out = extract(self, partition_id)
        state["extracted"] += 1
        state["order"].append(partition_id)
        return out

    postbox.Postbox.__init__ = counting_init  # type: ignore[method-assign]
    host.Shuffler.extract = counting_extract  # type: ignore[method-assign]

    def rss() -> tuple[int, int, int]:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon", "RssFile", "RssShmem")):
                    name, value, _ = line.split()
                    fields[name[:-1]] = int(value) * 1024
        return fields["RssAnon"], fields["RssFile"], fields["RssShmem"]

    def sample() -> None:
        while True:
            if state["on"]:
                held = sum(b._held[postbox.MemoryType.HOST] for b in list(state["boxes"]))
                state["samples"].append((time.monotonic(), *rss(), held, state["extracted"]))
            time.sleep(interval)

    threading.Thread(target=sample, daemon=True, name="timeline-sampler").start()
    dask_worker._timeline = state


def _start(dask_worker: Any) -> None:
    state = dask_worker._timeline
    state["samples"], state["extracted"], state["order"], state["on"] = [], 0, [], True


def _stop(dask_worker: Any) -> dict[str, Any]:
    state = dask_worker._timeline
    state["on"] = False
    return {"samples": list(state["samples"]), "order": list(state["order"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=120)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", type=float, default=4.0, help="GiB per worker")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between samples")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "extract_timeline.json"))
    args = parser.parse_args()
    cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                           memory_limit=f"{args.memory_limit}GiB", dashboard_address=":0")
    runs = []
    with cluster, Client(cluster) as client:
        client.run(_install, args.interval)
        df, on = synthetic(args.partitions, args.rows)
        data = df.persist()
        wait(data)
        for r in range(args.repeats + 1):  # the first one warms up, not recorded
            client.run(_start)
            with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
                out = data.shuffle(on, npartitions=args.partitions, ignore_index=True).optimize().persist()
            wait(out)
            samples = client.run(_stop)
            del out
            if r:
                runs.append(samples)
    report = []
    for r, samples in enumerate(runs):
        for w, (addr, got) in enumerate(sorted(samples.items())):
            rows = got["samples"]
            total = [a + f + s for _, a, f, s, _, _ in rows]
            i = max(range(len(rows)), key=total.__getitem__)
            _, anon, _, shmem, held, extracted = rows[i]
            owned = max(x[5] for x in rows)
            # What the postbox held when a quarter, half, three quarters of the partitions were extracted.
            quarters = [max((x[4] for x in rows if x[5] == owned * q // 4), default=0) / 1e6 for q in (1, 2, 3)]
            line = (f"run {r} worker {w}: peak RSS {total[i] / 1e6:7.1f} MB (anon {anon / 1e6:.1f}, "
                    f"shmem {shmem / 1e6:.1f}) with the postbox holding {held / 1e6:.1f} MB, "
                    f"{extracted} of {owned} partitions extracted; postbox max "
                    f"{max(x[4] for x in rows) / 1e6:.1f} MB, at 1/4, 1/2, 3/4 of the extracts "
                    + " / ".join(f"{v:.1f}" for v in quarters))
            print(line)
            print(f"  extract order: {got['order']}")
            report.append(line)
    Path(args.out).write_text(json.dumps({"args": vars(args), "report": report, "runs": [
        {addr: rows for addr, rows in samples.items()} for samples in runs]}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
