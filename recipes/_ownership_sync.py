"""The blocking Ownership: every call forwarded through a BlockingPortal to the async one."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

from pulsar_state import BlockingPortal, ClosedError, SyncFacade, backstop

from ._lease_table import Lease, LeaseTable, Mode, NotHeldError
from .ownership import Ownership

__all__ = ["SyncOwnership"]

T = TypeVar("T")


class SyncOwnership(SyncFacade[Ownership]):
    """The blocking twin of :class:`~recipes.Ownership` (same arguments plus ``portal``)::

    with SyncOwnership("pulsar://127.0.0.1:6650", "locks") as owners:
        with owners.hold(["a", "b"], ttl=10) as lease:
            print(lease.token)
    """

    def __init__(
        self,
        pulsar: Any,
        topic: str,
        *,
        owner: str | None = None,
        resources: Iterable[str] | None = None,
        reap: bool = True,
        portal: BlockingPortal | None = None,
        **manager_options: Any,
    ) -> None:
        self._ownership = Ownership(
            pulsar, topic, owner=owner, resources=resources, reap=reap, **manager_options
        )
        super().__init__(self._ownership, self._ownership.manager, portal)

    @property
    def async_ownership(self) -> Ownership:
        """The async Ownership underneath (use it only from the portal's loop)."""
        return self._ownership

    @property
    def owner(self) -> str:
        return self._ownership.owner

    @property
    def topic(self) -> str:
        return self._ownership.topic

    @property
    def position(self) -> int:
        return self._ownership.position

    def _forward(self, fn: Callable[[], Awaitable[T]], timeout: float | None) -> T:
        # No default timeout: acquire(timeout=None) waits as long as it takes.
        return self._portal.call(fn, timeout=backstop(timeout))

    def acquire(
        self,
        names: str | Iterable[str],
        *,
        mode: Mode = "write",
        ttl: float = 10.0,
        timeout: float | None = None,
        keep_alive: bool = True,
    ) -> Lease:
        """As :meth:`Ownership.acquire`."""
        return self._forward(
            lambda: self._ownership.acquire(
                names, mode=mode, ttl=ttl, timeout=timeout, keep_alive=keep_alive
            ),
            timeout,
        )

    def try_acquire(
        self,
        names: str | Iterable[str],
        *,
        mode: Mode = "write",
        ttl: float = 10.0,
        timeout: float | None = None,
        keep_alive: bool = True,
    ) -> Lease | None:
        """As :meth:`Ownership.try_acquire`."""
        return self._forward(
            lambda: self._ownership.try_acquire(
                names, mode=mode, ttl=ttl, timeout=timeout, keep_alive=keep_alive
            ),
            timeout,
        )

    def renew(
        self,
        lease: Lease,
        *,
        ttl: float | None = None,
        keep_alive: bool = False,
        timeout: float | None = None,
    ) -> Lease:
        return self._write(
            lambda: self._ownership.renew(lease, ttl=ttl, keep_alive=keep_alive, timeout=timeout),
            timeout,
        )

    def is_kept_alive(self, lease: Lease) -> bool:
        """As :meth:`Ownership.is_kept_alive` (no I/O)."""
        return self._portal.call_sync(lambda: self._ownership.is_kept_alive(lease))

    def release(self, lease: Lease, *, timeout: float | None = None) -> None:
        self._forward(lambda: self._ownership.release(lease, timeout=timeout), timeout)

    @contextlib.contextmanager
    def hold(
        self,
        names: str | Iterable[str],
        *,
        mode: Mode = "write",
        ttl: float = 10.0,
        timeout: float | None = None,
    ) -> Iterator[Lease]:
        """As :meth:`Ownership.hold`."""
        lease = self.acquire(names, mode=mode, ttl=ttl, timeout=timeout)
        try:
            yield lease
        except BaseException:
            with contextlib.suppress(NotHeldError, ClosedError):
                self.release(lease)
            raise
        self.release(lease)

    def holders(
        self, name: str, *, latest: bool = False, timeout: float | None = None
    ) -> list[Lease]:
        return self._read(
            lambda: self._ownership.holders(name, latest=latest, timeout=timeout), timeout
        )

    def holders_local(self, name: str) -> list[Lease]:
        """As :meth:`Ownership.holders_local` (no I/O)."""
        return self._portal.call_sync(lambda: self._ownership.holders_local(name))

    def leases(self, *, latest: bool = False, timeout: float | None = None) -> list[Lease]:
        return self._read(lambda: self._ownership.leases(latest=latest, timeout=timeout), timeout)

    def read_local(self, reader: Callable[[LeaseTable], Any]) -> Any:
        """As :meth:`Ownership.read_local`: ``reader`` on the local table (no I/O)."""
        return self._portal.call_sync(lambda: self._ownership.read_local(reader))

    def is_held(self, lease: Lease, *, margin: float = 0.0) -> bool:
        async def run() -> bool:
            return self._ownership.is_held(lease, margin=margin)

        return self._portal.call(run, timeout=30.0)
