"""Fenced writes: make a PulsarMap write conditional on a lease's fencing token.

:Status: Experimental. Built on the public APIs of ``PulsarMap`` and ``Ownership``.

The map itself remembers, per resource name, the largest fencing token any fenced write has
carried (under the key ``fence_key(name)``). :func:`fenced_transact` runs ``fn`` and writes its
changes together with the lease's token, in ONE atomic write decided on the up-to-date map
(``PulsarMap.transact``): if the map has already seen a larger token for one of the lease's
names, the write is refused with :class:`~recipes.StaleTokenError` and nothing is written.
Because the decision is made on the up-to-date map, and a record computed on a stale map is
ignored by every replica (whoever appends it: the writer's holder or the write relay), no
replica ever applies a fenced write from a holder whose lease was taken over and who has
been fenced out.

The fences are map keys under :data:`FENCE_PREFIX`, protected as the Spark sink's markers
are: ``clear()`` keeps them and ``update_multiple()`` never visits them, and fenced writes
may not change them. Only writes through this module are fenced: a plain ``put`` by a
holder that lost its lease is not checked, and ``put``/``delete`` naming a fence key change
it (to reset the fences of a lock table whose topic was recreated, whose tokens start again
at 1, delete them so).

This is the classic fencing-token scheme: the map refuses a token once it has seen a larger
one. A new holder closes the window right after acquiring by calling :func:`claim` (a fenced
write of nothing but its token); from then on the previous holder is refused everywhere,
even if it was frozen while the lease changed hands and still believes it holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pulsar_state import CodecError, ConfigurationError

from ._lease_table import Lease, StaleTokenError
from ._map_sync import SyncPulsarMap
from .map import FENCE_PREFIX, PulsarMap

__all__ = ["FENCE_PREFIX", "claim", "fence_key", "fenced_transact", "sync_fenced_transact"]


def fence_key(name: str) -> str:
    """The map key holding the largest token seen for resource ``name``."""
    return FENCE_PREFIX + name


def _check_lease(lease: Lease) -> None:
    # Lease is a plain public dataclass: one built by hand must not fence nothing, or fence
    # "d" and "b" for names="db".
    if not isinstance(lease, Lease):
        raise ConfigurationError(f"expected a Lease, not {type(lease).__name__}")
    token = lease.token
    if isinstance(token, bool) or not isinstance(token, int):
        raise ConfigurationError(f"lease {lease.id} has no fencing token: {token!r}")
    if not lease.held or lease.mode != "write":
        raise ConfigurationError("fenced writes need a granted lease in write mode")
    names = lease.names
    if (
        not isinstance(names, tuple)
        or not names
        or not all(isinstance(name, str) and name for name in names)
    ):
        raise ConfigurationError(
            f"lease {lease.id} names no resources to fence: {names!r} (a non-empty tuple of "
            "non-empty str is needed)"
        )


def _fenced(
    shared: PulsarMap[Any, Any],
    lease: Lease,
    fn: Callable[[Mapping[str, Any]], Mapping[str, Any]],
) -> Callable[[Mapping[str, Any]], Mapping[str, Any]]:
    if not isinstance(shared, PulsarMap):
        raise ConfigurationError(
            f"expected a PulsarMap, not {type(shared).__name__} (a SyncPulsarMap takes "
            "sync_fenced_transact)"
        )
    _check_lease(lease)
    # The fence keys as the map stores them (its key codec may normalise them): the check
    # and the write must name the very keys the map holds. The codecs are the map's own
    # (same package), so nothing is normalised twice or differently.
    codecs = shared._codecs
    try:
        fences = [(name, codecs.key(fence_key(name))[0]) for name in lease.names]
        stored = codecs.value(lease.token)[0]
    except CodecError as exc:
        raise ConfigurationError(
            f"this map cannot hold fencing tokens (str keys {FENCE_PREFIX!r}..., int values): {exc}"
        ) from exc
    if type(stored) is not int or stored != lease.token:
        raise ConfigurationError(
            f"this map cannot hold fencing tokens: its value codec stores {lease.token!r} as "
            f"{stored!r}"
        )

    def is_fence(key: Any) -> bool:
        norm = codecs.key(key)[0]  # (a bad key raises CodecError, as transact would)
        return isinstance(norm, str) and norm.startswith(FENCE_PREFIX)

    def run(view: Mapping[str, Any]) -> Mapping[str, Any]:
        for name, key in fences:
            seen = view.get(key, 0)
            if type(seen) is not int:
                raise ConfigurationError(
                    f"fence key {key!r} holds {seen!r}, not a fencing token (changed by "
                    "hand?); nothing was written"
                )
            if seen > lease.token:
                raise StaleTokenError(
                    f"token {lease.token} of lease {lease.id} on {name!r} is stale: the map has "
                    f"seen token {seen} (the lease was lost); nothing was written",
                    token=lease.token,
                    seen=seen,
                )
        changes = dict(fn(view))
        touched = sorted(repr(key) for key in changes if is_fence(key))
        if touched:
            raise ConfigurationError(f"fenced writes may not change fence keys {touched}")
        changes.update({key: lease.token for _, key in fences})
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
    run = _fenced(shared, lease, fn)  # (first: it checks that ``shared`` is a PulsarMap)
    return await shared.transact(run, timeout=timeout)


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
    if not isinstance(shared, SyncPulsarMap):
        raise ConfigurationError(
            f"expected a SyncPulsarMap, not {type(shared).__name__} (a PulsarMap takes "
            "fenced_transact)"
        )
    return shared.transact(_fenced(shared.async_map, lease, fn), timeout=timeout)
