"""The shuffler: one rank's share of one shuffle run.

A :class:`Shuffler` exists on every rank for each running shuffle (its
``op_id``). Insert tasks hand it the pieces of their input partition, already
split by output partition and packed (:class:`~mpshuffle.table.PackedData`);
it batches them per destination rank (the owner of each output partition,
:func:`~mpshuffle.table.partition_owner`) and sends each batch as one
*chunk*. Chunks that arrive go to the rank's *postbox*.

Completion is decided by *finish counting*: when all inserts are done (the
barrier task calls :meth:`Shuffler.insert_finished` on every rank through a
control message), each rank tells each peer how many chunks it sent to it.
A rank's output partitions are complete once every rank has reported and
that many chunks from each have arrived; :meth:`Shuffler.extract` waits for
that, then returns the partition's pieces ordered by input partition and
position, so output rows come in a deterministic order.

Message tags: ``("mps", op_id, kind)`` with kind ``"chunk"``, ``"finish"``,
``"inputs-done"`` or ``"inputs-done-ack"``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgpack

from mpshuffle.errors import (
    CommError,
    PartitionGoneError,
    ShuffleError,
    ShuffleTimeoutError,
    SpillError,
)
from mpshuffle.memory import BufferResource, MemoryType, Postbox
from mpshuffle.table import PackedData, owned_partitions, partition_owner

if TYPE_CHECKING:
    from mpshuffle.comm import Communicator, Frames, Tag

__all__ = ["TAG", "Shuffler", "Statistics"]

logger = logging.getLogger(__name__)

TAG = "mps"


class Statistics(dict):  # type: ignore[type-arg]
    """Counters of one shuffle run on one rank (a plain ``dict`` of numbers).

    Keys: ``bytes_inserted``, ``bytes_sent`` (to other ranks),
    ``bytes_received`` (from other ranks and itself), ``bytes_spilled``,
    ``bytes_unspilled``, ``chunks_sent``, ``chunks_received``,
    ``seconds_insert``, ``seconds_wait``, ``seconds_extract``,
    ``seconds_spill``, ``seconds_unspill``; bytes are packed sizes, seconds
    wall time summed over calls (spill time is part of receiving, on the
    progress thread; unspill time is part of extract).
    """


class Shuffler:
    """One rank's state of one shuffle run.

    Parameters
    ----------
    comm
        The generation's communicator.
    op_id
        Id of the run, unique within the generation.
    resource
        Where every buffer the shuffler holds is accounted (and spilled).
    batch_bytes
        Pieces for one destination are sent together up to about this many bytes.
    on_done
        Called once with ``op_id`` after this rank's last output partition was
        extracted, or when the run is closed.
    """

    op_id: int
    npartitions: int | None
    statistics: Statistics

    def __init__(
        self,
        comm: Communicator,
        op_id: int,
        *,
        resource: BufferResource,
        batch_bytes: int = 4 * 2**20,
        on_done: Callable[[int], None] | None = None,
    ) -> None:
        self.comm = comm
        self.op_id = op_id
        self.npartitions = None
        self.statistics = Statistics(
            bytes_inserted=0, bytes_sent=0, bytes_received=0, bytes_spilled=0,
            bytes_unspilled=0, chunks_sent=0, chunks_received=0,
            seconds_insert=0.0, seconds_wait=0.0, seconds_extract=0.0,
            seconds_spill=0.0, seconds_unspill=0.0,
        )
        self._batch_bytes = batch_bytes
        self._on_done = on_done
        self._lock = threading.Lock()
        self._complete = threading.Event()
        self._sent = [0] * comm.nranks
        self._received = [0] * comm.nranks
        self._expected: list[int | None] = [None] * comm.nranks
        self._inputs_done = False
        self._seq = 0
        self._error: BaseException | None = None
        self._owned: set[int] = set()
        self._extracted: set[int] = set()
        self._closed = False
        self.postbox = Postbox(resource, name=f"op{op_id}-r{comm.rank}")
        self._acks: set[int] = set()
        self._acks_event = threading.Event()
        self._barrier_running = False
        # The insert attempt whose data counts, per input partition (set by
        # the barrier); None keeps everything (no barrier named them).
        self._accepted: list[str] | None = None

    # -- insert ----------------------------------------------------------
    def insert(
        self, input_index: int, pieces: Mapping[int, PackedData], timeout: float, attempt: str = ""
    ) -> None:
        """Send the pieces of one input partition to their owners.

        Back-pressure: at most one chunk (about ``batch_bytes``) per
        destination rank is in flight; before sending the next chunk to a
        rank this waits, in the calling (task) thread, until the previous one
        was handed to the transport. Receivers keep their memory bounded by
        spilling, and while a receiver writes a spill file it reads no more
        data, so a slow disk slows the senders down instead of filling memory.
        The pieces are accounted as host memory while this call holds them.

        Parameters
        ----------
        input_index
            Index of the input partition (orders rows in the output).
        attempt
            Id of this execution of the insert task. An execution that Dask
            abandoned (its run restarted while it ran) can still be sending;
            the barrier names the attempt whose data counts, and extract drops
            the others' pieces.
        pieces
            Output partition id -> packed piece of that partition.
        timeout
            Seconds a send may take.

        Raises
        ------
        ShuffleError
            If a destination rank is lost or the run failed.
        """
        self._raise_if_failed()
        if self._inputs_done:
            raise ShuffleError(f"insert after insert_finished in shuffle op {self.op_id}")
        t0 = time.perf_counter()
        nranks = self.comm.nranks
        total = sum(p.nbytes for p in pieces.values())
        reservation = self.postbox.resource.reserve(MemoryType.HOST, total)
        batches: dict[int, list[tuple[int, PackedData]]] = {}
        sizes: dict[int, int] = {}
        in_flight: dict[int, Any] = {}
        try:
            for pid, packed in pieces.items():
                dest = partition_owner(pid, nranks)
                batches.setdefault(dest, []).append((pid, packed))
                sizes[dest] = sizes.get(dest, 0) + packed.nbytes
                if sizes[dest] >= self._batch_bytes:
                    self._send_after(in_flight, dest, (input_index, attempt), batches.pop(dest), timeout)
                    sizes[dest] = 0
            for dest, batch in batches.items():
                self._send_after(in_flight, dest, (input_index, attempt), batch, timeout)
            # One deadline for the last chunks: the error names every rank
            # that did not take its chunk, after one timeout at most.
            deadline, unsent = time.monotonic() + timeout, []
            for dest, fut in in_flight.items():
                try:
                    fut.result(max(0.0, deadline - time.monotonic()))
                except concurrent.futures.TimeoutError:
                    unsent.append(dest)
            if unsent:
                self._raise_unsent(unsent, timeout)
        except CommError as e:
            raise ShuffleError(f"sending a chunk of shuffle op {self.op_id} failed: {e}") from e
        finally:
            reservation.release()
        with self._lock:
            self.statistics["bytes_inserted"] += total
            self.statistics["seconds_insert"] += time.perf_counter() - t0

    def _send_after(
        self, in_flight: dict[int, Any], dest: int, source: tuple[int, str],
        batch: list[tuple[int, PackedData]], timeout: float,
    ) -> None:
        """Send a chunk to ``dest`` once the previous chunk to ``dest`` has gone."""
        previous = in_flight.get(dest)
        if previous is not None:
            try:
                previous.result(timeout)
            except concurrent.futures.TimeoutError:
                self._raise_unsent([dest], timeout)
            self._raise_if_failed()
        in_flight[dest] = self._send_chunk(dest, source, batch)

    def _raise_unsent(self, dests: list[int], timeout: float) -> None:
        """Raise the timeout of sends that did not complete, naming the ranks that stopped reading.

        A send completes when the transport took the chunk; one that does not
        within ``timeout`` means its destination stopped reading (the
        transport's buffers are full), so the error names the destination,
        not this rank.
        """
        who = ", ".join(f"rank {d} ({self.comm.addresses[d] or 'local'})" for d in sorted(dests))
        raise ShuffleTimeoutError(
            f"shuffle op {self.op_id}: {who} did not take a chunk from rank {self.comm.rank} within "
            f"{timeout:g} s (it stopped reading)",
            missing=tuple(sorted(dests)),
        )

    def _send_chunk(self, dest: int, source: tuple[int, str], batch: list[tuple[int, PackedData]]) -> Any:
        input_index, attempt = source
        header: list[Any] = []
        frames: list[Any] = [b""]
        nbytes = 0
        for pid, packed in batch:
            header.append((pid, input_index, attempt, self._seq, packed.nrows))
            self._seq += 1
            frames.extend(packed.to_frames())
            nbytes += packed.nbytes
        frames[0] = msgpack.packb(header)
        with self._lock:
            self._sent[dest] += 1
            self.statistics["chunks_sent"] += 1
            if dest != self.comm.rank:
                self.statistics["bytes_sent"] += nbytes
        return self.comm.send_nowait(dest, (TAG, self.op_id, "chunk"), frames)

    # -- receive (progress thread) ---------------------------------------
    def receive(self, src: int, tag: Tag, frames: Frames) -> None:
        """Handle one message of this run (called on the progress thread)."""
        kind = tag[2]
        if kind == "chunk":
            header = msgpack.unpackb(frames[0])
            per_piece = (len(frames) - 1) // max(len(header), 1)
            entries = []
            for k, (pid, input_index, attempt, seq, _nrows) in enumerate(header):
                piece = PackedData.from_frames(frames[1 + k * per_piece : 1 + (k + 1) * per_piece])
                entries.append((pid, (input_index, attempt, src, seq), piece))
            nbytes = sum(piece.nbytes for _, _, piece in entries)
            if self._error is None and not self._closed:
                try:
                    # Spilling happens here, on the progress thread: while it
                    # writes, no more data is read from the peers (back-pressure).
                    self.postbox.add_chunk(entries)
                except Exception as e:  # noqa: BLE001 -- any failure here must fail the run, not hang it
                    logger.error("mpshuffle: %s", e)
                    self.fail(e)
            with self._lock:
                self._received[src] += 1
                self.statistics["chunks_received"] += 1
                self.statistics["bytes_received"] += nbytes
            self._check_complete()
        elif kind == "finish":
            with self._lock:
                self._expected[src] = int(bytes(frames[0]))
            self._check_complete()
        elif kind == "inputs-done":
            info = msgpack.unpackb(frames[0])
            self.insert_finished(info["npartitions"], reply_to=src, accepted=info.get("accepted"))
        elif kind == "inputs-done-ack":
            with self._lock:
                self._acks.add(src)
                if len(self._acks) == self.comm.nranks:
                    self._acks_event.set()

    def _check_complete(self) -> None:
        with self._lock:
            if all(e is not None for e in self._expected) and self._received == self._expected:
                self._complete.set()

    # -- barrier ---------------------------------------------------------
    def insert_finished(
        self, npartitions: int, reply_to: int | None = None, accepted: list[str] | None = None
    ) -> None:
        """Mark this rank's inserts done: tell every peer how many chunks it got.

        Called on every rank by the barrier (through an ``"inputs-done"``
        control message); ``npartitions`` is the number of output partitions,
        ``accepted`` the insert attempt whose data counts for each input
        partition (``None``: all).
        """
        with self._lock:
            if self._inputs_done:
                first = False
            else:
                first = True
                self._inputs_done = True
                self._accepted = accepted
                self.npartitions = npartitions
                rank, nranks = self.comm.rank, self.comm.nranks
                self._owned = set(owned_partitions(rank, nranks, npartitions))
                sent = list(self._sent)
        if first:
            for dest in range(self.comm.nranks):
                self.comm.send_nowait(dest, (TAG, self.op_id, "finish"), [str(sent[dest]).encode()])
            # A rank that owns no output partition (npartitions < nranks) is
            # done now, unless it runs the barrier: closing would drop the
            # acks that barrier() still waits for; barrier() finishes it then.
            if not self._owned and not self._barrier_running:
                self._finish()
        if reply_to is not None:
            self.comm.send_nowait(reply_to, (TAG, self.op_id, "inputs-done-ack"), [])

    def barrier(self, npartitions: int, timeout: float, accepted: list[str] | None = None) -> None:
        """Run the shuffle's barrier from one rank (the barrier task's).

        Sends ``"inputs-done"`` (with ``npartitions`` and the ``accepted``
        insert attempt of each input partition) to every rank and waits until
        all confirmed.

        Raises
        ------
        ShuffleError
            Naming the ranks that did not confirm within ``timeout`` seconds,
            or the lost peer.
        """
        info = msgpack.packb({"npartitions": npartitions, "accepted": accepted})
        self._barrier_running = True
        for dest in range(self.comm.nranks):
            self.comm.send_nowait(dest, (TAG, self.op_id, "inputs-done"), [info])
        deadline = time.monotonic() + timeout
        while not self._acks_event.wait(0.1):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.comm.nranks)) - self._acks)
                who = ", ".join(f"rank {r} ({self.comm.addresses[r]})" for r in missing)
                raise ShuffleTimeoutError(
                    f"shuffle op {self.op_id}: {who} did not confirm the barrier within {timeout:g} s",
                    missing=tuple(missing),
                )
        self._raise_if_failed()
        # Our own ack came after our insert_finished, so _owned is set by now.
        if not self._owned:
            self._finish()

    # -- extract ---------------------------------------------------------
    def wait(self, timeout: float) -> None:
        """Block until this rank's output partitions are complete.

        Raises
        ------
        ShuffleError
            If the run failed (e.g. a peer was lost), or after ``timeout``
            seconds, naming the ranks whose data is still missing.
        """
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        while not self._complete.wait(0.1):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                with self._lock:
                    missing = [
                        r for r in range(self.comm.nranks)
                        if self._expected[r] is None or self._received[r] != self._expected[r]
                    ]
                who = ", ".join(f"rank {r} ({self.comm.addresses[r]})" for r in missing)
                raise ShuffleTimeoutError(
                    f"shuffle op {self.op_id} on rank {self.comm.rank}: data from {who} "
                    f"did not arrive within {timeout:g} s",
                    missing=tuple(missing),
                )
        self._raise_if_failed()
        self.statistics["seconds_wait"] += time.perf_counter() - t0

    def extract(self, partition_id: int, timeout: float) -> list[PackedData]:
        """Return the pieces of one output partition, ordered by input partition.

        Waits for completeness first (see :meth:`wait`). The partition's
        buffers leave the postbox; after the rank's last owned partition the
        run's state is freed.

        Raises
        ------
        PartitionGoneError
            If the partition was already extracted.
        ShuffleError
            As :meth:`wait`, or if the partition is not owned by this rank.
        """
        self.wait(timeout)
        t0 = time.perf_counter()
        with self._lock:
            if partition_id not in self._owned:
                raise ShuffleError(
                    f"output partition {partition_id} of shuffle op {self.op_id} is not owned by "
                    f"rank {self.comm.rank}"
                )
            if partition_id in self._extracted:
                raise PartitionGoneError(
                    f"output partition {partition_id} of shuffle op {self.op_id} was already extracted"
                )
            self._extracted.add(partition_id)
            last = self._extracted == self._owned
        try:
            pieces = self.postbox.pop(partition_id, keep=self._keep)
        except SpillError as e:
            self.fail(e)
            raise
        self._update_spill_statistics()
        self.statistics["seconds_extract"] += time.perf_counter() - t0
        if last:
            self._finish()
        return pieces

    def _keep(self, order: tuple[Any, ...]) -> bool:
        """Whether a piece (by its order key) came from its input's accepted attempt."""
        accepted = self._accepted
        if accepted is None:
            return True
        input_index, attempt = order[0], order[1]
        return 0 <= input_index < len(accepted) and accepted[input_index] == attempt

    # -- failure and cleanup ---------------------------------------------
    def fail(self, error: BaseException) -> None:
        """Fail the run on this rank: every wait raises ``error`` from now on.

        The postbox's buffers and spill files are freed at once; chunks that
        still arrive are dropped.
        """
        with self._lock:
            if self._error is None:
                self._error = error
        self._complete.set()
        self._acks_event.set()
        self.postbox.clear()

    def _raise_if_failed(self) -> None:
        err = self._error
        if err is not None:
            if isinstance(err, ShuffleError):
                raise err
            raise ShuffleError(f"shuffle op {self.op_id} failed on rank {self.comm.rank}: {err}") from err

    def _update_spill_statistics(self) -> None:
        box = self.postbox
        self.statistics["bytes_spilled"] = box.bytes_spilled
        self.statistics["bytes_unspilled"] = box.bytes_unspilled
        self.statistics["seconds_spill"] = box.seconds_spill
        self.statistics["seconds_unspill"] = box.seconds_unspill

    def _finish(self) -> None:
        self.close()

    @property
    def inputs_done(self) -> bool:
        """Whether :meth:`insert_finished` ran on this rank (no more inserts accepted)."""
        return self._inputs_done

    @property
    def closed(self) -> bool:
        """Whether the run's state on this rank was freed."""
        return self._closed

    def close(self) -> None:
        """Free every buffer and spill file of the run on this rank. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.postbox.clear()
        self._update_spill_statistics()
        if self._on_done is not None:
            self._on_done(self.op_id)
