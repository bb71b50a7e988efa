"""The replica: the pump that reads the log in order and applies the records it accepts.

State changes only here. A record is accepted when the version and last record id it was
computed against are this replica's own; otherwise it is ignored, the same way everywhere.
The write side learns the fate of its records through the small :class:`RecordOwner`
interface; other parts follow the replica through hooks (``after_apply``, ``on_halt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_fixed

from ._context import Context
from ._durable import DurableState, LogMark
from ._envelope import Record, decode_record
from ._errors import (
    ApplyError,
    ClosedError,
    CodecError,
    CorruptRecordError,
    ForkedHistoryError,
    OperationTimeoutError,
    PartitionedTopicError,
    PulsarStateError,
    ReplicaHaltedError,
)
from ._machine import StateMachine, identical
from ._pulsar import (
    LogPosition,
    PulsarConnection,
    RawMessage,
    StallLimit,
    StateReader,
    wait_bounded,
)
from ._records import Adoption
from ._retry import is_transient, retry_transient
from ._telemetry import observe_apply
from ._types import AppliedRecord, OnCorrupt
from ._waiters import Waiters

__all__ = ["Claim", "Replica", "RecordOwner", "subscribe"]

logger = logging.getLogger(__name__)

S = TypeVar("S")
Op = TypeVar("Op")
H = TypeVar("H")

# Pause before replacing a reader that failed for good (the client reconnects by itself).
_REOPEN_PAUSE_S = 0.5
# A replica that has read nothing for this long asks for the log's tail, and replaces its
# reader if it is behind and the reader stays silent (see Replica.watch_reading).
_WATCH_S = 10.0


class Claim(Protocol):
    """The writes of this process in a record being applied (see ``RecordOwner.claim``)."""

    def after_write(self, write_seq: int, state: Any) -> None: ...

    def commit(self, version: int) -> None: ...

    def fail(self, cause: BaseException) -> None: ...


class RecordOwner(Protocol):
    """The write side, as the replica sees it: whose records are whose."""

    def claim(self, record_id: str) -> Claim | None: ...

    def reject(self, record_id: str) -> None: ...


# Bytes of records the client may receive ahead of the replica. The client's queue is counted
# in messages: a replay of records of megabytes queued the whole log (2 GB measured for a
# 10M-key map of 4 MB records). Reading small records is no faster with more than 64 ahead.
_READ_AHEAD_BYTES = 64 * 1024 * 1024


# A holder's reader pauses once it has this few of the holder's records left to read, and
# is replaced (its unread records skipped) once it has this many read-aheads left.
_CAUGHT_UP = 4
_SKIP_AFTER_READ_AHEADS = 16
# Stale records remembered since the last record accepted (a chain built on an older one is
# at most a batch long; past this many, the oldest are forgotten and a chain on one halts).
_MAX_STALE = 65536
# At most this many stale records are kept across an accept (the latest ignored): what a
# snapshot or stored mark carries. A longer chain ahead of the version is forgotten from its
# oldest link, alike on every replica, whether it read the whole log or resumed.
MAX_STALE_KEPT = 4096


def _kept_at(stale: dict[str, int], version: int) -> dict[str, int]:
    """The stale records still to keep once the record making ``version`` is accepted: those
    claiming it or a later position (one claiming an earlier position can match nothing more)."""
    kept = {record_id: claim for record_id, claim in stale.items() if claim >= version}
    if len(kept) > MAX_STALE_KEPT:
        kept = dict(list(kept.items())[-MAX_STALE_KEPT:])
    return kept


def read_ahead(max_record_bytes: int) -> int:
    """Messages a replica's reader may receive ahead of reads, for records up to the size
    this replica writes (records of other writers are rarely larger)."""
    return max(16, min(2000, _READ_AHEAD_BYTES // max_record_bytes))


class Replica(Generic[S, Op]):
    """The state, its version, how far the log has been read, and the pump that moves them."""

    def __init__(
        self,
        state: S,
        machine: StateMachine[S, Op],
        context: Context,
        *,
        on_corrupt: OnCorrupt,
        owner: RecordOwner,
    ) -> None:
        self.state = state
        self.version = 0  # how many records were accepted
        self.last_record_id = ""
        self.read_to: LogPosition | None = None  # the last message handled
        # Where the last record accepted is (or the mark loaded): resuming just after it
        # re-reads the records ignored since, which _stale is made of.
        self.applied_at: LogPosition | None = None
        # The records ignored as stale that may still have a record built on them, each with
        # the position it claimed (its base's + 1): a record built on one of them at that
        # position (a writer's pipelined chain whose first record was ignored) is stale too,
        # not a fork. One claiming a position below the version can match nothing more, so
        # an accept keeps only those claiming its version or later (a chain can go on across
        # another writer's record, and run ahead of the version). (A duplicate of an
        # accepted record is ignored too: a record built on it is accepted first.)
        self._stale: dict[str, int] = {}
        # Those kept at the last accept (ignored before it): a replica resuming just after
        # applied_at reads the later ones again, not these, so snapshots and stored marks
        # carry them, with their claims.
        self.stale_at_applied: tuple[tuple[str, int], ...] = ()
        self.halt: PulsarStateError | None = None
        self.listeners: list[Callable[[AppliedRecord[Op]], None]] = []
        # Internal hooks, called before listeners: (version, state) after each record.
        self.after_apply: list[Callable[[int, S], None]] = []
        # Called after falling forward replaced the state object (a snapshot loaded).
        self.on_state_replaced: list[Callable[[], None]] = []
        self.on_halt: list[Callable[[ReplicaHaltedError], None]] = []
        self._machine = machine
        self._context = context
        self._topic = context.topic
        self._reader_name = f"pulsar-state-{context.writer_id}"
        self._on_corrupt = on_corrupt
        self._owner = owner
        self._stats = context.stats
        self._conn: PulsarConnection | None = None
        self._reader: StateReader | None = None
        self._log_waiters: Waiters[LogPosition] = Waiters()
        self._version_waiters: Waiters[int] = Waiters()
        # Set when the log may be trimmed (trim_history): loads a snapshot at a position at
        # least the one given into this replica; False if there is none to load.
        self.fall_forward: Callable[[int], Awaitable[bool]] | None = None
        # Set with fall_forward: whether the log still holds its message at a position (the
        # broker trims whole ledgers, so a reader moving to another ledger may have skipped
        # some: see _trimmed_behind).
        self.holds_message: Callable[[LogPosition], Awaitable[bool]] | None = None
        self._behind: tuple[Record, LogPosition] | None = None
        self._falling_forward = False  # loading a snapshot: no reads meanwhile, no stall
        self._stall = StallLimit()  # (wait_log_watched)
        # Set for a state that stores itself (``durable_state``): each record is committed.
        self.durable: DurableState[S] | None = None
        # The id of this history's first record (None until known): names the history in
        # snapshots and stored marks, whatever was trimmed from the log since.
        self.origin: str | None = None
        # When (time.monotonic) a record of another process was last read: someone then held
        # the writer, and probably still does for a moment (the writer's relay guess).
        self.foreign_at = float("-inf")
        self._writer_id = context.writer_id
        self._read_ahead = read_ahead(context.settings.max_record_bytes)
        self._skip_after = _SKIP_AFTER_READ_AHEADS * self._read_ahead
        self._replacing: asyncio.Future[None] | None = None

    def load(
        self,
        state: S,
        version: int,
        last_record_id: str,
        read_to: LogPosition | None,
        origin: str | None = None,
        stale: tuple[tuple[str, int], ...] = (),
    ) -> None:
        """Start from a snapshot (or a durable state's mark) instead of the empty state;
        ``read_to`` None: from the log's beginning. ``stale``: the records ignored before the
        last one accepted that may still have a chain built on them, with the positions they
        claimed (the snapshot's or mark's)."""
        self.state, self.version, self.last_record_id = state, version, last_record_id
        self.read_to, self.origin = read_to, origin
        self.applied_at = read_to
        self._stale = dict(stale)
        self.stale_at_applied = tuple(stale)
        self._stats.position = version

    # ------------------------------------------------------------------ the reader

    async def attach(self, conn: PulsarConnection) -> None:
        """Open the reader on the topic, which must be non-partitioned."""
        topic = str(self._topic)
        partitions = await conn.partitions(topic)
        if len(partitions) > 1 or (partitions and partitions[0] != topic):
            raise PartitionedTopicError(
                f"{topic} is partitioned ({len(partitions)} partitions): replicated state needs "
                "a non-partitioned topic, the only kind with one total order",
                topic=topic,
            )
        await self.open_reader(conn)

    async def open_reader(self, conn: PulsarConnection) -> None:
        """Open (or replace) the reader, just after the last message handled."""
        self._conn = conn
        old, self._reader = self._reader, None
        if old is not None:
            await old.close()  # first: a new reader prefetches from the moment it exists
        self._reader = await conn.create_reader(
            str(self._topic),
            name=self._reader_name,
            after=self.read_to,
            prefetch=self._read_ahead,
        )

    def pause_reading(self, applied_to: LogPosition) -> None:
        """Stop reading while this process holds the topic's exclusive writer and has applied
        everything up to ``applied_to``, the last record it appended: only its own records
        can follow, applied on their acks, so reading each back is work for nothing (measured:
        ~150 us of CPU a record). Reading resumes when anything waits for a position or
        version not reached (a ledger's first entry, a fencer's records), when the writer is
        released (:meth:`resume_reading`); meanwhile the reader looks at the log a second
        after the latest pause and every second (a fencer's records), then pauses again.

        What the paused reader leaves unread is never read: past ``_SKIP_AFTER_READ_AHEADS``
        read-aheads of it, or when reading is wanted while more than one read-ahead is
        unread, a new reader replaces it just after :attr:`read_to` (see
        :meth:`_skip_unread`)."""
        reader = self._reader
        if reader is None:
            return
        behind = reader.behind(applied_to)
        if reader.paused:
            if self._replacing is not None:
                return  # being replaced: the old one stays paused until it is closed
            if behind is None or behind > self._skip_after:
                self._skip_unread(reader)
            else:
                reader.pause(applied_to)  # from now: the look comes a second after this
            return
        if (
            behind is not None
            and behind <= _CAUGHT_UP
            and self.reached(applied_to)
            # A waiter resumed reading for a record this process may not have written.
            and not self._log_waiters.waiting()
            and not self._version_waiters.waiting()
        ):
            reader.pause(applied_to)

    def resume_reading(self) -> None:
        """Read again (a waiter wants a record, or the writer was released): at once, or
        through a new reader if the paused one left more than the read-ahead unread."""
        reader = self._reader
        if reader is None or not reader.paused:
            return
        behind = reader.behind(self.read_to) if self.read_to is not None else None
        if behind is not None and behind <= self._read_ahead:
            reader.resume()
        else:
            self._skip_unread(reader)

    def _skip_unread(self, reader: StateReader) -> None:
        """Replace ``reader`` (paused, behind with this process's own records) by one that
        starts just after :attr:`read_to`, in a task; it keeps reading in the meantime only
        if the replacement cannot be made."""
        if (
            self._replacing is not None  # (a waiter: the old one reads on meanwhile)
            or self._conn is None
            or self._behind is not None
            or self._context.closed
        ):
            reader.resume()
            return
        self._replacing = asyncio.ensure_future(self._replace_reader(reader, self._conn))
        self._replacing.add_done_callback(self._replaced)

    def _replaced(self, task: asyncio.Future[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.warning(
                "replacing the paused reader of %s failed", self._topic, exc_info=task.exception()
            )

    async def _replace_reader(self, old: StateReader, conn: PulsarConnection) -> None:
        try:
            # Created before the old one is closed, so the pump has one to read at once;
            # from read_to as of now: what this process applies meanwhile is skipped.
            new = await conn.create_reader(
                str(self._topic),
                name=self._reader_name,
                after=self.read_to,
                prefetch=self._read_ahead,
            )
        except Exception as exc:  # any: nobody awaits this task
            logger.debug("replacing the paused reader of %s: %s", self._topic, exc)
            old.resume()  # reads what it left instead
            return
        finally:
            self._replacing = None
        if self._reader is not old or self._context.closed or self.halt is not None:
            await new.close()  # replaced (or closed) meanwhile by someone else
            return
        self._reader = new
        self._stats.readers_replaced += 1
        await old.close()  # the pump, waiting on it, goes on with the new one

    async def close_reader(self, timeout: float) -> None:
        replacing = self._replacing
        if replacing is not None:
            # A replacement under way creates a reader: it must not outlive the close.
            replacing.cancel()
            await asyncio.wait({replacing}, timeout=timeout)
        if self._reader is not None:
            with contextlib.suppress(TimeoutError):
                await wait_bounded(self._reader.close(), timeout)

    async def pump(self) -> None:
        """Read and apply until closed or halted. Never ends with an exception nobody reads:
        whatever escapes (a bug here or in user code) halts the replica with it."""
        try:
            await self._pump()
        except Exception as exc:
            if self._context.closed or self.halt is not None:
                logger.debug("pump of %s ended after close or halt: %r", self._topic, exc)
                return
            self.halt_with(
                PulsarStateError(
                    f"the pump of {self._topic} failed after message {self.read_to}: "
                    f"{type(exc).__name__}: {exc}"
                ),
                cause=exc,
            )

    async def _pump(self) -> None:
        while not self._context.closed:
            batch = await self._next_batch()
            if batch is None:
                return
            for message in batch:
                if self._enters_ledger(message) and await self._trimmed_behind(message):
                    if self.halt is not None:
                        return  # halted meanwhile (by the writer): stays where it is
                    await self._fall_forward_over_trim(message.position)
                    break  # the reader was replaced: the rest of this batch is not ours
                self.on_message(message)
                if self.halt is not None:
                    return
                if self._behind is not None:
                    await self._fall_forward()
                    break  # the reader was replaced: the rest of this batch is not ours

    async def _next_batch(self) -> list[RawMessage] | None:
        """The next messages; None once closed. A reader that failed for good is replaced
        after a pause, resuming right after the last message this replica has handled."""
        reader = self._reader
        assert reader is not None
        try:
            return await reader.read_batch()  # the hot path: no retry machinery
        except PulsarStateError as exc:
            if self._context.closed:
                return None
            if self._swapped(reader):
                return []
            logger.warning("reading %s failed (%s); reopening the reader", self._topic, exc)
        await asyncio.sleep(_REOPEN_PAUSE_S)  # the client reconnects by itself meanwhile
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(self._worth_retrying),
                wait=wait_fixed(_REOPEN_PAUSE_S),
                before_sleep=self._log_read_failure,
                reraise=True,
            ):
                with attempt:
                    if self._context.closed:
                        return None
                    assert self._conn is not None
                    await self.open_reader(self._conn)
                    reader = self._reader
                    assert reader is not None
                    try:
                        return await reader.read_batch()
                    except PulsarStateError:
                        if self._swapped(reader):
                            return []
                        raise
        except PulsarStateError:
            if self._context.closed:
                return None
            raise
        raise AssertionError("unreachable: the reads are retried until one succeeds")

    def _swapped(self, reader: StateReader) -> bool:
        """Whether ``reader`` was closed because another replaced it on purpose (a holder's
        unread records skipped): the pump goes on with the new one, no failure."""
        return self._reader is not reader and self._reader is not None

    def _worth_retrying(self, exc: BaseException) -> bool:
        return isinstance(exc, PulsarStateError) and not self._context.closed

    def _log_read_failure(self, retry_state: RetryCallState) -> None:
        failed = retry_state.outcome.exception() if retry_state.outcome is not None else None
        logger.warning("reader on %s failed again (%s); reopening it", self._topic, failed)

    # ------------------------------------------------------------------ applying

    def on_message(
        self,
        message: RawMessage,
        record: Record | None = None,
        adoption: Adoption | None = None,
    ) -> None:
        """Handle the next message of the log (``record``: already decoded, our own;
        ``adoption``: its trial state, see :meth:`apply_own`)."""
        if self.halt is not None:
            return  # a halted replica stays at its last good state, whoever hands it more
        if self.read_to is not None and message.position <= self.read_to:
            logger.debug("ignoring redelivered message %s", message.position)
            return
        self._stats.records_read += 1
        self._stats.bytes_read += len(message.payload)
        try:
            self._handle(message, record, adoption)
        except BaseException as exc:
            # User code (a codec, a hook) or a bug raised: the state may hold part of this
            # message, so stop here, loudly, rather than let the pump die unseen (or, for a
            # BaseException, handle the message again: applied twice).
            self.halt_with(
                PulsarStateError(
                    f"handling message {message.position} of {self._topic} raised "
                    f"{type(exc).__name__}: {exc}"
                ),
                cause=exc,
            )
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise

    def _handle(
        self, message: RawMessage, record: Record | None, adoption: Adoption | None = None
    ) -> None:
        at = message.position
        if record is None:
            try:
                record = decode_record(message.payload, message_id=str(at))
            except CorruptRecordError as exc:
                # Not a record at all: every replica sees the same, so skipping is safe.
                if self._on_corrupt == "skip":
                    self._stats.records_skipped += 1
                    logger.warning("skipping message on %s: %s", self._topic, exc)
                    self._advance_read(at)
                    return
                self.halt_with(exc)
                return
        if record.writer_id != self._writer_id:
            self.foreign_at = time.monotonic()
        if record.base_position < self.version:
            self._reject(record)
        elif record.base_position == self.version and record.base_record_id == self.last_record_id:
            if (
                adoption is not None
                and adoption.decoded is not None
                and adoption.base is self.state
            ):
                # Built on exactly this state (the same object at the record's base: the
                # live state changes only by records, and a loaded snapshot is another
                # object) with the ops every replica decodes: its trial state is what
                # applying the record gives.
                decoded = [adoption.decoded]
            else:
                adoption = None  # applied as any record
                try:
                    decoded = self._decode(record, at)
                except (CorruptRecordError, CodecError) as exc:
                    # Never skipped, whatever on_corrupt says: replicas that can decode it
                    # accept it, so skipping would fork this replica's history (and its
                    # writes with it).
                    self.halt_with(exc)
                    return
            self._apply(record, decoded, at, adoption)
            if self.halt is not None:
                return
        elif self._stale.get(record.base_record_id) == record.base_position:
            self._reject(record)  # built on a stale record, where that one claimed to be
        elif self.fall_forward is not None:
            # Ahead of this replica: the records between were trimmed away while it was
            # behind (or its history forked). A snapshot at or after the base decides which.
            self._behind = (record, at)
            return
        else:
            self.halt_with(self._forked(record, at))
            return
        self._advance_read(at)

    def _enters_ledger(self, message: RawMessage) -> bool:
        """Whether ``message`` is the first one read in another ledger than the last one
        handled, on a log that may be trimmed."""
        read_to = self.read_to
        return (
            self.holds_message is not None
            and read_to is not None
            and read_to.ledger >= 0  # (-1:-1: before the first message, e.g. an empty snapshot)
            and message.position.ledger > read_to.ledger
            and message.position > read_to
            and self.halt is None
        )

    async def _trimmed_behind(self, message: RawMessage) -> bool:
        """Whether the broker deleted the ledger of the last message handled (and with it
        any message after it there) before this replica's reader moved on to ``message``.

        The broker trims whole ledgers, oldest first, and a reader whose next message was
        deleted goes on at the first one left. Whatever it skipped may hold the record
        accepted at this replica's position; the first record left may then be one based on
        the same position, stale for every replica that read the whole log, yet accepted
        here. If that ledger is still there, nothing after the message in it was skipped."""
        holds = self.holds_message
        read_to = self.read_to
        assert holds is not None
        assert read_to is not None
        self._falling_forward = True  # no reads meanwhile: not a stalled reader
        try:
            held = await self._until_answered(lambda: holds(read_to), read_to)
        finally:
            self._falling_forward = False
        if not held:
            logger.info(
                "%s: message %s follows %s, which the log no longer holds (trimmed): falling "
                "forward to a snapshot",
                self._topic,
                message.position,
                read_to,
            )
        return not held

    async def _until_answered(
        self, ask: Callable[[], Awaitable[bool]], read_to: LogPosition
    ) -> bool:
        """``ask()``, asked again after each failure until it answers (the replica waits at
        the ledger's edge meanwhile, as it would for a reader that fails): a check that
        failed or took long is no reason to halt a replica that may be healthy. A permanent
        error is raised (the pump halts with it); ClosedError once closed."""
        pause = _REOPEN_PAUSE_S
        while True:
            if self._context.closed:
                raise ClosedError(f"manager on {self._topic} is closed")
            try:
                return await ask()
            except (PulsarStateError, TimeoutError) as exc:
                if self._context.closed:
                    raise ClosedError(f"manager on {self._topic} is closed") from exc
                if not (is_transient(exc) or isinstance(exc, TimeoutError)):
                    raise  # (refused, not failed: the pump halts with it, loudly)
                logger.warning(
                    "checking that %s still holds message %s failed (%s); asking again in %.1fs",
                    self._topic,
                    read_to,
                    exc,
                    pause,
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, _WATCH_S)

    async def _fall_forward_over_trim(self, at: LogPosition) -> None:
        read_to = self.read_to

        def trimmed_away() -> PulsarStateError:
            return ForkedHistoryError(
                f"message {at} of {self._topic} follows message {read_to}, which the log no "
                f"longer holds (trimmed away), and no snapshot at position {self.version} or "
                "later checks out: this replica cannot tell which records it missed",
                message_id=str(at),
            )

        self._falling_forward = True
        try:
            await self._fall_forward_to(self.version, trimmed_away)
        finally:
            self._falling_forward = False

    async def _fall_forward(self) -> None:
        assert self._behind is not None
        assert self.fall_forward is not None
        record, at = self._behind
        self._behind = None
        logger.info(
            "%s: message %s is based on position %d, past this replica's %d: falling forward "
            "to a snapshot",
            self._topic,
            at,
            record.base_position,
            self.version,
        )
        self._falling_forward = True
        try:
            await self._fall_forward_to(record.base_position, lambda: self._forked(record, at))
        finally:
            self._falling_forward = False

    async def _fall_forward_to(self, needed: int, unfound: Callable[[], PulsarStateError]) -> None:
        """Load a snapshot at position ``needed`` or later; halt with ``unfound()`` if none
        checks out."""
        if self.halt is not None or self._context.closed:
            return  # a halted replica stays at its last good state
        behind_at = self.version
        fall_forward = self.fall_forward
        assert fall_forward is not None
        deadline = asyncio.get_running_loop().time() + self._context.settings.open_timeout_s
        loaded = await retry_transient(
            lambda: fall_forward(needed),
            deadline=deadline,
            what=f"loading a snapshot of {self._topic} to fall forward to",
        )
        if not loaded:
            self.halt_with(unfound())
            return
        self._stats.fell_forward += 1
        for hook in list(self.on_state_replaced):
            hook()
        logger.warning(
            "%s was trimmed past this replica (at position %d): fell forward to the snapshot "
            "at position %d",
            self._topic,
            behind_at,
            self.version,
        )
        assert self.read_to is not None
        conn = self._conn
        assert conn is not None
        self._log_waiters.release(self.read_to)
        self._version_waiters.release(self.version)
        await retry_transient(
            lambda: self.open_reader(conn),
            # Its own deadline: the snapshot's load may have used most of the first.
            deadline=asyncio.get_running_loop().time() + self._context.settings.open_timeout_s,
            what=f"reopening the reader on {self._topic} after the snapshot",
        )

    def _decode(self, record: Record, at: LogPosition) -> list[list[Op]]:
        try:
            return self._machine.decode(record, at)
        except CorruptRecordError:
            raise
        except Exception as exc:
            raise CodecError(
                f"message {at}: the op codec raised {type(exc).__name__} on record "
                f"{record.record_id}: {exc}"
            ) from exc

    def check_adoption(self, record: Record, adoption: Adoption) -> None:
        """Decode our own ``record`` (sent: called while its acknowledgement is awaited) and
        let it be applied by adopting its trial state only if the ops decode to exactly those
        the trial ran: then the trial state is what every replica's apply gives. Otherwise
        (a codec that changes types, or fails) the record is decoded and applied on its
        acknowledgement, as every replica does, and any failure halts there."""
        try:
            (ops,) = self._machine.decode(record, LogPosition(-1, -1))
        except Exception:
            return
        if identical(adoption.ops, ops):  # both lists
            adoption.decoded = ops

    def check_ops(self, record: Record) -> None:
        """Raise CorruptRecordError or CodecError if this replica's codec cannot decode the
        ops of ``record`` (one not in the log: another process's, relayed)."""
        self._decode(record, LogPosition(-1, -1))

    def _forked(self, record: Record, at: LogPosition) -> ForkedHistoryError:
        # In one history a record's base is never ahead of a replica that has read everything
        # before it: its writer accepted records this replica did not (or the reverse).
        return ForkedHistoryError(
            f"forked history: message {at} (record {record.record_id}) was written on top of "
            f"position {record.base_position} / record {record.base_record_id!r}, but this "
            f"replica is at {self.version} / {self.last_record_id!r} after reading everything "
            "before it. This replica and that writer hold different histories (a record "
            "skipped or missed by one of them, or a log that lost its beginning)",
            message_id=str(at),
        )

    def _reject(self, record: Record) -> None:
        self._stats.records_rejected += 1
        stale = self._stale
        stale[record.record_id] = record.base_position + 1
        if len(stale) > _MAX_STALE:  # a flood of stale records: forget the oldest
            del stale[next(iter(stale))]
        logger.debug(
            "ignoring stale record %s (based on %d/%r, replica at %d/%r)",
            record.record_id,
            record.base_position,
            record.base_record_id,
            self.version,
            self.last_record_id,
        )
        self._owner.reject(record.record_id)

    def apply_own(
        self, payload: bytes, record: Record, at: LogPosition, adoption: Adoption | None = None
    ) -> None:
        """Apply our own acknowledged record at once when it is provably next in the log;
        by adopting its trial state (``adoption``) while the live state is the one it was
        built on.

        Entries of a ledger are numbered densely, so a record stored at (L, e) while this
        replica has read exactly (L, e-1) has nothing before it left unread: handling it now
        is what the pump would do when the reader delivers it (and the pump then skips it).
        Otherwise (first entry of a ledger, or the pump is behind) the pump handles it.
        """
        if self.is_next(at):
            self.on_message(RawMessage(payload, at), record, adoption)  # no need to decode

    def is_next(self, at: LogPosition) -> bool:
        """Whether the message stored at ``at`` is provably the next one in the log: the
        same ledger as the last one handled, and the entry after it."""
        last = self.read_to
        return last is not None and last.ledger == at.ledger and last.entry + 1 == at.entry

    def _apply(
        self,
        record: Record,
        decoded: list[list[Op]],
        at: LogPosition,
        adoption: Adoption | None = None,
    ) -> None:
        claim = self._owner.claim(record.record_id)
        try:
            self._apply_claimed(record, decoded, at, adoption, claim)
        except BaseException as exc:
            if claim is not None:
                claim.fail(exc)  # a hook raised: the pump halts the replica next
            raise
        if claim is not None and self.halt is not None:
            # Its writes left the in-flight set that a halt fails: fail them now, not at
            # their deadline.
            claim.fail(self.halted_error())

    def _apply_claimed(
        self,
        record: Record,
        decoded: list[list[Op]],
        at: LogPosition,
        adoption: Adoption | None,
        claim: Claim | None,
    ) -> None:
        seqs = [w.write_seq for w in record.writes]

        def after_write(index: int, state: S) -> None:
            if claim is not None:
                claim.after_write(seqs[index], state)

        started = time.perf_counter()
        try:
            if adoption is not None:
                self.state = self._machine.adopt(self.state, adoption.trial)
                after_write(0, self.state)
            else:
                self.state = self._machine.apply_record(
                    self.state, self.version + 1, decoded, after_write
                )
        except Exception as exc:
            # The writer validated these ops on an identical state, so apply is not
            # deterministic (or adopt_trial failed). The state may hold part of this
            # record: stop here, loudly.
            culprit = "adopt_trial" if adoption is not None else "apply"
            self.halt_with(
                ApplyError(
                    f"{culprit} raised on record {record.record_id} at message {at}: "
                    f"{type(exc).__name__}: {exc}; {culprit} must be deterministic"
                ),
                cause=exc,
            )
            return
        origin = record.record_id if self.version == 0 else self.origin
        version = self.version + 1
        kept = _kept_at(self._stale, version) if self._stale else self._stale
        if self.durable is not None:
            try:
                self.durable.commit(
                    self.state, LogMark(version, record.record_id, at, origin, tuple(kept.items()))
                )
            except Exception as exc:
                # Not stored, so not applied: stop at the last record stored (the log keeps
                # this one; a replica reopened once the cause is fixed applies it).
                self.halt_with(
                    PulsarStateError(
                        f"could not store record {record.record_id} (message {at}) in the "
                        f"durable state: {type(exc).__name__}: {exc}"
                    ),
                    cause=exc,
                )
                return
        observe_apply(self._stats, self._context.attributes, time.perf_counter() - started)
        self.version = version
        self.last_record_id, self.origin = record.record_id, origin
        self.applied_at = at
        if self._stale or self.stale_at_applied:
            self._stale = kept
            self.stale_at_applied = tuple(kept.items())
        self._stats.position = self.version
        for hook in self.after_apply:
            hook(self.version, self.state)
        if claim is not None:
            claim.commit(self.version)
        if self.listeners:
            applied = AppliedRecord(self.version, record.record_id, at, decoded)
            for listener in list(self.listeners):
                try:
                    listener(applied)
                except BaseException as exc:  # (its record is applied: no halt for it)
                    if isinstance(exc, KeyboardInterrupt | SystemExit):
                        raise
                    logger.exception("listener raised; it stays registered")
        self._version_waiters.release(self.version)

    def _advance_read(self, at: LogPosition) -> None:
        self.read_to = at
        self._log_waiters.release(at)

    # ------------------------------------------------------------------ halting

    def halt_with(self, error: PulsarStateError, cause: BaseException | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        self.halt = error
        logger.error(
            "replica of %s halted at position %d: %s",
            self._topic,
            self.version,
            error,
            exc_info=cause,
        )
        halted = self.halted_error()
        self.fail_waiters(halted)
        for hook in self.on_halt:
            hook(halted)

    def halted_error(self) -> ReplicaHaltedError:
        error = ReplicaHaltedError(
            f"replica of {self._topic} stopped at position {self.version}: {self.halt}",
            position=self.version,
        )
        error.__cause__ = self.halt
        return error

    def check_running(self) -> None:
        if self.halt is not None:
            raise self.halted_error()
        if self._context.closed:
            raise ClosedError(f"manager on {self._topic} is closed")

    # ------------------------------------------------------------------ waiting

    def reached(self, target: LogPosition | None) -> bool:
        return target is None or (self.read_to is not None and self.read_to >= target)

    def log_waiter(self, target: LogPosition) -> asyncio.Future[None]:
        """A future done once the pump has handled the message at ``target``."""
        if self.halt is not None:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            future.set_exception(self.halted_error())
            return future
        if self.reached(target):
            future = asyncio.get_running_loop().create_future()
            future.set_result(None)
            return future
        self.resume_reading()
        return self._log_waiters.add(target)

    async def wait_log(self, target: LogPosition | None) -> None:
        if target is None or self.reached(target):
            self.check_running()
            return
        await self.log_waiter(target)

    async def wait_log_watched(self, target: LogPosition | None) -> None:
        """:meth:`wait_log`, reopening the reader when nothing at all is read for a while
        (:class:`~._pulsar.StallLimit`) while the log holds more: the broker can leave a reader
        subscribed during a topic unload attached to the closed topic, where no message ever
        comes (measured: 1 in about 700 readers opened during unloads)."""
        if target is None or self.reached(target):
            self.check_running()
            return
        waiting = asyncio.ensure_future(self.wait_log(target))
        try:
            while True:
                # The same reader having read nothing for a whole wait: one replaced meanwhile
                # (by the pump, a fall-forward) has not had its chance yet.
                seen, reader = self._stats.records_read, self._reader
                stall = self._stall.seconds(seen)
                done, _ = await asyncio.wait({waiting}, timeout=stall)
                if done:
                    return waiting.result()
                if (
                    self._stats.records_read == seen
                    and reader is not None
                    and reader is self._reader
                    and self.halt is None
                    and not self._context.closed
                    and not self._falling_forward  # (reads again once it has loaded)
                ):
                    logger.warning(
                        "no message from %s for %.0fs while its tail is at %s and this "
                        "replica at %s: reopening the reader",
                        self._topic,
                        stall,
                        target,
                        self.read_to,
                    )
                    reader.abandon(f"no message for {stall:.0f}s while behind the tail")
                    self._stall.replaced(seen)
        finally:
            waiting.cancel()

    async def watch_reading(self, tail: Callable[[], Awaitable[LogPosition | None]]) -> None:
        """Until closed or halted: after each :data:`_WATCH_S` in which nothing was read,
        ask for the log's ``tail`` and read up to it watched (:meth:`wait_log_watched`), so a
        reader stuck on a closed topic is replaced even when nobody waits for a position;
        else watches and local reads would go stale without an error. One binary tail
        request per quiet ``_WATCH_S`` (None from ``tail``: nothing to look for); none while
        records come, nor while the reader is paused (a holder's: it looks at the log by
        itself, and its own next record must not be read back before its acknowledgement)."""
        while not self._context.closed and self.halt is None:
            seen = self._stats.records_read
            await asyncio.sleep(_WATCH_S)
            reader = self._reader
            if (
                self._stats.records_read != seen
                or self._falling_forward
                or reader is None
                or reader.paused
            ):
                continue
            try:
                target = await tail()
                if target is None or self.reached(target):
                    continue
                async with asyncio.timeout(self._stall.seconds(seen) + _WATCH_S):
                    await self.wait_log_watched(target)
            except (PulsarStateError, TimeoutError) as exc:
                # Closed, halted (the loop ends) or the broker away: the next look tries again.
                logger.debug("watching the reader of %s: %r", self._topic, exc)
            except Exception:  # a bug: logged, and the watch goes on
                logger.warning("watching the reader of %s failed", self._topic, exc_info=True)

    def version_waiter(self, version: int) -> asyncio.Future[None]:
        if version > self.version:
            self.resume_reading()
        return self._version_waiters.add(version)

    async def wait_version(self, version: int, timeout: float) -> None:
        """Wait until ``version`` records are accepted, or raise OperationTimeoutError."""
        if self.version >= version:
            return
        try:
            async with asyncio.timeout(timeout):
                await self.version_waiter(version)
        except TimeoutError as exc:
            raise OperationTimeoutError(
                f"position {version} not reached in {timeout}s (at {self.version})"
            ) from exc

    async def catch_up(
        self, tail: Callable[[], Awaitable[LogPosition | None]], timeout: float
    ) -> int:
        """Read up to the log's tail as ``tail()`` captures it now (retried while transient);
        returns the version reached, or raises OperationTimeoutError after ``timeout``."""
        deadline = asyncio.get_running_loop().time() + timeout
        what = f"capturing the tail of {self._context.topic}"
        target = await retry_transient(tail, deadline=deadline, what=what)
        behind_from, started = self._stats.records_read, time.perf_counter()
        if target is None or self.reached(target):
            # Already there (a latest read on a quiet topic): no watch, no timer.
            self.check_running()
            self._stats.tail_lag_records, self._stats.tail_lag_seconds = 0, 0.0
            return self.version
        try:
            async with asyncio.timeout_at(deadline):
                await self.wait_log_watched(target)
        except TimeoutError as exc:
            raise OperationTimeoutError(
                f"could not catch up with {self._context.topic} in {timeout}s"
            ) from exc
        self._stats.tail_lag_records = self._stats.records_read - behind_from
        self._stats.tail_lag_seconds = time.perf_counter() - started
        return self.version

    def add_listener(self, listener: Callable[[AppliedRecord[Op]], None]) -> Callable[[], None]:
        """Register ``listener`` for each accepted record; returns its unsubscribe."""
        return subscribe(self.listeners, listener)

    def fail_waiters(self, error: BaseException) -> None:
        self._log_waiters.fail(error)
        self._version_waiters.fail(error)


def subscribe(hooks: list[H], hook: H) -> Callable[[], None]:
    """Add ``hook`` to ``hooks``; returns its unsubscribe (safe to call twice)."""
    hooks.append(hook)

    def unsubscribe() -> None:
        with contextlib.suppress(ValueError):
            hooks.remove(hook)

    return unsubscribe
