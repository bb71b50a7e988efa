"""Spark fixtures: one local SparkSession for the whole session, quiet and small."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.broker import REPO

try:
    from pyspark.sql import SparkSession
except ImportError as exc:  # fail, never skip: a run without the extra must not look green
    raise ImportError(
        "PySpark is not installed: install the spark extra (scripts/test does), or leave "
        "these tests out with --ignore=tests/spark"
    ) from exc

from recipes.spark import MapSpec, close_maps

# Marks for every test module here. PySpark warns that it does not fully support pandas 3;
# nothing here uses pandas through PySpark.
SPARK_MARKS = [
    pytest.mark.spark,
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
]

# Every wait in these tests is bounded by this; none of them measures speed.
WAIT_S = 120.0


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """local[2], small memory, WARN logs; Python workers run this interpreter and import the
    repository (they are forked by PySpark's daemon, so they exercise fork safety too)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    path = os.environ.get("PYTHONPATH", "")
    if str(REPO) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), path) if p)
    session = (
        SparkSession.builder.master("local[2]")
        .appName("pulsar-state-tests")
        .config("spark.driver.memory", "768m")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.streaming.stopTimeout", "60s")
        .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("WARN")
    try:
        yield session
    finally:
        for query in session.streams.active:
            query.stop()
        session.stop()
        close_maps()


@pytest.fixture
def spec(service_url: str, admin_url: str, topic: str) -> MapSpec:
    """A spec for this test's fresh topic, with the tests' timeouts."""
    return MapSpec(service_url, topic, admin_url=admin_url, options=map_options())


def map_options(**more: Any) -> dict[str, Any]:
    return {
        "write_timeout_s": WAIT_S,
        "read_timeout_s": WAIT_S,
        "open_timeout_s": WAIT_S,
        **more,
    }
