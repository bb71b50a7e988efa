"""Specs and the per-process cache: which map to reach, and this process's open copy of it.

Fork safety: see the package's doc; the cache below is keyed by process for it.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import logging
import os
import pickle
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from pulsar_state import BlockingPortal, ClosedError, Codec, ConfigurationError, ReplicaHaltedError
from recipes import PulsarMap, SyncPulsarMap

__all__ = ["MapSpec", "close_maps", "get_map"]

# Under the library's logger tree (README: Logging), as before the move into recipes.
logger = logging.getLogger("pulsar_state.spark")

# Options a spec cannot carry: the map sets the first ones, and the cache supplies the portal.
_RESERVED_OPTIONS = PulsarMap.reserved_options | {"portal", "admin_url"}


@dataclass(frozen=True)
class MapSpec:
    """How to reach one PulsarMap: picklable, so it can travel to Spark executors.

    Args:
        service_url: the broker's service URL (``pulsar://host:6650``).
        topic: the map's topic.
        admin_url: the broker's admin REST URL (default derived from the service URL).
        key_codec / value_codec: the map's codecs (default: str keys, JSON values). They
            travel with the spec, so they must pickle.
        options: other :class:`~pulsar_state.SharedStateManager` options (timeouts,
            ``max_record_bytes``, ``name``...). They must pickle too.

    Two specs with equal fields name the same cached map in a process (see :func:`get_map`).
    A spec that cannot be pickled is refused here, not on an executor.
    """

    service_url: str
    topic: str
    admin_url: str | None = None
    key_codec: Codec[Any] | None = None
    value_codec: Codec[Any] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.service_url, str) or not self.service_url:
            raise ConfigurationError("service_url must be a service URL string (a spec pickles)")
        if not isinstance(self.topic, str) or not self.topic:
            raise ConfigurationError("topic must be a non-empty string")
        reserved = sorted(_RESERVED_OPTIONS & set(self.options))
        if reserved:
            raise ConfigurationError(f"a MapSpec cannot carry {', '.join(reserved)} in options")
        object.__setattr__(self, "options", dict(self.options))
        try:
            identity = pickle.dumps(
                (
                    self.service_url,
                    self.topic,
                    self.admin_url,
                    self.key_codec,
                    self.value_codec,
                    sorted(self.options.items()),
                ),
                protocol=5,
            )
        except Exception as exc:
            raise ConfigurationError(f"a MapSpec must pickle (codecs and options): {exc}") from exc
        # Equal specs pickle to equal bytes: the cache key, stable across processes.
        object.__setattr__(self, "_key", hashlib.sha256(identity).hexdigest())

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MapSpec) and other.key == self.key

    @property
    def key(self) -> str:
        """A digest of every field: equal specs have equal keys (in any process)."""
        return str(self.__dict__["_key"])

    def with_options(self, **options: Any) -> MapSpec:
        """This spec with more (or other) manager options."""
        return dataclasses.replace(self, options={**self.options, **options})

    def open(self, *, timeout: float | None = None) -> SyncPulsarMap[Any, Any]:
        """This process's cached, open map for this spec (see :func:`get_map`)."""
        return get_map(self, timeout=timeout)

    def new_map(self, *, portal: BlockingPortal | None = None) -> SyncPulsarMap[Any, Any]:
        """A new, unopened, uncached map for this spec (the caller opens and closes it)."""
        return SyncPulsarMap(
            self.service_url,
            self.topic,
            key_codec=self.key_codec,
            value_codec=self.value_codec,
            portal=portal,
            admin_url=self.admin_url,
            **self.options,
        )

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SPEC_FIELDS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.__post_init__()


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(MapSpec))


# ---------------------------------------------------------------------------------- the cache


class _Closable(Protocol):
    def close(self) -> None: ...


R = TypeVar("R", bound=_Closable)


class _Cache:
    """This process's open maps, one per spec, sharing one portal (one event-loop thread)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        # Guards the dicts only, never held during I/O: opening one map (a replay that may
        # take minutes) must not hold up the callers of the others.
        self.lock = threading.Lock()
        self.maps: dict[str, SyncPulsarMap[Any, Any]] = {}
        # One per spec (or resource key): the first caller opens it, the others wait for it.
        self.opening: dict[str, threading.Lock] = {}
        self.resources: dict[str, _Closable] = {}  # see cached_resource
        self.portal: BlockingPortal | None = None


_cache = _Cache()
# What a forked child inherited: never used, never closed. Kept referenced so that no
# finalizer of the parent's client runs in the child while it lives.
_inherited: list[_Cache] = []


def _after_fork_in_child() -> None:
    global _cache
    # The parent's lock may have been held by another thread at fork: replace it too.
    _inherited.append(_cache)
    _cache = _Cache()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _current_cache() -> _Cache:
    # register_at_fork covers os.fork(); the pid check also covers a fork that bypassed it.
    if _cache.pid != os.getpid():
        _after_fork_in_child()
    return _cache


def get_map(spec: MapSpec, *, timeout: float | None = None) -> SyncPulsarMap[Any, Any]:
    """The open map for ``spec`` in this process, opened (replayed) on first use and cached.

    Safe from any thread; the first call for a spec opens the map (up to ``timeout``, default
    the spec's ``open_timeout_s``), later calls return the same object. In a forked child
    (a PySpark worker), the maps inherited from the parent are ignored and the child opens its
    own. Do not close the returned map yourself: :func:`close_maps` does (and runs at exit);
    a cached map found closed is replaced by a new one.
    """
    cache = _current_cache()
    with cache.lock:
        cached = _usable(cache, spec)
        if cached is not None:
            return cached
        opening = cache.opening.setdefault(spec.key, threading.Lock())
    with opening:
        with cache.lock:
            cached = _usable(cache, spec)  # opened by another thread meanwhile
            if cached is not None:
                return cached
            portal = _portal_locked(cache)
        new = spec.new_map(portal=portal)
        try:
            new.open(timeout=timeout)
        except BaseException:
            _close_quietly(new)
            raise
        with cache.lock:
            cache.maps[spec.key] = new
        return new


def _usable(cache: _Cache, spec: MapSpec) -> SyncPulsarMap[Any, Any] | None:
    """The cached map for ``spec`` if it can still serve; a closed or halted one is dropped
    (closed, for a halted one) so that the caller opens a new one."""
    cached = cache.maps.get(spec.key)
    if cached is None:
        return None
    try:
        len(cached)  # local, no I/O; raises if someone closed it or the replica halted
        return cached
    except ClosedError:
        pass
    except ReplicaHaltedError as exc:
        # A new map replays the topic: a lasting cause (a corrupt record...) halts it again
        # at open, loudly; a passing one is over.
        logger.error("the cached map on %s halted (%s); opening a new one", spec.topic, exc)
        _close_quietly(cached)
    del cache.maps[spec.key]
    return None


def _portal_locked(cache: _Cache) -> BlockingPortal:
    if cache.portal is None:
        cache.portal = BlockingPortal(name="pulsar-state-spark")
    return cache.portal


def cached_resource(
    key: str,
    open_new: Callable[[BlockingPortal], R],
    usable: Callable[[R], bool] = lambda _resource: True,
) -> R:
    """This process's resource under ``key``, made by ``open_new(portal)`` on first use (on
    the portal the cached maps share). Cached like the maps: forgotten in a forked child,
    closed by :func:`close_maps`. One that is no longer ``usable`` (closed, or its replica
    halted) is closed and replaced by a new one, as a cached map is."""
    cache = _current_cache()
    with cache.lock:
        found = _take_usable(cache, key, usable)
        if found is not None:
            return found
        opening = cache.opening.setdefault(f"resource:{key}", threading.Lock())
    with opening:  # not the cache's lock: opening one (a replay) must not hold up the others
        with cache.lock:
            found = _take_usable(cache, key, usable)
            if found is not None:
                return found
            portal = _portal_locked(cache)
        new = open_new(portal)
        with cache.lock:
            cache.resources[key] = new
        return new


def _take_usable(cache: _Cache, key: str, usable: Callable[[R], bool]) -> R | None:
    """The cached resource under ``key`` if usable; one that is not is dropped and closed in
    another thread (never under the cache's lock: closing does I/O)."""
    found = cast("R | None", cache.resources.get(key))
    if found is None or usable(found):
        return found
    logger.warning("the cached %r can no longer serve: opening a new one", found)
    del cache.resources[key]
    threading.Thread(target=_close_resource, args=(found,), daemon=True).start()
    return None


def _close_resource(resource: _Closable) -> None:
    try:
        resource.close()
    except Exception as exc:  # best effort: it is broken already
        logger.warning("closing %r failed: %s", resource, exc)


def _close_quietly(m: SyncPulsarMap[Any, Any]) -> None:
    try:
        m.close()
    except Exception as exc:  # closing is best effort: the process is done with it
        logger.warning("closing the map on %s failed: %s", m.topic, exc)


def close_maps() -> None:
    """Close every map this process cached (and their portal). Runs at interpreter exit."""
    cache = _current_cache()
    with cache.lock:
        maps, cache.maps = list(cache.maps.values()), {}
        resources, cache.resources = list(cache.resources.values()), {}
        portal, cache.portal = cache.portal, None
    for resource in resources:
        try:
            resource.close()
        except Exception as exc:  # best effort, as for the maps
            logger.warning("closing %r failed: %s", resource, exc)
    for m in maps:
        _close_quietly(m)
    if portal is not None:
        portal.stop()


atexit.register(close_maps)
