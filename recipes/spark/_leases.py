"""Leases for Spark jobs: one running instance of a streaming query among any number of
drivers (:class:`QueryLeader`), and the live Python workers of executors (:func:`join_membership`).

Both sit on :class:`recipes.SyncLeaderElection` and :class:`recipes.SyncMembership` (public API
only): their leases are decided by the log, renewed by writing, and expire ``ttl`` after the
last renewal of a process that died or froze.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

from pulsar_state import ConfigurationError, PulsarStateError
from recipes import Leader, Lease, SyncLeaderElection, SyncMembership

from ._specs import cached_resource

if TYPE_CHECKING:  # importing this package must not import PySpark
    from pyspark.sql.streaming.query import StreamingQuery

__all__ = ["QueryLeader", "join_membership"]

logger = logging.getLogger("pulsar_state.spark")


class QueryLeader:
    """Run a streaming query in one driver at a time, however many are started::

        with QueryLeader(URL, "carrier-report-leader", ttl=10, admin_url=ADMIN) as leader:
            query = leader.start(lambda: stream.writeStream.start())  # waits to lead
            query.awaitTermination()

    :meth:`start` campaigns in a leader election on ``topic`` (one topic per query) and calls
    ``start_query`` once this driver leads; the others wait in line. While the query runs, a
    watcher thread checks every ``ttl / 10`` s that this driver still leads with ``margin``
    seconds to spare (default ``ttl / 3``: one renewal missed). If not (renewals failing: the
    broker out of reach, the process frozen), it stops the query, logs an error and sets
    :attr:`lost_leadership`, so that the query ends before the lease does and before the next
    driver in line is granted. A query that ends by itself (stopped, failed, finished) hands
    leadership to the next driver; leaving the ``with`` block stops the query if it still runs.

    What a frozen driver's micro-batch does between its resuming and the watcher's check is
    not covered by the lease: :class:`~recipes.spark.PulsarMapSink` applies each batch id
    once whoever sends it; fence other writes with :attr:`lease`
    (:func:`recipes.fenced_transact`). The clocks of the drivers must agree to well within
    ``margin`` (README: the clock assumptions).

    Args:
        service_url: the Pulsar service URL.
        topic: the election's topic, one per query.
        name: this driver's name in the election (default host-pid-random).
        ttl: seconds a leader stays leader without renewing (renewed every ``ttl / 3``).
        margin: seconds before its lease ends at which a leader stops its query.
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
        # Checked before the election exists (it starts a portal thread); it checks ttl.
        if margin is not None and not (_seconds(margin) and _seconds(ttl) and 0 <= margin < ttl):
            raise ConfigurationError(f"margin must be >= 0 and < ttl ({ttl!r}s), not {margin!r}")
        self._election = SyncLeaderElection(service_url, topic, name=name, ttl=ttl, **options)
        self.ttl = self._election.async_election.ttl
        self.margin = self.ttl / 3 if margin is None else float(margin)
        self.lost_leadership = False
        self._query: StreamingQuery | None = None
        self._watcher: threading.Thread | None = None
        self._closing = threading.Event()

    @property
    def name(self) -> str:
        return self._election.name

    @property
    def lease(self) -> Lease | None:
        """This driver's lease while it leads (its token fences writes), else None."""
        return self._election.lease

    @property
    def query(self) -> StreamingQuery | None:
        """The query :meth:`start` started, if any."""
        return self._query

    def leader(self) -> Leader | None:
        """The current leader per the local replica (no I/O), or None."""
        return self._election.leader()

    def open(self) -> Self:
        self._election.open()
        return self

    def start(
        self, start_query: Callable[[], StreamingQuery], *, timeout: float | None = None
    ) -> StreamingQuery:
        """Wait until this driver leads (at most ``timeout`` s, then OperationTimeoutError),
        then return ``start_query()``'s query, watched. If ``start_query`` raises, leadership
        passes to the next driver and the exception propagates. Once the query has ended
        (and leadership was handed on), ``start`` may be called again: it campaigns anew."""
        if self._watcher is not None and self._watcher.is_alive():
            if self._query is not None and self._query.isActive:
                raise ConfigurationError(f"{self.name} runs its query already")
            self._watcher.join()  # the query ended: its watcher hands leadership on first
        self._election.campaign(timeout=timeout)
        self.lost_leadership = False
        try:
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

    def _watch(self, query: StreamingQuery) -> None:
        while not self._closing.wait(self.ttl / 10):
            if not query.isActive:
                logger.info("query %s ended: %s hands leadership on", query.id, self.name)
                self._resign()
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
                self._resign()
                return

    def _still_leads(self) -> bool:
        try:
            return self._election.is_leader(margin=self.margin)
        except PulsarStateError as exc:  # closed or halted: it cannot tell, so it does not lead
            logger.warning("%s cannot tell whether it leads: %s", self.name, exc)
            return False

    def _resign(self) -> None:
        try:
            self._election.resign()
        except PulsarStateError as exc:  # not leading any more, or unreachable: it expires
            logger.debug("%s resigning: %s", self.name, exc)

    def close(self) -> None:
        """Stop the query if it still runs, give leadership up and disconnect."""
        self._closing.set()
        try:
            if self._query is not None and self._query.isActive:
                self._query.stop()
            if self._watcher is not None:
                self._watcher.join()
        finally:
            self._election.close()

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"QueryLeader({self.name!r}, query={self._query and self._query.id})"


def _seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def join_membership(
    service_url: str, topic: str, *, name: str | None = None, ttl: float = 10.0, **options: Any
) -> SyncMembership:
    """This process's membership of the group on ``topic``: opened and joined on the first
    call in the process, then cached (like :func:`~recipes.spark.get_map`) and renewed in the
    background until the process exits (it leaves then) or dies (its lease expires ``ttl``
    later). Later calls in the process return the same membership, whatever their ``name``
    or ``ttl``.

    Call it in tasks (``foreachPartition``, ``mapPartitions``, a UDF): each executor's Python
    worker that ran one is a live member, and the driver lists them with
    ``SyncMembership(service_url, topic).members()``. ``**options`` go to
    :class:`~recipes.SyncMembership` (``admin_url``, the manager's options).
    """

    def open_joined(portal: Any) -> SyncMembership:
        group = SyncMembership(service_url, topic, portal=portal, name=name, ttl=ttl, **options)
        group.open()
        try:
            group.join()
        except BaseException:
            group.close()
            raise
        logger.info("%s joined the group on %s", group.name, topic)
        return group

    return cached_resource(f"membership:{service_url}|{topic}", open_joined)
