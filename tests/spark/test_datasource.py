"""The ``pulsar-state`` data source: the exactly-once stream writer, batch reads at a position,
the change feed resumed from Spark's checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import LongType, StringType, StructField, StructType

from pulsar_state import ConfigurationError, JsonCodec, PulsarStateError
from recipes.spark import MapSpec, PulsarMapSink, get_map
from recipes.spark.datasource import (
    FORMAT,
    PulsarStateDataSource,
    _ChangeFeedReader,
    _checked,
    _Layout,
    _parse_value_schema,
    _SnapshotReader,
    register,
    spark_options,
)
from tests.spark.conftest import SPARK_MARKS, WAIT_S

pytestmark = SPARK_MARKS


@pytest.fixture
def session(spark: SparkSession) -> SparkSession:
    register(spark)
    return spark


def write_csv_files(folder: Path, batches: list[list[tuple[str, int]]]) -> None:
    """One CSV file per batch (``key,n``), moved in whole so a stream never sees half a file."""
    folder.mkdir(parents=True, exist_ok=True)
    start = time.time() - 1000
    for i, rows in enumerate(batches):
        tmp = folder.parent / f".part-{folder.name}-{i}.csv"
        tmp.write_text("key,n\n" + "".join(f"{k},{n}\n" for k, n in rows))
        # The file source takes files by modification time: one second apart keeps the order.
        os.utime(tmp, (start + i, start + i))
        shutil.move(tmp, folder / f"part-{i:03}.csv")


def stream_of(spark: SparkSession, folder: Path) -> DataFrame:
    return (
        spark.readStream.schema("key STRING, n LONG")
        .option("header", True)
        .option("maxFilesPerTrigger", 1)
        .csv(str(folder))
    )


def write_stream(df: DataFrame, spec: MapSpec, checkpoint: Path, **options: str) -> StreamingQuery:
    writer = (
        df.writeStream.format(FORMAT)
        .options(**spark_options(spec))
        .option("value_column", "n")
        .option("checkpointLocation", str(checkpoint))
    )
    for name, value in options.items():
        writer = writer.option(name, value)
    return writer.trigger(availableNow=True).start()


def user_entries(spec: MapSpec) -> dict[str, Any]:
    return {k: v for k, v in get_map(spec).all(latest=True) if not k.startswith("__sink__/")}


# --------------------------------------------------------------------------------- writes

BATCHES = [[("a", 1), ("b", 2), ("a", 3)], [("b", 10), ("c", 5)], [("a", 100)]]


def test_stream_write_replayed_batch_is_skipped(
    session: SparkSession, spec: MapSpec, tmp_path: Path
) -> None:
    source, checkpoint = tmp_path / "in", tmp_path / "cp"
    write_csv_files(source, BATCHES)
    query = write_stream(stream_of(session, source), spec, checkpoint, sink_id="job", mode="add")
    query.awaitTermination(WAIT_S)
    assert query.exception() is None
    expected = {"a": 104, "b": 12, "c": 5}
    assert user_entries(spec) == expected
    sink = PulsarMapSink(spec, "job")
    assert sink.last_batch_id() == 2
    m = get_map(spec)
    before = m.sync()

    # As if the driver died after the sink's commit of batch 2 and before Spark logged it:
    # the restarted query runs batch 2 again, with the same id and rows.
    (checkpoint / "commits" / "2").unlink()
    (checkpoint / "commits" / ".2.crc").unlink(missing_ok=True)
    query = write_stream(stream_of(session, source), spec, checkpoint, sink_id="job", mode="add")
    query.awaitTermination(WAIT_S)
    assert query.exception() is None
    # Batch 2 ran again (and was committed to the map's sink), which appended nothing.
    assert query.lastProgress is not None
    assert query.lastProgress["batchId"] == 2
    assert m.sync() == before
    assert user_entries(spec) == expected
    assert sink.last_batch_id() == 2


def test_replace_mode_and_value_columns(
    session: SparkSession, spec: MapSpec, tmp_path: Path
) -> None:
    source = tmp_path / "in"
    write_csv_files(source, BATCHES)
    df = stream_of(session, source).selectExpr("key AS name", "n", "n * 2 AS twice")
    query = (
        df.writeStream.format(FORMAT)
        .options(**spark_options(spec))
        .option("sink_id", "cols")
        .option("key_column", "name")
        .option("value_columns", "n, twice")
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(WAIT_S)
    assert query.exception() is None
    got = user_entries(spec)
    assert got["c"] == {"n": 5, "twice": 10}
    assert got["a"] == {"n": 100, "twice": 200}
    assert got["b"] == {"n": 10, "twice": 20}


def test_an_aborted_batch_writes_nothing(
    session: SparkSession, spec: MapSpec, tmp_path: Path
) -> None:
    m = get_map(spec)
    m.put("untouched", 1)
    before = m.sync()
    source = tmp_path / "in"
    # Two partitions of one batch: one is fine, the other fails on the executor (a null key),
    # after the first may already have finished. Spark aborts the batch: nothing is written.
    write_csv_files(source, [[("fine", 1), ("", 2)] * 50])
    df = stream_of(session, source).repartition(2)
    query = write_stream(df, spec, tmp_path / "cp", sink_id="aborts", mode="add")
    with pytest.raises(StreamingQueryException, match="null key"):
        query.awaitTermination(WAIT_S)
    assert m.sync() == before
    assert user_entries(spec) == {"untouched": 1}
    assert PulsarMapSink(spec, "aborts").last_batch_id() is None


def test_a_batch_too_big_for_one_record_fails_and_writes_nothing(
    session: SparkSession, spec: MapSpec, tmp_path: Path
) -> None:
    small = spec.with_options(max_record_bytes=4096)
    before = get_map(small).sync()
    source = tmp_path / "in"
    write_csv_files(source, [[(f"key-{i:04}", i) for i in range(500)]])
    query = write_stream(stream_of(session, source), small, tmp_path / "cp", sink_id="big")
    with pytest.raises(
        StreamingQueryException, match=r"micro-batch 0 of sink 'big'.*nothing was written"
    ):
        query.awaitTermination(WAIT_S)
    assert get_map(small).sync() == before
    assert get_map(small).all(latest=True) == []


def test_writer_options_are_checked(session: SparkSession, spec: MapSpec, tmp_path: Path) -> None:
    source = tmp_path / "in"
    write_csv_files(source, BATCHES[:1])
    with pytest.raises(Exception, match="sink_id is required"):
        write_stream(stream_of(session, source), spec, tmp_path / "cp1").awaitTermination(WAIT_S)
    with pytest.raises(Exception, match="no column 'nope'"):
        write_stream(
            stream_of(session, source), spec, tmp_path / "cp2", sink_id="x", key_column="nope"
        ).awaitTermination(WAIT_S)
    with pytest.raises(Exception, match="mode must be replace or add"):
        write_stream(
            stream_of(session, source), spec, tmp_path / "cp3", sink_id="x", mode="max"
        ).awaitTermination(WAIT_S)


# ------------------------------------------------------------------------------ batch reads


def read_map(session: SparkSession, spec: MapSpec, **options: Any) -> DataFrame:
    reader = session.read.format(FORMAT).options(**spark_options(spec))
    for name, value in options.items():
        reader = reader.option(name, str(value))
    return reader.load()


def test_batch_read_equals_the_map(session: SparkSession, spec: MapSpec) -> None:
    m = get_map(spec)
    m.put_all({f"k{i:03}": {"flights": i, "delayed": i % 7} for i in range(60)})
    m.put("odd", {"flights": 1.5})
    PulsarMapSink(spec, "job").write_rows([("via-sink", {"flights": 2})], 0)
    m.put("__fence__/db", 7)  # recipes.fencing's bookkeeping, left out as the markers are
    expected = {k: (v, int(e.version)) for k, e in m.entries(latest=True) for v in [e.value]}
    del expected["__sink__/job"], expected["__fence__/db"]

    rows = read_map(session, spec).collect()
    assert [r.key for r in rows] == sorted(expected)  # key order, markers left out
    assert {r.key: (json.loads(r.value), r.version) for r in rows} == expected

    for partitions in (1, 4):
        typed = read_map(
            session, spec, value_schema="flights DOUBLE, delayed LONG", partitions=partitions
        )
        assert typed.columns == ["key", "flights", "delayed", "version"]
        assert typed.rdd.getNumPartitions() == partitions
        got = {r.key: (r.flights, r.delayed, r.version) for r in typed.collect()}
        assert got == {
            k: (float(v["flights"]), v.get("delayed"), version)
            for k, (v, version) in expected.items()
        }
    with_markers = read_map(session, spec, include_markers="true").collect()
    assert {"__sink__/job", "__fence__/db"} <= {r.key for r in with_markers}


def test_a_partitioned_read_of_an_int_keyed_map_with_a_sink_marker(spec: MapSpec) -> None:
    # A sink's marker is a str key, so an int-keyed map it writes to has keys of two types:
    # before, each partition compared them with < and failed with TypeError (review 45c F2).
    ints = dataclasses.replace(spec, key_codec=JsonCodec())
    m = get_map(ints)
    m.put_all({i: i * 10 for i in range(6)})
    PulsarMapSink(ints, "job").write_rows([(6, 60)], 0)
    reader = _SnapshotReader(ints, _Layout.of({"key_type": "long", "value_schema": "long"}), {})
    for partitions in (2, 3):
        reader.partition_count = partitions
        parts = reader.partitions()
        rows = [row[:2] for part in parts for row in reader.read(part)]
        assert rows == [(i, i * 10) for i in range(7)]


def test_at_position_equals_the_state_replayed_to_that_position(
    session: SparkSession, spec: MapSpec
) -> None:
    m = get_map(spec)
    states: dict[int, dict[str, Any]] = {0: {}}  # position -> the map then (kept by the test)
    current: dict[str, Any] = {}

    def did(position: int) -> None:
        states[position] = dict(current)

    current.update(a=1, b=2, c=3)
    did(m.put_all({"a": 1, "b": 2, "c": 3}))
    current["a"] = 10
    did(m.put("a", 10).position)
    del current["b"]
    m.delete("b")
    did(m.position)
    current.clear()
    did(m.clear())
    current.update(d=4, a=11)
    did(m.put_all({"d": 4, "a": 11}))
    assert sorted(states) == list(range(6))
    for position, state in states.items():
        for partitions in (1, 2):
            rows = read_map(
                session, spec, at_position=position, value_schema="long", partitions=partitions
            ).collect()
            assert {r.key: r.value for r in rows} == state, f"at position {position}"
            assert all(r.version >> 32 <= position for r in rows)
    with pytest.raises(Exception, match=r"at_position 6 is beyond the map's tail \(5 records\)"):
        read_map(session, spec, at_position=6).collect()


@pytest.mark.parametrize(
    ("cell", "ddl"),
    [
        (2**63, "long"),
        (-(2**63) - 1, "long"),
        (2**31, "int"),
        (-(2**15) - 1, "short"),
        (1e300, "float"),
        (-1e39, "float"),
        (10**400, "double"),
    ],
)
def test_a_number_out_of_its_type_s_range_fails_clearly(cell: Any, ddl: str) -> None:
    # Before: accepted here, then Arrow failed naming neither key nor field ("too large to
    # fit in C integer type"), or a float column silently held inf (review 45c F4).
    with pytest.raises(ConfigurationError, match="which does not fit the declared type"):
        _checked(cell, _parse_value_schema(ddl), "the value of 'k'")


def test_numbers_at_the_edges_of_their_types_fit() -> None:
    for cell, ddl in [(2**63 - 1, "long"), (-(2**31), "int"), (2**15 - 1, "short")]:
        assert _checked(cell, _parse_value_schema(ddl), "v") == cell
    assert _checked(3.4e38, _parse_value_schema("float"), "v") == 3.4e38
    assert _checked(3.4028235e38, _parse_value_schema("float"), "v") == 3.4028235e38  # max
    assert _checked(float("inf"), _parse_value_schema("float"), "v") == float("inf")
    assert _checked(float("nan"), _parse_value_schema("double"), "v") != 0


def test_a_value_of_the_wrong_type_fails_clearly(session: SparkSession, spec: MapSpec) -> None:
    get_map(spec).put_all({"ok": {"flights": 3}, "bad": {"flights": "three"}})
    with pytest.raises(
        Exception,
        match=r"field 'flights' of the value of 'bad' is 'three' \(str\), which does not fit "
        r"the declared type bigint",
    ):
        read_map(session, spec, value_schema="flights LONG").collect()
    with pytest.raises(Exception, match="'flights NOSUCHTYPE' is not a type this source reads"):
        read_map(session, spec, value_schema="flights NOSUCHTYPE").collect()
    # Any Spark type, as JSON.
    nested = StructType([StructField("other", LongType())]).json()
    assert read_map(session, spec, value_schema=nested).count() == 2
    stream = session.readStream.format(FORMAT).options(**spark_options(spec)).load()
    with pytest.raises(Exception, match="a stream of a pulsar-state map is its change feed"):
        stream.writeStream.format("noop").start().awaitTermination(WAIT_S)


# ------------------------------------------------------------------------------ change feed


class Crash(RuntimeError):
    """Simulates the driver dying after a batch's output and before Spark's commit."""


Change = tuple[int, str, Any, Any]  # position, kind, key, value


def start_feed(
    session: SparkSession,
    spec: MapSpec,
    checkpoint: Path,
    delivered: list[tuple[int, list[Change]]],
    crash_at: int | None,
) -> StreamingQuery:
    def process(batch: DataFrame, batch_id: int) -> None:
        rows = [(r.position, r.kind, r.key, r.value) for r in batch.collect()]
        delivered.append((batch_id, rows))
        if batch_id == crash_at:
            raise Crash(f"crash after delivering batch {batch_id}")

    return (
        session.readStream.format(FORMAT)
        .options(**spark_options(spec))
        .option("change_feed", "true")
        .option("value_schema", "long")
        .load()
        .writeStream.foreachBatch(process)
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="200 milliseconds")
        .start()
    )


def wait_for_batches(
    query: StreamingQuery, delivered: list[Any], count: int, *, failing: bool = False
) -> None:
    deadline = time.monotonic() + WAIT_S
    while len(delivered) < count:
        if not failing and query.exception() is not None:
            raise AssertionError(f"the query failed: {query.exception()}")
        assert time.monotonic() < deadline, f"fewer than {count} batches within {WAIT_S}s"
        time.sleep(0.1)


def wait_for_position(query: StreamingQuery, delivered: list[Any], position: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while not any(row[0] >= position for _, rows in delivered for row in rows):
        if query.exception() is not None:
            raise AssertionError(f"the query failed: {query.exception()}")
        assert time.monotonic() < deadline, f"position {position} not delivered in {WAIT_S}s"
        time.sleep(0.1)


@pytest.mark.slow
def test_change_feed_restarted_from_its_checkpoint_yields_every_change_once(
    session: SparkSession, spec: MapSpec, tmp_path: Path
) -> None:
    m = get_map(spec)
    expected: list[Change] = []  # kept by the test from its own writes
    start = m.put_all({"a": 1, "b": 2})
    expected += [(start, "put", "a", 1), (start, "put", "b", 2)]  # the starting snapshot
    checkpoint = tmp_path / "cp"

    def change(write: Any, *rows: tuple[str, Any, Any]) -> int:
        position = int(write())
        expected.extend((position, kind, key, value) for kind, key, value in rows)
        return position

    first: list[tuple[int, list[Change]]] = []
    query = start_feed(session, spec, checkpoint, first, crash_at=2)
    wait_for_batches(query, first, 1)  # batch 0: the snapshot
    change(lambda: m.put("c", 3).position, ("put", "c", 3))
    wait_for_batches(query, first, 2)
    change(lambda: m.put("a", 10).position, ("put", "a", 10))
    wait_for_batches(query, first, 3, failing=True)  # batch 2, then the crash
    with pytest.raises(StreamingQueryException, match="crash after delivering batch 2"):
        query.awaitTermination(WAIT_S)

    # Changes while no query runs.
    change(lambda: m.delete("b") and m.position, ("delete", "b", None))
    change(lambda: m.put_all({"d": 4, "e": 5}), ("put", "d", 4), ("put", "e", 5))
    change(lambda: m.delete("absent") or m.position)  # a record, but no change
    change(m.clear, ("clear", None, None))

    second: list[tuple[int, list[Change]]] = []
    query = start_feed(session, spec, checkpoint, second, crash_at=None)
    try:
        wait_for_position(query, second, m.position)
        # A stop ("kill") between batches, then more changes, then a third run.
    finally:
        query.stop()
    last = change(lambda: m.put("f", 6).position, ("put", "f", 6))
    third: list[tuple[int, list[Change]]] = []
    query = start_feed(session, spec, checkpoint, third, crash_at=None)
    try:
        wait_for_position(query, third, last)
    finally:
        query.stop()

    # Spark re-ran batch 2 (its offsets were logged, its commit was not): the same rows.
    assert second[0][0] == 2
    assert second[0][1] == first[2][1]
    by_batch: dict[int, list[Change]] = {}
    for batch_id, rows in first + second + third:
        by_batch.setdefault(batch_id, rows)
        assert by_batch[batch_id] == rows, f"batch {batch_id} changed when re-run"
    assert sorted(by_batch) == list(range(len(by_batch)))
    feed = [row for batch_id in sorted(by_batch) for row in by_batch[batch_id]]
    assert feed == expected  # every change once, in log order, no gap, no duplicate


@pytest.mark.parametrize("starting", ["snapshot", "earliest", "latest"])
def test_a_change_feed_run_again_with_available_now_resumes_at_its_checkpoint(
    session: SparkSession, spec: MapSpec, tmp_path: Path, starting: str
) -> None:
    # An incremental job: the same query with trigger(availableNow=True) run again and again
    # on one checkpoint (the README's example). Spark wraps a reader without
    # SupportsTriggerAvailableNow; a review (45c) read that wrapper as planning each run from
    # initialOffset(), which would repeat, lose or resend changes. Measured on PySpark 4.3:
    # it asks latestOffset() from the committed offset, and each run resumes there.
    m = get_map(spec)
    before = m.put_all({"a": 1, "b": 2})
    options = {**spark_options(spec), "starting_position": starting}
    checkpoint = tmp_path / "cp"

    def run() -> list[Change]:
        delivered: list[tuple[int, list[Change]]] = []
        query = start_feed_with(session, options, checkpoint, delivered)
        assert query.awaitTermination(WAIT_S), f"availableNow run not done in {WAIT_S}s"
        assert query.exception() is None
        return [row for _batch, rows in delivered for row in rows]

    first = run()
    expected = {
        "snapshot": [(before, "put", "a", 1), (before, "put", "b", 2)],
        "earliest": [(before, "put", "a", 1), (before, "put", "b", 2)],
        "latest": [],
    }[starting]
    assert first == expected
    c = m.put("c", 3).position
    d = m.delete("a") and m.position
    assert run() == [(c, "put", "c", 3), (d, "delete", "a", None)]
    assert run() == []


def start_feed_with(
    session: SparkSession,
    options: dict[str, str],
    checkpoint: Path,
    delivered: list[tuple[int, list[Change]]],
) -> StreamingQuery:
    def process(batch: DataFrame, batch_id: int) -> None:
        rows = [(r.position, r.kind, r.key, r.value) for r in batch.collect()]
        delivered.append((batch_id, rows))

    return (
        session.readStream.format(FORMAT)
        .options(**options)
        .option("change_feed", "true")
        .option("value_schema", "long")
        .load()
        .writeStream.foreachBatch(process)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


@pytest.mark.parametrize("starting", ["snapshot", "latest"])
def test_a_change_feed_batch_runs_from_where_it_was_planned(spec: MapSpec, starting: str) -> None:
    # Spark asks initialOffset() when it plans the first batch and again when it runs it
    # (and after a restart before that batch committed); "snapshot" and "latest" start at
    # the tail as of each call. Before: the batch ran from the second answer, so a change
    # landing in between came twice (in the snapshot, then as a change) or never.
    m = get_map(spec)
    first = m.put_all({"a": 1, "b": 2})
    reader = _ChangeFeedReader(spec, _Layout.of({}), {"starting_position": starting})
    planned = reader.initialOffset()
    change = m.put("c", 3).position
    end = reader.latestOffset(planned, None)
    m.put("d", 4)  # between the two calls
    again = reader.initialOffset()
    assert again["position"] > planned["position"]
    [partition] = reader.partitions(again, end)
    rows = [(row[0], row[1], row[2]) for row in reader.read(partition)]
    expected = [(first, "put", "a"), (first, "put", "b")] if starting == "snapshot" else []
    assert rows == [*expected, (change, "put", "c")]
    # The next batch starts at that end: "d" comes once, there.
    after = reader.latestOffset(end, None)
    [partition] = reader.partitions(end, after)
    assert [(row[1], row[2]) for row in reader.read(partition)] == [("put", "d")]


def test_the_change_feed_of_a_spec_with_snapshots_replays_the_whole_log(spec: MapSpec) -> None:
    # Before: the history's map took the spec's snapshots option, and a map with snapshots
    # watches only once open: every change feed and position read failed with ClosedError
    # "not open" (review 45c F3).
    snapshotted = spec.with_options(snapshots=True)
    m = get_map(snapshotted)
    first = m.put_all({"a": 1, "b": 2})
    m.snapshot()
    second = m.put("a", 3).position
    reader = _ChangeFeedReader(snapshotted, _Layout.of({}), {"starting_position": "earliest"})
    start = reader.initialOffset()
    [partition] = reader.partitions(start, reader.latestOffset(start, None))
    rows = [(row[0], row[1], row[2]) for row in reader.read(partition)]
    assert rows == [(first, "put", "a"), (first, "put", "b"), (second, "put", "a")]


def test_a_change_feed_batch_whose_start_is_past_its_end_fails_clearly(spec: MapSpec) -> None:
    reader = _ChangeFeedReader(spec, _Layout.of({}), {})
    with pytest.raises(PulsarStateError, match="after its end"):
        reader.partitions({"position": 9, "snapshot": False}, {"position": 5, "snapshot": False})


def test_complete_output_mode_with_add_is_refused(spec: MapSpec) -> None:
    # outputMode("complete") (overwrite) sends the whole result each batch: before, add
    # counted every earlier batch again.
    options = {**spark_options(spec), "sink_id": "s", "mode": "add"}
    schema = StructType([StructField("key", StringType()), StructField("value", LongType())])
    with pytest.raises(ConfigurationError, match="complete"):
        PulsarStateDataSource(options).streamWriter(schema, overwrite=True)
    PulsarStateDataSource(options).streamWriter(schema, overwrite=False)  # update, append
    replace = {**options, "mode": "replace"}
    PulsarStateDataSource(replace).streamWriter(schema, overwrite=True)


def test_a_latest_change_feed_with_nothing_new_runs_its_first_batch_from_where_planned(
    spec: MapSpec,
) -> None:
    # Spark plans the first batch even when nothing is new, then asks initialOffset() again
    # to run it. Before: the end it planned named no start, so a write in between made the
    # batch start past its end, and it failed on every restart.
    m = get_map(spec)
    m.put("a", 1)
    reader = _ChangeFeedReader(spec, _Layout.of({}), {"starting_position": "latest"})
    planned = reader.initialOffset()
    end = reader.latestOffset(planned, None)
    assert end.get("from") == planned
    m.put("b", 2)
    [partition] = reader.partitions(reader.initialOffset(), end)
    assert list(reader.read(partition)) == []
    after = reader.latestOffset(end, None)
    [partition] = reader.partitions(end, after)
    assert [(row[1], row[2]) for row in reader.read(partition)] == [("put", "b")]
    assert reader.latestOffset(after, None) == after  # nothing new: no batch
