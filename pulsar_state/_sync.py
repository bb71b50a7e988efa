"""The blocking API: an event loop in a background thread running the async implementation.

:class:`BlockingPortal` is the same idea as anyio's blocking portal, written over
``asyncio.run_coroutine_threadsafe`` rather than adding anyio and its dependencies for it.
:class:`SyncFacade` is the common base of the blocking twins (:class:`SyncSharedStateManager`
here, ``SyncPulsarMap`` in the recipes): opening, closing, ``with``, and the timeouts of calls
forwarded through a portal. There is no second copy of the logic.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, Self, TypeVar, overload

from ._envelope import SnapshotManifest
from ._errors import ClosedError, OperationTimeoutError, PulsarStateError
from ._manager import SharedStateManager, close_budget
from ._types import ManagerStats, WriteResult

__all__ = ["BlockingPortal", "SyncFacade", "SyncSharedStateManager", "backstop"]

logger = logging.getLogger(__name__)

S = TypeVar("S")
Op = TypeVar("Op")
T = TypeVar("T")

# Added to an operation's own timeout for the portal's backstop: the async call enforces the
# real timeout and raises a precise error; the backstop only guards against a stuck loop.
_GRACE_S = 5.0
# Bounds calls that do no I/O (``call_sync``) and closing: only a stuck loop takes longer.
_LOCAL_TIMEOUT_S = 30.0


def _close_backstop(timeout: float) -> float:
    # A recipe's close may first write (e.g. release its leases, up to ``timeout``), then
    # close its manager.
    return timeout + close_budget(timeout)


def backstop(timeout: float | None) -> float | None:
    """The portal's timeout for an async call whose own timeout is ``timeout`` (None: none)."""
    return None if timeout is None else timeout + _GRACE_S


class _AsyncResource(Protocol):
    async def open(self, *, timeout: float | None = None) -> None: ...

    async def aclose(self, *, timeout: float = ...) -> None: ...


def _copy_outcome(future: concurrent.futures.Future[T], task: asyncio.Task[T]) -> None:
    """Give ``future`` (the blocked caller's) the outcome of ``task`` (on the portal's loop),
    unless the caller cancelled it."""
    if task.cancelled():
        future.cancel()
    elif future.set_running_or_notify_cancel():
        error = task.exception()
        if error is None:
            future.set_result(task.result())
        else:
            future.set_exception(error)


class BlockingPortal:
    """Runs coroutines on an event loop owned by a daemon thread, for blocking callers.

    A portal belongs to the process that created it: after ``fork`` (PySpark workers fork) the
    child must create its own, and ``call`` says so instead of hanging.

    A portal still running at interpreter exit is stopped by an ``atexit`` hook, after closing
    the resources registered with :meth:`close_at_exit`: its daemon thread must not be inside
    the Pulsar client when the interpreter finalizes, or the process aborts (``terminate called
    without an active exception``: measured 1 process in 400 left its blocking facades open).
    """

    def __init__(self, name: str = "pulsar-state-portal") -> None:
        self._pid = os.getpid()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._exit_closers: dict[int, _AsyncResource] = {}
        self._stopped = False
        self._thread.start()
        self._ready.wait()
        _running_portals.add(self)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def call(
        self,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        timeout: float | None = None,
        cancel_on_interrupt: bool = True,
    ) -> T:
        """Run ``fn(*args)`` on the portal's loop and wait for its result.

        If the waiting thread is interrupted (Ctrl-C, or SystemExit from a signal handler),
        the call is cancelled on the loop, so that it does not go on alone (a campaign
        granted later that nobody knows leads); ``cancel_on_interrupt=False`` lets it finish
        instead (a close, which must not stop half-way).
        """
        if os.getpid() != self._pid:
            raise ClosedError(
                "this portal was created in another process (fork); create a new one here"
            )
        if self._stopped:
            raise ClosedError("the portal is stopped")
        if self.on_loop_thread():
            raise RuntimeError("blocking call from the portal's own thread would deadlock")

        # Not run_coroutine_threadsafe: an interrupt after it scheduled the call but before
        # it returned the future would leave nothing to cancel. The future exists first
        # here, and the call does not start once it is cancelled.
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        loop = self._loop

        async def run() -> T:  # fn's own errors, even raised before it awaits, in the task
            return await fn(*args)

        def start() -> None:
            if future.cancelled():
                return
            task = loop.create_task(run())
            future.add_done_callback(
                lambda f: f.cancelled() and loop.call_soon_threadsafe(task.cancel)
            )
            task.add_done_callback(functools.partial(_copy_outcome, future))

        try:
            loop.call_soon_threadsafe(start)
            return future.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            if future.done():
                # The call's own timeout error (OperationTimeoutError is a TimeoutError,
                # which concurrent.futures.TimeoutError is since 3.11): it is the precise one.
                raise
            future.cancel()
            raise OperationTimeoutError(f"blocking call did not finish in {timeout}s") from exc
        except BaseException:
            if cancel_on_interrupt:
                future.cancel()
            raise

    def on_loop_thread(self) -> bool:
        """Whether the calling thread is the portal's own (a callback on its loop), where a
        blocking call would deadlock: call the async side's plain methods directly there."""
        return threading.current_thread() is self._thread

    def call_sync(
        self, fn: Callable[..., T], *args: Any, timeout: float | None = _LOCAL_TIMEOUT_S
    ) -> T:
        """Run the plain function ``fn(*args)`` on the portal's loop, between its callbacks
        (so it sees the state the loop's tasks keep), and wait for its result."""

        async def run() -> T:
            return fn(*args)

        return self.call(run, timeout=timeout)

    def close_at_exit(self, resource: _AsyncResource) -> None:
        """Run ``resource.aclose()`` on this portal at interpreter exit if it is still
        registered then (blocking twins register on ``open`` and unregister on ``close``)."""
        self._exit_closers[id(resource)] = resource

    def forget_at_exit(self, resource: _AsyncResource) -> None:
        self._exit_closers.pop(id(resource), None)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the tasks still on the loop (and wait for them, up to ``timeout``), stop the
        loop and join the thread."""
        if self._stopped or os.getpid() != self._pid:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("stopping a portal from its own thread would deadlock")
        self._stopped = True
        _running_portals.discard(self)
        cancelled = asyncio.run_coroutine_threadsafe(_cancel_other_tasks(timeout), self._loop)
        try:
            cancelled.result(timeout + 1.0)
        except Exception as exc:  # a stuck loop: stop it anyway
            logger.warning("cancelling the tasks of portal %s: %r", self._thread.name, exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()

    def _stop_at_exit(self, timeout: float) -> None:
        resources, self._exit_closers = list(self._exit_closers.values()), {}
        for resource in resources:
            try:
                self.call(
                    lambda r=resource: r.aclose(timeout=timeout),
                    timeout=backstop(_close_backstop(timeout)),
                    cancel_on_interrupt=False,
                )
            except Exception as exc:
                logger.debug("closing a resource left open at exit: %r", exc)
        self.stop(timeout)


async def _cancel_other_tasks(timeout: float) -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


# Portals started in this process and not stopped yet (stopped at exit).
_running_portals: weakref.WeakSet[BlockingPortal] = weakref.WeakSet()
_EXIT_TIMEOUT_S = 5.0


def _stop_portals_at_exit() -> None:
    """An ``atexit`` hook. Registered after ``_pulsar``'s (this module imports it), so it runs
    before the Pulsar clients left open are closed: first the work on the portals stops."""
    for portal in list(_running_portals):
        if portal._pid == os.getpid():
            portal._stop_at_exit(_EXIT_TIMEOUT_S)


atexit.register(_stop_portals_at_exit)


class _Timeouts(Protocol):
    @property
    def open_timeout_s(self) -> float: ...

    @property
    def read_timeout_s(self) -> float: ...

    @property
    def write_timeout_s(self) -> float: ...


R = TypeVar("R", bound=_AsyncResource)


class SyncFacade(Generic[R]):
    """The blocking twin of an async resource (``open``/``aclose``): ``with`` opens and closes
    it through a portal, which the facade owns (and stops) unless it was given one."""

    def __init__(self, resource: R, timeouts: _Timeouts, portal: BlockingPortal | None) -> None:
        self._resource = resource
        self._timeouts = timeouts
        self._owns_portal = portal is None
        self._portal = portal if portal is not None else BlockingPortal()
        self._closed = False

    @property
    def portal(self) -> BlockingPortal:
        return self._portal

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has started, or the resource was closed otherwise (through
        the portal, or at interpreter exit)."""
        # The recipes' facades hold their manager as the timeouts: closed with the recipe.
        return self._closed or any(
            bool(getattr(part, "closed", False)) for part in (self._resource, self._timeouts)
        )

    def open(self, *, timeout: float | None = None) -> Self:
        self._portal.close_at_exit(self._resource)
        self._call(
            lambda: self._resource.open(timeout=timeout), timeout, self._timeouts.open_timeout_s
        )
        return self

    def close(self, *, timeout: float = 10.0) -> None:
        """Close the resource (its ``aclose(timeout=timeout)``) and the portal if owned;
        again, it does nothing (as ``aclose``)."""
        if self._closed:
            return
        self._closed = True
        self._portal.forget_at_exit(self._resource)
        try:
            self._portal.call(
                lambda: self._resource.aclose(timeout=timeout),
                timeout=backstop(_close_backstop(timeout)),
                cancel_on_interrupt=False,  # a close stopped half-way would leave it open
            )
        finally:
            if self._owns_portal:
                self._portal.stop()

    def __enter__(self) -> Self:
        try:
            return self.open()
        except BaseException:
            # __exit__ does not run when __enter__ raises: close here, or what open() made
            # and the facade's own portal (a thread and an event loop) would stay behind.
            try:
                self.close()
            except Exception as exc:  # the open's failure is the one the caller gets
                logger.warning("closing after a failed open: %r", exc)
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, fn: Callable[[], Awaitable[T]], timeout: float | None, default: float) -> T:
        return self._portal.call(fn, timeout=backstop(default if timeout is None else timeout))

    def _read(self, fn: Callable[[], Awaitable[T]], timeout: float | None) -> T:
        return self._call(fn, timeout, self._timeouts.read_timeout_s)

    def _write(self, fn: Callable[[], Awaitable[T]], timeout: float | None) -> T:
        return self._call(fn, timeout, self._timeouts.write_timeout_s)


class SyncSharedStateManager(SyncFacade[SharedStateManager[S, Op]], Generic[S, Op]):
    """The blocking twin of :class:`SharedStateManager`, for code that is not async.

    Takes the same arguments (plus an optional shared ``portal``)::

        with SyncSharedStateManager(url, "config", initial_state=dict, apply=apply_op) as m:
            m.write(lambda s: [{"set": "k", "to": 1}])
            print(m.read(lambda s: s.get("k"), latest=True))

    Functions passed to ``read``/``write`` run on the portal's thread, serialised with the
    replica's updates, so they see a consistent state.
    """

    def __init__(self, *args: Any, portal: BlockingPortal | None = None, **kwargs: Any) -> None:
        manager: SharedStateManager[S, Op] = SharedStateManager(*args, **kwargs)
        super().__init__(manager, manager, portal)
        self._manager = manager

    @property
    def manager(self) -> SharedStateManager[S, Op]:
        """The async manager underneath (use it only from the portal's loop)."""
        return self._manager

    @property
    def position(self) -> int:
        return self._manager.position

    @property
    def stats(self) -> ManagerStats:
        return self._manager.stats

    @property
    def halted(self) -> PulsarStateError | None:
        """Why this replica stopped applying, or None."""
        return self._manager.halted

    def read_local(self, reader: Callable[[S], T]) -> T:
        """``reader`` on the local state, now, no I/O (run on the portal's thread, between
        the replica's updates)."""
        return self._portal.call_sync(lambda: self._manager.read_local(reader))

    def read(
        self, reader: Callable[[S], T], *, latest: bool = False, timeout: float | None = None
    ) -> T:
        return self._read(
            lambda: self._manager.read(reader, latest=latest, timeout=timeout), timeout
        )

    def sync(self, *, timeout: float | None = None) -> int:
        return self._read(lambda: self._manager.sync(timeout=timeout), timeout)

    def wait_for(self, position: int, *, timeout: float | None = None) -> None:
        self._read(lambda: self._manager.wait_for(position, timeout=timeout), timeout)

    @overload
    def write(
        self, generator: Callable[[S], Sequence[Op]], *, timeout: float | None = None
    ) -> WriteResult[None]: ...

    @overload
    def write(
        self,
        generator: Callable[[S], Sequence[Op]],
        *,
        reader: Callable[[S], T],
        timeout: float | None = None,
    ) -> WriteResult[T]: ...

    def write(
        self,
        generator: Callable[[S], Sequence[Op]],
        *,
        reader: Callable[[S], Any] | None = None,
        timeout: float | None = None,
    ) -> WriteResult[Any]:
        async def run() -> WriteResult[Any]:
            if reader is None:
                return await self._manager.write(generator, timeout=timeout)
            return await self._manager.write(generator, reader=reader, timeout=timeout)

        return self._write(run, timeout)

    def snapshot(self, *, timeout: float | None = None) -> SnapshotManifest:
        return self._write(lambda: self._manager.snapshot(timeout=timeout), timeout)

    def release_writer(self) -> None:
        """See :meth:`SharedStateManager.release_writer`."""
        self._portal.call_sync(self._manager.release_writer)

    def take_writer(self) -> None:
        """See :meth:`SharedStateManager.take_writer`."""
        self._portal.call_sync(self._manager.take_writer)

    def write_ops(self, ops: Sequence[Op], *, timeout: float | None = None) -> WriteResult[None]:
        return self._write(lambda: self._manager.write_ops(ops, timeout=timeout), timeout)
