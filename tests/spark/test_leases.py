"""QueryLeader (one running instance of a streaming query among drivers) and join_membership
(executors' Python workers as live members), on a real broker and local Spark."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from pulsar_state import ClosedError, ConfigurationError, OperationTimeoutError
from recipes import SyncMembership
from recipes.spark import QueryLeader, QueryRunningError, close_maps, join_membership
from tests.spark.conftest import SPARK_MARKS, WAIT_S, map_options
from tests.spark.forking import in_forked_child

pytestmark = SPARK_MARKS

# Renewed every TTL / 3: a leader keeps MARGIN to spare unless renewals stall for 10 s. A
# broker just started stalls writes for seconds (a renewal timed out at 2 s with a 3 s TTL).
TTL = 20.0
MARGIN = 3.0


def starter(spark: SparkSession, checkpoints: Path, label: str) -> Callable[[], StreamingQuery]:
    """A streaming query of the rate source into the no-op sink, with its own checkpoint."""

    def start() -> StreamingQuery:
        return (
            spark.readStream.format("rate")
            .option("rowsPerSecond", 1)
            .load()
            .writeStream.format("noop")
            .option("checkpointLocation", str(checkpoints / label))
            .start()
        )

    return start


def leader_of(
    service_url: str,
    admin_url: str,
    topic: str,
    name: str,
    *,
    ttl: float = TTL,
    margin: float = MARGIN,
) -> QueryLeader:
    return QueryLeader(
        service_url, topic, name=name, ttl=ttl, margin=margin, admin_url=admin_url, **map_options()
    )


@contextlib.contextmanager
def two_drivers(
    service_url: str,
    admin_url: str,
    topic: str,
    *,
    a: dict[str, float] | None = None,
    b: dict[str, float] | None = None,
) -> Iterator[tuple[QueryLeader, QueryLeader]]:
    """Two drivers' QueryLeaders on one election topic, "driver-a" and "driver-b"."""
    with (
        leader_of(service_url, admin_url, topic, "driver-a", **(a or {})) as first,
        leader_of(service_url, admin_url, topic, "driver-b", **(b or {})) as second,
    ):
        yield first, second


def leader_name(leader: QueryLeader) -> str | None:
    current = leader.leader()
    return None if current is None else current.name


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_second_driver_starts_its_query_only_once_the_first_query_ends(
    spark: SparkSession, service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    with two_drivers(service_url, admin_url, topic) as (a, b):
        first = a.start(starter(spark, tmp_path, "a"))
        second: list[StreamingQuery] = []
        started_while_first_ran: list[bool] = []

        def start_b() -> StreamingQuery:
            started_while_first_ran.append(first.isActive)
            return starter(spark, tmp_path, "b")()

        waiting = threading.Thread(target=lambda: second.append(b.start(start_b)))
        waiting.start()
        time.sleep(3.0)  # b waits in line while the first query runs
        assert not second
        assert first.isActive
        assert leader_name(a) == "driver-a"
        first.stop()  # the first query ends: its driver hands leadership on
        waiting.join(WAIT_S)
        assert second
        assert second[0].isActive
        assert started_while_first_ran == [False]
        assert leader_name(b) == "driver-b"
        assert not a.lost_leadership
    assert not second[0].isActive  # leaving the block stopped it


def test_a_driver_whose_renewals_stop_stops_its_query_before_its_lease_ends(
    spark: SparkSession,
    service_url: str,
    admin_url: str,
    topic: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The lease is no longer renewed (as when every renewal fails): the watcher stops the
    # query while the lease still has time left, then resigns, so the next driver starts its
    # query with the first one already stopped.
    with two_drivers(service_url, admin_url, topic, a={"ttl": 8.0, "margin": 3.0}) as (a, b):
        first = a.start(starter(spark, tmp_path, "a"))
        caplog.set_level(logging.ERROR, logger="pulsar_state.spark")
        ownership = a._election.async_election.ownership
        lease = a.lease
        assert lease is not None
        a._election.portal.call_sync(lambda: ownership._stop_keeping(lease.id))
        expires_at = ownership.read_local(lambda table: table.leases[lease.id].expires_at)
        seen: list[bool] = []

        def start_b() -> StreamingQuery:
            seen.append(first.isActive)
            return starter(spark, tmp_path, "b")()

        second = threading.Thread(target=lambda: b.start(start_b))
        second.start()
        wait_until(lambda: not first.isActive, "the query stopped")
        assert time.time() < expires_at  # before the lease ended
        assert a.lost_leadership
        assert "no longer leads" in caplog.text
        second.join(WAIT_S)
        assert seen == [False]
        assert b.query is not None
        assert b.query.isActive
        wait_until(lambda: a.lease is None, "the first driver resigned")  # after the stop


def test_a_start_that_raises_hands_leadership_on(
    spark: SparkSession, service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    def broken() -> StreamingQuery:
        raise ValueError("no such source")

    with two_drivers(service_url, admin_url, topic) as (a, b):
        with pytest.raises(ValueError, match="no such source"):
            a.start(broken)
        assert a.lease is None
        assert a.query is None
        assert b.start(starter(spark, tmp_path, "b"), timeout=WAIT_S).isActive


def test_bad_input(service_url: str, admin_url: str, topic: str) -> None:
    threads = threading.active_count()
    for margin in (-1.0, 0.0, TTL / 10, TTL, TTL + 1, "1", True):
        with pytest.raises(ConfigurationError, match="margin"):
            QueryLeader(service_url, topic, ttl=TTL, margin=margin, admin_url=admin_url)  # type: ignore[arg-type]
    for ttl in (0, -1.0, float("inf"), "10"):
        with pytest.raises(ConfigurationError, match="ttl"):
            QueryLeader(service_url, topic, ttl=ttl, margin=1.0, admin_url=admin_url)  # type: ignore[arg-type]
    assert threading.active_count() == threads  # refused before any portal thread started
    with two_drivers(service_url, admin_url, topic) as (a, b):
        a._election.campaign()  # a leads (without a query): b cannot, and says so in time
        with pytest.raises(OperationTimeoutError):
            b.start(lambda: pytest.fail("b never leads"), timeout=1.0)
        assert b.query is None


def test_a_second_start_is_an_error_while_the_first_query_runs_and_campaigns_after(
    spark: SparkSession, service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    with two_drivers(service_url, admin_url, topic) as (a, b):
        first = a.start(starter(spark, tmp_path, "a"))
        with pytest.raises(QueryRunningError, match="runs its query already"):
            a.start(starter(spark, tmp_path, "again"))
        assert first.isActive
        # Ended (a restart loop's case): b, in line, leads first; a runs again after it.
        second = threading.Thread(target=lambda: b.start(starter(spark, tmp_path, "b")))
        second.start()
        first.stop()
        second.join(WAIT_S)
        assert leader_name(b) == "driver-b"
        assert b.query is not None
        b.query.stop()
        again = a.start(starter(spark, tmp_path, "a"), timeout=WAIT_S)
        assert again.isActive
        assert again.id == first.id  # the same checkpoint: the same query, resumed
        assert leader_name(a) == "driver-a"


def test_executors_python_workers_join_the_group_once_each(
    spark: SparkSession, service_url: str, admin_url: str, topic: str
) -> None:
    options = {"admin_url": admin_url, "ttl": 30.0, **map_options()}

    def join(_rows: object) -> None:
        join_membership(service_url, topic, **options)

    for _ in range(3):  # tasks run again in the same workers: no new members
        spark.sparkContext.parallelize(range(8), 4).foreachPartition(join)
    with SyncMembership(service_url, topic, admin_url=admin_url, **map_options()) as group:
        members = group.members()
    # local[2]: at most two Python workers at once (PySpark may have replaced one since).
    assert 1 <= len(members) <= 4
    assert all(f"-{os.getpid()}-" not in name for name in members)  # not the driver


def test_a_driver_frozen_past_its_lease_stops_its_query_when_it_resumes(
    spark: SparkSession, service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    # The driver's event loop (its renewals, its view of the lease) is held up for twice the
    # TTL, as by a long pause: the lease expires, the other driver is granted and starts its
    # query; the frozen one, on resuming, sees its lease past due and stops its own.
    short = {"ttl": 6.0, "margin": 1.0}
    with two_drivers(service_url, admin_url, topic, a=short, b=short) as (a, b):
        first = a.start(starter(spark, tmp_path, "a"))
        second = threading.Thread(target=lambda: b.start(starter(spark, tmp_path, "b")))
        second.start()
        freeze = threading.Thread(
            target=lambda: a._election.portal.call_sync(lambda: time.sleep(12.0))
        )
        freeze.start()
        second.join(WAIT_S)
        assert b.query is not None
        assert b.query.isActive
        assert leader_name(b) == "driver-b"
        freeze.join()
        # Nothing else stops it: its watcher does, at its first check after resuming.
        wait_until(lambda: not first.isActive, "the frozen driver's query stopped")
        assert a.lost_leadership
        wait_until(lambda: a.lease is None, "the frozen driver resigned")  # after the stop


def test_join_membership_once_per_process_and_again_after_a_lost_lease(
    service_url: str, admin_url: str, topic: str
) -> None:
    options = {"admin_url": admin_url, "ttl": 30.0, **map_options()}
    groups: list[SyncMembership] = []
    racing = [
        threading.Thread(
            target=lambda: groups.append(join_membership(service_url, topic, **options))
        )
        for _ in range(4)
    ]
    for thread in racing:
        thread.start()
    for thread in racing:
        thread.join(WAIT_S)
    assert len(groups) == 4
    group = groups[0]
    assert all(g is group for g in groups)
    assert group.members() == [group.name]
    group.leave()  # as if its lease had expired during a pause
    assert group.members() == []
    assert join_membership(service_url, topic, **options) is group
    assert group.members() == [group.name]


def test_join_membership_bad_input(service_url: str, admin_url: str, topic: str) -> None:
    with pytest.raises(ConfigurationError, match="no portal="):
        join_membership(service_url, topic, admin_url=admin_url, portal=object())
    with pytest.raises(ConfigurationError, match="ttl"):
        join_membership(service_url, topic, admin_url=admin_url, ttl=0)
    # Nothing was cached by the refused calls: a good one joins.
    group = join_membership(service_url, topic, admin_url=admin_url, ttl=30.0, **map_options())
    assert group.members() == [group.name]


def test_a_forked_child_joins_as_itself_and_the_parent_stays_a_member(
    service_url: str, admin_url: str, topic: str
) -> None:
    # PySpark's daemon forks Python workers from a process that may have joined already: the
    # child must join as a member of its own (the parent's client cannot cross a fork), and
    # neither its joining nor its closing at exit may touch the parent's membership.
    ttl = 5.0
    options = {"admin_url": admin_url, "ttl": ttl, **map_options()}
    parent = join_membership(service_url, topic, **options)

    def child() -> dict[str, object]:
        report: dict[str, object] = {}
        try:
            parent.members()
        except ClosedError as exc:
            report["inherited"] = str(exc)
        joined = join_membership(service_url, topic, **options)
        report["name"] = joined.name
        report["members"] = joined.members()
        close_maps()  # what the interpreter's exit runs (atexit)
        return report

    _, report = in_forked_child(child)
    assert "fork" in str(report.get("inherited")), report
    assert report["name"] != parent.name
    assert report["members"] == sorted([parent.name, report["name"]])
    # The child left as it closed; the parent, renewing all along, outlives its own TTL.
    assert parent.members() == [parent.name]
    time.sleep(ttl * 1.2)
    assert parent.members() == [parent.name]
    assert join_membership(service_url, topic, **options) is parent


def test_a_child_forked_while_a_rejoin_is_under_way_can_rejoin() -> None:
    # The rejoin lock held by another thread at the fork: before, the child inherited it
    # held, and its first join_membership blocked for ever.
    from recipes.spark import _leases

    def child() -> dict[str, bool]:
        acquired = _leases._rejoining.acquire(timeout=5)
        return {"acquired": acquired}

    held, done = threading.Event(), threading.Event()

    def rejoining() -> None:
        with _leases._rejoining:
            held.set()
            done.wait(WAIT_S)

    thread = threading.Thread(target=rejoining)
    thread.start()
    try:
        assert held.wait(WAIT_S)
        _pid, report = in_forked_child(child)
    finally:
        done.set()
        thread.join()
    assert report == {"acquired": True}
