"""Counter: an integer replicated through one Pulsar topic, with atomic add.

:Status: Experimental. Built only on ``pulsar_state``'s public API.

``add(delta)`` appends one op; every replica applies every op exactly once, in log order (the
core's guarantee, also under retries and fenced writers), so the value is exact under any
contention and ``add`` returns the value right after its own op: across all processes, the
values returned by ``add(1)`` are distinct. ``compare_and_set`` decides on the up-to-date value.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from pulsar_state import (
    STATE_MACHINE_OPTIONS,
    BlockingPortal,
    ConfigurationError,
    SharedStateManager,
    SyncFacade,
)

__all__ = ["Counter", "SyncCounter"]

T = TypeVar("T")


def _check_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{what} must be an int, not {type(value).__name__}")
    return value


def _apply(state: dict[str, Any], op: Any) -> None:
    if not isinstance(op, dict):
        raise ValueError(f"not a counter op: {op!r}")
    if "add" in op:
        state["value"] += _check_int(op["add"], "add")
    elif "set" in op:
        state["value"] = _check_int(op["set"], "set")
        state["tag"] = str(op.get("tag", ""))
    else:
        raise ValueError(f"not a counter op: {op!r}")


class Counter:
    """An exact, replicated integer (starts at 0)::

    async with Counter("pulsar://127.0.0.1:6650", "jobs-done") as done:
        print(await done.add(1), await done.value(latest=True))
    """

    def __init__(self, pulsar: Any, topic: str, **manager_options: Any) -> None:
        reserved = sorted(STATE_MACHINE_OPTIONS & manager_options.keys())
        if reserved:
            raise ConfigurationError(f"Counter sets {', '.join(reserved)} itself")
        self._manager: SharedStateManager[dict[str, Any], Any] = SharedStateManager(
            pulsar, topic, initial_state=lambda: {"value": 0}, apply=_apply, **manager_options
        )

    async def open(self, *, timeout: float | None = None) -> None:
        await self._manager.open(timeout=timeout)

    async def aclose(self, *, timeout: float = 10.0) -> None:
        await self._manager.aclose(timeout=timeout)

    async def __aenter__(self) -> Counter:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def manager(self) -> SharedStateManager[dict[str, Any], Any]:
        return self._manager

    @property
    def position(self) -> int:
        return self._manager.position

    async def add(self, delta: int = 1, *, timeout: float | None = None) -> int:
        """Add ``delta`` (an int, may be negative); returns the value right after this add."""
        op = {"add": _check_int(delta, "delta")}
        result = await self._manager.write(
            lambda _state: [op], reader=lambda s: int(s["value"]), timeout=timeout
        )
        return result.value

    async def compare_and_set(
        self, expected: int, new: int, *, timeout: float | None = None
    ) -> bool:
        """Set the value to ``new`` only if it is ``expected`` now; returns whether it did."""
        wanted = _check_int(expected, "expected")
        tag = os.urandom(8).hex()  # tells whether the op applied was this call's
        op = {"set": _check_int(new, "new"), "tag": tag}
        result = await self._manager.write(
            lambda state: [op] if state["value"] == wanted else [],
            reader=lambda s: s.get("tag") == tag,
            timeout=timeout,
        )
        return bool(result.value)

    async def value(self, *, latest: bool = False, timeout: float | None = None) -> int:
        """The value; ``latest=True`` first catches up with the tail (linearizable)."""
        return await self._manager.read(lambda s: int(s["value"]), latest=latest, timeout=timeout)


class SyncCounter(SyncFacade[Counter]):
    """The blocking twin of :class:`Counter` (same arguments plus an optional ``portal``)."""

    def __init__(
        self, pulsar: Any, topic: str, *, portal: BlockingPortal | None = None, **options: Any
    ) -> None:
        self._counter = Counter(pulsar, topic, **options)
        super().__init__(self._counter, self._counter.manager, portal)

    @property
    def position(self) -> int:
        return self._counter.position

    def add(self, delta: int = 1, *, timeout: float | None = None) -> int:
        return self._write(lambda: self._counter.add(delta, timeout=timeout), timeout)

    def compare_and_set(self, expected: int, new: int, *, timeout: float | None = None) -> bool:
        return self._write(
            lambda: self._counter.compare_and_set(expected, new, timeout=timeout), timeout
        )

    def value(self, *, latest: bool = False, timeout: float | None = None) -> int:
        return self._read(lambda: self._counter.value(latest=latest, timeout=timeout), timeout)
