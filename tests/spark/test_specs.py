"""Specs pickle; executors and forked children open their own maps; the cache's lifecycle."""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import SparkSession

from pulsar_state import (
    AvroCodec,
    ClosedError,
    ConfigurationError,
    PulsarStateError,
    ReplicaHaltedError,
    StrCodec,
)
from recipes.spark import MapSpec, close_maps, get_map
from recipes.spark import _specs as pulsar_spark
from tests.spark import tasks
from tests.spark.conftest import SPARK_MARKS, map_options
from tests.spark.forking import in_forked_child

pytestmark = SPARK_MARKS


def test_specs_pickle_and_equal_specs_share_a_key(service_url: str, admin_url: str) -> None:
    codec: AvroCodec[dict[str, Any]] = AvroCodec(
        {"type": "record", "name": "R", "fields": [{"name": "n", "type": "long"}]}
    )
    spec = MapSpec(
        service_url,
        "some-topic",
        admin_url=admin_url,
        key_codec=StrCodec(),
        value_codec=codec,
        options=map_options(max_record_bytes=2_000_000),
    )
    for copy in (pickle.loads(pickle.dumps(spec)), cloudpickle.loads(cloudpickle.dumps(spec))):
        assert copy == spec
        assert copy.key == spec.key
        assert hash(copy) == hash(spec)
        assert copy.options["max_record_bytes"] == 2_000_000
        assert copy.value_codec is not None
        assert copy.value_codec.decode(codec.encode({"n": 1})) == {"n": 1}
    assert spec.with_options(name="other") != spec
    assert spec.with_options(name="other").options["max_record_bytes"] == 2_000_000


def test_specs_refuse_what_cannot_travel(service_url: str) -> None:
    with pytest.raises(ConfigurationError, match="must pickle"):
        MapSpec(service_url, "t", options={"on_progress": threading.Lock()})
    with pytest.raises(ConfigurationError, match="portal"):
        MapSpec(service_url, "t", options={"portal": None})
    with pytest.raises(ConfigurationError, match="service URL"):
        MapSpec(object(), "t")  # type: ignore[arg-type]


def test_executors_open_their_own_cached_maps(spark: SparkSession, spec: MapSpec) -> None:
    driver = get_map(spec)
    assert get_map(spec) is driver
    driver.put_all({f"k{i}": i * 10 for i in range(8)})
    keys = [f"k{i}" for i in range(8)]

    rdd = spark.sparkContext.parallelize(keys, 4)
    rows = rdd.mapPartitions(lambda part: tasks.read_partition(spec, part)).collect()
    assert sorted(value for _, _, value in rows) == [i * 10 for i in range(8)]
    pids = {pid for pid, _, _ in rows}
    assert os.getpid() not in pids  # read in Python workers, not in the driver
    writers_by_pid: dict[int, set[str]] = {}
    for pid, writer, _ in rows:
        writers_by_pid.setdefault(pid, set()).add(writer)
    # One map per worker process, reused by all the tasks it ran.
    assert all(len(writers) == 1 for writers in writers_by_pid.values())
    assert driver.async_map.manager.writer_id not in set().union(*writers_by_pid.values())

    # Executors write too: each partition adds its size, atomically, through its own map.
    sizes = spark.sparkContext.parallelize(range(100), 5)
    assert sum(sizes.mapPartitions(lambda part: tasks.count_partition(spec, part)).collect()) == 100
    assert driver.get("hits", latest=True) == 100


def _child(spec: MapSpec, parent_writer: str) -> dict[str, Any]:
    m = get_map(spec)
    writer = m.async_map.manager.writer_id
    seen = m.get("from", latest=True)
    m.put("child", os.getpid())
    return {"writer": writer, "seen": seen, "new": writer != parent_writer}


def test_fork_child_opens_its_own_map_and_parent_keeps_working(spec: MapSpec) -> None:
    parent = get_map(spec)
    parent.put("from", "parent")
    parent_writer = parent.async_map.manager.writer_id
    # Fork while this process holds the cache's lock: the child must not inherit it held.
    pid, report = in_forked_child(
        lambda: _child(spec, parent_writer), around_fork=pulsar_spark._current_cache().lock
    )
    assert report["new"] is True
    assert report["seen"] == "parent"
    # The parent's map is untouched by the child's fork and still works.
    assert get_map(spec) is parent
    assert parent.get("child", latest=True) == pid
    parent.put("after", 1)
    assert parent.get("after") == 1


def test_closed_maps_are_replaced_and_close_maps_closes_all(spec: MapSpec) -> None:
    first = get_map(spec)
    first.put("a", 1)
    first.close()  # someone closed it by mistake: the next get_map opens a new one
    second = get_map(spec)
    assert second is not first
    assert second.get("a", latest=True) == 1
    close_maps()
    with pytest.raises(ClosedError):
        second.get("a")
    third = get_map(spec)
    assert third.get("a", latest=True) == 1


def test_a_halted_cached_map_is_replaced(spec: MapSpec) -> None:
    # Before: get_map raised ReplicaHaltedError for that spec for the rest of the process.
    first = get_map(spec)
    first.put("a", 1)
    manager = first.async_map.manager
    first.portal.call_sync(
        lambda: manager._replica.halt_with(PulsarStateError("injected: the replica stopped"))
    )
    with pytest.raises(ReplicaHaltedError):
        first.get("a")
    second = get_map(spec)
    assert second is not first
    assert second.get("a", latest=True) == 1
    close_maps()


def test_opening_one_map_does_not_hold_up_the_others(spec: MapSpec) -> None:
    # A map whose open waits (here: no broker at that address, until its open timeout) must
    # not block get_map for other specs: the cache's lock was held during the whole open.
    unreachable = MapSpec(
        "pulsar://127.0.0.1:9", "nowhere", admin_url="http://127.0.0.1:9", options=map_options()
    )
    finished: list[str] = []

    def open_unreachable() -> None:
        with contextlib.suppress(PulsarStateError):
            get_map(unreachable, timeout=20.0)
        finished.append("unreachable")

    slow = threading.Thread(target=open_unreachable)
    slow.start()
    try:
        time.sleep(0.5)  # the slow open is under way
        get_map(spec).put("k", "v")
        finished.append("reachable")
    finally:
        slow.join()
        close_maps()
    assert finished == ["reachable", "unreachable"]


def test_a_closed_or_halted_cached_history_is_replaced(spec: MapSpec) -> None:
    # Before: a cached MapHistory whose map closed or halted stayed cached, and every later
    # read of the change feed or at a position in that worker failed.
    from recipes.spark._history import get_history

    get_map(spec).put("a", 1)
    first = get_history(spec)
    assert first.state_at(1)["a"][0] == 1
    first.close()
    second = get_history(spec)
    assert second is not first
    assert second.state_at(1)["a"][0] == 1
    manager = second._map.async_map.manager
    second._portal.call_sync(
        lambda: manager._replica.halt_with(PulsarStateError("injected: the replica stopped"))
    )
    third = get_history(spec)
    assert third is not second
    assert third.state_at(1)["a"][0] == 1
    close_maps()
