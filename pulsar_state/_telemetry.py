"""Metrics through OpenTelemetry's API: a no-op until the application installs an SDK.

The library depends on ``opentelemetry-api`` only (the Python convention, and where Pulsar's
Java client went, PIP-342). Every open manager is observed: its ``manager.stats`` counters and
gauges are read when the SDK collects (observable instruments), and write and apply durations
are recorded as they happen (histograms, also kept in ``stats`` for :mod:`pulsar_state.metrics`).
Attributes: ``topic`` and ``writer_id`` (one per manager instance).

Names follow OpenTelemetry's conventions (``pulsar_state.records.read``, unit ``{record}``);
a Prometheus exporter of the SDK turns them into ``pulsar_state_records_read_total``.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from ._types import ManagerStats


class Observed(Protocol):
    """What is read of a manager (not imported here: the manager imports this module)."""

    @property
    def topic(self) -> Any: ...

    @property
    def writer_id(self) -> str: ...

    @property
    def stats(self) -> ManagerStats: ...

    @property
    def halted(self) -> Any: ...


__all__ = ["COUNTERS", "GAUGES", "observe_apply", "observe_write", "track", "untrack"]

_meter = metrics.get_meter("pulsar_state")

_WRITE_DURATION = _meter.create_histogram(
    "pulsar_state.write.duration",
    unit="s",
    description="From a write's submission to its outcome (committed or failed).",
)
_APPLY_DURATION = _meter.create_histogram(
    "pulsar_state.apply.duration",
    unit="s",
    description="Applying one accepted record to the replica's state.",
)

# ManagerStats field -> (instrument name, unit, description): monotonic counters.
COUNTERS: dict[str, tuple[str, str, str]] = {
    "records_read": ("pulsar_state.records.read", "{record}", "Records read from the topic."),
    "bytes_read": ("pulsar_state.read", "By", "Bytes of records read from the topic."),
    "records_rejected": (
        "pulsar_state.records.rejected",
        "{record}",
        "Records every replica ignores (a stale or fenced writer's).",
    ),
    "records_skipped": (
        "pulsar_state.records.skipped",
        "{record}",
        "Corrupt records skipped (on_corrupt='skip').",
    ),
    "records_sent": ("pulsar_state.records.sent", "{record}", "Records sent as the writer."),
    "writes_committed": ("pulsar_state.writes.committed", "{write}", "Writes committed."),
    "write_retries": ("pulsar_state.writes.retried", "{write}", "Write attempts retried."),
    "writer_acquisitions": (
        "pulsar_state.writer.acquisitions",
        "{acquisition}",
        "Times this manager took the exclusive writer.",
    ),
    "writer_fencings": (
        "pulsar_state.writer.fencings",
        "{fencing}",
        "Times this manager took the writer by fencing its holder.",
    ),
    "writer_releases": (
        "pulsar_state.writer.releases",
        "{release}",
        "Times this manager gave the writer up (idle, turn, failure, close).",
    ),
    "records_relayed": (
        "pulsar_state.records.relayed",
        "{record}",
        "Records relayed through the process holding the writer.",
    ),
    "relayed_appended": (
        "pulsar_state.relayed.appended",
        "{record}",
        "Records of other processes appended as the writer (in records.sent too).",
    ),
    "snapshots_written": ("pulsar_state.snapshots.written", "{snapshot}", "Snapshots written."),
    "history_trims": (
        "pulsar_state.history.trims",
        "{trim}",
        "Times this manager moved the trim point (trim_history).",
    ),
    "fell_forward": (
        "pulsar_state.fell_forward",
        "{load}",
        "Times this replica, behind a trimmed log, loaded a snapshot.",
    ),
    "determinism_failures": (
        "pulsar_state.determinism_failures",
        "{snapshot}",
        "Snapshots whose digest differed from this replica's state.",
    ),
}

# Gauges: name -> (unit, description, value from stats or None when unknown).
GAUGES: dict[str, tuple[str, str, Callable[[ManagerStats], float | None]]] = {
    "pulsar_state.position": (
        "{record}",
        "Records this replica has applied.",
        lambda s: float(s.position),
    ),
    "pulsar_state.tail_lag.records": (
        "{record}",
        "Records this replica was behind at its newest tail capture.",
        lambda s: None if s.tail_lag_records is None else float(s.tail_lag_records),
    ),
    "pulsar_state.tail_lag.duration": (
        "s",
        "How long this replica took to reach the tail at its newest tail capture.",
        lambda s: s.tail_lag_seconds,
    ),
    "pulsar_state.replay.progress": (
        "1",
        "Share of the opening replay's records read (1 once open).",
        lambda s: s.replay_progress,
    ),
    "pulsar_state.snapshot.age": (
        "s",
        "Seconds since this manager wrote its newest snapshot.",
        lambda s: None if s.snapshot_written_at is None else time.time() - s.snapshot_written_at,
    ),
    "pulsar_state.snapshot.size": (
        "By",
        "Size of the newest snapshot this manager wrote.",
        lambda s: None if s.snapshot_size_bytes is None else float(s.snapshot_size_bytes),
    ),
    "pulsar_state.snapshot.duration": (
        "s",
        "How long writing the newest snapshot took.",
        lambda s: s.snapshot_duration_s,
    ),
}

_lock = threading.Lock()  # the SDK collects on a thread of its own
_tracked: weakref.WeakSet[Observed] = weakref.WeakSet()


def track(manager: Observed) -> None:
    """Observe ``manager`` (from its open until :func:`untrack`)."""
    with _lock:
        _tracked.add(manager)


def untrack(manager: Observed) -> None:
    with _lock:
        _tracked.discard(manager)


def _attributes(manager: Observed) -> dict[str, str]:
    return {"topic": str(manager.topic), "writer_id": manager.writer_id}


def _observed() -> list[tuple[dict[str, str], ManagerStats, bool]]:
    with _lock:
        managers = list(_tracked)
    return [(_attributes(m), m.stats, m.halted is not None) for m in managers]


def _counter_callback(field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(getattr(stats, field), attrs) for attrs, stats, _ in _observed()]

    return observe


def _gauge_callback(
    value: Callable[[ManagerStats], float | None],
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(_: CallbackOptions) -> Iterable[Observation]:
        observed = []
        for attrs, stats, _halted in _observed():
            current = value(stats)
            if current is not None:  # unknown: no sample, never a sentinel
                observed.append(Observation(current, attrs))
        return observed

    return observe


def _failures(_: CallbackOptions) -> Iterable[Observation]:
    return [
        Observation(count, {**attrs, "error": error})
        for attrs, stats, _ in _observed()
        for error, count in sorted(stats.writes_failed.items())
    ]


def _halted(_: CallbackOptions) -> Iterable[Observation]:
    return [Observation(1 if halted else 0, attrs) for attrs, _, halted in _observed()]


for _field, (_name, _unit, _text) in COUNTERS.items():
    _meter.create_observable_counter(
        _name, callbacks=[_counter_callback(_field)], unit=_unit, description=_text
    )
for _name, (_unit, _text, _value) in GAUGES.items():
    _meter.create_observable_gauge(
        _name, callbacks=[_gauge_callback(_value)], unit=_unit, description=_text
    )
_meter.create_observable_counter(
    "pulsar_state.writes.failed",
    callbacks=[_failures],
    unit="{write}",
    description="Writes that failed, by error class.",
)
_meter.create_observable_gauge(
    "pulsar_state.halted",
    callbacks=[_halted],
    unit="1",
    description="1 when this replica stopped applying, else 0.",
)


def observe_write(
    stats: ManagerStats, attributes: dict[str, str], seconds: float, error: str | None
) -> None:
    """A write of this manager has its outcome (``error``: its class name, None: committed)."""
    stats.write_latency.observe(seconds)
    if error is not None:
        stats.writes_failed[error] = stats.writes_failed.get(error, 0) + 1
    _WRITE_DURATION.record(seconds, {**attributes, "outcome": error or "committed"})


def observe_apply(stats: ManagerStats, attributes: dict[str, str], seconds: float) -> None:
    stats.apply_latency.observe(seconds)
    _APPLY_DURATION.record(seconds, attributes)
