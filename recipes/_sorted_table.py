"""A map's keys in key order, each with its value and version beside it.

Why not ``sortedcontainers`` plus dicts: a version kept per key in a dict costs a dict slot
and an int object (about 75 bytes a key), and an ordered read that looks every value up in
a dict touches two scattered cache lines per key. Here the keys, values and versions sit in
parallel runs (lists and an ``array('q')``): 24 bytes a key, and a range read copies slices.
The runs are kept like ``sortedcontainers.SortedList`` keeps its sublists (a list of sorted
runs of about ``load`` keys, with the last key of each run to bisect over): O(log n) per
change and per lookup, O(log n + k) per range.
"""

from __future__ import annotations

import numbers
import operator
import sys
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

# Keys must be hashable and totally ordered; these three types are both, and cover what the
# built-in codecs decode keys to (JSON keys: str or int).
KEY_TYPES: tuple[type, ...] = (str, bytes, int)
_KEY_RANK = {int: 0, bytes: 1, str: 2}

_DEFAULT_LOAD = 1000


def key_order(key: Any) -> tuple[int, Any]:
    """The map's key order: ints, then bytes, then str; each by its own ``<``.

    str compares by code point, which is also the order of the UTF-8 bytes; bytes compare
    lexicographically by unsigned byte. A map normally holds one key type only.
    """
    return (_KEY_RANK[type(key)], key)


def exact_key(key: Any) -> Any:
    """``key`` as one of the key types (str, bytes, int) when it is an instance of one of
    them or a number equal to an int (a str enum member, True, an IntEnum, a numpy integer,
    2.0, Decimal(2)):
    equal to it, with the same hash, so it names the same key. Otherwise ``key`` itself."""
    if type(key) in _KEY_RANK:
        return key
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, bytes):
        return bytes(key)
    try:
        return operator.index(key)
    except TypeError:
        pass
    if isinstance(key, numbers.Number):  # 3.0, Decimal(3), Fraction(3), 3+0j
        try:
            whole = int(key.real) if isinstance(key, complex) else int(key)  # type: ignore[call-overload]
        except (TypeError, ValueError, OverflowError):  # NaN, infinity
            return key
        if whole == key and hash(whole) == hash(key):
            return whole
    return key


def prefix_end(prefix: str | bytes) -> str | bytes | None:
    """The first key past every key starting with ``prefix`` (of its type), or None when no
    such key exists (the prefix is empty or all of its last character's largest value): the
    keys starting with ``prefix`` are the keys ``k`` of its type with ``prefix <= k < end``."""
    if isinstance(prefix, str):
        stripped = prefix.rstrip(chr(sys.maxunicode))
        if not stripped:
            return None
        return stripped[:-1] + chr(ord(stripped[-1]) + 1)
    stripped_bytes = prefix.rstrip(b"\xff")
    if not stripped_bytes:
        return None
    return stripped_bytes[:-1] + bytes((stripped_bytes[-1] + 1,))


def sort_keys(keys: list[K]) -> list[K]:
    """``keys`` in the map's key order."""
    try:
        return sorted(keys)  # type: ignore[type-var]
    except TypeError:  # mixed key types: rank them
        return sorted(keys, key=key_order)


class SortedTable(Generic[K, V]):
    """Keys in key order with a value and a version (an int of 64 bits) each.

    One key type (the usual case) is kept by its own ``<``; a second type switches the
    table to :func:`key_order`. Iterate a table before it changes again.
    """

    __slots__ = ("_keys", "_len", "_load", "_maxes", "_order", "_type", "_values", "_versions")

    def __init__(self, items: Iterable[tuple[K, V, int]] = (), *, load: int = _DEFAULT_LOAD):
        if load < 2:
            raise ValueError("load must be at least 2")
        self._load = load
        self._keys: list[list[K]] = []
        self._values: list[list[V]] = []
        self._versions: list[array[int]] = []
        # The order key of each run's last key: what a lookup bisects first.
        self._maxes: list[Any] = []
        self._len = 0
        self._type: type | None = None
        # None while one key type is held (keys compare as they are), else key_order.
        self._order: Callable[[Any], Any] | None = None
        listed = list(items)
        if listed:
            types = {type(item[0]) for item in listed}
            if len(types) == 1:
                self._type = types.pop()
                listed.sort(key=_first)
            else:
                self._order = key_order
                listed.sort(key=lambda item: key_order(item[0]))
            for start in range(0, len(listed), load):
                run = listed[start : start + load]
                self._append_run(
                    [item[0] for item in run],
                    [item[1] for item in run],
                    array("q", [item[2] for item in run]),
                )

    def _append_run(self, keys: list[K], values: list[V], versions: array[int]) -> None:
        self._keys.append(keys)
        self._values.append(values)
        self._versions.append(versions)
        self._maxes.append(self._rank(keys[-1]))
        self._len += len(keys)

    def _rank(self, key: Any) -> Any:
        return key if self._order is None else key_order(key)

    def _admit(self, key: Any) -> None:
        """Make the table able to order ``key`` with what it holds."""
        if self._order is not None or type(key) is self._type:
            return
        if self._type is None and not self._len:
            self._type = type(key)
            return
        self._order, self._type = key_order, None
        self._maxes = [key_order(run[-1]) for run in self._keys]

    def _locate(self, key: Any) -> tuple[int, int, bool]:
        """Where ``key`` is, or would be inserted: (run, index in the run, found)."""
        maxes = self._maxes
        if not maxes:
            return 0, 0, False
        rank = self._rank(key)
        run = bisect_left(maxes, rank)
        if run == len(maxes):
            return run - 1, len(self._keys[run - 1]), False
        keys = self._keys[run]
        index = bisect_left(keys, rank, key=self._order)
        return run, index, index < len(keys) and self._rank(keys[index]) == rank

    def _comparable(self, key: Any) -> bool:
        if self._order is None:
            return type(key) is self._type
        return type(key) in _KEY_RANK

    # ------------------------------------------------------------------ changes

    def put(self, key: K, value: V, version: int) -> bool:
        """Bind ``key``; True when it is new."""
        self._admit(key)
        run, index, found = self._locate(key)
        if found:
            self._versions[run][index] = version
            self._values[run][index] = value
            return False
        if not self._keys:
            self._append_run([key], [value], array("q", [version]))
            return True
        keys = self._keys[run]
        self._versions[run].insert(index, version)  # first: the one that can fail (range)
        keys.insert(index, key)
        self._values[run].insert(index, value)
        self._len += 1
        if index == len(keys) - 1:
            self._maxes[run] = self._rank(key)
        if len(keys) > 2 * self._load:
            self._split(run)
        return True

    def remove(self, key: K) -> bool:
        """Unbind ``key``; True when it was there."""
        if not self._comparable(key):
            return False
        run, index, found = self._locate(key)
        if not found:
            return False
        keys = self._keys[run]
        del keys[index], self._values[run][index], self._versions[run][index]
        self._len -= 1
        if not keys:
            del self._keys[run], self._values[run], self._versions[run], self._maxes[run]
            return True
        if index == len(keys):
            self._maxes[run] = self._rank(keys[-1])
        if len(keys) < self._load // 2 and run + 1 < len(self._keys):
            self._merge_next(run)
        return True

    def clear(self) -> None:
        self._keys, self._values, self._versions, self._maxes = [], [], [], []
        self._len, self._type, self._order = 0, None, None

    def _parallel(self) -> tuple[list[Any], ...]:
        return self._keys, self._values, self._versions

    def _split(self, run: int) -> None:
        half = len(self._keys[run]) // 2
        for runs in self._parallel():
            whole = runs[run]
            runs.insert(run + 1, whole[half:])
            del whole[half:]
        self._maxes[run] = self._rank(self._keys[run][-1])
        self._maxes.insert(run + 1, self._rank(self._keys[run + 1][-1]))

    def _merge_next(self, run: int) -> None:
        for runs in self._parallel():
            runs[run] += runs[run + 1]
            del runs[run + 1]
        del self._maxes[run]
        if len(self._keys[run]) > 2 * self._load:
            self._split(run)

    # ------------------------------------------------------------------ reads

    def version(self, key: Any) -> int | None:
        """``key``'s version, or None when it is not in the table."""
        if not self._comparable(key):
            return None
        run, index, found = self._locate(key)
        return self._versions[run][index] if found else None

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[K]:
        for keys in self._keys:
            yield from keys

    def items(self) -> Iterator[tuple[K, V, int]]:
        """Every (key, value, version), in key order."""
        for keys, values, versions in zip(self._keys, self._values, self._versions, strict=True):
            yield from zip(keys, values, versions, strict=True)

    def _start(self, bound: Any) -> tuple[int, int]:
        """The place of the first key ``>= bound`` (a bound of this table's key type, or any
        bound once the table is mixed)."""
        run, index, _found = self._locate(bound)
        if run < len(self._keys) and index == len(self._keys[run]):
            return run + 1, 0
        return run, index

    def _span(self, low: Any, high: Any) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The places of ``low <= key < high`` (None: unbounded) as (start, end), or None
        when nothing can be in range."""
        if not self._len:
            return None
        if self._order is None:
            # One key type: a bound of another type falls before or after every key.
            rank = _KEY_RANK[self._type]  # type: ignore[index]
            if low is not None and type(low) is not self._type:
                if _KEY_RANK[type(low)] > rank:
                    return None
                low = None
            if high is not None and type(high) is not self._type:
                if _KEY_RANK[type(high)] < rank:
                    return None
                high = None
        start = (0, 0) if low is None else self._start(low)
        end = (len(self._keys), 0) if high is None else self._start(high)
        return (start, end) if start < end else None

    @staticmethod
    def _slices(runs: list[Any], span: tuple[tuple[int, int], tuple[int, int]] | None) -> list[Any]:
        if span is None:
            return []
        (first, begin), (last, end) = span
        if first == last:
            return list(runs[first][begin:end])
        found = list(runs[first][begin:])
        for run in range(first + 1, min(last, len(runs))):
            found += runs[run]
        if last < len(runs):
            found += runs[last][:end]
        return found

    def keys_between(self, low: Any, high: Any) -> list[K]:
        """Keys with ``low <= key < high`` (None: unbounded), in key order."""
        return self._slices(self._keys, self._span(low, high))

    def items_between(self, low: Any, high: Any) -> list[tuple[K, V]]:
        """(key, value) with ``low <= key < high`` (None: unbounded), in key order."""
        span = self._span(low, high)
        return list(
            zip(self._slices(self._keys, span), self._slices(self._values, span), strict=True)
        )

    def copy(self) -> SortedTable[K, V]:
        copied: SortedTable[K, V] = SortedTable(load=self._load)
        copied._keys = [list(run) for run in self._keys]
        copied._values = [list(run) for run in self._values]
        copied._versions = [array("q", run) for run in self._versions]
        copied._maxes = list(self._maxes)
        copied._len, copied._type, copied._order = self._len, self._type, self._order
        return copied


def _first(item: tuple[Any, Any, int]) -> Any:
    return item[0]
