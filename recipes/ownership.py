"""Ownership: named resources taken in read or write mode, with leases and fencing tokens.

:Status: Experimental. Built only on ``pulsar_state``'s public API.

The PGo state server's idea (a process takes ownership of named variables, in a read set and a
write set, and releases them), as a table replicated through one Pulsar topic (see
``recipes/_lease_table.py`` for the state machine):

* ``acquire(names, mode=...)`` takes every name at once or waits for all of them (no partial
  holdings, so overlapping sets never deadlock). Shared readers, one writer. Requests are
  served in log order: a waiting writer is never overtaken by later readers.
* Each grant carries a **fencing token**, strictly larger than every earlier one on the topic,
  so on each of its names. Pass it to the state the lease protects (:func:`fenced_transact`)
  so that a holder that lost its lease (frozen, partitioned) cannot write there any more.
* Every lease has a TTL and is renewed by writing (``keep_alive=True`` renews in the
  background every ``ttl / 3``); there is no keepalive stream. Expiry is decided from the log
  only (the ops' timestamps, see the README's clock assumptions), so every replica agrees on
  who holds what at each position. Each open Ownership appends an expiry ``tick`` when its
  own clock says a lease is past due (``reap=True``), so a dead holder's resources are freed
  about ``ttl`` after its last renewal even when nobody else writes.

Handover: with the core's write relay (``relay_writes``, the default), a request, renewal or
release from a process that does not hold the topic's writer goes through the process that
does, so the topic's writer rarely changes hands while processes take turns on a lock.
Without it, a request that has to wait gives the writer up at once (the holder writes next),
and a holder whose release alone would grant a request that just queued takes the writer
ahead (``take_writer``), so a release within ``idle_release_s`` of it is one send.

Failure semantics: as the core's. A call that times out raises
:class:`~pulsar_state.OperationTimeoutError` (``acquire`` then withdraws its request); errors
that say "nothing was written" (:class:`NotHeldError`, :class:`UnknownResourceError`,
:class:`~pulsar_state.ConfigurationError`) are raised before anything is sent. An ``acquire``
that fails while its request may still land (:class:`~pulsar_state.WriteOutcomeUnknownError`:
relayed, or sent and not seen in time) appends its withdrawal anyway before it raises, which
either releases the request or makes it stale for every replica; if even that fails, the
request is withdrawn whenever it shows up or is granted, and released at close. Either way a
request that landed first is in the log, so subscribers (``leaders()``, membership streams)
may see it requested or granted just before its withdrawal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import numbers
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Self

from pulsar_state import (
    STATE_MACHINE_OPTIONS,
    AppliedRecord,
    ClosedError,
    ConfigurationError,
    OperationTimeoutError,
    PulsarStateError,
    ReplicaHaltedError,
    SharedStateManager,
    WriterBusyError,
)

from ._lease_table import (
    Lease,
    LeaseEvent,
    LeaseTable,
    LeaseTableCodec,
    Mode,
    NotHeldError,
    WaitCancelledError,
    check_names,
    check_ttl,
)

__all__ = ["Ownership"]

logger = logging.getLogger(__name__)

# After a lease is due by the local clock, wait this long (plus jitter, so that not every
# replica races to append the same tick) before appending the tick that expires it.
_REAP_GRACE_S = 0.05
# A keep-alive whose renewals keep failing warns at most this often per lease.
_RENEW_WARN_EVERY_S = 5.0
_REAP_JITTER_S = 0.1
# Re-check at least this often even without news (a backstop; the listener wakes it).
_REAP_IDLE_S = 5.0
_TAKEOVER_AFTER_S = 1.0
# While the write relay is up, how long an idle process keeps the topic's writer after its
# last write (relay_idle_release_s; the core's idle_release_s is 0.1 s). Others' writes
# reach it through the relay (one hop, cheaper than taking the writer), and a lock taken
# again within this time is one send: taking the writer back makes the broker persist a new
# producer epoch (a lock taken after 1 s idle: 8.6 ms p50 with 0.1 s, 3.9 ms with 5 s,
# against ZooKeeper's 3.9 and etcd's 3.2). Longer than a renewal's ttl / 3 (10 s TTL): a
# holder renewing keeps the writer, and the others relay their renewals to it.
_IDLE_RELEASE_WITH_RELAY_S = 5.0
# Requests of failed acquires watched for a late landing (see Ownership._abandon): at most
# this many, each until its TTL and this margin (for other writers' clocks) have passed.
_MAX_ABANDONED = 1024
_ABANDONED_MARGIN_S = 60.0
_WITHDRAW_RETRY_S = 0.1
# A failed acquire's withdraw waits at most its timeout, and at least this long.
_WITHDRAW_MIN_S = 1.0
_WITHDRAW_RETRY_MAX_S = 5.0
# Failures of an acquire's write that say its request was not sent (nothing can land).
_NOTHING_SENT = (
    OperationTimeoutError,
    WriterBusyError,
    ConfigurationError,
    ClosedError,
    ReplicaHaltedError,
)

Subscriber = Callable[[list[LeaseEvent], LeaseTable], None]


def default_owner() -> str:
    """host-pid-random: unique per Ownership unless the caller names the owner."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Ownership:
    """A replicated table of named resources held in read or write mode, on one topic.

    ::

        async with Ownership("pulsar://127.0.0.1:6650", "locks") as owners:
            lease = await owners.acquire(["a", "b"], mode="write", ttl=10)
            print(lease.token)          # fencing token
            await owners.release(lease)

            async with owners.hold("a", mode="read", ttl=10) as lease:
                ...

    Args:
        pulsar: a service URL or a ``pulsar.asyncio.Client`` (as for ``SharedStateManager``).
        topic: the table's topic (one per table).
        owner: this process's name in the table (default host-pid-random).
        resources: the names this table manages; others raise UnknownResourceError. None
            (default): any non-empty str.
        reap: append expiry ticks when a lease is past due by this process's clock.
        snapshots: enable snapshots of the table (:class:`LeaseTableCodec`): give
            ``snapshot_every_records`` too (or call ``manager.snapshot()``), and opening
            loads the newest one and replays only the records after it. Every renewal is a
            record (a lease kept alive writes one every ``ttl / 3``), so without snapshots
            opening replays the table's whole history. With ``trim_history`` too, the
            broker deletes the history behind the kept snapshots; a replica that falls
            forward over it tells what changed as the difference of the two tables (its
            waiting requests granted or ended, its subscribers' streams told).
        **manager_options: passed to :class:`~pulsar_state.SharedStateManager`.
            ``takeover_after_s`` defaults to 1 s here (the core's default never takes over):
            a process frozen while it holds the topic's writer is fenced off after 1 s, so
            leases keep being renewed, expired and granted. Keep TTLs well above it.
            ``relay_idle_release_s`` defaults to 5 s here (unless ``idle_release_s`` is
            given): while its write relay is up, an idle process keeps the topic's writer
            that long after its last write (else the core's ``idle_release_s``, 0.1 s), so
            its next acquire, renewal or release within it is one send; others' writes come
            through it meanwhile. One cost: a process frozen or cut off then stalls others'
            writes until it resumes or is fenced (``takeover_after_s``), where it used to
            have let the writer go. A process with ``relay_writes=False`` (or an older
            pulsar-state without the relay) polls for the writer and fences an idle holder
            after ``takeover_after_s``: on a table shared with such processes, give every
            process ``relay_idle_release_s=0.1``.
    """

    def __init__(
        self,
        pulsar: Any,
        topic: str,
        *,
        owner: str | None = None,
        resources: Iterable[str] | None = None,
        reap: bool = True,
        snapshots: bool = False,
        **manager_options: Any,
    ) -> None:
        reserved = sorted((STATE_MACHINE_OPTIONS | {"snapshot_codec"}) & manager_options.keys())
        if reserved:
            hint = (
                " (snapshots=True gives it its own codec)" if "snapshot_codec" in reserved else ""
            )
            raise ConfigurationError(f"Ownership sets {', '.join(reserved)} itself{hint}")
        if owner is not None and (not isinstance(owner, str) or not owner):
            raise ConfigurationError(f"owner must be a non-empty str, not {owner!r}")
        self.owner = owner or default_owner()
        self._resources: frozenset[str] | None = None
        if resources is not None:
            self._resources = frozenset(check_names(resources, None))
        self._reap = reap
        # A holder frozen (SIGSTOP, GC pause) while it holds the topic's exclusive writer
        # must not stop everyone else from renewing, expiring and granting: take the
        # writer over (fencing it; the core refuses its stale records) after a short wait.
        manager_options.setdefault("takeover_after_s", _TAKEOVER_AFTER_S)
        if "idle_release_s" not in manager_options:
            # Only while the relay is up (others' writes come through the holder); without
            # it others can only poll for the writer, and the core's short hold applies.
            manager_options.setdefault("relay_idle_release_s", _IDLE_RELEASE_WITH_RELAY_S)
        self._manager: SharedStateManager[LeaseTable, Any] = SharedStateManager(
            pulsar,
            topic,
            initial_state=LeaseTable,
            apply=LeaseTable.apply,
            begin_record=LeaseTable.begin,
            copy_state=LeaseTable.copy,
            trial_state=LeaseTable.trial,
            adopt_trial=LeaseTable.adopt,
            snapshot_codec=LeaseTableCodec() if snapshots else None,
            **manager_options,
        )
        # A halt ends everything this Ownership waits for (see _on_halt).
        self._manager.add_halt_listener(self._on_halt)
        self._pending: dict[str, asyncio.Future[Lease]] = {}
        # lease id -> the timer of its next renewal, or the task renewing it now
        self._keepers: dict[str, asyncio.TimerHandle | asyncio.Task[None]] = {}
        # Lease id -> (renewals failed in a row, when the last warning was logged).
        self._renew_failures: dict[str, tuple[int, float]] = {}
        self._mine: set[str] = set()  # ids of this Ownership's requests and leases
        # Requests of acquires that failed while their record could still land (sent or
        # relayed, its outcome unknown): lease id -> Unix time after which this Ownership
        # stops watching for it. One that lands is withdrawn at once (see _on_events).
        self._abandoned: dict[str, float] = {}
        self._withdrawals: set[asyncio.Task[None]] = set()
        self._subscribers: list[Subscriber] = []
        # The table as of the last record this Ownership handled: after a fall-forward (a
        # snapshot loaded past trimmed records), the old table object, to tell what changed.
        self._seen: LeaseTable | None = None
        self._on_close: list[Callable[[PulsarStateError], None]] = []
        self._changed: asyncio.Event | None = None
        # When the reaper looks next (Unix time): a record wakes it only for an earlier expiry.
        self._reap_wake_at = 0.0
        self._reaper: asyncio.Task[None] | None = None
        self._opened = False
        self._open_called = False
        self._stopping = False
        self._closing = False  # aclose began: no request may be written any more
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def open(self, *, timeout: float | None = None) -> None:
        """Connect and replay the table up to the tail as of now (once: a table whose open
        failed is closed; create another)."""
        if self._closed:
            raise ClosedError(
                f"ownership table on {self.topic} is closed (or its open failed): create another"
            )
        if self._open_called:
            # Before anything: a second open subscribed the table's listeners twice (every
            # record handled twice) and replaced the Event the running reaper waits on.
            raise ConfigurationError(f"ownership table on {self.topic} is already open")
        self._open_called = True
        self._changed = asyncio.Event()
        self._manager.add_listener(self._on_record)
        self._manager.add_state_replaced_listener(self._on_state_replaced)
        try:
            await self._manager.open(timeout=timeout)
        except BaseException:
            self._closed = True  # the manager closed itself: this table is spent
            raise
        self._opened = True
        # What a fall-forward before any record is told against (else it told nothing).
        self._seen = self._manager.read_local(_whole)
        if self._reap:
            self._reaper = asyncio.get_running_loop().create_task(
                self._reap_loop(), name=f"ownership-reaper-{self.topic}"
            )

    async def aclose(self, *, release: bool = True, timeout: float = 10.0) -> None:
        """Stop renewing; release this process's leases (``release=True``); disconnect."""
        if self._closed or self._closing:
            return
        self._closing = self._stopping = True
        # The reaper and the keep-alives: renewal timers and renewals running now.
        background = [b for b in [self._reaper, *self._keepers.values()] if b is not None]
        # And withdrawals of late requests (in _mine: the release below covers them).
        background += self._withdrawals
        for work in background:
            work.cancel()
        for task in background:
            if isinstance(task, asyncio.Task):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if (
            release
            and self._opened
            and self._manager.halted is None
            and (self._mine or self._abandoned or self._pending)
        ):
            with contextlib.suppress(PulsarStateError):
                await self._manager.write(self._releases_at_close, timeout=timeout)
        self._closed = True
        closed = ClosedError(f"ownership table on {self.topic} is closed")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(closed)
                future.exception()  # an acquire still waiting gets it; nobody else must
        self._pending.clear()
        self._keepers.clear()
        self._tell_closed(closed)
        await self._manager.aclose(timeout=timeout)

    def _tell_closed(self, error: PulsarStateError) -> None:
        for callback in list(self._on_close):
            try:
                callback(error)
            except Exception:
                # One callback's bug must not keep the table open nor the other streams
                # waiting forever.
                logger.exception("an Ownership on_close callback raised")

    def _releases_at_close(self, state: LeaseTable) -> list[dict[str, Any]]:
        # Read as the record is built: a watched request that showed up meanwhile is in
        # _mine by then. One still watched for, or an acquire's still on its way (no attempt
        # is built once closing), is released present or not (see _give_up).
        now = time.time()
        ids = [i for i in self._mine if i in state.leases]
        ids += [i for i, until in self._abandoned.items() if until >= now and i not in ids]
        ids += [i for i in self._pending if i not in ids]
        return [self._op("release", i) for i in ids]

    async def __aenter__(self) -> Ownership:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def topic(self) -> str:
        return str(self._manager.topic)

    @property
    def position(self) -> int:
        return self._manager.position

    @property
    def manager(self) -> SharedStateManager[LeaseTable, Any]:
        """The SharedStateManager underneath (monitoring; write through the recipe)."""
        return self._manager

    def _check_usable(self) -> None:
        if self._closed or self._closing:
            raise ClosedError(f"ownership table on {self.topic} is closed")
        if not self._opened:
            raise ClosedError(f"ownership table on {self.topic} is not open")

    # ------------------------------------------------------------------ acquire / release

    def _op(self, kind: str, lease_id: str | None = None, **fields: Any) -> dict[str, Any]:
        op: dict[str, Any] = {"op": kind, "now": time.time()}
        if lease_id is not None:
            op["id"] = lease_id
        op.update(fields)
        return op

    async def acquire(
        self,
        names: str | Iterable[str],
        *,
        mode: Mode = "write",
        ttl: float = 10.0,
        timeout: float | None = None,
        keep_alive: bool = True,
    ) -> Lease:
        """Take every one of ``names`` in ``mode``, atomically; returns the granted lease.

        Waits (in FIFO order with other requests) until all names are free for ``mode``, at
        most ``timeout`` seconds (None: as long as it takes), then withdraws the request and
        raises :class:`~pulsar_state.OperationTimeoutError`. ``keep_alive`` renews the lease
        (and the waiting request) every ``ttl / 3`` seconds until :meth:`release`; without
        it, call :meth:`renew` yourself.

        Raises ConfigurationError for no names, a bad mode or a TTL that is not > 0,
        UnknownResourceError for a name outside ``resources``, NotHeldError if the request
        expired before it was granted (this process did not renew it in time).
        """
        lease = await self._acquire(names, mode, ttl, timeout, True, keep_alive)
        assert lease is not None
        return lease

    async def try_acquire(
        self,
        names: str | Iterable[str],
        *,
        mode: Mode = "write",
        ttl: float = 10.0,
        timeout: float | None = None,
        keep_alive: bool = True,
    ) -> Lease | None:
        """``acquire`` without waiting: the lease if every name is free for ``mode`` at the
        tail of the log, else None (the table is left unchanged)."""
        return await self._acquire(names, mode, ttl, timeout, False, keep_alive)

    async def _acquire(
        self,
        names: str | Iterable[str],
        mode: Mode,
        ttl: float,
        timeout: float | None,
        wait: bool,
        keep_alive: bool,
    ) -> Lease | None:
        self._check_usable()
        wanted = check_names(names, self._resources)
        if mode not in ("read", "write"):
            raise ConfigurationError(f"mode must be 'read' or 'write', not {mode!r}")
        ttl = check_ttl(ttl)
        lease_id = os.urandom(16).hex()  # as unique as uuid4().hex, without a UUID object
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        granted: asyncio.Future[Lease] = loop.create_future()
        self._pending[lease_id] = granted
        fields = {"owner": self.owner, "names": list(wanted), "mode": mode, "ttl": ttl}

        def generator(state: LeaseTable) -> list[dict[str, Any]]:
            if self._closing:  # (an attempt after the release at close would outlive it)
                raise ClosedError(f"ownership table on {self.topic} is closed")
            op = self._op("acquire", lease_id, **fields)
            if not wait and not state.simulate(op).leases.get(lease_id, _WAITING).held:
                return []
            return [op]

        written = False
        try:
            result = await self._manager.write(
                generator, reader=lambda s: s.leases.get(lease_id), timeout=_left(deadline)
            )
            written = True
            if self._closing:
                raise ClosedError(f"ownership table on {self.topic} closed while acquiring")
            lease = result.value
            if lease is None and not wait:
                self._pending.pop(lease_id, None)
                return None
            if lease is None:
                raise NotHeldError(f"request {lease_id} expired at once (ttl {ttl}s too short?)")
            self._mine.add(lease_id)
            if keep_alive:
                self._keep(lease_id, ttl / 3)
            if not lease.held:
                # The holder writes next (its release): let it have the writer at once.
                self._manager.release_writer()
                async with asyncio.timeout(_left(deadline)):
                    lease = await granted
        except BaseException as exc:
            self._pending.pop(lease_id, None)
            self._stop_keeping(lease_id)
            self._mine.discard(lease_id)
            if not isinstance(exc, NotHeldError):
                may_land = not written and not isinstance(exc, _NOTHING_SENT)
                if written or may_land:
                    # Bounded (the caller is failing already): a withdraw that times out
                    # leaves the request watched for (see _give_up).
                    bound = None if timeout is None else max(_WITHDRAW_MIN_S, timeout)
                    await self._give_up(
                        lease_id, ttl, in_table=written, may_land=may_land, timeout=bound
                    )
            if isinstance(exc, TimeoutError) and not isinstance(exc, OperationTimeoutError):
                raise OperationTimeoutError(
                    f"{list(wanted)} not granted for {mode} within {timeout}s"
                ) from exc
            raise
        self._pending.pop(lease_id, None)
        return lease

    async def _give_up(
        self,
        lease_id: str,
        ttl: float,
        *,
        in_table: bool,
        may_land: bool,
        timeout: float | None = None,
    ) -> None:
        """Withdraw the request of an acquire that failed (best effort: the caller is failing
        already). One whose record may still land (relayed, or sent and its outcome not seen
        in time) is released whether or not it is in the table yet: built on the log's tail,
        that release makes a request still on its way stale for every replica, or is
        ignored (the request landed first) and built again after it, where it finds the
        request. If the withdraw fails, the request is watched for (:meth:`_abandon`)."""
        self._abandon(lease_id, ttl)  # first: it may show up while the withdraw is sent
        if await self._withdraw(lease_id, fence=may_land, timeout=timeout):
            self._abandoned.pop(lease_id, None)
        else:
            self._count_while_in_table(lease_id)

    async def _withdraw(
        self, lease_id: str, *, fence: bool = False, timeout: float | None = None
    ) -> bool:
        """Release ``lease_id`` if the table has it (``fence``: whether or not); whether the
        write was done. Shielded: a cancelled caller leaves it to finish."""
        with contextlib.suppress(PulsarStateError, asyncio.CancelledError):
            await asyncio.shield(
                self._manager.write(
                    lambda s: (
                        [self._op("release", lease_id)] if fence or lease_id in s.leases else []
                    ),
                    timeout=timeout,
                )
            )
            return True
        return False

    def _abandon(self, lease_id: str, ttl: float) -> None:
        """Watch for the request ``lease_id`` of an acquire that gave up: withdrawn when it
        shows up or is granted (:meth:`_withdraw_landed`), released at close."""
        now = time.time()
        for stale in [i for i, until in self._abandoned.items() if until < now]:
            del self._abandoned[stale]
        while len(self._abandoned) >= _MAX_ABANDONED:
            evicted = next(iter(self._abandoned))  # the oldest
            del self._abandoned[evicted]
            logger.warning("no longer watching for request %s (too many watched)", evicted)
        # By then a request that lands is already past due by every clock within the margin
        # of ours (the table expires by the ops' clocks, and its op was stamped before the
        # acquire failed): the next expiry tick drops it. One in the table has been granted
        # (and withdrawn then) or expired.
        self._abandoned[lease_id] = now + ttl + _ABANDONED_MARGIN_S

    def _withdraw_landed(self, lease_id: str, lease: Lease) -> None:
        """The request of an acquire that gave up showed up (or was granted) after all:
        count it as this process's (so closing releases it) and withdraw it now, rather than
        let it wait first in line or hold its names for its whole TTL with nobody to release
        it."""
        del self._abandoned[lease_id]
        self._mine.add(lease_id)
        if self._stopping:
            return  # closing releases it
        logger.info(
            "request %s on %s showed up after its acquire gave up; withdrawing it",
            lease_id,
            list(lease.names),
        )
        task = asyncio.get_running_loop().create_task(
            self._withdraw_until_gone(lease_id), name=f"ownership-withdraw-{lease_id}"
        )
        self._withdrawals.add(task)
        task.add_done_callback(self._withdrawals.discard)

    async def _withdraw_until_gone(self, lease_id: str) -> None:
        # Whatever made the request late may make its withdraw fail too: try again, until
        # the request is gone (released, expired) or this Ownership stops.
        pause = _WITHDRAW_RETRY_S
        while not self._stopping and not await self._withdraw(lease_id):
            with contextlib.suppress(PulsarStateError):
                if not self._manager.read_local(lambda s: lease_id in s.leases):
                    return
            logger.warning("withdrawing request %s failed; trying again in %.1fs", lease_id, pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, _WITHDRAW_RETRY_MAX_S)

    async def renew(
        self,
        lease: Lease,
        *,
        ttl: float | None = None,
        keep_alive: bool = False,
        timeout: float | None = None,
    ) -> Lease:
        """Extend ``lease`` to ``ttl`` (default its own) seconds from now; returns it renewed.

        ``keep_alive=True`` also renews it from now on, as ``acquire(keep_alive=True)`` does
        (e.g. after a ``release`` that failed, which stops renewing). Raises NotHeldError
        (writing nothing) if it expired or was released; OperationTimeoutError after
        ``timeout`` s (default: the manager's ``write_timeout_s``).
        """
        self._check_usable()
        self._check_mine(lease)
        renewed = await self._renew(
            lease.id, check_ttl(lease.ttl if ttl is None else ttl), timeout=timeout
        )
        if (lease.id in self._keepers or keep_alive) and lease.id in self._mine:
            # (Not once a release began meanwhile: it stopped the renewals for good.)
            # Kept alive: its next renewal a third of the TTL just set from now (a shorter
            # one would expire before a renewal timed for the old one; a renewal under way
            # may have been built on the old TTL, so it is not waited for).
            self._stop_keeping(lease.id)
            self._keep(lease.id, renewed.ttl / 3)
        return renewed

    def is_kept_alive(self, lease: Lease) -> bool:
        """Whether this Ownership renews ``lease`` by itself (``keep_alive=True``, and no
        ``release`` tried since nor a renewal that found it lost). No I/O."""
        self._check_usable()
        return lease.id in self._keepers

    async def _renew(self, lease_id: str, ttl: float | None, timeout: float | None = None) -> Lease:
        """Renew for ``ttl`` seconds (None: the lease's own TTL in the table at the tail,
        as the keep-alive does, so that it keeps any TTL a renew() set)."""

        def generator(state: LeaseTable) -> list[dict[str, Any]]:
            current = state.leases.get(lease_id)
            op = self._op("renew", lease_id, ttl=current.ttl if ttl is None and current else ttl)
            if current is None or lease_id not in state.simulate(op).leases:
                raise NotHeldError(f"lease {lease_id} is not held: it expired or was released")
            return [op]

        result = await self._manager.write(
            generator, reader=lambda s: s.leases[lease_id], timeout=timeout
        )
        if not result.value.held:
            self._manager.release_writer()  # still waiting: the holder writes next
        return result.value

    async def release(self, lease: Lease, *, timeout: float | None = None) -> None:
        """Give ``lease`` up (or withdraw a waiting request).

        Raises NotHeldError (writing nothing) if it is not held by this Ownership: another
        owner's, already released, or expired. If the release fails otherwise (a timeout, an
        outage), the lease is no longer renewed: it ends at its expiry unless a retried
        ``release`` or :meth:`aclose` ends it first (or ``renew(lease, keep_alive=True)``
        keeps it).
        """
        self._check_usable()
        self._check_mine(lease)
        self._stop_keeping(lease.id)
        self._mine.discard(lease.id)
        try:
            await self._write_release(lease, timeout)
        except NotHeldError:
            raise
        except BaseException:
            self._count_while_in_table(lease.id)  # the release may not have landed
            raise

    def _count_while_in_table(self, lease_id: str) -> None:
        """Count ``lease_id`` as this process's again if the table still holds it (a release
        or withdraw that failed): closing must release it, and requests waiting for it must
        still count it as this process's. A release that lands later takes it out again,
        as any release or expiry does."""
        with contextlib.suppress(PulsarStateError):  # closed or halted: nothing to do
            if self._manager.read_local(lambda s: lease_id in s.leases):
                self._mine.add(lease_id)

    async def _write_release(self, lease: Lease, timeout: float | None = None) -> None:
        def generator(state: LeaseTable) -> list[dict[str, Any]]:
            op = self._op("release", lease.id)
            current = state.leases.get(lease.id)
            # By the op's own clock: it is what the table expires leases by before applying
            # it (a clock read earlier, when release was called, let a lease that expired
            # while the write was queued be "released" by an op that expired it).
            if current is None or current.expires_at <= max(state.clock, op["now"]):
                raise NotHeldError(
                    f"lease {lease.id} on {list(lease.names)} is not held: it expired or was "
                    "already released"
                )
            return [op]

        await self._manager.write(generator, timeout=timeout)

    def _check_mine(self, lease: Lease) -> None:
        if not isinstance(lease, Lease):
            raise ConfigurationError(f"expected a Lease, not {type(lease).__name__}")
        if lease.owner != self.owner:
            raise NotHeldError(f"lease {lease.id} belongs to {lease.owner!r}, not {self.owner!r}")

    @contextlib.asynccontextmanager
    async def hold(
        self,
        names: str | Iterable[str],
        *,
        mode: Mode = "write",
        ttl: float = 10.0,
        timeout: float | None = None,
    ) -> AsyncIterator[Lease]:
        """``acquire`` (kept alive) on entry, ``release`` on exit.

        If the lease was lost meanwhile, leaving raises NotHeldError (unless the body raised).
        """
        lease = await self.acquire(names, mode=mode, ttl=ttl, timeout=timeout)
        try:
            yield lease
        except BaseException:
            with contextlib.suppress(NotHeldError, ClosedError):
                await self.release(lease)
            raise
        await self.release(lease)

    # ------------------------------------------------------------------ reads

    def holders_local(self, name: str) -> list[Lease]:
        """The leases holding ``name`` in the local replica (no I/O), oldest grant first."""
        self._check_usable()
        return self._manager.read_local(lambda s: s.holding(name))

    async def holders(
        self, name: str, *, latest: bool = False, timeout: float | None = None
    ) -> list[Lease]:
        """The leases holding ``name``; ``latest=True`` first catches up with the tail.

        The table removes an expired lease only when an op reaches its expiry: compare
        ``expires_at`` with your clock to see one that is due but not yet reaped.
        """
        self._check_usable()
        return await self._manager.read(lambda s: s.holding(name), latest=latest, timeout=timeout)

    async def leases(self, *, latest: bool = False, timeout: float | None = None) -> list[Lease]:
        """Every lease, held and waiting, in request order."""
        self._check_usable()
        return await self._manager.read(
            lambda s: list(s.leases.values()), latest=latest, timeout=timeout
        )

    def is_held(self, lease: Lease, *, margin: float = 0.0) -> bool:
        """Whether the local replica shows ``lease`` held and this clock says it has more than
        ``margin`` seconds left (no I/O). A hint for when to stop acting; fence writes."""
        self._check_usable()
        if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not margin >= 0:
            # (A negative one called a lease held after its expiry.)
            raise ConfigurationError(f"margin must be a number of seconds >= 0, not {margin!r}")
        margin = float(margin)
        current = self._manager.read_local(lambda s: s.leases.get(lease.id))
        return current is not None and current.held and current.expires_at - margin > time.time()

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(events, table)`` after each record that changed the table, in log
        order, on the event loop (keep it short). Returns an unsubscribe function. Reading the
        table and subscribing in one synchronous step misses nothing."""
        self._check_usable()
        self._subscribers.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return remove

    def on_close(self, callback: Callable[[PulsarStateError], None]) -> Callable[[], None]:
        """Call ``callback(error)`` when this Ownership closes (a ClosedError) or its replica
        halts (a ReplicaHaltedError): what ends streams. A callback may see both, halt first.
        Returns a function that removes it (a stream closed early: nothing kept for it)."""
        self._on_close.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._on_close.remove(callback)

        return remove

    def read_local(self, reader: Callable[[LeaseTable], Any]) -> Any:
        """Run ``reader`` on the local table (no I/O); it must not change it."""
        self._check_usable()
        return self._manager.read_local(reader)

    # ------------------------------------------------------------------ background work

    def _on_record(self, record: AppliedRecord[Any]) -> None:
        if self._manager.closed:
            return
        table: LeaseTable = self._manager.read_local(_whole)
        self._seen = table
        self._on_events(table.events, table)

    def _on_state_replaced(self) -> None:
        """The replica fell forward to a snapshot (``trim_history``): the records skipped
        are not known, so what changed is told as the difference of the two tables."""
        if self._manager.closed:
            return
        table: LeaseTable = self._manager.read_local(_whole)
        before, self._seen = self._seen, table
        if before is not None and before is not table:
            self._on_events(self._changes(before, table), table)

    def _changes(self, before: LeaseTable, after: LeaseTable) -> list[LeaseEvent]:
        """Events taking ``before`` to ``after``: a lease gone is told released (expired if
        this process was keeping it alive), one new or now held granted (or requested while
        it waits), one with another expiry renewed."""
        position = after.position
        events = [
            LeaseEvent("expired" if lease_id in self._keepers else "released", lease, position)
            for lease_id, lease in before.leases.items()
            if lease_id not in after.leases
        ]
        for lease_id, lease in after.leases.items():
            prior = before.leases.get(lease_id)
            if prior is None or (lease.held and not prior.held):
                events.append(LeaseEvent("granted" if lease.held else "requested", lease, position))
            elif lease.expires_at != prior.expires_at:
                events.append(LeaseEvent("renewed", lease, position))
        return events

    def _on_events(self, events: list[LeaseEvent], table: LeaseTable) -> None:
        for event in events:
            lease_id = event.lease.id
            if event.kind in ("requested", "granted") and lease_id in self._abandoned:
                self._withdraw_landed(lease_id, event.lease)
            if event.kind == "granted":
                future = self._pending.pop(lease_id, None)
                if future is not None and not future.done():
                    future.set_result(event.lease)
            elif event.kind in ("expired", "released"):
                future = self._pending.pop(lease_id, None)
                if future is not None and not future.done():
                    future.set_exception(
                        NotHeldError(f"request {lease_id} {event.kind} before it was granted")
                    )
                self._mine.discard(lease_id)
                self._abandoned.pop(lease_id, None)
                if lease_id in self._keepers:
                    if event.kind == "expired":
                        logger.warning(
                            "lease %s on %s expired at position %d (not renewed in time)",
                            lease_id,
                            list(event.lease.names),
                            event.position,
                        )
                    self._stop_keeping(lease_id)
        if events:
            if self._holds_up_a_request(events, table):
                # This process's release comes next: have the writer ready for it.
                self._manager.take_writer()
            for callback in list(self._subscribers):
                try:
                    callback(events, table)
                except Exception:
                    # One subscriber's bug must not cost the others (a leaders() stream) this
                    # record, nor the reaper its wake-up below.
                    logger.exception("an Ownership subscriber raised; it stays subscribed")
        if self._changed is not None and any(
            event.lease.expires_at + _REAP_GRACE_S < self._reap_wake_at
            for event in events
            if event.kind in ("requested", "granted", "renewed")
        ):
            self._changed.set()

    def _on_halt(self, error: ReplicaHaltedError) -> None:
        """The replica halted (on the loop, once): no grant, expiry or renewal can come any
        more. Fail the waiting acquires and end the streams with ``error`` rather than leave
        them waiting forever, and stop renewing and reaping, which would fail and retry (and
        log) until closed."""
        self._stopping = True
        background = [b for b in [self._reaper, *self._keepers.values()] if b is not None]
        self._keepers.clear()
        for work in background:
            work.cancel()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
                future.exception()  # its acquire gets it; nobody else must
        self._pending.clear()
        self._tell_closed(error)

    def _holds_up_a_request(self, events: list[LeaseEvent], table: LeaseTable) -> bool:
        """Whether this process's release is what a request waits for: another process's
        request just queued on names only this process holds, or this process was just
        granted names another request waits for."""
        if not self._mine:
            return False
        for event in events:
            lease = event.lease
            if event.kind == "requested" and not self._is_mine(lease.id):
                waiting = table.leases.get(lease.id)
                if (
                    waiting is not None
                    and not waiting.held
                    and self._only_mine_hold(waiting.names, table)
                ):
                    return True
            elif event.kind == "granted" and self._is_mine(lease.id):
                for other in table.waiting():
                    if (
                        not self._is_mine(other.id)
                        and not set(lease.names).isdisjoint(other.names)
                        and self._only_mine_hold(other.names, table)
                    ):
                        return True
        return False

    def _is_mine(self, lease_id: str) -> bool:
        # A request's id is in _mine once written; in _pending while its write is on the way.
        return lease_id in self._mine or lease_id in self._pending

    def _only_mine_hold(self, names: tuple[str, ...], table: LeaseTable) -> bool:
        # Other holders too (shared readers): their releases count as much; none takes the
        # writer ahead, rather than all of them at once.
        held = [lease_id for name in names for lease_id in table.holders.get(name, ())]
        return bool(held) and all(self._is_mine(lease_id) for lease_id in held)

    def _keep(self, lease_id: str, interval: float) -> None:
        # A timer, not a task sleeping per lease: nothing to start or cancel on the loop
        # for the common lease that is released before its first renewal.
        self._keepers[lease_id] = asyncio.get_running_loop().call_later(
            interval, self._renew_due, lease_id, interval
        )

    def _stop_keeping(self, lease_id: str) -> None:
        self._renew_failures.pop(lease_id, None)
        keeper = self._keepers.pop(lease_id, None)
        if keeper is not None and keeper is not asyncio.current_task():
            keeper.cancel()

    def _renew_due(self, lease_id: str, interval: float) -> None:
        if not self._stopping and lease_id in self._keepers:
            self._keepers[lease_id] = asyncio.get_running_loop().create_task(
                self._keep_alive(lease_id, interval),
                name=f"ownership-keepalive-{lease_id}",
            )

    async def _keep_alive(self, lease_id: str, interval: float) -> None:
        # After a failure the next try comes sooner (halving, down to 50 ms) while the
        # lease may still be saved; after a success, a third of its TTL again.
        try:
            renewed = await self._renew(lease_id, None, timeout=max(interval, 0.5))
            next_in = renewed.ttl / 3
            failures = self._renew_failures.pop(lease_id, None)
            if failures is not None:
                logger.info("renewed lease %s after %d failed tries", lease_id, failures[0])
        except NotHeldError:
            self._renew_failures.pop(lease_id, None)
            logger.warning("lease %s was lost: it expired before it could be renewed", lease_id)
            self._keepers.pop(lease_id, None)
            return
        except ClosedError:
            return
        except PulsarStateError as exc:
            # Warned once per _RENEW_WARN_EVERY_S a lease: retries come every 50 ms at worst.
            now = time.monotonic()
            count, warned_at = self._renew_failures.get(lease_id, (0, -math.inf))
            if now - warned_at >= _RENEW_WARN_EVERY_S:
                logger.warning(
                    "renewing lease %s failed (%s, %d tries so far); retrying",
                    lease_id,
                    exc,
                    count + 1,
                )
                warned_at = now
            else:
                logger.debug("renewing lease %s failed again (%s); retrying", lease_id, exc)
            self._renew_failures[lease_id] = (count + 1, warned_at)
            next_in = max(interval / 2, 0.05)
        # Released (or lost) meanwhile: _stop_keeping dropped this task from the keepers.
        if self._keepers.get(lease_id) is asyncio.current_task() and not self._stopping:
            self._keep(lease_id, next_in)

    async def _reap_loop(self) -> None:
        assert self._changed is not None
        changed = self._changed
        while not self._stopping:
            changed.clear()
            due = self._manager.read_local(lambda s: s.next_expiry())
            now = time.time()
            if due is None or due + _REAP_GRACE_S > now:
                delay = _REAP_IDLE_S if due is None else due + _REAP_GRACE_S - now
                delay = min(delay + random.random() * _REAP_JITTER_S, _REAP_IDLE_S)
                self._reap_wake_at = now + delay
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await changed.wait()
                continue
            self._reap_wake_at = 0.0  # writing a tick now: it looks again right after
            try:
                await self._manager.write(self._tick)
            except ClosedError:
                return
            except PulsarStateError as exc:
                logger.warning("expiry tick on %s failed (%s); retrying", self.topic, exc)
                await asyncio.sleep(0.5)

    def _tick(self, state: LeaseTable) -> list[dict[str, Any]]:
        op = self._op("tick")
        due = state.next_expiry()
        return [op] if due is not None and due <= max(state.clock, op["now"]) else []


_WAITING = Lease("", "", (), "write", 1.0, 0.0)


def _whole(table: LeaseTable) -> LeaseTable:
    return table


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(deadline - asyncio.get_running_loop().time(), 0.0)


class OneLeaseRecipe:
    """What LeaderElection and Membership share: one named process holding at most one lease
    in an Ownership table of its own, with the table's lifecycle."""

    def __init__(
        self, pulsar: Any, topic: str, *, name: str | None = None, ttl: float = 10.0, **options: Any
    ) -> None:
        self.ttl = check_ttl(ttl)
        if "owner" in options:
            raise ConfigurationError(f"{type(self).__name__} is named by name=, not owner=")
        self._ownership = Ownership(pulsar, topic, owner=name, **options)
        self._lease: Lease | None = None
        # One campaign or join at a time: two would write two requests, and resign or leave
        # would release one while the other (granted next) kept this process in.
        self._taking = asyncio.Lock()
        # For cancel(): the tasks in campaign() or join(), those of them renewing the lease
        # they hold (not waiting: not called off), and those called off (True: cancelled,
        # told apart from a cancellation of their own; False: to stop once their renewal
        # finds the lease ended).
        self._waiting_tasks: set[asyncio.Task[Any]] = set()
        self._renewing: set[asyncio.Task[Any]] = set()
        self._called_off: dict[asyncio.Task[Any], bool] = {}

    @contextlib.asynccontextmanager
    async def _alone(self, deadline: float | None) -> AsyncIterator[None]:
        task = asyncio.current_task()
        assert task is not None
        self._waiting_tasks.add(task)
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._taking.acquire()
            except TimeoutError as exc:
                raise OperationTimeoutError(
                    f"{self.name}: another campaign or join of this process took the whole timeout"
                ) from exc
            try:
                yield
            finally:
                self._taking.release()
        except BaseException as exc:
            # Ownership.acquire withdrew the request on the way out (as on any cancellation).
            # A cancel() that came while the call was failing anyway may have been swallowed
            # there (the withdraw is shielded): its count is taken back all the same.
            if self._called_off.get(task):
                others = task.uncancel()  # cancellations of the caller's own, still due
                if others == 0 and isinstance(exc, asyncio.CancelledError):
                    raise self._called_off_error() from None
            raise
        else:
            if self._called_off.get(task):
                task.uncancel()  # won before the cancellation reached it: it leads
        finally:
            self._waiting_tasks.discard(task)
            self._called_off.pop(task, None)

    def _called_off_error(self) -> WaitCancelledError:
        return WaitCancelledError(f"{self.name}: called off by cancel(); the request was withdrawn")

    def _stop_if_called_off(self) -> None:
        """Raise WaitCancelledError if cancel() came while this task was renewing a lease
        that turned out to have ended (no request written yet: nothing to withdraw)."""
        task = asyncio.current_task()
        if task in self._called_off and not self._called_off[task]:
            raise self._called_off_error()

    def cancel(self) -> None:
        """Call off every ``campaign()`` or ``join()`` of this recipe still waiting (from
        another task; the blocking twin's from any thread): each withdraws its request (or,
        should that fail, leaves it to be withdrawn whenever it shows up, as a timed-out
        ``acquire`` does) and raises :class:`~recipes.WaitCancelledError`; a grant that came
        just before is given up again. A term or membership held is kept (``resign()`` or
        ``leave()`` give it up; a call renewing it returns it); a call that starts after
        this one is not affected. Kazoo's ``Election.cancel()``.
        """
        current = asyncio.current_task()
        for task in self._waiting_tasks:
            if task is current or task in self._called_off:
                continue
            waiting = task not in self._renewing
            self._called_off[task] = waiting
            if waiting:
                task.cancel()

    @property
    def name(self) -> str:
        return self._ownership.owner

    @property
    def ownership(self) -> Ownership:
        """The Ownership table underneath."""
        return self._ownership

    async def open(self, *, timeout: float | None = None) -> None:
        await self._ownership.open(timeout=timeout)

    async def _kept(self, deadline: float | None) -> Lease | None:
        """The lease this process holds, kept alive (renewed now and from now on if a resign
        or leave that failed stopped its renewals); None if it holds none any more."""
        lease = self._lease
        if lease is None or not self._ownership.is_held(lease):
            return None
        if self._ownership.is_kept_alive(lease):
            return lease
        loop = asyncio.get_running_loop()
        left = None if deadline is None else max(0.0, deadline - loop.time())
        task = asyncio.current_task()
        assert task is not None
        self._renewing.add(task)
        try:
            renewed = await self._ownership.renew(lease, keep_alive=True, timeout=left)
        except NotHeldError:  # it expired meanwhile
            self._stop_if_called_off()  # (a request would follow: called off before it)
            return None
        finally:
            self._renewing.discard(task)
        self._ownership._check_usable()  # closing meanwhile: ClosedError, as for a request
        if self._lease is not lease:  # resigned or left meanwhile
            self._stop_if_called_off()
            return None
        self._lease = renewed
        return renewed

    async def _give_up(self, not_held: str, timeout: float | None) -> None:
        """Release the lease (resign, leave); NotHeldError ``f"{name} is {not_held}"`` if
        there is none. A release that fails otherwise keeps it: calling again retries."""
        lease, self._lease = self._lease, None
        if lease is None:
            raise NotHeldError(f"{self.name} is {not_held}")
        try:
            await self._ownership.release(lease, timeout=timeout)
        except NotHeldError:
            raise
        except BaseException:
            if self._lease is None:  # not released (or not known to be)
                self._lease = lease
            raise

    async def aclose(self, *, timeout: float = 10.0) -> None:
        """Give up the lease (resign, leave) and disconnect."""
        await self._ownership.aclose(timeout=timeout)

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
