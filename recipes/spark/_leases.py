"""Leases for Spark jobs: one running instance of a streaming query among any number of
drivers (:class:`QueryLeader`), and the live Python workers of executors (:func:`join_membership`).

Both sit on :class:`recipes.SyncLeaderElection` and :class:`recipes.SyncMembership` (public API
only): their leases are decided by the log, renewed by writing, and expire ``ttl`` after the
last renewal of a process that died or froze.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

from pulsar_state import ClosedError, ConfigurationError, PulsarStateError
from recipes import Leader, Lease, NotHeldError, SyncLeaderElection, SyncMembership

from ._specs import cached_resource

if TYPE_CHECKING:  # importing this package must not import PySpark
    from pyspark.sql.streaming.query import StreamingQuery

__all__ = ["QueryLeader", "QueryRunningError", "join_membership"]

logger = logging.getLogger("pulsar_state.spark")


class QueryLeader:
    """Run a streaming query in one driver at a time, however many are started::

        with QueryLeader(URL, "carrier-report-leader", ttl=10, admin_url=ADMIN) as leader:
            query = leader.start(lambda: stream.writeStream.start())  # waits to lead
            query.awaitTermination()

    :meth:`start` campaigns in a leader election on ``topic`` (one topic per query) and calls
    ``start_query`` once this driver leads; the others wait in line. A watcher thread checks
    at once, then every ``ttl / 10`` s, that this driver still leads with ``margin`` seconds
    to spare (default ``ttl / 3``: one renewal missed). If not (renewals failing: the broker
    out of reach, the process frozen), it stops the query, logs an error and sets
    :attr:`lost_leadership`: the query stops before the lease ends if stopping it takes
    less than ``margin - ttl / 10`` (bound it with ``spark.sql.streaming.stopTimeout``), and
    the next driver is granted only when the lease has ended or been given up. A query that
    ends by itself (stopped, failed, finished) hands leadership on; leaving the ``with``
    block stops the query if it still runs.

    A driver frozen past its lease may still act between its resuming and the watcher's
    next check: :class:`~recipes.spark.PulsarMapSink` applies each batch id once whoever
    sends it; fence other writes with :attr:`lease` (:func:`recipes.fenced_transact`). The
    drivers' clocks must agree to well within ``margin`` (README: the clock assumptions).

    Args:
        service_url: the Pulsar service URL.
        topic: the election's topic, one per query.
        name: this driver's name in the election (default host-pid-random).
        ttl: seconds a leader stays leader without renewing (renewed every ``ttl / 3``).
        margin: seconds before its lease ends at which a leader stops its query; more than
            ``ttl / 10`` (the watcher's period) and less than ``ttl``.
        **options: passed to :class:`~recipes.SyncLeaderElection` (``admin_url`` and the
            manager's options).
    """

    def __init__(
        self,
        service_url: str,
        topic: str,
        *,
        name: str | None = None,
        ttl: float = 10.0,
        margin: float | None = None,
        **options: Any,
    ) -> None:
        # Checked before the election exists (it starts a portal thread), ttl first.
        if not (_seconds(ttl) and math.isfinite(ttl) and ttl > 0):
            raise ConfigurationError(f"ttl must be a finite number of seconds > 0, not {ttl!r}")
        ttl = float(ttl)
        if margin is not None and not (_seconds(margin) and ttl / 10 < margin < ttl):
            raise ConfigurationError(
                f"margin must be > ttl / 10 ({ttl / 10:g}s, the watcher's period) and < ttl "
                f"({ttl:g}s), not {margin!r}"
            )
        self.ttl = ttl
        self.margin = ttl / 3 if margin is None else float(margin)
        self.lost_leadership = False
        self._election = SyncLeaderElection(service_url, topic, name=name, ttl=ttl, **options)
        self._query: StreamingQuery | None = None
        self._watcher: threading.Thread | None = None
        self._closing = threading.Event()
        self._lock = threading.RLock()  # start() and close() from different threads

    @property
    def name(self) -> str:
        return self._election.name

    @property
    def lease(self) -> Lease | None:
        """This driver's lease while it leads (its token fences writes), else None."""
        return self._election.lease

    @property
    def query(self) -> StreamingQuery | None:
        """The query :meth:`start` started last, if any."""
        return self._query

    def leader(self) -> Leader | None:
        """The current leader per the local replica (no I/O), or None."""
        return self._election.leader()

    def open(self) -> Self:
        try:
            self._election.open()
        except BaseException:
            with contextlib.suppress(Exception):  # its own portal must not outlive it
                self._election.close()
            raise
        return self

    def start(
        self, start_query: Callable[[], StreamingQuery], *, timeout: float | None = None
    ) -> StreamingQuery:
        """Wait until this driver leads (at most ``timeout`` s, then OperationTimeoutError),
        then return ``start_query()``'s query, watched. If ``start_query`` raises, leadership
        passes to the next driver and the exception propagates. Once the query has ended
        (and leadership was handed on), ``start`` may be called again: it campaigns anew.

        Raises QueryRunningError while the query it started last still runs, ClosedError
        once :meth:`close` was called."""
        self._check_open()
        watcher = self._watcher
        if watcher is not None and watcher.is_alive():
            if self._query is not None and self._query.isActive:
                raise QueryRunningError(f"{self.name} runs its query already")
            watcher.join()  # the query ended: its watcher hands leadership on first
        self._election.campaign(timeout=timeout)
        # Held while the query starts: a close() meanwhile waits, then stops it.
        with self._lock:
            self.lost_leadership = False
            try:
                self._check_open()
                query = start_query()
            except BaseException:
                self._resign()
                raise
            self._query = query
            self._watcher = threading.Thread(
                target=self._watch, args=(query,), name=f"pulsar-state-query-leader-{self.name}"
            )
            self._watcher.daemon = True
            self._watcher.start()
        logger.info("%s leads: query %s started", self.name, query.id)
        return query

    def _check_open(self) -> None:
        if self._closing.is_set():
            raise ClosedError(f"{self!r} is closed")

    def _watch(self, query: StreamingQuery) -> None:
        # Whatever ends the watch (the query's end, lost leadership, close, an error of its
        # own), the query is not left running unwatched with the lease given up.
        try:
            while True:
                if not query.isActive:
                    logger.info("query %s ended: %s hands leadership on", query.id, self.name)
                    return
                if not self._still_leads():
                    self.lost_leadership = True
                    logger.error(
                        "%s no longer leads with %.3gs to spare (renewals failing?): stopping "
                        "query %s before its lease ends",
                        self.name,
                        self.margin,
                        query.id,
                    )
                    query.stop()
                    return
                if self._closing.wait(self.ttl / 10):
                    return  # close() stops the query and closes the election
        except BaseException:
            logger.exception("watching query %s failed: stopping it", query.id)
            _stop_quietly(query)
        finally:
            if not self._closing.is_set():
                self._resign()

    def _still_leads(self) -> bool:
        try:
            return self._election.is_leader(margin=self.margin)
        except (PulsarStateError, TimeoutError, concurrent.futures.CancelledError) as exc:
            # Closed, halted or stuck: it cannot tell, so it does not lead.
            logger.warning("%s cannot tell whether it leads: %s", self.name, exc)
            return False

    def _resign(self) -> None:
        try:
            self._election.resign(timeout=self.margin)
        except NotHeldError:
            pass  # not leading any more (never granted, or expired)
        except (PulsarStateError, TimeoutError, concurrent.futures.CancelledError) as exc:
            logger.warning("%s could not resign (its lease expires instead): %s", self.name, exc)

    def close(self) -> None:
        """Stop the query if it still runs, give leadership up and disconnect. If the query
        cannot be stopped, the error propagates and leadership is kept (renewed) rather
        than handed to another driver while this query may still run."""
        with self._lock:
            self._closing.set()
        query = self._query
        if query is not None and query.isActive:
            query.stop()
        if self._watcher is not None:
            self._watcher.join()
        self._election.close()

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"QueryLeader({self.name!r}, query={self._query and self._query.id})"


class QueryRunningError(PulsarStateError, RuntimeError):
    """:meth:`QueryLeader.start` was called while the query it started still runs."""


def _stop_quietly(query: StreamingQuery) -> None:
    try:
        query.stop()
    except Exception:
        logger.exception("stopping query %s failed", query.id)


def _seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def join_membership(
    service_url: str, topic: str, *, name: str | None = None, ttl: float = 10.0, **options: Any
) -> SyncMembership:
    """This process's membership of the group on ``topic``: opened and joined on the first
    call in the process, then cached (like :func:`~recipes.spark.get_map`) and renewed in the
    background. Each later call in the process returns the same membership, joining again if
    its lease was lost meanwhile (a pause longer than ``ttl``); ``name`` and ``ttl`` are the
    first call's. A process that exits or dies drops out when its lease expires, ``ttl``
    later (PySpark ends its Python workers without running exit handlers).

    Call it in tasks (``foreachPartition``, ``mapPartitions``, a UDF): each Python worker
    that ran one is a live member (so an executor is listed while its workers live), and the
    driver lists them with ``SyncMembership(service_url, topic).members()``. ``name``, if
    given, must differ between processes: members with one name are listed once.
    ``**options`` go to :class:`~recipes.SyncMembership` (``admin_url``, the manager's
    options).
    """

    if "portal" in options:
        raise ConfigurationError(
            "join_membership runs on the process's shared portal (as get_map does): no portal="
        )

    def open_joined(portal: Any) -> SyncMembership:
        group = SyncMembership(service_url, topic, portal=portal, name=name, ttl=ttl, **options)
        try:
            group.open()
            group.join()
        except BaseException:
            with contextlib.suppress(Exception):  # the open or join error is the one to see
                group.close()
            raise
        logger.info("%s joined the group on %s", group.name, topic)
        return group

    group = cached_resource(
        f"membership:{service_url}|{topic}",
        open_joined,
        lambda found: not found.closed and found.async_membership.ownership.manager.halted is None,
    )
    with _rejoining:
        if group.name not in group.members_local():
            logger.warning("%s lost its membership of %s: joining again", group.name, topic)
            group.join()
    return group


# One rejoin at a time per process (join refuses a member that is still in the group).
_rejoining = threading.Lock()


def _new_rejoin_lock() -> None:
    # A forked child (PySpark's workers are) inherits the lock as it was: held, if another
    # thread of the parent was rejoining at the fork, and never released in the child.
    global _rejoining
    _rejoining = threading.Lock()


os.register_at_fork(after_in_child=_new_rejoin_lock)
