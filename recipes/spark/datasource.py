"""The ``pulsar-state`` Spark data source (Spark 4's Python Data Source API).

::

    from recipes.spark.datasource import register, spark_options
    register(spark)
    opts = spark_options(spec)                      # or service_url= / topic= / admin_url=

    # a map as a table, at one log position (columns key, value, version)
    spark.read.format("pulsar-state").options(**opts).load()
    spark.read.format("pulsar-state").options(**opts).option("at_position", 42).load()
    # its change feed: one row per change (position, kind, key, value, version)
    spark.readStream.format("pulsar-state").options(**opts).option("change_feed", "true").load()
    # an exactly-once streaming sink: one atomic write per micro-batch
    (df.writeStream.format("pulsar-state").options(**opts)
       .option("sink_id", "carriers").option("mode", "add")
       .option("key_column", "carrier").option("value_columns", "flights,delayed")
       .option("checkpointLocation", cp).start())

Options (all strings, as Spark passes them):

* Which map: ``spec`` (from :func:`spark_options`: a MapSpec with its codecs and timeouts), or
  ``service_url`` + ``topic`` (+ ``admin_url``) for the default codecs (str keys, JSON values).
  ``topic`` also overrides the spec's topic.
* Reads: ``key_type`` (``string``, default; ``long``; ``binary``), ``value_schema`` (a DDL type:
  none gives the value as JSON text; a struct such as ``"flights LONG, delayed LONG"`` gives
  one column per field; any other type one typed ``value`` column; a value that does not fit
  fails the read with a clear error), ``include_markers`` (``false``: the map's protected
  keys, sink markers and fences, are left out).
* Batch reads: ``at_position`` (default: the tail when the read is planned), ``partitions``
  (key ranges, default 1; every partition reads the same position).
* Change feed: ``change_feed=true`` (needed: Spark asks a source for one schema before it
  says whether the read is a stream), ``starting_position`` (``snapshot``, the default: the
  map's entries at the tail as ``put`` rows, then every change; ``earliest``: every change
  since position 0; ``latest``: changes after the tail; or a position).
* Streaming writes: ``sink_id`` (required; the query's progress in the map, keep it with the
  checkpoint), ``mode`` (``replace`` or ``add``), ``key_column`` (``key``), ``value_column``
  (``value``) or ``value_columns`` (comma separated: a dict of those columns). Output modes:
  ``append`` and ``update`` with either; ``complete`` only with ``replace`` (``add`` would
  count earlier batches again: refused), and a key that leaves the result stays in the map.
  The sink is not bound to a query (Spark does not tell a data source which): a new
  checkpoint with an old ``sink_id`` has its batches up to the stored one skipped.

Guarantees: a batch read is one state of the map, at one position. The change feed's offsets
are positions and a micro-batch ``(a, b]`` always yields the same rows, so Spark's checkpoint
makes it exactly once: a restarted query resumes at the committed position. The writer's
executors hand their rows to the driver in their commit messages, and the driver's ``commit``
makes ONE atomic write carrying the sink's marker and the batch id
(:meth:`recipes.spark.PulsarMapSink.write_rows`): a replayed batch changes nothing, an aborted
one writes nothing (unless its commit failed with an unknown outcome: then it may have been
written once, and its re-run is skipped), and a batch too big for one record fails with
RecordTooLargeError, never split.

Costs: reads at a position and the change feed replay the map's log in each Python worker
that serves them (once per worker process, then they follow the tail) and keep its changes in
memory. For the current state alone, a read whose worker's map is at the planned position
takes the state directly.

This module imports PySpark; :mod:`recipes.spark` itself does not.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import pickle
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
)

from pulsar_state import ConfigurationError, PulsarStateError
from recipes.map import PROTECTED_PREFIXES

from ._history import get_history
from ._sink import PulsarMapSink, SinkMode, combine_rows
from ._specs import MapSpec, get_map

if TYPE_CHECKING:
    from pyspark.sql import Row, SparkSession

__all__ = ["FORMAT", "PulsarStateDataSource", "register", "spark_options"]

logger = logging.getLogger("pulsar_state.spark")

#: The format name: ``spark.read.format(FORMAT)``.
FORMAT = "pulsar-state"


def register(spark: SparkSession) -> None:
    """Make ``format("pulsar-state")`` available in this session."""
    spark.dataSource.register(PulsarStateDataSource)


def spark_options(spec: MapSpec) -> dict[str, str]:
    """The data source options naming ``spec`` (its codecs and manager options included)."""
    return {"spec": base64.b64encode(pickle.dumps(spec, protocol=5)).decode("ascii")}


# ------------------------------------------------------------------------------- options


def _flag(options: dict[str, str], name: str, default: bool) -> bool:
    text = options.get(name)
    if text is None:
        return default
    if text.strip().lower() in ("true", "1", "yes"):
        return True
    if text.strip().lower() in ("false", "0", "no"):
        return False
    raise ConfigurationError(f"option {name} must be true or false, not {text!r}")


def _int_option(options: dict[str, str], name: str, *, minimum: int) -> int | None:
    text = options.get(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(f"option {name} must be an integer, not {text!r}") from None
    if value < minimum:
        raise ConfigurationError(f"option {name} must be >= {minimum}, not {value}")
    return value


def _spec_from(options: dict[str, str]) -> MapSpec:
    encoded = options.get("spec")
    topic = options.get("topic")
    if encoded is not None:
        try:
            spec = pickle.loads(base64.b64decode(encoded))
        except Exception as exc:
            raise ConfigurationError(
                f"option spec does not decode ({exc}); make it with spark_options(spec)"
            ) from exc
        if not isinstance(spec, MapSpec):
            raise ConfigurationError("option spec must come from spark_options(spec)")
        return dataclasses.replace(spec, topic=topic) if topic else spec
    service_url = options.get("service_url")
    if not service_url or not topic:
        raise ConfigurationError(
            "give the map: option spec (spark_options(spec)), or options service_url and topic"
        )
    return MapSpec(service_url, topic, admin_url=options.get("admin_url"))


_KEY_TYPES: dict[str, DataType] = {
    "string": StringType(),
    "long": LongType(),
    "binary": BinaryType(),
}


@dataclass(frozen=True)
class _Layout:
    """How map entries become columns: the key's type and the value's columns."""

    key_type: DataType
    value_schema: DataType | None  # None: JSON text
    include_markers: bool

    @staticmethod
    def of(options: dict[str, str]) -> _Layout:
        key_name = options.get("key_type", "string").strip().lower()
        if key_name not in _KEY_TYPES:
            raise ConfigurationError(
                f"option key_type must be one of {', '.join(_KEY_TYPES)}, not {key_name!r}"
            )
        ddl = options.get("value_schema")
        schema: DataType | None = None
        if ddl:
            schema = _parse_value_schema(ddl)
            if isinstance(schema, StructType):
                clash = {"key", "version", "position", "kind"} & set(schema.fieldNames())
                if clash:
                    raise ConfigurationError(
                        f"value_schema cannot have a field named {sorted(clash)[0]!r}"
                    )
        return _Layout(_KEY_TYPES[key_name], schema, _flag(options, "include_markers", False))

    def value_fields(self) -> list[StructField]:
        if self.value_schema is None:
            return [StructField("value", StringType(), True)]
        if isinstance(self.value_schema, StructType):
            return [StructField(f.name, f.dataType, True) for f in self.value_schema.fields]
        return [StructField("value", self.value_schema, True)]

    def keep(self, key: Any) -> bool:
        # The map's bookkeeping: sink markers, and the fences of recipes.fencing.
        return self.include_markers or not (
            isinstance(key, str) and key.startswith(PROTECTED_PREFIXES)
        )

    def key_cell(self, key: Any) -> Any:
        return _checked(key, self.key_type, f"key {key!r}")

    def value_cells(self, key: Any, value: Any) -> list[Any]:
        """The value's cells; None (a delete) gives nulls."""
        schema = self.value_schema
        if schema is None:
            if value is None:
                return [None]
            try:
                return [json.dumps(value, sort_keys=True, ensure_ascii=False)]
            except TypeError as exc:
                raise ConfigurationError(
                    f"value of {key!r} is not JSON ({exc}); give option value_schema"
                ) from exc
        if isinstance(schema, StructType):
            if value is None:
                return [None] * len(schema.fields)
            if not isinstance(value, dict):
                raise ConfigurationError(
                    f"value_schema is a struct but the value of {key!r} is a "
                    f"{type(value).__name__} ({value!r}), not a dict"
                )
            return [
                _checked(value.get(f.name), f.dataType, f"field {f.name!r} of the value of {key!r}")
                for f in schema.fields
            ]
        return [_checked(value, schema, f"the value of {key!r}")]


_SIMPLE_TYPES: dict[str, DataType] = {
    "string": StringType(),
    "long": LongType(),
    "bigint": LongType(),
    "int": IntegerType(),
    "integer": IntegerType(),
    "short": ShortType(),
    "smallint": ShortType(),
    "double": DoubleType(),
    "float": FloatType(),
    "boolean": BooleanType(),
    "binary": BinaryType(),
}


def _parse_value_schema(text: str) -> DataType:
    """A value schema: a simple type (``"long"``), fields of simple types (``"flights LONG,
    delayed LONG"``), or any type as Spark's JSON (``StructType(...).json()``).

    Parsed here because Spark's own DDL parser needs a session, and the data source's
    methods run in Python workers that have none."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            return _from_json(json.loads(stripped))
        except Exception as exc:
            raise ConfigurationError(
                f"option value_schema is not a Spark JSON schema ({exc}): {text!r}"
            ) from exc
    simple = _SIMPLE_TYPES.get(stripped.lower())
    if simple is not None:
        return simple
    fields: list[StructField] = []
    for part in stripped.split(","):
        words = part.split()
        data_type = _SIMPLE_TYPES.get(words[1].lower()) if len(words) == 2 else None
        if data_type is None:
            raise ConfigurationError(
                f"option value_schema {text!r} is not a type this source reads: give one of "
                f"{', '.join(sorted(_SIMPLE_TYPES))}, fields 'name TYPE, ...' of those, or "
                "any Spark type as JSON (schema.json())"
            )
        fields.append(StructField(words[0].strip("`"), data_type, True))
    return StructType(fields)


def _from_json(document: Any) -> DataType:
    from pyspark.sql.types import _parse_datatype_json_value

    parsed: DataType = _parse_datatype_json_value(document)
    return parsed


_INTEGRAL = (LongType, IntegerType, ShortType)
# Each integral type's bits: a value outside them failed in Arrow, naming nothing.
_BITS = {LongType: 64, IntegerType: 32, ShortType: 16}


def _fits_float32(number: float) -> bool:
    """Whether a float32 holds ``number`` (rounded; inf and nan too): beyond its range,
    Arrow made inf."""
    (rounded,) = struct.unpack("f", struct.pack("f", number))
    return math.isfinite(rounded) or not math.isfinite(number)


def _checked(cell: Any, data_type: DataType, what: str) -> Any:
    """``cell`` as Spark expects it for ``data_type``; a clear error when it does not fit
    (Spark's own would name neither the key nor the option)."""
    if cell is None:
        return None
    ok: bool
    if isinstance(data_type, _INTEGRAL):
        ok = isinstance(cell, int) and not isinstance(cell, bool)
        if ok:
            bits = _BITS[type(data_type)] - 1
            ok = -(1 << bits) <= cell < 1 << bits
    elif isinstance(data_type, DoubleType | FloatType):
        ok = isinstance(cell, int | float) and not isinstance(cell, bool)
        if ok:
            try:
                cell = float(cell)
            except OverflowError:  # an int too large for a double
                ok = False
            else:
                ok = not isinstance(data_type, FloatType) or _fits_float32(cell)
    elif isinstance(data_type, StringType):
        ok = isinstance(cell, str)
    elif isinstance(data_type, BooleanType):
        ok = isinstance(cell, bool)
    elif isinstance(data_type, BinaryType):
        ok = isinstance(cell, bytes | bytearray)
    else:
        ok = True  # nested types: Spark checks them
    if not ok:
        raise ConfigurationError(
            f"{what} is {cell!r} ({type(cell).__name__}), which does not fit the declared type "
            f"{data_type.simpleString()} (options value_schema / key_type)"
        )
    return cell


# --------------------------------------------------------------------------- the source


class PulsarStateDataSource(DataSource):  # type: ignore[misc,unused-ignore]
    """``format("pulsar-state")``: see the module's doc."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        options = dict(self.options)
        layout = _Layout.of(options)
        if _flag(options, "change_feed", False):
            return StructType(
                [
                    StructField("position", LongType(), False),
                    StructField("kind", StringType(), False),
                    StructField("key", layout.key_type, True),
                    *layout.value_fields(),
                    StructField("version", LongType(), False),
                ]
            )
        return StructType(
            [
                StructField("key", layout.key_type, False),
                *layout.value_fields(),
                StructField("version", LongType(), False),
            ]
        )

    def reader(self, schema: StructType) -> DataSourceReader:
        options = dict(self.options)
        if _flag(options, "change_feed", False):
            raise ConfigurationError("change_feed=true is for spark.readStream")
        return _SnapshotReader(_spec_from(options), _Layout.of(options), options)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        options = dict(self.options)
        if not _flag(options, "change_feed", False):
            raise ConfigurationError(
                "a stream of a pulsar-state map is its change feed: add "
                '.option("change_feed", "true") (Spark asks for the schema before it says '
                "whether the read is a stream)"
            )
        return _ChangeFeedReader(_spec_from(options), _Layout.of(options), options)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        options = dict(self.options)
        if overwrite and options.get("mode", "replace") == "add":
            # outputMode("complete") sends the whole result table each batch: adding it to
            # the map's values would count every earlier batch again.
            raise ConfigurationError(
                "mode=add adds each batch's rows to the map's values, but outputMode "
                '"complete" sends every row of the result each batch: use mode=replace (or '
                'outputMode "update" with add)'
            )
        return _StreamWriter(_spec_from(options), options, schema)


# ------------------------------------------------------------------------ batch reads


@dataclass(frozen=True)
class _KeyRange(InputPartition):  # type: ignore[misc,unused-ignore]
    """Keys ``low <= key < high`` (None: unbounded) of the map at ``position``."""

    position: int
    low: Any
    high: Any


class _SnapshotReader(DataSourceReader):  # type: ignore[misc,unused-ignore]
    def __init__(self, spec: MapSpec, layout: _Layout, options: dict[str, str]) -> None:
        self.spec = spec
        self.layout = layout
        self.at_position = _int_option(options, "at_position", minimum=0)
        self.partition_count = _int_option(options, "partitions", minimum=1) or 1

    def partitions(self) -> Sequence[InputPartition]:
        m = get_map(self.spec)
        tail = m.sync()
        position = tail if self.at_position is None else self.at_position
        if position > tail:
            raise ConfigurationError(
                f"at_position {position} is beyond the map's tail ({tail} records)"
            )
        keys = m.list_keys()  # split points only: any keys cut the range correctly
        count = min(self.partition_count, max(1, len(keys)))
        bounds = [keys[len(keys) * i // count] for i in range(1, count)]
        edges = [None, *bounds, None]
        return [_KeyRange(position, edges[i], edges[i + 1]) for i in range(count)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, _KeyRange)
        layout = self.layout
        for key, value, version in _entries_at(self.spec, partition):
            if layout.keep(key):
                yield (layout.key_cell(key), *layout.value_cells(key, value), int(version))


def _entries_at(spec: MapSpec, part: _KeyRange) -> list[tuple[Any, Any, int]]:
    """The entries of ``part``'s key range as of ``part.position``, in key order."""

    # In the map's own order: an int-keyed map a sink writes to holds str markers too.
    low = None if part.low is None else _in_map_order(part.low)
    high = None if part.high is None else _in_map_order(part.high)

    def wanted(key: Any) -> bool:
        ordered = _in_map_order(key)
        return (low is None or ordered >= low) and (high is None or ordered < high)

    m = get_map(spec)
    if m.position < part.position:
        m.wait_for(part.position)
    # The worker's map is exactly at the position (the usual case when nobody writes): its
    # state is the one asked for. The entries are taken in one step of its loop, so equal
    # positions before and after mean no record came in between.
    if m.position == part.position:
        entries = m.entries()
        if m.position == part.position:
            return [(k, e.value, int(e.version)) for k, e in entries if wanted(k)]
    state = get_history(spec).state_at(part.position)
    return [(k, state[k][0], int(state[k][1])) for k in _sorted(state) if wanted(k)]


_KEY_RANK = {int: 0, bytes: 1, str: 2}


def _in_map_order(key: Any) -> tuple[int, Any]:
    """What orders ``key`` among a map's keys of mixed types: ints, then bytes, then str."""
    return _KEY_RANK[type(key)], key


def _sorted(keys: Any) -> list[Any]:
    return sorted(keys, key=_in_map_order)


# ----------------------------------------------------------------------- change feed


@dataclass(frozen=True)
class _Changes(InputPartition):  # type: ignore[misc,unused-ignore]
    """The changes at positions ``(after, through]``, after the state at ``after`` as
    ``put`` rows when ``snapshot``."""

    after: int
    through: int
    snapshot: bool


class _ChangeFeedReader(DataSourceStreamReader):  # type: ignore[misc,unused-ignore]
    def __init__(self, spec: MapSpec, layout: _Layout, options: dict[str, str]) -> None:
        self.spec = spec
        self.layout = layout
        self.starting = options.get("starting_position", "snapshot").strip().lower()
        if self.starting not in ("snapshot", "earliest", "latest"):
            _int_option(options, "starting_position", minimum=0)  # a clear error if not

    def initialOffset(self) -> dict[str, Any]:
        if self.starting == "earliest":
            return {"position": 0, "snapshot": False}
        if self.starting in ("snapshot", "latest"):
            tail = get_map(self.spec).sync()
            return {"position": tail, "snapshot": self.starting == "snapshot"}
        return {"position": int(self.starting), "snapshot": False}

    def latestOffset(self, start: dict[str, Any], limit: Any) -> dict[str, Any]:
        tail = get_map(self.spec).sync()
        if tail <= start["position"] and not start.get("snapshot") and "from" in start:
            return start  # nothing new (after the first batch: Spark plans that one anyway)
        # A pending snapshot makes a batch of its own even with no change after it. The end
        # offset names the start it was planned from ("from"): Spark asks initialOffset()
        # again to run the first batch (and after a restart before that batch committed),
        # and "snapshot"/"latest" start at the tail as of each call; the batch Spark logged
        # must run from where it was planned, or changes come twice or not at all.
        planned = {"position": start["position"], "snapshot": bool(start.get("snapshot"))}
        return {"position": max(tail, start["position"]), "snapshot": False, "from": planned}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        if start == end and not start.get("snapshot"):
            return []
        origin = end.get("from", start)
        if origin["position"] > end["position"]:
            raise PulsarStateError(
                f"the change feed's batch would start at position {origin['position']}, after "
                f"its end {end['position']}: its offsets do not belong to this map's history"
            )
        return [_Changes(origin["position"], end["position"], bool(origin.get("snapshot")))]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, _Changes)
        layout = self.layout
        history = get_history(self.spec)
        if partition.snapshot:
            state = history.state_at(partition.after)
            for key in _sorted(state):
                if layout.keep(key):
                    value, version = state[key]
                    yield (
                        partition.after,
                        "put",
                        layout.key_cell(key),
                        *layout.value_cells(key, value),
                        int(version),
                    )
        for event in history.changes(partition.after, partition.through):
            if event.kind != "clear" and not layout.keep(event.key):
                continue
            key = None if event.key is None else layout.key_cell(event.key)
            yield (
                event.position,
                event.kind,
                key,
                *layout.value_cells(event.key, event.value),
                int(event.version),
            )

    def commit(self, end: dict[str, Any]) -> None:
        pass  # nothing to release: the history is per worker and follows the tail


# ----------------------------------------------------------------------- stream writes


@dataclass(frozen=True)
class _Rows(WriterCommitMessage):  # type: ignore[misc,unused-ignore]
    """One task's rows, combined as the batch's write will combine them."""

    rows: list[tuple[Any, Any]]


class _StreamWriter(DataSourceStreamWriter):  # type: ignore[misc,unused-ignore]
    def __init__(self, spec: MapSpec, options: dict[str, str], schema: StructType) -> None:
        sink_id = options.get("sink_id")
        if not sink_id:
            raise ConfigurationError(
                "option sink_id is required: it names the query's progress in the map "
                "(keep it with the checkpoint; a new checkpoint needs a new sink_id)"
            )
        mode = options.get("mode", "replace")
        if mode not in ("replace", "add"):
            raise ConfigurationError(f"option mode must be replace or add, not {mode!r}")
        self.mode: SinkMode = "add" if mode == "add" else "replace"
        self.spec = spec
        self.sink_id = sink_id
        self.key_column = options.get("key_column", "key")
        listed = options.get("value_columns")
        self.value_columns = [c.strip() for c in listed.split(",")] if listed else None
        self.value_column = options.get("value_column", "value")
        names = set(schema.fieldNames())
        wanted = [self.key_column, *(self.value_columns or [self.value_column])]
        missing = [c for c in wanted if c not in names]
        if missing:
            raise ConfigurationError(
                f"the stream has no column {missing[0]!r} (columns: {', '.join(schema.names)}); "
                "set options key_column and value_column / value_columns"
            )

    def _extractor(self) -> Callable[[Row], tuple[Any, Any]]:
        key = self.key_column
        if self.value_columns is not None:
            columns = self.value_columns
            return lambda row: (row[key], {c: row[c] for c in columns})
        column = self.value_column
        return lambda row: (row[key], row[column])

    def write(self, iterator: Iterator[Row]) -> _Rows:
        # On an executor: nothing is written here, the driver's commit writes the whole batch.
        extract = self._extractor()
        updates = combine_rows((extract(row) for row in iterator), self.mode, self.sink_id)
        return _Rows(list(updates.items()))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        if not all(isinstance(message, _Rows) for message in messages):
            # Spark commits only when every task succeeded; a missing part is never written.
            raise ConfigurationError(f"micro-batch {batchId}: a task sent no rows; not written")
        rows = [row for message in messages if isinstance(message, _Rows) for row in message.rows]
        result = self.sink().write_rows(rows, batchId)
        logger.info(
            "sink %s batch %d: %d keys, %s",
            self.sink_id,
            batchId,
            result.keys,
            "skipped (already in the map)" if result.skipped else f"position {result.position}",
        )

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        # (Spark also aborts when commit raised: a write whose outcome was unknown may have
        # landed, and then the batch's re-run is skipped by the marker.)
        logger.warning(
            "sink %s batch %d aborted: nothing written by the abort (a commit that failed with "
            "an unknown outcome may have written the batch; its re-run is then skipped)",
            self.sink_id,
            batchId,
        )

    def sink(self) -> PulsarMapSink:
        """The sink whose exactly-once write this writer's commit makes."""
        return PulsarMapSink(self.spec, self.sink_id, mode=self.mode)
