"""SharedConfig: a typed config in a map, shared by jobs that run at the same time."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from pulsar_state import ConfigurationError
from recipes.spark import MapSpec, SharedConfig, get_map
from tests.spark.conftest import SPARK_MARKS, WAIT_S
from tests.spark.tasks import JobConfig, NeedsName
from tests.support.broker import REPO

pytestmark = SPARK_MARKS


def test_defaults_types_and_validation(spec: MapSpec) -> None:
    config = SharedConfig(spec, JobConfig)
    assert config.read() == JobConfig()  # nothing stored: the dataclass's defaults
    position = get_map(spec).position
    with pytest.raises(ConfigurationError, match="no field"):
        config.update(delay_threshold=60)
    with pytest.raises(ConfigurationError, match="is int"):
        config.update(delay_threshold_min="60")
    with pytest.raises(ConfigurationError, match="is int"):
        config.update(delay_threshold_min=True)
    with pytest.raises(ValueError, match=">= 0"):  # the dataclass's own validation
        config.update(delay_threshold_min=-1)
    assert get_map(spec).position == position  # nothing was written

    assert config.update(delay_threshold_min=60, ratio=1) == JobConfig(60, "default", 1.0)
    assert isinstance(config.read().ratio, float)
    assert config.write(JobConfig(5, "x", 0.25)) == JobConfig(5, "x", 0.25)
    assert get_map(spec).get("label") == "x"  # one key per field

    copy = pickle.loads(pickle.dumps(config))
    assert copy.read() == JobConfig(5, "x", 0.25)


def test_fields_without_default_and_prefixes(spec: MapSpec) -> None:
    needs = SharedConfig(spec, NeedsName, prefix="needs/")
    with pytest.raises(ConfigurationError, match="no default"):
        needs.read()
    assert needs.update(name="a") == NeedsName("a", 1)
    assert get_map(spec).get("needs/name") == "a"
    other = SharedConfig(spec, JobConfig, prefix="job/")
    assert other.read() == JobConfig()  # its own keys only
    with pytest.raises(ConfigurationError, match="dataclass"):
        SharedConfig(spec, dict)


def wait_until(condition: Callable[[], bool], queries: list[StreamingQuery]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        for query in queries:
            error = query.exception()
            if error is not None:
                raise AssertionError(f"query {query.name} failed: {error}")
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {WAIT_S}s")
        time.sleep(0.1)


def drop(directory: Path, name: str, rows: list[dict[str, Any]]) -> None:
    """Add a JSON-lines file to a streaming source directory, atomically (a rename)."""
    tmp = directory.parent / f".{directory.name}-{name}"
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, directory / name)


@pytest.mark.slow
def test_two_running_queries_and_another_process_share_config(
    spark: SparkSession, spec: MapSpec, tmp_path: Path
) -> None:
    """Query A re-reads the config at every batch; query B, running at the same time, changes
    it; then a separate process changes it again. Each change is in force for the first batch
    of A that starts after it completed."""
    # Separate replicas of the config in this driver (different specs): they meet at the broker.
    config_a = SharedConfig(spec.with_options(name="job-a"), JobConfig)
    config_b = SharedConfig(spec.with_options(name="job-b"), JobConfig)
    assert config_a.map is not config_b.map
    input_a, input_b = tmp_path / "in-a", tmp_path / "in-b"
    input_a.mkdir()
    input_b.mkdir()

    seen: list[tuple[int, int, int]] = []

    def job_a(batch: DataFrame, batch_id: int, config: JobConfig) -> None:
        late = batch.filter(batch.delay > config.delay_threshold_min).count()
        seen.append((batch_id, config.delay_threshold_min, late))

    applied: list[int] = []

    def job_b(batch: DataFrame, batch_id: int) -> None:
        for row in batch.collect():
            config_b.update(delay_threshold_min=row.threshold)
            applied.append(row.threshold)

    query_a = (
        spark.readStream.schema("delay LONG")
        .option("maxFilesPerTrigger", 1)
        .json(str(input_a))
        .writeStream.queryName("job_a")
        .foreachBatch(config_a.foreach_batch(job_a))
        .option("checkpointLocation", str(tmp_path / "cp-a"))
        .start()
    )
    query_b = (
        spark.readStream.schema("threshold LONG")
        .json(str(input_b))
        .writeStream.queryName("job_b")
        .foreachBatch(job_b)
        .option("checkpointLocation", str(tmp_path / "cp-b"))
        .start()
    )
    queries = [query_a, query_b]
    delays = [{"delay": d} for d in (5, 20, 45, 70, 100)]
    try:
        drop(input_a, "a0.json", delays)
        wait_until(lambda: len(seen) == 1, queries)
        assert seen[0][1:] == (15, 4)

        drop(input_b, "b0.json", [{"threshold": 60}])
        wait_until(lambda: applied == [60], queries)
        drop(input_a, "a1.json", delays)
        wait_until(lambda: len(seen) == 2, queries)
        assert seen[1][1:] == (60, 2)

        # Another application: a separate Python process using the config API.
        # It leaves its cached map open: the atexit hook closes it, and the process exits.
        code = (
            "from recipes.spark import MapSpec, SharedConfig\n"
            "from tests.spark.tasks import JobConfig\n"
            f"spec = MapSpec({spec.service_url!r}, {spec.topic!r}, admin_url={spec.admin_url!r})\n"
            "print(SharedConfig(spec, JobConfig).update(delay_threshold_min=90))\n"
        )
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, timeout=WAIT_S
        )
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        drop(input_a, "a2.json", delays)
        wait_until(lambda: len(seen) == 3, queries)
        assert seen[2][1:] == (90, 1)
        assert [batch_id for batch_id, _, _ in seen] == [0, 1, 2]
    finally:
        for query in queries:
            query.stop()


@dataclasses.dataclass(frozen=True)
class WithTimeout:
    timeout: float = 30.0
    retries: int = 3


def test_a_field_named_timeout_is_written_and_updated(spec: MapSpec) -> None:
    # Before: write() raised TypeError (timeout given twice) and update(timeout=60) was
    # taken as the call's timeout, changing nothing.
    config = SharedConfig(spec, WithTimeout)
    assert config.write(WithTimeout(5.0, 1)) == WithTimeout(5.0, 1)
    assert config.update({"timeout": 60.0}, retries=2) == WithTimeout(60.0, 2)
    assert config.update(retries=4, timeout=30.0) == WithTimeout(60.0, 4)  # the call's timeout
    assert config.read(latest=True) == WithTimeout(60.0, 4)


def test_an_update_of_only_the_call_timeout_is_refused_for_a_timeout_field(
    spec: MapSpec,
) -> None:
    config = SharedConfig(spec, WithTimeout)
    with pytest.raises(ConfigurationError, match="changes nothing"):
        config.update(timeout=60.0)  # the call's timeout: the field is update({"timeout": ...})
    assert config.update({}) == WithTimeout()  # an empty diff: nothing to do
