"""The replay that opening waits for: up to the tail captured at open, with progress reports."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from ._admin import AdminClient, TopicName
from ._envelope import SnapshotManifest
from ._errors import PulsarStateError
from ._pulsar import LogPosition
from ._replica import Replica
from ._tail import Tail
from ._types import ManagerStats, ReplayProgress

__all__ = ["replay_to_tail"]

logger = logging.getLogger(__name__)

# How often a long replay reports its progress.
_REPORT_EVERY_S = 2.0


async def replay_to_tail(
    replica: Replica[Any, Any],
    tail_of_log: Tail,
    admin: AdminClient | None,
    topic: TopicName,
    stats: ManagerStats,
    *,
    snapshot: SnapshotManifest | None,
    on_progress: Callable[[ReplayProgress], None] | None,
) -> None:
    """Wait until the pump has read the log up to its tail as of now.

    ``snapshot`` is the one the replica started from, if any: only the records past it are
    replayed and counted.
    """

    def report(
        started: float, records_total: int | None, bytes_total: int | None, *, done: bool
    ) -> None:
        progress = ReplayProgress(
            records_read=stats.records_read,
            bytes_read=stats.bytes_read,
            records_total=records_total,
            bytes_total=bytes_total,
            elapsed_s=time.monotonic() - started,
            done=done,
            snapshot_position=snapshot.position if snapshot else None,
            snapshot_bytes=snapshot.size if snapshot else 0,
        )
        if done:
            stats.replay_progress = 1.0
        elif records_total:
            stats.replay_progress = min(1.0, progress.records_read / records_total)
        if not done:
            logger.info(
                "replaying %s: %d/%s records, %.1f/%s MB, %.0fs",
                topic,
                progress.records_read,
                records_total if records_total is not None else "?",
                progress.bytes_read / 1e6,
                f"{bytes_total / 1e6:.1f}" if bytes_total is not None else "?",
                progress.elapsed_s,
            )
        if on_progress is not None:
            try:
                on_progress(progress)
            except Exception:
                logger.exception("on_progress callback raised")

    tail = await tail_of_log.position()
    if tail is None or replica.reached(tail):
        # The pump got there first (or there is nothing): the work was what it read.
        report(time.monotonic(), stats.records_read, stats.bytes_read, done=True)
        return
    records_total: int | None
    bytes_total: int | None
    records_total = bytes_total = None
    if admin is not None:  # totals for progress reports only
        with contextlib.suppress(PulsarStateError):
            # The snapshot's own position, not the read position: the pump is already moving.
            after = LogPosition(snapshot.log_ledger, snapshot.log_entry) if snapshot else None
            records_total, bytes_total = await admin.backlog(topic, after=after)
    started = time.monotonic()
    # Watched: a reader opened while the topic unloads can stay attached to the closed topic
    # and deliver nothing, and the open would wait for it to its deadline.
    waiter = asyncio.ensure_future(replica.wait_log_watched(tail))
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=_REPORT_EVERY_S)
            if done:
                waiter.result()
                break
            report(started, records_total, bytes_total, done=False)
    finally:
        if not waiter.done():
            waiter.cancel()
            await asyncio.wait({waiter})
        if not waiter.cancelled():
            waiter.exception()  # (retrieved: a halt racing the open's deadline)
    report(started, records_total, bytes_total, done=True)
