"""PySpark integration: PulsarMaps from drivers and executors, shared config, DataFrames, a sink.

Install with the ``spark`` extra (PySpark 4.x). Four pieces, all built on
:class:`recipes.PulsarMap`:

* :class:`MapSpec`: what to connect to (service URL, topic, admin URL, codecs, options). A spec
  pickles; a live client never does. :func:`get_map` (or ``spec.open()``) turns it into the
  process's own open :class:`recipes.SyncPulsarMap`, cached per process: one per spec in the
  driver, one per spec in each Python worker, whatever the number of tasks.
* :class:`SharedConfig`: a typed config (a dataclass) kept in a map; a batch job reads it at
  start, a streaming job re-reads it at the start of every micro-batch
  (:meth:`SharedConfig.foreach_batch`), and any process may change it with
  :meth:`SharedConfig.update`.
* :func:`map_dataframe`: a consistent snapshot of a map as a DataFrame.
* :class:`PulsarMapSink`: an exactly-once ``foreachBatch`` sink. Each micro-batch is ONE atomic
  write that carries the sink's id and the batch id; the map refuses a batch id it already
  holds, so a query restarted from its checkpoint never applies a batch twice.

Fork safety: pulsar-client and the portal's event-loop thread do not survive ``fork`` (PySpark
forks its Python workers). The cache is keyed by process: a forked child drops the entries it
inherited, without closing them (closing would act on the parent's connections), and opens its
own. Maps still cached at interpreter exit are closed (``atexit``).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import decimal
import hashlib
import json
import logging
import os
import pickle
import threading
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from pulsar_state import (
    BlockingPortal,
    ClosedError,
    Codec,
    ConfigurationError,
    PulsarStateError,
    RecordTooLargeError,
    WriteOutcomeUnknownError,
)
from recipes import SyncPulsarMap

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType

__all__ = [
    "SINK_MARKER_PREFIX",
    "MapSpec",
    "PulsarMapSink",
    "SharedConfig",
    "SinkMode",
    "SinkResult",
    "close_maps",
    "get_map",
    "map_dataframe",
]

logger = logging.getLogger("pulsar_state.spark")

C = TypeVar("C")

#: Keys under this prefix hold exactly-once sink markers (see :class:`PulsarMapSink`).
SINK_MARKER_PREFIX = "__sink__/"

# Options a spec cannot carry: the map sets the first ones, and the cache supplies the portal.
_RESERVED_OPTIONS = frozenset(
    {"initial_state", "apply", "codec", "copy_state", "begin_record", "portal", "admin_url"}
)
# Bounds the wait for a cached map's local call (no I/O): only a stuck loop reaches it.
_LOCAL_TIMEOUT_S = 30.0


# ---------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class MapSpec:
    """How to reach one PulsarMap: picklable, so it can travel to Spark executors.

    Args:
        service_url: the broker's service URL (``pulsar://host:6650``).
        topic: the map's topic.
        admin_url: the broker's admin REST URL (default derived from the service URL).
        key_codec / value_codec: the map's codecs (default: str keys, JSON values). They
            travel with the spec, so they must pickle.
        options: other :class:`~pulsar_state.SharedStateManager` options (timeouts,
            ``max_record_bytes``, ``name``...). They must pickle too.

    Two specs with equal fields name the same cached map in a process (see :func:`get_map`).
    A spec that cannot be pickled is refused here, not on an executor.
    """

    service_url: str
    topic: str
    admin_url: str | None = None
    key_codec: Codec[Any] | None = None
    value_codec: Codec[Any] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.service_url, str) or not self.service_url:
            raise ConfigurationError("service_url must be a service URL string (a spec pickles)")
        if not isinstance(self.topic, str) or not self.topic:
            raise ConfigurationError("topic must be a non-empty string")
        reserved = sorted(_RESERVED_OPTIONS & set(self.options))
        if reserved:
            raise ConfigurationError(f"a MapSpec cannot carry {', '.join(reserved)} in options")
        object.__setattr__(self, "options", dict(self.options))
        try:
            identity = pickle.dumps(
                (
                    self.service_url,
                    self.topic,
                    self.admin_url,
                    self.key_codec,
                    self.value_codec,
                    sorted(self.options.items()),
                ),
                protocol=5,
            )
        except Exception as exc:
            raise ConfigurationError(f"a MapSpec must pickle (codecs and options): {exc}") from exc
        # Equal specs pickle to equal bytes: the cache key, stable across processes.
        object.__setattr__(self, "_key", hashlib.sha256(identity).hexdigest())

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MapSpec) and other.key == self.key

    @property
    def key(self) -> str:
        """A digest of every field: equal specs have equal keys (in any process)."""
        return str(self.__dict__["_key"])

    def with_options(self, **options: Any) -> MapSpec:
        """This spec with more (or other) manager options."""
        return dataclasses.replace(self, options={**self.options, **options})

    def open(self, *, timeout: float | None = None) -> SyncPulsarMap[Any, Any]:
        """This process's cached, open map for this spec (see :func:`get_map`)."""
        return get_map(self, timeout=timeout)

    def new_map(self, *, portal: BlockingPortal | None = None) -> SyncPulsarMap[Any, Any]:
        """A new, unopened, uncached map for this spec (the caller opens and closes it)."""
        return SyncPulsarMap(
            self.service_url,
            self.topic,
            key_codec=self.key_codec,
            value_codec=self.value_codec,
            portal=portal,
            admin_url=self.admin_url,
            **self.options,
        )

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SPEC_FIELDS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.__post_init__()


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(MapSpec))


# ---------------------------------------------------------------------------------- the cache


class _Cache:
    """This process's open maps, one per spec, sharing one portal (one event-loop thread)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.maps: dict[str, SyncPulsarMap[Any, Any]] = {}
        self.portal: BlockingPortal | None = None


_cache = _Cache()
# What a forked child inherited: never used, never closed. Kept referenced so that no
# finalizer of the parent's client runs in the child while it lives.
_inherited: list[_Cache] = []


def _after_fork_in_child() -> None:
    global _cache
    # The parent's lock may have been held by another thread at fork: replace it too.
    _inherited.append(_cache)
    _cache = _Cache()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _current_cache() -> _Cache:
    # register_at_fork covers os.fork(); the pid check also covers a fork that bypassed it.
    if _cache.pid != os.getpid():
        _after_fork_in_child()
    return _cache


def get_map(spec: MapSpec, *, timeout: float | None = None) -> SyncPulsarMap[Any, Any]:
    """The open map for ``spec`` in this process, opened (replayed) on first use and cached.

    Safe from any thread; the first call for a spec opens the map (up to ``timeout``, default
    the spec's ``open_timeout_s``), later calls return the same object. In a forked child
    (a PySpark worker), the maps inherited from the parent are ignored and the child opens its
    own. Do not close the returned map yourself: :func:`close_maps` does (and runs at exit);
    a cached map found closed is replaced by a new one.
    """
    cache = _current_cache()
    with cache.lock:
        cached = cache.maps.get(spec.key)
        if cached is not None:
            try:
                len(cached)  # local, no I/O; raises ClosedError if someone closed it
                return cached
            except ClosedError:
                del cache.maps[spec.key]
        if cache.portal is None:
            cache.portal = BlockingPortal(name="pulsar-state-spark")
        new = spec.new_map(portal=cache.portal)
        try:
            new.open(timeout=timeout)
        except BaseException:
            _close_quietly(new)
            raise
        cache.maps[spec.key] = new
        return new


def _close_quietly(m: SyncPulsarMap[Any, Any]) -> None:
    try:
        m.close()
    except Exception as exc:  # closing is best effort: the process is done with it
        logger.warning("closing the map on %s failed: %s", m.topic, exc)


def close_maps() -> None:
    """Close every map this process cached (and their portal). Runs at interpreter exit."""
    cache = _current_cache()
    with cache.lock:
        maps, cache.maps = list(cache.maps.values()), {}
        portal, cache.portal = cache.portal, None
    for m in maps:
        _close_quietly(m)
    if portal is not None:
        portal.stop()


atexit.register(close_maps)


# ---------------------------------------------------------------------------------- config


_SIMPLE_TYPES: tuple[type, ...] = (bool, int, float, str)


class SharedConfig(Generic[C]):
    """A typed configuration, an instance of a dataclass, kept in a PulsarMap.

    Each field is one key (``prefix + field name``) holding a JSON value; a field with no key
    in the map takes the dataclass's default (a field with no default must be set before it
    is read). Keys of the map that are not fields are ignored, so a newer job may add fields.
    Fields annotated ``bool``, ``int``, ``float`` or ``str`` are type-checked when written
    and read; the dataclass's own ``__post_init__`` validation runs on every change, on the
    up-to-date config, before anything is written.

    ::

        @dataclass(frozen=True)
        class JobConfig:
            delay_threshold_min: int = 15

        config = SharedConfig(MapSpec(url, "job-config"), JobConfig)
        config.read().delay_threshold_min                      # batch job: read at start
        query = df.writeStream.foreachBatch(config.foreach_batch(process)).start()  # streaming
        config.update(delay_threshold_min=60)                  # any process, any time

    A SharedConfig pickles (it holds the spec, the type and the prefix).
    """

    def __init__(
        self,
        spec: MapSpec,
        config_type: type[C],
        *,
        prefix: str = "",
        timeout: float | None = None,
    ) -> None:
        if not (isinstance(config_type, type) and dataclasses.is_dataclass(config_type)):
            raise ConfigurationError("config_type must be a dataclass type")
        self.spec = spec
        self.config_type = config_type
        self.prefix = prefix
        self.timeout = timeout
        self._fields = {f.name: f for f in dataclasses.fields(config_type) if f.init}
        self._keys = {prefix + name: name for name in self._fields}
        self._types = _simple_field_types(config_type)

    @property
    def map(self) -> SyncPulsarMap[Any, Any]:
        """This process's cached map holding the config."""
        return get_map(self.spec, timeout=self.timeout)

    def read(self, *, latest: bool = True, timeout: float | None = None) -> C:
        """The current config, from one consistent state of the map.

        ``latest=True`` (default) is linearizable: it reflects every change that completed
        before this call, in any process. ``latest=False`` reads this process's replica only
        (no I/O; it may lag other processes).
        """
        values: dict[str, Any] = {}
        keys = self._keys

        def collect(key: Any, value: Any) -> None:
            values[keys[key]] = value

        self.map.scan(
            lambda key: key in keys,
            collect,
            latest=latest,
            timeout=self._timeout(timeout),
        )
        return self._build(values)

    def update(self, *, timeout: float | None = None, **changes: Any) -> C:
        """Change some fields in ONE atomic write, validated on the up-to-date config.

        Unknown field names and values of the wrong type raise :class:`ConfigurationError`
        before anything is written; so does the dataclass's own validation (its exception
        is raised as is). Returns the config as this process sees it right after the write
        (so it includes the change).
        """
        unknown = sorted(set(changes) - set(self._fields))
        if unknown:
            raise ConfigurationError(
                f"{self.config_type.__name__} has no field {', '.join(unknown)}"
            )
        for name, value in changes.items():
            self._check_type(name, value)
        keys = self._keys
        prefix = self.prefix

        def fn(view: Mapping[Any, Any]) -> Mapping[Any, Any]:
            current = {keys[k]: view[k] for k in keys if k in view}
            self._build({**current, **changes})  # validate the result before writing
            return {prefix + name: value for name, value in changes.items()}

        self.map.transact(fn, timeout=self._timeout(timeout))
        return self.read(latest=False)

    def write(self, config: C, *, timeout: float | None = None) -> C:
        """Store every field of ``config`` in ONE atomic write (defaults included)."""
        if not isinstance(config, self.config_type):
            raise ConfigurationError(f"expected a {self.config_type.__name__}")
        values = {name: getattr(config, name) for name in self._fields}
        return self.update(timeout=timeout, **values)

    def foreach_batch(
        self, fn: Callable[[DataFrame, int, C], object]
    ) -> Callable[[DataFrame, int], None]:
        """Wrap ``fn(batch_df, batch_id, config)`` for ``writeStream.foreachBatch``.

        At the start of each micro-batch the config is re-read with a linearizable read
        (``read(latest=True)``), so a change that completed before a batch starts is in force
        for that whole batch and every later one, and never changes in the middle of a
        batch. Spark runs foreachBatch functions on the driver, so this is one read per batch.
        """

        def run(batch: DataFrame, batch_id: int) -> None:
            fn(batch, batch_id, self.read(latest=True))

        return run

    # -------------------------------------------------------------- helpers

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _check_type(self, name: str, value: Any) -> None:
        expected = self._types.get(name)
        if expected is None:
            return
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ConfigurationError(
                f"{self.config_type.__name__}.{name} is {expected.__name__}, "
                f"not {type(value).__name__} ({value!r})"
            )

    def _build(self, values: Mapping[str, Any]) -> C:
        kwargs: dict[str, Any] = {}
        for name, value in values.items():
            self._check_type(name, value)
            kwargs[name] = float(value) if self._types.get(name) is float else value
        missing = [
            name
            for name, f in self._fields.items()
            if name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigurationError(
                f"{self.config_type.__name__} field(s) {', '.join(missing)} have no default and "
                f"are not set in {self.spec.topic}"
            )
        return self.config_type(**kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "config_type": self.config_type,
            "prefix": self.prefix,
            "timeout": self.timeout,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["spec"], state["config_type"], prefix=state["prefix"], timeout=state["timeout"]
        )

    def __repr__(self) -> str:
        return f"SharedConfig({self.config_type.__name__}, topic={self.spec.topic!r})"


def _simple_field_types(config_type: type[Any]) -> dict[str, type]:
    try:
        hints = typing.get_type_hints(config_type)
    except Exception:  # unresolvable annotations: no type checks, the dataclass validates
        return {}
    return {name: hint for name, hint in hints.items() if hint in _SIMPLE_TYPES}


# ---------------------------------------------------------------------------------- DataFrames


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
    ``version`` (the position of the write that last changed the key; omitted when
    ``with_version=False``). Rows are in key order.

    The value, by ``value_schema``:

    * None: one ``value`` column holding the value as JSON text (sorted keys);
    * a ``StructType`` or a DDL string with fields (``"flights LONG, delayed LONG"``): each
      dict value is expanded to one column per field (missing fields are null, other keys are
      ignored; ints are widened to float/double fields);
    * any other type (``"double"``, ``"string"``, ``"binary"``...): one ``value`` column.

    Sink markers (keys under ``SINK_MARKER_PREFIX``) are left out unless
    ``include_markers=True``. The snapshot travels from the driver, so this is for maps that
    fit in the driver's memory (which every PulsarMap does: each replica holds it all).
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

    m = get_map(spec, timeout=timeout)
    rows = _snapshot(m, latest=latest, timeout=timeout)
    if not include_markers:
        rows = [
            r for r in rows if not (isinstance(r[0], str) and r[0].startswith(SINK_MARKER_PREFIX))
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
            row.append(version)
    return spark.createDataFrame(out, StructType(fields))


def _widen(value: Any) -> Any:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _snapshot(
    m: SyncPulsarMap[Any, Any], *, latest: bool, timeout: float | None
) -> list[tuple[Any, Any, int]]:
    """(key, value, version) of every entry, from one state of the map, in key order."""
    amap = m.async_map
    read_timeout = amap.manager.read_timeout_s if timeout is None else timeout

    async def take() -> list[tuple[Any, Any, int]]:
        if latest:
            await amap.sync(timeout=read_timeout)
        # A watch starts with a snapshot of the map with versions. changes() and len() run in
        # the same step of the event loop, so no record is applied between them: exactly
        # len() initial events are queued, and reading them never waits.
        watch = amap.changes(snapshot=True)
        count = len(amap)
        try:
            events = [await watch.next(timeout=read_timeout) for _ in range(count)]
        finally:
            watch.close()
        result: list[tuple[Any, Any, int]] = []
        for event in events:
            if event is None or not event.initial:  # the watch was closed under us
                raise ClosedError(f"the snapshot of {amap.topic} was interrupted")
            result.append((event.key, event.value, event.version))
        return result

    return m.portal.call(take, timeout=2 * read_timeout + 5.0)


# ---------------------------------------------------------------------------------- the sink


SinkMode = Literal["replace", "add"]


@dataclass(frozen=True)
class SinkResult:
    """What one :meth:`PulsarMapSink.write` did.

    ``skipped`` is True when the map already held this batch id for this sink (a batch
    replayed after a restart, or an earlier attempt of the same call that did commit): then
    nothing was changed. ``position`` is the write's position when it changed the map.
    """

    batch_id: int
    keys: int
    skipped: bool
    position: int | None


class PulsarMapSink:
    """An exactly-once ``foreachBatch`` sink that upserts each micro-batch into a PulsarMap.

    ::

        sink = PulsarMapSink(spec, "carrier-delays", mode="add",
                             key_column="carrier", value_columns=["flights", "delayed"])
        query = deltas.writeStream.foreachBatch(sink).option("checkpointLocation", cp).start()

    How it is exactly once: each micro-batch becomes ONE atomic write
    (:meth:`recipes.PulsarMap.transact`) holding the batch's upserts and the sink's marker,
    the key ``"__sink__/<sink_id>"`` of the same map, set to the batch id. The write is
    decided on the up-to-date map under the topic's exclusive writer: if the marker already
    holds this batch id or a later one, it changes nothing. Spark re-runs the last batch
    with the same id (and the same data) after a restart from its checkpoint, so a batch is
    counted once whether or not its first run committed, even if two drivers race. A write
    that failed or timed out is retried (``retries`` times) for the same reason.

    Modes: ``"replace"`` sets each key to its row's value (None deletes the key);
    ``"add"`` adds the row's value to the current one (absent counts as zero): numbers, or
    dicts of numbers (added field by field). Several rows with the same key in one batch are
    added up in ``"add"`` mode; in ``"replace"`` mode the last one collected wins.

    Values: ``value_column`` (one column, default ``"value"``) or ``value_columns`` (a dict
    of those columns); Spark values are converted to JSON-friendly ones (Decimal to int or
    float, dates to ISO text, structs to dicts). The map's key codec must accept the str
    marker key and its value codec the int batch id: the default codecs (str keys, JSON
    values) do.

    Size: the whole batch is collected on the driver and must fit in one record
    (``max_record_bytes`` of the spec, 1 MiB by default, at most about 4.5 MB under the
    broker's 5 MB message limit). A bigger batch fails with :class:`RecordTooLargeError`
    and writes nothing: it is never split into several, non-atomic, writes. Bound the batch
    size with the source (``maxFilesPerTrigger``, ``maxOffsetsPerTrigger``...).

    ``sink_id`` names the query's progress in the map: keep it with the checkpoint. A new
    query on a new checkpoint starts again from batch 0, so it needs a new sink id (or
    :meth:`reset`).
    """

    def __init__(
        self,
        spec: MapSpec,
        sink_id: str,
        *,
        key_column: str = "key",
        value_column: str | None = "value",
        value_columns: Sequence[str] | None = None,
        mode: SinkMode = "replace",
        timeout: float | None = None,
        retries: int = 3,
    ) -> None:
        if not sink_id:
            raise ConfigurationError("sink_id must be a non-empty string")
        if mode not in ("replace", "add"):
            raise ConfigurationError(f"mode must be 'replace' or 'add', not {mode!r}")
        if value_columns is not None and not value_columns:
            raise ConfigurationError("value_columns must name at least one column")
        if value_columns is None and value_column is None:
            raise ConfigurationError("give value_column or value_columns")
        if retries < 0:
            raise ConfigurationError("retries must be >= 0")
        self.spec = spec
        self.sink_id = sink_id
        self.key_column = key_column
        self.value_column = value_column
        self.value_columns = list(value_columns) if value_columns is not None else None
        self.mode: SinkMode = mode
        self.timeout = timeout
        self.retries = retries

    @property
    def marker_key(self) -> str:
        """The map key holding the id of the last batch this sink applied."""
        return SINK_MARKER_PREFIX + self.sink_id

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        """``writeStream.foreachBatch(sink)`` calls this for each micro-batch."""
        self.write(batch, batch_id)

    def write(self, batch: DataFrame, batch_id: int) -> SinkResult:
        """Upsert the rows of ``batch`` as micro-batch ``batch_id`` (see the class doc)."""
        columns = self.value_columns if self.value_columns is not None else [self.value_column]
        rows = batch.select(self.key_column, *columns).collect()
        if self.value_columns is not None:
            names = self.value_columns
            pairs = [(row[0], {n: row[i + 1] for i, n in enumerate(names)}) for row in rows]
        else:
            pairs = [(row[0], row[1]) for row in rows]
        return self.write_rows(pairs, batch_id)

    def write_rows(self, rows: Iterable[tuple[Any, Any]], batch_id: int) -> SinkResult:
        """Upsert ``(key, value)`` pairs as micro-batch ``batch_id``: the same as :meth:`write`
        for rows already on the driver."""
        if isinstance(batch_id, bool) or not isinstance(batch_id, int) or batch_id < 0:
            raise ConfigurationError(f"batch_id must be an int >= 0, not {batch_id!r}")
        updates = self._combine(rows)
        marker = self.marker_key
        mode = self.mode

        def fn(view: Mapping[Any, Any]) -> Mapping[Any, Any]:
            last = view.get(marker)
            if last is not None and (isinstance(last, bool) or not isinstance(last, int)):
                raise ConfigurationError(f"{marker} holds {last!r}, not a batch id")
            if last is not None and last >= batch_id:
                return {}  # this batch (or a later one) is already in the map
            changes: dict[Any, Any]
            if mode == "add":
                changes = {k: _add(view.get(k), d, k) for k, d in updates.items()}
            else:
                changes = dict(updates)
            changes[marker] = batch_id
            return changes

        m = get_map(self.spec, timeout=self.timeout)
        attempt = 0
        while True:
            try:
                position = m.transact(fn, timeout=self.timeout)
                break
            except RecordTooLargeError as exc:
                raise RecordTooLargeError(
                    f"micro-batch {batch_id} of sink {self.sink_id!r} ({len(updates)} keys) "
                    f"does not fit in one write of at most {exc.limit} bytes "
                    f"(max_record_bytes); nothing was written. Make batches smaller "
                    "(maxFilesPerTrigger, maxOffsetsPerTrigger...) or raise max_record_bytes "
                    "in the MapSpec options (up to about 4.5 MB)",
                    size=exc.size,
                    limit=exc.limit,
                ) from exc
            except PulsarStateError as exc:
                # Safe to retry, even when the outcome is unknown: the marker makes a second
                # commit of this batch impossible.
                retriable = exc.retriable or isinstance(exc, WriteOutcomeUnknownError)
                if not retriable or attempt >= self.retries:
                    raise
                attempt += 1
                logger.warning(
                    "sink %s batch %d: %s; retrying (%d/%d)",
                    self.sink_id,
                    batch_id,
                    exc,
                    attempt,
                    self.retries,
                )
        return SinkResult(batch_id, len(updates), position is None, position)

    def last_batch_id(self, *, latest: bool = True, timeout: float | None = None) -> int | None:
        """The id of the last batch this sink applied, or None if none was."""
        value = get_map(self.spec, timeout=self.timeout).get(
            self.marker_key, latest=latest, timeout=timeout if timeout is not None else self.timeout
        )
        return None if value is None else int(value)

    def reset(self, *, timeout: float | None = None) -> None:
        """Forget this sink's progress (for a new query on a new checkpoint)."""
        get_map(self.spec, timeout=self.timeout).delete(
            self.marker_key, timeout=timeout if timeout is not None else self.timeout
        )

    def _combine(self, rows: Iterable[tuple[Any, Any]]) -> dict[Any, Any]:
        updates: dict[Any, Any] = {}
        for key, raw in rows:
            if key is None:
                raise ConfigurationError(f"a row of sink {self.sink_id!r} has a null key")
            if isinstance(key, str) and key.startswith(SINK_MARKER_PREFIX):
                raise ConfigurationError(f"key {key!r} is reserved for sink markers")
            value = _plain(raw)
            if self.mode == "add":
                if value is not None:
                    updates[key] = _add(updates.get(key), value, key)
            else:
                updates[key] = value
        return updates

    def __repr__(self) -> str:
        return f"PulsarMapSink({self.sink_id!r}, topic={self.spec.topic!r}, mode={self.mode!r})"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _add(old: Any, delta: Any, key: Any) -> Any:
    """``old + delta`` for numbers, or field by field for dicts of numbers (None is zero)."""
    if old is None:
        return delta
    if _is_number(old) and _is_number(delta):
        return old + delta
    if isinstance(old, dict) and isinstance(delta, dict):
        total = dict(old)
        for name, d in delta.items():
            if d is None:
                continue
            current = total.get(name)
            if (current is not None and not _is_number(current)) or not _is_number(d):
                raise ConfigurationError(f"cannot add {d!r} to {current!r} in {key!r}.{name}")
            total[name] = (current or 0) + d
        return total
    raise ConfigurationError(
        f"'add' needs numbers or dicts of numbers: cannot add {delta!r} to {old!r} in {key!r}"
    )


def _plain(value: Any) -> Any:
    """A Spark value as a JSON-friendly Python value."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, datetime.date | datetime.datetime):
        return value.isoformat()
    if isinstance(value, bytearray):
        return bytes(value)
    as_dict = getattr(value, "asDict", None)  # a pyspark Row (a struct)
    if callable(as_dict):
        return {k: _plain(v) for k, v in as_dict().items()}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
