"""Snapshots: the state at a position, so that opening replays only the records after it.

Where they live: two side topics next to the state topic, ``<topic>-snapshots`` (the state's
bytes, in chunks of at most ``chunk_bytes``, so no single-message cap applies) and
``<topic>-snapshot-index`` (one small manifest per complete snapshot, written after all its
chunks). Keeping them off the state topic means the log stays a pure sequence of records,
and opening reads only the small index, the chosen snapshot's chunks, and the log's tail.

By default the state topic is never trimmed: the log stays the source of truth, so a missing
or damaged snapshot falls back to an older one, or to a full replay. With ``trim_history``,
after each snapshot it writes, a replica moves the library's durable subscription on the state
topic (and on the chunk and index topics) to just before what the ``keep_snapshots`` newest
snapshots need (the message each covers, its chunks, its manifest): the broker may then delete
whole ledgers behind it, as retention allows. A replica still reading behind that point falls
forward to a snapshot (``Replica``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar, cast

from ._admin import AdminClient, TopicName
from ._codecs import Codec, StreamingCodec
from ._context import Context
from ._durable import DurableState, LogMark
from ._envelope import (
    SnapshotManifest,
    decode_chunk,
    decode_manifest,
    encode_chunk,
    encode_manifest,
    message_fingerprint,
)
from ._errors import (
    ClosedError,
    CodecError,
    CorruptRecordError,
    OperationTimeoutError,
    PulsarStateError,
    WriterBusyError,
)
from ._pulsar import (
    LogPosition,
    PulsarConnection,
    ReopeningReader,
    StateWriter,
    TailProbe,
    wait_bounded,
)
from ._replica import Replica
from ._retry import is_transient

__all__ = ["SnapshotPolicy", "SnapshotStore", "digest_of"]

T = TypeVar("T")

# Snapshot chunks the client may receive ahead of reads, and the bytes read ahead of a durable
# state storing them: what a snapshot being loaded holds in memory besides the store.
_CHUNK_PREFETCH = 8
_STORE_AHEAD_BYTES = 32 * 1024 * 1024
# Chunks of a snapshot being written sent and not yet confirmed: the bytes held meanwhile.
_CHUNKS_IN_FLIGHT = 8
# The bytes digested per worker-thread step of a streamed determinism check.
_DIGEST_STEP_BYTES = 1024 * 1024
# How long closing waits for a snapshot taken by hand to stop making parts.
_TAKES_STOP_S = 10.0
# The pause before the next automatic snapshot after one failed, doubling up to the maximum.
_AUTO_RETRY_S = 1.0
_AUTO_RETRY_MAX_S = 300.0
_AUTO_BUSY_MAX_S = 30.0


def run_in_own_thread(work: Callable[[], T], name: str) -> asyncio.Future[T]:
    """``work()`` in a new daemon thread; its outcome as a future of the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(cast(T, result))

    def run() -> None:
        try:
            result, error = work(), None
        except BaseException as exc:
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=f"pulsar-state-{name}", daemon=True).start()
    return future


async def wait_out(future: asyncio.Future[Any]) -> None:
    """Wait until ``future`` is done, even through cancellations (re-raised after): for a
    thread that must end before its caller goes on (it may hold a write transaction)."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:
            break
    if cancelled:
        raise asyncio.CancelledError


def close_iterator(items: object) -> None:
    """Run a generator's own cleanup now (a store's read transaction), not whenever it is
    collected; other iterators have none."""
    close = getattr(items, "close", None)
    if close is not None:
        close()


class Chunked:
    """The bytes of ``parts`` joined, cut into chunks of ``size`` (the last may be shorter;
    at least one, empty for no bytes), counted and digested as they go by."""

    def __init__(self, parts: Iterable[bytes], size: int) -> None:
        self._parts = parts
        self._size = size
        self.digest = hashlib.sha256()
        self.total = 0
        self.count = 0

    def __iter__(self) -> Iterator[bytes]:
        size, pending = self._size, bytearray()
        try:
            for part in self._parts:
                view = memoryview(part)
                if pending:
                    wanted = size - len(pending)
                    pending += view[:wanted]
                    view = view[wanted:]
                    if len(pending) < size:
                        continue
                    yield self._counted(bytes(pending))
                    pending.clear()
                while len(view) >= size:
                    yield self._counted(bytes(view[:size]))
                    view = view[size:]
                pending += view
            if pending or not self.count:
                yield self._counted(bytes(pending))
        finally:
            close_iterator(self._parts)

    def _counted(self, chunk: bytes) -> bytes:
        self.digest.update(chunk)
        self.total += len(chunk)
        self.count += 1
        return chunk


_END: Any = object()


async def step_in_worker(items: Iterator[T]) -> AsyncGenerator[T, None]:
    """The items of a blocking iterator, each made in a worker thread. A step under way when
    the consumer stops is waited out before the iterator is closed (on the loop): it may
    read a store whose transaction the close ends."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            step = loop.run_in_executor(None, next, items, _END)
            await wait_out(step)
            item = step.result()
            if item is _END:
                return
            yield item
    finally:
        close_iterator(items)


logger = logging.getLogger(__name__)

# How long the log is asked for a message the admin tail says is not there.
_ABSENT_CHECK_S = 2.0
# How often a snapshot being loaded reports its progress (INFO, and on_progress while opening).
_LOAD_REPORT_EVERY_S = 2.0
# The second look of a fall-forward: long enough for a topic being loaded again, short enough
# that several checks fit in the fall-forward's own deadline (open_timeout_s).
_PATIENT_CHECK_S = 15.0

S = TypeVar("S")


class SnapshotStore:
    """Reads and writes the snapshots of one state topic."""

    def __init__(
        self,
        conn: PulsarConnection,
        admin: AdminClient,
        topic: TopicName,
        *,
        chunk_bytes: int,
        timeout_s: float,
    ) -> None:
        self.conn = conn
        self._admin = admin
        self.state_topic = topic
        self.data_topic = TopicName.parse(f"{topic}-snapshots")
        self.index_topic = TopicName.parse(f"{topic}-snapshot-index")
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s
        self._data_hold: TailProbe | None = None
        self._index_hold: TailProbe | None = None
        # Where each manifest read by manifests() is on the index topic (by snapshot id), and
        # the index message just before it (None: the first one read).
        self._index_at: dict[str, tuple[LogPosition, LogPosition | None]] = {}

    async def hold(self, *, name: str) -> None:
        """Hold the side topics' messages with the library's durable subscription, as the
        state topic's are: under a finite retention, a topic without one loses its messages
        as soon as a ledger closes. Idempotent."""
        if self._data_hold is None:
            self._data_hold = await self.conn.create_tail_probe(str(self.data_topic), name=name)
        if self._index_hold is None:
            self._index_hold = await self.conn.create_tail_probe(str(self.index_topic), name=name)

    async def trim_chunks_through(self, position: LogPosition) -> None:
        """Let the broker delete the chunk topic's ledgers wholly at or before ``position``."""
        if self._data_hold is not None:
            await self._data_hold.hold_after(position)

    async def trim_index_before(self, kept: Iterable[SnapshotManifest]) -> None:
        """Let the broker delete the index topic's ledgers wholly before the manifests of
        ``kept`` (as read by :meth:`manifests`): the index would otherwise grow by one
        manifest a snapshot for ever, and every open and every trim reads all of it."""
        found = [self._index_at.get(manifest.snapshot_id) for manifest in kept]
        if self._index_hold is None or not found or None in found:
            return
        # Through the message just before the earliest kept manifest: at an entry 0, that is
        # the previous ledger's last one.
        _, before = min(at for at in found if at is not None)
        if before is not None:
            await self._index_hold.hold_after(before)

    async def close(self) -> None:
        for hold in (self._data_hold, self._index_hold):
            if hold is not None:
                await hold.close()
        self._data_hold = self._index_hold = None

    async def manifests(self) -> list[SnapshotManifest]:
        """Every complete snapshot's manifest, oldest first (the index is small; with
        ``trim_history`` it is trimmed behind the kept snapshots)."""
        status, _ = await self._admin.get(self.index_topic.rest_path + "/lastMessageId")
        if status == 404:
            return []
        tail = await self._admin.last_position(self.index_topic)
        if tail is None:
            return []
        reader = await ReopeningReader(self.conn, str(self.index_topic)).open()
        found: list[SnapshotManifest] = []
        index_at: dict[str, tuple[LogPosition, LogPosition | None]] = {}
        previous: LogPosition | None = None
        seen: set[SnapshotManifest] = set()
        try:
            async with asyncio.timeout(self._timeout_s):
                while True:
                    message = await reader.read_next()  # (never one read before)
                    try:
                        manifest = decode_manifest(
                            message.payload, message_id=str(message.position)
                        )
                        if manifest not in seen:  # (the same one stored twice: a resend)
                            seen.add(manifest)
                            found.append(manifest)
                            index_at.setdefault(manifest.snapshot_id, (message.position, previous))
                    except CorruptRecordError as exc:
                        logger.warning("ignoring a damaged snapshot manifest: %s", exc)
                    previous = message.position
                    if message.position >= tail:
                        self._index_at = index_at
                        return found
        except TimeoutError as exc:  # the library's own error, which callers handle
            raise OperationTimeoutError(
                f"reading the snapshot index {self.index_topic} took over {self._timeout_s}s "
                f"({len(found)} manifests read)"
            ) from exc
        finally:
            await reader.close()

    async def chunks_trimmed(self, manifest: SnapshotManifest) -> bool:
        """Whether the snapshot's first chunk is gone because the chunk topic was trimmed
        behind it (``trim_history``: the topic now begins after it), not lost or damaged."""
        at = LogPosition(manifest.first_chunk_ledger, manifest.first_chunk_entry)
        reader = await ReopeningReader(
            self.conn, str(self.data_topic), at=at, prefetch=_CHUNK_PREFETCH
        ).open()
        try:
            async with asyncio.timeout(self._timeout_s):
                message = await reader.read_next()
        except TimeoutError:
            return False  # nothing there at all: not a trim, which keeps the newer chunks
        finally:
            await reader.close()
        return message.position > at

    async def load(
        self, manifest: SnapshotManifest, *, progress: Callable[[int], None] | None = None
    ) -> bytes:
        """The snapshot's bytes, checked chunk by chunk and against its digest."""
        return b"".join([chunk async for chunk in self.load_chunks(manifest, progress=progress)])

    async def load_chunks(
        self, manifest: SnapshotManifest, *, progress: Callable[[int], None] | None = None
    ) -> AsyncGenerator[bytes, None]:
        """The snapshot's chunks in order as they are read, each checked; after the last
        one, the whole is checked against the digest: CorruptRecordError then (the caller
        must not have kept anything of it), as for a chunk missing or out of order.
        ``progress``: called with the bytes read so far after each chunk."""
        at = LogPosition(manifest.first_chunk_ledger, manifest.first_chunk_entry)
        missing = CorruptRecordError(
            f"snapshot {manifest.snapshot_id}: chunks missing from {self.data_topic}",
            message_id=f"{at.ledger}:{at.entry}",
        )
        tail = await self._admin.last_position(self.data_topic)
        if tail is None or tail < at:
            raise missing
        # Chunks are big (a megabyte by default): a few ahead are enough to keep reading.
        reader = await ReopeningReader(
            self.conn, str(self.data_topic), at=at, prefetch=_CHUNK_PREFETCH
        ).open()
        digest, size, due = hashlib.sha256(), 0, 0
        last_seen: LogPosition | None = None
        try:
            while due < manifest.chunks:
                if last_seen is not None and last_seen >= tail:
                    raise missing  # the data topic ends before the snapshot's last chunk
                # Each read is bounded, not the whole load: a snapshot of many gigabytes takes
                # as long as it takes while chunks keep coming (and the caller's work between
                # chunks is its own; a timeout must not span a generator's yield).
                async with asyncio.timeout(self._timeout_s):
                    message = await reader.read_next()
                if last_seen is None and message.position != at:
                    raise missing  # its first chunk is gone (trimmed): the reader started later
                last_seen = message.position
                snapshot_id, index, count, data = decode_chunk(
                    message.payload, message_id=str(message.position)
                )
                if snapshot_id != manifest.snapshot_id or count not in (0, manifest.chunks):
                    continue  # a chunk of an unfinished snapshot written in between
                if index < due:
                    # Sent again by the client (stored, but the acknowledgement was lost in a
                    # reconnect): the same bytes as the one read already.
                    continue
                if index != due:
                    raise CorruptRecordError(
                        f"snapshot {snapshot_id}: chunk {index} where {due} was due",
                        message_id=str(message.position),
                    )
                digest.update(data)
                size += len(data)
                due += 1
                if progress is not None:
                    progress(size)
                if due == manifest.chunks and (
                    size != manifest.size or digest.hexdigest() != manifest.digest
                ):
                    raise CorruptRecordError(
                        f"snapshot {manifest.snapshot_id} does not match its digest",
                        message_id=f"{at.ledger}:{at.entry}",
                    )
                yield data
        finally:
            await reader.close()

    async def log_message(
        self, at: LogPosition | None, *, patient: bool = False
    ) -> tuple[LogPosition, str] | None:
        """The state topic's message ``at`` a position (None: its first message), as its
        position and fingerprint; None when the topic holds no such message.

        A reader asked to start at a position the topic does not have starts elsewhere, so
        the caller compares the position returned with the one it asked for.
        """
        tail = await self._admin.last_position(self.state_topic)
        # The admin tail can lag just after the topic moved to a new ledger (an unload, a
        # rollover): "nothing there" from it is only a hint, so the log itself is asked then,
        # briefly (``patient``: longer, for a second look). A message found proves the position;
        # none within the bound means none.
        absent_hint = tail is None or (at is not None and tail < at)
        if not absent_hint:
            wait_s = self._timeout_s
        else:
            wait_s = min(self._timeout_s, _PATIENT_CHECK_S if patient else _ABSENT_CHECK_S)
        reader = await ReopeningReader(self.conn, str(self.state_topic), at=at).open()
        try:
            async with asyncio.timeout(wait_s):
                message = await reader.read_next()
        except TimeoutError:
            if absent_hint:
                return None
            raise
        finally:
            await reader.close()
        message_id = str(message.position)
        return message.position, message_fingerprint(message.payload, message_id=message_id)

    async def first_position_from(self, at: LogPosition) -> LogPosition:
        """The position of the state topic's first message at or after ``at`` (later if
        ``at`` was trimmed away), by a reader alone; OperationTimeoutError if none comes in
        time (a caller that knows one is there asks again)."""
        reader = await ReopeningReader(self.conn, str(self.state_topic), at=at, prefetch=1).open()
        try:
            async with asyncio.timeout(min(self._timeout_s, _PATIENT_CHECK_S)):
                message = await reader.read_next()
        except TimeoutError as exc:
            raise OperationTimeoutError(
                f"no message of {self.state_topic} came from {at} on"
            ) from exc
        finally:
            await reader.close()
        return message.position

    async def incarnation_mismatch(
        self, manifest: SnapshotManifest, *, patient: bool = False
    ) -> str | None:
        """Why ``manifest`` does not describe the state topic as it is now, or None if it does.

        Checked: the covered message is on the topic at its position (ledger ids are never
        reused, so a topic deleted and created again has none of the old positions) with the
        same record, and the topic's first message is the one the snapshot's history began
        with. A manifest written before these fingerprints existed is checked on what it
        has: the covered message's position.
        """
        if manifest.position == 0 and manifest.log_ledger < 0:
            return None  # the empty state: it describes any topic
        covered = LogPosition(manifest.log_ledger, manifest.log_entry)
        mismatch = await self.covered_mismatch(
            covered, manifest.log_covered_record, what="the snapshot", patient=patient
        )
        if mismatch is not None:
            return mismatch
        if manifest.log_first_record is None:
            return None  # an older manifest: nothing more to check
        first = await self.log_message(None, patient=patient)
        first_at = LogPosition(manifest.log_first_ledger or 0, manifest.log_first_entry or 0)
        if first is not None and first[0] > first_at:
            # The log's beginning was trimmed. Ledger ids are never reused, so the covered
            # message, found above at its position, already identifies this history.
            return None
        if first is None or first != (first_at, manifest.log_first_record):
            return (
                f"the log begins with {first}, the snapshot's history with "
                f"{(first_at, manifest.log_first_record)}"
            )
        return None

    async def covered_mismatch(
        self, covered: LogPosition, record: str | None, *, what: str, patient: bool = False
    ) -> str | None:
        """Why the state topic does not hold ``record`` (its fingerprint: a record id) at
        ``covered``, the last message ``what`` covers; None if it does. Ledger ids are never
        reused, so another topic, or one deleted and created again, has no such message."""
        found = await self.log_message(covered, patient=patient)
        if found is None or found[0] != covered:
            return f"the log has no message at {covered}, the last one {what} covers"
        if record is not None and found[1] != record:
            return f"the message at {covered} is {found[1]}, not {record}"
        return None

    async def write(
        self,
        parts: Iterable[bytes],
        *,
        position: int,
        record_id: str,
        log_position: LogPosition,
        writer_id: str,
        origin: str | None = None,
        stale: tuple[tuple[str, int], ...] = (),
        count: int = 0,
    ) -> SnapshotManifest:
        """Write the snapshot whose bytes are ``parts`` joined as chunks, then the manifest.
        ``count``: the number of chunks when known ahead (bytes known whole), written in
        each chunk; 0 for a streamed snapshot (the manifest has it: readers before 0.2 skip
        such chunks, taking the snapshot as incomplete).
        The parts are made in a worker thread as the chunks are sent (a few in flight), so
        no more than a few chunks are held. Raises WriterBusyError if another process is
        writing a snapshot right now."""
        snapshot_id = uuid.uuid4().hex
        first: tuple[LogPosition, str] | None = None
        covered: tuple[LogPosition, str] | None = None
        if log_position.ledger >= 0:
            # The incarnation fingerprint: which log this state was read from.
            first = await self.log_message(None)
            covered = await self.log_message(log_position)
            if first is None or covered is None or covered[0] != log_position:
                raise PulsarStateError(
                    f"{self.state_topic} no longer holds message {log_position} of this "
                    "replica's history (was the topic deleted?): no snapshot written"
                )
        chunked = Chunked(parts, self._chunk_bytes)
        data_writer = await self._exclusive_writer(self.data_topic)
        try:
            index_writer = await self._exclusive_writer(self.index_topic)
            try:
                first_chunk = await self._send_chunks(data_writer, snapshot_id, chunked, count)
                manifest = SnapshotManifest(
                    snapshot_id=snapshot_id,
                    position=position,
                    record_id=record_id,
                    log_ledger=log_position.ledger,
                    log_entry=log_position.entry,
                    size=chunked.total,
                    chunks=chunked.count,
                    digest=chunked.digest.hexdigest(),
                    first_chunk_ledger=first_chunk.ledger,
                    first_chunk_entry=first_chunk.entry,
                    created_at=time.time(),
                    writer_id=writer_id,
                    log_first_ledger=None if first is None else first[0].ledger,
                    log_first_entry=None if first is None else first[0].entry,
                    log_first_record=None if first is None else first[1],
                    log_covered_record=None if covered is None else covered[1],
                    log_origin=origin,
                    log_stale=stale,
                )
                # Written last: a snapshot is used only once all its chunks are durable.
                async with asyncio.timeout(self._timeout_s):
                    await index_writer.send(encode_manifest(manifest), key=snapshot_id)
            finally:
                await index_writer.close()
        finally:
            await data_writer.close()
        return manifest

    def chunks_for(self, size: int) -> int:
        """How many chunks ``size`` bytes take (at least one)."""
        return max(1, -(-size // self._chunk_bytes))

    async def _send_chunks(
        self, writer: StateWriter, snapshot_id: str, chunked: Chunked, count: int
    ) -> LogPosition:
        """Send the chunks, at most :data:`_CHUNKS_IN_FLIGHT` unconfirmed at a time; the
        position of the first."""
        in_flight: deque[asyncio.Future[LogPosition]] = deque()
        first: LogPosition | None = None
        try:
            async with contextlib.aclosing(step_in_worker(iter(chunked))) as chunks:
                index = 0
                async for chunk in chunks:
                    if len(in_flight) >= _CHUNKS_IN_FLIGHT:
                        sent = await in_flight.popleft()
                        first = first or sent
                    payload = encode_chunk(snapshot_id, index, count, chunk)
                    in_flight.append(
                        asyncio.ensure_future(writer.send(payload, key=f"{snapshot_id}/{index}"))
                    )
                    index += 1
            while in_flight:
                sent = await in_flight.popleft()
                first = first or sent
        finally:
            for send in in_flight:  # failed or cancelled: the rest are not waited for
                send.cancel()
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)
        assert first is not None  # at least one chunk, even for no bytes
        return first

    async def _exclusive_writer(self, topic: TopicName) -> StateWriter:
        # Exclusive: one snapshotting process at a time; another gets WriterBusyError.
        return await self.conn.create_writer(
            str(topic),
            fencing=False,
            send_timeout_s=self._timeout_s,
            timeout_s=self._timeout_s,
        )

    async def latest(self) -> SnapshotManifest | None:
        """The newest manifest (the index topic's last message), or None."""
        status, _ = await self._admin.get(self.index_topic.rest_path + "/lastMessageId")
        if status == 404 or await self._admin.last_position(self.index_topic) is None:
            return None
        reader = await self.conn.create_reader(str(self.index_topic), last=True)
        try:
            async with asyncio.timeout(self._timeout_s):
                # The C++ reader positions a "latest, inclusive" start on this call.
                if not await reader.has_message_available():
                    return None
                message = await reader.read_next()
            return decode_manifest(message.payload, message_id=str(message.position))
        except CorruptRecordError:
            return None
        finally:
            await reader.close()


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _decoded(codec: Codec[S], data: bytes) -> S:
    """``codec.decode(data)``; whatever it raises is a CodecError (the snapshot is unusable:
    the caller falls back to an older one or to the log)."""
    try:
        return codec.decode(data)
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(
            f"snapshot_codec could not decode the snapshot: {type(exc).__name__}: {exc}"
        ) from exc


def encode_checked(codec: Codec[S], state: S) -> bytes:
    """The state's snapshot bytes, refused (CodecError) unless they load back exactly.

    A lossy codec (JSON turning int dict keys into str, say) would make the replicas that
    load the snapshot differ from those that replay, and the digest check compares bytes, so
    it would not notice: ``encode(decode(b)) == b`` always, and ``decode(b) == state`` when
    the state's type defines equality.
    """
    data = codec.encode(state)
    try:
        loaded = codec.decode(data)
    except Exception as exc:
        raise CodecError(f"snapshot_codec cannot decode the bytes it encoded: {exc}") from exc
    if codec.encode(loaded) != data:
        raise CodecError(
            "snapshot_codec is lossy: encode(decode(bytes)) differs from the bytes; "
            "no snapshot written"
        )
    if type(state).__eq__ is not object.__eq__ and not bool(loaded == state):
        raise CodecError(
            f"snapshot_codec is lossy: the state decoded from a snapshot is not equal to the "
            f"state encoded ({type(state).__name__}; e.g. JSON turns int dict keys into str); "
            "no snapshot written"
        )
    return data


class SnapshotPolicy(Generic[S]):
    """When and how this replica takes, loads and checks snapshots.

    Opening loads the newest snapshot that checks out. The writer asks :meth:`after_batch`
    whether one is due (``snapshot_every_records`` / ``snapshot_every_bytes``). The newest
    snapshot not loaded is kept to check the replayed state against its digest when the
    replica reaches its version (:meth:`check_determinism`, a replica ``after_apply`` hook).
    """

    def __init__(
        self,
        context: Context,
        store: SnapshotStore,
        codec: Codec[S],
        replica: Replica[S, Any],
        copy_state: Callable[[S], S],
        trim_log: Callable[[LogPosition], Awaitable[None]] | None = None,
        keep_snapshots: int = 2,
        durable: DurableState[S] | None = None,
    ) -> None:
        self._context = context
        self._durable = durable
        self._trim_log = trim_log
        self._keep_snapshots = keep_snapshots
        self._store = store
        self._codec = codec
        self._replica = replica
        self._copy_state = copy_state
        self._writer_id = context.writer_id
        self._settings = context.settings
        self._stats = context.stats
        self._topic = context.topic
        self.loaded: SnapshotManifest | None = None
        self._to_verify: SnapshotManifest | None = None
        self._last_version = 0
        self._bytes_at_last = 0
        self._task: asyncio.Task[None] | None = None
        # After an automatic snapshot failed: none is started before this (loop time), and
        # the pause doubles with each failure in a row (each attempt copies the state).
        self._auto_after = float("-inf")
        self._auto_pause = _AUTO_RETRY_S
        self._busy_pause = _AUTO_RETRY_S  # the same, while other processes are writing one
        # True while a snapshot is being stored into a durable state: its content may change
        # before the replica's version does, so no snapshot is taken meanwhile.
        self._storing = False
        # A worker thread encoding a snapshot, maybe of an attempt that timed out (_encode).
        self._encoding = False
        # A determinism check of a streamed codec under way (see check_determinism).
        self._checking: asyncio.Task[None] | None = None
        # Snapshots being taken (automatic or by hand): each a future done when it ends.
        self._takes: set[asyncio.Future[None]] = set()
        # Told (manifest, bytes read, seconds) every few seconds while a snapshot loads.
        self.on_load_progress: Callable[[SnapshotManifest, int, float], None] | None = None

    @classmethod
    async def start(
        cls,
        context: Context,
        store: SnapshotStore,
        codec: Codec[S],
        replica: Replica[S, Any],
        copy_state: Callable[[S], S],
        *,
        load: bool,
        trim_log: Callable[[LogPosition], Awaitable[None]] | None = None,
        keep_snapshots: int = 2,
        durable: DurableState[S] | None = None,
        on_load_progress: Callable[[SnapshotManifest, int, float], None] | None = None,
    ) -> SnapshotPolicy[S]:
        """The policy of a replica about to start: loads the newest good snapshot into it
        (unless ``load`` is False) and registers the determinism check as its hook.
        ``trim_log``: trim the history behind the ``keep_snapshots`` newest snapshots.
        ``durable``: a snapshot is loaded by storing it there (not by decoding it)."""
        policy = cls(context, store, codec, replica, copy_state, trim_log, keep_snapshots, durable)
        policy.on_load_progress = on_load_progress
        hooks = list(replica.after_apply)
        replica.after_apply.append(policy.check_determinism)
        try:
            if await policy.load_newest(load=load):
                await replica.open_reader(store.conn)  # resume right after the snapshot
        except BaseException:
            replica.after_apply[:] = hooks  # a retried start registers its own hook
            raise
        return policy

    async def fall_forward(self, needed: int) -> bool:
        """Load the newest good snapshot at a position of at least ``needed`` (the replica is
        behind a trimmed log); False if there is none."""
        # A transient failure is raised (for the caller to retry), not taken for a bad
        # snapshot: falling back to an older one would find its history trimmed away.
        if await self.load_newest(load=True, at_least=needed, transient_raises=True):
            return True
        # None found is a forked history only if it still holds on a second look: the list
        # of snapshots may predate the one the log was trimmed behind (written and trimmed
        # since it was read), and a topic being unloaded answers "no such message" briefly.
        logger.info(
            "no snapshot of %s at position %d or later checked out; looking again",
            self._topic,
            needed,
        )
        return await self.load_newest(
            load=True, at_least=needed, transient_raises=True, patient=True
        )

    async def holds_message(self, at: LogPosition) -> bool:
        """Whether the state topic still holds its message at ``at`` (not trimmed away),
        asked when a message after it was read: only a message read at another position
        proves it gone. A reader alone (no admin request: the data path's own access)."""
        return await self._store.first_position_from(at) == at

    async def load_newest(
        self,
        *,
        load: bool,
        at_least: int = 0,
        transient_raises: bool = False,
        patient: bool = False,
    ) -> bool:
        """Load the newest snapshot that checks out; older ones are fallbacks. True if one was.
        ``patient``: wait for the log as long as for any read before calling a message absent."""
        # By position, newest first (ties: the one written last): a lagging or slow process
        # may write a snapshot of an older position after a newer one. That among the
        # snapshots of the history of the one written last; the others (a topic deleted and
        # created again writes after its old snapshots) after them, the last written first.
        written = await self._store.manifests()
        origin = written[-1].log_origin if written else None
        manifests = sorted(
            (m for m in reversed(written) if m.log_origin == origin),
            key=lambda m: m.position,
            reverse=True,
        ) + [m for m in reversed(written) if m.log_origin != origin]
        if manifests and not load:
            self._to_verify = manifests[0]
            return False
        for manifest in manifests:
            if manifest.position < at_least:
                continue
            try:
                mismatch = await self._store.incarnation_mismatch(manifest, patient=patient)
                if mismatch is not None:
                    logger.warning(
                        "snapshot %s of %s (position %d) was taken of another history of the "
                        "topic (deleted and created again?): %s; not loading it",
                        manifest.snapshot_id,
                        self._topic,
                        manifest.position,
                        mismatch,
                    )
                    continue
                started = time.monotonic()
                at = LogPosition(manifest.log_ledger, manifest.log_entry)
                if self._durable is not None:
                    mark = LogMark(
                        manifest.position,
                        manifest.record_id,
                        at,
                        manifest.log_origin,
                        manifest.log_stale,
                    )
                    self._storing = True  # until the replica is at the snapshot's version
                    try:
                        state = await self._store_streamed(self._durable, manifest, mark)
                    except BaseException:
                        self._storing = False
                        raise
                else:
                    data = await self._store.load(manifest, progress=self._reporter(manifest))
                    state = await asyncio.to_thread(_decoded, self._codec, data)
            except (PulsarStateError, TimeoutError) as exc:
                if transient_raises and is_transient(exc):
                    raise
                if transient_raises and isinstance(exc, TimeoutError):
                    raise OperationTimeoutError(f"loading snapshot {manifest.snapshot_id}") from exc
                logger.warning(
                    "snapshot %s of %s (position %d) is unusable, falling back: %s",
                    manifest.snapshot_id,
                    self._topic,
                    manifest.position,
                    exc,
                )
                self._to_verify = self._to_verify or manifest
                continue
            self._replica.load(
                state,
                manifest.position,
                manifest.record_id,
                LogPosition(manifest.log_ledger, manifest.log_entry),
                manifest.log_origin,
                manifest.log_stale,
            )
            self._storing = False
            self._last_version = manifest.position
            self.loaded = manifest
            self._stats.snapshot_loaded_position = manifest.position
            logger.info(
                "loaded snapshot of %s at position %d (%.1f MB) in %.2fs",
                self._topic,
                manifest.position,
                manifest.size / 1e6,
                time.monotonic() - started,
            )
            return True
        if manifests:
            logger.warning("no usable snapshot of %s: replaying the whole log", self._topic)
        return False

    def _reporter(self, manifest: SnapshotManifest) -> Callable[[int], None]:
        """A ``progress`` for loading ``manifest``: a line at INFO (and ``on_load_progress``)
        every :data:`_LOAD_REPORT_EVERY_S`, as a long replay reports."""
        started = time.monotonic()
        due = started + _LOAD_REPORT_EVERY_S

        def report(loaded: int) -> None:
            nonlocal due
            now = time.monotonic()
            if now < due:
                return
            due = now + _LOAD_REPORT_EVERY_S
            logger.info(
                "loading snapshot %s of %s (position %d): %.1f/%.1f MB, %.0fs",
                manifest.snapshot_id,
                self._topic,
                manifest.position,
                loaded / 1e6,
                manifest.size / 1e6,
                now - started,
            )
            hook = self.on_load_progress
            if hook is not None:
                try:
                    hook(manifest, loaded, now - started)
                except Exception:
                    logger.exception("on_progress callback raised")

        return report

    async def _store_streamed(
        self, durable: DurableState[S], manifest: SnapshotManifest, mark: LogMark
    ) -> S:
        """Load a snapshot into a durable state while its chunks are still being read: the
        state stores them in a thread of its own as they arrive (one transaction of its own),
        so reading and storing overlap. A damaged snapshot raises in that thread, from the
        chunks' iterator, before anything is committed; the thread has always ended (its
        transaction committed or aborted) when this returns or raises."""
        chunks: queue.SimpleQueue[bytes | BaseException | None] = queue.SimpleQueue()
        loop = asyncio.get_running_loop()
        exhausted = False
        ahead = 0  # bytes read and not yet taken by the state
        taken = asyncio.Event()

        def took(size: int) -> None:
            nonlocal ahead
            ahead -= size
            taken.set()

        def arriving() -> Iterator[bytes]:
            nonlocal exhausted
            while (item := chunks.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads
                    loop.call_soon_threadsafe(took, len(item))
                yield item
            exhausted = True

        # Not the default executor: this thread waits on the download, and the admin
        # client's calls run there.
        storing = run_in_own_thread(
            lambda: durable.load_snapshot(self._replica.state, arriving(), mark),
            f"store-snapshot-{manifest.snapshot_id[:8]}",
        )
        storing.add_done_callback(lambda _: taken.set())
        try:
            async with contextlib.aclosing(
                self._store.load_chunks(manifest, progress=self._reporter(manifest))
            ) as loading:
                async for chunk in loading:
                    # Bounded: a state slower than the broker does not have the whole
                    # snapshot piled up in memory ahead of it.
                    while ahead > _STORE_AHEAD_BYTES and not storing.done():
                        taken.clear()
                        await taken.wait()
                    if storing.done():
                        break  # it failed: its error is raised below
                    ahead += len(chunk)
                    chunks.put(chunk)
            chunks.put(None)
        except BaseException as exc:
            chunks.put(exc)
            raise
        finally:
            await wait_out(storing)
        state = storing.result()
        if not exhausted:
            # The digest is checked as the last chunk is read: a state that returned before
            # reading to the end stored a snapshot nobody checked.
            # Not a PulsarStateError: no falling back to another snapshot or a replay on
            # top of what it stored. A broken DurableState fails the open, loudly.
            raise RuntimeError(
                f"the durable state returned before reading all of snapshot "
                f"{manifest.snapshot_id}: it must iterate the chunks to their end"
            )
        return state

    def check_determinism(self, version: int, state: S) -> None:
        """Compare the replayed state with a snapshot another replica took at this version."""
        manifest = self._to_verify
        if manifest is None or manifest.position != version:
            return
        self._to_verify = None
        if manifest.record_id != self._replica.last_record_id:
            # Record ids are unique to one history: this snapshot is of another incarnation
            # of the topic (deleted and created again), so there is nothing to compare.
            logger.warning(
                "snapshot %s of %s was taken after record %s, this log has %s at position %d: "
                "it belongs to another history of the topic, not checked",
                manifest.snapshot_id,
                self._topic,
                manifest.record_id,
                self._replica.last_record_id,
                version,
            )
            return
        if isinstance(self._codec, StreamingCodec):
            # A state too big to encode whole (and on the loop): digested part by part in a
            # worker thread, from a copy of this moment, while the replica goes on.
            if self._checking is None and not self._context.closed:
                view = self._copy_state(state)
                self._checking = asyncio.create_task(self._check_streamed(manifest, view))
            return
        self._compare(manifest, digest_of(self._codec.encode(state)))

    async def _check_streamed(self, manifest: SnapshotManifest, view: S) -> None:
        codec = cast(StreamingCodec[S], self._codec)
        chunked = Chunked(self._unless_closed(codec.encode_parts(view)), _DIGEST_STEP_BYTES)
        try:
            async with contextlib.aclosing(step_in_worker(iter(chunked))) as chunks:
                async for _chunk in chunks:
                    pass
            self._compare(manifest, chunked.digest.hexdigest())
        except Exception as exc:  # the check only: the replica is not at fault
            logger.warning(
                "could not check %s against snapshot %s: %s", self._topic, manifest.snapshot_id, exc
            )
        finally:
            self._checking = None

    def _compare(self, manifest: SnapshotManifest, digest: str) -> None:
        version = manifest.position
        if digest == manifest.digest:
            logger.debug("replayed state matches snapshot %s", manifest.snapshot_id)
            return
        self._stats.determinism_failures += 1
        logger.error(
            "DETERMINISM CHECK FAILED on %s: the state replayed to position %d differs from "
            "snapshot %s taken there by %s (digest %s, snapshot %s). Replicas disagree: apply "
            "or snapshot_codec is not deterministic.",
            self._topic,
            version,
            manifest.snapshot_id,
            manifest.writer_id,
            digest[:16],
            manifest.digest[:16],
        )

    async def take(self, timeout: float, *, trim_timeout: float | None = None) -> SnapshotManifest:
        """Write a snapshot of the state as it is now. The trim after it (``trim_history``)
        runs within ``timeout`` too, unless given ``trim_timeout`` of its own."""
        taking = asyncio.get_running_loop().create_future()
        self._takes.add(taking)
        try:
            return await self._take(timeout, trim_timeout)
        finally:
            self._takes.discard(taking)
            taking.set_result(None)

    def _unless_closed(self, parts: Iterable[bytes]) -> Iterator[bytes]:
        """``parts``, ended by ClosedError once the manager closes (checked before each, in
        the worker thread): the state's store is closed next."""
        try:
            for part in parts:
                if self._context.closed:
                    raise ClosedError(f"{self._topic} was closed while a snapshot was made")
                yield part
        finally:
            close_iterator(parts)

    async def _take(self, timeout: float, trim_timeout: float | None) -> SnapshotManifest:
        replica = self._replica
        if self._storing:
            raise WriterBusyError(
                f"a snapshot of {self._topic} is being loaded into this replica; try again"
            )
        if replica.halt is not None:
            # Its state may hold part of the record it halted on: never a snapshot of that.
            raise replica.halted_error()
        if self._encoding:
            raise WriterBusyError(
                f"a snapshot of {self._topic} that timed out is still encoding its copy of the "
                "state; try again later (or with a longer timeout)"
            )
        # Captured in one synchronous step: the state, its version and the log position.
        state = self._copy_state(replica.state)
        version, record_id, origin = replica.version, replica.last_record_id, replica.origin
        # Where that record is, not how far the replica read: a replica loading the
        # snapshot reads the records ignored since, as this one did (see Replica._stale),
        # and is told those ignored before it that may still have a chain built on them.
        log_position = replica.applied_at or LogPosition(-1, -1)
        stale = replica.stale_at_applied
        bytes_read = self._stats.bytes_read
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            async with asyncio.timeout_at(deadline):
                parts: Iterable[bytes]
                count = 0  # of chunks: known only at the end of a streamed snapshot
                if isinstance(self._codec, StreamingCodec):
                    # Made as the chunks are sent (in a worker thread): never whole in memory.
                    parts = self._unless_closed(self._codec.encode_parts(state))
                else:
                    data = await self._encode(state)
                    parts, count = (data,), self._store.chunks_for(len(data))
                manifest = await self._store.write(
                    parts,
                    count=count,
                    position=version,
                    record_id=record_id,
                    log_position=log_position,
                    writer_id=self._writer_id,
                    origin=origin,
                    stale=stale,
                )
        except TimeoutError as exc:
            raise OperationTimeoutError(f"snapshot of {self._topic} took over {timeout}s") from exc
        self._last_version = max(self._last_version, version)
        self._bytes_at_last = max(self._bytes_at_last, bytes_read)
        self._stats.snapshots_written += 1
        self._stats.snapshot_written_at = time.time()
        self._stats.snapshot_size_bytes = manifest.size
        self._stats.snapshot_duration_s = time.perf_counter() - started
        logger.info(
            "wrote snapshot %s of %s at position %d (%.1f MB, %d chunks)",
            manifest.snapshot_id,
            self._topic,
            version,
            manifest.size / 1e6,
            manifest.chunks,
        )
        if self._trim_log is not None:
            try:
                if trim_timeout is not None:
                    deadline = asyncio.get_running_loop().time() + trim_timeout
                async with asyncio.timeout_at(deadline):
                    await self.trim()
            except (PulsarStateError, TimeoutError) as exc:
                # The snapshot stands; the next one trims again.
                logger.warning("trimming %s after a snapshot failed: %r", self._topic, exc)
        return manifest

    async def _encode(self, state: S) -> bytes:
        """``state`` encoded (and checked) in a worker thread. A thread cannot be stopped: one
        whose snapshot timed out runs on, holding its copy of the state, and until it ends
        no other snapshot starts (see _take: each would copy the state once more)."""

        def encode() -> bytes:
            # Set here, not before: a work item still queued when its snapshot timed out is
            # dropped by the executor, and nothing would unset the flag.
            self._encoding = True
            try:
                return encode_checked(self._codec, state)
            finally:
                self._encoding = False

        return await asyncio.to_thread(encode)

    async def trim(self) -> LogPosition | None:
        """Move the trim points to just before what the oldest of the ``keep_snapshots``
        newest snapshots needs: the message it covers (checked when it is loaded) and its
        first chunk. Returns the state topic's new trim point, if any."""
        if self._trim_log is None:
            return None
        manifests = sorted(
            (m for m in await self._store.manifests() if self._of_this_history(m)),
            key=lambda m: m.position,
        )
        if len(manifests) < self._keep_snapshots:
            return None
        kept = manifests[-self._keep_snapshots :]
        oldest = kept[0]
        # Each kept snapshot needs its chunks and the message it covers. Two processes may
        # write snapshots out of position order (one encodes slowly): the newest by position
        # may have the earlier chunks, so the trim points are the earliest over all kept.
        covered = min(LogPosition(m.log_ledger, m.log_entry) for m in kept)
        first_chunk = min(LogPosition(m.first_chunk_ledger, m.first_chunk_entry) for m in kept)
        if first_chunk.entry >= 1:
            await self._store.trim_chunks_through(first_chunk._replace(entry=first_chunk.entry - 1))
        through = None
        # (At an entry 0, the end of the ledger before is unknown: the next snapshot trims.)
        if covered.entry >= 1:
            through = covered._replace(entry=covered.entry - 1)
            await self._trim_log(through)
            self._stats.history_trims += 1
            logger.info(
                "trimmed %s through %s (snapshot at position %d)",
                self._topic,
                through,
                oldest.position,
            )
        await self._store.trim_index_before(kept)  # last: the log's trim matters more
        return through

    def _of_this_history(self, manifest: SnapshotManifest) -> bool:
        """Whether ``manifest`` may describe this replica's history: a topic deleted and
        created again keeps the old index, whose manifests name another origin."""
        origin = self._replica.origin
        return manifest.log_origin is None or origin is None or manifest.log_origin == origin

    def after_batch(self) -> None:
        """Start an automatic snapshot in the background if one is due."""
        if self._due():
            self._task = asyncio.create_task(self._auto())

    def _due(self, *, running_ok: bool = False) -> bool:
        if self._task is not None and not running_ok:
            return False
        if self._replica.halt is not None:
            return False
        if asyncio.get_running_loop().time() < self._auto_after:
            return False
        records = self._replica.version - self._last_version
        data = self._stats.bytes_read - self._bytes_at_last
        every_records = self._settings.snapshot_every_records
        every_bytes = self._settings.snapshot_every_bytes
        return bool(
            (every_records and records >= every_records) or (every_bytes and data >= every_bytes)
        )

    async def _auto(self) -> None:
        succeeded = failed = False
        try:
            newest = await self._store.latest()
            if (
                newest is not None
                and newest.position > self._last_version
                and self._of_this_history(newest)
            ):
                # Another writer took one since ours: count from there instead.
                self._last_version = newest.position
                if not self._due(running_ok=True):
                    return
            # Its trim has a bound of its own: a snapshot taking most of write_timeout_s
            # would leave none, and the history would never be trimmed.
            await self.take(
                self._settings.write_timeout_s, trim_timeout=self._settings.open_timeout_s
            )
            succeeded = True
        except WriterBusyError:
            # Another process is writing one (each attempt copies and encodes the state
            # first): wait, longer each time in a row, up to _AUTO_BUSY_MAX_S.
            self._auto_after = asyncio.get_running_loop().time() + self._busy_pause
            self._busy_pause = min(self._busy_pause * 2, _AUTO_BUSY_MAX_S)
            logger.debug("another process is writing a snapshot of %s", self._topic)
        except CodecError as exc:
            failed = True
            logger.error("automatic snapshot of %s refused: %s", self._topic, exc)
        except PulsarStateError as exc:
            failed = True
            logger.warning("automatic snapshot of %s failed: %s", self._topic, exc)
        except Exception as exc:  # a snapshot codec's own error: logged, never lost unseen
            failed = True
            logger.error("automatic snapshot of %s raised: %r", self._topic, exc)
        finally:
            self._task = None
            if failed:
                self._auto_after = asyncio.get_running_loop().time() + self._auto_pause
                self._auto_pause = min(self._auto_pause * 2, _AUTO_RETRY_MAX_S)
            elif succeeded:
                self._auto_pause = self._busy_pause = _AUTO_RETRY_S
        # Writes went on while it ran: if another is already due, take it now. Never after a
        # failure, which would only retry in a loop; the next write checks again.
        if succeeded and not self._context.closed and self._due():
            self._task = asyncio.create_task(self._auto())

    async def settle(self, timeout: float) -> None:
        """Let a running automatic snapshot (and a determinism check) finish, within
        ``timeout``."""
        running = [task for task in (self._task, self._checking) if task is not None]
        if running:
            with contextlib.suppress(Exception):
                await wait_bounded(asyncio.shield(asyncio.gather(*running)), timeout)

    async def cancel(self) -> None:
        """Stop the automatic snapshot and the determinism check; wait for snapshots taken by
        hand to stop making parts (``context.closed`` ends them at the next part)."""
        for task in (self._task, self._checking):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._takes:
            await asyncio.wait(set(self._takes), timeout=_TAKES_STOP_S)
