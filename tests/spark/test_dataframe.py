"""map_dataframe: a consistent snapshot of a map, as a DataFrame equal to the map."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.types import DoubleType, LongType, StringType

from pulsar_state import ConfigurationError
from recipes import SyncPulsarMap
from recipes.spark import MapSpec, PulsarMapSink, map_dataframe
from tests.spark.conftest import SPARK_MARKS, WAIT_S

pytestmark = SPARK_MARKS


def expected_rows(m: SyncPulsarMap[Any, Any]) -> list[tuple[str, Any, int]]:
    """The map's own entries, read key by key (no concurrent writers here)."""
    rows = []
    for key, value in m.all(latest=True):
        entry = m.entry(key)
        assert entry is not None
        rows.append((key, value, entry.version))
    return rows


def test_dataframe_equals_the_map(spark: SparkSession, spec: MapSpec) -> None:
    # Written through another replica than the one map_dataframe reads from (latest=True).
    with spec.new_map() as writer:
        writer.put_all(
            {f"c{i:02}": {"flights": i, "delayed": i // 2, "name": f"n{i}"} for i in range(20)}
        )
        writer.put("c03", {"flights": 300, "delayed": 7, "name": "changed"})  # a later version
        writer.delete("c05")
        PulsarMapSink(spec, "s1").write_rows([("c00", {"flights": 0, "delayed": 0})], 0)
        writer.put("__fence__/db", 4)  # recipes.fencing's: left out as the markers are
        expected = [r for r in expected_rows(writer) if not r[0].startswith("__")]
        marker = writer.entry("__sink__/s1")
        assert marker is not None

        df = map_dataframe(spark, spec)
        assert [(f.name, f.dataType) for f in df.schema.fields] == [
            ("key", StringType()),
            ("value", StringType()),
            ("version", LongType()),
        ]
        got = [(r.key, json.loads(r.value), r.version) for r in df.collect()]
        assert got == expected
        assert len({version for _, _, version in got}) > 1

        expanded = map_dataframe(
            spark, spec, value_schema="flights LONG, delayed DOUBLE, missing STRING"
        )
        assert expanded.columns == ["key", "flights", "delayed", "missing", "version"]
        assert expanded.schema["delayed"].dataType == DoubleType()
        assert [tuple(r) for r in expanded.collect()] == [
            (k, v["flights"], float(v["delayed"]), None, version) for k, v, version in expected
        ]
        # Spark computes on it like on any DataFrame.
        total = expanded.groupBy().sum("flights").collect()[0][0]
        assert total == sum(v["flights"] for _, v, _ in expected)

        with_markers = map_dataframe(spark, spec, include_markers=True, with_version=False)
        assert with_markers.columns == ["key", "value"]
        assert {("__sink__/s1", "0"), ("__fence__/db", "4")} <= {
            tuple(r) for r in with_markers.collect()
        }


def test_scalar_values_and_int_keys(
    spark: SparkSession, service_url: str, admin_url: str, topic: str
) -> None:
    from pulsar_state import JsonCodec

    ints = MapSpec(
        service_url,
        topic,
        admin_url=admin_url,
        key_codec=JsonCodec(),
        options={"read_timeout_s": WAIT_S, "write_timeout_s": WAIT_S},
    )
    with ints.new_map() as writer:
        writer.put_all({3: 1.5, 1: 2, 2: 7})
    df = map_dataframe(spark, ints, value_schema="double")
    assert df.schema["key"].dataType == LongType()
    assert [(r.key, r.value) for r in df.collect()] == [(1, 2.0), (2, 7.0), (3, 1.5)]


def test_empty_map_and_bad_schemas(spark: SparkSession, spec: MapSpec) -> None:
    assert map_dataframe(spark, spec).collect() == []
    with spec.new_map() as writer:
        writer.put("a", 1)
    with pytest.raises(ConfigurationError, match="not a dict"):
        map_dataframe(spark, spec, value_schema="n LONG")
    with pytest.raises(ConfigurationError, match="'version'"):
        map_dataframe(spark, spec, value_schema="version LONG")
