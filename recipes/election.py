"""LeaderElection: one leader at a time, chosen through an Ownership table on one topic.

:Status: Experimental. Built on :class:`~recipes.Ownership` (public API only).

Candidates ``campaign()``: each takes the resource ``"leader"`` in write mode, so one holds it
and the others wait in FIFO order. The leader's lease is renewed by writing every ``ttl / 3``
seconds; if the leader dies or freezes, its lease expires about ``ttl`` after its last renewal
(any open replica appends the expiry) and the next candidate is granted in the same record.
Every leader has a fencing token (its lease's), larger than every earlier leader's: pass
``election.lease`` to :func:`~recipes.fenced_transact` so a deposed leader cannot write.

``leaders()`` streams the current leader, then every change, in log order: every observer
sees the same sequence of leaders.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pulsar_state import OperationTimeoutError, PulsarStateError

from ._lease_table import Lease, LeaseEvent, LeaseTable, NotHeldError
from ._streams import EventStream, feed
from .ownership import OneLeaseRecipe

__all__ = ["Leader", "LeaderElection"]

RESOURCE = "leader"

logger = logging.getLogger(__name__)

# Between campaigns after a candidacy expired while it waited: doubling, up to the maximum.
_RETRY_PAUSE_S = 0.05
_RETRY_PAUSE_MAX_S = 1.0
# The least time a campaign again must have left after its pause.
_RETRY_ROOM_S = 0.1


@dataclass(frozen=True, slots=True)
class Leader:
    """A term of leadership: who, its fencing token, and where in the log it began."""

    name: str
    token: int
    position: int


def _leader_of(table: LeaseTable) -> Leader | None:
    holding = table.holding(RESOURCE)
    if not holding:
        return None
    lease = holding[0]
    return Leader(lease.owner, lease.token, lease.position)


class LeaderElection(OneLeaseRecipe):
    """Elect one leader among processes sharing ``topic``::

    async with LeaderElection("pulsar://127.0.0.1:6650", "my-job-leader", ttl=5) as election:
        await election.campaign()        # returns once this process leads
        ...                              # lead; fence writes with election.lease

    Args:
        pulsar: a service URL or a ``pulsar.asyncio.Client``.
        topic: the election's topic (one per election).
        name: this candidate's name (default host-pid-random).
        ttl: seconds a leader stays leader without renewing (renewed every ``ttl / 3``).
        **manager_options: passed to :class:`~pulsar_state.SharedStateManager`.
    """

    async def campaign(self, *, timeout: float | None = None) -> Leader:
        """Wait until this candidate leads (at most ``timeout`` s, then OperationTimeoutError
        and the candidacy is withdrawn; a candidacy that expired while it waited, as in a stall
        longer than the TTL, is put again after a pause of 50 ms to 1 s, unless too little of
        the timeout is left); returns its term (the current one if it already
        leads, renewed from now on if a :meth:`resign` that failed stopped its renewals).
        Leadership is kept alive until :meth:`resign` or close."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        async with self._alone(deadline):
            return await self._campaign(loop, deadline)

    async def _campaign(self, loop: asyncio.AbstractEventLoop, deadline: float | None) -> Leader:
        held = await self._kept(deadline)
        if held is not None:
            return Leader(held.owner, held.token, held.position)
        pause, expiries = _RETRY_PAUSE_S, 0
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                lease = await self._ownership.acquire(
                    RESOURCE, mode="write", ttl=self.ttl, timeout=left
                )
                break
            except NotHeldError:
                # Released by this table's close: not an expiry, nothing to campaign for.
                self._ownership._check_usable()
                # The waiting request expired: this process (or everyone: a stall in which
                # nobody could write) did not renew it within its TTL. Still a candidate,
                # after a pause (a TTL too short for this log expires every request at once:
                # no loop of writes), if time is left for more than a request and its withdraw.
                if deadline is not None and loop.time() + pause + _RETRY_ROOM_S >= deadline:
                    raise OperationTimeoutError(
                        f"{self.name}: the candidacy expired while it waited, too close to the "
                        "timeout to campaign again"
                    ) from None
                expiries += 1
                logger.log(
                    logging.WARNING if expiries == 1 or expiries % 10 == 0 else logging.DEBUG,
                    "the candidacy of %s expired while it waited (%d times); campaigning "
                    "again in %.2fs",
                    self.name,
                    expiries,
                    pause,
                )
                await asyncio.sleep(pause)
                pause = min(pause * 2, _RETRY_PAUSE_MAX_S)
        self._lease = lease
        return Leader(lease.owner, lease.token, lease.position)

    async def resign(self, *, timeout: float | None = None) -> None:
        """Stop leading; the next candidate takes over. NotHeldError if not leading."""
        await self._give_up("not leading", timeout)

    @property
    def lease(self) -> Lease | None:
        """This candidate's lease while it leads (its token fences writes), else None: once
        the local replica or this clock says the lease ended (expired, released, or this
        election closed or halted), not the lease it won last. Its ``expires_at`` is the
        grant's: renewals move the table's, which ``is_leader(margin=...)`` reads."""
        try:
            return self._lease if self.is_leader() else None
        except PulsarStateError:  # closed or halted: it leads no more, as far as it knows
            return None

    def is_leader(self, *, margin: float = 0.0) -> bool:
        """Whether this candidate leads, per the local replica and this clock (``margin`` s
        before its lease ends, it says no): a hint; fence the writes that matter."""
        return self._lease is not None and self._ownership.is_held(self._lease, margin=margin)

    def leader(self) -> Leader | None:
        """The leader per the local replica (no I/O), or None."""
        leader: Leader | None = self._ownership.read_local(_leader_of)
        return leader

    async def current_leader(
        self, *, latest: bool = True, timeout: float | None = None
    ) -> Leader | None:
        """The leader, after catching up with the tail (``latest=True``; OperationTimeoutError
        after ``timeout`` s, by default the manager's ``read_timeout_s``)."""
        if latest:
            await self._ownership.manager.sync(timeout=timeout)
        return self.leader()

    def leaders(self, *, max_queue: int = 1000) -> EventStream[Leader | None]:
        """The current leader (None: no leader), then every change of leader in log order::

        async for leader in election.leaders():
            print("leader:", leader and leader.name)
        """
        table: LeaseTable = self._ownership.read_local(lambda s: s)
        current = _leader_of(table)
        stream: EventStream[Leader | None] = EventStream(
            [current], max_queue=max_queue, position=table.position
        )
        last = [current]

        def on_change(
            stream: EventStream[Leader | None], events: list[LeaseEvent], table: LeaseTable
        ) -> None:
            if not any(RESOURCE in event.lease.names for event in events):
                return
            now = _leader_of(table)
            if now != last[0]:
                last[0] = now
                stream.push([now], table.position)

        feed(stream, self._ownership.subscribe, self._ownership.on_close, on_change)
        return stream
