"""BlockingPortal.call_sync and the SyncFacade base of the blocking twins (no broker)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from pulsar_state import (
    BlockingPortal,
    ClosedError,
    ConfigurationError,
    OperationTimeoutError,
    SharedStateManager,
)
from pulsar_state._manager import close_budget
from pulsar_state._sync import SyncFacade, backstop


def test_call_sync_runs_on_the_portal_thread_and_returns() -> None:
    portal = BlockingPortal()
    try:
        assert portal.call_sync(lambda a, b: (a + b, threading.current_thread().name), 1, 2) == (
            3,
            "pulsar-state-portal",
        )
        with pytest.raises(KeyError):
            portal.call_sync({}.__getitem__, "missing")
    finally:
        portal.stop()
    with pytest.raises(ClosedError):
        portal.call_sync(lambda: None)


@contextlib.contextmanager
def ctrl_c_once(started: threading.Event) -> Iterator[None]:
    """Send this thread a SIGINT (Ctrl-C) once ``started`` is set, from another thread."""
    main = threading.get_ident()
    interrupter = threading.Thread(
        target=lambda: started.wait(5.0) and signal.pthread_kill(main, signal.SIGINT)
    )
    interrupter.start()
    try:
        yield
    finally:
        interrupter.join()


def test_an_interrupted_blocking_call_is_cancelled_on_the_portal() -> None:
    portal = BlockingPortal()
    outcome: list[str] = []
    started = threading.Event()

    async def long_call() -> None:
        started.set()
        try:
            await asyncio.sleep(3.0)
            outcome.append("finished")
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    try:
        # Before: the KeyboardInterrupt reached the caller and the call ran on to the end.
        with ctrl_c_once(started), pytest.raises(KeyboardInterrupt):
            portal.call(long_call)
        portal.call_sync(lambda: None)  # a loop turn: the cancellation has run
        assert outcome == ["cancelled"]
    finally:
        portal.stop()


def test_an_interrupted_close_still_closes_on_a_shared_portal() -> None:
    portal = BlockingPortal()
    steps: list[str] = []
    started = threading.Event()

    class SlowToClose(Resource):
        async def aclose(self, *, timeout: float = 10.0) -> None:
            started.set()
            steps.append("releasing")
            await asyncio.sleep(0.3)
            steps.append("disconnected")

    resource = SlowToClose()
    facade = SyncFacade(resource, resource, portal)
    try:
        with ctrl_c_once(started), pytest.raises(KeyboardInterrupt):
            facade.close()
        # A close cancelled half-way would leave the resource open, and a second close()
        # does nothing: it must run to its end.
        portal.call(lambda: asyncio.sleep(0.5))
        assert steps == ["releasing", "disconnected"]
    finally:
        portal.stop()


def test_backstop_adds_the_grace_to_a_timeout() -> None:
    assert backstop(None) is None
    assert backstop(1.0) == 6.0


@dataclass
class Resource:
    events: list[str] = field(default_factory=list)
    open_timeout_s: float = 1.0
    read_timeout_s: float = 1.0
    write_timeout_s: float = 1.0
    close_timeout: float | None = None

    async def open(self, *, timeout: float | None = None) -> None:
        self.events.append(f"open {timeout}")

    async def aclose(self, *, timeout: float = 10.0) -> None:
        self.events.append("aclose")
        self.close_timeout = timeout


def test_facade_opens_and_closes_through_with_and_stops_only_its_own_portal() -> None:
    resource = Resource()
    with SyncFacade(resource, resource, None) as facade:
        own = facade.portal
        assert resource.events == ["open None"]
    assert resource.events == ["open None", "aclose"]
    with pytest.raises(ClosedError):
        own.call_sync(lambda: None)  # the facade made it, the facade stopped it

    shared = BlockingPortal()
    try:
        with SyncFacade(resource, resource, shared):
            pass
        assert shared.call_sync(lambda: 42) == 42  # given, so left running
    finally:
        shared.stop()


class RefusedResource(Resource):
    async def open(self, *, timeout: float | None = None) -> None:
        self.events.append("open")
        raise ConnectionRefusedError("the broker is down")


def portal_threads() -> int:
    return sum(thread.name == "pulsar-state-portal" for thread in threading.enumerate())


def test_an_open_that_fails_in_with_closes_the_resource_and_stops_its_own_portal() -> None:
    before = portal_threads()
    resources = [RefusedResource() for _ in range(5)]
    for resource in resources:
        with pytest.raises(ConnectionRefusedError), SyncFacade(resource, resource, None):
            pass
    # Before: __exit__ never ran, so each facade's portal thread (and event loop) stayed,
    # and nothing closed what the open had made.
    assert portal_threads() == before
    assert all(resource.events == ["open", "aclose"] for resource in resources)

    shared = BlockingPortal()
    try:
        resource = RefusedResource()
        with pytest.raises(ConnectionRefusedError), SyncFacade(resource, resource, shared):
            pass
        assert shared.call_sync(lambda: 42) == 42  # given, so left running
    finally:
        shared.stop()


def test_closing_a_facade_again_does_nothing() -> None:
    resource = Resource()
    facade = SyncFacade(resource, resource, None)
    with facade:
        pass
    facade.close()  # before: ClosedError("the portal is stopped"); aclose() may be called twice
    assert resource.events == ["open None", "aclose"]


def test_close_waits_as_long_as_the_resources_close_may_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The portal's backstop for close() was a fixed 30 s, shorter than aclose() may take
    # (close_budget): the caller got a timeout while the close still ran. Now close passes
    # its timeout to aclose and waits at least what that aclose may take.
    waited: list[float | None] = []
    call = BlockingPortal.call

    def spy(
        self: BlockingPortal, fn: Any, *args: Any, timeout: float | None = None, **kw: Any
    ) -> Any:
        waited.append(timeout)
        return call(self, fn, *args, timeout=timeout, **kw)

    monkeypatch.setattr(BlockingPortal, "call", spy)
    resource = Resource()
    facade = SyncFacade(resource, resource, None)
    facade.close(timeout=60.0)
    assert resource.close_timeout == 60.0
    assert waited[-1] is not None
    assert waited[-1] > close_budget(60.0) > 60.0


def test_an_async_timeout_error_comes_through_unchanged() -> None:
    portal = BlockingPortal()

    async def times_out() -> None:
        raise OperationTimeoutError("could not catch up with the topic in 1s")

    try:
        with pytest.raises(OperationTimeoutError, match="could not catch up"):
            portal.call(times_out, timeout=5.0)
    finally:
        portal.stop()


def test_a_borrowed_client_needs_admin_url() -> None:
    client = object()  # any non-URL is a borrowed client; the check comes before any I/O
    with pytest.raises(ConfigurationError, match="admin_url"):
        SharedStateManager(client, "t", initial_state=dict, apply=lambda s, op: None)
