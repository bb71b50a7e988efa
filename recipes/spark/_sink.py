"""PulsarMapSink: an exactly-once foreachBatch sink, one atomic map write per micro-batch."""

from __future__ import annotations

import datetime
import decimal
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import tenacity

from pulsar_state import (
    ConfigurationError,
    PulsarStateError,
    RecordTooLargeError,
    WriteOutcomeUnknownError,
)
from recipes.map import PROTECTED_PREFIX

from ._specs import MapSpec, get_map

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = [
    "SINK_MARKER_PREFIX",
    "PulsarMapSink",
    "SinkMode",
    "SinkOwnedByAnotherQueryError",
    "SinkResult",
]

# Under the library's logger tree (README: Logging), as before the move into recipes.
logger = logging.getLogger("pulsar_state.spark")

#: Keys under this prefix hold exactly-once sink markers (see :class:`PulsarMapSink`).
SINK_MARKER_PREFIX = PROTECTED_PREFIX  # "__sink__/": clear() keeps these keys


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
    :meth:`reset`). The marker is bound to the streaming query's id (stable across restarts
    from one checkpoint, new with a new checkpoint): a batch of another query under the same
    sink id raises :class:`SinkOwnedByAnotherQueryError` instead of being dropped as
    "already applied". (:meth:`write_rows` called directly, with no ``query_id``, is not
    checked.)
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
        query_id = _streaming_query_id(batch)
        columns = self.value_columns if self.value_columns is not None else [self.value_column]
        rows = batch.select(self.key_column, *columns).collect()
        if self.value_columns is not None:
            names = self.value_columns
            pairs = [(row[0], {n: row[i + 1] for i, n in enumerate(names)}) for row in rows]
        else:
            pairs = [(row[0], row[1]) for row in rows]
        return self.write_rows(pairs, batch_id, query_id=query_id)

    def write_rows(
        self, rows: Iterable[tuple[Any, Any]], batch_id: int, *, query_id: str | None = None
    ) -> SinkResult:
        """Upsert ``(key, value)`` pairs as micro-batch ``batch_id``: the same as :meth:`write`
        for rows already on the driver. ``query_id``: the streaming query's id, checked
        against (and bound to) the sink's marker; None checks nothing."""
        if isinstance(batch_id, bool) or not isinstance(batch_id, int) or batch_id < 0:
            raise ConfigurationError(f"batch_id must be an int >= 0, not {batch_id!r}")
        updates = combine_rows(rows, self.mode, self.sink_id)
        marker = self.marker_key
        mode = self.mode
        sink_id = self.sink_id

        def fn(view: Mapping[Any, Any]) -> Mapping[Any, Any]:
            last, owner = _read_marker(marker, view.get(marker))
            if query_id is not None and owner is not None and owner != query_id:
                raise SinkOwnedByAnotherQueryError(
                    f"sink {sink_id!r} holds the progress of streaming query {owner} (batch "
                    f"{last}); this is query {query_id} (another query, or a new checkpoint), "
                    "whose batches would be taken for applied ones and dropped. Use another "
                    "sink_id, or reset() this sink if the old query is gone for good"
                )
            if last is not None and last >= batch_id:
                return {}  # this batch (or a later one) is already in the map
            changes: dict[Any, Any]
            if mode == "add":
                changes = {k: _add(view.get(k), d, k) for k, d in updates.items()}
            else:
                changes = dict(updates)
            bound = query_id if query_id is not None else owner
            changes[marker] = batch_id if bound is None else {"batch": batch_id, "query": bound}
            return changes

        m = get_map(self.spec, timeout=self.timeout)

        def log_retry(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            logger.warning(
                "sink %s batch %d: %s; retrying (%d/%d)",
                self.sink_id,
                batch_id,
                exc,
                state.attempt_number,
                self.retries,
            )

        # Retried at once, even when the outcome is unknown: the marker makes a second commit
        # of this batch impossible.
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_retriable),
            stop=tenacity.stop_after_attempt(self.retries + 1),
            before_sleep=log_retry,
            reraise=True,
        )
        try:
            position = retrying(m.transact, fn, timeout=self.timeout)
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
        return SinkResult(batch_id, len(updates), position is None, position)

    def last_batch_id(self, *, latest: bool = True, timeout: float | None = None) -> int | None:
        """The id of the last batch this sink applied, or None if none was."""
        value = get_map(self.spec, timeout=self.timeout).get(
            self.marker_key, latest=latest, timeout=timeout if timeout is not None else self.timeout
        )
        return _read_marker(self.marker_key, value)[0]

    def reset(self, *, timeout: float | None = None) -> None:
        """Forget this sink's progress (for a new query on a new checkpoint)."""
        get_map(self.spec, timeout=self.timeout).delete(
            self.marker_key, timeout=timeout if timeout is not None else self.timeout
        )

    def __repr__(self) -> str:
        return f"PulsarMapSink({self.sink_id!r}, topic={self.spec.topic!r}, mode={self.mode!r})"


def combine_rows(rows: Iterable[tuple[Any, Any]], mode: SinkMode, sink_id: str) -> dict[Any, Any]:
    """A batch's ``(key, value)`` rows as the updates of one write: values made JSON-friendly,
    rows of one key added up (``"add"``) or the last one kept (``"replace"``). Refuses null
    keys and keys under the markers' prefix."""
    updates: dict[Any, Any] = {}
    for key, raw in rows:
        if key is None:
            raise ConfigurationError(f"a row of sink {sink_id!r} has a null key")
        if isinstance(key, str) and key.startswith(SINK_MARKER_PREFIX):
            raise ConfigurationError(f"key {key!r} is reserved for sink markers")
        value = plain_value(raw)
        if mode == "add":
            if value is not None:
                updates[key] = _add(updates.get(key), value, key)
        else:
            updates[key] = value
    return updates


class SinkOwnedByAnotherQueryError(ConfigurationError):
    """A sink id's marker belongs to another streaming query (or checkpoint)."""


def _streaming_query_id(batch: DataFrame) -> str | None:
    """The id of the streaming query running this foreachBatch (Spark sets it as a local
    property of the micro-batch's thread); None outside a streaming query or without a
    SparkContext (Spark Connect)."""
    try:
        query_id = batch.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
    except Exception:  # no SparkContext here (Spark Connect)
        return None
    return str(query_id) if query_id else None


def _read_marker(marker: str, value: Any) -> tuple[int | None, str | None]:
    """(last batch id, owning query id) from a marker's value: None, an int (markers of
    version 0.1, unbound) or ``{"batch": id, "query": query id}``."""
    if value is None:
        return None, None
    if isinstance(value, int) and not isinstance(value, bool):
        return value, None
    if isinstance(value, Mapping):
        batch, query = value.get("batch"), value.get("query")
        if isinstance(batch, int) and not isinstance(batch, bool) and isinstance(query, str):
            return batch, query
    raise ConfigurationError(f"{marker} holds {value!r}, not a batch id (nor a sink marker)")


def _retriable(exc: BaseException) -> bool:
    """Whether a failed batch write may be tried again (never a batch too large to fit)."""
    if not isinstance(exc, PulsarStateError) or isinstance(exc, RecordTooLargeError):
        return False
    return exc.retriable or isinstance(exc, WriteOutcomeUnknownError)


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


def plain_value(value: Any) -> Any:
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
        return {k: plain_value(v) for k, v in as_dict().items()}
    if isinstance(value, Mapping):
        return {str(k): plain_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_value(v) for v in value]
    return value
