"""Watches on a PulsarMap: a consistent snapshot, then every change in log order."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from pulsar_state import (
    AppliedRecord,
    ClosedError,
    OperationTimeoutError,
    PulsarStateError,
    SharedStateManager,
)

from ._map_ops import MapEntry, MapEvent, MapOp, MapState, readable

__all__ = ["MapWatch", "WatchHub", "WatchOverflowError"]

K = TypeVar("K")
V = TypeVar("V")
Q = TypeVar("Q")

# A position no replica reaches: waiting for it ends only when the replica halts or closes.
_NEVER = 2**62


def _readable(event: MapEvent[K, V]) -> MapEvent[K, V]:
    # Events share their value with the state (and other watches): frozen values are handed
    # out as they are, any other kind as a copy.
    value = readable(event.value)
    return event if value is event.value else dataclasses.replace(event, value=value)


class WatchOverflowError(PulsarStateError):
    """A watch's consumer fell more than ``max_queue`` changes behind; the watch has stopped.

    The events it had queued are dropped. ``position`` is the log position up to which the
    consumer received every change (the snapshot's position if none; the one before a record
    whose changes it received only some of): open a new watch to resynchronise from a fresh
    snapshot. (Raised with ``max_queue=0`` when the replica fell forward over a trimmed
    history: the queued changes are delivered first, and ``position`` is the snapshot's it
    fell forward to; the changes between are not known.)
    """

    retriable = True

    def __init__(self, message: str, *, max_queue: int, position: int) -> None:
        super().__init__(message)
        self.max_queue = max_queue
        self.position = position


def received_through(at: int, queue: deque[Q], position_of: Callable[[Q], int]) -> int:
    """The log position up to which a consumer that just took an item of the record at
    ``at`` received every item: ``at``, unless more of that record's items still wait in
    ``queue`` (an overflow then drops them: a consumer resuming after ``at`` would miss them).
    """
    return at - 1 if queue and position_of(queue[0]) == at else at


def _position_of(event: MapEvent[K, V]) -> int:
    return event.position


class _Feed(Generic[K, V]):
    """The listener side of one watch. Held by the hub, so it never keeps a MapWatch alive."""

    def __init__(
        self,
        state: MapState[K, V],
        accept: Callable[[MapEvent[K, V]], bool],
        initial: list[MapEvent[K, V]],
        start_position: int,
        max_queue: int,
    ) -> None:
        self.state = state
        self.accept = accept
        self.initial: deque[MapEvent[K, V]] = deque(initial)
        self.queue: deque[MapEvent[K, V]] = deque()
        self.max_queue = max_queue
        self.delivered_position = start_position
        self.wake = asyncio.Event()
        self.closed = False
        # Raised once the queue is drained (halt, map closed); overflow drops the queue first.
        self.error: PulsarStateError | None = None
        self.unsubscribe: Callable[[], None] = lambda: None

    def on_record(self, record: AppliedRecord[MapOp[K, V]]) -> None:
        # Runs in the pump right after the record was applied: state.events are its changes.
        events = self.state.events
        if not events or self.closed or self.error is not None:
            return
        accepted = [event for event in events if self.accept(event)]
        if not accepted:
            return
        # A consumer holding nothing queued takes a record of any size (it is in memory
        # already): only a consumer more than max_queue changes behind overflows.
        if self.queue and len(self.queue) + len(accepted) > self.max_queue:
            self.queue.clear()
            self.error = WatchOverflowError(
                f"the watch's consumer fell more than {self.max_queue} changes behind (at "
                f"position {record.position}, consumer at {self.delivered_position}); open a "
                "new watch to start again from a fresh snapshot",
                max_queue=self.max_queue,
                position=self.delivered_position,
            )
            self.unsubscribe()
        else:
            self.queue.extend(accepted)
        self.wake.set()

    def fail(self, error: PulsarStateError) -> None:
        if self.error is None:
            self.error = error
        self.unsubscribe()
        self.wake.set()

    def close(self) -> None:
        self.closed = True
        self.initial.clear()
        self.queue.clear()
        self.unsubscribe()
        self.wake.set()


class MapWatch(Generic[K, V]):
    """A stream of :class:`MapEvent`: first a consistent snapshot, then every change in order.

    Made by :meth:`recipes.PulsarMap.changes`. The snapshot is taken, and the watch starts
    listening, in one step when ``changes()`` is called, so no change is missed or seen twice:
    the snapshot events (``initial=True``, position ``start_position``) come first, then every
    later change to a matching key in log order, each write's changes together.

    Use it as ``async for event in watch`` or call :meth:`next` (with a timeout). The stream
    ends (``async for`` stops, ``next`` returns None) after :meth:`close`. If the replica halts
    or the map closes, the events already queued are delivered, then the error is raised
    (:class:`ReplicaHaltedError`, :class:`ClosedError`). A consumer more than ``max_queue``
    changes behind gets :class:`WatchOverflowError` at once. ``async with`` closes the watch on
    exit; a watch dropped without closing unsubscribes when it is garbage collected.
    """

    def __init__(self, feed: _Feed[K, V], start_position: int) -> None:
        self._feed = feed
        self.start_position = start_position
        self._finalizer = weakref.finalize(self, feed.close)

    @property
    def closed(self) -> bool:
        return self._feed.closed

    async def next(self, *, timeout: float | None = None) -> MapEvent[K, V] | None:
        """The next event, or None once the watch is closed.

        Waits at most ``timeout`` seconds (None: until an event comes), then raises
        :class:`OperationTimeoutError`; the watch stays usable.
        """
        feed = self._feed
        try:
            async with asyncio.timeout(timeout):
                while True:
                    if feed.closed:
                        return None
                    if feed.initial:
                        return _readable(feed.initial.popleft())
                    if feed.queue:
                        event = feed.queue.popleft()
                        feed.delivered_position = received_through(
                            event.position, feed.queue, _position_of
                        )
                        return _readable(event)
                    if feed.error is not None:
                        break  # raised below: the error may itself be a TimeoutError
                    feed.wake.clear()
                    await feed.wake.wait()
        except TimeoutError as exc:
            raise OperationTimeoutError(f"no change came within {timeout}s") from exc
        # Raised again on every call: drop the previous raise's traceback.
        raise feed.error.with_traceback(None)

    def __aiter__(self) -> MapWatch[K, V]:
        return self

    async def __anext__(self) -> MapEvent[K, V]:
        event = await self.next()
        if event is None:
            raise StopAsyncIteration
        return event

    def close(self) -> None:
        """Stop listening at once and drop queued events; iteration then ends."""
        self._finalizer()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> MapWatch[K, V]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class WatchHub(Generic[K, V]):
    """A map's watches: turns event collection on while any is open, and ends them all when
    the replica halts or the map closes."""

    def __init__(
        self, state: MapState[K, V], manager: SharedStateManager[MapState[K, V], MapOp[K, V]]
    ) -> None:
        self._state = state
        self._manager = manager
        self._feeds: set[_Feed[K, V]] = set()
        self._sentinel: asyncio.Task[None] | None = None
        self._started = False  # the manager is open (the sentinel's wait_for needs it)

    def open(
        self,
        accept: Callable[[MapEvent[K, V]], bool],
        *,
        snapshot: bool,
        max_queue: int,
        candidates: Callable[[MapState[K, V]], Iterable[K]] | None = None,
        after: int | None = None,
    ) -> MapWatch[K, V]:
        """A watch of the changes ``accept`` takes; its snapshot holds the entries ``accept``
        takes among those of ``candidates(state)`` (None: every key), in key order.
        ``after``: ``accept`` takes no change at or before this position (a resumed watch),
        so the consumer has received every change through it from the start."""
        # One synchronous step (no await): the snapshot and the subscription see the same state.
        state = self._state
        position = self._manager.position
        if after is not None:
            # (An overflow before anything was delivered named the open's position, maybe
            # 0: resuming there delivered every change up to ``after`` again.)
            position = max(position, after)
        initial: list[MapEvent[K, V]] = []
        if snapshot:
            entries: Iterable[tuple[K, MapEntry[V] | None]] = (
                state.entries_in_order()
                if candidates is None
                else ((key, state.lookup(key)) for key in candidates(state))
            )
            for key, entry in entries:
                if entry is None:
                    continue
                event = MapEvent("put", key, entry.value, entry.version, position, initial=True)
                if accept(event):
                    initial.append(event)
        feed = _Feed(state, accept, initial, position, max_queue)
        remove_listener = self._manager.add_listener(feed.on_record)

        def unsubscribe() -> None:
            remove_listener()
            self._feeds.discard(feed)
            if not self._feeds:
                state.events = None

        feed.unsubscribe = unsubscribe
        self._feeds.add(feed)
        if state.events is None:
            state.events = []
        if self._started:
            self._start_sentinel()
        return MapWatch(feed, position)

    def start(self) -> None:
        """The map is open: watch for a halt (watches opened before open() waited for this)."""
        self._started = True
        if self._feeds:
            self._start_sentinel()

    def _start_sentinel(self) -> None:
        if self._sentinel is None:
            self._sentinel = asyncio.get_running_loop().create_task(
                self._end_on_halt(), name=f"pulsar-map-watch-sentinel-{self._manager.topic}"
            )

    async def _end_on_halt(self) -> None:
        while True:
            try:
                await self._manager.wait_for(_NEVER, timeout=3600.0)
            except OperationTimeoutError:
                continue
            except PulsarStateError as exc:  # ReplicaHaltedError or ClosedError
                self.fail_all(exc)
                return

    def fail_all(self, error: PulsarStateError) -> None:
        for feed in list(self._feeds):
            feed.fail(error)

    def end(self, error: PulsarStateError) -> None:
        """End every watch with ``error`` and stop watching for a halt (a hub replaced)."""
        self.fail_all(error)
        sentinel, self._sentinel = self._sentinel, None
        if sentinel is not None:
            sentinel.cancel()

    async def aclose(self) -> None:
        self.fail_all(ClosedError("the map is closed"))
        sentinel, self._sentinel = self._sentinel, None
        if sentinel is not None:
            sentinel.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sentinel
