"""PySpark integration: PulsarMaps from drivers and executors, shared config, DataFrames, a sink.

Install with the ``spark`` extra (PySpark 4.x). The pieces, built on
:class:`recipes.PulsarMap` and the lease recipes:

* :class:`MapSpec`: what to connect to (service URL, topic, admin URL, codecs, options). A spec
  pickles; a live client never does. :func:`get_map` (or ``spec.open()``) turns it into the
  process's own open :class:`recipes.SyncPulsarMap`, cached per process: one per spec in the
  driver, one per spec in each Python worker, whatever the number of tasks.
* :class:`SharedConfig`: a typed config (a dataclass) kept in a map; a batch job reads it at
  start, a streaming job re-reads it at the start of every micro-batch
  (:meth:`SharedConfig.foreach_batch`), and any process may change it with
  :meth:`SharedConfig.update`.
* :func:`map_dataframe`: a consistent snapshot of a map as a DataFrame.
* :class:`QueryLeader`: one running instance of a streaming query among any number of drivers
  (a leader election; the query stops when its driver stops leading), and
  :func:`join_membership`: executors' Python workers join a group the driver can list.
* :class:`PulsarMapSink`: an exactly-once ``foreachBatch`` sink. Each micro-batch is ONE atomic
  write that carries the sink's id and the batch id; the map refuses a batch id it already
  holds, so a query restarted from its checkpoint never applies a batch twice.

The ``pulsar-state`` data source (:mod:`recipes.spark.datasource`, which imports PySpark;
``register(spark)`` then ``spark.read/readStream/writeStream.format("pulsar-state")``) offers
the same maps through Spark's own reader and writer protocols: a map as a table at one log
position, its change feed as a stream, and an exactly-once streaming writer (one atomic write
per micro-batch, made by the driver's commit with the :class:`PulsarMapSink` marker). The
``foreachBatch`` sink, :func:`map_dataframe` and :class:`SharedConfig` stay as the
alternative for code that already has a DataFrame or a ``foreachBatch`` in hand.

Fork safety: pulsar-client and the portal's event-loop thread do not survive ``fork`` (PySpark
forks its Python workers). The cache is keyed by process: a forked child drops the entries it
inherited, without closing them (closing would act on the parent's connections), and opens its
own. Maps still cached at interpreter exit are closed (``atexit``).

This package sits above :mod:`recipes` and uses only the public APIs of ``pulsar_state`` and of
:class:`recipes.PulsarMap`; nothing below imports it (the ``layers`` contract of import-linter,
run by CI, checks it). Importing it does not import PySpark.
"""

from ._config import SharedConfig
from ._dataframe import map_dataframe
from ._leases import QueryLeader, QueryRunningError, join_membership
from ._sink import (
    SINK_MARKER_PREFIX,
    PulsarMapSink,
    SinkMode,
    SinkOwnedByAnotherQueryError,
    SinkResult,
)
from ._specs import MapSpec, close_maps, get_map

__all__ = [
    "SINK_MARKER_PREFIX",
    "MapSpec",
    "PulsarMapSink",
    "QueryLeader",
    "QueryRunningError",
    "SharedConfig",
    "SinkMode",
    "SinkOwnedByAnotherQueryError",
    "SinkResult",
    "close_maps",
    "get_map",
    "join_membership",
    "map_dataframe",
]
