"""A copy-on-write view of a dict: the writer's trial state, at the cost of what it changes.

The writer runs a batch's generators and ops on a trial state, never on the live one, and
then throws the trial away: replicas (the writer's own included) apply the records they read
back to the live state themselves. Copying the whole state for every batch costs O(state);
an overlay records only the keys a batch changes (new values and tombstones) over the
untouched live dict, so it costs O(what the batch touches).

Pure: no I/O and no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, TypeVar, overload

__all__ = ["DictOverlay"]

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")

_MISSING: Any = object()


class DictOverlay(MutableMapping[K, V]):
    """A mutable view of ``base`` that records its changes apart and never changes ``base``.

    It behaves as a copy of ``base`` would (``dict`` semantics, including iteration order:
    base keys in their order, then keys added since, and a deleted key that is added again
    moves to the end), but reading and writing cost O(1) and creating one costs nothing.
    ``base`` must not change while the overlay is in use (the writer's trial run is one
    synchronous step).

    ``copy_value``: called on a base value the first time it is read through the overlay, for
    values that ``apply`` may change in place (a list appended to): the overlay then keeps
    and hands out that private copy. None when values are never changed in place.
    """

    __slots__ = ("_added", "_base", "_changed", "_cleared", "_copy_value", "_len", "_removed")

    def __init__(self, base: Mapping[K, V], *, copy_value: Callable[[V], V] | None = None) -> None:
        self._base = base
        self._copy_value = copy_value
        # Base keys still in their base place whose value was replaced (or privately copied).
        self._changed: dict[K, V] = {}
        # Keys not in a base place: new keys, and base keys deleted then added again.
        self._added: dict[K, V] = {}
        # Base keys that no longer hold their base place (deleted, maybe added again).
        self._removed: set[K] = set()
        # clear() hides the whole base.
        self._cleared = False
        self._len = len(base)

    # ------------------------------------------------------------ what changed

    @property
    def base(self) -> Mapping[K, V]:
        """The mapping this overlay sits on."""
        return self._base

    @property
    def cleared(self) -> bool:
        """Whether ``clear()`` ran: then no base key shows through."""
        return self._cleared

    @property
    def added_keys(self) -> Iterable[K]:
        """Keys that are not in a base place: new ones, and base keys deleted and added
        again (those are also in :attr:`removed_keys`)."""
        return self._added.keys()

    @property
    def removed_keys(self) -> Iterable[K]:
        """Base keys that no longer hold their base place."""
        return self._removed

    def commit(self) -> None:
        """Write the changes into ``base`` (a mutable mapping): it then holds what this
        overlay shows, in the same order. The overlay is spent: do not use it again."""
        base = self._base
        if type(base) is not dict and not isinstance(base, MutableMapping):  # dict: no ABC check
            raise TypeError(f"cannot commit an overlay onto a {type(base).__name__}")
        if self._cleared:
            base.clear()
        else:
            for key in self._removed:
                del base[key]
            base.update(self._changed)
        # After the removals: a base key deleted and added again moves to the end, as in a
        # dict, and keys added go in the order they were added.
        base.update(self._added)

    def _in_base(self, key: Any) -> bool:
        # A key in its base place, visible through the overlay.
        return not self._cleared and key not in self._removed and key in self._base

    # ------------------------------------------------------------ the mapping

    def __getitem__(self, key: K) -> V:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    @overload
    def get(self, key: K, /) -> V | None: ...

    @overload
    def get(self, key: K, default: V | D, /) -> V | D: ...

    def get(self, key: K, default: Any = None, /) -> Any:
        added = self._added.get(key, _MISSING)
        if added is not _MISSING:
            return added
        changed = self._changed.get(key, _MISSING)
        if changed is not _MISSING:
            return changed
        if not self._in_base(key):
            return default
        value = self._base[key]
        if self._copy_value is not None:
            value = self._copy_value(value)
            self._changed[key] = value  # later in-place changes go to this copy
        return value

    def __contains__(self, key: object) -> bool:
        return key in self._added or self._in_base(key)

    def __setitem__(self, key: K, value: V) -> None:
        if key in self._added:
            self._added[key] = value
        elif self._in_base(key):
            self._changed[key] = value
        else:
            self._added[key] = value
            self._len += 1

    def __delitem__(self, key: K) -> None:
        if key in self._added:
            del self._added[key]
        elif self._in_base(key):
            self._removed.add(key)
            self._changed.pop(key, None)
        else:
            raise KeyError(key)
        self._len -= 1

    def setdefault(self, key: K, default: Any = None, /) -> Any:
        # MutableMapping's would look the key up through __getitem__ and KeyError.
        value = self.get(key, _MISSING)
        if value is _MISSING:
            self[key] = value = default
        return value

    def clear(self) -> None:
        self._cleared = True
        self._added.clear()
        self._changed.clear()
        self._removed.clear()
        self._len = 0

    def popitem(self) -> tuple[K, V]:
        # dict.popitem removes the last key in iteration order.
        if self._added:
            self._len -= 1
            return self._added.popitem()
        if not self._cleared:
            for key in reversed(list(self._base)):
                if key not in self._removed:
                    value = self[key]
                    del self[key]
                    return key, value
        raise KeyError("popitem(): dictionary is empty")

    def __iter__(self) -> Iterator[K]:
        if not self._cleared:
            removed = self._removed
            for key in self._base:
                if key not in removed:
                    yield key
        yield from self._added

    def __len__(self) -> int:
        return self._len

    def copy(self) -> dict[K, V]:
        """A plain dict with the overlay's contents (as ``dict.copy`` would give)."""
        return dict(self.items())

    def __or__(self, other: Mapping[K, V]) -> dict[K, V]:
        merged = self.copy()
        merged.update(other)
        return merged

    def __ior__(self, other: Mapping[K, V]) -> DictOverlay[K, V]:
        self.update(other)
        return self

    def __repr__(self) -> str:
        return f"DictOverlay({dict(self.items())!r})"
