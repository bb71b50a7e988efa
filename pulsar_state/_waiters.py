"""Futures waiting for a replica to reach a target (a version or a log position)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Waiters"]


class _Ordered(Protocol):
    def __le__(self, other: Any, /) -> bool: ...
    def __lt__(self, other: Any, /) -> bool: ...


K = TypeVar("K", bound=_Ordered)


class Waiters(Generic[K]):
    """A heap of futures keyed by the target each waits for: releasing up to a point is
    O(released · log n), whatever the number still waiting."""

    def __init__(self) -> None:
        self._heap: list[tuple[K, int, asyncio.Future[None]]] = []
        self._tiebreak = itertools.count()  # futures do not compare: equal targets need it

    def add(self, target: K) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (target, next(self._tiebreak), future))
        return future

    def waiting(self) -> bool:
        """Whether a future still waits (one given up on counts until its target is
        reached or passed, unless it is the first)."""
        while self._heap and self._heap[0][2].done():
            heapq.heappop(self._heap)
        return bool(self._heap)

    def release(self, reached: K) -> None:
        """Complete every future whose target is at or below ``reached``."""
        while self._heap and self._heap[0][0] <= reached:
            _, _, future = heapq.heappop(self._heap)
            if not future.done():
                future.set_result(None)

    def fail(self, error: BaseException) -> None:
        for _, _, future in self._heap:
            if not future.done():
                future.set_exception(error)
        self._heap.clear()
