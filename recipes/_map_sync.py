"""The blocking PulsarMap: every call forwarded through a BlockingPortal to the async map."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar, cast, overload

from pulsar_state import BlockingPortal, Codec, ManagerStats, SyncFacade, backstop

from ._map_ops import MapEntry, MapEvent, MapVersion
from ._map_watch import MapWatch
from .map import PulsarMap

__all__ = ["SyncMapWatch", "SyncPulsarMap"]

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


def _close_on_loop(portal: BlockingPortal, close: Callable[[], None]) -> None:
    # A watch lives on the portal's loop: close it there, even from a finalizer.
    with contextlib.suppress(RuntimeError):  # the loop is already closed
        portal.loop.call_soon_threadsafe(close)


class SyncMapWatch(Generic[K, V]):
    """The blocking twin of :class:`~recipes.MapWatch` (same events, same guarantees).

    Iterate it (``for event in watch``; waits as long as it takes) or call :meth:`next` with a
    timeout. :meth:`close`, from any thread, ends the iteration.
    """

    def __init__(self, watch: MapWatch[K, V], portal: BlockingPortal) -> None:
        self._watch = watch
        self._portal = portal
        self._finalizer = weakref.finalize(self, _close_on_loop, portal, watch.close)

    @property
    def start_position(self) -> int:
        return self._watch.start_position

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (the close itself runs on the portal's loop)
        or the watch ended there."""
        return not self._finalizer.alive or self._watch.closed

    def next(self, *, timeout: float | None = None) -> MapEvent[K, V] | None:
        """The next event, or None once the watch is closed (OperationTimeoutError after
        ``timeout`` seconds; None waits as long as it takes)."""
        return self._portal.call(
            lambda: self._watch.next(timeout=timeout), timeout=backstop(timeout)
        )

    def __iter__(self) -> Iterator[MapEvent[K, V]]:
        return self

    def __next__(self) -> MapEvent[K, V]:
        event = self.next()
        if event is None:
            raise StopIteration
        return event

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> SyncMapWatch[K, V]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SyncPulsarMap(SyncFacade[PulsarMap[K, V]], Generic[K, V]):
    """The blocking twin of :class:`~recipes.PulsarMap`, for code that is not async.

    Same arguments (plus an optional shared ``portal``), same methods and guarantees: each call
    runs the async map's method on the portal's event loop (there is no second copy of the
    logic). Functions passed in (``update``, ``scan``...) run on the portal's thread::

        with SyncPulsarMap("pulsar://127.0.0.1:6650", "config") as m:
            m.put("mode", "fast")
            print(m.get("mode", latest=True), len(m))
    """

    @overload
    def __init__(
        self: SyncPulsarMap[str, Any],
        pulsar: Any,
        topic: str,
        *,
        key_codec: None = None,
        value_codec: None = None,
        portal: BlockingPortal | None = None,
        **manager_options: Any,
    ) -> None: ...

    @overload
    def __init__(
        self: SyncPulsarMap[str, V],
        pulsar: Any,
        topic: str,
        *,
        key_codec: None = None,
        value_codec: Codec[V],
        portal: BlockingPortal | None = None,
        **manager_options: Any,
    ) -> None: ...

    @overload
    def __init__(
        self: SyncPulsarMap[K, Any],
        pulsar: Any,
        topic: str,
        *,
        key_codec: Codec[K],
        value_codec: None = None,
        portal: BlockingPortal | None = None,
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
        portal: BlockingPortal | None = None,
        **manager_options: Any,
    ) -> None: ...

    def __init__(
        self,
        pulsar: Any,
        topic: str,
        *,
        key_codec: Codec[Any] | None = None,
        value_codec: Codec[Any] | None = None,
        portal: BlockingPortal | None = None,
        **manager_options: Any,
    ) -> None:
        # PulsarMap chooses the default codecs.
        self._map = cast(
            PulsarMap[K, V],
            PulsarMap(
                pulsar, topic, key_codec=key_codec, value_codec=value_codec, **manager_options
            ),
        )
        super().__init__(self._map, self._map.manager, portal)

    @property
    def async_map(self) -> PulsarMap[K, V]:
        """The async map underneath (use it only from the portal's loop)."""
        return self._map

    @property
    def topic(self) -> str:
        return self._map.topic

    @property
    def position(self) -> int:
        return self._map.position

    @property
    def stats(self) -> ManagerStats:
        return self._map.stats

    # ------------------------------------------------------------------ lifecycle

    def sync(self, *, timeout: float | None = None) -> int:
        return self._read(lambda: self._map.sync(timeout=timeout), timeout)

    def wait_for(self, position: int, *, timeout: float | None = None) -> None:
        self._read(lambda: self._map.wait_for(position, timeout=timeout), timeout)

    def snapshot(self, *, timeout: float | None = None) -> int:
        """As :meth:`PulsarMap.snapshot`: write a snapshot now; returns its position."""
        return self._write(lambda: self._map.snapshot(timeout=timeout), timeout)

    # ------------------------------------------------------------------ reads

    def get(self, key: K, *, latest: bool = False, timeout: float | None = None) -> V | None:
        return self._read(lambda: self._map.get(key, latest=latest, timeout=timeout), timeout)

    def get_or_default(
        self, key: K, default: D, *, latest: bool = False, timeout: float | None = None
    ) -> V | D:
        return self._read(
            lambda: self._map.get_or_default(key, default, latest=latest, timeout=timeout),
            timeout,
        )

    def scan(
        self,
        filter: Callable[[K], bool],
        processor: Callable[[K, V], object],
        *,
        latest: bool = False,
        timeout: float | None = None,
    ) -> int:
        return self._read(
            lambda: self._map.scan(filter, processor, latest=latest, timeout=timeout), timeout
        )

    def list_keys(self, *, latest: bool = False, timeout: float | None = None) -> list[K]:
        return self._read(lambda: self._map.list_keys(latest=latest, timeout=timeout), timeout)

    def version(self, key: K, *, latest: bool = False, timeout: float | None = None) -> MapVersion:
        return self._read(lambda: self._map.version(key, latest=latest, timeout=timeout), timeout)

    def entry(
        self, key: K, *, latest: bool = False, timeout: float | None = None
    ) -> MapEntry[V] | None:
        return self._read(lambda: self._map.entry(key, latest=latest, timeout=timeout), timeout)

    def entries(
        self, *, latest: bool = False, timeout: float | None = None
    ) -> list[tuple[K, MapEntry[V]]]:
        """As :meth:`PulsarMap.entries`."""
        return self._read(lambda: self._map.entries(latest=latest, timeout=timeout), timeout)

    def range(
        self,
        from_key: K | None,
        to_key: K | None,
        *,
        latest: bool = False,
        timeout: float | None = None,
    ) -> list[tuple[K, V]]:
        return self._read(
            lambda: self._map.range(from_key, to_key, latest=latest, timeout=timeout), timeout
        )

    def all(self, *, latest: bool = False, timeout: float | None = None) -> list[tuple[K, V]]:
        return self._read(lambda: self._map.all(latest=latest, timeout=timeout), timeout)

    # ------------------------------------------------------------------ the local view

    def __len__(self) -> int:
        return self._portal.call_sync(self._map.__len__)

    def __contains__(self, key: object) -> bool:
        return self._portal.call_sync(lambda: key in self._map)

    def __iter__(self) -> Iterator[K]:
        return iter(self.keys())

    def keys(self) -> list[K]:
        return self._portal.call_sync(self._map.keys)

    def values(self) -> list[V]:
        return self._portal.call_sync(self._map.values)

    def items(self) -> list[tuple[K, V]]:
        return self._portal.call_sync(self._map.items)

    @overload
    def get_local(self, key: K) -> V | None: ...

    @overload
    def get_local(self, key: K, default: D) -> V | D: ...

    def get_local(self, key: K, default: D | None = None) -> V | D | None:
        return self._portal.call_sync(lambda: self._map.get_local(key, default))

    # ------------------------------------------------------------------ writes

    def check_entry(self, key: K, value: V) -> None:
        """As :meth:`PulsarMap.check_entry` (no I/O)."""
        self._portal.call_sync(lambda: self._map.check_entry(key, value))

    def put(self, key: K, value: V, *, timeout: float | None = None) -> MapVersion:
        return self._write(lambda: self._map.put(key, value, timeout=timeout), timeout)

    def put_all(
        self, entries: Mapping[K, V] | Iterable[tuple[K, V]], *, timeout: float | None = None
    ) -> int:
        return self._write(lambda: self._map.put_all(entries, timeout=timeout), timeout)

    def delete(self, key: K, *, timeout: float | None = None) -> bool:
        return self._write(lambda: self._map.delete(key, timeout=timeout), timeout)

    def clear(self, *, timeout: float | None = None) -> int:
        return self._write(lambda: self._map.clear(timeout=timeout), timeout)

    def update(
        self, key: K, fn: Callable[[K, V | None], V | None], *, timeout: float | None = None
    ) -> V | None:
        return self._write(lambda: self._map.update(key, fn, timeout=timeout), timeout)

    def update_multiple(
        self,
        filter: Callable[[K], bool],
        fn: Callable[[K, V], V | None],
        *,
        timeout: float | None = None,
    ) -> int:
        return self._write(lambda: self._map.update_multiple(filter, fn, timeout=timeout), timeout)

    def transact(
        self,
        fn: Callable[[Mapping[K, V]], Mapping[K, V | None]],
        *,
        timeout: float | None = None,
    ) -> int | None:
        """As :meth:`PulsarMap.transact` (``fn`` runs on the portal's thread)."""
        return self._write(lambda: self._map.transact(fn, timeout=timeout), timeout)

    def replace(
        self, key: K, expected: V | None, value: V | None, *, timeout: float | None = None
    ) -> bool:
        return self._write(
            lambda: self._map.replace(key, expected, value, timeout=timeout), timeout
        )

    def replace_version(
        self,
        key: K,
        expected_version: int | None,
        value: V | None,
        *,
        timeout: float | None = None,
    ) -> bool:
        return self._write(
            lambda: self._map.replace_version(key, expected_version, value, timeout=timeout),
            timeout,
        )

    def put_if_absent(self, key: K, value: V, *, timeout: float | None = None) -> V:
        return self._write(lambda: self._map.put_if_absent(key, value, timeout=timeout), timeout)

    # ------------------------------------------------------------------ watches

    def changes(
        self,
        *,
        key: K | None = None,
        prefix: str | bytes | None = None,
        snapshot: bool = True,
        max_queue: int = 10_000,
        from_position: int | None = None,
    ) -> SyncMapWatch[K, V]:
        """As :meth:`PulsarMap.changes`, as a blocking iterator."""
        watch = self._portal.call_sync(
            lambda: self._map.changes(
                key=key,
                prefix=prefix,
                snapshot=snapshot,
                max_queue=max_queue,
                from_position=from_position,
            )
        )
        return SyncMapWatch(watch, self._portal)
