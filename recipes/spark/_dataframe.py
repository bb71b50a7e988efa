"""map_dataframe: one consistent snapshot of a map, with versions, as a DataFrame."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pulsar_state import ConfigurationError
from recipes import thaw
from recipes.map import PROTECTED_PREFIXES

from ._specs import MapSpec, get_map

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType

__all__ = ["map_dataframe"]


def map_dataframe(
    spark: SparkSession,
    spec: MapSpec,
    *,
    latest: bool = True,
    value_schema: DataType | str | None = None,
    with_version: bool = True,
    include_markers: bool = False,
    timeout: float | None = None,
) -> DataFrame:
    """A DataFrame holding one consistent snapshot of the map, taken on the driver.

    The snapshot is every entry of one state of the map (never a mix of two); with
    ``latest=True`` (default) it includes every write completed before the call, in any
    process. Columns: ``key`` (string, long or binary, from the keys), then the value, then
    ``version`` (the key's :class:`~recipes.MapVersion` as a long: the change that last set
    it; omitted when ``with_version=False``). Rows are in key order.

    The value, by ``value_schema``:

    * None: one ``value`` column holding the value as JSON text (sorted keys);
    * a ``StructType`` or a DDL string with fields (``"flights LONG, delayed LONG"``): each
      dict value is expanded to one column per field (missing fields are null, other keys are
      ignored; ints are widened to float/double fields);
    * any other type (``"double"``, ``"string"``, ``"binary"``...): one ``value`` column.

    The map's protected keys (sink markers and fences: ``recipes.map.PROTECTED_PREFIXES``) are
    left out unless ``include_markers=True``. The snapshot travels from the driver, so this is
    for maps that fit in the driver's memory (which every PulsarMap does: each replica holds
    it all).
    """
    from pyspark.sql.types import (
        BinaryType,
        DataType,
        DoubleType,
        FloatType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    entries = get_map(spec, timeout=timeout).entries(latest=latest, timeout=timeout)
    # Plain dicts and lists for Spark: its JVM side unpickles rows, and knows no FrozenDict.
    rows = [(key, thaw(entry.value), entry.version) for key, entry in entries]
    if not include_markers:
        rows = [
            r for r in rows if not (isinstance(r[0], str) and r[0].startswith(PROTECTED_PREFIXES))
        ]

    key_types = {type(r[0]) for r in rows}
    key_type: DataType
    if key_types <= {str}:
        key_type = StringType()
    elif key_types == {int}:
        key_type = LongType()
    elif key_types == {bytes}:
        key_type = BinaryType()
    else:
        raise ConfigurationError(f"keys of mixed types cannot form one column: {key_types}")

    schema = DataType.fromDDL(value_schema) if isinstance(value_schema, str) else value_schema
    fields = [StructField("key", key_type, False)]
    out: list[list[Any]] = []
    if isinstance(schema, StructType):
        clash = {"key", "version"} & set(schema.fieldNames())
        if clash:
            raise ConfigurationError(f"value_schema cannot have a field named {clash.pop()!r}")
        fields += [StructField(f.name, f.dataType, True) for f in schema.fields]
        widen = {f.name for f in schema.fields if isinstance(f.dataType, DoubleType | FloatType)}
        for key, value, _version in rows:
            if not isinstance(value, dict):
                raise ConfigurationError(
                    f"value of {key!r} is a {type(value).__name__}, not a dict to expand"
                )
            out.append(
                [key] + [_widen(value.get(n)) if n in widen else value.get(n) for n in schema.names]
            )
    elif schema is None:
        fields.append(StructField("value", StringType(), False))
        for key, value, _version in rows:
            try:
                text = json.dumps(value, sort_keys=True, ensure_ascii=False)
            except TypeError as exc:
                raise ConfigurationError(
                    f"value of {key!r} is not JSON ({exc}); pass value_schema="
                ) from exc
            out.append([key, text])
    else:
        fields.append(StructField("value", schema, True))
        floating = isinstance(schema, DoubleType | FloatType)
        out = [[key, _widen(value) if floating else value] for key, value, _ in rows]
    if with_version:
        fields.append(StructField("version", LongType(), False))
        for row, (_key, _value, version) in zip(out, rows, strict=True):
            row.append(int(version))  # a plain int: Spark checks the exact type
    return spark.createDataFrame(out, StructType(fields))


def _widen(value: Any) -> Any:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value
