"""The writes of this process that are not settled yet: queued, in flight, or past deadline.

A write is *queued* until a batch takes it, then *in flight* in one or more records (each
attempt is one record) until the replica accepts one of them, ignores the newest, or its
deadline passes. The replica settles in-flight records through :meth:`PendingWrites.claim`
and :meth:`PendingWrites.reject` only; it never sees the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._context import Context
from ._envelope import write_id
from ._errors import (
    ClosedError,
    OperationTimeoutError,
    PulsarStateError,
    WriteOutcomeUnknownError,
    callback_error,
)
from ._records import OutgoingRecord
from ._telemetry import observe_write
from ._types import ManagerStats, WriteResult

__all__ = ["PendingWrite", "PendingWrites", "RecordClaim"]

logger = logging.getLogger(__name__)

# The deadline heap is pruned of finished writes once it holds more than this.
_PRUNE_AT = 4096


@dataclass(eq=False, slots=True)
class PendingWrite:
    generator: Callable[[Any], Sequence[Any]]
    reader: Callable[[Any], Any] | None
    future: asyncio.Future[WriteResult[Any]]
    deadline: float
    write_seq: int
    # When it was submitted (loop clock): its wait for the topic's writer is counted from it.
    submitted_at: float = 0.0
    queued: bool = True
    # The record of the newest attempt; only its rejection triggers a retry.
    latest_record: str | None = None
    # Records carrying an attempt that may still land; empty means "certainly not applied".
    outstanding: set[str] = field(default_factory=set)
    # Attempts sent through the write relay (the writer takes the writer itself after a few),
    # and the base position of the latest (one may be appended late while that is the tip).
    relays: int = 0
    relayed_base: int | None = None
    # Its failure, decided on the state it was built on: given once that state is confirmed
    # the log's latest (as a write that changes nothing is confirmed), else decided again.
    refusal: BaseException | None = None
    # A batch holding it could not be built once (copy_state raised): the next time, it fails.
    build_failed: bool = False


class RecordClaim:
    """This process's writes in one record the replica is applying."""

    def __init__(
        self, record_id: str, writer_id: str, writes: list[PendingWrite], stats: ManagerStats
    ) -> None:
        self._record_id = record_id
        self._writer_id = writer_id
        self._by_seq = {p.write_seq: p for p in writes}
        self._stats = stats
        self._results: list[tuple[PendingWrite, Any, BaseException | None]] = []

    def after_write(self, write_seq: int, state: Any) -> None:
        """Run the write's reader on the state right after its ops."""
        pending = self._by_seq.get(write_seq)
        if pending is None:
            return
        value: Any = None
        error: BaseException | None = None
        if pending.reader is not None:
            try:
                value = pending.reader(state)
            except BaseException as exc:  # the caller's reader: its error, its write
                error = callback_error(exc, "the write's reader")
        self._results.append((pending, value, error))

    def fail(self, cause: BaseException) -> None:
        """The replica halted while applying the record: its writes fail at once (not at
        their deadline). The record is in the log, so other replicas may apply it."""
        for pending in self._by_seq.values():
            pending.outstanding.discard(self._record_id)
            if not pending.future.done():
                wid = write_id(self._writer_id, pending.write_seq)
                error = WriteOutcomeUnknownError(
                    f"the replica halted while applying the record of write {wid}; other "
                    "replicas may apply it (it is in the log)",
                    write_id=wid,
                )
                error.__cause__ = cause
                pending.future.set_exception(error)

    def commit(self, version: int) -> None:
        """The record was accepted as ``version``: complete its writes."""
        for pending, value, error in self._results:
            pending.outstanding.discard(self._record_id)
            if pending.future.done():
                continue
            self._stats.writes_committed += 1
            if error is not None:
                pending.future.set_exception(error)
            else:
                pending.future.set_result(WriteResult(value, version))


class PendingWrites:
    """The write queue, the records in flight, and the deadlines of one manager."""

    def __init__(self, context: Context) -> None:
        self._context = context
        self._writer_id = context.writer_id
        self._stats = context.stats
        self.queue: deque[PendingWrite] = deque()
        self.deadlines: list[tuple[float, int, PendingWrite]] = []
        self._in_flight: dict[str, list[PendingWrite]] = {}
        # The position each record in flight claims (its base's + 1): see skipped_to.
        self._claims: dict[str, int] = {}
        self._write_seq = itertools.count(1)
        self.wake = asyncio.Event()
        # Set whenever the replica settles (claims or rejects) a record of ours in flight.
        self.settled = asyncio.Event()
        # The writer's latest failure, named when a write times out (why it did not land).
        self.last_failure: BaseException | None = None
        # Called as each write is queued; True: the writer sends it without being woken
        # (Writer.queued).
        self.on_submit: Callable[[], bool] | None = None

    # ------------------------------------------------------------------ the queue

    def submit(
        self,
        generator: Callable[[Any], Sequence[Any]],
        reader: Callable[[Any], Any] | None,
        timeout: float,
    ) -> asyncio.Future[WriteResult[Any]]:
        loop = asyncio.get_running_loop()
        now = loop.time()
        pending = PendingWrite(
            generator=generator,
            reader=reader,
            future=loop.create_future(),
            deadline=now + timeout,
            write_seq=next(self._write_seq),
            submitted_at=now,
        )
        # perf_counter, not loop.time(): uvloop's clock counts whole milliseconds.
        pending.future.add_done_callback(functools.partial(self._observe, time.perf_counter()))
        self.queue.append(pending)
        heapq.heappush(self.deadlines, (pending.deadline, pending.write_seq, pending))
        if self.on_submit is None or not self.on_submit():
            self.wake.set()
        return pending.future

    def _observe(self, submitted: float, future: asyncio.Future[WriteResult[Any]]) -> None:
        if future.cancelled():
            error: str | None = "CancelledError"
        else:
            failure = future.exception()
            error = None if failure is None else type(failure).__name__
        seconds = time.perf_counter() - submitted
        observe_write(self._stats, self._context.attributes, seconds, error)

    def take(self, count: int) -> list[PendingWrite]:
        batch = [self.queue.popleft() for _ in range(min(len(self.queue), count))]
        for pending in batch:
            pending.queued = False
        return batch

    def drop_finished_head(self) -> None:
        # Only the head: a full scan per batch would cost O(queue) under a deep queue; the
        # others are skipped when a batch is built.
        while self.queue and self.queue[0].future.done():
            self.queue.popleft().queued = False

    def expire(self, now: float) -> None:
        """Fail the queued writes past their deadline and drop every finished one."""
        kept: deque[PendingWrite] = deque()
        for pending in self.queue:
            if not pending.future.done() and now >= pending.deadline:
                self.fail_timeout(pending)
            if pending.future.done():
                pending.queued = False
            else:
                kept.append(pending)
        self.queue = kept

    def requeue(self, retry: Iterable[PendingWrite], *, retry_count: bool = True) -> None:
        # Retried first, in their original order: they waited longest. A write is never in
        # the queue twice, or its generator could run and commit twice in one batch.
        # ``retry_count``: counted in ``write_retries`` (not when nothing was sent).
        again = [p for p in retry if not p.queued and not p.future.done()]
        if self._context.closed:
            # Nobody serves the queue any more (it was failed and the watchdog stops): end
            # them here, or their callers would wait forever.
            for pending in again:
                pending.future.set_exception(self._closed_error(pending))
            return
        for pending in again:
            pending.queued = True
            pending.refusal = None  # decided again
        self.queue.extendleft(reversed(again))
        if retry_count:
            self._stats.write_retries += len(again)
        if again:
            self.wake.set()

    def complete_unchanged(self, writes: list[PendingWrite], state: Any, position: int) -> None:
        """Complete writes that appended nothing: ``state`` (at ``position``) is the latest."""
        for pending in writes:
            if pending.future.done():
                continue
            self._stats.writes_committed += 1
            try:
                value = pending.reader(state) if pending.reader is not None else None
            except BaseException as exc:  # the caller's reader: its error, its write
                pending.future.set_exception(callback_error(exc, "the write's reader"))
                continue
            pending.future.set_result(WriteResult(value, position))

    def fail_queued(self, error: PulsarStateError) -> None:
        """End the queued writes with ``error`` (a ClosedError or the replica's halt); one
        whose earlier attempt was sent, and may still land, gets WriteOutcomeUnknownError."""
        for pending in list(self.queue):
            if not pending.future.done():
                pending.future.set_exception(self._ended_error(pending, error))
        self.queue.clear()

    def fail_unfinished(self, error: PulsarStateError) -> None:
        """End every write without its outcome yet, wherever it is: queued, in flight, or
        taken into a batch that the writer was building or checking when it stopped. After a
        close or a halt nothing else ends them (the deadline watchdog stops with the close)."""
        for _, _, pending in self.deadlines:
            if not pending.future.done():
                pending.future.set_exception(self._ended_error(pending, error))

    def fail_unfinished_soon(self, error: PulsarStateError) -> None:
        """:meth:`fail_unfinished` a loop turn from now (after a halt: a record being applied
        as the replica halted ends its own writes first, with what is known of them)."""
        with contextlib.suppress(RuntimeError):  # no loop running: nothing waits either
            asyncio.get_running_loop().call_soon(self.fail_unfinished, error)

    def _ended_error(self, pending: PendingWrite, error: PulsarStateError) -> PulsarStateError:
        if not pending.outstanding:
            return error
        wid = write_id(self._writer_id, pending.write_seq)
        why = "the manager closed" if isinstance(error, ClosedError) else "the replica halted"
        unknown = WriteOutcomeUnknownError(
            f"{why} before the outcome of write {wid} was seen (a record of it was sent); it "
            "was applied once or not at all",
            write_id=wid,
        )
        unknown.__cause__ = error
        return unknown

    # ------------------------------------------------------------------ deadlines

    async def watch_deadlines(self) -> None:
        """Fail each write whose deadline has passed, wherever it is (queued or in flight):
        one timer for all writes, not one each."""
        loop = asyncio.get_running_loop()
        prune_at, last_prune = _PRUNE_AT, loop.time()
        last_in_flight_prune = last_prune
        while not self._context.closed:
            now = loop.time()
            while self.deadlines and self.deadlines[0][0] <= now:
                _, _, pending = heapq.heappop(self.deadlines)
                if not pending.future.done():
                    self.fail_timeout(pending)
            size = len(self.deadlines)
            if size > prune_at or (size > _PRUNE_AT and now - last_prune > 1.0):
                # Finished writes would otherwise stay (with their results) until their
                # deadline: a busy writer could hold hundreds of thousands of them.
                self.deadlines = [d for d in self.deadlines if not d[2].future.done()]
                heapq.heapify(self.deadlines)
                prune_at, last_prune = max(_PRUNE_AT, 2 * len(self.deadlines)), now
            if self._in_flight and now - last_in_flight_prune > 1.0:
                self.forget_finished_records()
                last_in_flight_prune = now
            await asyncio.sleep(0.05)

    def forget_finished_records(self) -> None:
        """Drop the records in flight whose writes all have their outcome.

        A send that failed may still land, so its record stays in flight; once its writes
        completed otherwise (a retry landed, or the deadline passed) nothing waits on it, and
        it would be kept (with its generators and readers) for the manager's lifetime.
        """
        self._in_flight = {
            record_id: writes
            for record_id, writes in self._in_flight.items()
            if any(not p.future.done() for p in writes)
        }
        self._claims = {r: claim for r, claim in self._claims.items() if r in self._in_flight}

    def _take_in_flight(self, record_id: str) -> list[PendingWrite] | None:
        self._claims.pop(record_id, None)
        return self._in_flight.pop(record_id, None)

    def skipped_to(self, version: int) -> None:
        """The replica loaded a snapshot at ``version`` without reading the records before
        it (it fell forward over a trimmed log). A record of ours in flight claiming a
        position up to ``version`` may be in that snapshot or may have been ignored: nobody
        can tell now. Its writes end as WriteOutcomeUnknownError and are never retried (a
        retry, built on the snapshot's state, would apply a write that is in it twice)."""
        skipped = [record_id for record_id, claim in self._claims.items() if claim <= version]
        for record_id in skipped:
            for pending in self._take_in_flight(record_id) or ():
                pending.outstanding.discard(record_id)
                if not pending.future.done():
                    wid = write_id(self._writer_id, pending.write_seq)
                    pending.future.set_exception(
                        WriteOutcomeUnknownError(
                            f"write {wid}: its record was in a part of the log trimmed before "
                            f"this replica read it (it loaded a snapshot at position {version} "
                            "instead); it was applied once or not at all",
                            write_id=wid,
                        )
                    )
        if skipped:
            self.settled.set()

    def fail_timeout(self, pending: PendingWrite) -> None:
        pending.future.set_exception(self._timeout_error(pending))

    def _closed_error(self, pending: PendingWrite) -> PulsarStateError:
        wid = write_id(self._writer_id, pending.write_seq)
        if pending.outstanding:
            return WriteOutcomeUnknownError(
                f"the manager closed before the outcome of write {wid} was seen; it was "
                "applied once or not at all",
                write_id=wid,
            )
        return ClosedError(f"the manager closed before write {wid} was appended")

    def _timeout_error(self, pending: PendingWrite) -> PulsarStateError:
        wid = write_id(self._writer_id, pending.write_seq)
        if pending.outstanding:
            return WriteOutcomeUnknownError(
                f"write {wid} was sent but its outcome was not seen before the timeout; "
                "it was applied once or not at all",
                write_id=wid,
            )
        because = f" (last error: {self.last_failure})" if self.last_failure is not None else ""
        return OperationTimeoutError(f"write {wid} timed out; nothing was appended{because}")

    # ------------------------------------------------------------------ in flight

    def launch(self, records: list[OutgoingRecord[PendingWrite]]) -> None:
        """The records are about to be sent: their writes are in flight from now on."""
        for outgoing in records:
            record_id = outgoing.record.record_id
            self._in_flight[record_id] = outgoing.writes
            self._claims[record_id] = outgoing.record.base_position + 1
            for pending in outgoing.writes:
                pending.latest_record = record_id
                pending.outstanding.add(record_id)

    def in_flight(self, record_id: str) -> bool:
        return record_id in self._in_flight

    @property
    def records_in_flight(self) -> int:
        return len(self._in_flight)

    def claim(self, record_id: str) -> RecordClaim | None:
        """The replica accepts ``record_id``: hand it the writes to complete, if ours."""
        writes = self._take_in_flight(record_id)
        if not writes:
            return None
        self.settled.set()
        return RecordClaim(record_id, self._writer_id, writes, self._stats)

    def reject(self, record_id: str) -> None:
        """The replica ignored ``record_id`` (stale): retry the writes it decided."""
        writes = self._take_in_flight(record_id)
        if not writes:
            return
        self.settled.set()
        retry = []
        for pending in writes:
            if pending.latest_record != record_id:
                # An older attempt; a newer one is in flight and decides.
                pending.outstanding.discard(record_id)
                continue
            # The newest attempt was ignored, so the state had moved past the base that every
            # attempt of this write was computed on: none of them can be accepted any more.
            pending.outstanding.clear()
            if not pending.future.done():
                retry.append(pending)
        self.requeue(retry)

    def refuse(
        self,
        records: list[OutgoingRecord[PendingWrite]],
        error: Callable[[OutgoingRecord[PendingWrite]], BaseException],
    ) -> None:
        """The records certainly were not persisted: fail their writes with ``error``, or
        WriteOutcomeUnknownError for one whose earlier attempt was sent and may still land."""
        for outgoing, pending in self._never_landing(records):
            if pending.future.done():
                continue
            failure = error(outgoing)
            if pending.outstanding:
                wid = write_id(self._writer_id, pending.write_seq)
                unknown = WriteOutcomeUnknownError(
                    f"write {wid}: this attempt was refused ({failure}), but an earlier one "
                    "was sent and may still be applied; it was applied once or not at all",
                    write_id=wid,
                )
                unknown.__cause__ = failure
                failure = unknown
            pending.future.set_exception(failure)

    def withdraw(self, records: list[OutgoingRecord[PendingWrite]]) -> None:
        """The records were never handed to the client, so none can land: out of flight,
        and their writes queued again (not counted as retries)."""
        again = [pending for _, pending in self._never_landing(records)]
        self.requeue(list(dict.fromkeys(again)), retry_count=False)

    def _never_landing(
        self, records: list[OutgoingRecord[PendingWrite]]
    ) -> Iterator[tuple[OutgoingRecord[PendingWrite], PendingWrite]]:
        """Take ``records``, certainly not persisted, out of flight: each write of those
        still in flight, with its record (whose id it no longer waits for)."""
        for outgoing in records:
            record_id = outgoing.record.record_id
            if self._take_in_flight(record_id) is None:
                continue
            for pending in outgoing.writes:
                pending.outstanding.discard(record_id)
                yield outgoing, pending

    def requeue_unseen(self, records: list[OutgoingRecord[PendingWrite]]) -> None:
        # They keep their outstanding record ids: if one of those lands later and is accepted,
        # the write completes from it and the retry's record is ignored as stale.
        unseen = [p for o in records for p in o.writes if o.record.record_id in self._in_flight]
        self.requeue(list(dict.fromkeys(unseen)))

    async def settle_in_flight(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until every write in flight has its outcome."""
        waiting = [p.future for ps in self._in_flight.values() for p in ps if not p.future.done()]
        if waiting:
            await asyncio.wait(waiting, timeout=timeout)

    def fail_in_flight(self, cause: BaseException | None = None) -> None:
        """End the writes in flight: their records may land, unseen by this manager (it
        closes, or ``cause``: its replica halted)."""
        why = "the manager closed" if cause is None else "the replica halted"
        for writes in self._in_flight.values():
            for pending in writes:
                if not pending.future.done():
                    error = WriteOutcomeUnknownError(
                        f"{why} before this write's outcome was seen; it was applied once "
                        "or not at all",
                        write_id=write_id(self._writer_id, pending.write_seq),
                    )
                    error.__cause__ = cause
                    pending.future.set_exception(error)
        self._in_flight.clear()
        self._claims.clear()
