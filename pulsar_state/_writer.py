"""The writer: takes the topic's exclusive producer, sends batches of records, reads them back.

It holds the producer while writes keep coming and releases it when idle (``idle_release_s``)
or after ``max_hold_s`` so that other processes get a turn. It never changes the state: it
builds records against the replica's state and waits for the replica to settle them.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_delay,
)

from ._context import Context
from ._envelope import Record
from ._errors import (
    OperationTimeoutError,
    PulsarStateError,
    RecordTooLargeError,
    WriterBusyError,
)
from ._pending import PendingWrite, PendingWrites
from ._pulsar import LogPosition, PulsarConnection, StateWriter
from ._records import OutgoingRecord, RecordBuilder
from ._retry import backoff, is_transient, retry_transient
from ._tail import Tail

__all__ = ["ReadSide", "Writer"]

logger = logging.getLogger(__name__)

# Pauses of the writer loop after a failed turn: short after a known failure (fenced, busy,
# broker hiccup), longer after an unexpected one, which is logged with its traceback.
_PAUSE_AFTER_ERROR_S = 0.01
_PAUSE_AFTER_BUG_S = 0.1
# After releasing the writer to give other processes a turn.
_TURN_PAUSE_S = 0.05
# The longest one attempt to create the exclusive producer may take before it is retried.
_ACQUIRE_ATTEMPT_S = 10.0
# take_ahead() is a hint: it tries this long for a writer another process holds, then drops it.
_AHEAD_BUDGET_S = 1.0


class ReadSide(Protocol):
    """What the writer needs of the replica."""

    @property
    def state(self) -> Any: ...

    @property
    def version(self) -> int: ...

    @property
    def last_record_id(self) -> str: ...

    @property
    def halt(self) -> PulsarStateError | None: ...

    async def wait_log(self, target: LogPosition | None) -> None: ...

    def reached(self, target: LogPosition | None) -> bool: ...

    def apply_own(self, payload: bytes, record: Record, at: LogPosition) -> None: ...

    def halt_with(self, error: PulsarStateError, cause: BaseException | None = None) -> None: ...


def _acquire_pause(state: RetryCallState) -> float:
    failed = state.outcome.exception() if state.outcome is not None else None
    if isinstance(failed, WriterBusyError):
        # Contention: the holder usually releases within moments (a handover: it is closing
        # its producer now), so retry soon, then back off to 30 ms, jittered.
        return random.uniform(0.5, 1.0) * min(0.002 * 2.0 ** (state.attempt_number - 1), 0.03)
    return backoff(state)  # the broker is down or the topic moving: back off


def _pause(state: RetryCallState) -> float:
    failed = state.outcome.exception() if state.outcome is not None else None
    return _PAUSE_AFTER_ERROR_S if isinstance(failed, PulsarStateError) else _PAUSE_AFTER_BUG_S


class Writer:
    def __init__(
        self,
        context: Context,
        conn: PulsarConnection,
        tail: Tail,
        pending: PendingWrites,
        replica: ReadSide,
        builder: RecordBuilder[Any, Any],
        after_batch: Callable[[], None],
    ) -> None:
        self._context = context
        self._conn = conn
        self._tail = tail
        self._topic = context.topic
        self._pending = pending
        self._replica = replica
        self._builder = builder
        self._settings = context.settings
        self._stats = context.stats
        self._after_batch = after_batch
        self._producer: StateWriter | None = None
        self._producer_since = 0.0
        self._release_when_idle = False  # release_soon(): skip the idle wait once
        self._take_ahead = False  # take_ahead(): acquire before any write is queued

    async def run(self) -> None:
        """Serve the write queue until the manager closes or the replica halts; a failed
        turn releases the writer and pauses before the next."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(Exception), wait=_pause, before_sleep=self._log_failure
        ):
            with attempt:
                try:
                    await self._serve()
                except Exception:
                    await self.release()
                    raise

    def _remember_failure(self, state: RetryCallState) -> None:
        failed = state.outcome.exception() if state.outcome is not None else None
        if failed is not None and not isinstance(failed, WriterBusyError):
            self._pending.last_failure = failed
            logger.debug("acquiring the writer of %s: %s; retrying", self._topic, failed)

    def _log_failure(self, state: RetryCallState) -> None:
        failed = state.outcome.exception() if state.outcome is not None else None
        if failed is not None:
            self._pending.last_failure = failed
        if isinstance(failed, PulsarStateError):
            logger.info("writer on %s: %s; retrying", self._topic, failed)
        else:
            logger.error("writer loop on %s failed; retrying", self._topic, exc_info=failed)

    async def _serve(self) -> None:
        pending, wake = self._pending, self._pending.wake
        loop = asyncio.get_running_loop()
        while not self._context.closed and self._replica.halt is None:
            if not pending.queue:
                wake.clear()
                if self._producer is None:
                    self._release_when_idle = False  # nothing held: the hint is spent
                    if self._take_ahead:
                        self._take_ahead = False
                        await self._acquire_ahead()
                        continue
                    await wake.wait()
                    continue
                if self._release_when_idle:
                    self._release_when_idle = False
                    await self.release()
                    continue
                try:
                    await asyncio.wait_for(wake.wait(), self._settings.idle_release_s)
                except TimeoutError:
                    await self.release()
                continue
            # Deadlines are the watchdog's job; here only finished writes are dropped.
            pending.drop_finished_head()
            if not pending.queue:
                continue
            held_for = loop.time() - self._producer_since
            if self._producer is not None and held_for > self._settings.max_hold_s:
                # Let writers in other processes have a turn; they poll for the writer.
                await self.release()
                await asyncio.sleep(_TURN_PAUSE_S)
                continue
            if self._producer is None:
                await self._acquire()
                if self._producer is None:
                    continue  # every queued write expired while waiting for the writer
            await self._write_batch()
            self._after_batch()

    async def _acquire_ahead(self) -> None:
        # A hint: another process keeping the writer, or a broker hiccup, only drops it.
        try:
            await self._acquire(ahead=True)
        except (PulsarStateError, TimeoutError) as exc:
            logger.debug("taking the writer of %s ahead of a write: %s", self._topic, exc)
            await self.release()

    async def _acquire(self, *, ahead: bool = False) -> None:
        """Create the exclusive producer and catch up. ``ahead``: no write is queued yet
        (take_ahead), so never fence, give up after ``_AHEAD_BUDGET_S`` and fail no write."""
        pending, settings = self._pending, self._settings
        loop = asyncio.get_running_loop()
        started = loop.time()
        if ahead:
            budget = min(settings.acquire_timeout_s, _AHEAD_BUDGET_S)
            takeover = None
        else:
            budget = max(0.0, min(settings.acquire_timeout_s, pending.latest_deadline() - started))
            takeover = settings.takeover_after_s
        topic = str(self._topic)
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(is_transient),
                wait=_acquire_pause,
                stop=stop_after_delay(budget),
                before_sleep=self._remember_failure,
                reraise=True,
            ):
                with attempt:
                    pending.expire(loop.time())
                    if ahead and pending.queue:
                        # A write came: acquire for it instead (its budget, its takeover).
                        return
                    if not pending.queue and not ahead:
                        return
                    fencing = takeover is not None and loop.time() - started >= takeover
                    if fencing:
                        logger.warning("taking over the writer of %s with fencing", topic)
                    self._producer = await self._conn.create_writer(
                        topic,
                        fencing=fencing,
                        send_timeout_s=min(settings.write_timeout_s, 30.0),
                        # Capped: a creation hanging through a broker restart (apache/pulsar
                        # #10721) must not use up the whole budget in one attempt.
                        timeout_s=max(
                            1.0, min(_ACQUIRE_ATTEMPT_S, budget - (loop.time() - started))
                        ),
                    )
        except WriterBusyError:
            if ahead:
                raise
            waited = loop.time() - started
            for waiting in pending.queue:
                if waiting.future.done():
                    continue
                if waiting.outstanding:
                    pending.fail_timeout(waiting)
                else:
                    waiting.future.set_exception(
                        WriterBusyError(
                            f"another process held the writer of {topic} for {waited:.1f}s; "
                            "nothing was appended"
                        )
                    )
            pending.expire(loop.time())
            raise
        self._producer_since = loop.time()
        self._take_ahead = False
        self._pending.last_failure = None
        self._stats.writer_acquisitions += 1
        if self._producer is not None and self._producer.fencing:
            self._stats.writer_fencings += 1
        logger.debug("acquired the writer of %s", topic)
        # Exclusive from here on: catch up with everything appended before we got it.
        await self._bounded(self._catch_up(), "catching up after acquiring the writer")

    async def _catch_up(self) -> None:
        deadline = asyncio.get_running_loop().time() + self._settings.write_timeout_s
        tail = await retry_transient(
            self._tail.position,
            deadline=deadline,
            what=f"capturing the tail of {self._topic}",
        )
        await self._replica.wait_log(tail)

    async def _bounded(self, awaitable: Awaitable[None], what: str) -> None:
        timeout = self._settings.write_timeout_s
        try:
            await asyncio.wait_for(awaitable, timeout)
        except TimeoutError as exc:
            raise OperationTimeoutError(f"{what} on {self._topic} took over {timeout}s") from exc

    def take_ahead(self) -> None:
        """Acquire the writer (and catch up) now if it is not held and no write is queued:
        the next write then skips the producer's creation. Held as after a write: released
        after ``idle_release_s`` without one."""
        self._release_when_idle = False
        if self._producer is None:
            self._take_ahead = True
            self._pending.wake.set()

    def release_soon(self) -> None:
        """Release the writer as soon as no write is queued, without the idle wait (also
        when it is taken again first, e.g. after a failed send or a ``max_hold_s`` turn)."""
        self._release_when_idle = True
        self._pending.wake.set()

    async def release(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            self._stats.writer_releases += 1
            await producer.close()
            logger.debug("released the writer of %s", self._topic)

    async def _write_batch(self) -> None:
        producer = self._producer
        assert producer is not None
        pending, replica = self._pending, self._replica
        batch = pending.take(self._settings.max_writes_per_batch)
        built = self._builder.build(
            [p for p in batch if not p.future.done()],
            replica.state,
            replica.version,
            replica.last_record_id,
        )
        for refused, error in built.refused:
            refused.future.set_exception(error)
        if built.halt is not None:
            # The trial run just mutated the live state with an unacknowledged write: this
            # replica can no longer be trusted, so it stops rather than show that write.
            culprit, error = built.halt
            culprit.future.set_exception(error)
            replica.halt_with(error)
            return
        if built.unchanged:
            await self._settle_unchanged(built.unchanged)
        records = built.records
        if not records:
            return
        pending.launch(records)
        # Pipelined: all sends are issued in order before any is awaited (a lone record is
        # awaited as it is: no task, one loop turn less per write).
        sends: list[Awaitable[LogPosition]] = (
            [producer.send(records[0].payload, key=records[0].record.record_id)]
            if len(records) == 1
            else [
                asyncio.ensure_future(producer.send(o.payload, key=o.record.record_id))
                for o in records
            ]
        )
        acked: list[LogPosition] = []
        failures: list[BaseException] = []
        for outgoing, send in zip(records, sends, strict=True):
            try:
                at = await send
            except Exception as exc:
                failures.append(exc)
                continue
            acked.append(at)
            replica.apply_own(outgoing.payload, outgoing.record, at)
        self._stats.records_sent += len(records)
        read_back: OperationTimeoutError | None = None
        if acked:
            # Every acked record is settled (accepted or ignored) once the pump passes it;
            # our own record, applied on its ack, usually is already (then no timer).
            try:
                if replica.reached(max(acked)):
                    await replica.wait_log(max(acked))  # returns at once (or the halt)
                else:
                    await self._bounded(
                        replica.wait_log(max(acked)), "reading back the records sent"
                    )
            except OperationTimeoutError as exc:
                read_back = exc  # the failed sends still need their retry first
        if failures:
            await self._send_failed(records, failures)
        if read_back is not None:
            raise read_back

    async def _settle_unchanged(self, writes: list[PendingWrite]) -> None:
        # Writes that append nothing were decided on this replica's state. Holding the
        # exclusive writer is not proof enough that it is the latest (another process may
        # have fenced us): the decision stands only if catching up with the tail accepts no
        # record; otherwise it is made again on the newer state.
        version = self._replica.version
        try:
            await self._bounded(self._catch_up(), "confirming the state of writes with no ops")
        except BaseException:
            self._pending.requeue(writes)
            raise
        if self._replica.version != version or self._replica.halt is not None:
            self._pending.requeue(writes)
            return
        self._pending.complete_unchanged(writes, self._replica.state, version)

    async def _send_failed(
        self, records: list[OutgoingRecord[PendingWrite]], failures: list[BaseException]
    ) -> None:
        # A failed send may still have been persisted: the records stay in flight and are
        # settled by the pump if they ever appear. The writer re-acquires and catches up;
        # writes whose records are not seen by then are retried by requeue_unseen.
        error = failures[0]
        logger.info("send to %s failed: %s", self._topic, error)
        if all(isinstance(f, RecordTooLargeError) for f in failures):
            # Refused by the client before sending: certainly not persisted, not retriable.
            limit = self._settings.max_record_bytes

            def too_large(outgoing: OutgoingRecord[PendingWrite]) -> BaseException:
                return RecordTooLargeError(
                    f"the broker's client refused a {len(outgoing.payload)}-byte message "
                    "(over the broker's maxMessageSize); lower max_record_bytes",
                    size=len(outgoing.payload),
                    limit=limit,
                )

            self._pending.refuse(records, too_large)
            return
        await self.release()
        self._pending.requeue_unseen(records)
        if isinstance(error, PulsarStateError):
            raise error
        raise PulsarStateError(f"send failed: {error}") from error
