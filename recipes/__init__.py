"""Recipes built on pulsar-state's public API only (as kazoo's recipes are on kazoo's).

* :class:`PulsarMap` / :class:`SyncPulsarMap`: a replicated key-value map (the PIP's recipe),
  with versions, compare-and-set and watches.
* :mod:`recipes.spark` (the ``spark`` extra): PySpark jobs sharing PulsarMaps. A layer above
  this one: import it explicitly; nothing here imports it.
"""

from ._map_ops import MapEntry, MapEvent, MapVersion
from ._map_sync import SyncMapWatch, SyncPulsarMap
from ._map_watch import MapWatch, WatchOverflowError
from .map import PulsarMap

__all__ = [
    "MapEntry",
    "MapEvent",
    "MapVersion",
    "MapWatch",
    "PulsarMap",
    "SyncMapWatch",
    "SyncPulsarMap",
    "WatchOverflowError",
]
