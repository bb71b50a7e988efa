"""The ``pulsar-state`` Spark data source against the ``foreachBatch`` sink, in one run.

    .venv/bin/python benchmarks/spark_datasource.py [--quick] [--out FILE]

Same broker, same Spark session (local[2]), same input files, for each measure:

* streaming write, rows/s: a file stream of N rows (F files, one per micro-batch, K keys in
  each) added into a fresh map, by ``writeStream.format("pulsar-state")`` and by
  ``foreachBatch(PulsarMapSink(...))``; from the query's start to its end (availableNow);
* change feed read, changes/s: the data source's map read back as a stream from position 0
  (one row per change: F x K), to a ``noop`` sink;
* batch read, rows/s: the final map (K keys) by ``spark.read.format("pulsar-state")`` and by
  ``map_dataframe`` (the driver-side snapshot), counted.

Each is run ``--repeat`` times alternately; the best run counts (the machine is shared).
Writes a table to stdout and ``benchmarks/spark_results.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pyspark.sql import DataFrame, SparkSession  # noqa: E402

from pulsar_state.testing import provide_broker  # noqa: E402
from recipes.spark import MapSpec, PulsarMapSink, close_maps, get_map, map_dataframe  # noqa: E402
from recipes.spark.datasource import FORMAT, register, spark_options  # noqa: E402

WAIT_S = 600.0


def session() -> SparkSession:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), path) if p)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("pulsar-state-bench")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def write_input(folder: Path, files: int, keys: int) -> int:
    """``files`` CSV files of ``keys`` rows each (every key once per file); returns the rows."""
    folder.mkdir(parents=True)
    start = time.time() - 10_000
    for f in range(files):
        path = folder / f"part-{f:03}.csv"
        path.write_text("key,n\n" + "".join(f"k{k:06},{f + 1}\n" for k in range(keys)))
        os.utime(path, (start + f, start + f))  # the file source's order
    return files * keys


def stream(spark: SparkSession, folder: Path) -> DataFrame:
    return (
        spark.readStream.schema("key STRING, n LONG")
        .option("header", True)
        .option("maxFilesPerTrigger", 1)
        .csv(str(folder))
    )


def timed(run: Callable[..., Any], *args: Any) -> float:
    started = time.perf_counter()
    run(*args)
    return time.perf_counter() - started


def new_spec(url: str, admin: str, label: str) -> MapSpec:
    options = {"write_timeout_s": 120.0, "read_timeout_s": 120.0, "open_timeout_s": 300.0}
    topic = f"bench-spark-{label}-{uuid.uuid4().hex[:8]}"
    return MapSpec(url, topic, admin_url=admin, options=options)


def datasource_write(spark: SparkSession, folder: Path, spec: MapSpec, cp: Path) -> None:
    query = (
        stream(spark, folder)
        .writeStream.format(FORMAT)
        .options(**spark_options(spec))
        .option("sink_id", "bench")
        .option("mode", "add")
        .option("value_column", "n")
        .option("checkpointLocation", str(cp))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(WAIT_S)
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))


def foreach_batch_write(spark: SparkSession, folder: Path, spec: MapSpec, cp: Path) -> None:
    sink = PulsarMapSink(spec, "bench", mode="add", value_column="n")
    query = (
        stream(spark, folder)
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(cp))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(WAIT_S)
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))


def change_feed_read(spark: SparkSession, spec: MapSpec, cp: Path) -> None:
    query = (
        spark.readStream.format(FORMAT)
        .options(**spark_options(spec))
        .option("change_feed", "true")
        .option("starting_position", "earliest")
        .option("value_schema", "long")
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(cp))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(WAIT_S)
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))


def batch_read(spark: SparkSession, spec: MapSpec, keys: int) -> None:
    reader = spark.read.format(FORMAT).options(**spark_options(spec))
    _expect(reader.option("value_schema", "long").load().count(), keys)


def snapshot_read(spark: SparkSession, spec: MapSpec, keys: int) -> None:
    _expect(map_dataframe(spark, spec, value_schema="long").count(), keys)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "spark_results.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas", FutureWarning)
    files, keys = (4, 2_000) if args.quick else (10, 10_000)
    repeat = args.repeat or (1 if args.quick else 3)
    work = Path(tempfile.mkdtemp(prefix="pulsar-state-spark-bench-"))
    results: dict[str, list[float]] = {}
    broker = provide_broker(
        os.environ.get("PULSAR_SERVICE_URL"), os.environ.get("PULSAR_ADMIN_URL")
    )
    url, admin = broker.service_url, broker.admin_url
    spark = session()
    try:
        rows = write_input(work / "input", files, keys)
        # Warm-up: the JVM, the Python workers, one map open per kind.
        warm = work / "warm"
        write_input(warm, 1, 10)
        datasource_write(spark, warm, new_spec(url, admin, "warm"), work / "cp-w1")
        foreach_batch_write(spark, warm, new_spec(url, admin, "warm"), work / "cp-w2")
        last_spec: MapSpec | None = None
        for r in range(repeat):
            spec = new_spec(url, admin, "ds")
            seconds = timed(datasource_write, spark, work / "input", spec, work / f"cp-ds-{r}")
            results.setdefault("write: data source", []).append(rows / seconds)
            other = new_spec(url, admin, "fb")
            seconds = timed(foreach_batch_write, spark, work / "input", other, work / f"cp-fb-{r}")
            results.setdefault("write: foreachBatch sink", []).append(rows / seconds)
            last_spec = spec
        assert last_spec is not None
        total = sum(range(1, files + 1))
        assert get_map(last_spec).get(f"k{0:06}", latest=True) == total  # each batch once
        changes = files * keys
        for r in range(repeat):
            seconds = timed(change_feed_read, spark, last_spec, work / f"cp-cf-{r}")
            results.setdefault("read: change feed (stream)", []).append(changes / seconds)
            seconds = timed(batch_read, spark, last_spec, keys)
            results.setdefault("read: data source (batch)", []).append(keys / seconds)
            seconds = timed(snapshot_read, spark, last_spec, keys)
            results.setdefault("read: map_dataframe", []).append(keys / seconds)
    finally:
        spark.stop()
        close_maps()
        shutil.rmtree(work, ignore_errors=True)
        broker.stop()
    best = {name: max(values) for name, values in results.items()}
    report: dict[str, Any] = {
        "input": {"files": files, "keys_per_file": keys, "rows": files * keys},
        "repeat": repeat,
        "rows_per_s_best": best,
        "rows_per_s_all": results,
        "environment": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "ratios": {
            "write: data source / foreachBatch": best["write: data source"]
            / best["write: foreachBatch sink"],
            "read: data source batch / map_dataframe": best["read: data source (batch)"]
            / best["read: map_dataframe"],
        },
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"input: {files} files x {keys} keys = {files * keys:,} rows; best of {repeat}")
    print(f"{'measure':<34} {'rows/s':>12}")
    for name, value in best.items():
        print(f"{name:<34} {value:>12,.0f}")
    for name, ratio in report["ratios"].items():
        print(f"{name:<45} {ratio:.2f}x")
    return 0


def _expect(count: int, wanted: int) -> None:
    if count != wanted:
        raise AssertionError(f"read {count} rows, expected {wanted}")


if __name__ == "__main__":
    sys.exit(main())
