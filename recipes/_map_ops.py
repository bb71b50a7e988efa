"""PulsarMap's replicated pieces: entries, events, the op format, the state and its ``apply``.

Private to the recipes; :mod:`recipes.map` is the public face. Everything here runs on every
replica and on the writer's trial state, so it is deterministic and never does I/O.
"""

from __future__ import annotations

import copy
import io
import struct
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast

import fastavro

from pulsar_state import AvroCodec, Codec, CodecError

__all__ = [
    "KEY_TYPES",
    "EventKind",
    "MapCodecs",
    "MapEntry",
    "MapEvent",
    "MapOp",
    "MapOpCodec",
    "MapSnapshotCodec",
    "MapState",
    "MapVersion",
    "detached",
    "key_order",
]

K = TypeVar("K")
V = TypeVar("V")

OpKind = Literal["PUT", "DELETE", "CLEAR"]
EventKind = Literal["put", "delete", "clear"]

# Keys must be hashable and totally ordered; these three types are both, and cover what the
# built-in codecs decode keys to (JSON keys: str or int).
KEY_TYPES: tuple[type, ...] = (str, bytes, int)
_KEY_RANK = {int: 0, bytes: 1, str: 2}


def key_order(key: Any) -> tuple[int, Any]:
    """The map's key order: ints, then bytes, then str; each by its own ``<``.

    str compares by code point, which is also the order of the UTF-8 bytes; bytes compare
    lexicographically by unsigned byte. A map normally holds one key type only.
    """
    return (_KEY_RANK[type(key)], key)


_IMMUTABLE_TYPES = frozenset({str, bytes, int, float, bool, type(None)})


def detached(value: V) -> V:
    """A copy of a stored value that the caller may keep and change.

    Stored values are shared by the replica's state and the writer's trial copies, so they must
    never be changed in place; every value handed out goes through here.
    """
    return value if type(value) in _IMMUTABLE_TYPES else copy.deepcopy(value)


# Bits of a version below its position: the index of the op within its record. A record holds
# at most a few million ops (it fits in one broker message), far below 2**32.
_INDEX_BITS = 32


class MapVersion(int):
    """Identifies one change of the map: ``(position, index)`` packed in one ordered int.

    ``position`` is the record that made the change (what ``wait_for`` takes) and ``index``
    the change's place among that record's ops, so two writes group-committed into one record
    never share a version. Every replica computes the same versions (they follow the log
    alone); versions order like the changes in the log, and 0 means "absent". It is an int,
    so it compares, hashes, pickles and fits a Spark ``LongType`` column.
    """

    __slots__ = ()

    @classmethod
    def of(cls, position: int, index: int) -> MapVersion:
        if position < 0 or not 0 <= index < 1 << _INDEX_BITS:
            raise ValueError(f"no version at position {position}, index {index}")
        return cls((position << _INDEX_BITS) | index)

    @property
    def position(self) -> int:
        """The position of the record that made this change."""
        return int(self) >> _INDEX_BITS

    @property
    def index(self) -> int:
        """The change's index among the ops of its record."""
        return int(self) & ((1 << _INDEX_BITS) - 1)

    def __repr__(self) -> str:
        return f"MapVersion(position={self.position}, index={self.index})"


NO_VERSION = MapVersion(0)


@dataclass(frozen=True, slots=True)
class MapEntry(Generic[V]):
    """A bound value and its version: the :class:`MapVersion` of the change that last set it."""

    value: V
    version: MapVersion


@dataclass(frozen=True, slots=True)
class MapEvent(Generic[K, V]):
    """One change seen by a watch (see :meth:`recipes.PulsarMap.changes`).

    ``kind`` is ``"put"`` (``key`` is bound to ``value``), ``"delete"`` (``key`` was removed;
    ``value`` is None) or ``"clear"`` (every key was removed; ``key`` and ``value`` are None).
    ``position`` is the position of the write that made the change, and ``version`` the
    change's own :class:`MapVersion` (unique, ``version.position == position``; what
    :meth:`recipes.PulsarMap.version` then returns for the key). Events with ``initial=True``
    describe the snapshot a watch starts from: ``version`` is the key's version and
    ``position`` the snapshot's position.
    """

    kind: EventKind
    key: K | None
    value: V | None
    version: MapVersion
    position: int
    initial: bool = False


@dataclass(frozen=True, slots=True)
class MapOp(Generic[K, V]):
    """One change to the map. Keys and values are held decoded and encoded, both normalised.

    ``tag`` marks the op of a conditional write so that the write can tell, from the state
    right after it, whether its own op was the one applied (see ``MapState.last_tag``).
    """

    kind: OpKind
    key: K | None = None
    value: V | None = None
    key_bytes: bytes = b""
    value_bytes: bytes | None = None
    tag: bytes | None = None


# The op envelope. Key and value travel as the bytes of the map's own codecs; evolving this
# record later (with defaults) stays readable thanks to the schema fingerprint.
OP_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "MapOp",
    "namespace": "pulsar_state.recipes.map",
    "fields": [
        {
            "name": "kind",
            "type": {"type": "enum", "name": "MapOpKind", "symbols": ["PUT", "DELETE", "CLEAR"]},
        },
        {"name": "key", "type": "bytes", "default": ""},
        {"name": "value", "type": ["null", "bytes"], "default": None},
        {"name": "tag", "type": ["null", "bytes"], "default": None},
    ],
}


class MapCodecs(Generic[K, V]):
    """The map's key and value codecs, with normalisation.

    A key or value is stored as ``decode(encode(x))``: exactly what every replica decodes from
    the log, so the writer's trial state and the replicas compare the same things.
    """

    def __init__(self, keys: Codec[K], values: Codec[V]) -> None:
        self.keys = keys
        self.values = values

    def key(self, key: K) -> tuple[K, bytes]:
        """The normalised key and its bytes; CodecError if it is not a valid key."""
        encoded = _encode(self.keys, key, "key")
        return self.decode_key(encoded), encoded

    def key_bytes(self, key: K) -> bytes:
        """The bytes of a key that is already normalised (taken from the state)."""
        return _encode(self.keys, key, "key")

    def value(self, value: V) -> tuple[V, bytes]:
        """The normalised value and its bytes; CodecError if it cannot be stored."""
        if value is None:
            raise CodecError("None cannot be stored: it means 'absent' (use delete to remove)")
        encoded = _encode(self.values, value, "value")
        return self.decode_value(encoded), encoded

    def decode_key(self, data: bytes) -> K:
        key = self.keys.decode(data)
        if type(key) not in KEY_TYPES:
            raise CodecError(f"keys must decode to str, bytes or int, not {type(key).__name__}")
        return key

    def decode_value(self, data: bytes) -> V:
        value = self.values.decode(data)
        if value is None:
            raise CodecError("a stored value decoded to None, which means 'absent'")
        return value

    def put(self, key: K, value: V, *, tag: bytes | None = None) -> MapOp[K, V]:
        """A PUT op from caller input (both normalised here, so bad input fails now)."""
        norm_key, key_bytes = self.key(key)
        norm_value, value_bytes = self.value(value)
        return MapOp("PUT", norm_key, norm_value, key_bytes, value_bytes, tag)

    def put_known(
        self, key: K, key_bytes: bytes, value: V, *, tag: bytes | None = None
    ) -> MapOp[K, V]:
        """A PUT op for a key already normalised (with its bytes)."""
        norm_value, value_bytes = self.value(value)
        return MapOp("PUT", key, norm_value, key_bytes, value_bytes, tag)


def _encode(codec: Codec[Any], item: Any, what: str) -> bytes:
    try:
        return codec.encode(item)
    except CodecError:
        raise
    except Exception as exc:  # a user codec that raises something else
        raise CodecError(f"cannot encode {what} {item!r}: {exc}") from exc


class MapOpCodec(Generic[K, V]):
    """Encodes :class:`MapOp` as an Avro record (single-object encoding) and back.

    Decoding checks keys and values with the map's codecs: a key or value this replica cannot
    decode raises :class:`CodecError`, which the core turns into a halt (CorruptRecordError).
    """

    def __init__(self, codecs: MapCodecs[K, V]) -> None:
        self._codecs = codecs
        self._envelope: AvroCodec[dict[str, Any]] = AvroCodec(OP_SCHEMA)
        # The ops are built here and always valid, so encode without the codec's per-value
        # validation (5x faster), behind the same single-object prefix the codec writes.
        sample = self._envelope.encode({"kind": "CLEAR", "key": b"", "value": None, "tag": None})
        self._prefix = sample[:10]

    def encode(self, op: MapOp[K, V], /) -> bytes:
        buffer = io.BytesIO()
        buffer.write(self._prefix)
        fastavro.schemaless_writer(
            buffer,
            self._envelope.schema,
            {"kind": op.kind, "key": op.key_bytes, "value": op.value_bytes, "tag": op.tag},
        )
        return buffer.getvalue()

    def decode(self, data: bytes, /) -> MapOp[K, V]:
        fields = self._envelope.decode(data)
        kind: OpKind = fields["kind"]
        tag = fields.get("tag")
        if kind == "CLEAR":
            return MapOp("CLEAR", tag=tag)
        key_bytes = fields["key"]
        key = self._codecs.decode_key(key_bytes)
        if kind == "DELETE":
            return MapOp("DELETE", key, None, key_bytes, None, tag)
        value_bytes = fields.get("value")
        if value_bytes is None:
            raise CodecError("a PUT op without a value")
        value = self._codecs.decode_value(value_bytes)
        return MapOp("PUT", key, value, key_bytes, value_bytes, tag)


class MapState(Generic[K, V]):
    """The replicated state: ``entries`` maps each key to an immutable :class:`MapEntry`.

    Entries are never mutated, only replaced, so a shallow copy (:meth:`copy`) is a correct and
    cheap trial state for the writer. ``position`` is the position of the record being applied
    (set by :meth:`begin`) and ``op_index`` the number of its ops applied so far: together they
    stamp versions, the same on the writer's trial state and on every replica. ``events``
    collects the changes of the current record for watches; it is None on trial copies and
    when nobody watches.
    """

    __slots__ = ("_sorted", "entries", "events", "last_tag", "op_index", "position")

    def __init__(self) -> None:
        self.entries: dict[K, MapEntry[V]] = {}
        self.position = 0
        self.op_index = 0
        self.last_tag: bytes | None = None
        self.events: list[MapEvent[K, V]] | None = None
        self._sorted: list[K] | None = None

    def __eq__(self, other: object) -> bool:
        # What replicas must agree on: the entries with their versions, and the position.
        return (
            isinstance(other, MapState)
            and other.position == self.position
            and other.entries == self.entries
        )

    __hash__ = None  # type: ignore[assignment]

    def copy(self) -> MapState[K, V]:
        trial: MapState[K, V] = MapState()
        trial.entries = dict(self.entries)
        trial.position = self.position
        trial.op_index = self.op_index
        trial.last_tag = self.last_tag
        trial._sorted = self._sorted  # never mutated, only replaced
        return trial

    def begin(self, position: int) -> None:
        self.position = position
        self.op_index = 0
        if self.events:
            self.events.clear()

    def apply(self, op: MapOp[K, V]) -> None:
        events = self.events
        if op.tag is not None:
            self.last_tag = op.tag
        version = MapVersion.of(self.position, self.op_index)
        self.op_index += 1
        if op.kind == "PUT":
            key, value = cast(K, op.key), cast(V, op.value)  # set on every PUT
            if key not in self.entries:
                self._sorted = None
            self.entries[key] = MapEntry(value, version)
            if events is not None:
                events.append(MapEvent("put", key, value, version, self.position))
        elif op.kind == "DELETE":
            if self.entries.pop(cast(K, op.key), None) is not None:
                self._sorted = None
                if events is not None:
                    events.append(MapEvent("delete", op.key, None, version, self.position))
        else:
            self.entries.clear()
            self._sorted = None
            if events is not None:
                events.append(MapEvent("clear", None, None, version, self.position))

    # ---------------------------------------------------------------- ordered reads

    def sorted_keys(self) -> list[K]:
        """The keys in key order (cached until a key is added or removed)."""
        if self._sorted is None:
            try:
                self._sorted = sorted(self.entries)  # type: ignore[type-var]
            except TypeError:  # mixed key types: rank them
                self._sorted = sorted(self.entries, key=key_order)
        return self._sorted

    def items_between(self, low: K | None, high: K | None) -> list[tuple[K, V]]:
        """Entries with ``low <= key < high`` (None: unbounded), in key order."""
        keys = self.sorted_keys()
        start = 0 if low is None else bisect_left(keys, key_order(low), key=key_order)
        stop = len(keys) if high is None else bisect_left(keys, key_order(high), key=key_order)
        entries = self.entries
        return [(key, entries[key].value) for key in keys[start:stop]]

    def matching(self, accept: Callable[[K], bool]) -> list[tuple[K, MapEntry[V]]]:
        entries = self.entries
        return [(key, entries[key]) for key in self.sorted_keys() if accept(key)]


_SNAPSHOT_MAGIC = b"PSMAP\x01"
_SNAPSHOT_HEAD = struct.Struct(">qI")  # the state's position, the number of entries
_SNAPSHOT_ENTRY = struct.Struct(">qII")  # version, key length, value length


class MapSnapshotCodec(Generic[K, V]):
    """A map's whole state as bytes, built from its key and value codecs: deterministic (the
    entries sorted by key bytes), and carrying each key's version."""

    def __init__(self, codecs: MapCodecs[K, V]) -> None:
        self._codecs = codecs

    def encode(self, state: MapState[K, V], /) -> bytes:
        codecs = self._codecs
        items = sorted((codecs.key_bytes(key), entry) for key, entry in state.entries.items())
        parts = [_SNAPSHOT_MAGIC, _SNAPSHOT_HEAD.pack(state.position, len(items))]
        for key_bytes, entry in items:
            value_bytes = _encode(codecs.values, entry.value, "value")
            parts += [
                _SNAPSHOT_ENTRY.pack(int(entry.version), len(key_bytes), len(value_bytes)),
                key_bytes,
                value_bytes,
            ]
        return b"".join(parts)

    def decode(self, data: bytes, /) -> MapState[K, V]:
        if not data.startswith(_SNAPSHOT_MAGIC):
            raise CodecError("not a PulsarMap snapshot")
        state: MapState[K, V] = MapState()
        try:
            offset = len(_SNAPSHOT_MAGIC)
            state.position, count = _SNAPSHOT_HEAD.unpack_from(data, offset)
            offset += _SNAPSHOT_HEAD.size
            for _ in range(count):
                version, key_len, value_len = _SNAPSHOT_ENTRY.unpack_from(data, offset)
                offset += _SNAPSHOT_ENTRY.size
                key = self._codecs.decode_key(data[offset : offset + key_len])
                offset += key_len
                value = self._codecs.decode_value(data[offset : offset + value_len])
                offset += value_len
                state.entries[key] = MapEntry(value, MapVersion(version))
        except struct.error as exc:
            raise CodecError(f"damaged PulsarMap snapshot: {exc}") from exc
        if offset != len(data):
            raise CodecError("damaged PulsarMap snapshot: bytes left over")
        return state
