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

Message tags: ``("mps", op_id, kind)`` with kind ``"chunk"``, ``"chunks"``
(small chunks held and sent together, :data:`SMALL_CHUNK_BYTES`: a list of
each chunk's frame count, then their frames), ``"finish"``,
``"inputs-done"`` or ``"inputs-done-ack"``.

A chunk is pieces of one input partition for one destination, a range of
neighbouring partitions (an insert cuts a destination's pieces in a few
such ranges, :data:`RELEASE_GROUPS`, so the receiver frees each once its
range is extracted), as one message whatever their number: a small header
(every piece's partition, row count, metadata and byte range as arrays,
each in the fewest bytes its values need: ~3-5 bytes a piece,
:func:`~mpshuffle.memory.postbox.compact_pieces`),
each distinct metadata once
(the pieces of one insert share theirs), then the data as few frames as
the pieces' memory allows (the pieces :func:`~mpshuffle.table._columns.pack`
writes for one destination are one contiguous range: one frame). So
thousands of tiny pieces cost a few array operations, not a header, two
frames and a message part each.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from mpshuffle.comm._pack import packb
from mpshuffle.comm.base import SendFuture
from mpshuffle.errors import (
    CommError,
    ShuffleError,
    ShuffleTimeoutError,
    SpillError,
)
from mpshuffle.memory import BufferResource, Chunk, MemoryType, Postbox
from mpshuffle.memory._pages import aligned_empty
from mpshuffle.memory.packed import PackedPieces, PieceTable
from mpshuffle.memory.postbox import compact_pieces
from mpshuffle.memory.resource import Reservation
from mpshuffle.shuffler.run import Run
from mpshuffle.table import PackedData
from mpshuffle.table.hashing import partition_owners

if TYPE_CHECKING:
    from mpshuffle.comm import Communicator, Frames, Tag
    from mpshuffle.memory.pool import HostPool
    from mpshuffle.table import FrameAdapter

__all__ = ["TAG", "Shuffler"]

logger = logging.getLogger(__name__)

TAG = "mps"

#: An insert's pieces for one destination go in up to this many chunks, each a
#: range of neighbouring partitions (pieces are in partition order), so the
#: receiver's postbox frees a chunk once its range is extracted instead of
#: holding every received chunk until the rank's last extract. Two, not eight
#: (session 26): chunks are at most ``batch_bytes`` (4 MiB) anyway, so the
#: groups only cut inserts of a few MiB per destination finer, and pages of
#: extracted pieces go back before their chunk does (see *Receive* in
#: ``docs/architecture.md``). With eight, a 35 MB insert sent each of 2 ranks
#: eight chunks of 2.2 MB instead of five of 4 MiB, and the messages cost: on the
#: 2-core VM the config line ran at 969-978 MB/s against 889 (1.82-1.85
#: against 1.98 CPU-s/GB, the same peak), the 1.6 GB time-to-space rechunk
#: in 1.29 s against 1.40-1.41 (medians, alternated); 120 partitions of
#: 4.4 MB (``extract_timeline.py``) cut the same and peaked the same.
RELEASE_GROUPS = 2
#: ... of at least this many bytes each: a chunk costs a message (a send, a
#: receive, an acknowledgement, between ranks of one host a shared-memory
#: file), measured at 0.2-0.4 ms of CPU on the 2-core VM, so at this size the
#: cut costs at most ~0.3 CPU-s/GB. An insert under it per destination still
#: sends one chunk there, and the number of chunks stays linear in bytes, not
#: in partitions.
RELEASE_MIN_BYTES = 2**20
#: Chunks of one insert in flight to one destination at most (sent, not yet
#: taken by the receiver). Two, not one: while the receiver takes a chunk
#: (maps it, and past its host budget writes it to its spill file) the next is
#: already there, so its progress thread goes on without waiting for this
#: sender's task thread to wake up and send again: with one, each of an
#: insert's ~16 chunks in the 4.5 GB out-of-core case waited for that round
#: trip, and the workers used more CPU (``benchmarks/results/README.md``).
#: What is in flight stays within the insert's own pieces, which exist anyway.
IN_FLIGHT = 2
#: Chunks in flight to one destination at most while the insert's chunks in
#: flight to all destinations (with those earlier inserts left copied in
#: flight; inserts on other threads count their own) hold under
#: :data:`IN_FLIGHT_BYTES` of data:
#: past :data:`IN_FLIGHT`, a sender waits for the oldest chunk only where the
#: bytes say so. Why (session 26): at 2 ranks on the 2-core VM the task thread
#: of a rechunk's insert waited 0.13-0.15 of its 0.40-0.46 s for
#: acknowledgements (the round trip through both ranks' progress threads, each
#: waiting for its process's GIL); with this bound it waited 0.06-0.08 and the
#: rechunk took 1.36-1.37 s against 1.46-1.52 (medians of 5, alternated). On many
#: ranks the bytes keep it at :data:`IN_FLIGHT` (16 ranks x 2 chunks of a few
#: MB are past the bound already), so what one rank can leave in ``/dev/shm``
#: before its receivers take it does not grow with the ranks.
IN_FLIGHT_MOST = 4
#: Bytes of data in the chunks an insert (with what earlier inserts left
#: copied in flight) may have in flight to all destinations before a
#: destination's sends beyond :data:`IN_FLIGHT` wait.
IN_FLIGHT_BYTES = 32 * 2**20
#: A chunk for another rank whose pieces' data are at most this many bytes
#: is copied at once and held with the other small chunks for that rank; they
#: go as one ``"chunks"`` message once they reach :data:`HELD_BYTES`,
#: and the rest when this rank's inputs are done (:meth:`Shuffler.insert_finished`).
#: Why: an input partition of a few hundred rows (thousands of partitions)
#: sends each rank a chunk of a few KB per insert, and each message cost a
#: wake of the progress thread, the GIL handed to it and back, and a
#: message's framing and reading on both ranks: per pair of (input
#: partition, rank), what issue 24 asks to make per rank.
SMALL_CHUNK_BYTES = 64 * 1024
#: Held small chunks for one rank go once they reach this many bytes. Below
#: the transport's shared-memory threshold (256 KiB), so that they arrive in
#: one buffer of the receiver's own, freed as a whole: in a shared-memory
#: file each of their thousands of frames was a mapping whose pages every
#: extract looked at giving back (``PieceTable.release_pages``).
HELD_BYTES = 192 * 1024
#: A chunk for another rank of more than :data:`SMALL_CHUNK_BYTES` and less
#: than this many bytes (an insert with under :data:`RELEASE_MIN_BYTES` for
#: that rank) is held as well, apart from the small ones, copied into one
#: buffer per destination (from the run's pool) that goes as one
#: ``"chunks"`` message once the next chunk would not fit in
#: :data:`HELD_MEDIUM_BYTES`. Why: such chunks come from inputs that are
#: small against the ranks' number, as a rechunk's blocks are: at 16 ranks a
#: 4 MB block gives each rank ~250 KB, below the transport's shared-memory
#: threshold, and the 24,000 socket messages of a 6.4 GB time-to-space
#: rechunk made it slower than P2P's (``benchmarks/results/README.md``,
#: session 24). Held, they go between ranks of one host as a few
#: shared-memory files, for one copy more on the sender.
MEDIUM_CHUNK_BYTES = RELEASE_MIN_BYTES
#: Bytes of one destination's buffer of held medium chunks: at least the
#: transport's shared-memory threshold (256 KiB), so that it goes as a file.
HELD_MEDIUM_BYTES = 4 * 2**20


class Shuffler(Run):
    """One rank's state of one host run (see :class:`~mpshuffle.shuffler.run.Run` for the lifecycle).

    Parameters
    ----------
    comm
        The generation's communicator.
    op_id
        Id of the run, unique within the generation.
    resource
        Where every buffer the shuffler holds is accounted (and spilled).
    timeout
        Seconds any wait of the run may take (a send, the barrier, extract).
    batch_bytes
        Pieces for one destination are sent together up to about this many bytes.
    pool
        Host memory that :meth:`insert_frame`'s pieces are placed in (reused
        across inserts and runs), or ``None``.
    on_done
        Called once with ``op_id`` after this rank's last output partition was
        extracted, or when the run is closed.
    """

    def __init__(
        self,
        comm: Communicator,
        op_id: int,
        *,
        resource: BufferResource,
        timeout: float,
        batch_bytes: int = 4 * 2**20,
        pool: HostPool | None = None,
        on_done: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(comm, op_id, resource=resource, timeout=timeout, on_done=on_done)
        self._batch_bytes = batch_bytes
        self.pool = pool
        self._complete = threading.Event()
        self._sent = [0] * comm.nranks
        self._received = [0] * comm.nranks
        self._expected: list[int | None] = [None] * comm.nranks
        self._seq = 0
        self.postbox = Postbox(resource, name=f"op{op_id}-r{comm.rank}")
        self._barrier_running = False
        # Per destination, sends of earlier inserts whose bytes the transport
        # copied already (SendFuture.copied) and that their receiver may not
        # have taken yet, oldest first; guarded by _lock.
        self._copied_in_flight: dict[int, collections.deque[SendFuture]] = collections.defaultdict(collections.deque)
        # Per (destination, medium), small or medium chunks copied and held
        # until they go together (SMALL_CHUNK_BYTES, MEDIUM_CHUNK_BYTES);
        # guarded by _lock.
        self._held: dict[tuple[int, bool], _Held] = {}

    def set_run_options(self, timeout: float | None, batch_bytes: int | None) -> None:
        """Apply the run's ``timeout`` and ``batch_bytes`` (see :meth:`Run.set_run_options`)."""
        super().set_run_options(timeout, batch_bytes)
        if batch_bytes is not None:
            self._batch_bytes = batch_bytes

    def run_options(self) -> dict[str, Any]:
        """``timeout`` (seconds) and ``batch_bytes`` in force on this rank."""
        return {**super().run_options(), "batch_bytes": self._batch_bytes}

    # -- insert ----------------------------------------------------------
    def insert_frame(
        self, input_index: int, frame: Any, adapter: FrameAdapter, on: Sequence[Any],
        npartitions: int, ids: Any = None, attempt: str = "",
    ) -> None:
        """Split ``frame`` with ``adapter`` by output partition and :meth:`insert` the pieces.

        The pieces this rank keeps and those it sends are placed apart, in
        memory from the :class:`~mpshuffle.memory.pool.HostPool` (if the run
        has one), so a sent piece's memory is reused by the next insert.
        """
        pieces = adapter.split_for(
            frame, list(on), npartitions, ids, rank=self.comm.rank, nranks=self.comm.nranks, pool=self.pool
        )
        # pack's pieces lie in memory made for them, which nothing here holds after the call.
        self.insert(input_index, pieces, attempt=attempt, given=isinstance(pieces, PackedPieces))

    def insert_frames(
        self, input_index: int, parts: Sequence[tuple[Any, FrameAdapter]], npartitions: int, attempt: str = "",
    ) -> None:
        """Split several frames of one input (each by its own adapter) and :meth:`insert` all their pieces at once.

        For inputs cut by position rather than by key (a rechunk's blocks,
        whose adapters know their place, so ``on`` and ``ids`` are not
        used). The pieces go in order of partition, each partition's in the
        order of ``parts``, so per destination rank they travel in the same
        chunks, sized as one insert's (:func:`_batches`): a chunk per frame
        and rank was a message of a frame's bytes over the ranks, which at
        16 ranks made the 4 MB blocks of a time-to-space rechunk 24,000
        socket messages of ~250 KB.

        Parameters
        ----------
        input_index, attempt
            As :meth:`insert`: one input, one attempt, for all the frames.
        parts
            ``(frame, adapter)`` pairs.
        npartitions
            Output partitions of the run.
        """
        rank, nranks = self.comm.rank, self.comm.nranks
        pairs: list[tuple[int, PackedData]] = []
        for frame, adapter in parts:
            pieces = adapter.split_for(frame, [], npartitions, None, rank=rank, nranks=nranks, pool=self.pool)
            pairs.extend(pieces.items())
        pairs.sort(key=lambda pair: pair[0])  # stable: each partition's pieces in the order of parts
        self.insert(input_index, pairs, attempt=attempt)

    def insert(
        self, input_index: int, pieces: Mapping[int, PackedData] | Sequence[tuple[int, PackedData]],
        attempt: str = "", *, given: bool = False,
    ) -> None:
        """Send the pieces of one input partition to their owners.

        Back-pressure: at most :data:`IN_FLIGHT` chunks (about ``batch_bytes``
        each) per destination rank are in flight, up to :data:`IN_FLIGHT_MOST`
        while the chunks this insert (and earlier ones, copied) has in flight
        hold under :data:`IN_FLIGHT_BYTES`;
        before sending the next chunk to a rank past that this waits, in the
        calling (task) thread, until the oldest of them was handed to the
        transport. Receivers keep their memory bounded by
        spilling, and while a receiver writes a spill file it reads no more
        data, so a slow disk slows the senders down instead of filling memory.
        The pieces are accounted as host memory while this call holds them.

        The call returns once every chunk's bytes left the pieces: it waits
        for the last chunks to be taken only where the transport still reads
        the pieces' memory. A chunk the transport copied at once (into a
        shared-memory file, see :class:`~mpshuffle.comm.base.SendFuture`)
        stays in flight past the call and counts against the next inserts'
        :data:`IN_FLIGHT` to its destination, so the bound holds across
        inserts; a receiver lost meanwhile fails the run as before. Waiting
        for those acknowledgements at the end of every insert kept the task
        thread idle for about a third of its time in ``insert`` on a loaded
        2-core machine (``seconds_insert_wait``).

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
            Output partition id -> packed piece of that partition; or
            ``(partition id, piece)`` pairs, several per partition allowed,
            in the order they go.
        given
            Whether the pieces' memory is handed over: nothing but the run
            reads or writes it after the call (pieces packed for this call
            alone). Then the receivers may give the pages of extracted
            pieces back before the last piece of their chunk is extracted
            (:class:`~mpshuffle.memory.postbox.Chunk`'s ``given``).

        Raises
        ------
        ShuffleError
            If a destination rank is lost or the run failed.
        """
        self._raise_if_failed()
        if self._inputs_done:
            raise ShuffleError(f"insert after insert_finished in shuffle op {self.op_id}")
        t0 = time.perf_counter()
        nranks, timeout = self.comm.nranks, self.timeout
        table = _table_of(pieces)
        reservation = self.postbox.resource.reserve(MemoryType.HOST, table.nbytes)
        in_flight: dict[int, list[SendFuture]] = {}
        waited = 0.0
        try:
            for dest, ix in _batches(table, nranks, self._batch_bytes):
                waited += self._send_after(in_flight, dest, (input_index, attempt, given), table, ix, timeout)
            # One deadline for the last chunks: the error names every rank
            # that did not take its chunk, after one timeout at most.
            t_wait = time.perf_counter()
            deadline, unsent = time.monotonic() + timeout, []
            for dest, futs in in_flight.items():
                copied = [f for f in futs if f.copied]
                if copied:
                    with self._lock:
                        self._copied_in_flight[dest].extend(copied)
                try:
                    for fut in futs:
                        if not fut.copied:
                            fut.result(max(0.0, deadline - time.monotonic()))
                        elif fut.done():
                            fut.result()  # raises a failed send's error here, as a wait would
                except concurrent.futures.TimeoutError:
                    unsent.append(dest)
            if unsent:
                self._raise_unsent(unsent, timeout)
            waited += time.perf_counter() - t_wait
        except CommError as e:
            raise ShuffleError(f"sending a chunk of shuffle op {self.op_id} failed: {e}") from e
        finally:
            reservation.release()
        with self._lock:
            self.statistics["bytes_inserted"] += int(table.size.sum())
            self.statistics["seconds_insert"] += time.perf_counter() - t0
            self.statistics["seconds_insert_wait"] += waited

    def _send_after(
        self, in_flight: dict[int, list[SendFuture]], dest: int, source: tuple[int, str, bool],
        table: PieceTable, ix: npt.NDArray[np.int64], timeout: float,
    ) -> float:
        """Send a chunk to ``dest`` once the bound on chunks in flight allows it.

        Fewer than :data:`IN_FLIGHT` chunks to ``dest`` in flight always
        allow it; fewer than :data:`IN_FLIGHT_MOST` allow it while the chunks
        in flight to every rank (this insert's, and those earlier inserts
        left copied in flight), this one included, hold at most
        :data:`IN_FLIGHT_BYTES` of data.

        Returns the seconds it waited for that.
        """
        futs = in_flight.setdefault(dest, [])
        nbytes = int(table.size[ix].sum())
        waited = 0.0
        while True:
            with self._lock:
                earlier = self._copied_in_flight.get(dest)
                while earlier and earlier[0].done() and earlier[0].exception() is None:
                    earlier.popleft()
                oldest = None
                count = len(futs) + (len(earlier) if earlier else 0)
                if count >= IN_FLIGHT and (
                    count >= IN_FLIGHT_MOST or self._bytes_in_flight(in_flight) + nbytes > IN_FLIGHT_BYTES
                ):
                    # The oldest send to dest: an earlier insert's, else this one's.
                    oldest = earlier.popleft() if earlier else futs.pop(0)
            if oldest is None:
                break
            t0 = time.perf_counter()
            try:
                oldest.result(timeout)
            except concurrent.futures.TimeoutError:
                self._raise_unsent([dest], timeout)
            waited += time.perf_counter() - t0
            self._raise_if_failed()
        futs.append(self._send_chunk(dest, source, table, ix, nbytes))
        return waited

    def _bytes_in_flight(self, in_flight: dict[int, list[SendFuture]]) -> int:
        """Data bytes of the chunks not yet taken: this insert's (``in_flight``) and those earlier inserts
        left copied in flight; under the run's lock."""
        mine = sum(f.nbytes for futs in in_flight.values() for f in futs if not f.done())
        return mine + sum(f.nbytes for futs in self._copied_in_flight.values() for f in futs if not f.done())

    def _raise_unsent(self, dests: list[int], timeout: float) -> None:
        """Raise the timeout of sends that did not complete, naming the ranks that stopped reading.

        A send completes when the transport took the chunk; one that does not
        within ``timeout`` means its destination stopped reading (the
        transport's buffers are full), so the error names the destination,
        not this rank.
        """
        me = self.comm.rank
        others = [d for d in sorted(dests) if d != me]
        parts = []
        if others:
            who = ", ".join(self.comm.describe(d) for d in others)
            parts.append(f"{who} did not take a chunk from rank {me} within {timeout:g} s (it stopped reading)")
        if me in dests:
            # A chunk for this rank goes through its own progress thread: that
            # thread, not a peer, was too slow for the timeout.
            parts.append(
                f"rank {me}'s own progress thread did not file a chunk for rank {me} within {timeout:g} s "
                "(the worker is too busy for the timeout, or the timeout is too short)"
            )
        raise ShuffleTimeoutError(f"shuffle op {self.op_id}: " + "; ".join(parts), missing=tuple(sorted(dests)))

    def _send_chunk(
        self, dest: int, source: tuple[int, str, bool], table: PieceTable, ix: npt.NDArray[np.int64], data_bytes: int,
    ) -> SendFuture:
        input_index, attempt, given = source
        small = data_bytes <= SMALL_CHUNK_BYTES
        medium = not small and data_bytes < MEDIUM_CHUNK_BYTES
        held = (small or medium) and dest != self.comm.rank
        # Held chunks are sent without ``given``: small ones arrive in one
        # buffer of the receiver, which frees it as a whole (giving their pages
        # back piece by piece cost more than the shuffle at 2000 -> 2000
        # partitions of 500 rows); medium ones go through /dev/shm, whose
        # pages every extract gives back as any mapped chunk's.
        with self._lock:  # inserts on several threads each take their own range of sequence numbers
            seq, self._seq = self._seq, self._seq + len(ix)
        frames, nbytes = _chunk_frames(input_index, attempt, seq, table, ix, given=given and not held)
        with self._lock:
            self._sent[dest] += 1
            self.statistics["chunks_sent"] += 1
            if dest != self.comm.rank:
                self.statistics["bytes_sent"] += nbytes
        if held:
            return self._hold(dest, frames, medium=medium)
        tag = (TAG, self.op_id, "chunk")
        if small:
            # A small chunk for this rank goes to its postbox here, in the
            # task thread, as the progress thread would file it: through the
            # communicator it cost a wake of the progress thread's loop and a
            # wait for it per insert (the GIL handed back and forth), for a
            # message that moves no byte. A large one still goes through the
            # progress thread, which files it (and past the budget writes it
            # to the spill file) while this thread packs and sends the next:
            # filed here, the 4.5 GB out-of-core shuffle took ~15 % more time.
            self.receive(dest, tag, frames)
            return _done(copied=False)
        fut = self.comm.send_nowait(dest, tag, frames)
        fut.nbytes = data_bytes
        return fut

    def _hold(self, dest: int, frames: list[Any], *, medium: bool = False) -> SendFuture:
        """Copy a small (or ``medium``) chunk for ``dest`` and hold it (see :data:`SMALL_CHUNK_BYTES`,
        :data:`MEDIUM_CHUNK_BYTES`).

        Returns the future of the message that took the held chunks if they
        reached :data:`HELD_BYTES` (a medium chunk: if this chunk would not
        fit beside them in :data:`HELD_MEDIUM_BYTES`; it then starts the next
        buffer). That future counts against :data:`IN_FLIGHT` as any send's;
        else a future that is done already.
        """
        key = (dest, medium)
        if not medium:
            copies = [f if isinstance(f, bytes) else memoryview(f).cast("B").tobytes() for f in frames]
            nbytes = sum(len(c) for c in copies)
            reservation = self.postbox.resource.reserve(MemoryType.HOST, nbytes)
            with self._lock:
                held = self._held.setdefault(key, _Held())
                held.counts.append(len(copies))
                held.frames.extend(copies)
                held.reservations.append(reservation)
                held.nbytes += nbytes
                full = held.nbytes >= HELD_BYTES
            sent = self._send_held(key) if full else None
            return sent if sent is not None else _done(copied=True)
        views = [memoryview(f).cast("B") for f in frames]
        nbytes = sum(v.nbytes for v in views)
        reservation = self.postbox.resource.reserve(MemoryType.HOST, nbytes)
        with self._lock:
            filled = self._held.get(key)
            if filled is not None and filled.nbytes + nbytes > HELD_MEDIUM_BYTES:
                del self._held[key]
            else:
                filled = None
            into = self._held.get(key)
            if into is None:
                buffer = self.pool.array(HELD_MEDIUM_BYTES) if self.pool is not None else aligned_empty(HELD_MEDIUM_BYTES)
                into = self._held[key] = _Held(buffer=buffer)
            assert into.buffer is not None
            at = into.nbytes
            for v in views:
                # Header and metadata are bytes already: kept as they are, not copied.
                if isinstance(v.obj, bytes):
                    into.frames.append(v.obj)
                else:
                    into.buffer[at : at + v.nbytes] = np.frombuffer(v, np.uint8)
                    into.frames.append(into.buffer[at : at + v.nbytes])
                    at += v.nbytes
            into.counts.append(len(views))
            into.reservations.append(reservation)
            into.nbytes = at
        return self._send_chunks(dest, filled) if filled is not None else _done(copied=True)

    def _send_held(self, key: tuple[int, bool]) -> SendFuture | None:
        """Send the chunks held for ``key`` (destination, medium) as one ``"chunks"`` message; ``None`` if none are held."""
        with self._lock:
            held = self._held.pop(key, None)
        return None if held is None else self._send_chunks(key[0], held)

    def _send_chunks(self, dest: int, held: _Held) -> SendFuture:
        fut = self.comm.send_nowait(dest, (TAG, self.op_id, "chunks"), [packb(held.counts), *held.frames])
        # The bytes are the transport's now (as a copied message's are).
        fut.copied = True
        fut.nbytes = held.nbytes
        held.release()
        return fut

    def _send_all_held(self) -> None:
        with self._lock:
            keys = list(self._held)
        for key in keys:
            self._send_held(key)

    # -- receive (progress thread) ---------------------------------------
    def receive(self, src: int, tag: Tag, frames: Frames) -> None:
        """Handle one message of this run (on the progress thread; a small chunk of this rank's own, on the inserting thread)."""
        kind = tag[2]
        if kind == "chunk":
            self._receive_chunk(src, frames)
            self._check_complete()
        elif kind == "chunks":
            at = 1
            for n in msgpack.unpackb(frames[0]):
                self._receive_chunk(src, frames[at : at + n])
                at += n
            self._check_complete()
        elif kind == "finish":
            with self._lock:
                self._expected[src] = int(bytes(frames[0]))
            self._check_complete()
        elif kind == "inputs-done":
            info = msgpack.unpackb(frames[0])
            self.insert_finished(info["npartitions"], reply_to=src, accepted=info.get("accepted"))
        elif kind == "inputs-done-ack":
            self._record_ack(src)

    def _receive_chunk(self, src: int, frames: Frames) -> None:
        chunk = _received_chunk(src, frames)
        nbytes = chunk.data_bytes
        if self._error is None and not self._closed:
            try:
                # Spilling happens here, on the progress thread: while it
                # writes, no more data is read from the peers (back-pressure).
                self.postbox.add_chunk(chunk)
            except Exception as e:  # noqa: BLE001 -- any failure here must fail the run, not hang it
                logger.error("mpshuffle: %s", e)
                self.fail(e)
        with self._lock:
            self._received[src] += 1
            self.statistics["chunks_received"] += 1
            self.statistics["bytes_received"] += nbytes

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
                self._mark_inputs_done(npartitions, accepted)
                sent = list(self._sent)
        if first:
            # The small chunks still held go now; completion counts chunks, so
            # they may arrive after the count.
            self._send_all_held()
            for dest in range(self.comm.nranks):
                self.comm.send_nowait(dest, (TAG, self.op_id, "finish"), [str(sent[dest]).encode()])
            # A rank that owns no output partition (npartitions < nranks) is
            # done now, unless it runs the barrier: closing would drop the
            # acks that barrier() still waits for; barrier() finishes it then.
            if not self._owned and not self._barrier_running:
                self._finish()
        if reply_to is not None:
            self.comm.send_nowait(reply_to, (TAG, self.op_id, "inputs-done-ack"), [])

    def barrier(self, npartitions: int, accepted: list[str] | None = None) -> None:
        """Run the shuffle's barrier from one rank (the barrier task's).

        Sends ``"inputs-done"`` (with ``npartitions`` and the ``accepted``
        insert attempt of each input partition) to every rank and waits until
        all confirmed.

        Raises
        ------
        ShuffleError
            Naming the ranks that did not confirm within :attr:`timeout`
            seconds, or the lost peer.
        """
        info = msgpack.packb({"npartitions": npartitions, "accepted": accepted})
        self._barrier_running = True
        for dest in range(self.comm.nranks):
            self.comm.send_nowait(dest, (TAG, self.op_id, "inputs-done"), [info])
        self._wait_acks(self.timeout)
        # Our own ack came after our insert_finished, so _owned is set by now.
        if not self._owned:
            self._finish()

    # -- extract ---------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Block until this rank's output partitions are complete.

        Raises
        ------
        ShuffleError
            If the run failed (e.g. a peer was lost), or after ``timeout``
            seconds (by default :attr:`timeout`), naming the ranks whose data
            is still missing.
        """
        timeout = self.timeout if timeout is None else timeout
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
                who = ", ".join(self.comm.describe(r) for r in missing)
                raise ShuffleTimeoutError(
                    f"shuffle op {self.op_id} on rank {self.comm.rank}: data from {who} "
                    f"did not arrive within {timeout:g} s",
                    missing=tuple(missing),
                )
        self._raise_if_failed()
        self._count("seconds_wait", time.perf_counter() - t0)

    def extract(self, partition_id: int) -> Sequence[PackedData]:
        """Return the pieces of one output partition, ordered by input partition.

        They come as a :class:`~mpshuffle.memory.packed.PieceTable` (a
        sequence of :class:`PackedData` built on demand, over the received
        frames).

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
        self.wait()
        t0 = time.perf_counter()
        with self._lock:
            self._take(partition_id)
        try:
            pieces = self.postbox.pop(partition_id, keep=self._keep)
        except SpillError as e:
            self.fail(e)
            raise
        finally:
            last = self._done_taking()
        self._update_spill_statistics()
        self._count("seconds_extract", time.perf_counter() - t0)
        if last:
            self._finish()
        return pieces

    def move_to_disk(self) -> int:
        """Move the chunks this rank holds in memory to its spill file; returns the bytes moved.

        See :meth:`mpshuffle.memory.postbox.Postbox.move_to_disk`. A failed
        write fails the run (its error names the disk).

        Returns
        -------
        int
            Bytes moved; 0 if the run failed, closed or held nothing in memory.
        """
        if self._error is not None or self._closed:
            return 0
        try:
            moved = self.postbox.move_to_disk()
        except SpillError as e:
            self.fail(e)
            return 0
        self._update_spill_statistics()
        return moved

    def _keep(self, order: tuple[Any, ...]) -> bool:
        """Whether a piece (by its order key) came from its input's accepted attempt."""
        accepted = self._accepted
        if accepted is None:
            return True
        input_index, attempt = order[0], order[1]
        return 0 <= input_index < len(accepted) and accepted[input_index] == attempt

    # -- failure and cleanup ---------------------------------------------
    def _wake(self) -> None:
        self._complete.set()

    def _free(self) -> None:
        with self._lock:
            self._copied_in_flight.clear()
            held, self._held = list(self._held.values()), {}
        for h in held:
            h.release()
        self.postbox.clear()
        self._update_spill_statistics()

    def _update_spill_statistics(self) -> None:
        box = self.postbox
        self.statistics["bytes_spilled_disk"] = box.bytes_spilled
        self.statistics["bytes_unspilled_disk"] = box.bytes_unspilled
        self.statistics["seconds_spill_disk"] = box.seconds_spill
        self.statistics["seconds_unspill_disk"] = box.seconds_unspill

    def _finish(self) -> None:
        self.close()


@dataclasses.dataclass
class _Held:
    """Small or medium chunks held for one destination (see :data:`SMALL_CHUNK_BYTES`, :data:`MEDIUM_CHUNK_BYTES`)."""

    #: Frames per chunk, in order; the chunks' frames one after another, copied.
    counts: list[int] = dataclasses.field(default_factory=list)
    frames: list[Any] = dataclasses.field(default_factory=list)
    #: Medium chunks: the buffer their data frames were copied into, back to back.
    buffer: npt.NDArray[np.uint8] | None = None
    #: Their bytes, and what accounts them in the host budget.
    nbytes: int = 0
    reservations: list[Reservation] = dataclasses.field(default_factory=list)

    def release(self) -> None:
        for r in self.reservations:
            r.release()


def _done(*, copied: bool) -> SendFuture:
    """A send future that is done already (a chunk filed or held here)."""
    fut = SendFuture()
    fut.copied = copied
    fut.set_result(None)
    return fut


def _table_of(pieces: Mapping[int, PackedData] | Sequence[tuple[int, PackedData]]) -> PieceTable:
    """The pieces of one insert as a :class:`~mpshuffle.memory.packed.PieceTable`, in the mapping's (or pairs') order.

    :func:`~mpshuffle.table._columns.pack`'s pieces are one already; for
    others, pieces that are slices of one parent ``pyarrow.Buffer`` (pooled or
    packed memory) are byte ranges of that parent, so adjacent ones travel
    as one frame.
    """
    if isinstance(pieces, PackedPieces):
        return pieces.table
    pairs = list(pieces.items()) if isinstance(pieces, Mapping) else list(pieces)
    pids = np.fromiter((pid for pid, _ in pairs), np.int64, len(pairs))
    values = [piece for _, piece in pairs]
    table = PieceTable.of_pieces(values, pids)
    datas = [p.data for p in values]
    parents = [d.parent if type(d) is pa.Buffer else None for d in datas]
    if not values or any(parent is None for parent in parents):
        return table
    # pyarrow gives a new object for every .parent: parents are the same
    # buffer where they span the same bytes.
    number: dict[tuple[int, int], int] = {}
    buffers: list[Any] = []
    buffer_of = np.empty(len(values), np.int32)
    offset = np.empty(len(values), np.int64)
    for i, (d, parent) in enumerate(zip(datas, parents, strict=True)):
        assert parent is not None
        span = (parent.address, parent.size)
        if span not in number:
            number[span] = len(buffers)
            buffers.append(parent)
        buffer_of[i] = number[span]
        offset[i] = d.address - parent.address
    return PieceTable(
        pids=pids, nrows=table.nrows, meta_of=table.meta_of, metas=table.metas,
        buffer_of=buffer_of, offset=offset, size=table.size, buffers=buffers,
    )


def _batches(table: PieceTable, nranks: int, batch_bytes: int) -> list[tuple[int, npt.NDArray[np.int64]]]:
    """The chunks to send: ``(destination rank, piece numbers)``, in the order they fill.

    Pieces go to their partition's owner
    (:func:`~mpshuffle.table.hashing.partition_owners`), in table order; a chunk
    closes at the piece that brings it to its destination's chunk size
    (:func:`_chunk_bytes`: ``batch_bytes`` at most, and an
    :data:`RELEASE_GROUPS`-th of the bytes the destination gets where that
    is :data:`RELEASE_MIN_BYTES` or more, so that with the table in partition
    order each chunk is a range of partitions the receiver frees once that
    range is extracted). Closed chunks are sent in
    the order they closed (the order a loop over the pieces would send them,
    so the destinations take turns), the rest after, by destination.
    """
    n = len(table)
    if n == 0:
        return []
    dest = partition_owners(table.pids, nranks)
    by_dest = np.argsort(dest, kind="stable")
    sorted_dest = dest[by_dest]
    cuts = np.flatnonzero(sorted_dest[1:] != sorted_dest[:-1]) + 1
    closed: list[tuple[int, int, npt.NDArray[np.int64]]] = []
    rest: list[tuple[int, int, npt.NDArray[np.int64]]] = []
    size = table.size
    for lo, hi in zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [n])).tolist(), strict=True):
        ix = by_dest[lo:hi]
        d = int(sorted_dest[lo])
        total = np.cumsum(size[ix])
        target = _chunk_bytes(int(total[-1]), batch_bytes)
        start = 0
        while start < len(ix):
            before = int(total[start - 1]) if start else 0
            end = int(np.searchsorted(total, before + target, side="left"))  # the piece reaching it
            if end >= len(ix):
                rest.append((int(ix[start]), d, ix[start:]))
                break
            closed.append((int(ix[end]), d, ix[start : end + 1]))
            start = end + 1
    closed.sort(key=lambda c: c[0])
    rest.sort(key=lambda c: c[1])
    return [(d, ix) for _, d, ix in closed + rest]


def _chunk_bytes(nbytes: int, batch_bytes: int) -> int:
    """Bytes at which a chunk of an insert's ``nbytes`` for one destination closes.

    ``nbytes`` split evenly (rounded up) in :data:`RELEASE_GROUPS` groups, or
    in fewer where a group would be under :data:`RELEASE_MIN_BYTES` (one when
    ``nbytes`` is under it), and never above ``batch_bytes``: at most
    ``RELEASE_GROUPS`` chunks, or one per ``batch_bytes``, whichever is more.
    """
    groups = min(RELEASE_GROUPS, nbytes // RELEASE_MIN_BYTES)
    return min(batch_bytes, -(-nbytes // groups)) if groups > 1 else batch_bytes


def _chunk_frames(
    input_index: int, attempt: str, seq: int, table: PieceTable, ix: npt.NDArray[np.int64], *, given: bool = False
) -> tuple[list[Any], int]:
    """The frames of one chunk of pieces ``ix`` of ``table`` (see the module docstring) and its data bytes.

    ``given``: the data frames' memory is handed over (see :meth:`Shuffler.insert`).
    """
    n = len(ix)
    meta_of: npt.NDArray[Any]
    if len(table.metas) == 1:
        meta_frames: list[Any] = list(table.metas) if n else []
        meta_of = np.zeros(n, np.int32)
    else:
        used, inverse = np.unique(table.meta_of[ix], return_inverse=True)
        meta_frames = [table.metas[m] for m in used.tolist()]
        meta_of = inverse.astype(np.int32)
    buffer_of, at, size = table.buffer_of[ix], table.offset[ix], table.size[ix]
    # One frame per run of adjacent pieces of one buffer (one per chunk for
    # pack's pieces: each destination's are contiguous).
    if n:
        starts = np.flatnonzero(np.concatenate(
            ([True], (buffer_of[1:] != buffer_of[:-1]) | (at[1:] != at[:-1] + size[:-1]))))
    else:
        starts = np.zeros(0, np.int64)
    first = np.zeros(n, np.int32)
    first[starts[1:]] = 1
    frame_of = np.cumsum(first, dtype=np.int32)
    ends = np.append(starts[1:], n) - 1
    offset = at - at[starts][frame_of]
    data_frames: list[Any] = [
        table.buffers[b].slice(lo, hi - lo)
        for b, lo, hi in zip(buffer_of[starts].tolist(), at[starts].tolist(), (at[ends] + size[ends]).tolist(),
                             strict=True)
    ]
    header = packb({
        "input": input_index, "attempt": attempt, "seq": seq, "metas": len(meta_frames),
        "pieces": compact_pieces(table.pids[ix], table.nrows[ix], meta_of, frame_of, offset, size),
        **({"given": True} if given else {}),
    })
    return [header, *meta_frames, *data_frames], int(size.sum())


def _received_chunk(src: int, frames: Frames) -> Chunk:
    """The :class:`~mpshuffle.memory.postbox.Chunk` of a received chunk's frames; the data stays in the frames."""
    header = msgpack.unpackb(frames[0])
    nmetas = header["metas"]
    return Chunk.received(
        header["input"], header["attempt"], src, header["seq"], pieces=header["pieces"],
        metas=[bytes(f) for f in frames[1 : 1 + nmetas]],
        frames=frames[1 + nmetas :], given=header.get("given", False),
    )
