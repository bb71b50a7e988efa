"""The writer: takes the topic's exclusive producer, sends batches of records, reads them back.

It holds the producer while writes keep coming and releases it when idle (``idle_release_s``)
or after ``max_hold_s`` so that other processes get a turn (with a relay: when one asks, and
unasked for processes that can only poll; see ``_UNASKED_TURN_FACTOR``). It never changes
the state: it builds records against the replica's state and waits for the replica to
settle them.

With a :class:`~._relay.Relay`, a process without the producer sends its records to the
process that probably holds it (one whose record was read within most of
``idle_release_s``, see ``_HOLDER_LIKELY_SHARE``), and the holder appends the records it
receives, first, as they are. A holder that gives the writer up says so on the relay. Records
relayed that are not seen within ``_RELAY_PATIENCE_S`` (or shortly after such a notice) are
handled as after a failed send: the writer is taken, the log caught up with, and the writes
not seen are retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
)

from ._context import Context
from ._envelope import Record, decode_record, write_id
from ._errors import (
    CodecError,
    CorruptRecordError,
    OperationTimeoutError,
    PulsarStateError,
    RecordTooLargeError,
    WriteOutcomeUnknownError,
    WriterBusyError,
    callback_error,
)
from ._pending import PendingWrite, PendingWrites
from ._pulsar import LogPosition, PulsarConnection, StateWriter, wait_bounded
from ._records import Adoption, OutgoingRecord, RecordBuilder
from ._relay import TURN_REQUEST, Relay, is_release_notice, release_notice
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
# A relayed record is settled in milliseconds when a process holds the writer; one not seen
# after this long probably reached nobody, so the writer is taken instead.
_RELAY_PATIENCE_S = 0.05
# A holder releases the writer idle_release_s (relay_idle_release_s with its relay up) after
# its latest append (its own record or a
# relayed one), which others read a few milliseconds after it was made: until this share of
# idle_release_s has passed since they read it, the holder is taken to hold the writer still.
# (At one half, a lock released 50 ms after its waiter's request was read first tried to take
# the writer, a 1-4 ms refusal, and only then relayed the release.)
_HOLDER_LIKELY_SHARE = 0.8
# After a holder's notice that it gave the writer up, records relayed to it are waited for
# this much longer (it may have appended them just before), not the whole patience.
_RELEASED_GRACE_S = 0.005
# A write whose relayed records were ignored (stale) this many times takes the writer.
_RELAY_TRIES = 3
# With a relay, the holder gives others a turn after max_hold_s only when one asks for it
# (their writes are relayed meanwhile). Processes without the relay can only poll: for them
# it gives one unasked, with the pause, after this many times max_hold_s (at most two thirds
# of acquire_timeout_s, so that a poller's wait for the writer outlasts it), and before, at
# half that, one at a moment no write is queued (no pause: a write of its own that comes
# next takes the writer back unless a poller has it). The first was given at 10x whenever a
# write was queued: each such turn stalled the holder's queued writes 50 ms or more.
_UNASKED_TURN_FACTOR = 20
# How many ids of stale relayed records the holder remembers (see _append_foreign).
_STALE_REMEMBERED = 1024
# Records relayed by others, waiting for the holder to append them: more (in number or in
# bytes) are dropped, as is one larger than this holder's max_record_bytes (their senders take
# the writer after _RELAY_PATIENCE_S).
_MAX_FOREIGN = 1000
_MAX_FOREIGN_BYTES = 64 << 20


class _NotSent(PulsarStateError):
    """A record of a batch never handed to the client: the client refused one before it,
    and each record is built on the one before (sent, it would be stored on top of a record
    the log never got: a fork in every replica's eyes)."""


def _not_sent() -> asyncio.Future[LogPosition]:
    future: asyncio.Future[LogPosition] = asyncio.get_running_loop().create_future()
    future.set_exception(_NotSent("not sent: the client refused a record before it"))
    future.exception()  # awaited by _finish; never an unretrieved error
    return future


@dataclass(slots=True)
class _Issued:
    """A batch built and sent without the serve loop (see :meth:`Writer.queued`), for the
    serve loop to finish."""

    records: list[OutgoingRecord[PendingWrite]]
    sends: list[Awaitable[LogPosition]]
    unchanged: list[PendingWrite]
    failure: Exception | None = None


# uvloop's clock and timers tick in whole milliseconds: its timer may fire up to 1 ms before
# loop.time() reaches the end it was set for (asyncio's loop allows for its own clock's
# resolution the same way). Setting it again then would spin until that millisecond passes
# (measured: 364 checks in one wait); an idle wait that ends up to 1 ms early is harmless.
_TIMER_SLACK_S = 0.001


class _IdleWait:
    """The serve loop's idle wait, holding the producer: it ends at ``until``, which a batch
    finished on its acknowledgement pushes back by a plain store (an ``asyncio.timeout``
    rescheduled per write cancelled and pushed a loop timer each time). The loop's timer
    fires at the first end set and, if the end moved meanwhile, is set again once."""

    __slots__ = ("_armed", "_handle", "_loop", "_wake", "expired", "until")

    def __init__(self, loop: asyncio.AbstractEventLoop, until: float, wake: asyncio.Event) -> None:
        self._loop, self._wake = loop, wake
        self.until = self._armed = until
        self.expired = False
        self._handle = loop.call_at(until, self._check)

    def move_to(self, until: float) -> None:
        self.until = until
        if until < self._armed:  # sooner (a shorter idle_release once the relay is up)
            self._handle.cancel()
            self._armed = until
            self._handle = self._loop.call_at(until, self._check)

    def _check(self) -> None:
        if self._loop.time() + _TIMER_SLACK_S < self.until:
            self._armed = self.until
            self._handle = self._loop.call_at(self.until, self._check)
            return
        self.expired = True
        self._wake.set()

    def cancel(self) -> None:
        self._handle.cancel()


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

    @property
    def foreign_at(self) -> float: ...

    async def wait_log(self, target: LogPosition | None) -> None: ...

    async def wait_log_watched(self, target: LogPosition | None) -> None: ...

    def reached(self, target: LogPosition | None) -> bool: ...

    def apply_own(
        self, payload: bytes, record: Record, at: LogPosition, adoption: Adoption | None = None
    ) -> None: ...

    def is_next(self, at: LogPosition) -> bool: ...

    def check_ops(self, record: Record) -> None: ...

    def check_adoption(self, record: Record, adoption: Adoption) -> None: ...

    def pause_reading(self, applied_to: LogPosition) -> None: ...

    def resume_reading(self) -> None: ...

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
        relay: Relay | None = None,
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
        # Held since (the bound of unasked turns with the pause): an idle turn the holder
        # took back within a turn's pause (pollers retry within 30 ms), nobody else writing
        # meanwhile, does not reset it.
        self._unpaused_since = 0.0
        self._idle_turn = False  # the last release was an unasked turn given while idle
        self._release_when_idle = False  # release_soon(): skip the idle wait once
        self._take_ahead = False  # take_ahead(): acquire before any write is queued
        self._relay = relay
        # Records other processes relayed, received while this one holds the producer.
        self._foreign: deque[bytes] = deque()
        self._foreign_bytes = 0
        # Records this process relayed that were not seen in time: the writer is taken, the
        # log caught up with, then their writes are retried unless seen by then.
        self._relayed: list[OutgoingRecord[PendingWrite]] = []
        self._held_elsewhere = False
        self._relay_landed_at = float("-inf")  # a relayed record of ours was appended
        # Ids of stale records relayed by others (the newest): what is built on them is too.
        self._stale_relayed: dict[str, None] = {}
        self._relay_quiet_until = float("-inf")  # no relaying until then (one went unseen)
        self._turn_requested = False  # another process asked for the writer
        self._turn_asked_at = float("-inf")  # when this process last asked for a turn
        self._turn_task: asyncio.Task[None] | None = None
        self._released_at = float("-inf")  # when this process last gave the writer up
        # When another process last said it gave the writer up (its notice on the relay).
        self._holder_released_at = float("-inf")
        self._release_notice = release_notice(context.writer_id)
        self._notice_task: asyncio.Task[None] | None = None
        self._notice_again = False
        self._relay_next = False  # creating the producer found it held: relay next
        # The serve loop waits, holding the producer, with nothing queued: a write queued now
        # may be sent without waking it (see queued()).
        self._parked = False
        # A batch _send_queued() built (and sent): the serve loop finishes it before anything.
        self._issued: _Issued | None = None
        self._send_soon: asyncio.Handle | None = None  # _send_queued() is scheduled
        # The serve loop's idle wait while it waits holding the producer (_parked: and a
        # write may be sent at once). When it ends ``idle_release_s`` after the last batch
        # (_idle_from_last), a batch finished on its acknowledgement pushes that end back.
        self._idle_wait: _IdleWait | None = None
        self._idle_from_last = False
        # Records read before the writer started (the opening replay) say nothing of who
        # holds the writer now.
        self._started_at = time.monotonic()

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
        # Closed (the close releases the writer itself, after the writes in flight are seen),
        # or the replica halted: a halted holder must not keep the exclusive producer (every
        # other process would wait for it until this manager closes).
        if not self._context.closed:
            await self.release()

    def on_halt(self, error: PulsarStateError) -> None:
        """The replica halted: drop what others relayed (their senders take the writer when
        it is not seen) and wake the serve loop, which stops and releases the writer."""
        del error  # (the hook's argument: the writes learn it from the pending queue)
        self._drop_foreign()
        self._pending.wake.set()

    def _drop_foreign(self) -> None:
        self._foreign.clear()
        self._foreign_bytes = 0

    def _remember_failure(self, state: RetryCallState) -> None:
        failed = state.outcome.exception() if state.outcome is not None else None
        self._held_elsewhere = isinstance(failed, WriterBusyError)
        if failed is not None:
            # Named by a write that times out meanwhile (held elsewhere, too: the usual cause).
            self._pending.last_failure = failed
            if not self._held_elsewhere:  # (expected, and every few ms: not logged)
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
        # A batch sent without the serve loop is finished first, also once closing (as a batch the
        # loop sent itself would be): its caller learns the outcome from the acknowledgement.
        while self._issued is not None or (not self._context.closed and self._replica.halt is None):
            if self._issued is not None:
                issued, self._issued = self._issued, None  # taken: the ack leaves it alone
                await self._finish_issued(issued)
                self._after_batch()
                continue
            self._prune_relayed()
            if self._foreign and self._producer is None:
                self._drop_foreign()  # released since they came: their senders retry
            pending.drop_finished_head()  # (writes the watchdog failed are no reason to turn)
            now = loop.time()
            held_for = now - self._producer_since
            busy = bool(pending.queue or self._foreign or self._turn_requested)
            if self._producer is not None and busy and self._turn_due(now):
                # Let writers in other processes have a turn; they poll for the writer.
                logger.debug("giving the writer of %s up for a turn, busy", self._topic)
                await self.release()
                await asyncio.sleep(_TURN_PAUSE_S)
                continue
            if self._foreign:
                await self._append_foreign()
                self._after_batch()  # the holder takes the snapshots that fall due
                if not pending.queue:
                    continue
                # One batch of this process's own writes between relayed ones: never starved.
            if not pending.queue and not self._relayed:
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
                idle = self._idle_release()
                unasked_turn = False
                if self._turn_requested:
                    # Asked for a turn while idle: give it once max_hold_s has passed.
                    idle = min(idle, max(0.0, self._settings.max_hold_s - held_for))
                elif self._relay_up():
                    # The turn given unasked (see _UNASKED_TURN_FACTOR), while nothing is queued.
                    unasked = self._unasked_turn_after() / 2 - held_for
                    if unasked < idle:
                        idle, unasked_turn = max(0.0, unasked), True
                if idle > 0:  # else (a turn due now) no wait: the queue is checked below
                    self._parked = True
                    self._idle_from_last = not unasked_turn and not self._turn_requested
                    # A timer, not wait_for: no task per idle wait (one per write).
                    idle_wait = self._idle_wait = _IdleWait(loop, loop.time() + idle, wake)
                    try:
                        await wake.wait()
                    finally:
                        idle_wait.cancel()
                        self._parked = False
                        self._idle_wait = None
                    if not idle_wait.expired:
                        continue
                if pending.queue or self._foreign or self._issued is not None:
                    continue  # came as the wait ended: served first, the turn comes later
                if unasked_turn:
                    logger.debug("giving the writer of %s up for a turn, idle", self._topic)
                await self.release()
                self._idle_turn = unasked_turn
                continue
            # Deadlines are the watchdog's job; here only finished writes are dropped.
            pending.drop_finished_head()
            if not pending.queue and not self._relayed:
                continue
            if self._producer is None:
                if not self._relayed and self._relay_first():
                    await self._relay_batch()
                    continue
                await self._acquire()
                if self._producer is None:
                    # Every write waiting for the writer expired or was seen meanwhile; or
                    # the queued ones are to be relayed after all. Never a spin: yield.
                    await asyncio.sleep(0)
                    continue
            if not pending.queue:
                continue  # only relayed writes were waiting: retried (or seen) by _acquire
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
        asked_at = time.monotonic()  # a poller could have had the writer until about now
        takeover = None if ahead else settings.takeover_after_s
        self._held_elsewhere = False  # the latest attempt's refusal: another process holds it

        def ends_at() -> float:
            # Asked at each attempt: a write queued meanwhile waits acquire_timeout_s from
            # its own submission, within its own deadline (with the first write's budget
            # alone, it failed long before its own timeout).
            if ahead:
                return started + min(settings.acquire_timeout_s, _AHEAD_BUDGET_S)
            return self._latest_wait_end(started, settings.acquire_timeout_s)

        topic = str(self._topic)
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(is_transient),
                wait=_acquire_pause,
                stop=lambda _: loop.time() >= ends_at(),
                before_sleep=self._remember_failure,
                reraise=True,
            ):
                with attempt:
                    if not ahead and self._held_elsewhere:
                        # Held by another process: each write waits for it acquire_timeout_s
                        # of its own. Through an outage they wait on until their deadlines.
                        self._fail_waited_out(started, settings.acquire_timeout_s)
                    pending.expire(loop.time())  # (drops the writes failed just now too)
                    if ahead and pending.queue:
                        # A write came: acquire for it instead (its budget, its takeover).
                        return
                    if not pending.queue and not ahead and not self._relayed_waiting():
                        self._relayed = []
                        return
                    # After the longest-waiting write has waited ``takeover`` (an attempt
                    # kept going by later writes must not fence sooner than one write would).
                    fencing = (
                        takeover is not None
                        and loop.time() - self._oldest_wait_start(started) >= takeover
                    )
                    if fencing:
                        logger.warning("taking over the writer of %s with fencing", topic)
                    try:
                        self._producer = await self._conn.create_writer(
                            topic,
                            fencing=fencing,
                            send_timeout_s=min(settings.write_timeout_s, 30.0),
                            # Capped: a creation hanging through a broker restart (apache/
                            # pulsar #10721) must not use up the whole budget in one attempt.
                            timeout_s=max(1.0, min(_ACQUIRE_ATTEMPT_S, ends_at() - loop.time())),
                        )
                    except WriterBusyError:
                        if ahead:
                            raise
                        if not self._may_relay():
                            self._request_turn()  # rate-limited: one per max_hold_s
                            raise
                        # Held for sure: the serve loop relays the queued writes instead.
                        self._relay_next = bool(pending.queue)
                        return
        except WriterBusyError:
            if ahead:
                raise
            waited = loop.time() - started
            self._prune_relayed()
            for relayed in self._relayed:
                for waiting in relayed.writes:
                    if not waiting.future.done():
                        pending.fail_timeout(waiting)  # sent: its outcome is unknown
            self._relayed = []
            for waiting in pending.queue:
                if not waiting.future.done():
                    self._fail_busy(waiting, waited)
            pending.expire(loop.time())
            raise
        self._producer_since = loop.time()
        released_at = self._released_at
        taken_back = (
            self._idle_turn
            and asked_at - released_at < _TURN_PAUSE_S
            and self._replica.foreign_at <= released_at
        )
        if not taken_back:
            self._unpaused_since = self._producer_since
        self._idle_turn = False
        self._take_ahead = False
        self._turn_requested = False  # asked of an earlier holding
        self._relay_next = False
        self._pending.last_failure = None
        self._stats.writer_acquisitions += 1
        if self._producer is not None and self._producer.fencing:
            self._stats.writer_fencings += 1
        logger.debug("acquired the writer of %s", topic)
        # Exclusive from here on: catch up with everything appended before we got it.
        await self._bounded(self._catch_up(), "catching up after acquiring the writer")
        self._prune_relayed()
        if self._relayed:
            # Nothing relayed can be appended now but by us: retry what did not land.
            self._pending.requeue_unseen(self._relayed)
            self._relayed = []

    def _relayed_waiting(self) -> bool:
        return any(not w.future.done() for o in self._relayed for w in o.writes)

    def _waiting_writes(self) -> list[PendingWrite]:
        relayed = [w for o in self._relayed for w in o.writes if not w.future.done()]
        return [w for w in self._pending.queue if not w.future.done()] + relayed

    @staticmethod
    def _wait_start(write: PendingWrite, started: float) -> float:
        # A write waits for the writer from when it came, or from the start of this attempt
        # if it came before.
        return max(write.submitted_at, started)

    def _wait_end(self, write: PendingWrite, started: float, budget: float) -> float:
        # ``budget`` s after its wait began, and never past its deadline.
        return min(self._wait_start(write, started) + budget, write.deadline)

    def _oldest_wait_start(self, started: float) -> float:
        starts = [self._wait_start(w, started) for w in self._waiting_writes()]
        return min(starts, default=started)

    def _latest_wait_end(self, started: float, budget: float) -> float:
        # No write waiting: the attempt at the writer returns on its own.
        ends = [self._wait_end(w, started, budget) for w in self._waiting_writes()]
        return max(ends, default=started + budget)

    def _fail_waited_out(self, started: float, budget: float) -> None:
        """Fail the queued writes whose wait for the writer is over while the attempt goes
        on for later ones (each with its own wait); the caller's ``expire`` drops them."""
        now = asyncio.get_running_loop().time()
        for waiting in self._pending.queue:
            if not waiting.future.done() and now >= self._wait_end(waiting, started, budget):
                self._fail_busy(waiting, now - self._wait_start(waiting, started))

    def _fail_busy(self, waiting: PendingWrite, waited: float) -> None:
        # Its own deadline reached: a timeout, whichever of the deadline watchdog and the
        # attempt at the writer sees it first (the last error names the holder). Sent
        # before: its outcome is unknown. Else its wait for the writer ran out first.
        if waiting.outstanding or asyncio.get_running_loop().time() >= waiting.deadline:
            self._pending.fail_timeout(waiting)
        else:
            waiting.future.set_exception(
                WriterBusyError(
                    f"another process held the writer of {self._topic} for {waited:.1f}s; "
                    "nothing was appended"
                )
            )

    # ------------------------------------------------------------------ the relay

    def accept_foreign(self, payload: bytes) -> None:
        """A record another process relayed: appended next if this process holds the writer
        (dropped otherwise: its sender takes the writer when it is not seen)."""
        if is_release_notice(payload):
            if payload != self._release_notice:
                self._holder_released_at = time.monotonic()
                self._pending.settled.set()  # a relay of ours waiting on it may give up now
            return
        if self._producer is None or self._replica.halt is not None:
            return
        if payload == TURN_REQUEST:
            self._turn_requested = True
            self._pending.wake.set()  # an idle holder bounds its wait by max_hold_s
            return
        size = len(payload)
        if (
            len(self._foreign) >= _MAX_FOREIGN
            or self._foreign_bytes + size > _MAX_FOREIGN_BYTES
            or size > self._settings.max_record_bytes  # the client would refuse it
        ):
            return
        self._foreign.append(payload)
        self._foreign_bytes += size
        self._pending.wake.set()

    def _turn_due(self, now: float) -> bool:
        max_hold = self._settings.max_hold_s
        if now - self._producer_since <= max_hold:
            return False
        if not self._relay_up() or self._turn_requested:
            return True
        return now - self._unpaused_since > self._unasked_turn_after()

    def _unasked_turn_after(self) -> float:
        settings = self._settings
        return min(_UNASKED_TURN_FACTOR * settings.max_hold_s, settings.acquire_timeout_s * 2 / 3)

    def _relay_up(self) -> bool:
        return self._relay is not None and self._relay.ready

    def _held_idle_by_relaying(self) -> float:
        """How long a holder whose relay is up keeps the writer after its last append."""
        settings = self._settings
        relayed = settings.relay_idle_release_s
        return settings.idle_release_s if relayed is None else relayed

    def _idle_release(self) -> float:
        """How long this process keeps the writer after its last append: longer with the
        relay up when ``relay_idle_release_s`` says so (others' writes come through it), the
        plain ``idle_release_s`` without (others can only wait for the writer)."""
        return self._held_idle_by_relaying() if self._relay_up() else self._settings.idle_release_s

    def _request_turn(self) -> None:
        """Ask the holder (through the relay, if up) for a turn, in the background; at most
        once per max_hold_s."""
        relay = self._relay
        now = time.monotonic()
        if (
            relay is None
            or not relay.ready
            or now < self._turn_asked_at + self._settings.max_hold_s
            or self._turn_task is not None
        ):
            return
        self._turn_asked_at = now

        async def ask() -> None:
            try:
                await relay.send(TURN_REQUEST)
            except Exception as exc:  # a hint (turns come anyway); the relay may be closed
                logger.debug("asking for a turn on %s: %s", relay.topic, exc)
            finally:
                self._turn_task = None

        self._turn_task = asyncio.get_running_loop().create_task(ask())

    def _holder_likely(self) -> bool:
        """Whether another process probably holds the writer and the relay reaches it: its
        record, or a relayed one of ours, was read within most of the time a holder with its
        relay up keeps the writer idle (``relay_idle_release_s``, else ``idle_release_s``;
        our settings taken to be the holder's too), and no holder said it let go since."""
        if not self._relay_open():
            return False
        now = time.monotonic()
        # Records of others read while this process held the writer were appended by it (relayed)
        # or before it took the writer: they say nothing of a holder now.
        foreign = self._replica.foreign_at
        seen = max(foreign if foreign > self._released_at else float("-inf"), self._relay_landed_at)
        # Not all of it: the holder's countdown started before we read its record.
        likely_for = self._held_idle_by_relaying() * _HOLDER_LIKELY_SHARE
        since = max(self._started_at, self._holder_released_at)  # a holder said it let go
        return seen > since and now - seen < likely_for

    def _may_relay(self) -> bool:
        """Whether the queued writes may be relayed (the relay is up, no relayed record is
        waiting to be settled, and none of them lost too often)."""
        self._prune_relayed()
        if self._relayed or not self._relay_open():
            return False
        return all(w.relays < _RELAY_TRIES for w in self._pending.queue)

    def _relay_open(self) -> bool:
        """The relay is up and not in its quiet time (after a relayed record went unseen)."""
        relay = self._relay
        return relay is not None and relay.ready and time.monotonic() >= self._relay_quiet_until

    def _relay_first(self) -> bool:
        """Whether to relay the next batch rather than take the writer."""
        relay_next, self._relay_next = self._relay_next, False
        return self._may_relay() and (relay_next or self._holder_likely())

    async def _relay_batch(self) -> None:
        relay, pending = self._relay, self._pending
        assert relay is not None
        relayed_at = time.monotonic()  # a holder's notice from now on may concern these
        records = await self._build_batch()
        if not records:
            return
        pending.launch(records)
        for outgoing in records:
            for write in outgoing.writes:
                write.relays += 1
                write.relayed_base = outgoing.record.base_position
        try:
            await asyncio.gather(*(relay.send(outgoing.payload) for outgoing in records))
        except (PulsarStateError, TimeoutError) as exc:
            logger.debug("relaying to %s: %s; taking the writer", relay.topic, exc)
            self._relayed = records  # may have gone out: settled as after a failed send
            self._relay_quiet_until = time.monotonic() + self._settings.idle_release_s
            return
        if await self._settled(records, _RELAY_PATIENCE_S, since=relayed_at):
            if self._holder_released_at <= relayed_at:
                # (Landed just before its holder let go: no sign of a holder now.)
                self._relay_landed_at = time.monotonic()
            return
        unseen = [o for o in records if pending.in_flight(o.record.record_id)]
        self._relayed = records  # the whole chain (a stale link kills the rest): pruned later
        if self._holder_released_at > relayed_at:
            # The relay works; the holder let go: take the writer (no quiet time).
            logger.debug(
                "%d record(s) relayed to %s not seen; its holder let go: taking the writer",
                len(unseen),
                relay.topic,
            )
            return
        logger.debug(
            "%d record(s) relayed to %s not seen in %.0f ms; taking the writer",
            len(unseen),
            relay.topic,
            _RELAY_PATIENCE_S * 1000,
        )
        self._relay_quiet_until = time.monotonic() + self._settings.idle_release_s

    async def _settled(
        self, records: list[OutgoingRecord[PendingWrite]], within: float, *, since: float
    ) -> bool:
        """Wait until the replica settled every one of ``records`` (True), or ``within``; or
        until shortly after a holder says it gave the writer up after ``since`` (it may have
        appended them first: their records are then read within milliseconds)."""
        pending, replica = self._pending, self._replica
        deadline = time.monotonic() + within
        while True:
            self._drop_dead_chain(records)
            if not any(pending.in_flight(o.record.record_id) for o in records):
                break
            if self._holder_released_at > since:
                deadline = min(deadline, self._holder_released_at + _RELEASED_GRACE_S)
            left = deadline - time.monotonic()
            if left <= 0 or replica.halt is not None or self._context.closed:
                return False
            pending.settled.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await pending.settled.wait()
        return True

    def _remember_stale(self, record_id: str) -> None:
        self._stale_relayed[record_id] = None
        if len(self._stale_relayed) > _STALE_REMEMBERED:
            del self._stale_relayed[next(iter(self._stale_relayed))]

    def _prune_relayed(self) -> None:
        """Keep only the relayed records that may still be seen: not settled, not dead."""
        self._drop_dead_chain(self._relayed)
        self._relayed = [o for o in self._relayed if self._pending.in_flight(o.record.record_id)]

    def _drop_dead_chain(self, records: list[OutgoingRecord[PendingWrite]]) -> None:
        """Retry now the writes of relayed records that can no longer be accepted.

        ``records`` are one chain, each based on the one before. A record is dead when it is
        based before this replica's version, or at it on another record; and so is every
        record after a dead one, or after one the replica ignored as stale (its writes were
        queued again): each is based on a record no replica accepted (the holder does not
        even append those)."""
        pending, replica = self._pending, self._replica
        dead = False
        for outgoing in records:
            record = outgoing.record
            if not pending.in_flight(record.record_id):
                # Settled: accepted (its writes done), or ignored (its writes queued again).
                dead = dead or any(not w.future.done() for w in outgoing.writes)
                continue
            dead = dead or (
                record.base_position < replica.version
                or (
                    record.base_position == replica.version
                    and record.base_record_id != replica.last_record_id
                )
            )
            if dead:
                pending.reject(record.record_id)

    async def _append_foreign(self) -> None:
        """Append the records other processes relayed, each as it came (the replicas decide,
        as for any record), and read them back before this process builds on the state."""
        producer, replica = self._producer, self._replica
        assert producer is not None
        batch: list[tuple[bytes, Record]] = []
        # Where the log will be once the records taken so far are appended: a sender's batch
        # is a chain (each record based on the one before it).
        version, last_id = replica.version, replica.last_record_id
        while self._foreign:
            payload = self._foreign.popleft()
            self._foreign_bytes -= len(payload)
            try:
                record = decode_record(payload, message_id=f"relayed on {self._topic}")
                if record.base_position == version and record.base_record_id == last_id:
                    # Accepted once appended: every replica must be able to decode it.
                    replica.check_ops(record)
            except (CorruptRecordError, CodecError) as exc:
                logger.warning("dropping a record relayed on %s: %s", self._topic, exc)
                continue
            if record.base_position == version and record.base_record_id == last_id:
                version, last_id = version + 1, record.record_id
            elif record.base_record_id in self._stale_relayed:
                # Built on a relayed record that was stale: its sender retries it anyway.
                self._remember_stale(record.record_id)
                continue
            elif record.base_position >= version:
                # Built on a history this replica does not have (a forked or deleted one):
                # appended, it would halt every replica. Its sender finds out by itself.
                logger.warning(
                    "dropping record %s relayed on %s: based on %d/%r, the log is at %d/%r",
                    record.record_id,
                    self._topic,
                    record.base_position,
                    record.base_record_id,
                    version,
                    last_id,
                )
                continue
            else:
                # Stale: appended all the same, ignored by every replica; its sender learns at
                # once that its writes are to be retried on the newer state.
                self._remember_stale(record.record_id)
            batch.append((payload, record))
        if not batch:
            return
        sends: list[Awaitable[LogPosition]] = []
        for payload, record in batch:
            if sends and producer.refused:
                # The client refused the one before inside its send call (too large for this
                # broker, say): the records after it may be built on it (a sender's chain),
                # and appended they would halt every replica. Their senders retry them.
                sends.append(_not_sent())
                continue
            sends.append(producer.send_nowait(payload, key=record.record_id))
        acked: list[LogPosition] = []
        failure: BaseException | None = None
        for (payload, record), send in zip(batch, sends, strict=True):
            try:
                at = await send
            except Exception as exc:
                failure = failure or exc
                continue
            acked.append(at)
            replica.apply_own(payload, record, at)
        self._stats.records_sent += len(batch)
        self._stats.relayed_appended += len(acked)
        if acked and failure is None:
            replica.pause_reading(max(acked))
        if acked and not replica.reached(max(acked)):
            await self._bounded(replica.wait_log(max(acked)), "reading back relayed records")
        if failure is not None:
            # Their senders see them or not, and retry; this writer starts over.
            await self.release()
            if isinstance(failure, PulsarStateError):
                raise failure
            raise PulsarStateError(f"appending relayed records failed: {failure}") from failure

    async def _catch_up(self) -> None:
        deadline = asyncio.get_running_loop().time() + self._settings.write_timeout_s
        tail = await retry_transient(
            self._tail.position,
            deadline=deadline,
            what=f"capturing the tail of {self._topic}",
        )
        await self._replica.wait_log_watched(tail)  # (a reader stuck on a closed topic)

    async def _bounded(self, awaitable: Awaitable[None], what: str) -> None:
        timeout = self._settings.write_timeout_s
        try:
            await wait_bounded(awaitable, timeout)  # (wait_for may swallow a cancellation)
        except TimeoutError as exc:
            raise OperationTimeoutError(f"{what} on {self._topic} took over {timeout}s") from exc

    def take_ahead(self) -> None:
        """Acquire the writer (and catch up) now if it is not held and no write is queued:
        the next write then skips the producer's creation. Held as after a write: released
        after ``idle_release_s`` without one."""
        self._release_when_idle = False
        if self._producer is None and not self._holder_likely():
            # (Held elsewhere: the write that comes is relayed to its holder instead.)
            self._take_ahead = True
            self._pending.wake.set()

    def relay_changed(self) -> None:
        """The relay opened (or failed to): an idle holder's turns now follow other rules."""
        self._pending.wake.set()

    def cancel_background(self) -> None:
        """Stop what the writer left running beside its loop (a turn request, a release
        notice), at close."""
        for task in (self._turn_task, self._notice_task):
            if task is not None:
                task.cancel()

    def release_soon(self) -> None:
        """Release the writer as soon as no write is queued, without the idle wait (also
        when it is taken again first, e.g. after a failed send or a ``max_hold_s`` turn).
        Not with a relay: the other process's write then comes through this one."""
        if self._relay_up():
            return
        self._release_when_idle = True
        self._pending.wake.set()

    async def release(self) -> None:
        self._replica.resume_reading()  # records of other processes may come from now on
        producer, self._producer = self._producer, None
        if producer is not None:
            self._released_at = time.monotonic()
            self._stats.writer_releases += 1
            await producer.close()
            logger.debug("released the writer of %s", self._topic)
            self._tell_released()

    def _tell_released(self) -> None:
        """Say on the relay (in the background) that this process gave the writer up: others
        then take it at their next write instead of relaying to nobody. Not at close (the
        relay closes next; others fall back to their patience)."""
        relay = self._relay
        if relay is None or not relay.ready or self._context.closed:
            return
        if self._notice_task is not None:
            self._notice_again = True  # released again while the last notice is on its way
            return

        async def tell() -> None:
            try:
                self._notice_again = True
                while self._notice_again:
                    self._notice_again = False
                    await relay.send(self._release_notice)
            except Exception as exc:  # a hint; the relay may be closed
                logger.debug("telling %s the writer was released: %s", relay.topic, exc)
            finally:
                self._notice_task = None

        self._notice_task = asyncio.get_running_loop().create_task(tell())

    async def _build_batch(self) -> list[OutgoingRecord[PendingWrite]]:
        """The records of the next batch of queued writes (built on the replica's state);
        the writes that append nothing are settled here."""
        records, unchanged = self._build_now()
        if unchanged and not await self._settle_unchanged(unchanged, records):
            return []
        if unchanged and any(w.future.done() for o in records for w in o.writes):
            # A write of these records ended while the state was confirmed (its deadline
            # passed, its caller cancelled): it was told nothing was appended, so it must not
            # be. The records are a chain, so the others are built again without it.
            again = [w for o in records for w in o.writes if not w.future.done()]
            self._pending.requeue(again, retry_count=False)
            return []
        return records

    def _build_now(self) -> tuple[list[OutgoingRecord[PendingWrite]], list[PendingWrite]]:
        """The records of the next batch of queued writes, and the writes decided on the
        replica's state that append nothing or were refused (to settle: they stand only if
        that state is the log's latest); deferred ones are queued again."""
        pending, replica = self._pending, self._replica
        batch = pending.take(self._batch_size())
        try:
            built = self._builder.build(
                [p for p in batch if not p.future.done()],
                replica.state,
                replica.version,
                replica.last_record_id,
            )
        except BaseException as exc:
            # Not one write's failure (copy_state raised, say). Dropped here, the writes taken
            # waited out their deadline: they are built once more (a passing failure), then
            # fail with it, those whose earlier attempt may land excepted (their deadline
            # ends them, unknown). No release and retake of the writer per try.
            failure = callback_error(exc, "building a batch of writes (copy_state)")
            logger.error("building a batch of writes on %s failed", self._topic, exc_info=exc)
            again = []
            for write in batch:
                if write.future.done():
                    continue
                if write.build_failed and not write.outstanding:
                    write.future.set_exception(failure)
                else:
                    write.build_failed = True
                    again.append(write)
            pending.requeue(again, retry_count=False)
            return [], []
        unchanged = []
        for refused, error in built.refused:
            if self._lingering(refused):
                refused.future.set_exception(self._unless_lingering(refused, error))
            else:
                # Decided on this replica's state, which may be behind the log (a process
                # relaying its writes reads the holder's a moment late): it stands once that
                # state is confirmed the latest, as a write that changes nothing does.
                refused.refusal = error
                unchanged.append(refused)
        if built.deferred:
            # Decided again in a later batch, on the state holding this batch's outcome.
            pending.requeue(built.deferred, retry_count=False)
        if built.halt is not None:
            # The trial run just mutated the live state with an unacknowledged write: this
            # replica can no longer be trusted, so it stops rather than show that write.
            culprit, error = built.halt
            culprit.future.set_exception(error)
            replica.halt_with(error)
            return [], []
        for write in built.unchanged:
            if self._lingering(write):
                write.future.set_exception(self._unless_lingering(write, None))
            else:
                unchanged.append(write)
        return built.records, unchanged

    def _batch_size(self) -> int:
        return self._settings.max_writes_per_batch

    def _lingering(self, write: PendingWrite) -> bool:
        """Whether an attempt of ``write`` relayed earlier may still be appended and accepted
        (it was not seen, and its base is still the log's latest): a process that received
        it late may append it whenever it holds the writer."""
        base = write.relayed_base
        return bool(write.outstanding) and base is not None and base >= self._replica.version

    def _unless_lingering(self, write: PendingWrite, error: BaseException | None) -> BaseException:
        """``error`` (a refused write's), or, when an earlier relayed attempt may still land,
        WriteOutcomeUnknownError: this attempt's generator gave no ops or raised now (it is
        not a function of the state alone), so only the lingering one can apply the write."""
        if not self._lingering(write):
            assert error is not None
            return error
        wid = write_id(self._context.writer_id, write.write_seq)
        unknown = WriteOutcomeUnknownError(
            f"write {wid}: an earlier attempt, relayed through the process holding the "
            "writer, may still be applied, but this attempt's generator "
            f"{'raised' if error is not None else 'gave no ops'} on the same state; it was "
            "applied once or not at all",
            write_id=wid,
        )
        unknown.__cause__ = error
        return unknown

    async def _write_batch(self) -> None:
        records = await self._build_batch()
        if records:
            await self._finish(records, self._issue(records))

    def _issue(
        self,
        records: list[OutgoingRecord[PendingWrite]],
        on_settled: Callable[[], None] | None = None,
    ) -> list[Awaitable[LogPosition]]:
        """Launch ``records`` and hand them all to the client, in order (pipelined: none is
        awaited before the last is sent)."""
        producer = self._producer
        assert producer is not None
        self._pending.launch(records)
        sends: list[Awaitable[LogPosition]] = []
        for outgoing in records:
            if sends and producer.refused:
                sends.append(_not_sent())  # built on a record the client refused
                continue
            sends.append(
                producer.send_nowait(
                    outgoing.payload, key=outgoing.record.record_id, on_settled=on_settled
                )
            )
        for outgoing in records:  # sent: decoding now costs the caller nothing
            if outgoing.adoption is not None:
                self._replica.check_adoption(outgoing.record, outgoing.adoption)
        return sends

    def queued(self) -> bool:
        """A write was just queued (``PendingWrites.on_submit``). True when the writer's
        task need not be woken for it: the serve loop idles holding the producer, so a
        callback at the end of this loop turn builds and sends the queued writes (those
        queued in the same turn join them: group commit as before) without the writer's
        task waking first, a turn of 50-100 us on a CPU that was idle, which is on a lock
        handover's path. A batch of one record is finished on its acknowledgement
        (:meth:`_finish_at_once`); the serve loop, woken, finishes any other."""
        if self._send_soon is not None:
            return True  # joins the batch about to be built
        if not self._may_send_now():
            return False
        self._send_soon = asyncio.get_running_loop().call_soon(self._send_queued)
        return True

    def _may_send_now(self) -> bool:
        """Whether the serve loop idles holding the producer with nothing to do first (no
        relayed records, no turn due)."""
        return (
            self._parked
            and self._issued is None
            and self._producer is not None
            and not self._foreign
            and not self._relayed
            and not self._turn_requested
            and not self._release_when_idle
            and self._replica.halt is None
            and not self._context.closed
            and not self._turn_due(asyncio.get_running_loop().time())
        )

    def _send_queued(self) -> None:
        self._send_soon = None
        if self._may_send_now():
            self._parked = False  # one batch: writes queued from now on are the loop's
            try:
                taken = list(itertools.islice(self._pending.queue, self._batch_size()))
                records, unchanged = self._build_now()
                if records and unchanged:
                    # Writes with no ops are confirmed on the state they were decided on
                    # before the records are sent: the serve loop builds this batch again
                    # (generators may run more than once), and does that.
                    self._pending.requeue(taken, retry_count=False)
                elif len(records) == 1 and not self._pending.queue:
                    issued = _Issued(records, [], [])
                    self._issued = issued
                    issued.sends = self._issue(
                        records, on_settled=lambda: self._finish_at_once(issued)
                    )
                    return  # finished on its acknowledgement, without the serve loop
                else:
                    sends = self._issue(records) if records else []
                    self._issued = _Issued(records, sends, unchanged)
            except Exception as exc:
                # Raised in the serve loop, as it would have been there (its retry logs it).
                self._issued = _Issued([], [], [], failure=exc)
        self._pending.wake.set()  # the batch to finish, or the queued writes to send

    def _finish_at_once(self, issued: _Issued) -> None:
        """``issued`` (one record, sent while the serve loop stayed in its idle wait) is
        acknowledged or failed. While the serve loop still sleeps there and nothing else is
        to be done, finish it here, on the loop: apply it (its caller resumes one loop turn
        sooner) and let the serve loop sleep on, its idle wait counted from now as after
        any batch. That spares it a wake-up and setting its wait up again per write
        (measured: 5-20% less CPU on the loop's thread for a lone writer). Anything else
        (the serve loop woken meanwhile or its wait ended, a failed send, a record the pump
        must read first, a halt, closing, writes left queued, an unasked turn falling due)
        is the serve loop's: it is woken and finishes the batch as any other."""
        if self._issued is not issued:
            return  # the serve loop took it first (woken meanwhile) and finishes it
        replica, wake, pending = self._replica, self._pending.wake, self._pending
        (outgoing,), (send,) = issued.records, issued.sends
        assert isinstance(send, asyncio.Future)
        idle_wait = self._idle_wait
        try:
            loop = asyncio.get_running_loop()
            idle_until = loop.time() + self._idle_release()
            # In a plain idle wait, the serve loop would wait idle_release_s from now, unless
            # the unasked turn comes first (then it works its wait out again); in the wait
            # for the unasked turn, that comes first still.
            idle_moves = self._idle_from_last
            if (
                idle_wait is None
                or idle_wait.expired
                or wake.is_set()
                or (
                    idle_moves
                    and self._relay_up()
                    and idle_until >= self._producer_since + self._unasked_turn_after() / 2
                )
                or self._turn_requested
                or pending.queue
                or self._context.closed
                or send.cancelled()
                or send.exception() is not None
                or not replica.is_next(at := send.result())
            ):
                wake.set()
                return
            replica.apply_own(outgoing.payload, outgoing.record, at, outgoing.adoption)
            if replica.halt is not None:
                wake.set()
                return
            self._issued = None
            self._stats.records_sent += 1
            replica.pause_reading(at)
            self._after_batch()
            if idle_moves:
                idle_wait.move_to(idle_until)
            self._parked = True  # still idle holding the producer: the next write too
        except Exception as exc:
            # Raised in the serve loop, as it would have been there (its retry logs it).
            self._issued = _Issued([], [], [], failure=exc)
            wake.set()

    async def _finish_issued(self, issued: _Issued) -> None:
        if issued.failure is not None:
            raise issued.failure
        if issued.records:
            await self._finish(issued.records, issued.sends)
        elif issued.unchanged:
            await self._settle_unchanged(issued.unchanged)

    async def _finish(
        self, records: list[OutgoingRecord[PendingWrite]], sends: list[Awaitable[LogPosition]]
    ) -> None:
        """Await the acknowledgements of ``records`` (sent), apply them, read them back."""
        replica = self._replica
        acked: list[LogPosition] = []
        failures: list[tuple[OutgoingRecord[PendingWrite], BaseException]] = []
        for outgoing, send in zip(records, sends, strict=True):
            try:
                at = await send
            except Exception as exc:
                failures.append((outgoing, exc))
                continue
            acked.append(at)
            replica.apply_own(outgoing.payload, outgoing.record, at, outgoing.adoption)
        self._stats.records_sent += len(records)
        if acked and not failures:
            replica.pause_reading(max(acked))  # if all applied: nothing to read back
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

    async def _settle_unchanged(
        self, writes: list[PendingWrite], built: Sequence[OutgoingRecord[PendingWrite]] = ()
    ) -> bool:
        """Confirm ``writes`` (no ops, or refused: decided on the replica's state) if that
        state is the log's latest; True if so: each completes, or fails with its refusal.
        Otherwise they are queued again, and so are the writes of
        ``built`` (records of the same batch not sent yet, built on that state): all are
        decided again on the newer state, in their order."""
        # Holding the exclusive writer is not proof enough that the state is the latest
        # (another process may have fenced us): the decision stands only if catching up with
        # the tail accepts no record.
        version = self._replica.version
        again = writes + [write for outgoing in built for write in outgoing.writes]
        try:
            await self._bounded(self._catch_up(), "confirming the state of writes with no ops")
        except BaseException:
            self._pending.requeue(again)
            raise
        if self._replica.version != version or self._replica.halt is not None:
            self._pending.requeue(again)
            return False
        confirmed = []
        for write in writes:
            error, write.refusal = write.refusal, None
            if error is None:
                confirmed.append(write)
            elif not write.future.done():
                write.future.set_exception(self._unless_lingering(write, error))
        self._pending.complete_unchanged(confirmed, self._replica.state, version)
        return True

    async def _send_failed(
        self,
        records: list[OutgoingRecord[PendingWrite]],
        failures: list[tuple[OutgoingRecord[PendingWrite], BaseException]],
    ) -> None:
        # A failed send may still have been persisted: the records stay in flight and are
        # settled by the pump if they ever appear. The writer re-acquires and catches up;
        # writes whose records are not seen by then are retried by requeue_unseen.
        error = failures[0][1]
        logger.info("send to %s failed: %s", self._topic, error)
        refused = [o for o, f in failures if isinstance(f, RecordTooLargeError)]
        unsent = [o for o, f in failures if isinstance(f, _NotSent)]
        if refused and len(refused) + len(unsent) == len(failures):
            # Refused by the client before sending, and the records built on them never
            # sent: certainly not persisted. The refused writes fail (not retriable); the
            # others go again, in records built afresh.
            limit = self._settings.max_record_bytes

            def too_large(outgoing: OutgoingRecord[PendingWrite]) -> BaseException:
                return RecordTooLargeError(
                    f"the broker's client refused a {len(outgoing.payload)}-byte message "
                    "(over the broker's maxMessageSize); lower max_record_bytes",
                    size=len(outgoing.payload),
                    limit=limit,
                )

            self._pending.refuse(refused, too_large)
            self._pending.withdraw(unsent)
            return
        await self.release()
        self._pending.requeue_unseen(records)
        if isinstance(error, PulsarStateError):
            raise error
        raise PulsarStateError(f"send failed: {error}") from error
