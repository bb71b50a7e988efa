"""Prometheus metrics for state managers (the ``prometheus`` extra: ``prometheus-client``).

::

    from pulsar_state.metrics import ManagerCollector, start_http_server

    collector = ManagerCollector()
    collector.add(manager)                 # a SharedStateManager, a PulsarMap, or a Sync one
    start_http_server(9464, collector)     # /metrics, in a daemon thread

Every sample is read from ``manager.stats`` and ``manager.halted`` when scraped, labelled with
the manager's ``topic`` and ``writer_id`` (one per manager instance). Counters only go up;
``position`` and ``halted`` are gauges. Nothing is sampled for a value that is unknown (no
snapshot loaded yet): no negative sentinel.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import start_http_server as _start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ._manager import SharedStateManager
from ._telemetry import GAUGES
from ._types import LatencyHistogram

__all__ = ["COUNTERS", "ManagerCollector", "start_http_server"]

# ManagerStats field -> (metric name without the _total suffix, help). Units in the names.
COUNTERS: dict[str, tuple[str, str]] = {
    "records_read": ("pulsar_state_records_read", "Records read from the state topic."),
    "bytes_read": ("pulsar_state_read_bytes", "Bytes of records read from the state topic."),
    "records_rejected": (
        "pulsar_state_records_rejected",
        "Records every replica ignores (a stale or fenced writer's).",
    ),
    "records_skipped": (
        "pulsar_state_records_skipped",
        "Corrupt records skipped (on_corrupt='skip').",
    ),
    "records_sent": ("pulsar_state_records_sent", "Records this manager sent as the writer."),
    "writes_committed": ("pulsar_state_writes_committed", "Writes of this manager committed."),
    "write_retries": ("pulsar_state_write_retries", "Write attempts retried."),
    "writer_acquisitions": (
        "pulsar_state_writer_acquisitions",
        "Times this manager took the exclusive writer.",
    ),
    "writer_fencings": (
        "pulsar_state_writer_fencings",
        "Times this manager took the writer by fencing its holder.",
    ),
    "writer_releases": (
        "pulsar_state_writer_releases",
        "Times this manager gave the writer up (idle, turn, failure, close).",
    ),
    "records_relayed": (
        "pulsar_state_records_relayed",
        "Records this manager relayed through the process holding the writer.",
    ),
    "relayed_appended": (
        "pulsar_state_relayed_appended",
        "Records of other processes this manager appended as the writer (in records_sent too).",
    ),
    "readers_replaced": (
        "pulsar_state_readers_replaced",
        "Times the writer's holder replaced its paused reader to skip its own records.",
    ),
    "snapshots_written": ("pulsar_state_snapshots_written", "Snapshots this manager wrote."),
    "history_trims": (
        "pulsar_state_history_trims",
        "Times this manager moved the trim point (trim_history).",
    ),
    "fell_forward": (
        "pulsar_state_fell_forward",
        "Times this replica, behind a trimmed log, loaded a snapshot.",
    ),
    "determinism_failures": (
        "pulsar_state_determinism_failures",
        "Snapshots whose digest differed from this replica's state.",
    ),
}

_LABELS = ["topic", "writer_id"]


def _manager_of(source: Any) -> SharedStateManager[Any, Any]:
    """The manager under a SharedStateManager, a (Sync)PulsarMap or a SyncSharedStateManager."""
    if isinstance(source, SharedStateManager):
        return source
    manager = getattr(source, "manager", None)
    if isinstance(manager, SharedStateManager):
        return manager
    raise TypeError(f"not a state manager or map: {type(source).__name__}")


class ManagerCollector:
    """A Prometheus collector over the stats of the managers added to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # scrapes run on the HTTP server's thread
        self._managers: list[SharedStateManager[Any, Any]] = []

    def add(self, source: Any) -> None:
        manager = _manager_of(source)
        with self._lock:
            self._managers.append(manager)

    def remove(self, source: Any) -> None:
        manager = _manager_of(source)
        with self._lock:
            self._managers.remove(manager)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            managers = list(self._managers)
        counters = {
            field: CounterMetricFamily(name, text, labels=_LABELS)
            for field, (name, text) in COUNTERS.items()
        }
        position = GaugeMetricFamily(
            "pulsar_state_position", "Records this replica has applied.", labels=_LABELS
        )
        halted = GaugeMetricFamily(
            "pulsar_state_halted", "1 when this replica stopped applying, else 0.", labels=_LABELS
        )
        snapshot = GaugeMetricFamily(
            "pulsar_state_snapshot_loaded_position",
            "The position of the snapshot this replica opened from (absent when none).",
            labels=_LABELS,
        )
        failed = CounterMetricFamily(
            "pulsar_state_writes_failed",
            "Writes of this manager that failed, by error class.",
            labels=[*_LABELS, "error"],
        )
        histograms = {
            "write_latency": HistogramMetricFamily(
                "pulsar_state_write_duration_seconds",
                "From a write's submission to its outcome (committed or failed).",
                labels=_LABELS,
            ),
            "apply_latency": HistogramMetricFamily(
                "pulsar_state_apply_duration_seconds",
                "Applying one accepted record to the replica's state.",
                labels=_LABELS,
            ),
        }
        # The OpenTelemetry gauges, under Prometheus names (units spelled out).
        gauges = {
            name: (
                GaugeMetricFamily(_prometheus_name(name, unit), text, labels=_LABELS),
                value,
            )
            for name, (unit, text, value) in GAUGES.items()
            if name != "pulsar_state.position"
        }
        for manager in managers:
            labels = [str(manager.topic), manager.writer_id]
            stats = manager.stats
            for field, family in counters.items():
                family.add_metric(labels, float(getattr(stats, field)))
            position.add_metric(labels, float(stats.position))
            halted.add_metric(labels, 0.0 if manager.halted is None else 1.0)
            if stats.snapshot_loaded_position is not None:
                snapshot.add_metric(labels, float(stats.snapshot_loaded_position))
            for error, count in sorted(stats.writes_failed.items()):
                failed.add_metric([*labels, error], float(count))
            for field, histogram_family in histograms.items():
                histogram: LatencyHistogram = getattr(stats, field)
                buckets = [
                    ("+Inf" if bound == float("inf") else repr(bound), float(count))
                    for bound, count in histogram.cumulative()
                ]
                histogram_family.add_metric(labels, buckets, histogram.sum_s)
            for gauge_family, value in gauges.values():
                current = value(stats)
                if current is not None:
                    gauge_family.add_metric(labels, current)
        yield from counters.values()
        yield from (position, halted, snapshot, failed)
        yield from histograms.values()
        yield from (gauge_family for gauge_family, _ in gauges.values())


def _prometheus_name(name: str, unit: str) -> str:
    base = name.replace(".", "_")
    suffix = {"s": "_seconds", "By": "_bytes"}.get(unit, "")
    return base if base.endswith(suffix) else base + suffix


def start_http_server(
    port: int, collector: ManagerCollector, *, addr: str = "127.0.0.1"
) -> tuple[Any, threading.Thread]:
    """Serve ``collector`` (alone) on ``http://addr:port/metrics`` from a daemon thread.

    Returns the server (``server.server_port`` is the port when ``port`` is 0) and its thread;
    ``server.shutdown()`` stops it.
    """
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    return _start_http_server(port, addr=addr, registry=registry)
