"""The tail of the state topic: where a linearizable read, a writer's catch-up and the open
replay must read up to.

Captured over the binary protocol (:class:`~._pulsar.TailProbe`, one round trip on the
client's own connection and credentials) instead of the admin REST API. Concurrent callers
share fetches: a caller joins the next fetch to *start*, never one already under way, whose
answer may predate a write that completed before the caller asked (that would break
linearizability). So under load each caller waits for at most two round trips, and the broker
sees one request at a time per replica.
"""

from __future__ import annotations

import asyncio
import logging

from ._admin import AdminClient, TopicName
from ._errors import BrokerError, ClosedError
from ._pulsar import LogPosition, PulsarConnection, TailProbe

__all__ = ["Tail"]

logger = logging.getLogger(__name__)


class Tail:
    """The last message position of one topic, asked of the broker, fetches shared."""

    def __init__(self, topic: TopicName, admin: AdminClient | None) -> None:
        self._topic = topic
        self._admin = admin
        self._probe: TailProbe | None = None
        self._running: asyncio.Future[LogPosition | None] | None = None
        self._queued: asyncio.Future[LogPosition | None] | None = None
        self.fetches = 0  # round trips made, for tests and stats

    async def attach(self, conn: PulsarConnection, *, name: str) -> None:
        """Open the probe (idempotent: a probe already open is kept)."""
        if self._probe is None:
            self._probe = await conn.create_tail_probe(str(self._topic), name=name)

    async def position(self) -> LogPosition | None:
        """The position of the topic's last message as of some moment after this call began
        (None: the topic holds none)."""
        fetch: asyncio.Future[LogPosition | None]
        if self._running is None:
            fetch = self._running = asyncio.ensure_future(self._fetch())
        else:
            if self._queued is None:
                self._queued = asyncio.ensure_future(self._fetch_after(self._running))
            fetch = self._queued
        fetch.add_done_callback(self._finished)
        # Shielded: one caller's cancellation (its own deadline) must not fail the others.
        return await asyncio.shield(fetch)

    def _finished(self, fetch: asyncio.Future[LogPosition | None]) -> None:
        if self._running is fetch:
            self._running = None
        if not fetch.cancelled():
            fetch.exception()  # retrieved here: every caller may have given up on it

    async def _fetch_after(self, running: asyncio.Future[LogPosition | None]) -> LogPosition | None:
        await asyncio.wait({running})  # its outcome belongs to its own callers
        self._queued = None
        self._running = asyncio.current_task()
        return await self._fetch()

    async def _fetch(self) -> LogPosition | None:
        if self._probe is None:
            raise ClosedError(f"the tail probe of {self._topic} is not open")
        self.fetches += 1
        position = await self._probe.last_id()
        if position is None or position.entry >= 0:
            return position
        # The broker's current ledger is empty: the last message (if any) is the last entry of
        # an earlier ledger, which only the admin API's ledger list tells.
        if self._admin is None:
            raise BrokerError(
                f"the tail of {self._topic} is in a ledger before {position.ledger}, which only "
                "the admin REST API can tell: pass admin_url= (this passes after the next write)",
                result="tail unknown",
            )
        return await self._admin.last_position(self._topic)

    async def position_in_current_ledger(self) -> LogPosition | None:
        """The last message's position if it is in the broker's current ledger, else None (an
        empty topic, or a ledger just opened): one probe round trip, no admin request, not
        shared with :meth:`position`'s callers. For a background look, not for a read that
        must see every write completed before it."""
        if self._probe is None:
            raise ClosedError(f"the tail probe of {self._topic} is not open")
        position = await self._probe.last_id()
        return position if position is not None and position.entry >= 0 else None

    async def trim_through(self, position: LogPosition) -> None:
        """Let the broker delete the topic's ledgers wholly at or before ``position``."""
        if self._probe is None:
            raise ClosedError(f"the tail probe of {self._topic} is not open")
        await self._probe.hold_after(position)

    async def close(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            await probe.close()
