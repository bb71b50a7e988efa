"""PulsarMap: a key-value map replicated through one Pulsar topic (the PIP's recipe).

:Status: Beta. Built only on ``pulsar_state``'s public API.

Every process holding a :class:`PulsarMap` on a topic keeps the whole map in memory and reads
it locally; every change is a write to the topic, applied by every replica in log order. It has
the PIP's ``PulsarMap`` methods (async), a local view with no I/O (``len(m)``, ``key in m``,
``m.items()``...), Samza's ``put_all``/``range``/``all``, per-key versions with compare-and-set,
and watches (:meth:`PulsarMap.changes`).

Guarantees (from the core, see its README):

* A write is atomic: all the changes of one call (``put_all``, ``update_multiple``,
  ``transact``, ``clear``) are seen together by every replica, or not at all; never half of them.
* Conditional writes (``update``, ``replace``, ``replace_version``, ``put_if_absent``,
  ``delete``, ``transact``) decide on the up-to-date map, under the topic's exclusive writer;
  a decision made on a stale map is never applied (the write is recomputed), so
  compare-and-set is exact.
* A call returns after its write is applied locally: the local view shows it at once. Reads
  with ``latest=True`` are linearizable; reads without it are local and never wait.
* Bad input fails before anything is sent: a key or value its codec cannot encode raises
  :class:`~pulsar_state.CodecError` and leaves the map unchanged. A key or value on the topic
  that this replica's codecs cannot decode halts the replica at the last good state
  (:class:`~pulsar_state.ReplicaHaltedError` from every call, caused by
  :class:`~pulsar_state.CorruptRecordError`).

Failure semantics: a write that times out before anything was sent raises
:class:`~pulsar_state.OperationTimeoutError` (retry freely); one sent but not seen in time raises
:class:`~pulsar_state.WriteOutcomeUnknownError` (applied once or not at all: read with
``latest=True`` to tell).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, Generic, TypeVar, cast, overload

from pulsar_state import (
    STATE_MACHINE_OPTIONS,
    ClosedError,
    Codec,
    ConfigurationError,
    JsonCodec,
    ManagerStats,
    PulsarStateError,
    ReplicaHaltedError,
    SharedStateManager,
    StrCodec,
    WriteResult,
)

from ._map_disk import DiskDurability, DiskMapState, DiskSnapshotCodec, DiskStore
from ._map_ops import (
    KEY_TYPES,
    NO_VERSION,
    MapCodecs,
    MapEntry,
    MapEvent,
    MapOp,
    MapOpCodec,
    MapSnapshotCodec,
    MapState,
    MapVersion,
    detached,
    readable,
    thaw,
)
from ._map_watch import MapWatch, WatchHub, WatchOverflowError
from ._sorted_table import exact_key, prefix_end

__all__ = ["PulsarMap"]

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")
T = TypeVar("T")

# SharedStateManager options that PulsarMap sets itself.
_RESERVED_OPTIONS = STATE_MACHINE_OPTIONS | {"snapshot_codec"}
_CLEAR: MapOp[Any, Any] = MapOp("CLEAR")

#: Keys under this prefix hold the bookkeeping of writers built on the map (the Spark sink's
#: exactly-once batch markers); see :data:`PROTECTED_PREFIXES`.
PROTECTED_PREFIX = "__sink__/"
#: Keys under this prefix hold the largest fencing token each resource name has written with
#: (:mod:`recipes.fencing`); see :data:`PROTECTED_PREFIXES`.
FENCE_PREFIX = "__fence__/"
#: :meth:`PulsarMap.clear` keeps the keys under these prefixes and
#: :meth:`PulsarMap.update_multiple` never visits them: clearing the data must neither make a
#: sink apply its batches again nor lower a fence (which would let a holder that lost its
#: lease write again). Name such a key (``delete``, ``put``) to change it.
PROTECTED_PREFIXES = (PROTECTED_PREFIX, FENCE_PREFIX)
# Each prefix with the first str after every key it starts ("/" + 1 is "0").
_PROTECTED_RANGES = tuple((p, p[:-1] + chr(ord(p[-1]) + 1)) for p in PROTECTED_PREFIXES)


def _protected(key: Any) -> bool:
    return isinstance(key, str) and key.startswith(PROTECTED_PREFIXES)


# The state's own methods, looked up on each call: a disk state and the trial overlay each
# have their own.
def _apply_op(state: MapState[K, V], op: MapOp[K, V]) -> None:
    state.apply(op)


def _begin_record(state: MapState[K, V], position: int) -> None:
    state.begin(position)


def _trial_of(state: MapState[K, V]) -> MapState[K, V]:
    return state.trial()


def _copy_of(state: MapState[K, V]) -> MapState[K, V]:
    return state.copy()


def _new_tag() -> bytes:
    # Marks the op of one conditional call; 64 random bits never collide in practice.
    return os.urandom(8)


class PulsarMap(Generic[K, V]):
    """A replicated map from keys ``K`` to values ``V`` on one Pulsar topic.

    ::

        async with PulsarMap("pulsar://127.0.0.1:6650", "config") as m:
            await m.put("mode", "fast")
            await m.update("hits", lambda key, hits: (hits or 0) + 1)
            if await m.replace("mode", "fast", "safe"):   # compare-and-set
                ...
            print(len(m), m.get_local("mode"))            # local view, no I/O
            async with m.changes(prefix="mode") as watch:
                async for event in watch:
                    print(event.kind, event.key, event.value)

    Args:
        pulsar: a service URL or a ``pulsar.asyncio.Client`` (as for ``SharedStateManager``).
        topic: the map's topic (non-partitioned, keeps its history).
        key_codec: encodes keys (default :class:`~pulsar_state.StrCodec`). Keys must decode to
            ``str``, ``bytes`` or ``int`` (so JSON keys are str or int).
        value_codec: encodes values (default :class:`~pulsar_state.JsonCodec`); for example
            :class:`~pulsar_state.AvroCodec` for schema-checked records.
        snapshots: enable snapshots (:meth:`snapshot`, ``snapshot_every_records``...) with the
            map's own deterministic codec, built from ``key_codec`` and ``value_codec``
            (keys, values and versions); opening then loads the newest snapshot.
        store: where the entries live: None (default) keeps them in memory;
            :class:`~recipes.DiskStore` keeps them on local disk (LMDB) with a cache of decoded
            values, commits each record with its log position, and resumes from there when
            the map opens again (only the log's tail is replayed).
        **manager_options: passed to :class:`~pulsar_state.SharedStateManager` (``admin_url``,
            timeouts, ``name``, ...); not ``initial_state``/``apply``/``codec``/``copy_state``/
            ``begin_record``, which the map sets.

    Keys and values are stored as every replica decodes them (``decode(encode(x))``): a tuple
    stored through JSON reads back as a list. ``None`` means "absent" and is never stored.

    Values: reads (``get``, ``get_local``, ``range``, ``items``..., ``scan``, watch events)
    hand out the stored values themselves, without a copy, and those cannot be changed:
    values are frozen once when applied, their dicts and lists becoming
    :class:`~recipes.FrozenDict` and :class:`~recipes.FrozenList` (subclasses of dict and
    list: they compare, serialise and pickle as dicts and lists, but every change raises
    ``TypeError``; ``copy.deepcopy(value)`` or :func:`~recipes.thaw` gives a mutable copy).
    A value holding any other mutable object (a custom codec's class) cannot be frozen: reads
    then hand out deep copies. Functions that compute new values (``update``,
    ``update_multiple``, the ``transact`` view) get mutable copies, which they may change and
    return. Key order, used by ``list_keys``/``range``/``all``/``scan`` and the local view, is
    each key type's ``<``: str by code point (the same as UTF-8 byte order), bytes by unsigned
    byte, ints numerically (mixed types: ints, then bytes, then str).

    Versions: a key's version is the :class:`~recipes.MapVersion` of the change that last set
    it: the position of that write's record (1 for the first record on the topic) and the
    change's index among the record's ops, packed in one int. It identifies that one change
    (writes group-committed into one record never share a version), is the same on every
    replica, and orders like the log; an absent key has version 0. A watch reports every
    change with its version (see :meth:`changes`).
    """

    #: SharedStateManager options the map sets itself (passing one raises ConfigurationError).
    reserved_options: ClassVar[frozenset[str]] = _RESERVED_OPTIONS

    @overload
    def __init__(
        self: PulsarMap[str, Any],
        pulsar: Any,
        topic: str,
        *,
        key_codec: None = None,
        value_codec: None = None,
        snapshots: bool = False,
        store: DiskStore | None = None,
        **manager_options: Any,
    ) -> None: ...

    @overload
    def __init__(
        self: PulsarMap[str, V],
        pulsar: Any,
        topic: str,
        *,
        key_codec: None = None,
        value_codec: Codec[V],
        snapshots: bool = False,
        store: DiskStore | None = None,
        **manager_options: Any,
    ) -> None: ...

    @overload
    def __init__(
        self: PulsarMap[K, Any],
        pulsar: Any,
        topic: str,
        *,
        key_codec: Codec[K],
        value_codec: None = None,
        snapshots: bool = False,
        store: DiskStore | None = None,
        **manager_options: Any,
    ) -> None: ...

    @overload
    def __init__(
        self,
        pulsar: Any,
        topic: str,
        *,
        key_codec: Codec[K],
        value_codec: Codec[V],
        snapshots: bool = False,
        store: DiskStore | None = None,
        **manager_options: Any,
    ) -> None: ...

    def __init__(
        self,
        pulsar: Any,
        topic: str,
        *,
        key_codec: Codec[Any] | None = None,
        value_codec: Codec[Any] | None = None,
        snapshots: bool = False,
        store: DiskStore | None = None,
        **manager_options: Any,
    ) -> None:
        reserved = sorted(_RESERVED_OPTIONS & manager_options.keys())
        if reserved:
            raise ConfigurationError(f"PulsarMap sets {', '.join(reserved)} itself")
        if store is not None and not isinstance(store, DiskStore):
            raise ConfigurationError(f"store must be a DiskStore or None, not {store!r}")
        self._codecs: MapCodecs[K, V] = MapCodecs(
            cast(Codec[K], key_codec if key_codec is not None else StrCodec()),
            cast(Codec[V], value_codec if value_codec is not None else JsonCodec()),
        )
        disk = None if store is None else DiskMapState(store, self._codecs)
        state: MapState[K, V] = MapState() if disk is None else disk
        self._state = state
        self._disk = disk
        snapshot_codec: MapSnapshotCodec[K, V] | None = None
        if snapshots:
            snapshot_codec = (
                MapSnapshotCodec(self._codecs) if disk is None else DiskSnapshotCodec(self._codecs)
            )
        # apply mutates the state in place, so the manager keeps this very object: the local
        # view reads it directly, with no I/O.
        self._manager: SharedStateManager[MapState[K, V], MapOp[K, V]] = SharedStateManager(
            pulsar,
            topic,
            initial_state=lambda: state,
            apply=_apply_op,
            codec=MapOpCodec(self._codecs),
            # The writer's trial run works on an overlay (O(what a batch changes)); snapshots
            # take a full copy (a disk store: a read transaction), encoded in another thread.
            trial_state=_trial_of,
            copy_state=_copy_of,
            begin_record=_begin_record,
            snapshot_codec=snapshot_codec,
            # A disk store keeps its own log mark: opening resumes from it.
            durable_state=None if disk is None else DiskDurability(),
            **manager_options,
        )
        if disk is not None:
            disk.bind_topic(str(self._manager.topic))
        self._watches = WatchHub(state, self._manager)
        self._snapshots = snapshots
        self._opened = False
        self._closed = False
        # Weakly: the manager's running tasks must not keep a dropped map alive.
        this = weakref.ref(self)

        def serve_local_checked(*_error: object) -> None:
            found = this()
            if found is not None:
                found._serve_local_checked()

        self._codecs.on_unfrozen = serve_local_checked
        self._manager.add_halt_listener(serve_local_checked)

        def state_replaced() -> None:
            found = this()
            if found is not None:
                found._state_replaced()

        self._manager.add_state_replaced_listener(state_replaced)

    # ------------------------------------------------------------------ lifecycle

    async def open(self, *, timeout: float | None = None) -> None:
        """Connect and replay the topic up to its tail as of now."""
        if self._closed:
            raise ClosedError(f"map on {self.topic} is closed")
        try:
            if self._disk is not None and not self._disk.is_open:
                self._disk.open_store()
            await self._manager.open(timeout=timeout)
        except BaseException as exc:
            if self._disk is not None:
                # Every commit is whole: what is stored is one record boundary, so a failed
                # open still closes cleanly (a refused store was closed untouched already).
                self._disk.close_store(clean=self._disk.is_open)
            # Watches opened before open() end with the failure instead of waiting forever.
            failure = (
                exc if isinstance(exc, PulsarStateError) else ClosedError(f"open failed: {exc!r}")
            )
            self._watches.fail_all(failure)
            raise
        # Opening from a snapshot replaces the state object: every view reads the live one
        # (apply changes it in place from now on, so it stays the same object).
        live = self._manager.read_local(lambda state: state)
        if live is not self._state:
            self._state = live
            self._watches = WatchHub(live, self._manager)
        self._opened = True
        self._watches.start()
        if self._codecs.all_frozen and self._manager.halted is None:
            # The fast local read: the live state's dict of frozen values serves get_local
            # itself (one C call, no copy: nothing a caller gets can change the state). It is
            # taken away at a close, a halt, or the first value that cannot be frozen.
            self.__dict__["get_local"] = live.values.get

    def _state_replaced(self) -> None:
        """The replica fell forward to a snapshot (history trimmed while it was behind): every
        view reads the new state object; watches end (the changes skipped are not known)."""
        if not self._opened or self._closed:
            return  # open() reads the live state when it ends
        live = self._manager.read_local(lambda state: state)
        old, self._state = self._watches, live
        self._watches = WatchHub(live, self._manager)
        self._watches.start()
        old.end(
            WatchOverflowError(
                f"the replica of {self.topic} fell forward to a snapshot at position "
                f"{self.position} (the history before it was trimmed while it was behind): "
                "the changes in between are not known; open a new watch",
                max_queue=0,
                position=self.position,
            )
        )
        self._serve_local_checked()
        if self._codecs.all_frozen and self._manager.halted is None:
            self.__dict__["get_local"] = live.values.get

    def _serve_local_checked(self) -> None:
        """get_local from now on checks the map's state and copies values that are not
        frozen (the class's method)."""
        self.__dict__.pop("get_local", None)

    async def aclose(self, *, timeout: float = 10.0) -> None:
        """Close: end open watches (they raise ClosedError), release the writer, disconnect."""
        if self._closed:
            return
        self._closed = True
        self._serve_local_checked()
        await self._watches.aclose()
        try:
            await self._manager.aclose(timeout=timeout)
        finally:
            if self._disk is not None:
                # After the pump stopped: nothing applies to it any more.
                self._disk.close_store()

    async def __aenter__(self) -> PulsarMap[K, V]:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def topic(self) -> str:
        return str(self._manager.topic)

    @property
    def position(self) -> int:
        """How many records this replica has applied: the map's version."""
        return self._manager.position

    @property
    def stats(self) -> ManagerStats:
        return self._manager.stats

    @property
    def manager(self) -> SharedStateManager[MapState[K, V], MapOp[K, V]]:
        """The SharedStateManager underneath (for monitoring; write through the map)."""
        return self._manager

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError(f"map on {self.topic} is closed")
        if not self._opened:
            raise ClosedError(f"map on {self.topic} is not open: use `async with` or open()")
        halted = self._manager.halted
        if halted is not None:
            error = ReplicaHaltedError(
                f"replica of {self.topic} stopped at position {self.position}: {halted}",
                position=self.position,
            )
            error.__cause__ = halted
            raise error

    async def snapshot(self, *, timeout: float | None = None) -> int:
        """Write a snapshot of the map now (needs ``snapshots=True``); returns its position.

        Replicas opened later load the newest snapshot and replay only what follows it.
        """
        self._check_usable()
        return (await self._manager.snapshot(timeout=timeout)).position

    async def sync(self, *, timeout: float | None = None) -> int:
        """Catch up with the topic's tail as of now; returns the position reached."""
        self._check_usable()
        return await self._manager.sync(timeout=timeout)

    async def wait_for(self, position: int, *, timeout: float | None = None) -> None:
        """Wait until this replica has applied ``position`` (a write's position elsewhere;
        a :class:`~recipes.MapVersion` stands for its own ``position``)."""
        self._check_usable()
        if isinstance(position, MapVersion):
            position = position.position
        await self._manager.wait_for(position, timeout=timeout)

    # ------------------------------------------------------------------ reads (PIP)

    async def _read(
        self, reader: Callable[[MapState[K, V]], T], latest: bool, timeout: float | None
    ) -> T:
        self._check_usable()
        return await self._manager.read(reader, latest=latest, timeout=timeout)

    async def get(self, key: K, *, latest: bool = False, timeout: float | None = None) -> V | None:
        """The value bound to ``key``, or None.

        ``latest=False`` reads the local replica (no I/O); ``latest=True`` first catches up
        with the tail of the topic as of the call (linearizable).
        """
        return await self.get_or_default(key, None, latest=latest, timeout=timeout)

    async def get_or_default(
        self, key: K, default: D, *, latest: bool = False, timeout: float | None = None
    ) -> V | D:
        """The value bound to ``key``, or ``default``."""

        def lookup(state: MapState[K, V]) -> V | D:
            entry = state.entries.get(key)
            return default if entry is None else readable(entry.value)

        return await self._read(lookup, latest, timeout)

    async def scan(
        self,
        filter: Callable[[K], bool],
        processor: Callable[[K, V], object],
        *,
        latest: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Call ``processor(key, value)`` for each key that ``filter(key)`` accepts.

        Keys are visited in key order, all on one consistent state, synchronously on the event
        loop (keep both functions short). Returns how many entries were processed.
        """

        def run(state: MapState[K, V]) -> int:
            matching = state.matching(filter)
            for key, entry in matching:
                processor(key, readable(entry.value))
            return len(matching)

        return await self._read(run, latest, timeout)

    async def list_keys(self, *, latest: bool = False, timeout: float | None = None) -> list[K]:
        """All keys, in key order."""
        return await self._read(lambda state: list(state.sorted_keys()), latest, timeout)

    async def version(
        self, key: K, *, latest: bool = False, timeout: float | None = None
    ) -> MapVersion:
        """The version of the change that last set ``key``; 0 if it is absent."""

        def lookup(state: MapState[K, V]) -> MapVersion:
            entry = state.entries.get(key)
            return NO_VERSION if entry is None else entry.version

        return await self._read(lookup, latest, timeout)

    async def entry(
        self, key: K, *, latest: bool = False, timeout: float | None = None
    ) -> MapEntry[V] | None:
        """The value and version of ``key`` read together, or None if absent."""

        def lookup(state: MapState[K, V]) -> MapEntry[V] | None:
            entry = state.entries.get(key)
            return None if entry is None else MapEntry(readable(entry.value), entry.version)

        return await self._read(lookup, latest, timeout)

    async def entries(
        self, *, latest: bool = False, timeout: float | None = None
    ) -> list[tuple[K, MapEntry[V]]]:
        """Every key with its value and version, in key order, from ONE consistent state.

        A list taken from one state of the map (never a mix of two), like :meth:`all` but with
        each key's version (the :class:`~recipes.MapVersion` of the change that last set it).
        """

        def run(state: MapState[K, V]) -> list[tuple[K, MapEntry[V]]]:
            return [
                (key, MapEntry(readable(entry.value), entry.version))
                for key, entry in state.entries_in_order()
            ]

        return await self._read(run, latest, timeout)

    # ------------------------------------------------------------------ reads (Samza)

    async def range(
        self,
        from_key: K | None,
        to_key: K | None,
        *,
        latest: bool = False,
        timeout: float | None = None,
    ) -> list[tuple[K, V]]:
        """The entries with ``from_key <= key < to_key``, in key order (None: unbounded).

        A list taken from one consistent state (not a lazy iterator).
        """
        for bound in (from_key, to_key):
            if bound is not None and type(bound) not in KEY_TYPES:
                raise ConfigurationError(
                    f"range bounds are keys (str, bytes or int), not {type(bound).__name__}"
                )

        def run(state: MapState[K, V]) -> list[tuple[K, V]]:
            return [(k, readable(v)) for k, v in state.items_between(from_key, to_key)]

        return await self._read(run, latest, timeout)

    async def all(self, *, latest: bool = False, timeout: float | None = None) -> list[tuple[K, V]]:
        """Every entry, in key order, from one consistent state."""
        return await self.range(None, None, latest=latest, timeout=timeout)

    # ------------------------------------------------------------------ the local view

    def __len__(self) -> int:
        """How many keys the local replica holds (no I/O)."""
        self._check_usable()
        return len(self._state.entries)

    def __contains__(self, key: object) -> bool:
        self._check_usable()
        return key in self._state.entries

    def __iter__(self) -> Iterator[K]:
        """The local keys in key order (a snapshot)."""
        return iter(self.keys())

    def keys(self) -> list[K]:
        """The local keys, in key order (a snapshot)."""
        self._check_usable()
        return list(self._state.sorted_keys())

    def values(self) -> list[V]:
        """The local values, in key order (a snapshot)."""
        self._check_usable()
        return [readable(value) for _key, value in self._state.items_between(None, None)]

    def items(self) -> list[tuple[K, V]]:
        """The local entries, in key order (a snapshot)."""
        self._check_usable()
        return [(key, readable(value)) for key, value in self._state.items_between(None, None)]

    @overload
    def get_local(self, key: K, /) -> V | None: ...

    @overload
    def get_local(self, key: K, default: D, /) -> V | D: ...

    def get_local(self, key: K, default: D | None = None, /) -> V | D | None:
        """The locally known value of ``key``, or ``default`` (no I/O; both positional).

        As fast as a dict lookup: the value is the stored one, read-only (see "Values"
        in the class's documentation), not a copy.
        """
        self._check_usable()
        entry = self._state.entries.get(key)
        return default if entry is None else readable(entry.value)

    # ------------------------------------------------------------------ writes

    async def _write(
        self,
        generator: Callable[[MapState[K, V]], list[MapOp[K, V]]],
        reader: Callable[[MapState[K, V]], T],
        timeout: float | None,
    ) -> WriteResult[T]:
        self._check_usable()
        return await self._manager.write(generator, reader=reader, timeout=timeout)

    async def _write_blind(self, ops: list[MapOp[K, V]], timeout: float | None) -> int:
        self._check_usable()
        return (await self._manager.write_ops(ops, timeout=timeout)).position

    async def put(self, key: K, value: V, *, timeout: float | None = None) -> MapVersion:
        """Bind ``key`` to ``value``; returns the key's new version (unique to this change;
        its ``position`` is the write's position).

        Always writes, even when the value is unchanged. ``value`` must not be None (use
        :meth:`delete`); a key or value the codecs reject raises CodecError, sending nothing.
        """
        op = self._codecs.put(key, value)
        norm_key = cast(K, op.key)

        def new_version(state: MapState[K, V]) -> MapVersion:
            # Read right after this write's op was applied: the version it stamped.
            return state.entries[norm_key].version

        return (await self._write(lambda _state: [op], new_version, timeout)).value

    def check_entry(self, key: K, value: V) -> None:
        """Raise what :meth:`put` would raise for this key and value (CodecError: a key or
        value the codecs refuse), writing nothing: check a whole load before any write."""
        self._codecs.put(key, value)

    async def put_all(
        self, entries: Mapping[K, V] | Iterable[tuple[K, V]], *, timeout: float | None = None
    ) -> int:
        """Bind several keys in ONE atomic write; returns its position (every key's new
        version has that ``position``; each change has its own version).

        Takes a mapping or ``(key, value)`` pairs (a repeated key: the last pair wins). Every
        key and value is encoded before anything is sent. The write must fit in one record
        (``max_record_bytes``, else RecordTooLargeError).
        """
        pairs = entries.items() if isinstance(entries, Mapping) else entries
        ops = [self._codecs.put(key, value) for key, value in pairs]
        return await self._write_blind(ops, timeout)

    async def delete(self, key: K, *, timeout: float | None = None) -> bool:
        """Remove ``key``; returns whether it was bound (so this call removed it)."""
        norm_key, key_bytes = self._codecs.key(key)
        tag = _new_tag()
        op: MapOp[K, V] = MapOp("DELETE", norm_key, None, key_bytes, None, tag)

        def generator(state: MapState[K, V]) -> list[MapOp[K, V]]:
            return [op] if norm_key in state.entries else []

        return (await self._write(generator, lambda s: s.last_tag == tag, timeout)).value

    async def clear(self, *, timeout: float | None = None) -> int:
        """Remove every key (but the protected ones: :data:`PROTECTED_PREFIXES`) in one write;
        returns its position. Watches see one clear event (then the protected keys put back)."""
        codecs = self._codecs

        def generator(state: MapState[K, V]) -> list[MapOp[K, V]]:
            # Each prefix is one key range: O(log n + kept), never a walk over the map.
            kept = [
                item
                for low, high in _PROTECTED_RANGES
                for item in state.items_between(cast(K, low), cast(K, high))
            ]
            if len(kept) == len(state.entries):
                return []  # nothing to remove
            return [_CLEAR] + [
                codecs.put_known(key, codecs.key_bytes(key), thaw(value)) for key, value in kept
            ]

        return (await self._write(generator, lambda s: None, timeout)).position

    async def update(
        self, key: K, fn: Callable[[K, V | None], V | None], *, timeout: float | None = None
    ) -> V | None:
        """Set ``key`` to ``fn(key, current)`` on the up-to-date map; returns the new value.

        ``current`` is None when the key is absent (and is the caller's own copy: ``fn`` may
        change and return it). ``fn`` returning None deletes the key. Nothing is written when
        the result equals the current value. ``fn`` may run more than once (when another
        process wrote first) and must not have side effects; if it raises, the call raises
        that error and nothing is written.
        """
        norm_key, key_bytes = self._codecs.key(key)
        codecs = self._codecs

        def generator(state: MapState[K, V]) -> list[MapOp[K, V]]:
            entry = state.entries.get(norm_key)
            new = fn(norm_key, None if entry is None else detached(entry.value))
            if new is None:
                return [] if entry is None else [MapOp("DELETE", norm_key, None, key_bytes)]
            op = codecs.put_known(norm_key, key_bytes, new)
            return [] if entry is not None and op.value == entry.value else [op]

        def new_value(state: MapState[K, V]) -> V | None:
            entry = state.entries.get(norm_key)
            return None if entry is None else readable(entry.value)

        return (await self._write(generator, new_value, timeout)).value

    async def update_multiple(
        self,
        filter: Callable[[K], bool],
        fn: Callable[[K, V], V | None],
        *,
        timeout: float | None = None,
    ) -> int:
        """Apply ``fn(key, value)`` to every key ``filter`` accepts, in ONE atomic write.

        Keys are visited in key order on the up-to-date map, and ``fn`` gets a copy of each
        value (it may change and return it). ``fn`` returning None deletes the key; keys whose
        value does not change are not written. Like ``update``, both functions may run more
        than once and must not have side effects. Returns the write's position.
        """
        codecs = self._codecs

        def visited(key: K) -> bool:
            return not _protected(key) and filter(key)

        def generator(state: MapState[K, V]) -> list[MapOp[K, V]]:
            ops: list[MapOp[K, V]] = []
            for key, entry in state.matching(visited):
                new = fn(key, detached(entry.value))
                if new is None:
                    ops.append(MapOp("DELETE", key, None, codecs.key_bytes(key)))
                    continue
                op = codecs.put_known(key, codecs.key_bytes(key), new)
                if op.value != entry.value:
                    ops.append(op)
            return ops

        return (await self._write(generator, lambda s: None, timeout)).position

    async def transact(
        self,
        fn: Callable[[Mapping[K, V]], Mapping[K, V | None]],
        *,
        timeout: float | None = None,
    ) -> int | None:
        """Add, change and delete any keys in ONE atomic write decided on the up-to-date map.

        ``fn(view)`` gets a read-only view of the up-to-date map (a ``Mapping``: ``view[key]``,
        ``view.get(key)``, ``key in view``, ``len(view)``, iteration in key order; values
        handed out are copies) and returns the changes to make: ``{key: new value}``, with
        None meaning "delete". Unlike :meth:`update_multiple`, the changes may add keys, so
        "a conditional multi-key upsert" (decide from some keys, write others, including new
        ones) is one write: every replica applies all of it or none of it, and it is applied
        only to the very state ``fn`` saw (otherwise ``fn`` runs again on the newer state).

        Changes that change nothing (a value equal to the current one, deleting an absent
        key) are not written. Like :meth:`update`, ``fn`` may run more than once and must not
        have side effects; if it raises, or a key or value cannot be encoded, the call raises
        that error and nothing is written. The changes must fit in one record
        (``max_record_bytes``, else RecordTooLargeError; nothing is written).

        Returns the write's position (the ``position`` of every changed key's new version), or
        None when the final run of ``fn`` asked for no change (then the map was not changed).
        """
        codecs = self._codecs
        tag = _new_tag()

        def generator(state: MapState[K, V]) -> list[MapOp[K, V]]:
            ops: list[MapOp[K, V]] = []
            for key, value in fn(_View(state)).items():
                norm_key, key_bytes = codecs.key(key)
                entry = state.entries.get(norm_key)
                if value is None:
                    if entry is not None:
                        ops.append(MapOp("DELETE", norm_key, None, key_bytes))
                    continue
                op = codecs.put_known(norm_key, key_bytes, value)
                if entry is None or op.value != entry.value:
                    ops.append(op)
            if ops:
                # One tag (on the last op) tells whether this call's write was the one applied.
                ops[-1] = dataclasses.replace(ops[-1], tag=tag)
            return ops

        result = await self._write(generator, lambda s: s.last_tag == tag, timeout)
        return result.position if result.value else None

    async def replace(
        self, key: K, expected: V | None, value: V | None, *, timeout: float | None = None
    ) -> bool:
        """Compare-and-set on the value: bind ``key`` to ``value`` only if its current value
        equals ``expected``. Returns whether it did (True: this call's write changed the key).

        ``expected=None`` means "only if absent"; ``value=None`` deletes the key. Values are
        compared after normalisation through the codec, with ``==``. True means the key
        changed: ``replace(key, None, None)`` (delete if absent) changes nothing and returns
        False, as does ``replace_version(key, 0, None)``.
        """
        norm_key, key_bytes = self._codecs.key(key)
        wanted = None if expected is None else self._codecs.value(expected)[0]
        tag = _new_tag()
        op = self._conditional_op(norm_key, key_bytes, value, tag)

        def generator(state: MapState[K, V]) -> list[MapOp[K, V]]:
            entry = state.entries.get(norm_key)
            if entry is None and value is None:
                return []  # deleting an absent key changes nothing: not a successful swap
            return [op] if (None if entry is None else entry.value) == wanted else []

        return (await self._write(generator, lambda s: s.last_tag == tag, timeout)).value

    async def replace_version(
        self,
        key: K,
        expected_version: int | None,
        value: V | None,
        *,
        timeout: float | None = None,
    ) -> bool:
        """Compare-and-set on the version: bind ``key`` to ``value`` only if its version is
        ``expected_version`` (0 or None: only if absent). Returns whether it did.

        ``value=None`` deletes the key. The new version is this change's own; read it with
        :meth:`version`. A version identifies one change, so a version read before another
        write to the key never matches after it, even when both writes shared one record.
        """
        norm_key, key_bytes = self._codecs.key(key)
        wanted = expected_version or 0
        tag = _new_tag()
        op = self._conditional_op(norm_key, key_bytes, value, tag)

        def generator(state: MapState[K, V]) -> list[MapOp[K, V]]:
            entry = state.entries.get(norm_key)
            if entry is None and value is None:
                return []  # deleting an absent key changes nothing: not a successful swap
            return [op] if (0 if entry is None else entry.version) == wanted else []

        return (await self._write(generator, lambda s: s.last_tag == tag, timeout)).value

    def _conditional_op(self, key: K, key_bytes: bytes, value: V | None, tag: bytes) -> MapOp[K, V]:
        if value is None:
            return MapOp("DELETE", key, None, key_bytes, None, tag)
        return self._codecs.put_known(key, key_bytes, value, tag=tag)

    async def put_if_absent(self, key: K, value: V, *, timeout: float | None = None) -> V:
        """Bind ``key`` to ``value`` if it is absent; returns the value bound now either way.

        The returned value equals ``value`` (normalised) when this call bound it, or is the
        value already there (like ``dict.setdefault``). For a plain "did I win?" use
        ``replace(key, None, value)``.
        """
        op = self._codecs.put(key, value)
        norm_key = cast(K, op.key)

        def generator(state: MapState[K, V]) -> list[MapOp[K, V]]:
            return [] if norm_key in state.entries else [op]

        def bound(state: MapState[K, V]) -> V:
            return readable(state.entries[norm_key].value)

        return (await self._write(generator, bound, timeout)).value

    # ------------------------------------------------------------------ watches

    def changes(
        self,
        *,
        key: K | None = None,
        prefix: str | bytes | None = None,
        snapshot: bool = True,
        max_queue: int = 10_000,
        from_position: int | None = None,
    ) -> MapWatch[K, V]:
        """Watch the map: a consistent snapshot, then every change in log order.

        Watches every key, one ``key``, or the str/bytes keys starting with ``prefix``. The
        watch starts when this is called: it first yields the matching entries as ``put``
        events with ``initial=True`` (unless ``snapshot=False``), then every later change to a
        matching key as ``put``/``delete`` events, and every ``clear`` of the map, each once and
        in log order. Deleting an absent key is not a change.

        Up to ``max_queue`` changes wait for the consumer (the snapshot does not count; a
        consumer with none waiting takes one write's changes whatever their number); a
        consumer further behind gets :class:`~recipes.WatchOverflowError` from its next call,
        and the watch stops (open a new one to resynchronise). See :class:`MapWatch`.

        History: called before :meth:`open` on a map without ``snapshots``, the watch starts
        from the empty map at position 0, so it yields every change of the topic's history as
        the opening replay applies it (the whole history waits in its queue until consumed:
        size ``max_queue`` for it). A map with snapshots may skip history when it opens, so
        it refuses this.

        ``from_position=p`` resumes a watch: no snapshot, and only the changes at positions
        after ``p`` (an event's ``position``), the earlier ones not even queued. Before
        :meth:`open` (a map without snapshots or a disk store) that is any ``p``; on an open
        map, ``p`` must not be behind the replica (it keeps no history): ConfigurationError
        otherwise. If
        the topic's history before ``p`` was trimmed (``trim_history``), the opening replay
        cannot pass the trimmed point and the watch ends with that error.
        """
        if self._opened or self._closed:
            self._check_usable()
        elif self._snapshots:
            raise ClosedError(
                f"map on {self.topic} is not open: a map with snapshots only watches once open "
                "(opening may load a snapshot and skip the history before it)"
            )
        elif self._disk is not None:
            raise ClosedError(
                f"map on {self.topic} is not open: a map on a disk store only watches once "
                "open (opening resumes from the store and skips the history before it)"
            )
        if key is not None and prefix is not None:
            raise ConfigurationError("watch one key or one prefix, not both")
        if max_queue < 1:
            raise ConfigurationError("max_queue must be at least 1")
        if from_position is not None:
            if isinstance(from_position, bool) or not isinstance(from_position, int):
                raise ConfigurationError(f"from_position must be an int, not {from_position!r}")
            if from_position < 0:
                raise ConfigurationError(f"from_position must be >= 0, not {from_position}")
            if self._opened and from_position < self.position:
                raise ConfigurationError(
                    f"changes after position {from_position}: this replica is at "
                    f"{self.position} and keeps no history; watch before open() (on a map "
                    "without snapshots, whose opening replays the history) to resume there"
                )
            snapshot = False
        accept: Callable[[MapEvent[K, V]], bool]
        # The keys whose entries the snapshot may hold (None: every key): a watch on a key
        # or a prefix reads only those, not the whole map (which a disk store would decode).
        candidates: Callable[[MapState[K, V]], Iterable[K]] | None = None
        if key is not None:
            watched = self._codecs.key(key)[0]

            def accept(event: MapEvent[K, V]) -> bool:
                return event.kind == "clear" or event.key == watched

            def candidates(state: MapState[K, V]) -> Iterable[K]:
                return (watched,)

        elif prefix is not None:
            if not isinstance(prefix, str | bytes):
                raise ConfigurationError("prefix must be str or bytes")
            # A str or bytes subclass (a str enum member) matches as its plain value does.
            start: str | bytes = exact_key(prefix)
            low, high = cast(K, start), cast("K | None", prefix_end(start))

            def accept(event: MapEvent[K, V]) -> bool:
                found = event.key
                return event.kind == "clear" or (
                    isinstance(found, type(start)) and cast(Any, found).startswith(start)
                )

            def candidates(state: MapState[K, V]) -> Iterable[K]:
                return state.keys_between(low, high)

        else:

            def accept(event: MapEvent[K, V]) -> bool:
                return True

        if from_position is not None:
            after, matches = from_position, accept

            def accept(event: MapEvent[K, V]) -> bool:
                return event.position > after and matches(event)

        return self._watches.open(
            accept,
            snapshot=snapshot,
            max_queue=max_queue,
            candidates=candidates,
            after=from_position,
        )


class _View(Mapping[K, V]):
    """The read-only view of a map's state handed to :meth:`PulsarMap.transact`."""

    __slots__ = ("_state",)

    def __init__(self, state: MapState[K, V]) -> None:
        self._state = state

    def __getitem__(self, key: K) -> V:
        return detached(self._state.entries[key].value)

    def __contains__(self, key: object) -> bool:
        return key in self._state.entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._state.sorted_keys())

    def __len__(self) -> int:
        return len(self._state.entries)
