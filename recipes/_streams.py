"""A bounded async stream of events, fed from a manager listener (election, membership)."""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from pulsar_state import ClosedError, ConfigurationError, OperationTimeoutError, PulsarStateError

from ._map_watch import WatchOverflowError, received_through

__all__ = ["EventStream", "feed", "removing_all"]

T = TypeVar("T")
A = TypeVar("A")
B = TypeVar("B")


class EventStream(Generic[T]):
    """Items in log order: ``async for item in stream`` or ``await stream.next(timeout=...)``.

    At most ``max_queue`` items wait for the consumer (the initial snapshot does not count,
    and a consumer with none waiting takes one record's items whatever their number). One
    further behind gets :class:`~recipes.WatchOverflowError`, whose ``position`` is the log
    position up to which it received every item (the snapshot's if none; the one before a
    record whose items it received only some of): the changes queued are
    dropped, the rest of the snapshot is still delivered first, and the stream stops (open a
    new one to start again from the current state). If the recipe closes or its replica
    halts, the queued items are delivered, then that error is raised.
    ``close()`` (or leaving ``async with``) ends ``async for``; ``next()`` then raises ClosedError.
    """

    def __init__(self, initial: Iterable[T], *, max_queue: int, position: int) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ConfigurationError(f"max_queue must be an int >= 1, not {max_queue!r}")
        # The snapshot apart from the changes: it is the state, not a backlog.
        self._initial: deque[T] = deque(initial)
        self._queue: deque[tuple[T, int]] = deque()
        self._max_queue = max_queue
        # Every item up to this log position was taken by the consumer.
        self._received = position
        self._wake = asyncio.Event()
        self._error: PulsarStateError | None = None
        self._closed = False
        self.unsubscribe: Callable[[], None] = lambda: None

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, items: list[T], position: int) -> None:
        """Queue ``items``, the changes of the record at log ``position`` (called from a
        listener, on the event loop)."""
        if self._closed or self._error is not None or not items:
            return
        if self._queue and len(self._queue) + len(items) > self._max_queue:
            self._queue.clear()  # the snapshot, a state, is still delivered first
            self.fail(
                WatchOverflowError(
                    f"the consumer fell more than {self._max_queue} events behind (at log "
                    f"position {self._received}); open a new stream to start again from the "
                    "current state",
                    max_queue=self._max_queue,
                    position=self._received,
                )
            )
            return
        self._queue.extend((item, position) for item in items)
        self._wake.set()

    def fail(self, error: PulsarStateError) -> None:
        if self._error is None:
            self._error = error
        self.unsubscribe()
        self._wake.set()

    async def next(self, *, timeout: float | None = None) -> T:
        """The next item; OperationTimeoutError after ``timeout`` s; ClosedError once closed."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    if self._closed:
                        raise ClosedError("the stream is closed")
                    if self._initial:
                        return self._initial.popleft()
                    if self._queue:
                        item, at = self._queue.popleft()
                        self._received = received_through(at, self._queue, lambda q: q[1])
                        return item
                    if self._error is not None:
                        raise self._error.with_traceback(None)
                    self._wake.clear()
                    await self._wake.wait()
        except TimeoutError as exc:
            raise OperationTimeoutError(f"no event came within {timeout}s") from exc

    def __aiter__(self) -> EventStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._closed:
            raise StopAsyncIteration
        try:
            return await self.next()
        except ClosedError:
            if self._closed:  # closed by close(), not by the recipe closing
                raise StopAsyncIteration from None
            raise

    def close(self) -> None:
        self._closed = True
        self._initial.clear()
        self._queue.clear()
        self.unsubscribe()
        self._wake.set()

    async def __aenter__(self) -> EventStream[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


def feed(
    stream: EventStream[T],
    subscribe: Callable[[Callable[[A, B], None]], Callable[[], None]],
    on_close: Callable[[Callable[[PulsarStateError], None]], Callable[[], None]],
    on_change: Callable[[EventStream[T], A, B], None],
) -> None:
    """Feed ``stream``: ``on_change(stream, ...)`` for each call of the listener given to
    ``subscribe``, and the stream failed with the error ``on_close`` reports. The listeners
    hold the stream weakly, so a stream dropped without close() (a ``break`` out of
    ``async for``, a cancelled consumer) is collected and leaves nothing subscribed; before,
    each stayed subscribed, queueing, as long as the recipe was open."""
    ref = weakref.ref(stream)

    def changed(first: A, second: B) -> None:
        found = ref()
        if found is not None:
            on_change(found, first, second)

    def closed(error: PulsarStateError) -> None:
        found = ref()
        if found is not None:
            found.fail(error)

    # Called by close() or fail(), or when the stream is collected: once, whichever is first.
    stream.unsubscribe = weakref.finalize(
        stream, removing_all(subscribe(changed), on_close(closed))
    )


def removing_all(*removers: Callable[[], None]) -> Callable[[], None]:
    """One remover calling each of ``removers`` (subscriptions to drop when a stream ends,
    closed or failed: a stream closed early leaves nothing of it with its sources)."""

    def remove() -> None:
        for remover in removers:
            remover()

    return remove
