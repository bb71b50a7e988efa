"""The blocking LeaderElection and Membership: every call forwarded through a BlockingPortal."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Generic, TypeVar

from pulsar_state import BlockingPortal, ClosedError, SyncFacade, backstop

from ._lease_table import Lease
from ._streams import EventStream
from .election import Leader, LeaderElection
from .membership import MemberEvent, Membership
from .ownership import OneLeaseRecipe

__all__ = ["SyncEventStream", "SyncLeaderElection", "SyncMembership"]

T = TypeVar("T")
R = TypeVar("R", bound=OneLeaseRecipe)


class SyncEventStream(Generic[T]):
    """The blocking twin of an event stream (``leaders()``, ``events()``): iterate it
    (waits as long as it takes) or call :meth:`next` with a timeout; :meth:`close`, from any
    thread, ends the iteration."""

    def __init__(self, stream: EventStream[T], portal: BlockingPortal) -> None:
        self._stream = stream
        self._portal = portal

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._stream.closed

    def next(self, *, timeout: float | None = None) -> T:
        """The next item; OperationTimeoutError after ``timeout`` s; ClosedError once closed."""
        return self._portal.call(
            lambda: self._stream.next(timeout=timeout), timeout=backstop(timeout)
        )

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        try:
            return self.next()
        except ClosedError:
            if self._stream.closed:  # closed by close(), not by the recipe closing
                raise StopIteration from None
            raise

    def close(self) -> None:
        with contextlib.suppress(ClosedError):  # a stopped portal serves nothing any more
            self._portal.call_sync(self._stream.close)

    def __enter__(self) -> SyncEventStream[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _SyncOneLease(SyncFacade[R]):
    def __init__(self, recipe: R, portal: BlockingPortal | None) -> None:
        super().__init__(recipe, recipe.ownership.manager, portal)
        self._recipe = recipe

    @property
    def name(self) -> str:
        return self._recipe.name

    def _forward(self, fn: Callable[[], Awaitable[T]], timeout: float | None) -> T:
        # No default timeout: campaign/join(timeout=None) wait as long as it takes.
        return self._portal.call(fn, timeout=backstop(timeout))

    def _local(self, fn: Callable[[], T]) -> T:
        return self._portal.call_sync(fn)

    def cancel(self) -> None:
        """Call off a ``campaign()`` or ``join()`` blocked in another thread: it withdraws its
        request and raises :class:`~recipes.WaitCancelledError` (see the async ``cancel``).
        Nothing once closed."""
        if self._portal.on_loop_thread():  # (a callback on the portal's loop)
            self._recipe.cancel()
            return
        with contextlib.suppress(ClosedError):  # a stopped portal has nothing in progress
            self._local(self._recipe.cancel)


class SyncLeaderElection(_SyncOneLease[LeaderElection]):
    """The blocking twin of :class:`~recipes.LeaderElection` (same arguments plus ``portal``)::

    with SyncLeaderElection("pulsar://127.0.0.1:6650", "my-job-leader", ttl=5) as election:
        election.campaign()              # returns once this process leads
    """

    def __init__(
        self, pulsar: Any, topic: str, *, portal: BlockingPortal | None = None, **options: Any
    ) -> None:
        super().__init__(LeaderElection(pulsar, topic, **options), portal)

    @property
    def async_election(self) -> LeaderElection:
        """The async LeaderElection underneath (use it only from the portal's loop)."""
        return self._recipe

    def campaign(self, *, timeout: float | None = None) -> Leader:
        return self._forward(lambda: self._recipe.campaign(timeout=timeout), timeout)

    def resign(self, *, timeout: float | None = None) -> None:
        self._write(lambda: self._recipe.resign(timeout=timeout), timeout)

    @property
    def lease(self) -> Lease | None:
        # On the portal's loop, as every read of the replica (is_leader reads it); a stopped
        # portal: closed, so it leads no more.
        try:
            return self._local(lambda: self._recipe.lease)
        except ClosedError:
            return None

    def is_leader(self, *, margin: float = 0.0) -> bool:
        return self._local(lambda: self._recipe.is_leader(margin=margin))

    def leader(self) -> Leader | None:
        return self._local(self._recipe.leader)

    def current_leader(self, *, latest: bool = True, timeout: float | None = None) -> Leader | None:
        return self._read(
            lambda: self._recipe.current_leader(latest=latest, timeout=timeout), timeout
        )

    def leaders(self, *, max_queue: int = 1000) -> SyncEventStream[Leader | None]:
        stream = self._local(lambda: self._recipe.leaders(max_queue=max_queue))
        return SyncEventStream(stream, self._portal)


class SyncMembership(_SyncOneLease[Membership]):
    """The blocking twin of :class:`~recipes.Membership` (same arguments plus ``portal``)::

    with SyncMembership("pulsar://127.0.0.1:6650", "workers", name="w1", ttl=5) as group:
        group.join()
        print(group.members())
    """

    def __init__(
        self, pulsar: Any, topic: str, *, portal: BlockingPortal | None = None, **options: Any
    ) -> None:
        super().__init__(Membership(pulsar, topic, **options), portal)

    @property
    def async_membership(self) -> Membership:
        """The async Membership underneath (use it only from the portal's loop)."""
        return self._recipe

    def join(self, *, timeout: float | None = None) -> Lease:
        return self._forward(lambda: self._recipe.join(timeout=timeout), timeout)

    def leave(self, *, timeout: float | None = None) -> None:
        self._write(lambda: self._recipe.leave(timeout=timeout), timeout)

    def members_local(self) -> list[str]:
        return self._local(self._recipe.members_local)

    def members(self, *, latest: bool = True, timeout: float | None = None) -> list[str]:
        return self._read(lambda: self._recipe.members(latest=latest, timeout=timeout), timeout)

    def events(
        self, *, snapshot: bool = True, max_queue: int = 10_000
    ) -> SyncEventStream[MemberEvent]:
        stream = self._local(lambda: self._recipe.events(snapshot=snapshot, max_queue=max_queue))
        return SyncEventStream(stream, self._portal)
