"""QueryLeader (one running instance of a streaming query among drivers) and join_membership
(executors' Python workers as live members), on a real broker and local Spark."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from pulsar_state import ConfigurationError, OperationTimeoutError
from recipes import SyncMembership
from recipes.spark import QueryLeader, join_membership
from tests.spark.conftest import SPARK_MARKS, WAIT_S, map_options

pytestmark = SPARK_MARKS

TTL = 3.0


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


def leader_of(service_url: str, admin_url: str, topic: str, name: str) -> QueryLeader:
    return QueryLeader(service_url, topic, name=name, ttl=TTL, admin_url=admin_url, **map_options())


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
    with (
        leader_of(service_url, admin_url, topic, "driver-a") as a,
        leader_of(service_url, admin_url, topic, "driver-b") as b,
    ):
        first = a.start(starter(spark, tmp_path, "a"))
        second: list[StreamingQuery] = []
        started_while_first_ran: list[bool] = []

        def start_b() -> StreamingQuery:
            started_while_first_ran.append(first.isActive)
            return starter(spark, tmp_path, "b")()

        waiting = threading.Thread(target=lambda: second.append(b.start(start_b)))
        waiting.start()
        time.sleep(2 * TTL)  # renewed all along: b keeps waiting in line
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


def test_a_driver_that_stops_leading_stops_its_query(
    spark: SparkSession,
    service_url: str,
    admin_url: str,
    topic: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The lease's view is replaced by "not leading" (as when renewals fail and the lease
    # nears its end): the watcher stops the query and resigns, so the next driver leads.
    with (
        leader_of(service_url, admin_url, topic, "driver-a") as a,
        leader_of(service_url, admin_url, topic, "driver-b") as b,
    ):
        query = a.start(starter(spark, tmp_path, "a"))
        caplog.set_level(logging.ERROR, logger="pulsar_state.spark")
        a._election.is_leader = lambda *, margin=0.0: False  # type: ignore[method-assign]
        wait_until(lambda: not query.isActive, "the query stopped")
        assert a.lost_leadership
        assert "no longer leads" in caplog.text
        replacement = b.start(starter(spark, tmp_path, "b"), timeout=WAIT_S)
        assert replacement.isActive
        assert b.lease is not None
        assert a.lease is None


def test_a_start_that_raises_hands_leadership_on(
    spark: SparkSession, service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    def broken() -> StreamingQuery:
        raise ValueError("no such source")

    with (
        leader_of(service_url, admin_url, topic, "driver-a") as a,
        leader_of(service_url, admin_url, topic, "driver-b") as b,
    ):
        with pytest.raises(ValueError, match="no such source"):
            a.start(broken)
        assert a.lease is None
        assert a.query is None
        assert b.start(starter(spark, tmp_path, "b"), timeout=WAIT_S).isActive


def test_bad_input(service_url: str, admin_url: str, topic: str) -> None:
    for margin in (-1.0, TTL, TTL + 1):
        with pytest.raises(ConfigurationError, match="margin"):
            QueryLeader(service_url, topic, ttl=TTL, margin=margin, admin_url=admin_url)
    with pytest.raises(ConfigurationError, match="ttl"):
        QueryLeader(service_url, topic, ttl=0, admin_url=admin_url)
    with (
        leader_of(service_url, admin_url, topic, "driver-a") as a,
        leader_of(service_url, admin_url, topic, "driver-b") as b,
    ):
        a._election.campaign()  # a leads (without a query): b cannot, and says so in time
        with pytest.raises(OperationTimeoutError):
            b.start(lambda: pytest.fail("b never leads"), timeout=1.0)
        assert b.query is None


def test_a_second_start_is_an_error_while_the_first_query_runs_and_campaigns_after(
    spark: SparkSession, service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    with (
        leader_of(service_url, admin_url, topic, "driver-a") as a,
        leader_of(service_url, admin_url, topic, "driver-b") as b,
    ):
        first = a.start(starter(spark, tmp_path, "a"))
        with pytest.raises(ConfigurationError, match="runs its query already"):
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
