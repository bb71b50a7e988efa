"""SharedStateManager: one state object replicated through a Pulsar topic.

How it works, in brief (the README has the long form):

* **Log.** Every change is a *record* on one non-partitioned topic. A replica reads the topic
  from the start with one reader task (the *pump*) and applies records strictly in log order.
  State changes only there, never on the write path, so every op is applied exactly once.
* **Write.** A writer takes the topic's exclusive producer, reads to the tail, runs the
  generators of all waiting writes on a trial copy of the state (group commit), and appends
  the records. The caller's future completes when the pump has applied the record, so the
  local state already shows the write.
* **Safety.** Each record names the count of accepted records and the last accepted record id
  it was computed against. A replica accepts a record only if both match its own; otherwise
  it ignores it, deterministically, everywhere. A fenced, stale or duplicated record can never
  change the state; the writer whose record was ignored re-runs its generator and retries.
* **Reads.** ``latest=False`` reads the local state. ``latest=True`` captures the tail position
  at call time (admin ``lastMessageId``) and waits until the pump has passed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import heapq
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, overload

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_random

from ._admin import AdminClient, TopicName, default_admin_url
from ._codecs import Codec, JsonCodec
from ._envelope import (
    Record,
    SnapshotManifest,
    Write,
    decode_record,
    encode_record,
    record_overhead,
    write_id,
)
from ._errors import (
    ApplyError,
    ClosedError,
    CodecError,
    ConfigurationError,
    CorruptRecordError,
    OperationTimeoutError,
    PartitionedTopicError,
    PulsarStateError,
    RecordTooLargeError,
    ReplicaHaltedError,
    WriteOutcomeUnknownError,
    WriterBusyError,
)
from ._pulsar import LogPosition, PulsarConnection, RawMessage, StateReader, StateWriter
from ._snapshots import SnapshotStore, digest_of

__all__ = [
    "AppliedRecord",
    "ManagerStats",
    "ReplayProgress",
    "SharedStateManager",
    "WriteResult",
]

logger = logging.getLogger("pulsar_state")

S = TypeVar("S")
Op = TypeVar("Op")
T = TypeVar("T")

Generator = Callable[[S], Sequence[Op]]
OnCorrupt = Literal["halt", "skip"]


@dataclass(frozen=True, slots=True)
class WriteResult(Generic[T]):
    """What a committed write returns.

    ``value`` is the ``reader``'s result on the state right after this write's ops were
    applied (from the attempt that committed). ``position`` is the number of records accepted
    up to and including this write's record: pass it to ``wait_for`` on another replica to
    read your own writes there.
    """

    value: T
    position: int


@dataclass(frozen=True, slots=True)
class AppliedRecord(Generic[Op]):
    """A record as applied by the pump; handed to listeners (see ``add_listener``)."""

    position: int
    record_id: str
    log_position: LogPosition
    writes: list[list[Op]]


@dataclass(frozen=True, slots=True)
class ReplayProgress:
    """Progress of the bootstrap replay (``on_progress`` callback and INFO logs)."""

    records_read: int
    bytes_read: int
    records_total: int | None
    bytes_total: int | None
    elapsed_s: float
    done: bool
    snapshot_position: int | None = None  # the snapshot the replay started from, if any
    snapshot_bytes: int = 0


@dataclass(slots=True)
class ManagerStats:
    """Counters for monitoring. Read with ``manager.stats``."""

    position: int = 0
    records_read: int = 0
    bytes_read: int = 0
    records_rejected: int = 0
    records_skipped: int = 0
    records_sent: int = 0
    writes_committed: int = 0
    write_retries: int = 0
    writer_acquisitions: int = 0
    snapshots_written: int = 0
    snapshot_loaded_position: int | None = None
    determinism_failures: int = 0


@dataclass(eq=False, slots=True)
class _PendingWrite:
    generator: Callable[[Any], Sequence[Any]]
    reader: Callable[[Any], Any] | None
    future: asyncio.Future[WriteResult[Any]]
    deadline: float
    write_seq: int
    attempts: int = 0
    queued: bool = True
    # The record of the newest attempt; only its rejection triggers a retry.
    latest_record: str | None = None
    # Records carrying an attempt that may still land; empty means "certainly not applied".
    outstanding: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _OutgoingRecord:
    record: Record
    payload: bytes
    pending: list[_PendingWrite]


class SharedStateManager(Generic[S, Op]):
    """A state object of type ``S`` kept consistent across processes by a Pulsar topic.

    Use it as an async context manager::

        async with SharedStateManager(
            "pulsar://127.0.0.1:6650", "my-state",
            initial_state=dict, apply=apply_op, codec=JsonCodec(),
        ) as manager:
            await manager.write(lambda s: [{"set": "k", "to": 1}])
            value = await manager.read(lambda s: s.get("k"), latest=True)

    Args:
        pulsar: a service URL (``pulsar://host:6650``; the manager owns its client) or an
            existing ``pulsar.asyncio.Client`` (borrowed, not closed).
        topic: a non-partitioned persistent topic, ``name`` or ``persistent://t/ns/name``.
        initial_state: factory for the empty state.
        apply: ``apply(state, op)`` mutates ``state`` in place (return None) or returns the new
            state. It must be deterministic: every replica runs it on the same ops.
        codec: encodes ops to bytes and back (default JSON).
        copy_state: copies the state for the writer's trial run of generators and ops
            (default ``copy.deepcopy``). Pass ``None`` when ``apply`` never mutates its input.
        begin_record: ``begin_record(state, position)`` runs before the ops of each accepted
            record, with the position that record gets (1 for the first): for states that
            stamp versions. Runs on the writer's trial state too, with the same position.
        admin_url: the broker's admin REST URL (default derived from the service URL).
        on_corrupt: ``"halt"`` (default) stops applying at a foreign or damaged message and
            raises :class:`ReplicaHaltedError` from then on; ``"skip"`` logs, counts and skips.
        check_topic: refuse partitioned topics and topics whose policies lose history.
        idle_release_s: release the exclusive writer after this long without writes.
        max_hold_s: release the writer after holding it this long while others may wait.
        acquire_timeout_s: how long a write waits for the exclusive writer.
        takeover_after_s: after waiting this long, take the writer over with fencing
            (``ExclusiveWithFencing``). None (default) never fences another process.
        write_timeout_s / read_timeout_s / open_timeout_s: default timeouts of those calls.
        max_record_bytes: refuse a write larger than this before sending (default 1 MiB,
            below the broker's 5 MB message limit).
        max_writes_per_record: group-commit at most this many writes into one message.
        max_writes_per_batch: at most this many writes per pipelined batch.
        on_progress: called with :class:`ReplayProgress` during the bootstrap replay.
        snapshot_codec: encodes the whole state to bytes and back; enables snapshots
            (``snapshot()``, automatic policies, and opening from the newest good snapshot).
            It must be deterministic (same state, same bytes): digests are compared.
        snapshot_every_records / snapshot_every_bytes: the writer takes a snapshot after this
            many records (or bytes of records) since the last one. None: only manual.
        snapshot_chunk_bytes: snapshot chunk size (one message each; no overall size cap).
        load_snapshot: open from the newest good snapshot (default) or replay everything.
        name: a label for logs and the writer id.
        client_options: extra ``pulsar.Client`` options (authentication, TLS, ...).
    """

    def __init__(
        self,
        pulsar: Any,
        topic: str,
        *,
        initial_state: Callable[[], S],
        apply: Callable[[S, Op], S | None],
        codec: Codec[Op] | None = None,
        copy_state: Callable[[S], S] | None = copy.deepcopy,
        begin_record: Callable[[S, int], S | None] | None = None,
        admin_url: str | None = None,
        on_corrupt: OnCorrupt = "halt",
        check_topic: bool = True,
        idle_release_s: float = 0.1,
        max_hold_s: float = 1.0,
        acquire_timeout_s: float = 30.0,
        takeover_after_s: float | None = None,
        write_timeout_s: float = 30.0,
        read_timeout_s: float = 30.0,
        open_timeout_s: float = 120.0,
        max_record_bytes: int = 1024 * 1024,
        max_writes_per_record: int = 256,
        max_writes_per_batch: int = 1024,
        on_progress: Callable[[ReplayProgress], None] | None = None,
        snapshot_codec: Codec[S] | None = None,
        snapshot_every_records: int | None = None,
        snapshot_every_bytes: int | None = None,
        snapshot_chunk_bytes: int = 1024 * 1024,
        load_snapshot: bool = True,
        name: str | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        if on_corrupt not in ("halt", "skip"):
            raise ConfigurationError(f"on_corrupt must be 'halt' or 'skip', not {on_corrupt!r}")
        if max_writes_per_record < 1 or max_writes_per_batch < 1 or max_record_bytes < 1024:
            raise ConfigurationError("max_writes_per_* must be >= 1 and max_record_bytes >= 1024")
        self.topic = TopicName.parse(topic)
        self._pulsar_arg = pulsar
        self._initial_state = initial_state
        self._apply = apply
        self._codec: Codec[Op] = codec if codec is not None else JsonCodec()
        self._copy_state = copy_state
        self._begin_record = begin_record
        if isinstance(pulsar, str):
            service_url = pulsar
        else:
            service_url = getattr(pulsar, "service_url", "pulsar://127.0.0.1:6650")
        self._admin = AdminClient(admin_url or default_admin_url(service_url))
        self._on_corrupt: OnCorrupt = on_corrupt
        self._check_topic = check_topic
        self.idle_release_s = idle_release_s
        self.max_hold_s = max_hold_s
        self.acquire_timeout_s = acquire_timeout_s
        self.takeover_after_s = takeover_after_s
        self.write_timeout_s = write_timeout_s
        self.read_timeout_s = read_timeout_s
        self.open_timeout_s = open_timeout_s
        self.max_record_bytes = max_record_bytes
        self.max_writes_per_record = max_writes_per_record
        self.max_writes_per_batch = max_writes_per_batch
        self._on_progress = on_progress
        self._client_options = client_options
        self._snapshot_codec = snapshot_codec
        self.snapshot_every_records = snapshot_every_records
        self.snapshot_every_bytes = snapshot_every_bytes
        self._snapshot_chunk_bytes = snapshot_chunk_bytes
        self._load_snapshot = load_snapshot
        self._snapshots: SnapshotStore | None = None
        self._snapshot_task: asyncio.Task[None] | None = None
        self._last_snapshot_position = 0
        self._bytes_at_last_snapshot = 0
        # The newest manifest past the loaded state: checked when the replay reaches it.
        self._verify_manifest: SnapshotManifest | None = None
        self._loaded_manifest: SnapshotManifest | None = None
        self.writer_id = f"{name + '-' if name else ''}{uuid.uuid4().hex[:12]}"

        self._state: S = initial_state()
        self._position = 0
        self._last_record_id = ""
        self._read_position: LogPosition | None = None
        self._halt: PulsarStateError | None = None
        self.stats = ManagerStats()

        self._conn: PulsarConnection | None = None
        self._owns_conn = False
        self._reader: StateReader | None = None
        self._producer: StateWriter | None = None
        self._producer_since = 0.0
        self._pump_task: asyncio.Task[None] | None = None
        self._writer_task: asyncio.Task[None] | None = None
        self._opened = False
        self._closed = False

        self._tiebreak = itertools.count()
        self._log_waiters: list[tuple[LogPosition, int, asyncio.Future[None]]] = []
        self._position_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._listeners: list[Callable[[AppliedRecord[Op]], None]] = []

        self._queue: deque[_PendingWrite] = deque()
        self._deadlines: list[tuple[float, int, _PendingWrite]] = []
        self._watchdog_task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._in_flight: dict[str, list[_PendingWrite]] = {}
        self._write_seq = itertools.count(1)
        self._record_seq = itertools.count(1)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> SharedStateManager[S, Op]:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self, *, timeout: float | None = None) -> None:
        """Connect, check the topic, and replay it up to the tail captured now."""
        if self._opened:
            raise ConfigurationError("the manager is already open")
        self._opened = True
        timeout = self.open_timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(timeout):
                await self._open()
        except TimeoutError as exc:
            await self.aclose()
            raise OperationTimeoutError(
                f"opening {self.topic} did not finish in {timeout}s "
                f"({self.stats.records_read} records replayed)"
            ) from exc
        except BaseException:
            await self.aclose()
            raise

    async def _open(self) -> None:
        self._wake = asyncio.Event()
        if isinstance(self._pulsar_arg, str):
            self._conn = PulsarConnection(
                self._pulsar_arg,
                operation_timeout_s=self.write_timeout_s,
                client_options=self._client_options,
            )
            self._owns_conn = True
        else:
            self._conn = PulsarConnection.wrap(self._pulsar_arg)
        topic = str(self.topic)
        partitions = await self._conn.partitions(topic)
        if len(partitions) > 1 or (partitions and partitions[0] != topic):
            raise PartitionedTopicError(
                f"{topic} is partitioned ({len(partitions)} partitions): replicated state needs "
                "a non-partitioned topic, the only kind with one total order",
                topic=topic,
            )
        # Creating the reader also creates the topic (auto-creation), so policies exist.
        self._reader = await self._conn.create_reader(topic, name=f"pulsar-state-{self.writer_id}")
        if self._check_topic:
            await self._admin.check_topic(self.topic)
        if self._snapshot_codec is not None:
            self._snapshots = SnapshotStore(
                self._conn,
                self._admin,
                self.topic,
                chunk_bytes=self._snapshot_chunk_bytes,
                timeout_s=self.open_timeout_s,
            )
            if await self._load_newest_snapshot(load=self._load_snapshot):
                assert self._read_position is not None
                await self._reader.close()
                self._reader = await self._conn.create_reader(
                    topic, name=f"pulsar-state-{self.writer_id}", after=self._read_position
                )
        self._pump_task = asyncio.create_task(self._pump(), name=f"pulsar-state-pump-{topic}")
        await self._bootstrap()
        self._check_usable()  # the replay may have stopped at a bad record: refuse to open
        self._writer_task = asyncio.create_task(
            self._writer_loop(), name=f"pulsar-state-writer-{topic}"
        )
        self._watchdog_task = asyncio.create_task(
            self._watchdog(), name=f"pulsar-state-deadlines-{topic}"
        )
        logger.info(
            "opened %s at position %d (%d records read)",
            topic,
            self._position,
            self.stats.records_read,
        )

    async def _load_newest_snapshot(self, *, load: bool) -> bool:
        """Load the newest snapshot that checks out; older ones are fallbacks. True if one was.

        The newest snapshot not loaded (unusable, or ``load`` False) is kept to check the
        replayed state against its digest when the replay reaches its position.
        """
        assert self._snapshots is not None
        assert self._snapshot_codec is not None
        manifests = await self._snapshots.manifests()
        if manifests and not load:
            self._verify_manifest = manifests[-1]
            return False
        for manifest in reversed(manifests):
            try:
                started = time.monotonic()
                data = await self._snapshots.load(manifest)
                state = await asyncio.to_thread(self._snapshot_codec.decode, data)
            except (PulsarStateError, TimeoutError) as exc:
                logger.warning(
                    "snapshot %s of %s (position %d) is unusable, falling back: %s",
                    manifest.snapshot_id,
                    self.topic,
                    manifest.position,
                    exc,
                )
                self._verify_manifest = self._verify_manifest or manifest
                continue
            self._state = state
            self._position = self._last_snapshot_position = manifest.position
            self._last_record_id = manifest.record_id
            self._read_position = LogPosition(manifest.log_ledger, manifest.log_entry)
            self._loaded_manifest = manifest
            self.stats.position = manifest.position
            self.stats.snapshot_loaded_position = manifest.position
            logger.info(
                "loaded snapshot of %s at position %d (%.1f MB) in %.2fs",
                self.topic,
                manifest.position,
                manifest.size / 1e6,
                time.monotonic() - started,
            )
            return True
        if manifests:
            logger.warning("no usable snapshot of %s: replaying the whole log", self.topic)
        return False

    async def _bootstrap(self) -> None:
        tail = await self._admin.last_position(self.topic)
        if tail is None or self._reached(tail):
            # The pump got there first (or there is nothing): the work was what it read.
            read = self.stats.records_read, self.stats.bytes_read
            self._report_progress(time.monotonic(), *read, done=True)
            return
        records_total: int | None
        bytes_total: int | None
        try:
            # After a snapshot only the records past it are replayed: count just those.
            # The snapshot's own position, not the read position: the pump is already moving.
            loaded = self._loaded_manifest
            after = LogPosition(loaded.log_ledger, loaded.log_entry) if loaded else None
            records_total, bytes_total = await self._admin.backlog(self.topic, after=after)
        except PulsarStateError:
            records_total = bytes_total = None
        started = time.monotonic()
        waiter = self._log_waiter(tail)
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=2.0)
            if done:
                waiter.result()
                break
            self._report_progress(started, records_total, bytes_total, done=False)
        self._report_progress(started, records_total, bytes_total, done=True)

    def _report_progress(
        self, started: float, records_total: int | None, bytes_total: int | None, *, done: bool
    ) -> None:
        loaded = self._loaded_manifest
        progress = ReplayProgress(
            records_read=self.stats.records_read,
            bytes_read=self.stats.bytes_read,
            records_total=records_total,
            bytes_total=bytes_total,
            elapsed_s=time.monotonic() - started,
            done=done,
            snapshot_position=loaded.position if loaded else None,
            snapshot_bytes=loaded.size if loaded else 0,
        )
        if not done:
            logger.info(
                "replaying %s: %d/%s records, %.1f/%s MB, %.0fs",
                self.topic,
                progress.records_read,
                records_total if records_total is not None else "?",
                progress.bytes_read / 1e6,
                f"{bytes_total / 1e6:.1f}" if bytes_total is not None else "?",
                progress.elapsed_s,
            )
        if self._on_progress is not None:
            try:
                self._on_progress(progress)
            except Exception:
                logger.exception("on_progress callback raised")

    async def aclose(self, *, timeout: float = 10.0) -> None:
        """Stop: fail queued writes, release the writer at once, stop the reader."""
        if self._closed:
            return
        self._closed = True
        closed = ClosedError(f"manager on {self.topic} is closed")
        for pending in list(self._queue):
            if not pending.future.done():
                pending.future.set_exception(closed)
        self._queue.clear()
        if self._wake is not None:
            self._wake.set()
        # Give writes already sent a moment to be seen, so their callers learn the outcome.
        in_flight = [p.future for ps in self._in_flight.values() for p in ps if not p.future.done()]
        if in_flight:
            await asyncio.wait(in_flight, timeout=min(timeout, 5.0))
        if self._snapshot_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._snapshot_task), min(timeout, 30.0))
        for task in (self._writer_task, self._snapshot_task, self._watchdog_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        # Every step is bounded: a broker that does not answer cannot hang a close.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._release_writer(), timeout)
        if self._reader is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reader.close(), timeout)
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump_task
        for futures in self._in_flight.values():
            for pending in futures:
                if not pending.future.done():
                    pending.future.set_exception(
                        WriteOutcomeUnknownError(
                            "the manager closed before this write's outcome was seen",
                            write_id=write_id(self.writer_id, pending.write_seq),
                        )
                    )
        self._in_flight.clear()
        self._fail_waiters(closed)
        if self._conn is not None and self._owns_conn:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._conn.close(), timeout)
        logger.debug("closed manager on %s", self.topic)

    # ------------------------------------------------------------------ public API

    @property
    def position(self) -> int:
        """How many records this replica has accepted (its state's version)."""
        return self._position

    @property
    def closed(self) -> bool:
        """True once ``aclose()`` has started."""
        return self._closed

    def read_local(self, reader: Callable[[S], T]) -> T:
        """``read(reader)`` without the coroutine: the local state, now, no I/O.

        Call it from the event loop's thread (the pump mutates the state there).
        """
        self._check_usable()
        return reader(self._state)

    @property
    def halted(self) -> PulsarStateError | None:
        """Why this replica stopped applying, or None."""
        return self._halt

    def add_listener(self, listener: Callable[[AppliedRecord[Op]], None]) -> Callable[[], None]:
        """Call ``listener`` after each accepted record, in log order; returns an unsubscribe.

        Listeners run on the event loop inside the pump: keep them short and non-blocking.
        Registering and reading the state in the same synchronous step gives a consistent
        snapshot followed by every later change.
        """
        self._listeners.append(listener)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return remove

    async def read(
        self, reader: Callable[[S], T], *, latest: bool = False, timeout: float | None = None
    ) -> T:
        """Run ``reader`` on the state and return its result.

        ``latest=False`` reads the local state at once (no I/O). ``latest=True`` is
        linearizable: it captures the tail of the log now and returns after applying up to it.
        ``reader`` must not mutate the state or keep references that outlive the call.
        """
        self._check_usable()
        if latest:
            await self.sync(timeout=timeout)
        return reader(self._state)

    async def sync(self, *, timeout: float | None = None) -> int:
        """Catch up with the tail of the log as of now; returns the position reached."""
        self._check_usable()
        timeout = self.read_timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(timeout):
                tail = await self._admin.last_position(self.topic)
                await self._wait_log(tail)
        except TimeoutError as exc:
            raise OperationTimeoutError(
                f"could not catch up with {self.topic} in {timeout}s"
            ) from exc
        return self._position

    async def wait_for(self, position: int, *, timeout: float | None = None) -> None:
        """Wait until this replica has accepted ``position`` records (read-your-writes)."""
        self._check_usable()
        if self._position >= position:
            return
        timeout = self.read_timeout_s if timeout is None else timeout
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._position_waiters, (position, next(self._tiebreak), future))
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError as exc:
            raise OperationTimeoutError(
                f"position {position} not reached in {timeout}s (at {self._position})"
            ) from exc

    @overload
    async def write(
        self, generator: Callable[[S], Sequence[Op]], *, timeout: float | None = None
    ) -> WriteResult[None]: ...

    @overload
    async def write(
        self,
        generator: Callable[[S], Sequence[Op]],
        *,
        reader: Callable[[S], T],
        timeout: float | None = None,
    ) -> WriteResult[T]: ...

    async def write(
        self,
        generator: Callable[[S], Sequence[Op]],
        *,
        reader: Callable[[S], Any] | None = None,
        timeout: float | None = None,
    ) -> WriteResult[Any]:
        """Append the ops that ``generator`` computes from the up-to-date state, atomically.

        ``generator(state)`` returns the ops to append; it runs on a trial copy of the state
        at the tail of the log, while this process holds the exclusive writer, and may run
        more than once (if another writer got in first). Each op is validated by applying it
        to that trial copy before anything is sent. The ops of one write are applied together
        by every replica, or not at all.

        ``reader(state)`` runs on the state right after this write's ops were applied, and
        its result is returned in :class:`WriteResult` (from the attempt that committed).

        Raises the generator's own exception if it raises (nothing is appended);
        :class:`ApplyError` if an op fails on the trial state; :class:`RecordTooLargeError`;
        :class:`OperationTimeoutError` when nothing was appended in time;
        :class:`WriteOutcomeUnknownError` when a record was sent but not seen in time.
        """
        self._check_usable()
        assert self._wake is not None
        timeout = self.write_timeout_s if timeout is None else timeout
        loop = asyncio.get_running_loop()
        pending = _PendingWrite(
            generator=generator,
            reader=reader,
            future=loop.create_future(),
            deadline=loop.time() + timeout,
            write_seq=next(self._write_seq),
        )
        self._queue.append(pending)
        heapq.heappush(self._deadlines, (pending.deadline, pending.write_seq, pending))
        self._wake.set()
        # The watchdog fails the future at its deadline: one timer for all writes, not one each.
        return await pending.future

    async def write_ops(
        self, ops: Sequence[Op], *, timeout: float | None = None
    ) -> WriteResult[None]:
        """Append ``ops`` unconditionally (no generator), atomically."""
        fixed = list(ops)
        return await self.write(lambda _state: fixed, timeout=timeout)

    async def snapshot(self, *, timeout: float | None = None) -> SnapshotManifest:
        """Write a snapshot of the state as it is now; returns its manifest.

        Other processes may keep writing meanwhile. Raises :class:`WriterBusyError` if another
        process is writing a snapshot of this topic at the same moment.
        """
        self._check_usable()
        if self._snapshots is None or self._snapshot_codec is None:
            raise ConfigurationError("snapshots need snapshot_codec= (state <-> bytes)")
        codec = self._snapshot_codec
        timeout = self.write_timeout_s if timeout is None else timeout
        # Captured in one synchronous step: the state, its position and the log position.
        state = self._trial_state()
        position, record_id = self._position, self._last_record_id
        log_position = self._read_position or LogPosition(-1, -1)
        bytes_read = self.stats.bytes_read
        try:
            async with asyncio.timeout(timeout):
                data = await asyncio.to_thread(codec.encode, state)
                manifest = await self._snapshots.write(
                    data,
                    position=position,
                    record_id=record_id,
                    log_position=log_position,
                    writer_id=self.writer_id,
                )
        except TimeoutError as exc:
            raise OperationTimeoutError(f"snapshot of {self.topic} took over {timeout}s") from exc
        self._last_snapshot_position = max(self._last_snapshot_position, position)
        self._bytes_at_last_snapshot = max(self._bytes_at_last_snapshot, bytes_read)
        self.stats.snapshots_written += 1
        logger.info(
            "wrote snapshot %s of %s at position %d (%.1f MB, %d chunks)",
            manifest.snapshot_id,
            self.topic,
            position,
            manifest.size / 1e6,
            manifest.chunks,
        )
        return manifest

    def _snapshot_due(self, *, running_ok: bool = False) -> bool:
        if self._snapshots is None or (self._snapshot_task is not None and not running_ok):
            return False
        records = self._position - self._last_snapshot_position
        data = self.stats.bytes_read - self._bytes_at_last_snapshot
        return bool(
            (self.snapshot_every_records and records >= self.snapshot_every_records)
            or (self.snapshot_every_bytes and data >= self.snapshot_every_bytes)
        )

    async def _auto_snapshot(self) -> None:
        succeeded = False
        try:
            assert self._snapshots is not None
            newest = await self._snapshots.latest()
            if newest is not None and newest.position > self._last_snapshot_position:
                # Another writer took one since ours: count from there instead.
                self._last_snapshot_position = newest.position
                if not self._snapshot_due(running_ok=True):
                    return
            await self.snapshot()
            succeeded = True
        except WriterBusyError:
            logger.debug("another process is writing a snapshot of %s", self.topic)
        except PulsarStateError as exc:
            logger.warning("automatic snapshot of %s failed: %s", self.topic, exc)
        finally:
            self._snapshot_task = None
        # Writes went on while it ran: if another is already due, take it now. Never after a
        # failure, which would only retry in a loop; the next write checks again.
        if succeeded and not self._closed and self._snapshot_due():
            self._snapshot_task = asyncio.create_task(self._auto_snapshot())

    # ------------------------------------------------------------------ the pump

    async def _pump(self) -> None:
        assert self._reader is not None
        while not self._closed:
            try:
                batch = await self._reader.read_batch()
            except asyncio.CancelledError:
                raise
            except PulsarStateError as exc:
                if self._closed:
                    return
                # The client reconnects by itself; a reader that failed for good is replaced,
                # resuming right after the last message this replica has seen.
                logger.warning("reading %s failed (%s); reopening the reader", self.topic, exc)
                await asyncio.sleep(0.5)
                await self._reopen_reader()
                continue
            for message in batch:
                self._on_message(message)
                if self._halt is not None:
                    return

    async def _reopen_reader(self) -> None:
        assert self._conn is not None
        old, topic = self._reader, str(self.topic)
        try:
            self._reader = await self._conn.create_reader(
                topic, name=f"pulsar-state-{self.writer_id}", after=self._read_position
            )
        except PulsarStateError as exc:
            logger.warning("reopening the reader on %s failed: %s", self.topic, exc)
            return
        if old is not None:
            await old.close()

    def _on_message(self, message: RawMessage, record: Record | None = None) -> None:
        if self._read_position is not None and message.position <= self._read_position:
            logger.debug("ignoring redelivered message %s", message.position)
            return
        self.stats.records_read += 1
        self.stats.bytes_read += len(message.payload)
        try:
            if record is None:
                record = decode_record(message.payload, message_id=str(message.position))
            accepted = (
                record.base_position == self._position
                and record.base_record_id == self._last_record_id
            )
            decoded = self._decode_ops(record, message) if accepted else []
        except CorruptRecordError as exc:
            if self._on_corrupt == "skip":
                self.stats.records_skipped += 1
                logger.warning("skipping message on %s: %s", self.topic, exc)
                self._advance_read(message.position)
                return
            self._halt_with(exc)
            return
        if accepted:
            self._apply_record(record, decoded, message.position)
            if self._halt is not None:
                return
        else:
            self.stats.records_rejected += 1
            logger.debug(
                "ignoring stale record %s (based on %d/%r, replica at %d/%r)",
                record.record_id,
                record.base_position,
                record.base_record_id,
                self._position,
                self._last_record_id,
            )
            self._settle_rejected(record.record_id)
        self._advance_read(message.position)

    def _decode_ops(self, record: Record, message: RawMessage) -> list[list[Op]]:
        try:
            return [[self._codec.decode(op) for op in w.ops] for w in record.writes]
        except CodecError as exc:
            raise CorruptRecordError(
                f"message {message.position}: record {record.record_id} holds an op the codec "
                f"cannot decode ({exc})",
                message_id=str(message.position),
            ) from exc

    def _apply_record(self, record: Record, decoded: list[list[Op]], at: LogPosition) -> None:
        own = self._in_flight.pop(record.record_id, None)
        own_by_seq = {p.write_seq: p for p in own} if own else {}
        state = self._state
        results: list[tuple[_PendingWrite, Any, BaseException | None]] = []
        try:
            state = self._begin(state, self._position + 1)
            for write, ops in zip(record.writes, decoded, strict=True):
                for op in ops:
                    new_state = self._apply(state, op)
                    if new_state is not None:
                        state = new_state
                pending = own_by_seq.get(write.write_seq)
                if pending is not None:
                    value: Any = None
                    error: BaseException | None = None
                    if pending.reader is not None:
                        try:
                            value = pending.reader(state)
                        except Exception as exc:  # the caller's reader: its error, its write
                            error = exc
                    results.append((pending, value, error))
        except Exception as exc:
            # The writer validated these ops on an identical state, so apply is not
            # deterministic. The state may hold part of this record: stop here, loudly.
            self._state = state
            self._halt_with(
                ApplyError(
                    f"apply raised on record {record.record_id} at message {at}: "
                    f"{type(exc).__name__}: {exc}; apply must be deterministic"
                ),
                cause=exc,
            )
            return
        self._state = state
        self._position += 1
        self._last_record_id = record.record_id
        self.stats.position = self._position
        if self._verify_manifest is not None and self._verify_manifest.position == self._position:
            self._check_determinism(self._verify_manifest)
        for pending, value, error in results:
            pending.outstanding.discard(record.record_id)
            if pending.future.done():
                continue
            self.stats.writes_committed += 1
            if error is not None:
                pending.future.set_exception(error)
            else:
                pending.future.set_result(WriteResult(value, self._position))
        if self._listeners:
            applied = AppliedRecord(self._position, record.record_id, at, decoded)
            for listener in list(self._listeners):
                try:
                    listener(applied)
                except Exception:
                    logger.exception("listener raised; it stays registered")
        while self._position_waiters and self._position_waiters[0][0] <= self._position:
            _, _, future = heapq.heappop(self._position_waiters)
            if not future.done():
                future.set_result(None)

    def _check_determinism(self, manifest: SnapshotManifest) -> None:
        """Compare the replayed state with a snapshot another replica took at this position."""
        assert self._snapshot_codec is not None
        self._verify_manifest = None
        digest = digest_of(self._snapshot_codec.encode(self._state))
        if digest == manifest.digest:
            logger.debug("replayed state matches snapshot %s", manifest.snapshot_id)
            return
        self.stats.determinism_failures += 1
        logger.error(
            "DETERMINISM CHECK FAILED on %s: the state replayed to position %d differs from "
            "snapshot %s taken there by %s (digest %s, snapshot %s). Replicas disagree: apply "
            "or snapshot_codec is not deterministic.",
            self.topic,
            self._position,
            manifest.snapshot_id,
            manifest.writer_id,
            digest[:16],
            manifest.digest[:16],
        )

    def _settle_rejected(self, record_id: str) -> None:
        pendings = self._in_flight.pop(record_id, None)
        if not pendings:
            return
        retry = []
        for pending in pendings:
            if pending.latest_record != record_id:
                # An older attempt; a newer one is in flight and decides.
                pending.outstanding.discard(record_id)
                continue
            # The newest attempt was ignored, so the state had moved past the base that every
            # attempt of this write was computed on: none of them can be accepted any more.
            pending.outstanding.clear()
            if not pending.future.done():
                retry.append(pending)
        self._requeue(retry)

    def _requeue(self, retry: list[_PendingWrite]) -> None:
        # Retried first, in their original order: they waited longest. A write is never in
        # the queue twice, or its generator could run and commit twice in one batch.
        retry = [p for p in retry if not p.queued and not p.future.done()]
        for pending in retry:
            pending.queued = True
        self._queue.extendleft(reversed(retry))
        self.stats.write_retries += len(retry)
        if retry and self._wake is not None:
            self._wake.set()

    def _advance_read(self, position: LogPosition) -> None:
        self._read_position = position
        while self._log_waiters and self._log_waiters[0][0] <= position:
            _, _, future = heapq.heappop(self._log_waiters)
            if not future.done():
                future.set_result(None)

    def _halt_with(self, error: PulsarStateError, cause: BaseException | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        self._halt = error
        logger.error("replica of %s halted at position %d: %s", self.topic, self._position, error)
        halted = self._halted_error()
        self._fail_waiters(halted)
        for pending in list(self._queue):
            if not pending.future.done():
                pending.future.set_exception(halted)
        self._queue.clear()

    def _fail_waiters(self, error: BaseException) -> None:
        for _, _, future in self._log_waiters + self._position_waiters:
            if not future.done():
                future.set_exception(error)
        self._log_waiters.clear()
        self._position_waiters.clear()

    def _reached(self, target: LogPosition | None) -> bool:
        return target is None or (self._read_position is not None and self._read_position >= target)

    def _log_waiter(self, target: LogPosition) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._halt is not None:
            future.set_exception(self._halted_error())
        elif self._reached(target):
            future.set_result(None)
        else:
            heapq.heappush(self._log_waiters, (target, next(self._tiebreak), future))
        return future

    async def _wait_log(self, target: LogPosition | None) -> None:
        if target is None or self._reached(target):
            self._check_usable()
            return
        await self._log_waiter(target)

    def _halted_error(self) -> ReplicaHaltedError:
        error = ReplicaHaltedError(
            f"replica of {self.topic} stopped at position {self._position}: {self._halt}",
            position=self._position,
        )
        error.__cause__ = self._halt
        return error

    def _check_usable(self) -> None:
        if self._halt is not None:
            raise self._halted_error()
        if self._closed:
            raise ClosedError(f"manager on {self.topic} is closed")
        if self._wake is None:
            raise ClosedError(f"manager on {self.topic} is not open: use `async with` or open()")

    # ------------------------------------------------------------------ the writer

    async def _writer_loop(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while not self._closed and self._halt is None:
            if not self._queue:
                self._wake.clear()
                if self._producer is None:
                    await self._wake.wait()
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), self.idle_release_s)
                except TimeoutError:
                    await self._release_writer()
                continue
            # Deadlines are the watchdog's job; here only finished writes at the head are
            # dropped (the rest are skipped when a batch is built). A full scan per batch would
            # cost O(queue) each time under a deep queue.
            while self._queue and self._queue[0].future.done():
                self._queue.popleft().queued = False
            if not self._queue:
                continue
            if self._producer is not None and loop.time() - self._producer_since > self.max_hold_s:
                # Let writers in other processes have a turn; they poll for the writer.
                await self._release_writer()
                await asyncio.sleep(0.05)
                continue
            try:
                if self._producer is None:
                    await self._acquire_writer()
                await self._write_batch()
                if self._snapshot_due():
                    self._snapshot_task = asyncio.create_task(self._auto_snapshot())
            except asyncio.CancelledError:
                raise
            except PulsarStateError as exc:
                logger.info("writer on %s: %s; retrying", self.topic, exc)
                await self._release_writer()
                await asyncio.sleep(0.01)
            except Exception:
                logger.exception("writer loop on %s failed; retrying", self.topic)
                await self._release_writer()
                await asyncio.sleep(0.1)

    def _expire(self, now: float) -> None:
        kept: deque[_PendingWrite] = deque()
        for pending in self._queue:
            if not pending.future.done() and now >= pending.deadline:
                self._fail_timeout(pending)
            if pending.future.done():
                pending.queued = False
            else:
                kept.append(pending)
        self._queue = kept

    async def _watchdog(self) -> None:
        """Fail each write whose deadline has passed, wherever it is (queued or in flight)."""
        loop = asyncio.get_running_loop()
        prune_at, last_prune = 4096, loop.time()
        while not self._closed:
            now = loop.time()
            while self._deadlines and self._deadlines[0][0] <= now:
                _, _, pending = heapq.heappop(self._deadlines)
                if not pending.future.done():
                    self._fail_timeout(pending)
            size = len(self._deadlines)
            if size > prune_at or (size > 4096 and now - last_prune > 1.0):
                # Finished writes would otherwise stay (with their results) until their
                # deadline: a busy writer could hold hundreds of thousands of them.
                self._deadlines = [d for d in self._deadlines if not d[2].future.done()]
                heapq.heapify(self._deadlines)
                prune_at, last_prune = max(4096, 2 * len(self._deadlines)), now
            await asyncio.sleep(0.05)

    def _fail_timeout(self, pending: _PendingWrite) -> None:
        pending.future.set_exception(self._timeout_error(pending))

    def _timeout_error(self, pending: _PendingWrite) -> PulsarStateError:
        wid = write_id(self.writer_id, pending.write_seq)
        if pending.outstanding:
            return WriteOutcomeUnknownError(
                f"write {wid} was sent but its outcome was not seen before the timeout; "
                "it was applied once or not at all",
                write_id=wid,
            )
        return OperationTimeoutError(f"write {wid} timed out; nothing was appended")

    async def _acquire_writer(self) -> None:
        assert self._conn is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        latest_deadline = max(p.deadline for p in self._queue)
        budget = max(0.0, min(self.acquire_timeout_s, latest_deadline - started))
        takeover = self.takeover_after_s
        topic = str(self.topic)
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type((WriterBusyError, OperationTimeoutError)),
                wait=wait_random(0.002, 0.03),
                stop=stop_after_delay(budget),
                reraise=True,
            ):
                with attempt:
                    self._expire(loop.time())
                    if not self._queue:
                        return
                    fencing = takeover is not None and loop.time() - started >= takeover
                    if fencing:
                        logger.warning("taking over the writer of %s with fencing", topic)
                    self._producer = await self._conn.create_writer(
                        topic,
                        fencing=fencing,
                        name=None,
                        send_timeout_s=min(self.write_timeout_s, 30.0),
                        timeout_s=max(1.0, budget - (loop.time() - started)),
                    )
        except WriterBusyError:
            waited = loop.time() - started
            for pending in self._queue:
                if pending.future.done():
                    continue
                if pending.outstanding:
                    self._fail_timeout(pending)
                else:
                    pending.future.set_exception(
                        WriterBusyError(
                            f"another process held the writer of {topic} for {waited:.1f}s; "
                            "nothing was appended"
                        )
                    )
            self._expire(loop.time())
            raise
        self._producer_since = loop.time()
        self.stats.writer_acquisitions += 1
        logger.debug("acquired the writer of %s", topic)
        # Exclusive from here on: catch up with everything appended before we got it.
        await self._bounded(self._catch_up(), "catching up after acquiring the writer")

    async def _catch_up(self) -> None:
        await self._wait_log(await self._admin.last_position(self.topic))

    async def _bounded(self, awaitable: Any, what: str) -> None:
        try:
            await asyncio.wait_for(awaitable, self.write_timeout_s)
        except TimeoutError as exc:
            raise OperationTimeoutError(
                f"{what} on {self.topic} took over {self.write_timeout_s}s"
            ) from exc

    async def _release_writer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.close()
            logger.debug("released the writer of %s", self.topic)

    def _trial_state(self) -> S:
        return self._copy_state(self._state) if self._copy_state is not None else self._state

    def _build_records(self, batch: list[_PendingWrite]) -> list[_OutgoingRecord]:
        """Run generators on a trial state, validate their ops, pack them into records.

        Writes are packed as they are generated, so the trial state knows the position each
        write's record will have (``begin_record``) exactly as the replicas will.
        """
        trial = self._trial_state()
        # What was applied to the trial state, to rebuild it when a write fails half-way.
        steps: list[tuple[int, list[Op]]] = []
        records: list[_OutgoingRecord] = []
        base_position, base_id = self._position, self._last_record_id
        group: list[tuple[_PendingWrite, list[bytes]]] = []
        group_size = record_overhead(self.writer_id)

        def flush() -> None:
            nonlocal base_position, base_id, group, group_size
            if not group:
                return
            record = Record(
                writer_id=self.writer_id,
                record_seq=next(self._record_seq),
                base_position=base_position,
                base_record_id=base_id,
                writes=[Write(p.write_seq, enc) for p, enc in group],
            )
            records.append(_OutgoingRecord(record, encode_record(record), [p for p, _ in group]))
            base_position, base_id = base_position + 1, record.record_id
            group, group_size = [], record_overhead(self.writer_id)

        for pending in batch:
            if pending.future.done():
                continue
            try:
                ops = list(pending.generator(trial))
            except Exception as exc:  # the caller's generator: its exception, unchanged
                pending.future.set_exception(exc)
                continue
            try:
                encoded = [self._codec.encode(op) for op in ops]
            except CodecError as exc:
                pending.future.set_exception(exc)
                continue
            except Exception as exc:
                pending.future.set_exception(CodecError(f"cannot encode op: {exc}"))
                continue
            size = sum(len(e) + 8 for e in encoded) + 16
            if size + record_overhead(self.writer_id) > self.max_record_bytes:
                pending.future.set_exception(
                    RecordTooLargeError(
                        f"write of {size} bytes exceeds max_record_bytes={self.max_record_bytes}",
                        size=size,
                        limit=self.max_record_bytes,
                    )
                )
                continue
            if group and (
                len(group) >= self.max_writes_per_record
                or group_size + size > self.max_record_bytes
            ):
                flush()
            position = base_position + 1  # the position of the record this write joins
            try:
                if not group:
                    trial = self._begin(trial, position)
                for op in ops:
                    new_trial = self._apply(trial, op)
                    if new_trial is not None:
                        trial = new_trial
                    elif self._copy_state is None:
                        self._misused_copy_state(pending)
                        return []
            except Exception as exc:
                error = ApplyError(f"apply raised on op {op!r}: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                pending.future.set_exception(error)
                # The trial state may hold part of this write: rebuild it from the real one.
                trial = self._trial_state()
                begun = -1
                for step_position, good_ops in steps:
                    if step_position != begun:
                        trial, begun = self._begin(trial, step_position), step_position
                    for good in good_ops:
                        rebuilt = self._apply(trial, good)
                        if rebuilt is not None:
                            trial = rebuilt
                continue
            steps.append((position, ops))
            group.append((pending, encoded))
            group_size += size
        flush()
        return records

    def _begin(self, state: S, position: int) -> S:
        if self._begin_record is None:
            return state
        new_state = self._begin_record(state, position)
        return state if new_state is None else new_state

    def _misused_copy_state(self, pending: _PendingWrite) -> None:
        # The trial run just mutated the live state with an unacknowledged write: this replica
        # can no longer be trusted, so it stops rather than show that write to readers.
        error = ConfigurationError(
            "apply returned None (mutated the state in place) but copy_state=None promises "
            "apply never mutates its input; pass copy_state (default copy.deepcopy)"
        )
        pending.future.set_exception(error)
        self._halt_with(error)

    async def _write_batch(self) -> None:
        producer = self._producer
        assert producer is not None
        batch = [
            self._queue.popleft() for _ in range(min(len(self._queue), self.max_writes_per_batch))
        ]
        for pending in batch:
            pending.queued = False
        records = self._build_records(batch)
        if not records:
            return
        for outgoing in records:
            self._in_flight[outgoing.record.record_id] = outgoing.pending
            for pending in outgoing.pending:
                pending.attempts += 1
                pending.latest_record = outgoing.record.record_id
                pending.outstanding.add(outgoing.record.record_id)
        # Pipelined: all sends are issued in order before any is awaited.
        sends = [
            asyncio.ensure_future(producer.send(o.payload, key=o.record.record_id)) for o in records
        ]
        acked: list[LogPosition] = []
        failures: list[BaseException] = []
        for outgoing, send in zip(records, sends, strict=True):
            try:
                position = await send
            except Exception as exc:
                failures.append(exc)
                continue
            acked.append(position)
            self._apply_on_ack(outgoing, position)
        self.stats.records_sent += len(records)
        if acked:
            # Every acked record is settled (accepted or ignored) once the pump passes it.
            await self._bounded(self._wait_log(max(acked)), "reading back the records sent")
        if failures:
            # A failed send may still have been persisted: the records stay in flight and are
            # settled by the pump if they ever appear. The writer re-acquires and catches up;
            # writes whose records are not seen by then are retried by _requeue_unseen.
            error = failures[0]
            logger.info("send to %s failed: %s", self.topic, error)
            if all(isinstance(f, RecordTooLargeError) for f in failures):
                # Refused by the client before sending: certainly not persisted, not retriable.
                for outgoing in records:
                    if outgoing.record.record_id not in self._in_flight:
                        continue
                    del self._in_flight[outgoing.record.record_id]
                    for pending in outgoing.pending:
                        pending.outstanding.discard(outgoing.record.record_id)
                        if not pending.future.done():
                            pending.future.set_exception(
                                RecordTooLargeError(
                                    f"the broker's client refused a {len(outgoing.payload)}-byte "
                                    "message (over the broker's maxMessageSize); lower "
                                    "max_record_bytes",
                                    size=len(outgoing.payload),
                                    limit=self.max_record_bytes,
                                )
                            )
                return
            await self._release_writer()
            self._requeue_unseen(records)
            if isinstance(error, PulsarStateError):
                raise error
            raise PulsarStateError(f"send failed: {error}") from error

    def _apply_on_ack(self, outgoing: _OutgoingRecord, position: LogPosition) -> None:
        """Apply our own acknowledged record at once when it is provably next in the log.

        Entries of a ledger are numbered densely, so a record stored at (L, e) while this
        replica has read exactly (L, e-1) has nothing before it left unread: handling it now
        is what the pump would do when the reader delivers it (and the pump then skips it).
        Otherwise (first entry of a ledger, or the pump is behind) the pump handles it.
        """
        last = self._read_position
        if last is not None and last.ledger == position.ledger and last.entry + 1 == position.entry:
            message = RawMessage(outgoing.payload, position, outgoing.record.record_id)
            self._on_message(message, outgoing.record)  # the record we encoded: no need to decode

    def _requeue_unseen(self, records: list[_OutgoingRecord]) -> None:
        # They keep their outstanding record ids: if one of those lands later and is accepted,
        # the write completes from it and the retry's record is ignored as stale.
        unseen = [p for o in records for p in o.pending if o.record.record_id in self._in_flight]
        self._requeue(list(dict.fromkeys(unseen)))
