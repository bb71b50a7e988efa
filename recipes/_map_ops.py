"""PulsarMap's replicated pieces: entries, events, the op format, the state and its ``apply``.

Private to the recipes; :mod:`recipes.map` is the public face. Everything here runs on every
replica and on the writer's trial state, so it is deterministic and never does I/O.
"""

from __future__ import annotations

import copy
import io
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, NoReturn, TypeVar, cast

import fastavro

from pulsar_state import IMMUTABLE_TYPES, AvroCodec, Codec, CodecError, DictOverlay

from ._sorted_table import KEY_TYPES, SortedTable, exact_key, key_order, sort_keys

__all__ = [
    "KEY_TYPES",
    "EventKind",
    "FrozenDict",
    "FrozenList",
    "MapCodecs",
    "MapEntry",
    "MapEvent",
    "MapOp",
    "MapOpCodec",
    "MapSnapshotCodec",
    "MapState",
    "MapVersion",
    "detached",
    "freeze",
    "key_order",
    "readable",
    "sort_keys",
    "thaw",
]

K = TypeVar("K")
V = TypeVar("V")

OpKind = Literal["PUT", "DELETE", "CLEAR"]
EventKind = Literal["put", "delete", "clear"]

# Values nothing can change in place (the core's list): handed out as they are.
_IMMUTABLE_TYPES = IMMUTABLE_TYPES

_READ_ONLY = (
    "a value read from a PulsarMap is read-only (shared with the replica); "
    "copy.deepcopy(value) or recipes.thaw(value) gives a mutable copy"
)


def _refuse(*args: Any, **kwargs: Any) -> NoReturn:
    raise TypeError(_READ_ONLY)


class FrozenDict(dict[Any, Any]):
    """A read-only ``dict``: how a PulsarMap hands out the objects its values hold (JSON
    objects, Avro records and maps). It is a dict (``isinstance``, ``==``, ``json.dumps``,
    Spark rows), but every change raises ``TypeError``. ``copy.deepcopy``, ``pickle`` and
    :func:`thaw` give plain, mutable dicts and lists; ``dict(value)`` a mutable shallow copy.
    """

    __slots__ = ()

    def __setitem__(self, key: Any, value: Any) -> NoReturn:
        _refuse()

    def __delitem__(self, key: Any) -> NoReturn:
        _refuse()

    def __ior__(self, other: Any) -> NoReturn:  # type: ignore[misc]
        _refuse()

    def clear(self) -> NoReturn:
        _refuse()

    def pop(self, *args: Any) -> NoReturn:
        _refuse()

    def popitem(self) -> NoReturn:
        _refuse()

    def setdefault(self, *args: Any) -> NoReturn:
        _refuse()

    def update(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def __copy__(self) -> dict[Any, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[Any, Any]:
        return thaw(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (thaw(self),))

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"


class FrozenList(list[Any]):
    """A read-only ``list``: how a PulsarMap hands out the arrays its values hold (see
    :class:`FrozenDict`: a list for every read, but every change raises ``TypeError``)."""

    __slots__ = ()

    def __setitem__(self, index: Any, value: Any) -> NoReturn:
        _refuse()

    def __delitem__(self, index: Any) -> NoReturn:
        _refuse()

    def __iadd__(self, other: Any) -> NoReturn:  # type: ignore[misc]
        _refuse()

    def __imul__(self, other: Any) -> NoReturn:  # type: ignore[misc]
        _refuse()

    def append(self, value: Any) -> NoReturn:
        _refuse()

    def extend(self, values: Any) -> NoReturn:
        _refuse()

    def insert(self, index: Any, value: Any) -> NoReturn:
        _refuse()

    def pop(self, *args: Any) -> NoReturn:
        _refuse()

    def remove(self, value: Any) -> NoReturn:
        _refuse()

    def clear(self) -> NoReturn:
        _refuse()

    def sort(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def reverse(self) -> NoReturn:
        _refuse()

    def __copy__(self) -> list[Any]:
        return list(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return thaw(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (thaw(self),))

    def __repr__(self) -> str:
        return f"FrozenList({list.__repr__(self)})"


# Values a reader may share with the state: immutable, or frozen all the way down.
_SHAREABLE_TYPES = _IMMUTABLE_TYPES | {FrozenDict, FrozenList}


class _Unfreezable(Exception):
    pass


def _freeze(value: Any) -> Any:
    kind = type(value)
    if kind in _SHAREABLE_TYPES:
        return value
    if kind is dict:
        return FrozenDict({key: _freeze(item) for key, item in value.items()})
    if kind is list:
        return FrozenList([_freeze(item) for item in value])
    if kind is tuple:
        return tuple(_freeze(item) for item in value)
    raise _Unfreezable


def freeze(value: V) -> tuple[V, bool]:
    """``value`` made read-only (its dicts and lists as :class:`FrozenDict` and
    :class:`FrozenList`), and True; or ``value`` itself and False when it holds an object of
    another kind, which readers then get a deep copy of."""
    try:
        return _freeze(value), True
    except _Unfreezable:
        return value, False


def thaw(value: V) -> V:
    """A mutable deep copy of a value read from a map (plain dicts and lists)."""
    kind = type(value)
    if kind is FrozenDict or kind is dict:
        return cast(V, {key: thaw(item) for key, item in cast(dict[Any, Any], value).items()})
    if kind is FrozenList or kind is list:
        return cast(V, [thaw(item) for item in cast(list[Any], value)])
    if kind in _IMMUTABLE_TYPES:
        return value
    return copy.deepcopy(value)


def readable(value: V) -> V:
    """A stored value as readers get it: itself when nothing can change it (immutable, or
    frozen), else a deep copy, so that a reader can never change the replica's state."""
    return value if type(value) in _SHAREABLE_TYPES else copy.deepcopy(value)


def detached(value: V) -> V:
    """A mutable copy of a stored value that the caller may keep and change (what ``update``
    functions and the ``transact`` view get)."""
    return thaw(value)


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
        # A version is a signed 64-bit int (snapshots and the sorted table store it so):
        # 2**31 records, refused alike on the writer's trial state and on every replica.
        if not 0 <= position < 1 << (63 - _INDEX_BITS) or not 0 <= index < 1 << _INDEX_BITS:
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
        # True while every value decoded so far could be frozen (readers may then share
        # stored values); the first that cannot turns it off for good and calls
        # ``on_unfrozen``.
        self.all_frozen = True
        self.on_unfrozen: Callable[[], None] = lambda: None

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
        # Frozen once here, so that reads hand the stored value out without a copy.
        frozen, ok = freeze(value)
        if not ok and self.all_frozen:
            self.all_frozen = False
            self.on_unfrozen()
        return frozen

    def put(self, key: K, value: V, *, tag: bytes | None = None) -> MapOp[K, V]:
        """A PUT op from caller input (both normalised here, so bad input fails now)."""
        norm_key, key_bytes = self.key(key)
        return self.put_known(norm_key, key_bytes, value, tag=tag)

    def put_known(
        self, key: K, key_bytes: bytes, value: V, *, tag: bytes | None = None
    ) -> MapOp[K, V]:
        """A PUT op for a key already normalised (with its bytes)."""
        try:
            norm_value, value_bytes = self.value(value)
        except CodecError as exc:  # named: one bad value among a batch's (a Spark sink's)
            if type(exc) is not CodecError:  # a codec's own kind: callers may catch it
                exc.add_note(f"(the value of key {key!r})")
                raise
            raise CodecError(f"the value of key {key!r}: {exc}") from exc
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
    """The replicated state: each key's (frozen) value and its :class:`MapVersion`.

    ``values`` maps each key to its value, so that a local read is one dict lookup; the
    keys, values and versions are also kept in key order in a :class:`SortedTable` (ordered
    reads copy slices of it, and a version costs 8 bytes there, not a dict slot and an int).
    ``entries`` is a read-only view of both as :class:`MapEntry` objects, made when asked.
    ``position`` is the position of the record being applied (set by :meth:`begin`) and
    ``op_index`` the number of its ops applied so far: together they stamp versions, the same
    on the writer's trial state and on every replica. ``events`` collects the changes of the
    current record for watches; it is None on trial states and when nobody watches.

    The writer's trial state is :meth:`trial`: an overlay over this state (O(1) to make,
    O(what a batch changes) to use) that never changes it.
    """

    __slots__ = ("_order", "_own_entries", "events", "last_tag", "op_index", "position", "values")

    def __init__(self) -> None:
        self.values: MutableMapping[K, V] = {}
        self._own_entries: Mapping[K, MapEntry[V]] | None = None
        self.position = 0
        self.op_index = 0
        self.last_tag: bytes | None = None
        self.events: list[MapEvent[K, V]] | None = None
        # None on a trial state, which derives the order from its overlay when asked.
        self._order: SortedTable[K, V] | None = SortedTable()

    def __eq__(self, other: object) -> bool:
        # What replicas must agree on: the entries with their versions, and the position.
        return (
            isinstance(other, MapState)
            and other.position == self.position
            and dict(other.entries.items()) == dict(self.entries.items())
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def entries(self) -> Mapping[K, MapEntry[V]]:
        """Each key's :class:`MapEntry` (value and version), read-only. A view made per
        access: held by the state, it would tie the two in a reference cycle, and a state
        dropped (a snapshot's copy) would wait for the cyclic collector."""
        own = self._own_entries
        return _Entries(self) if own is None else own

    @entries.setter
    def entries(self, entries: Mapping[K, MapEntry[V]]) -> None:
        self._own_entries = entries  # a trial's overlay

    def lookup(self, key: K) -> MapEntry[V] | None:
        """``key``'s entry (made now), or None when the key is not bound."""
        value = self.values.get(key, _ABSENT)
        if value is _ABSENT:
            return None
        version = self.version_of(key)
        assert version is not None  # bound: version_of finds it or raises
        return MapEntry(value, MapVersion(version))

    def exists(self, key: K) -> bool:
        return key in self.values

    def count(self) -> int:
        return len(self.values)

    def version_of(self, key: K) -> int | None:
        """``key``'s version as an int, or None when the key is not bound. A key equal to a
        bound one but of another type (a str enum, True for 1) finds that one's version."""
        order = self._order
        assert order is not None
        if key not in self.values:
            return None
        version = order.version(key)
        if version is None:
            version = order.version(exact_key(key))
        if version is None:
            raise TypeError(
                f"key {key!r} ({type(key).__name__}) equals a key of the map but is not "
                "a str, bytes or int: look it up by the key's own type"
            )
        return version

    def load(self, items: list[tuple[K, V, int]]) -> None:
        """Replace the entries at once (decoding a snapshot): (key, value, version) each."""
        self.values = {key: value for key, value, _version in items}
        if len(self.values) != len(items):
            raise CodecError("a PulsarMap snapshot names a key twice")
        self._order = SortedTable(items)

    def copy(self) -> MapState[K, V]:
        """An independent copy (for a snapshot, encoded in another thread). O(n)."""
        copied: MapState[K, V] = MapState()
        copied.values = dict(self.values)
        copied.position = self.position
        copied.op_index = self.op_index
        copied.last_tag = self.last_tag
        copied._order = None if self._order is None else self._order.copy()
        return copied

    def trial(self) -> MapState[K, V]:
        """The writer's trial state: reads see this state, changes stay in the trial."""
        return _TrialMapState(self)

    def begin(self, position: int) -> None:
        self.position = position
        self.op_index = 0
        if self.events:
            self.events.clear()

    def _stamp(self, op: MapOp[K, V]) -> MapVersion:
        if op.tag is not None:
            self.last_tag = op.tag
        version = MapVersion.of(self.position, self.op_index)
        self.op_index += 1
        return version

    def apply(self, op: MapOp[K, V]) -> None:
        events = self.events
        version = self._stamp(op)
        order, values = self._order, self.values
        assert order is not None
        if op.kind == "PUT":
            key, value = cast(K, op.key), cast(V, op.value)  # set on every PUT
            order.put(key, value, version)
            values[key] = value
            if events is not None:
                events.append(MapEvent("put", key, value, version, self.position))
        elif op.kind == "DELETE":
            key = cast(K, op.key)
            if key in values:
                del values[key]
                order.remove(key)
                if events is not None:
                    events.append(MapEvent("delete", key, None, version, self.position))
        else:
            values.clear()
            order.clear()
            if events is not None:
                events.append(MapEvent("clear", None, None, version, self.position))

    # ---------------------------------------------------------------- ordered reads

    def sorted_keys(self) -> Iterable[K]:
        """The keys in key order (iterate it before the state changes again)."""
        assert self._order is not None
        return self._order

    def items_between(self, low: K | None, high: K | None) -> list[tuple[K, V]]:
        """Entries with ``low <= key < high`` (None: unbounded), in key order:
        O(log n + k)."""
        assert self._order is not None
        return self._order.items_between(low, high)

    def keys_between(self, low: K | None, high: K | None) -> list[K]:
        """Keys with ``low <= key < high`` (None: unbounded), in key order."""
        assert self._order is not None
        return self._order.keys_between(low, high)

    def matching(self, accept: Callable[[K], bool]) -> list[tuple[K, MapEntry[V]]]:
        assert self._order is not None
        return [
            (key, MapEntry(value, MapVersion(version)))
            for key, value, version in self._order.items()
            if accept(key)
        ]

    def entries_in_order(self) -> Iterable[tuple[K, MapEntry[V]]]:
        """Every (key, entry) in key order (iterate it before the state changes again)."""
        assert self._order is not None
        return [
            (key, MapEntry(value, MapVersion(version)))
            for key, value, version in self._order.items()
        ]


T = TypeVar("T")


class _StateView(Mapping[K, T]):
    """A read-only mapping over a state's ``lookup``, ``exists`` and ``count`` (the in-memory
    state's, or the disk state's store), each found entry shown through ``_show``."""

    __slots__ = ("_state",)

    def __init__(self, state: MapState[K, Any]) -> None:
        self._state = state

    def _show(self, found: MapEntry[Any]) -> T:
        raise NotImplementedError

    def get(self, key: K, default: Any = None) -> Any:
        found = self._state.lookup(key)
        return default if found is None else self._show(found)

    def __getitem__(self, key: K) -> T:
        found = self._state.lookup(key)
        if found is None:
            raise KeyError(key)
        return self._show(found)

    def __contains__(self, key: object) -> bool:
        return self._state.exists(cast(K, key))

    def __len__(self) -> int:
        return self._state.count()

    def __iter__(self) -> Iterator[K]:
        # Key order, like items(): keys(), values() and items() agree.
        return iter(self._state.sorted_keys())


class _Entries(_StateView[K, MapEntry[V]]):
    """``MapState.entries``: the entries (value and version) of a state."""

    __slots__ = ()

    def _show(self, found: MapEntry[Any]) -> MapEntry[V]:
        return found

    def items(self) -> Any:
        return self._state.entries_in_order()


class _Values(_StateView[K, V]):
    """The values of a state (a disk state's ``values``: ``get`` serves ``get_local``)."""

    __slots__ = ()

    def _show(self, found: MapEntry[Any]) -> V:
        # readable: a disk state decodes a value on its first read, so the fast get_local may
        # meet one that cannot be frozen (a type check for a frozen one).
        return readable(cast(V, found.value))


_ABSENT: Any = object()


class _TrialMapState(MapState[K, V]):
    """A trial state: :class:`~pulsar_state.DictOverlay` views of a live state's dicts.

    Made for one batch of the writer and thrown away after it; the live state does not
    change meanwhile (the batch is built in one synchronous step).
    """

    __slots__ = ("_live",)

    def __init__(self, live: MapState[K, V]) -> None:
        # Not MapState.__init__: nothing of a fresh state is needed.
        self._live = live
        self.entries = DictOverlay(live.entries)
        self.values = DictOverlay(live.values)
        self.position = live.position
        self.op_index = live.op_index
        self.last_tag = live.last_tag
        self.events = None
        self._order = None

    def trial(self) -> MapState[K, V]:
        raise AssertionError("a trial state is never the base of another trial")

    def version_of(self, key: K) -> int | None:
        entry = self.entries.get(key)
        return None if entry is None else int(entry.version)

    def apply(self, op: MapOp[K, V]) -> None:
        version = self._stamp(op)
        entries = cast(DictOverlay[K, MapEntry[V]], self.entries)
        if op.kind == "PUT":
            key, value = cast(K, op.key), cast(V, op.value)  # set on every PUT
            entries[key] = MapEntry(value, version)
            self.values[key] = value
        elif op.kind == "DELETE":
            key = cast(K, op.key)
            if entries.pop(key, None) is not None:
                del self.values[key]
        else:
            entries.clear()
            self.values.clear()

    def sorted_keys(self) -> Iterable[K]:
        # O(n) merge of the live order with this batch's changes; only whole-map generators
        # (update_multiple, transact iterating its view) ask.
        overlay = cast(DictOverlay[K, MapEntry[V]], self.entries)
        added = list(overlay.added_keys)
        if overlay.cleared:
            return sort_keys(added)
        live = self._live.sorted_keys()
        removed = overlay.removed_keys
        if not added and not removed:
            return live
        survivors = [key for key in live if key not in removed] if removed else list(live)
        return sort_keys(survivors + added) if added else survivors  # timsort merges the runs

    def keys_between(self, low: K | None, high: K | None) -> list[K]:
        # The live state's keys in range (O(log n + k)) merged with this batch's changes:
        # never a walk over the whole live state.
        overlay = cast(DictOverlay[K, MapEntry[V]], self.entries)
        low_order = None if low is None else key_order(low)
        high_order = None if high is None else key_order(high)

        def inside(key: K) -> bool:
            return (low_order is None or key_order(key) >= low_order) and (
                high_order is None or key_order(key) < high_order
            )

        added = [key for key in overlay.added_keys if inside(key)]
        if overlay.cleared:
            return sort_keys(added)
        removed = overlay.removed_keys
        live = self._live.keys_between(low, high)
        if removed:
            live = [key for key in live if key not in removed]
        return sort_keys(live + added) if added else live

    def items_between(self, low: K | None, high: K | None) -> list[tuple[K, V]]:
        values = self.values
        return [(key, values[key]) for key in self.keys_between(low, high)]

    def matching(self, accept: Callable[[K], bool]) -> list[tuple[K, MapEntry[V]]]:
        entries = self.entries
        return [(key, entries[key]) for key in self.sorted_keys() if accept(key)]

    def entries_in_order(self) -> Iterable[tuple[K, MapEntry[V]]]:
        entries = self.entries
        return [(key, entries[key]) for key in self.sorted_keys()]


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
        items = sorted((codecs.key_bytes(key), entry) for key, entry in state.entries_in_order())
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
        items: list[tuple[K, V, int]] = []
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
                items.append((key, value, version))
        except struct.error as exc:
            raise CodecError(f"damaged PulsarMap snapshot: {exc}") from exc
        if offset != len(data):
            raise CodecError("damaged PulsarMap snapshot: bytes left over")
        state.load(items)
        return state
