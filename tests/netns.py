"""A harness of several "hosts" on one machine: Linux network namespaces on a bridge.

A scheduler and ``NWORKERS`` ``dask worker --nthreads 1`` processes each run
in a network namespace of their own, joined by veth pairs to a bridge in the
root namespace, each with its own address on a private /24
(``10.77.X.0/24``), so every byte between ranks crosses a link. A client
connects from the root namespace through the bridge's address. Namespaces
share ``/dev/shm`` (only the network stack is separate), so clusters made
here run with ``shared_memory=False``, as between hosts.

Used by ``tests/dask/test_netns.py`` and by the benchmarks that run across
links (they put this directory on ``sys.path``). Needs root and ``ip``
(iproute2): :func:`can_make_namespaces` says why not otherwise. Every name
carries a tag unique to the run, and :meth:`Hosts.down` removes everything
made, on failure too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NWORKERS = 3
TIMEOUT = 5.0  # mpshuffle's timeout in these clusters, seconds
HERE = Path(__file__).resolve().parent


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def tc(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=check, timeout=30)


#: How long a packet may wait in a rate limit's queue, seconds (tbf's
#: ``latency``; with the rate it sets the queue's length in bytes). 10 ms
#: holds 1.25 MB at 1 Gbit/s and 12.5 MB at 10 Gbit/s: far more than the
#: tens-of-microseconds round trip of a veth pair times the rate (what TCP
#: needs queued to keep the link busy), and a shallow enough queue that a
#: full one shows as drops and retransmissions rather than as seconds of
#: delay that the 5 s test ``timeout`` would mistake for a dead rank.
RATE_LATENCY = 0.010
#: Seconds of rate that a limit's bucket holds (tbf's ``burst``). tbf can
#: only release tokens on a timer tick, so the bucket must hold at least
#: ``rate / HZ`` bytes or the link cannot reach its rate (tc-tbf(8)); 10 ms
#: covers any kernel HZ >= 100 (this machine's is 250: 4 ms).
RATE_BURST_SECONDS = 0.010
#: The smallest bucket, bytes. veth pairs pass TSO/GSO packets of up to
#: 64 KiB whole; a bucket smaller than one makes tbf cut every such packet
#: into MTU segments (CPU per packet, and the rate is then met only
#: approximately). Four of them let a burst of a few packets through whole.
RATE_MIN_BURST = 4 * 64 * 1024


def rate_burst(bits_per_s: float) -> int:
    """Bytes in the bucket of a :meth:`Hosts.limit_rate` limit of ``bits_per_s``: what passes at once."""
    return max(int(bits_per_s / 8 * RATE_BURST_SECONDS), RATE_MIN_BURST)


_TBF_STATS = re.compile(r"qdisc tbf .*?Sent (\d+) bytes \d+ pkt \(dropped (\d+), overlimits (\d+)", re.DOTALL)


def _free_subnet() -> int:
    """A third octet X such that no interface already has an address in 10.77.X.0/24."""
    used = ip("-4", "-o", "addr").stdout
    for _ in range(100):
        x = secrets.randbelow(250) + 2
        if f" 10.77.{x}." not in used:
            return x
    raise RuntimeError("no free 10.77.X.0/24 subnet")


@dataclass
class Hosts:
    """A scheduler and workers, each in its own network namespace (see the module docstring).

    ``namespaces[0]`` holds the scheduler, ``namespaces[i]`` worker ``i``
    (1-based); ``links[i]`` is the root-side end of namespace ``i``'s veth
    pair and ``inner[i]`` the end inside it; ``addresses[i]`` its IPv4 address.
    """

    tag: str
    subnet: int
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    inner: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    bridge: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    tmp: str = ""
    tls: bool = False
    nworkers: int = NWORKERS
    timeout: float = TIMEOUT
    memory_limit: str = "2GiB"
    workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    limited: set[int] = field(default_factory=set)
    _env: dict[str, str] = field(default_factory=dict)

    @property
    def scheduler(self) -> str:
        return f"{'tls' if self.tls else 'tcp'}://{self.addresses[0]}:8786"

    def tls_files(self) -> dict[str, str]:
        """PEM files of a self-signed certificate (its own CA) that every process presents."""
        return {k: os.path.join(self.tmp, f"{k}.pem") for k in ("ca", "cert", "key")}

    def security(self) -> Any:
        """The client's :class:`distributed.security.Security` (``None`` over plain TCP)."""
        if not self.tls:
            return None
        from distributed.security import Security

        f = self.tls_files()
        return Security(
            tls_ca_file=f["ca"], tls_client_cert=f["cert"], tls_client_key=f["key"], require_encryption=True
        )

    def _tls_args(self) -> list[str]:
        if not self.tls:
            return []
        f = self.tls_files()
        return ["--tls-ca-file", f["ca"], "--tls-cert", f["cert"], "--tls-key", f["key"]]

    def limit_rate(self, bits_per_s: float, i: int | None = None) -> None:
        """Limit host ``i``'s link (every host's when ``None``) to ``bits_per_s`` in each direction.

        A token-bucket filter (``tc qdisc replace ... tbf``) on both ends of
        each veth pair: inside the namespace on ``inner[i]`` (what the host
        sends) and in the root namespace on ``links[i]`` (what the bridge
        forwards to the host), as a host with a full-duplex NIC of that speed
        on a switch. A byte from worker ``a`` to worker ``b`` so passes two
        limits in turn (``a``'s uplink, ``b``'s downlink). Replaces any limit
        already there. Burst and queue: :data:`RATE_BURST_SECONDS`,
        :data:`RATE_MIN_BURST`, :data:`RATE_LATENCY`.

        Parameters
        ----------
        bits_per_s
            Rate in bits per second (``1e9`` is 1 Gbit/s); at least 1e6.
        i
            Index into :attr:`namespaces` (0 the scheduler, ``k`` worker
            ``k``), or ``None`` for all of them.

        Raises
        ------
        ValueError
            If ``bits_per_s`` is below 1e6 (tbf's bucket of 64 KiB packets
            would then hold seconds of traffic) or ``i`` names no host.
        subprocess.CalledProcessError
            If ``tc`` refuses (no ``sch_tbf`` in the kernel).
        """
        if not bits_per_s >= 1e6:
            raise ValueError(f"rate must be at least 1e6 bits/s, got {bits_per_s!r}")
        hosts = range(len(self.namespaces)) if i is None else [i]
        if i is not None and not 0 <= i < len(self.namespaces):
            raise ValueError(f"no host {i}: there are {len(self.namespaces)} (0 is the scheduler)")
        rate = int(bits_per_s)
        spec = ["root", "tbf", "rate", f"{rate}bit", "burst", str(rate_burst(bits_per_s)), "latency", f"{RATE_LATENCY * 1e3:g}ms"]
        for k in hosts:
            tc("-n", self.namespaces[k], "qdisc", "replace", "dev", self.inner[k], *spec)
            tc("qdisc", "replace", "dev", self.links[k], *spec)
            self.limited.add(k)

    def unlimit(self) -> None:
        """Remove every limit :meth:`limit_rate` set (back to the veth's own speed); never raises."""
        for k in sorted(self.limited):
            tc("-n", self.namespaces[k], "qdisc", "del", "dev", self.inner[k], "root", check=False)
            tc("qdisc", "del", "dev", self.links[k], "root", check=False)
        self.limited.clear()

    def rate_counters(self) -> dict[str, dict[str, int]]:
        """The rate limits' counters: ``{device: {"sent_bytes", "overlimits", "dropped"}}``.

        One entry per limited device, ``inner[i]`` and ``links[i]`` of every
        limited host, read from ``tc -s qdisc``. ``overlimits`` counts the
        times a packet had to wait for tokens: above zero, the limit held
        traffic back.
        """
        out: dict[str, dict[str, int]] = {}
        for k in sorted(self.limited):
            for prefix, dev in ((["-n", self.namespaces[k]], self.inner[k]), ([], self.links[k])):
                text = tc(*prefix, "-s", "qdisc", "show", "dev", dev).stdout
                m = _TBF_STATS.search(text)
                if m is None:
                    raise RuntimeError(f"no tbf on {dev}: {text!r}")
                out[dev] = {"sent_bytes": int(m[1]), "dropped": int(m[2]), "overlimits": int(m[3])}
        return out

    def up(self) -> None:
        self.bridge = f"b{self.tag}"
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"10.77.{self.subnet}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i in range(self.nworkers + 1):
            ns, outer, inner = f"mps-{self.tag}-{i}", f"v{self.tag}{i}", f"p{self.tag}{i}"
            address = f"10.77.{self.subnet}.{i + 2}"
            ip("netns", "add", ns)
            self.namespaces.append(ns)
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self.links.append(outer)
            self.inner.append(inner)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            self.addresses.append(address)

    def start(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix=f"mps-{self.tag}-")
        env = dict(os.environ)
        # Functions a test sends with client.run are pickled by reference to
        # this module and conftest: make both importable on the workers.
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "dask"), str(HERE), env.get("PYTHONPATH", "")])
        env["DASK_MPSHUFFLE__SHARED_MEMORY"] = "False"
        env["DASK_MPSHUFFLE__TIMEOUT"] = str(self.timeout)

        self._env = env
        if self.tls:
            from distributed.security import Security

            temporary = Security.temporary()  # PEM text, not paths
            f = self.tls_files()
            Path(f["ca"]).write_text(temporary.tls_ca_file)
            Path(f["cert"]).write_text(temporary.tls_scheduler_cert)
            Path(f["key"]).write_text(temporary.tls_scheduler_key)
        self.spawn(
            self.namespaces[0],
            ["scheduler", "--host", self.addresses[0], "--port", "8786", "--no-dashboard",
             *(["--protocol", "tls"] if self.tls else []), *self._tls_args()],
            "scheduler.log",
        )
        for i in range(1, self.nworkers + 1):
            self.spawn_worker(i)

    def spawn(self, ns: str, args: list[str], log: str) -> subprocess.Popen[bytes]:
        command = dask_command()
        if command is None:
            raise RuntimeError(can_make_namespaces())
        out = open(os.path.join(self.tmp, log), "ab")  # noqa: SIM115 - closed with the process
        self.procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns, *command, *args], env=self._env, stdout=out, stderr=subprocess.STDOUT
            )
        )
        out.close()  # the child holds its own copy
        return self.procs[-1]

    def spawn_worker(self, i: int) -> None:
        """Start worker ``i`` (1-based) in its namespace; again, after it has gone."""
        self.workers[i] = self.spawn(
            self.namespaces[i],
            [
                "worker", self.scheduler, "--nthreads", "1", "--nworkers", "1", "--no-nanny",
                "--host", self.addresses[i], "--no-dashboard", "--memory-limit", self.memory_limit,
                "--local-directory", os.path.join(self.tmp, f"w{i}"), *self._tls_args(),
            ],
            f"worker{i}.log",
        )

    def logs(self) -> str:
        text = []
        for name in sorted(os.listdir(self.tmp)) if self.tmp else []:
            path = os.path.join(self.tmp, name)
            if os.path.isfile(path):
                text.append(f"--- {name}\n" + Path(path).read_text(errors="replace")[-3000:])
        return "\n".join(text)

    def down(self) -> None:
        """Stop every process and remove every namespace, link and the bridge; never raises."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for ns in self.namespaces:
            ip("netns", "del", ns, check=False)  # takes its veth pair with it
        for link in self.links:
            ip("link", "del", link, check=False)
        if self.bridge:
            ip("link", "del", self.bridge, check=False)
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


def dask_command() -> list[str] | None:
    """The command that starts ``dask scheduler`` / ``dask worker`` with this Python's packages.

    The ``dask`` script next to :data:`sys.executable` (a virtual
    environment's), else ``python -m dask`` with this very interpreter, which
    finds dask, distributed and mpshuffle on ``sys.path``/``PYTHONPATH`` as
    this process does (where they come from a ``PYTHONPATH`` folder, the
    ``dask`` script there names the interpreter that installed it, perhaps
    not this one). ``None`` if this Python cannot import distributed.
    """
    beside = Path(sys.executable).parent / "dask"
    if beside.exists():
        return [str(beside)]
    if importlib.util.find_spec("distributed") is None:
        return None
    return [sys.executable, "-m", "dask"]


def can_make_namespaces() -> str | None:
    """Why namespaces cannot be made here, or ``None`` when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on PATH"
    if dask_command() is None:
        return f"distributed is not importable by {sys.executable} (no `dask` command to start the cluster)"
    return None


def can_limit_rate() -> str | None:
    """Why :meth:`Hosts.limit_rate` cannot work here (no ``tc``), or ``None``."""
    if shutil.which("tc") is None:
        return "no `tc` (iproute2) on PATH"
    return None


def new_hosts(**kwargs: Any) -> Hosts:
    """A :class:`Hosts` with a tag unique to this process and a free subnet; nothing made yet."""
    return Hosts(tag=f"{os.getpid() % 1000:03d}{secrets.token_hex(2)}", subnet=_free_subnet(), **kwargs)


def made_hosts(**kwargs: Any) -> Iterator[Hosts]:
    """Namespaces made and the cluster started, for a pytest fixture; skips with the reason where they cannot be.

    ``kwargs`` go to :class:`Hosts` (``tls``, ``nworkers``, ``timeout``,
    ``memory_limit``). Everything is removed when the generator closes.
    """
    import pytest  # here, not at the top: benchmarks import this module where pytest may be absent

    reason = can_make_namespaces()
    if reason:
        pytest.skip(reason)
    h = new_hosts(**kwargs)
    try:
        try:
            h.up()
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot make network namespaces here: {' '.join(e.cmd)}: {e.stderr.strip()}")
        h.start()
        yield h
    finally:
        h.down()
