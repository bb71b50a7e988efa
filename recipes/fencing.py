"""Fenced writes: make a PulsarMap write conditional on a lease's fencing token.

:Status: Experimental. Built on the public APIs of ``PulsarMap`` and ``Ownership``.

The map itself remembers, per resource name, the largest fencing token any fenced write has
carried (under the key ``fence_key(name)``). :func:`fenced_transact` runs ``fn`` and writes its
changes together with the lease's token, in ONE atomic write decided on the up-to-date map
(``PulsarMap.transact``): if the map has already seen a larger token for one of the lease's
names, the write is refused with :class:`~recipes.StaleTokenError` and nothing is written.
Because the decision is made on the up-to-date map under the topic's exclusive writer, and a
record computed on a stale map is ignored by every replica, no replica ever applies a write
from a holder whose lease was taken over and who has been fenced out.

This is the classic fencing-token scheme: the map refuses a token once it has seen a larger
one. A new holder closes the window right after acquiring by calling :func:`claim` (a fenced
write of nothing but its token); from then on the previous holder is refused everywhere,
even if it was frozen while the lease changed hands and still believes it holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pulsar_state import ConfigurationError

from ._lease_table import Lease, StaleTokenError
from ._map_sync import SyncPulsarMap
from .map import PulsarMap

__all__ = ["FENCE_PREFIX", "claim", "fence_key", "fenced_transact", "sync_fenced_transact"]

FENCE_PREFIX = "__fence__/"


def fence_key(name: str) -> str:
    """The map key holding the largest token seen for resource ``name``."""
    return FENCE_PREFIX + name


def _fenced(
    lease: Lease, fn: Callable[[Mapping[str, Any]], Mapping[str, Any]]
) -> Callable[[Mapping[str, Any]], Mapping[str, Any]]:
    if not isinstance(lease, Lease):
        raise ConfigurationError(f"expected a Lease, not {type(lease).__name__}")
    if not lease.held or lease.mode != "write":
        raise ConfigurationError("fenced writes need a granted lease in write mode")

    def run(view: Mapping[str, Any]) -> Mapping[str, Any]:
        for name in lease.names:
            seen = view.get(fence_key(name), 0)
            if seen > lease.token:
                raise StaleTokenError(
                    f"token {lease.token} of lease {lease.id} on {name!r} is stale: the map has "
                    f"seen token {seen} (the lease was lost); nothing was written",
                    token=lease.token,
                    seen=seen,
                )
        changes = dict(fn(view))
        touched = sorted(key for key in changes if str(key).startswith(FENCE_PREFIX))
        if touched:
            raise ConfigurationError(f"fenced writes may not change fence keys {touched}")
        changes.update({fence_key(name): lease.token for name in lease.names})
        return changes

    return run


async def fenced_transact(
    shared: PulsarMap[str, Any],
    lease: Lease,
    fn: Callable[[Mapping[str, Any]], Mapping[str, Any]],
    *,
    timeout: float | None = None,
) -> int | None:
    """``shared.transact(fn)``, refused if ``lease``'s token is older than the map has seen.

    ``fn`` is as for :meth:`PulsarMap.transact` (it may run more than once; it must not change
    ``__fence__/`` keys). Returns the write's position, or None if nothing changed. Raises
    :class:`~recipes.StaleTokenError` (nothing written) when a newer holder of one of the
    lease's names has written to this map; ConfigurationError for a read or waiting lease.
    """
    return await shared.transact(_fenced(lease, fn), timeout=timeout)


async def claim(
    shared: PulsarMap[str, Any], lease: Lease, *, timeout: float | None = None
) -> int | None:
    """Record ``lease``'s token in ``shared`` so that older tokens are refused from now on."""
    return await fenced_transact(shared, lease, lambda view: {}, timeout=timeout)


def sync_fenced_transact(
    shared: SyncPulsarMap[str, Any],
    lease: Lease,
    fn: Callable[[Mapping[str, Any]], Mapping[str, Any]],
    *,
    timeout: float | None = None,
) -> int | None:
    """The blocking :func:`fenced_transact`, for a :class:`~recipes.SyncPulsarMap`."""
    return shared.transact(_fenced(lease, fn), timeout=timeout)
