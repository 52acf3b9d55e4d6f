"""A per-worker memory timeline of a Dask cluster while a benchmark runs.

Not a test. :class:`Timeline` samples every worker every ``interval``
seconds from a background thread (``client.run``, so a paused worker still
answers): its RSS, Dask's status (running / paused) and its managed memory
by task prefix (bytes of the results in memory; and what Dask spilled),
the tasks executing, and mpshuffle's own accounting on that worker (host
and disk bytes reserved in its ``BufferResource``, the host budget, the
pool's idle bytes, and per live run the bytes its postbox holds in memory
and spilled). Used by ``rechunk_bench.py --timeline``.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from distributed import Client


def sample(dask_worker: Any) -> dict[str, Any]:
    """One worker's memory right now (runs on the worker, through ``client.run``)."""
    import psutil

    from mpshuffle.dask.worker import PLUGIN_NAME
    from mpshuffle.memory.resource import MemoryType

    state = dask_worker.state
    by_prefix: collections.Counter[str] = collections.Counter()
    executing = []
    for ts in list(state.tasks.values()):
        if ts.state == "memory":
            by_prefix[ts.prefix] += int(ts.nbytes or 0)
        elif ts.state == "executing":
            executing.append(ts.prefix)
    spilled = getattr(dask_worker.data, "spilled_total", None)
    out: dict[str, Any] = {
        "t": time.time(),
        "rss": psutil.Process().memory_info().rss,
        **_rss_parts(),
        **_malloc(),
        "status": dask_worker.status.name,
        "managed": int(sum(by_prefix.values())),
        "managed_by_prefix": dict(by_prefix.most_common(6)),
        "dask_spilled": int(spilled.memory) if spilled is not None else 0,
        "executing": executing,
    }
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    ctx = getattr(plugin, "context", None)
    if ctx is not None:
        res = ctx.resource
        runs = {}
        for op_id, run in list(ctx.shufflers.items()):
            box = getattr(run, "postbox", None)
            held = getattr(box, "_held", None)
            if held:
                metas = list(getattr(box, "_meta_list", ()))
                runs[op_id] = {"host": int(held[MemoryType.HOST]), "disk": int(held[MemoryType.DISK]),
                               "spilled": int(box.bytes_spilled), "unspilled": int(box.bytes_unspilled),
                               "metadata": len(metas), "metadata_bytes": sum(len(m) for m in metas),
                               "chunks": len(getattr(box, "_chunks", ()))}
        out["mpshuffle"] = {
            "host_used": res.used(MemoryType.HOST), "host_budget": res.limit(MemoryType.HOST),
            "disk_used": res.used(MemoryType.DISK), "pool_idle": ctx.pool.idle_bytes, "runs": runs,
        }
    return out


def _malloc() -> dict[str, int]:
    """glibc's heap: bytes in use, free inside the heap, and in mmapped blocks (``mallinfo2``); {} elsewhere."""
    import ctypes

    class _Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Info
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"malloc_in_use": info.uordblks, "malloc_free": info.fordblks, "malloc_mmapped": info.hblkhd}


def _rss_parts() -> dict[str, int]:
    """RSS split into anonymous, file-backed and shared-memory pages (Linux ``/proc/self/status``)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for row in f:
                if row.startswith(("RssAnon", "RssFile", "RssShmem")):
                    name, value = row.split(":")
                    out[name.lower()] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


class Timeline:
    """Samples every worker of ``client`` every ``interval`` seconds until :meth:`stop`."""

    def __init__(self, client: Client, interval: float = 0.5, echo: bool = False) -> None:
        self.client = client
        self.interval = interval
        self.echo = echo
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-timeline", daemon=True)

    def start(self) -> Timeline:
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        return self.samples

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                per = self.client.run(sample)
            except Exception as e:  # noqa: BLE001 -- a lost worker must not end the timeline
                per = {"error": repr(e)}
            self.samples.append({"t": time.time(), "workers": per})
            if self.echo:
                print(line(self.samples[-1]), flush=True)
            self._stop.wait(self.interval)


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per worker: the peak RSS, and what the worker held at that moment."""
    out: dict[str, Any] = {}
    for s in samples:
        for addr, w in s["workers"].items():
            if not isinstance(w, dict):
                continue
            best = out.get(addr)
            if best is None or w["rss"] > best["rss"]:
                out[addr] = w
    return out


def _short(prefix: str) -> str:
    return prefix.replace("mpshuffle-rechunk-", "").replace("mpshuffle-rechunk", "pick")[:8]


def line(s: dict[str, Any]) -> str:
    """One sample as a line: per worker RSS, status, Dask's managed bytes, mpshuffle's host / disk (MB)."""
    parts = []
    for w in s["workers"].values():
        if not isinstance(w, dict):
            parts.append(str(w)[:40])
            continue
        m = w.get("mpshuffle", {})
        parts.append(
            f"rss {w['rss'] / 1e6:4.0f} (anon {w.get('rssanon', 0) / 1e6:4.0f} shm {w.get('rssshmem', 0) / 1e6:3.0f}) "
            f"(malloc used {w.get('malloc_in_use', 0) / 1e6:4.0f} free {w.get('malloc_free', 0) / 1e6:4.0f} "
            f"mmap {w.get('malloc_mmapped', 0) / 1e6:4.0f}) {w['status'][:5]} dask {w['managed'] / 1e6:4.0f} "
            f"(spilled {w['dask_spilled'] / 1e6:4.0f}) mps {m.get('host_used', 0) / 1e6:4.0f}"
            f"/{(m.get('host_budget') or 0) / 1e6:3.0f} disk {m.get('disk_used', 0) / 1e6:5.0f} "
            f"metas {sum(r.get('metadata', 0) for r in m.get('runs', {}).values())} "
            f"exec {','.join(_short(p) for p in w['executing'])} "
            f"held {','.join(f'{_short(k)}:{v / 1e6:.0f}' for k, v in w['managed_by_prefix'].items() if v > 1e6)}"
        )
    return time.strftime("%H:%M:%S ", time.localtime(s["t"])) + " | ".join(parts)
