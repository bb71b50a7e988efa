"""Recipes built on pulsar-state's public API only (as kazoo's recipes are on kazoo's).

* :class:`PulsarMap` / :class:`SyncPulsarMap`: a replicated key-value map (the PIP's recipe),
  with versions, compare-and-set and watches.
* :class:`Ownership` / :class:`SyncOwnership`: named resources held in read or write mode,
  taken atomically, with leases decided from the log and fencing tokens;
  :func:`fenced_transact` makes a PulsarMap write conditional on a token.
* :class:`LeaderElection` / :class:`SyncLeaderElection`, :class:`Membership` /
  :class:`SyncMembership` (on Ownership) and :class:`Counter` / :class:`SyncCounter`.
* :mod:`recipes.spark` (the ``spark`` extra): PySpark jobs sharing PulsarMaps. A layer above
  this one: import it explicitly; nothing here imports it.
"""

from ._lease_sync import SyncEventStream, SyncLeaderElection, SyncMembership
from ._lease_table import (
    Lease,
    LeaseEvent,
    LeaseTableCodec,
    NotHeldError,
    StaleTokenError,
    UnknownResourceError,
    WaitCancelledError,
)
from ._map_disk import DiskStore, LocalStoreError
from ._map_ops import FrozenDict, FrozenList, MapEntry, MapEvent, MapVersion, thaw
from ._map_sync import SyncMapWatch, SyncPulsarMap
from ._map_watch import MapWatch, WatchOverflowError
from ._ownership_sync import SyncOwnership
from ._streams import EventStream
from .counter import Counter, SyncCounter
from .election import Leader, LeaderElection
from .fencing import claim, fence_key, fenced_transact, sync_fenced_transact
from .map import PulsarMap
from .membership import MemberEvent, Membership
from .ownership import Ownership

__all__ = [
    "Counter",
    "DiskStore",
    "EventStream",
    "FrozenDict",
    "FrozenList",
    "Leader",
    "LeaderElection",
    "Lease",
    "LeaseEvent",
    "LeaseTableCodec",
    "LocalStoreError",
    "MapEntry",
    "MapEvent",
    "MapVersion",
    "MapWatch",
    "MemberEvent",
    "Membership",
    "NotHeldError",
    "Ownership",
    "PulsarMap",
    "StaleTokenError",
    "SyncCounter",
    "SyncEventStream",
    "SyncLeaderElection",
    "SyncMapWatch",
    "SyncMembership",
    "SyncOwnership",
    "SyncPulsarMap",
    "UnknownResourceError",
    "WaitCancelledError",
    "WatchOverflowError",
    "claim",
    "fence_key",
    "fenced_transact",
    "sync_fenced_transact",
    "thaw",
]

# Public objects report the public package (``recipes.MapVersion``, not
# ``recipes._map_ops.MapVersion``) in reprs, tracebacks and docs, as pulsar_state's do.
for _name in __all__:
    if hasattr(globals()[_name], "__module__"):
        globals()[_name].__module__ = __name__
del _name
