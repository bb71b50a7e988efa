"""PulsarMapSink: one atomic write per micro-batch, replays ignored by the map itself."""

from __future__ import annotations

import decimal
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas
import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from pulsar_state import ConfigurationError, RecordTooLargeError
from recipes.spark import MapSpec, PulsarMapSink, SinkResult, get_map, map_dataframe
from tests.spark.conftest import SPARK_MARKS, WAIT_S
from tests.spark.tasks import flights_csv

pytestmark = SPARK_MARKS


def test_replace_mode_and_replays(spec: MapSpec) -> None:
    sink = PulsarMapSink(spec, "job-1")
    m = get_map(spec)
    assert sink.last_batch_id() is None
    first = sink.write_rows([("a", 1), ("b", {"x": 1}), ("gone", 0)], 0)
    assert first == SinkResult(0, 3, False, first.position)
    assert first.position is not None
    assert sink.write_rows([("gone", None), ("a", 2)], 1).skipped is False
    assert m.all() == [("__sink__/job-1", 1), ("a", 2), ("b", {"x": 1})]
    position = m.position
    # The same batch id again (a replay), or an older one: nothing changes.
    assert sink.write_rows([("a", 99)], 1) == SinkResult(1, 1, True, None)
    assert sink.write_rows([("a", 98)], 0).skipped is True
    assert m.get("a", latest=True) == 2
    assert m.position == position  # skipped batches append nothing
    assert sink.last_batch_id() == 1
    # Another sink on the same map has its own progress.
    assert PulsarMapSink(spec, "job-2").write_rows([("c", 3)], 0).skipped is False
    sink.reset()
    assert sink.last_batch_id() is None


def test_add_mode_counts_each_batch_once(spec: MapSpec) -> None:
    sink = PulsarMapSink(spec, "adder", mode="add")
    batch = [("n", 1), ("n", 2), ("d", {"flights": 2, "delayed": 1}), ("d", {"flights": 1})]
    sink.write_rows(batch, 0)
    sink.write_rows(batch, 0)  # replayed: ignored
    sink.write_rows([("n", 0.5), ("d", {"flights": 1, "delayed": 1, "new": 4})], 1)
    m = get_map(spec)
    assert m.get("n") == 3.5
    assert m.get("d") == {"flights": 4, "delayed": 2, "new": 4}
    position = m.position
    with pytest.raises(ConfigurationError, match="cannot add"):
        sink.write_rows([("n", "text")], 2)
    with pytest.raises(ConfigurationError, match="cannot add"):
        sink.write_rows([("d", 5)], 2)
    with pytest.raises(ConfigurationError, match="reserved"):
        sink.write_rows([("__sink__/x", 5)], 2)
    assert m.position == position
    assert sink.last_batch_id() == 1  # the failed batches left no trace


def test_a_batch_too_large_for_one_write_fails_and_writes_nothing(spec: MapSpec) -> None:
    small = spec.with_options(max_record_bytes=4096)
    sink = PulsarMapSink(small, "big")
    with pytest.raises(
        RecordTooLargeError, match=r"micro-batch 0 of sink 'big'.*nothing was written"
    ):
        sink.write_rows([(f"key-{i}", "x" * 50) for i in range(200)], 0)
    assert get_map(small).all(latest=True) == []
    assert sink.write_rows([("fits", 1)], 0).skipped is False


def test_write_takes_a_dataframe(spark: SparkSession, spec: MapSpec) -> None:
    df = spark.createDataFrame(
        [("AA", 3, decimal.Decimal("2.50")), ("UA", 1, decimal.Decimal("4"))],
        "carrier STRING, flights INT, cost DECIMAL(10,2)",
    )
    sink = PulsarMapSink(
        spec, "df", key_column="carrier", value_columns=["flights", "cost"], mode="add"
    )
    sink(df, 0)  # as foreachBatch calls it
    sink.write(df, 1)
    m = get_map(spec)
    assert m.get("AA") == {"flights": 6, "cost": 5.0}
    assert m.get("UA") == {"flights": 2, "cost": 8}
    single = PulsarMapSink(spec, "single", key_column="carrier", value_column="flights")
    single.write(df.withColumn("carrier", F.concat(F.lit("s/"), "carrier")), 0)
    assert m.get("s/AA") == 3


# ------------------------------------------------------------------ a restarted streaming query

FLIGHTS = 30_000
FILES = 6
THRESHOLD = 15


class Crash(RuntimeError):
    """Simulates the driver dying after the sink's write and before Spark's commit."""


def carrier_deltas(batch: DataFrame) -> DataFrame:
    return batch.groupBy("carrier").agg(
        F.count("*").alias("flights"),
        F.sum(F.when(F.col("arr_delay") > THRESHOLD, 1).otherwise(0)).alias("delayed"),
    )


def start_query(
    spark: SparkSession,
    source: Path,
    checkpoint: Path,
    sink: PulsarMapSink,
    results: list[SinkResult],
    crash_after: int | None,
) -> StreamingQuery:
    def process(batch: DataFrame, batch_id: int) -> None:
        results.append(sink.write(carrier_deltas(batch), batch_id))
        if batch_id == crash_after:
            raise Crash(f"crash after writing batch {batch_id}")

    return (
        spark.readStream.schema("carrier STRING, arr_delay DOUBLE")
        .option("header", True)
        .option("maxFilesPerTrigger", 1)
        .csv(str(source))
        .writeStream.foreachBatch(process)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )


def wait_until(query: StreamingQuery, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        error = query.exception()
        if error is not None:
            raise AssertionError(f"the query failed: {error}")
        if time.monotonic() > deadline:
            raise AssertionError(f"the query did not get there within {WAIT_S}s")
        time.sleep(0.1)


def counted_flights(spec: MapSpec) -> int:
    """The flights the map has counted so far (the sink's own marker left out)."""
    return sum(
        value["flights"] for key, value in get_map(spec).all() if not key.startswith("__sink__/")
    )


@pytest.mark.slow
def test_restarted_query_does_not_double_count(
    spark: SparkSession, spec: MapSpec, tmp_path: Path
) -> None:
    # Columns in the order of the stream's schema (a CSV source maps columns by position).
    flights = pandas.read_csv(flights_csv(), usecols=["carrier", "arr_delay"], nrows=FLIGHTS)[
        ["carrier", "arr_delay"]
    ]
    source = tmp_path / "flights"
    source.mkdir()
    chunk = FLIGHTS // FILES
    for i in range(FILES):
        part = flights.iloc[i * chunk : (i + 1) * chunk]
        tmp = tmp_path / f"part-{i}.csv"
        part.to_csv(tmp, index=False)
        shutil.move(tmp, source / f"part-{i:02}.csv")
    checkpoint = tmp_path / "checkpoint"
    # Map calls time out well inside the test's waits and the sink does not retry, so a hang
    # in the library fails as a library error, never as a slow query.
    spec = spec.with_options(write_timeout_s=30.0, read_timeout_s=30.0)
    sink = PulsarMapSink(
        spec,
        "carriers",
        key_column="carrier",
        value_columns=["flights", "delayed"],
        mode="add",
        retries=0,
    )

    # Run 1 dies right after the sink wrote batch 2, before Spark recorded it as done.
    first: list[SinkResult] = []
    query = start_query(spark, source, checkpoint, sink, first, crash_after=2)
    with pytest.raises(StreamingQueryException, match="crash after writing batch 2"):
        query.awaitTermination(WAIT_S)
    assert [r.batch_id for r in first] == [0, 1, 2]
    assert not any(r.skipped for r in first)

    # Run 2, from the same checkpoint: Spark runs batch 2 again; the map ignores it. Then it
    # is stopped after one more batch...
    second: list[SinkResult] = []
    query = start_query(spark, source, checkpoint, sink, second, crash_after=None)
    try:
        wait_until(query, lambda: len(second) >= 2)
    finally:
        query.stop()  # may interrupt batch 4 before or after its write: both are fine
    assert second[0] == SinkResult(2, second[0].keys, True, None)
    assert second[1] == SinkResult(3, second[1].keys, False, second[1].position)

    # ...and run 3 finishes the input. A stop can interrupt Spark while it logs a batch's
    # offsets; the restarted query may then plan the remaining files as fewer, larger batches
    # (maxFilesPerTrigger is not a bound after a restart). So wait for the input, not for a
    # batch count: every flight counted (more would be a double count, checked below).
    third: list[SinkResult] = []
    query = start_query(spark, source, checkpoint, sink, third, crash_after=None)
    try:
        wait_until(query, lambda: counted_flights(spec) >= FLIGHTS)
    finally:
        query.stop()
    applied = [r.batch_id for r in first + second + third if not r.skipped]
    assert applied == list(range(len(applied))), "each batch id applied once, in order"
    assert sink.last_batch_id() == applied[-1]

    # The totals equal an independent computation over the same flights: each counted once.
    expected = {
        carrier: {"flights": len(group), "delayed": int((group.arr_delay > THRESHOLD).sum())}
        for carrier, group in flights.groupby("carrier")
    }
    got: dict[str, Any] = {
        row.key: {"flights": row.flights, "delayed": row.delayed}
        for row in map_dataframe(spark, spec, value_schema="flights LONG, delayed LONG").collect()
    }
    assert got == expected
    assert sum(v["flights"] for v in got.values()) == FLIGHTS

    # A new query (a new checkpoint) under the same sink id starts again at batch 0: its
    # batches would be taken for applied ones and dropped. It fails loudly instead.
    fourth: list[SinkResult] = []
    query = start_query(spark, source, tmp_path / "new-checkpoint", sink, fourth, None)
    with pytest.raises(StreamingQueryException, match="another query, or a new checkpoint"):
        query.awaitTermination(WAIT_S)
    assert fourth == []
    assert counted_flights(spec) == FLIGHTS
