"""What every run is: one rank's share of one shuffle, with one lifecycle for both kinds.

A run goes through the same phases on every rank, whatever its data:

1. **insert** (task threads): input partitions are taken in
   (:meth:`Run.insert_frame`);
2. **barrier** (one rank's task): ``inputs-done`` goes to every rank, naming
   the insert attempt whose data counts per input partition; each rank marks
   its inputs done (which fixes the output partitions it owns, by
   :func:`~mpshuffle.table.owned_partitions`) and acknowledges, with its
   error if it has one; the barrier waits for every acknowledgement;
3. **extract** (task threads on the owning rank): each owned output partition
   is handed out once; after the last one the run's state is freed;
4. **fail** / **close**: a failed run wakes every wait with its error and
   frees its buffers; a closed run has freed everything and told its owner
   (``on_done``) once.

:class:`Run` holds that shared lifecycle; :class:`~mpshuffle.shuffler.host.Shuffler`
(host data, streamed in chunks) and :class:`~mpshuffle.shuffler.device.DeviceRun`
(device data, exchanged over NCCL at the barrier) implement the phases.
Both report the same :class:`Statistics`.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

from mpshuffle.errors import PartitionGoneError, ShuffleError, ShuffleTimeoutError
from mpshuffle.table import owned_partitions

if TYPE_CHECKING:
    from mpshuffle.comm import Communicator, Frames, Tag
    from mpshuffle.memory import BufferResource
    from mpshuffle.table import FrameAdapter, PackedData

__all__ = ["STATISTICS", "Run", "Statistics"]

# Every key of a run's statistics, for both kinds; a kind leaves the keys of
# the other's mechanisms at 0.
STATISTICS: tuple[str, ...] = (
    "bytes_inserted", "bytes_sent", "bytes_received",
    "bytes_spilled_host", "bytes_spilled_disk", "bytes_unspilled_disk", "bytes_consolidated",
    "bytes_gathered", "chunks_sent", "chunks_received", "rounds",
    "seconds_insert", "seconds_insert_wait", "seconds_headers", "seconds_exchange", "seconds_consolidate",
    "seconds_gather", "seconds_spill_host", "seconds_spill_disk", "seconds_unspill_disk",
    "seconds_wait", "seconds_extract",
)


class Statistics(dict[str, float]):
    """Counters of one run on one rank: a ``dict`` with exactly the keys of :data:`STATISTICS`.

    Bytes are packed sizes, counts are counts, seconds are wall time summed
    over calls.

    ``bytes_inserted``
        Bytes of the input partitions taken in.
    ``bytes_sent``, ``bytes_received``
        Bytes sent to other ranks; bytes received from every rank, itself included.
    ``bytes_spilled_host``, ``seconds_spill_host``
        Device buffers copied to host memory past the device budget (device runs).
    ``bytes_spilled_disk``, ``seconds_spill_disk``
        Buffers written to the spill directory past the host budget (host
        buffers; device runs: also device buffers that went straight to disk
        where the host tier had no room).
    ``bytes_unspilled_disk``, ``seconds_unspill_disk``
        Spilled bytes read back (host runs: by extract, counted in its time).
    ``bytes_consolidated``, ``seconds_consolidate``
        Output partitions gathered into one piece each after the exchange (device runs).
    ``bytes_gathered``, ``seconds_gather``
        Output partitions not consolidated, gathered into one device piece
        each by their extract from the device, host memory and disk (device
        runs; the disk reads also count in ``*_unspill_disk``).
    ``chunks_sent``, ``chunks_received``
        Chunks of the host path's streaming sends.
    ``rounds``, ``seconds_headers``, ``seconds_exchange``
        The device exchange's rounds, its header swap and its NCCL rounds.
    ``seconds_insert``, ``seconds_wait``, ``seconds_extract``
        Time in insert; waiting for the data at extract; handing it out.
    ``seconds_insert_wait``
        Of ``seconds_insert``, the time the host path's inserts waited for
        their chunks to be taken by the receivers (back-pressure, and the
        last chunks of each insert).

    Raises
    ------
    KeyError
        On setting a key that is not a statistic (a misspelt counter).
    """

    def __init__(self) -> None:
        super().__init__(dict.fromkeys(STATISTICS, 0))
        for key in STATISTICS:
            if key.startswith("seconds_"):
                super().__setitem__(key, 0.0)

    def __setitem__(self, key: str, value: float) -> None:
        if key not in self:
            raise KeyError(f"{key!r} is not a run statistic (known: {', '.join(STATISTICS)})")
        super().__setitem__(key, value)


class Run(abc.ABC):
    """One rank's share of one run: the lifecycle shared by host and device runs.

    Parameters
    ----------
    comm
        The generation's communicator.
    op_id
        Id of the run, unique within the generation.
    resource
        Where every buffer of the run is accounted (and spilled).
    timeout
        Seconds any wait of the run may take (a send, the barrier, extract's
        wait for the data, a peer's headers).
    on_done
        Called once with ``op_id`` when the run's state is freed.

    Attributes
    ----------
    op_id
        Id of the run.
    npartitions
        Number of output partitions, known once the inputs are done.
    statistics
        The run's counters on this rank.
    timeout
        Seconds any wait of the run may take.
    """

    #: How messages name a run of this kind ("shuffle op 3 ...").
    label: ClassVar[str] = "shuffle op"
    #: What a rank acknowledges at the barrier (for the timeout's message).
    ack_meaning: ClassVar[str] = "confirm the barrier"

    comm: Communicator
    op_id: int
    resource: BufferResource
    timeout: float
    npartitions: int | None
    statistics: Statistics

    def __init__(
        self,
        comm: Communicator,
        op_id: int,
        *,
        resource: BufferResource,
        timeout: float,
        on_done: Callable[[int], None] | None = None,
    ) -> None:
        self.comm = comm
        self.op_id = op_id
        self.resource = resource
        self.timeout = timeout
        self.npartitions = None
        self.statistics = Statistics()
        self._on_done = on_done
        self._lock = threading.Lock()
        self._owned: set[int] = set()
        self._extracted: set[int] = set()
        # Extracts that took their partition and still read the run's state,
        # and whether one of them was told to free the run (_done_taking).
        self._extracting = 0
        self._freeing = False
        self._inputs_done = False
        # The insert attempt whose data counts, per input partition (set by
        # the barrier); None keeps everything (no barrier named them).
        self._accepted: list[str] | None = None
        # Barrier acknowledgements by rank: "" or the rank's error.
        self._acks: dict[int, str] = {}
        self._acks_event = threading.Event()
        self._error: BaseException | None = None
        self._closed = False

    def set_run_options(self, timeout: float | None, batch_bytes: int | None) -> None:
        """Apply the run's own options (:data:`~mpshuffle.options.RUN_OPTIONS`) from its task.

        A run that a peer's message created before any task of it ran on
        this rank starts with its context's options; the task's graph says
        the run's. ``None`` keeps a value. Runs without batches ignore
        ``batch_bytes``.
        """
        if timeout is not None:
            self.timeout = timeout

    def run_options(self) -> dict[str, Any]:
        """The run's own options in force on this rank (``timeout`` in seconds; ``batch_bytes`` for host runs)."""
        return {"timeout": self.timeout}

    # -- the phases each kind implements ------------------------------------
    @abc.abstractmethod
    def insert_frame(
        self, input_index: int, frame: Any, adapter: FrameAdapter, on: Sequence[Any],
        npartitions: int, ids: Any = None, attempt: str = "",
    ) -> None:
        """Take input partition ``input_index`` in.

        Parameters
        ----------
        frame
            The partition, of ``adapter``'s type.
        on
            Key columns (hash partitioning) unless ``ids`` is given.
        npartitions
            Number of output partitions.
        ids
            Optional output partition id of every row (shape ``(n,)``, int64,
            on the frame's device, see :meth:`FrameAdapter.as_ids`), or, for
            a host run of a pandas frame, a
            :class:`~mpshuffle.table.hashing.PandasRowHash` of its rows.
        attempt
            Id of this execution of the insert task; the barrier names the
            attempt whose data counts.

        Raises
        ------
        ShuffleError
            If the run failed or its inputs are done.
        """

    @abc.abstractmethod
    def barrier(self, npartitions: int, accepted: list[str] | None = None) -> None:
        """Tell every rank that the inputs are done and wait until all acknowledged.

        Parameters
        ----------
        npartitions
            Number of output partitions.
        accepted
            Per input partition, the insert attempt whose data counts
            (``None``: all).

        Raises
        ------
        ShuffleError
            With a rank's error, or naming the ranks that did not acknowledge
            within :attr:`timeout` seconds.
        """

    @abc.abstractmethod
    def extract(self, partition_id: int) -> Sequence[PackedData]:
        """The pieces of owned output partition ``partition_id``, ordered by input partition.

        Raises
        ------
        PartitionGoneError
            If the partition was already extracted.
        ShuffleError
            If the run failed, its data did not come within :attr:`timeout`
            seconds, or the partition is not owned here.
        """

    @abc.abstractmethod
    def receive(self, src: int, tag: Tag, frames: Frames) -> None:
        """Handle one control or data message of this run (on the progress thread; never blocks)."""

    @abc.abstractmethod
    def _free(self) -> None:
        """Free the run's buffers and spill files (on fail and on close). Idempotent."""

    def _wake(self) -> None:
        """Wake the kind's own waits (called by :meth:`fail`)."""

    def _after_close(self) -> None:
        """Finish closing (after the buffers were freed, before ``on_done``)."""

    def scope(self) -> AbstractContextManager[Any]:
        """Context in which this run's output partitions are unpacked (a device run's GPU)."""
        return contextlib.nullcontext()

    # -- the shared lifecycle -------------------------------------------------
    def _mark_inputs_done(self, npartitions: int, accepted: list[str] | None) -> None:
        """Record the end of the inputs; call with ``_lock`` held and only once."""
        self._inputs_done = True
        self._accepted = accepted
        self.npartitions = npartitions
        self._owned = set(owned_partitions(self.comm.rank, self.comm.nranks, npartitions))

    def _record_ack(self, src: int, error: str = "") -> None:
        """Rank ``src`` acknowledged the barrier (with its error, if any)."""
        with self._lock:
            self._acks[src] = error
            if len(self._acks) == self.comm.nranks:
                self._acks_event.set()

    def _wait_acks(self, timeout: float) -> None:
        """Wait for every rank's acknowledgement; raise a rank's error or a timeout naming the missing."""
        deadline = time.monotonic() + timeout
        while not self._acks_event.wait(0.1):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.comm.nranks)) - set(self._acks))
                who = ", ".join(self.comm.describe(r) for r in missing)
                raise ShuffleTimeoutError(
                    f"{self.label} {self.op_id}: {who} did not {self.ack_meaning} within {timeout:g} s",
                    missing=tuple(missing),
                )
        self._raise_if_failed()
        errors = {r: e for r, e in self._acks.items() if e}
        if errors:
            raise ShuffleError(
                f"{self.label} {self.op_id}: exchange failed on "
                + "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
            )

    def _take(self, partition_id: int) -> None:
        """Mark owned partition ``partition_id`` handed out and its extract under way.

        Call with ``_lock`` held, and :meth:`_done_taking` once the extract
        has read what it needs of the run (also when it fails).

        Raises
        ------
        ShuffleError
            If this rank does not own it.
        PartitionGoneError
            If it was handed out already.
        """
        if partition_id not in self._owned:
            raise ShuffleError(
                f"output partition {partition_id} of {self.label} {self.op_id} is not owned by "
                f"rank {self.comm.rank}"
            )
        if partition_id in self._extracted:
            raise PartitionGoneError(
                f"output partition {partition_id} of {self.label} {self.op_id} was already extracted"
            )
        self._extracted.add(partition_id)
        self._extracting += 1

    def _done_taking(self) -> bool:
        """End an extract begun by :meth:`_take`; return whether the caller frees the run now.

        True for one caller only: the one that ends while every owned
        partition is handed out and no other extract is still reading the
        run's state. Not the extract that took the last partition: on a
        worker of several threads another one may have taken its partition
        before and not yet read it, and freeing the run then left it with
        no pieces (found by a breaker, session 25).
        """
        with self._lock:
            self._extracting -= 1
            if self._extracting or self._extracted != self._owned or self._freeing:
                return False
            self._freeing = True
            return True

    def _count(self, name: str, value: float) -> None:
        """Add ``value`` to statistic ``name`` (from any thread)."""
        with self._lock:
            self.statistics[name] += value

    def fail(self, error: BaseException) -> None:
        """Fail the run on this rank: every wait raises ``error`` from now on; buffers are freed.

        Messages that still arrive for it are dropped.
        """
        with self._lock:
            if self._error is None:
                self._error = error
        self._acks_event.set()
        self._wake()
        self._free()

    def _raise_if_failed(self) -> None:
        err = self._error
        if err is not None:
            if isinstance(err, ShuffleError):
                raise err
            raise ShuffleError(f"{self.label} {self.op_id} failed on rank {self.comm.rank}: {err}") from err

    @property
    def inputs_done(self) -> bool:
        """Whether this rank's inputs are done (no more inserts accepted)."""
        return self._inputs_done

    @property
    def closed(self) -> bool:
        """Whether the run's state on this rank was freed."""
        return self._closed

    def close(self) -> None:
        """Free every buffer and spill file of the run on this rank (extracted data stays valid). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._free()
        self._after_close()
        if self._on_done is not None:
            self._on_done(self.op_id)
