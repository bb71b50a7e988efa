"""Membership: a group of live members with leases, and join/leave events in log order.

:Status: Experimental. Built on :class:`~recipes.Ownership` (public API only).

A member joins by taking the resource ``"members"`` in read mode (readers share it), with a
lease renewed by writing every ``ttl / 3`` seconds. It leaves by releasing it, or by dying:
its lease expires about ``ttl`` after its last renewal (any open replica appends the expiry).
Every replica agrees on the members at each position of the log, and :meth:`events` streams
the same joins and leaves, in the same order, to every observer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from pulsar_state import ConfigurationError

from ._lease_table import Lease, LeaseEvent, LeaseTable
from ._streams import EventStream, feed
from .ownership import OneLeaseRecipe

__all__ = ["MemberEvent", "Membership"]

RESOURCE = "members"


@dataclass(frozen=True, slots=True)
class MemberEvent:
    """A member joined or left. ``reason``: "joined", "left" (released) or "expired" (died).
    ``initial`` marks the members already present when the stream was opened."""

    kind: Literal["join", "leave"]
    member: str
    position: int
    reason: Literal["joined", "left", "expired"]
    initial: bool = False


def _members_of(table: LeaseTable) -> list[str]:
    return sorted({lease.owner for lease in table.holding(RESOURCE)})


class Membership(OneLeaseRecipe):
    """A group of live processes sharing ``topic``::

    async with Membership("pulsar://127.0.0.1:6650", "workers", name="w1", ttl=5) as group:
        await group.join()
        print(group.members_local())
        async with group.events() as events:
            async for event in events:
                print(event.kind, event.member)

    Args:
        pulsar: a service URL or a ``pulsar.asyncio.Client``.
        topic: the group's topic (one per group).
        name: this member's name (default host-pid-random).
        ttl: seconds a member stays without renewing (renewed every ``ttl / 3``).
        **manager_options: passed to :class:`~pulsar_state.SharedStateManager`.
    """

    async def join(self, *, timeout: float | None = None) -> Lease:
        """Join the group (kept alive until :meth:`leave` or close); returns the lease.

        ConfigurationError if this Membership has already joined and is still a member (after
        a :meth:`leave` that failed, it is still a member: ``join`` then renews the lease from
        now on and returns it).
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        async with self._alone(deadline):
            if self._lease is not None and self._ownership.is_held(self._lease):
                if self._ownership.is_kept_alive(self._lease):
                    raise ConfigurationError(f"{self.name} has already joined")
                # A leave that failed stopped its renewals: still a member, kept from now on.
                kept = await self._kept(deadline)
                if kept is not None:
                    return kept
            left = None if deadline is None else max(0.0, deadline - loop.time())
            self._lease = await self._ownership.acquire(
                RESOURCE, mode="read", ttl=self.ttl, timeout=left
            )
            return self._lease

    async def leave(self, *, timeout: float | None = None) -> None:
        """Leave the group. NotHeldError if not a member (never joined, left, or expired)."""
        await self._give_up("not a member", timeout)

    def members_local(self) -> list[str]:
        """The members per the local replica (no I/O), sorted."""
        members: list[str] = self._ownership.read_local(_members_of)
        return members

    async def members(self, *, latest: bool = True, timeout: float | None = None) -> list[str]:
        """The members, after catching up with the tail (``latest=True``; OperationTimeoutError
        after ``timeout`` s, by default the manager's ``read_timeout_s``), sorted."""
        if latest:
            await self._ownership.manager.sync(timeout=timeout)
        return self.members_local()

    def events(self, *, snapshot: bool = True, max_queue: int = 10_000) -> EventStream[MemberEvent]:
        """The current members as ``join`` events (``initial=True``, unless
        ``snapshot=False``), then every join and leave in log order."""
        table: LeaseTable = self._ownership.read_local(lambda s: s)
        initial = (
            [MemberEvent("join", m, table.position, "joined", True) for m in _members_of(table)]
            if snapshot
            else []
        )
        stream: EventStream[MemberEvent] = EventStream(
            initial, max_queue=max_queue, position=table.position
        )
        # The members as the stream has told them: a member is a name, which may hold more
        # than one lease (a rejoin before its lost lease was reaped, or two processes given
        # one name), so only its first lease joins it and only its last one leaves.
        told = set(_members_of(table))

        def on_change(
            stream: EventStream[MemberEvent], events: list[LeaseEvent], table: LeaseTable
        ) -> None:
            changes: list[MemberEvent] = []
            members: set[str] | None = None  # after this record, computed once if needed
            for event in events:
                lease = event.lease
                if RESOURCE not in lease.names or lease.mode != "read":
                    continue
                if event.kind == "granted" and lease.owner not in told:
                    told.add(lease.owner)
                    changes.append(MemberEvent("join", lease.owner, event.position, "joined"))
                elif event.kind in ("released", "expired") and lease.held:
                    if members is None:
                        members = set(_members_of(table))
                    if lease.owner in members or lease.owner not in told:
                        continue  # still a member by another lease
                    told.discard(lease.owner)
                    reason: Literal["left", "expired"] = (
                        "left" if event.kind == "released" else "expired"
                    )
                    changes.append(MemberEvent("leave", lease.owner, event.position, reason))
            stream.push(changes, table.position)

        feed(stream, self._ownership.subscribe, self._ownership.on_close, on_change)
        return stream
