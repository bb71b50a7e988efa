"""MapHistory: every change of a map since its first record, for reads at a position.

The data source reads a map "as of position p" (batch reads, each partition of one read at the
same position) and "the changes in (a, b]" (the change feed, whose offsets are positions).
Both need the log, not just the current state: a replica opened with a watch registered before
its opening replay (:meth:`recipes.PulsarMap.changes` before ``open``) sees every change of
the topic with its position, and keeps following the tail.
"""

from __future__ import annotations

import bisect
import dataclasses
import sys
import threading
from typing import Any

from pulsar_state import BlockingPortal, ConfigurationError, OperationTimeoutError
from recipes import MapEvent, MapVersion, MapWatch, SyncPulsarMap

from ._specs import MapSpec, cached_resource

__all__ = ["MapHistory", "get_history"]

#: Changes kept by a history wait in a watch queue until drained: no bound (the history is
#: what it is); memory is the caller's trade-off, documented on the data source.
_UNBOUNDED = sys.maxsize
#: PulsarMap and manager options a history's own map leaves out.
_SNAPSHOT_OPTIONS = frozenset(
    {
        "snapshots",
        "store",
        "load_snapshot",
        "trim_history",
        "keep_snapshots",
        "snapshot_every_records",
        "snapshot_every_bytes",
        "snapshot_chunk_bytes",
    }
)


class MapHistory:
    """One process's replay of a map's whole log, as :class:`~recipes.MapEvent` in log order.

    Holds every change (put, delete, clear) since position 0 in memory, so that
    :meth:`state_at` and :meth:`changes` answer for any position up to the tail. Thread safe.
    """

    def __init__(self, spec: MapSpec, portal: BlockingPortal, *, timeout: float | None) -> None:
        self.spec = spec
        self._portal = portal
        self._lock = threading.Lock()
        self._events: list[MapEvent[Any, Any]] = []
        self._positions: list[int] = []  # event positions, for bisect
        self._complete_through = 0  # every change at a position <= this is in _events
        # A map of its own, which replays the whole log: none of the spec's snapshot options
        # (opening from a snapshot skips the history before it, and a map with snapshots
        # watches only once open) nor its disk store (which the spec's own map holds).
        whole_log = {k: v for k, v in spec.options.items() if k not in _SNAPSHOT_OPTIONS}
        self._map: SyncPulsarMap[Any, Any] = dataclasses.replace(spec, options=whole_log).new_map(
            portal=portal
        )
        self._watch: MapWatch[Any, Any] = portal.call_sync(
            lambda: self._map.async_map.changes(snapshot=False, max_queue=_UNBOUNDED)
        )
        try:
            self._map.open(timeout=timeout)
        except BaseException:
            self.close()
            raise

    @property
    def position(self) -> int:
        """The position this history's replica has reached."""
        return self._map.position

    def tail(self, *, timeout: float | None = None) -> int:
        """Catch up with the topic's tail as of now; returns its position."""
        return self._map.sync(timeout=timeout)

    def _drain_through(self, position: int, timeout: float | None) -> None:
        """Make sure every change at a position <= ``position`` is in ``_events``."""
        if position <= self._complete_through:
            return
        self._map.wait_for(position, timeout=timeout)

        async def drain() -> tuple[list[MapEvent[Any, Any]], int]:
            # The replica has applied `reached` records, and its listener queued their changes
            # synchronously: everything up to `reached` is in the queue now.
            reached = self._map.async_map.position
            drained: list[MapEvent[Any, Any]] = []
            while True:
                try:
                    event = await self._watch.next(timeout=0)
                except OperationTimeoutError:
                    return drained, reached
                if event is None:  # closed under us
                    raise ConfigurationError("the map history was closed")
                drained.append(event)

        events, reached = self._portal.call(drain, timeout=timeout)
        self._events.extend(events)
        self._positions.extend(event.position for event in events)
        self._complete_through = max(self._complete_through, reached)

    def changes(
        self, after: int, through: int, *, timeout: float | None = None
    ) -> list[MapEvent[Any, Any]]:
        """The changes at positions in ``(after, through]``, in log order."""
        with self._lock:
            self._drain_through(through, timeout)
            low = bisect.bisect_right(self._positions, after)
            high = bisect.bisect_right(self._positions, through)
            return self._events[low:high]

    def state_at(
        self, position: int, *, timeout: float | None = None
    ) -> dict[Any, tuple[Any, MapVersion]]:
        """The map as it was at ``position``: key -> (value, version)."""
        state: dict[Any, tuple[Any, MapVersion]] = {}
        for event in self.changes(0, position, timeout=timeout):
            if event.kind == "put":
                state[event.key] = (event.value, event.version)
            elif event.kind == "delete":
                state.pop(event.key, None)
            else:
                state.clear()
        return state

    def usable(self) -> bool:
        """Whether it can still answer: its map open and its replica not halted."""
        return not self._map.closed and self._map.async_map.manager.halted is None

    def close(self) -> None:
        try:
            self._portal.call_sync(self._watch.close)
        finally:
            self._map.close()

    def __repr__(self) -> str:
        return f"MapHistory({self.spec.topic!r}, through={self._complete_through})"


def get_history(spec: MapSpec, *, timeout: float | None = None) -> MapHistory:
    """This process's cached :class:`MapHistory` for ``spec`` (opened, replayed, on first use)."""
    return cached_resource(
        "history:" + spec.key,
        lambda portal: MapHistory(spec, portal, timeout=timeout),
        MapHistory.usable,
    )
