"""PulsarMap's disk store: the map's entries in LMDB on local disk, a bounded cache of decoded
values in front, and the log mark of the last applied record stored with them.

Samza's local state, on the core's ``durable_state`` hook: each record's changes and its
:class:`~pulsar_state.LogMark` are committed in ONE LMDB write transaction, so a process killed
at any instant reopens to exactly a record boundary, and opening replays only the log's tail.

Layout of a store directory:

* ``PULSAR_STATE_MAP``: a small JSON marker (``format``), written first, so that a directory
  is known to be ours before anything is opened in it (a directory that is not a store of
  ours is never touched).
* ``data.mdb`` / ``lock.mdb``: the LMDB environment, with two databases: ``data`` (one entry
  per key) and ``meta`` (``info``: format, topic, codecs, boot id, clean flag; ``mark``:
  the log mark, the number of keys).
* ``owner.lock``: held with ``flock`` while a process has the store open (LMDB allows many
  processes; a map store has exactly one).

Keys are stored in an order-preserving encoding of the decoded key (:func:`store_key`), so
LMDB's byte order IS the map's :func:`~recipes._map_ops.key_order`: ints (sign, length,
magnitude), then bytes (raw), then str (UTF-8, whose byte order is code-point order). A value
is stored as its version (8 bytes) and the value codec's bytes of the normalised value: the
bytes the map's snapshot codec writes.

Writes are not fsynced per record: LMDB's pages go to the OS page cache on commit, so a killed
process loses nothing committed, and the log is the durable copy. A machine that crashes
while the store is open may leave torn pages: the store records the kernel's boot id and a
clean flag (set by a clean close after an fsync), and a store opened under another boot id
without a clean close is not trusted (refused, or rebuilt from the log).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import struct
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Generic, Literal, TypeVar, cast

from pulsar_state import (
    BytesCodec,
    Codec,
    CodecError,
    ConfigurationError,
    JsonCodec,
    LogMark,
    LogPosition,
    PulsarStateError,
    StrCodec,
)

from ._map_ops import (
    KEY_TYPES,
    MapCodecs,
    MapEntry,
    MapEvent,
    MapOp,
    MapSnapshotCodec,
    MapState,
    MapVersion,
    _TrialMapState,
    _Values,
)
from ._sorted_table import exact_key

__all__ = [
    "DiskDurability",
    "DiskMapState",
    "DiskSnapshotCodec",
    "DiskStore",
    "LocalStoreError",
    "key_from_store",
    "store_key",
]

logger = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")

# 2: the mark may carry the history's origin (a store of format 1 is read as having none).
# 3: the entries live in one of two databases, the meta "active" key names which: a snapshot is
# loaded into the other, then switched to in one transaction.
# 4: the mark may name records ignored as stale (state 3): read as another history before.
FORMAT: Final = 4
MARKER = "PULSAR_STATE_MAP"
_OWNER_LOCK = "owner.lock"
_INFO = b"info"
_MARK = b"mark"
# LMDB's key size limit (MDB_MAXKEYSIZE in the bundled build): a longer encoded key is refused.
MAX_KEY_BYTES: Final = 511

_VERSION = struct.Struct(">Q")
# state (0 empty, 1 at a mark, 2 at a mark with an origin, 3 at a mark naming stale records),
# position, ledger, entry, number of keys; the record id follows: the rest (state 1), or
# (state 2) its length (_ID_LENGTH) first, then the origin's record id (ids may hold any
# character, NUL included), or (state 3, rare) a JSON object of the record id, the origin and
# the stale records (pairs of id and claimed position, LogMark.stale).
_MARK_HEAD = struct.Struct(">Bqqqq")
_ID_LENGTH = struct.Struct(">I")
_ACTIVE = b"active"
_DATABASES = (b"data", b"data.b")
# A snapshot is stored in transactions of about this many bytes of entries: LMDB holds a write
# transaction's dirty pages in memory until it commits.
_LOAD_TRANSACTION_BYTES = 16 * 1024 * 1024
_INVERT = bytes(255 - i for i in range(256))
_INT, _BYTES, _STR = 0x00, 0x01, 0x02


class LocalStoreError(PulsarStateError):
    """A map's local store cannot be used: not a store of ours, written by a newer format,
    held by another process, or (with ``on_mismatch="error"``) holding another history of
    the topic. Nothing in the store was changed."""


# ---------------------------------------------------------------------- key encoding


def store_key(key: Any) -> bytes:
    """``key`` in an encoding whose byte order is the map's key order (see the module doc)."""
    kind = type(key)
    if kind is str:
        return b"\x02" + cast(str, key).encode("utf-8", "surrogatepass")
    if kind is bytes:
        return b"\x01" + cast(bytes, key)
    if kind is int:
        number = cast(int, key)
        if number >= 0:
            magnitude = number.to_bytes((number.bit_length() + 7) // 8, "big")
            return b"\x00\x01" + len(magnitude).to_bytes(4, "big") + magnitude
        magnitude = (-number).to_bytes(((-number).bit_length() + 7) // 8, "big")
        # Longer and larger magnitudes are smaller numbers: both are inverted.
        return (
            b"\x00\x00"
            + (0xFFFFFFFF - len(magnitude)).to_bytes(4, "big")
            + magnitude.translate(_INVERT)
        )
    raise CodecError(f"keys must be str, bytes or int, not {kind.__name__}")


def key_from_store(data: bytes) -> Any:
    """The key :func:`store_key` encoded as ``data``."""
    kind = data[0]
    if kind == _STR:
        return data[1:].decode("utf-8", "surrogatepass")
    if kind == _BYTES:
        return data[1:]
    if kind == _INT and len(data) >= 6:
        if data[1] == 1:
            return int.from_bytes(data[6:], "big")
        return -int.from_bytes(data[6:].translate(_INVERT), "big")
    raise CodecError(f"not a stored key: {data[:16]!r}")


def _exact(key: Any) -> Any:
    """The stored key a key looked up names, or None when no stored key can equal it.

    A key equal to a stored one but of another type (a str enum member, True for 1, an
    IntEnum) names that key, as it does in a dict (the in-memory map)."""
    if type(key) in KEY_TYPES:
        return key
    hash(key)  # an unhashable key raises TypeError, as a dict would
    exact = exact_key(key)
    return exact if type(exact) in KEY_TYPES else None


def _bound(key: Any) -> bytes | None:
    return None if key is None else store_key(key)


# ---------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class DiskStore:
    """A PulsarMap's entries on local disk: ``PulsarMap(url, topic, store=DiskStore(path))``.

    Args:
        path: the store's directory (created if missing). One map, one topic, one process.
        cache_bytes: the budget of the cache of decoded values (an estimate of their size in
            memory; least recently used values are dropped first).
        on_mismatch: what to do when the store holds another history than the topic's (a
            topic deleted and created again, another topic, a mark past the tail, other
            codecs, or a machine crash while it was open): ``"error"`` (default) refuses to
            open with :class:`LocalStoreError` and changes nothing; ``"rebuild"`` empties the
            store and rebuilds it from the newest snapshot and the log. The machine-crash
            check is Linux-only (it reads the boot id in /proc/sys/kernel/random/boot_id):
            elsewhere a store left open across a machine crash is not detected.
        map_size: LMDB's address space for the store (the largest it may grow to; sparse).
    """

    path: str | os.PathLike[str]
    cache_bytes: int = 64 * 1024 * 1024
    on_mismatch: Literal["error", "rebuild"] = "error"
    map_size: int = 1 << 40

    def __post_init__(self) -> None:
        if self.on_mismatch not in ("error", "rebuild"):
            raise ValueError(f"on_mismatch must be 'error' or 'rebuild', not {self.on_mismatch!r}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, not {self.cache_bytes}")


def _lmdb() -> Any:
    # Imported when a store opens: LMDB is the optional ``disk`` extra.
    try:
        import lmdb
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigurationError(
            "a disk-backed PulsarMap needs LMDB: pip install 'pulsar-state[disk]'"
        ) from exc
    return lmdb


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _codec_name(codec: Codec[Any]) -> str:
    kind = type(codec)
    return f"{kind.__module__}.{kind.__qualname__}"


# ---------------------------------------------------------------------- the LRU cache

# A rough size in memory of one cached entry besides its value's bytes: the decoded value's
# object headers, its MapEntry and MapVersion, the key, and the cache's own node.
_ENTRY_OVERHEAD = 240


class _Cache(Generic[K, V]):
    """Decoded entries, least recently used dropped first past ``max_bytes`` (estimated)."""

    __slots__ = ("_bytes", "_items", "hits", "max_bytes", "misses")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[K, tuple[MapEntry[V], int]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: K) -> MapEntry[V] | None:
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return item[0]

    def peek(self, key: K) -> MapEntry[V] | None:
        item = self._items.get(key)
        return None if item is None else item[0]

    def put(self, key: K, entry: MapEntry[V], size: int) -> None:
        cost = size + _ENTRY_OVERHEAD
        if cost > self.max_bytes:
            self.pop(key)
            return
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        self._items[key] = (entry, cost)
        self._bytes += cost
        while self._bytes > self.max_bytes:
            _key, (_entry, dropped) = self._items.popitem(last=False)
            self._bytes -= dropped

    def pop(self, key: K) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= old[1]

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def size_bytes(self) -> int:
        return self._bytes


# ---------------------------------------------------------------------- the LMDB environment


class _Env:
    """The store's directory: marker, owner lock, LMDB environment, info and mark."""

    def __init__(self, config: DiskStore) -> None:
        self.config = config
        self.path = Path(config.path)
        self.env: Any = None
        # As meta's "active" names them (a load swaps them when it commits the switch).
        self.data: Any = None  # the entries (the active database)
        self.spare: Any = None  # where a snapshot is loaded, then switched to
        self.spare_name = _DATABASES[1]
        # Whether the store was closed cleanly before this open (open marks it not clean).
        self.was_clean = True
        self.meta: Any = None
        self._lock_fd: int | None = None

    def open(self, topic: str, codecs: tuple[str, str]) -> str | None:
        """Open (creating a new store if there is none); returns why the stored content
        cannot be trusted for this map, or None. Raises LocalStoreError for a directory
        that is not a store of ours, a newer format, or a store open elsewhere."""
        path = self.path
        if path.exists() and not path.is_dir():
            raise LocalStoreError(f"{path} is not a directory: not a PulsarMap store")
        marker = path / MARKER
        # The marker's scratch files do not count: a first open killed before the rename
        # left one. (Left in place: another process's first open may be renaming its own.)
        if (
            path.exists()
            and not marker.exists()
            and any(not entry.name.startswith(f".{MARKER}.") for entry in path.iterdir())
        ):
            raise LocalStoreError(
                f"{path} is not a PulsarMap store (no {MARKER} file) and is not empty: "
                "refusing to use it (give a new or empty directory)"
            )
        if marker.exists():
            try:
                found = json.loads(marker.read_text())
                version = int(found["format"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise LocalStoreError(f"{marker} is damaged: {exc}") from exc
            if version > FORMAT:
                raise LocalStoreError(
                    f"{path} was written by a newer pulsar-state (store format {version}, "
                    f"this one reads up to {FORMAT}): upgrade, or give another directory"
                )
        else:
            path.mkdir(parents=True, exist_ok=True)
            scratch = path / f".{MARKER}.{uuid.uuid4().hex}"
            with scratch.open("w") as file:
                file.write(json.dumps({"format": FORMAT}))
                file.flush()
                os.fsync(file.fileno())  # a machine crash leaves no empty marker
            os.replace(scratch, marker)  # first: from now on the directory is ours
            _fsync_directory(path)  # and the rename is not lost in a machine crash
        lmdb = _lmdb()
        self._lock(path / _OWNER_LOCK)
        try:
            self.env = lmdb.open(
                str(path),
                map_size=self.config.map_size,
                max_dbs=3,
                subdir=True,
                # Commits reach the page cache, not the disk: a killed process loses nothing
                # committed; a machine crash is detected by the boot id (see the module doc).
                sync=False,
                metasync=False,
                readahead=False,
            )
            self.meta = self.env.open_db(b"meta")
            with self.env.begin(db=self.meta) as txn:
                active = bytes(txn.get(_ACTIVE) or _DATABASES[0])
            self.spare_name = _DATABASES[1] if active == _DATABASES[0] else _DATABASES[0]
            self.data = self.env.open_db(active)
            self.spare = self.env.open_db(self.spare_name)
            self.drop_spare()  # what a load killed half-way left, if anything
            return self._check_info(topic, codecs)
        except BaseException:
            self.close(clean=False)
            raise

    def _lock(self, lock_path: Path) -> None:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise LocalStoreError(
                f"the store {self.path} is open in another process (or another map of this "
                "one): a store serves one map"
            ) from exc
        self._lock_fd = fd

    def _check_info(self, topic: str, codecs: tuple[str, str]) -> str | None:
        with self.env.begin(db=self.meta) as txn:
            raw = txn.get(_INFO)
        boot = _boot_id()
        reason: str | None = None
        if raw is not None:
            info = json.loads(raw)
            self.was_clean = bool(info.get("clean"))
            if int(info.get("format", 0)) > FORMAT:
                raise LocalStoreError(
                    f"{self.path} was written by a newer pulsar-state (store format "
                    f"{info.get('format')}, this one reads up to {FORMAT})"
                )
            if info.get("topic") != topic:
                reason = f"the store holds the map of topic {info.get('topic')}, not {topic}"
            elif [info.get("key_codec"), info.get("value_codec")] != list(codecs):
                reason = (
                    f"the store was written with codecs {info.get('key_codec')} / "
                    f"{info.get('value_codec')}, this map uses {codecs[0]} / {codecs[1]}"
                )
            elif not info.get("clean") and info.get("boot_id") != boot:
                reason = (
                    "the machine restarted while the store was open (writes are not synced "
                    "per record, so its last pages may be torn)"
                )
        return reason

    def write_info(self, topic: str, codecs: tuple[str, str], *, clean: bool) -> None:
        info = {
            "format": FORMAT,
            "topic": topic,
            "key_codec": codecs[0],
            "value_codec": codecs[1],
            "boot_id": _boot_id(),
            "clean": clean,
        }
        with self.env.begin(write=True, db=self.meta) as txn:
            txn.put(_INFO, json.dumps(info, sort_keys=True).encode())
        self.env.sync(True)

    def wipe(self) -> None:
        """Empty the store (one transaction): no entries, no mark."""
        with self.env.begin(write=True) as txn:
            txn.drop(self.data, delete=False)
            txn.drop(self.spare, delete=False)
            txn.delete(_MARK, db=self.meta)

    def drop_spare(self) -> None:
        """Empty the spare database (a few milliseconds even for millions of entries: LMDB
        frees the leaf pages without reading them)."""
        with self.env.begin(write=True) as txn:
            if txn.stat(self.spare)["entries"]:
                txn.drop(self.spare, delete=False)

    def switched(self) -> None:
        """The spare database was made the active one (by a load): swap the handles."""
        self.data, self.spare = self.spare, self.data
        self.spare_name = _DATABASES[1] if self.spare_name == _DATABASES[0] else _DATABASES[0]

    def read_mark(self) -> tuple[LogMark | None, int]:
        with self.env.begin(db=self.meta) as txn:
            raw = txn.get(_MARK)
        if raw is None:
            return None, 0
        state, position, ledger, entry, count = _MARK_HEAD.unpack_from(raw)
        if state == 0:
            return None, 0
        ids, origin = bytes(raw[_MARK_HEAD.size :]), None
        if state == 3:
            named = json.loads(ids)
            at = LogPosition(ledger, entry)
            stale = tuple((record_id, claim) for record_id, claim in named["stale"])
            return LogMark(position, named["id"], at, named["origin"], stale), count
        if state == 2:
            (length,) = _ID_LENGTH.unpack_from(ids)
            ids = ids[_ID_LENGTH.size :]
            origin = ids[length:].decode()
            ids = ids[:length]
        return LogMark(position, ids.decode(), LogPosition(ledger, entry), origin), count

    def close(self, *, clean: bool, topic: str = "", codecs: tuple[str, str] = ("", "")) -> None:
        if self.env is not None:
            try:
                if clean:
                    self.env.sync(True)
                    self.write_info(topic, codecs, clean=True)
            except _lmdb().Error as exc:  # a full disk: the store stays "not clean", that is all
                logger.warning("could not mark the store %s closed cleanly: %s", self.path, exc)
            finally:
                self.env.close()
                self.env = None
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None


def _batches(entries: Iterable[tuple[bytes, bytes]]) -> Iterator[list[tuple[bytes, bytes]]]:
    """``entries`` in lists of about :data:`_LOAD_TRANSACTION_BYTES`."""
    batch: list[tuple[bytes, bytes]] = []
    size = 0
    for key, value in entries:
        batch.append((key, value))
        size += len(key) + len(value)
        if size >= _LOAD_TRANSACTION_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def pack_mark(mark: LogMark | None, count: int) -> bytes:
    if mark is None:
        return _MARK_HEAD.pack(0, 0, 0, 0, 0)
    at, record_id = mark.log_position, mark.record_id.encode()
    if mark.stale:
        head = _MARK_HEAD.pack(3, mark.position, at.ledger, at.entry, count)
        named = {"id": mark.record_id, "origin": mark.origin, "stale": list(mark.stale)}
        return head + json.dumps(named).encode()
    if mark.origin is None:
        return _MARK_HEAD.pack(1, mark.position, at.ledger, at.entry, count) + record_id
    head = _MARK_HEAD.pack(2, mark.position, at.ledger, at.entry, count)
    return head + _ID_LENGTH.pack(len(record_id)) + record_id + mark.origin.encode()


# ---------------------------------------------------------------------- the state

_DELETED: Any = object()


class DiskMapState(MapState[K, V]):
    """A :class:`MapState` whose entries live in the store: ``entries`` and ``values`` are
    views that read the current record's changes, then the cache, then LMDB.

    All use is on the event loop's thread (as for the in-memory state), except a snapshot's
    :meth:`copy` (its own read transaction) and :meth:`load_snapshot` (the manager's worker
    thread, while the pump waits).
    """

    __slots__ = (
        "_cache",
        "_cleared",
        "_codecs",
        "_count",
        "_env",
        "_loading",
        "_lock",
        "_mark",
        "_pending",
        "_pending_count",
        "_read_txn",
        "_scans",
        "_switched",
        "_topic",
        "_view",
    )

    def __init__(self, config: DiskStore, codecs: MapCodecs[K, V], topic: str = "") -> None:
        super().__init__()
        self._order = None  # the store is the order
        self._codecs = codecs
        self._topic = topic
        self._env = _Env(config)
        self._cache: _Cache[K, V] = _Cache(config.cache_bytes)
        # The current record's changes (a key's MapEntry, or _DELETED), until commit.
        self._pending: dict[K, Any] = {}
        self._cleared = False
        self._count = 0
        self._pending_count = 0
        self._mark: LogMark | None = None
        self._read_txn: Any = None
        self._scans = 0  # the loop's scans iterating the read transaction now
        # The database the loop reads (its read transaction and cache): the active one, or
        # until the loop follows a load's switch (see _settle) the one active before.
        self._view: Any = None
        # Set by a snapshot load (a worker thread) once it switched the store to the loaded
        # database; the loop's next use of the store follows it (see _settle).
        self._switched = False
        self._loading = False  # a load (a worker thread) is filling the spare database
        # Held by a load to start, to switch and to give up, and by the loop to follow a
        # switch or begin a read transaction: a load never empties what the loop reads.
        self._lock = threading.Lock()
        self.values = _Values(self)  # type: ignore[assignment]

    # ------------------------------------------------------------ opening and closing

    def bind_topic(self, topic: str) -> None:
        """The topic's full name (the store records it and refuses another)."""
        self._topic = topic

    @property
    def config(self) -> DiskStore:
        return self._env.config

    def _codec_names(self) -> tuple[str, str]:
        return _codec_name(self._codecs.keys), _codec_name(self._codecs.values)

    def open_store(self) -> None:
        """Open the store directory (see :class:`DiskStore` for what is refused)."""
        reason = self._env.open(self._topic, self._codec_names())
        self._view = self._env.data
        if reason is not None:
            self._reset_or_refuse(reason)  # raises, or empties the store
        # Open from now on: a machine crash before the next clean close is detected.
        self._env.write_info(self._topic, self._codec_names(), clean=False)
        self._mark, self._count = self._env.read_mark()
        self._pending_count = self._count
        self.position = 0 if self._mark is None else self._mark.position

    def _reset_or_refuse(self, reason: str, *, clean: bool = False) -> None:
        """``clean``: close as cleanly as before this open when refusing (only once the
        store's own topic and codecs were found to be ours: closing writes them)."""
        if self.config.on_mismatch != "rebuild":
            self.close_store(clean=clean)
            raise LocalStoreError(
                f"the local store {self.config.path} cannot be used for {self._topic}: "
                f"{reason}. Nothing was changed; open with DiskStore(..., "
                "on_mismatch='rebuild') to rebuild it from the log, or give another directory"
            )
        logger.warning(
            "rebuilding the local store %s of %s from the log: %s",
            self.config.path,
            self._topic,
            reason,
        )
        self._drop_read()
        self._env.wipe()
        self._cache.clear()
        self._mark, self._count, self._pending_count, self.position = None, 0, 0, 0

    def close_store(self, *, clean: bool = True) -> None:
        """Close; ``clean``: sync to disk first and say so (the next open then trusts the
        store after a machine restart too). Idempotent."""
        self._drop_read()
        self._env.close(clean=clean, topic=self._topic, codecs=self._codec_names())

    @property
    def is_open(self) -> bool:
        return self._env.env is not None

    @property
    def mark(self) -> LogMark | None:
        """The mark of the last committed record (None: nothing stored)."""
        return self._mark

    @property
    def cache(self) -> _Cache[K, V]:
        return self._cache

    # ------------------------------------------------------------ reading the store

    def _settle(self) -> None:
        """On the loop, once a snapshot load switched the store: read the loaded database
        from now on (until then, and while it loaded, the loop read the old one, cache
        included). Not during a scan: a read from its callbacks keeps the transaction it
        iterates."""
        if self._switched and not self._scans:
            with self._lock:
                self._follow()

    def _follow(self) -> None:
        """_settle's work, holding the lock: the old database is emptied too, unless
        another load started since (which emptied it, and fills it)."""
        if not self._switched:
            return
        self._switched = False
        self._drop_read()
        self._cache.clear()
        self._view = self._env.data
        if self._loading:
            return
        try:
            self._env.drop_spare()
        except _lmdb().Error as exc:  # only space: the next open or load empties it
            logger.warning("could not empty the old entries of %s: %s", self.config.path, exc)

    def _txn(self) -> Any:
        self._settle()
        txn = self._read_txn
        if txn is None:
            with self._lock:  # no load switches, then empties the database, before it begins
                self._follow()
                txn = self._read_txn = self._env.env.begin(db=self._view)
        return txn

    def _drop_read(self) -> None:
        txn, self._read_txn = self._read_txn, None
        if txn is not None:
            txn.abort()

    def _decode(self, raw: bytes) -> tuple[MapEntry[V], int]:
        value = self._codecs.decode_value(raw[_VERSION.size :])
        return MapEntry(value, MapVersion(_VERSION.unpack_from(raw)[0])), len(raw)

    def lookup(self, key: K) -> MapEntry[V] | None:
        """The entry of ``key`` as this state holds it now (the record being applied
        included), or None."""
        pending = self._pending.get(key)
        if pending is not None:
            return None if pending is _DELETED else cast(MapEntry[V], pending)
        if self._cleared:
            return None
        self._settle()
        cache = self._cache
        found = cache.get(key)
        if found is not None:
            return found
        exact = _exact(key)
        if exact is None:
            return None
        raw = self._txn().get(store_key(exact))
        if raw is None:
            return None
        entry, size = self._decode(raw)
        cache.put(exact, entry, size)
        return entry

    def exists(self, key: K) -> bool:
        pending = self._pending.get(key)
        if pending is not None:
            return pending is not _DELETED
        if self._cleared:
            return False
        self._settle()
        if self._cache.peek(key) is not None:
            return True
        exact = _exact(key)
        return exact is not None and self._txn().get(store_key(exact)) is not None

    def count(self) -> int:
        """How many keys the state holds now (the record being applied included)."""
        return self._pending_count

    def _stored(self, low: bytes | None, high: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """Stored (key, raw) pairs with ``low <= key < high`` in store order (not pending)."""
        if self._cleared:
            return
        cursor = self._txn().cursor()
        found = cursor.set_range(low) if low is not None else cursor.first()
        while found:
            skey = cursor.key()
            if high is not None and skey >= high:
                return
            yield skey, cursor.value()
            found = cursor.next()

    def _scan(
        self,
        low: bytes | None,
        high: bytes | None,
        *,
        with_values: bool,
        accept: Callable[[K], bool] | None = None,
    ) -> Iterator[tuple[K, MapEntry[V] | None]]:
        """(key, entry) in key order with ``low <= key < high`` and, if given, ``accept(key)``
        true; entries only when asked (and only of the keys accepted)."""
        self._settle()
        self._scans += 1
        try:
            pending = self._pending
            if not pending:
                peek = self._cache.peek
                for skey, raw in self._stored(low, high):
                    key = cast(K, key_from_store(skey))
                    if accept is not None and not accept(key):
                        continue
                    if not with_values:
                        yield key, None
                        continue
                    yield key, (peek(key) or self._decode(raw)[0])
                return
            # Inside a record (a write's reader): merge its changes in. Rare, so simple.
            merged: dict[bytes, tuple[K, MapEntry[V] | None]] = {}
            for skey, raw in self._stored(low, high):
                merged[bytes(skey)] = (
                    key_from_store(skey),
                    self._decode(raw)[0] if with_values else None,
                )
            for key, entry in pending.items():
                skey = store_key(key)
                if (low is not None and skey < low) or (high is not None and skey >= high):
                    continue
                if entry is _DELETED:
                    merged.pop(skey, None)
                else:
                    merged[skey] = (key, entry)
            for skey in sorted(merged):
                if accept is None or accept(merged[skey][0]):
                    yield merged[skey]
        finally:
            self._scans -= 1

    # ------------------------------------------------------------ MapState's reads

    def sorted_keys(self) -> Iterable[K]:
        return [key for key, _entry in self._scan(None, None, with_values=False)]

    def items_between(self, low: K | None, high: K | None) -> list[tuple[K, V]]:
        return [
            (key, cast(MapEntry[V], entry).value)
            for key, entry in self._scan(_bound(low), _bound(high), with_values=True)
        ]

    def keys_between(self, low: K | None, high: K | None) -> list[K]:
        return [key for key, _entry in self._scan(_bound(low), _bound(high), with_values=False)]

    def matching(self, accept: Callable[[K], bool]) -> list[tuple[K, MapEntry[V]]]:
        # The entries from the scan itself: one state, whatever a load does meanwhile.
        return [
            (key, cast(MapEntry[V], entry))
            for key, entry in self._scan(None, None, with_values=True, accept=accept)
        ]

    def entries_in_order(self) -> Iterable[tuple[K, MapEntry[V]]]:
        return [
            (key, cast(MapEntry[V], entry))
            for key, entry in self._scan(None, None, with_values=True)
        ]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MapState) or other.position != self.position:
            return False
        return dict(self.entries_in_order()) == dict(other.entries_in_order())

    __hash__ = None

    # ------------------------------------------------------------ applying

    def trial(self) -> MapState[K, V]:
        return _DiskTrialMapState(self)

    def begin(self, position: int) -> None:
        super().begin(position)
        self._pending.clear()
        self._cleared = False
        self._pending_count = self._count

    def apply(self, op: MapOp[K, V]) -> None:
        events = self.events
        if op.tag is not None:
            self.last_tag = op.tag
        version = MapVersion.of(self.position, self.op_index)
        self.op_index += 1
        if op.kind == "PUT":
            key, value = cast(K, op.key), cast(V, op.value)
            check_key(key)
            if not self.exists(key):
                self._pending_count += 1
            self._pending[key] = MapEntry(value, version)
            if events is not None:
                events.append(MapEvent("put", key, value, version, self.position))
        elif op.kind == "DELETE":
            key = cast(K, op.key)
            if self.exists(key):
                self._pending[key] = _DELETED
                self._pending_count -= 1
                if events is not None:
                    events.append(MapEvent("delete", key, None, version, self.position))
        else:
            self._pending.clear()
            self._cleared = True
            self._pending_count = 0
            if events is not None:
                events.append(MapEvent("clear", None, None, version, self.position))

    def commit(self, mark: LogMark) -> None:
        """Store the current record's changes and ``mark`` in one LMDB transaction."""
        self._settle()
        env, encode = self._env, self._codecs.values.encode
        self._drop_read()
        staged: list[tuple[K, MapEntry[V] | None, int]] = []
        with env.env.begin(write=True) as txn:
            if self._cleared:
                txn.drop(env.data, delete=False)
            for key, entry in self._pending.items():
                skey = store_key(key)
                if entry is _DELETED:
                    txn.delete(skey, db=env.data)
                    staged.append((key, None, 0))
                    continue
                raw = _VERSION.pack(int(entry.version)) + encode(entry.value)
                txn.put(skey, raw, db=env.data)
                staged.append((key, entry, len(raw)))
            txn.put(_MARK, pack_mark(mark, self._pending_count), db=env.meta)
        # Committed: the cache and the counters follow.
        cache = self._cache
        if self._cleared:
            cache.clear()
        for key, done, size in staged:
            if done is None:
                cache.pop(key)
            else:  # write-through: a value just written is likely read next
                cache.put(key, done, size)
        self._pending.clear()
        self._cleared = False
        self._count = self._pending_count
        self._mark = mark

    # ------------------------------------------------------------ snapshots

    def copy(self) -> MapState[K, V]:
        """A consistent, read-only view of the store for a snapshot (its own LMDB read
        transaction: applies go on meanwhile)."""
        with self._lock:  # the database and the count a load switches together
            return _DiskView(self, self._env.env.begin(db=self._env.data))

    def load_snapshot(self, chunks: Iterable[bytes], mark: LogMark) -> DiskMapState[K, V]:
        """Replace the store's content by the snapshot at ``mark`` (its bytes: ``chunks``
        joined), stored as the chunks arrive (runs in a worker thread, while the replica
        applies nothing). The entries go into the spare database in transactions of about
        16 MB, then ONE transaction makes it the active one with ``mark``: a process killed
        before reopens to the old content, one killed after to the snapshot. If the chunks'
        iterator raises, the spare is emptied and nothing else changed. Meanwhile, the
        loop's reads see the old content; its next use of the store follows the switch."""
        env = self._env
        with self._lock:
            self._loading = True
        try:
            # Empty already, unless the old entries could not be dropped, or the loop has not
            # followed the last load yet (it reads the database active before that one).
            env.drop_spare()
            count = 0
            for batch in _batches(stored_entries(chunks, self._codecs)):
                with env.env.begin(write=True) as txn:
                    # Not overwritten: a key named twice (in this batch or an earlier one,
                    # the spare was emptied first) is refused, as a memory replica refuses it.
                    consumed, added = txn.cursor(db=env.spare).putmulti(batch, overwrite=False)
                    if added != consumed:
                        raise CodecError("a PulsarMap snapshot names a key twice")
                    count += added
            with self._lock:
                with env.env.begin(write=True) as txn:
                    txn.put(_ACTIVE, env.spare_name, db=env.meta)
                    txn.put(_MARK, pack_mark(mark, count), db=env.meta)
                env.switched()
                self._pending.clear()
                self._cleared = False
                self._count = self._pending_count = count
                self._mark = mark
                self.position = mark.position
                self.op_index = 0
                self._switched = True
                self._loading = False
        except BaseException:
            with self._lock:
                self._loading = False
                try:
                    env.drop_spare()
                except Exception as exc:  # only space: emptied on the next open or load
                    logger.warning("could not empty the spare database of %s: %s", env.path, exc)
            raise
        return self

    def refuse_history(self, reason: str) -> None:
        """The stored mark is not of the topic's history: LocalStoreError, or (with
        ``on_mismatch="rebuild"``) an emptied store. Refused, it is left marked as cleanly
        closed as it was before this open (untouched: a machine restart must not then be
        blamed for it)."""
        self._reset_or_refuse(reason, clean=self._env.was_clean)


class DiskDurability(Generic[K, V]):
    """The core's ``durable_state`` hook for a :class:`DiskMapState`."""

    def stored_mark(self, state: MapState[K, V]) -> LogMark | None:
        return _disk(state).mark

    def commit(self, state: MapState[K, V], mark: LogMark) -> None:
        _disk(state).commit(mark)

    def load_snapshot(
        self, state: MapState[K, V], chunks: Iterable[bytes], mark: LogMark
    ) -> MapState[K, V]:
        return _disk(state).load_snapshot(chunks, mark)

    def refuse(self, state: MapState[K, V], reason: str) -> MapState[K, V]:
        _disk(state).refuse_history(reason)
        return state


def _disk(state: MapState[K, V]) -> DiskMapState[K, V]:
    assert isinstance(state, DiskMapState)
    return state


def check_key(key: Any) -> None:
    """Refuse a key the store cannot hold (LMDB keys are at most 511 bytes)."""
    if len(store_key(key)) > MAX_KEY_BYTES:
        raise CodecError(
            f"a disk-backed PulsarMap holds keys of at most {MAX_KEY_BYTES - 1} bytes "
            f"(UTF-8 for str); this one has {len(store_key(key)) - 1}"
        )


class _DiskTrialMapState(_TrialMapState[K, V]):
    """The writer's trial over a disk state: the overlay, refusing keys the store cannot
    hold before anything is sent (ApplyError)."""

    __slots__ = ()

    def apply(self, op: MapOp[K, V]) -> None:
        if op.key is not None:
            check_key(op.key)
        super().apply(op)


class _DiskView(MapState[K, V]):
    """A disk state frozen at one moment (an LMDB read transaction): what a snapshot
    encodes in another thread while the live state goes on."""

    __slots__ = ("_codecs", "_txn", "count_stored")

    def __init__(self, live: DiskMapState[K, V], txn: Any) -> None:
        super().__init__()
        self._order = None
        self._codecs = live._codecs
        self._txn = txn
        self.count_stored = live._count  # taken between records: what the transaction sees
        self.position = live.position
        self.op_index = live.op_index
        self.last_tag = live.last_tag

    def stored(self) -> Iterator[tuple[bytes, bytes]]:
        """(store key, raw) pairs in store order."""
        cursor = self._txn.cursor()
        found = cursor.first()
        while found:
            yield cursor.key(), cursor.value()
            found = cursor.next()

    def entries_in_order(self) -> Iterable[tuple[K, MapEntry[V]]]:
        for skey, raw in self.stored():
            value = self._codecs.decode_value(raw[_VERSION.size :])
            yield key_from_store(skey), MapEntry(value, MapVersion(_VERSION.unpack_from(raw)[0]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MapState) or other.position != self.position:
            return False
        return dict(self.entries_in_order()) == dict(other.entries_in_order())

    __hash__ = None

    def close(self) -> None:
        txn, self._txn = self._txn, None
        if txn is not None:
            txn.abort()

    def __del__(self) -> None:
        self.close()


# ---------------------------------------------------------------------- snapshot bytes

_SNAPSHOT_MAGIC = b"PSMAP\x01"
_SNAPSHOT_HEAD = struct.Struct(">qI")
_SNAPSHOT_ENTRY = struct.Struct(">qII")


def stored_entries(
    chunks: Iterable[bytes], codecs: MapCodecs[Any, Any]
) -> Iterator[tuple[bytes, bytes]]:
    """The store's (key, value) of each entry of a map snapshot whose bytes are ``chunks``
    joined, parsed as they arrive (an entry may span chunks). Values are stored as the
    snapshot has them, after their version: a snapshot entry begins with the version in the
    store's own 8 bytes (big-endian, never negative), so no value is decoded or packed."""
    head_size = len(_SNAPSHOT_MAGIC) + _SNAPSHOT_HEAD.size
    entry, entry_size = _SNAPSHOT_ENTRY, _SNAPSHOT_ENTRY.size
    # A str key's store bytes are its UTF-8 after a tag: not decoded and encoded back, only
    # checked (bytes a StrCodec could not have written fail as a memory replica's load does).
    str_keys = type(codecs.keys) is StrCodec
    count: int | None = None
    seen = 0
    # Bytes of an entry (or the head) not complete yet, joined once it is: an entry larger
    # than a chunk costs one copy, not one per chunk.
    pending: list[bytes] = []
    pending_size, needed = 0, head_size
    for chunk in chunks:
        if pending:
            pending.append(chunk)
            pending_size += len(chunk)
            if pending_size < needed:
                continue
            data = b"".join(pending)
        else:
            data = chunk
        offset = 0
        if count is None:
            if len(data) < head_size:
                pending, pending_size = [data], len(data)
                continue
            if not data.startswith(_SNAPSHOT_MAGIC):
                raise CodecError("not a PulsarMap snapshot")
            _position, count = _SNAPSHOT_HEAD.unpack_from(data, len(_SNAPSHOT_MAGIC))
            offset = head_size
        end = len(data)
        while seen < count and offset + entry_size <= end:
            version, key_len, value_len = entry.unpack_from(data, offset)
            key_at = offset + entry_size
            value_at = key_at + key_len
            stop = value_at + value_len
            if stop > end:
                break  # the entry goes on in the next chunk
            if version < 0:
                raise CodecError(f"damaged PulsarMap snapshot: version {version}")
            key = data[key_at:value_at]
            if str_keys:
                try:
                    key.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise CodecError(f"damaged PulsarMap snapshot: a key {exc}") from exc
                key = b"\x02" + key
            else:
                key = store_key(codecs.decode_key(key))
            yield key, data[offset : offset + 8] + data[value_at:stop]
            offset, seen = stop, seen + 1
        rest = data[offset:]
        pending, pending_size = ([rest], len(rest)) if rest else ([], 0)
        needed = entry_size
        if len(rest) >= entry_size:  # the entry's own length is known: wait for all of it
            _version, key_len, value_len = entry.unpack_from(rest)
            needed = entry_size + key_len + value_len
    if count is None or seen < count:
        raise CodecError("damaged PulsarMap snapshot: truncated")
    if pending:
        raise CodecError("damaged PulsarMap snapshot: bytes left over")


class _SnapshotImage(MapState[K, V]):
    """A map snapshot's bytes seen as a state, parsed as it is read, never held decoded:
    what :class:`DiskSnapshotCodec` decodes to, for the core's lossless check of a snapshot
    being taken (``encode(decode(b)) == b`` and ``decode(b) == state``) in bounded memory."""

    __slots__ = ("_codecs", "data")

    def __init__(self, data: bytes, codecs: MapCodecs[K, V]) -> None:
        super().__init__()
        self._order = None
        self.data = data
        self._codecs = codecs
        if not data.startswith(_SNAPSHOT_MAGIC):
            raise CodecError("not a PulsarMap snapshot")
        try:
            self.position = _SNAPSHOT_HEAD.unpack_from(data, len(_SNAPSHOT_MAGIC))[0]
        except struct.error as exc:
            raise CodecError(f"damaged PulsarMap snapshot: {exc}") from exc

    def raw(self) -> Iterator[tuple[bytes, int, bytes]]:
        """(key bytes, version, value bytes) per entry, in the snapshot's order."""
        data = self.data
        view = memoryview(data)
        try:
            offset = len(_SNAPSHOT_MAGIC)
            _position, count = _SNAPSHOT_HEAD.unpack_from(data, offset)
            offset += _SNAPSHOT_HEAD.size
            for _ in range(count):
                version, key_len, value_len = _SNAPSHOT_ENTRY.unpack_from(data, offset)
                offset += _SNAPSHOT_ENTRY.size
                key = bytes(view[offset : offset + key_len])
                offset += key_len
                value = bytes(view[offset : offset + value_len])
                offset += value_len
                if len(value) != value_len:
                    raise CodecError("damaged PulsarMap snapshot: truncated")
                yield key, version, value
        except struct.error as exc:
            raise CodecError(f"damaged PulsarMap snapshot: {exc}") from exc
        if offset != len(data):
            raise CodecError("damaged PulsarMap snapshot: bytes left over")

    def entries_in_order(self) -> Iterable[tuple[K, MapEntry[V]]]:
        codecs = self._codecs
        for key, version, value in self.raw():
            yield codecs.decode_key(key), MapEntry(codecs.decode_value(value), MapVersion(version))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MapState) or other.position != self.position:
            return False
        pairs = itertools.zip_longest(
            self.entries_in_order(), other.entries_in_order(), fillvalue=_ENDED
        )
        for a, b in pairs:
            if a is _ENDED or b is _ENDED:
                return False  # one has more entries (zip() dropped the first extra one)
            if a != b:
                # Another order (a key codec whose bytes do not sort as keys do): compare
                # as mappings, in memory (rare).
                return dict(self.entries_in_order()) == dict(other.entries_in_order())
        return True

    __hash__ = None


_ENDED: Final = object()  # what the shorter of two entry sequences gives once it ended

# Codecs whose encode(decode(b)) is b for any b they encoded: a snapshot's entries are not
# decoded to check it. Any other codec is checked entry by entry as the snapshot is made.
_EXACT_CODECS: Final = (BytesCodec, StrCodec, JsonCodec)
# A streamed snapshot's bytes are handed over in parts of about this size.
_PART_BYTES = 1024 * 1024


class DiskSnapshotCodec(MapSnapshotCodec[K, V]):
    """The map's snapshot codec, reading a disk state's stored bytes as they are (the same
    bytes :class:`MapSnapshotCodec` writes for the same map), part by part
    (:meth:`encode_parts`: the core's streamed snapshots). Decoding gives a lazy image of
    the bytes; loading a snapshot into the store streams it (:meth:`DiskMapState.load_snapshot`).

    Streaming needs the store's order to be the snapshot's (sorted by key bytes): str keys
    (StrCodec) and bytes keys (BytesCodec). With another key codec the entries are sorted in
    memory when a snapshot is taken."""

    def decode(self, data: bytes, /) -> MapState[K, V]:
        return _SnapshotImage(data, self._codecs)

    def encode(self, state: MapState[K, V], /) -> bytes:
        if isinstance(state, _SnapshotImage):
            return self._encode_image(state)
        if isinstance(state, _DiskView | DiskMapState):
            return b"".join(self.encode_parts(state))
        return super().encode(state)

    def encode_parts(self, state: MapState[K, V], /) -> Iterator[bytes]:
        """The snapshot bytes of ``state`` in parts of about a megabyte. A disk view's read
        transaction ends with the last part (or when the parts are closed)."""
        if isinstance(state, DiskMapState):  # the live state: a view of this moment
            state = cast(_DiskView[K, V], state.copy())
        if not isinstance(state, _DiskView):
            yield self.encode(state)
            return
        try:
            key_codec: type = type(self._codecs.keys)
            if key_codec in (StrCodec, BytesCodec):
                yield from self._stored_parts(state)
            else:
                yield self._encode_sorted(state.position, state)
        finally:
            state.close()

    def _check_lossless(self, key: bytes, value: bytes) -> None:
        """CodecError unless the codecs give back the bytes they encoded (codecs other
        than the built-in ones only)."""
        codecs = self._codecs
        exact_keys = type(codecs.keys) in _EXACT_CODECS
        if not exact_keys and codecs.key_bytes(codecs.decode_key(key)) != key:
            raise CodecError(_LOSSY.format("key"))
        exact_values = type(codecs.values) in _EXACT_CODECS
        if not exact_values and codecs.values.encode(codecs.decode_value(value)) != value:
            raise CodecError(_LOSSY.format("value"))

    def _stored_parts(self, view: _DiskView[K, V]) -> Iterator[bytes]:
        codecs = self._codecs
        entry, version_of, version_size = _SNAPSHOT_ENTRY.pack, _VERSION.unpack_from, _VERSION.size
        check = None
        if type(codecs.keys) not in _EXACT_CODECS or type(codecs.values) not in _EXACT_CODECS:
            check = self._check_lossless
        part = bytearray(_SNAPSHOT_MAGIC + _SNAPSHOT_HEAD.pack(view.position, view.count_stored))
        count, previous = 0, b""
        for skey, raw in view.stored():
            encoded = skey[1:]  # str (UTF-8) and bytes keys: their bytes after the type tag
            if encoded < previous:
                raise CodecError(f"the store's keys are out of order at {encoded[:40]!r}")
            previous = encoded
            value = raw[version_size:]
            if check is not None:
                check(encoded, value)
            part += entry(version_of(raw)[0], len(encoded), len(value))
            part += encoded
            part += value
            count += 1
            if len(part) >= _PART_BYTES:
                yield bytes(part)
                part.clear()
        if count != view.count_stored:
            raise CodecError(
                f"the store holds {count} entries where its mark counts {view.count_stored}: "
                "no snapshot written"
            )
        yield bytes(part)

    def _encode_sorted(self, position: int, view: _DiskView[K, V]) -> bytes:
        key_bytes = self._codecs.key_bytes
        items = sorted((key_bytes(key_from_store(skey)), bytes(raw)) for skey, raw in view.stored())
        parts = [_SNAPSHOT_MAGIC, _SNAPSHOT_HEAD.pack(position, len(items))]
        for encoded, raw in items:
            value = raw[_VERSION.size :]
            self._check_lossless(encoded, value)
            version = _VERSION.unpack_from(raw)[0]
            parts += [_SNAPSHOT_ENTRY.pack(version, len(encoded), len(value)), encoded, value]
        return b"".join(parts)

    def _encode_image(self, image: _SnapshotImage[K, V]) -> bytes:
        """The image encoded again, entry by entry through the codecs: its own bytes when
        every key and value encodes back to the same bytes (checked one at a time, so no
        copy of the map is held), else the bytes the codecs give (which then differ)."""
        codecs = self._codecs
        for key, _version, value in image.raw():
            if codecs.key_bytes(codecs.decode_key(key)) != key or (
                codecs.values.encode(codecs.decode_value(value)) != value
            ):
                return self._encode_decoded(image)
        return image.data

    def _encode_decoded(self, image: _SnapshotImage[K, V]) -> bytes:
        codecs = self._codecs
        items = sorted(
            (codecs.key_bytes(key), int(entry.version), codecs.values.encode(entry.value))
            for key, entry in image.entries_in_order()
        )
        parts = [_SNAPSHOT_MAGIC, _SNAPSHOT_HEAD.pack(image.position, len(items))]
        for key, version, value in items:
            parts += [_SNAPSHOT_ENTRY.pack(version, len(key), len(value)), key, value]
        return b"".join(parts)


_LOSSY = (
    "the map's {} codec is lossy: encode(decode(bytes)) differs from the bytes it encoded; "
    "no snapshot written"
)
