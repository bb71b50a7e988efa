"""The manager's public result types: what a write returns, what listeners and progress
callbacks receive, and the counters of ``manager.stats``.

Two kinds of "position" appear here and must not be confused: a *version* is a count of
accepted records (an ``int``: ``WriteResult.position``, ``ManagerStats.position``), a
:class:`LogPosition` is a message's place in the topic (ledger, entry). The public fields keep
their historical name ``position``; the code behind them says ``version``.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from ._pulsar import LogPosition

__all__ = [
    "LATENCY_BUCKETS_S",
    "STATE_MACHINE_OPTIONS",
    "AppliedRecord",
    "LatencyHistogram",
    "ManagerStats",
    "OnCorrupt",
    "ReplayProgress",
    "WriteResult",
]

Op = TypeVar("Op")
T = TypeVar("T")

OnCorrupt = Literal["halt", "skip"]


@dataclass(frozen=True, slots=True)
class WriteResult(Generic[T]):
    """What a committed write returns.

    ``value`` is the ``reader``'s result on the state right after this write's ops were
    applied (from the attempt that committed). ``position`` is the number of records accepted
    up to and including this write's record (for a write with no ops, which appends
    nothing: the position of the state it was decided on): pass it to ``wait_for`` on another
    replica to read your own writes there.
    """

    value: T
    position: int


@dataclass(frozen=True, slots=True)
class AppliedRecord(Generic[Op]):
    """A record as applied by the pump; handed to listeners (see ``add_listener``)."""

    position: int
    record_id: str
    log_position: LogPosition
    writes: list[list[Op]]


@dataclass(frozen=True, slots=True)
class ReplayProgress:
    """Progress of opening (``on_progress`` callback and INFO logs): loading a snapshot
    (``loading_snapshot``, every few seconds of a long load: ``snapshot_bytes_loaded`` of
    ``snapshot_bytes``), then replaying the log after it."""

    records_read: int
    bytes_read: int
    records_total: int | None
    bytes_total: int | None
    elapsed_s: float
    done: bool
    snapshot_position: int | None = None  # the snapshot the replay started from, if any
    snapshot_bytes: int = 0
    loading_snapshot: bool = False  # still loading it: no record replayed yet
    snapshot_bytes_loaded: int = 0


# Upper bounds, in seconds, of the latency histograms' buckets (Prometheus' defaults, plus
# sub-millisecond ones: a local write or apply takes well under a millisecond).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


@dataclass(slots=True)
class LatencyHistogram:
    """Durations in seconds, counted in :data:`LATENCY_BUCKETS_S` (plus one for larger)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    sum_s: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` per bucket, the last bound ``inf``."""
        bounds = [*LATENCY_BUCKETS_S, math.inf]
        return list(zip(bounds, itertools.accumulate(self.counts), strict=True))


@dataclass(slots=True)
class ManagerStats:
    """Counters and gauges for monitoring. Read with ``manager.stats``; exported by
    :mod:`pulsar_state.metrics` (Prometheus) and through OpenTelemetry's API.

    Counters only go up. A gauge that is not known yet (no snapshot written, no tail
    captured) is None, never a sentinel.
    """

    position: int = 0
    records_read: int = 0
    bytes_read: int = 0
    records_rejected: int = 0
    records_skipped: int = 0
    records_sent: int = 0
    writes_committed: int = 0
    write_retries: int = 0
    writer_acquisitions: int = 0
    snapshots_written: int = 0
    snapshot_loaded_position: int | None = None
    determinism_failures: int = 0
    # Writes of this manager that failed, by error class name (e.g. OperationTimeoutError).
    writes_failed: dict[str, int] = field(default_factory=dict)
    # Times this manager took the writer by fencing its holder, and gave the writer up.
    writer_fencings: int = 0
    writer_releases: int = 0
    # Records this manager relayed through the writer's holder, and appended for others (as
    # the writer: those count in records_sent too).
    records_relayed: int = 0
    relayed_appended: int = 0
    # Times the reader of this manager, paused as the writer's holder, was replaced to skip
    # the holder's own records it left unread (instead of reading them back).
    readers_replaced: int = 0
    # From submit to outcome, per write of this manager; per record applied by the replica.
    write_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    apply_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    # The newest snapshot this manager wrote: when (Unix time), how big, how long it took.
    snapshot_written_at: float | None = None
    snapshot_size_bytes: int | None = None
    snapshot_duration_s: float | None = None
    # At the newest tail capture (latest read, sync, writer catch-up): how many records this
    # replica was behind, and how long it took to reach the tail.
    tail_lag_records: int | None = None
    tail_lag_seconds: float | None = None
    # The opening replay: the share of its records read (1.0 once open; None while the
    # number of records to read is not known).
    replay_progress: float | None = None
    history_trims: int = 0  # times this manager moved the trim point (trim_history)
    fell_forward: int = 0  # times this replica, behind a trimmed log, loaded a snapshot
    # The position a durable state (``durable_state=``) resumed from at open; None if it did
    # not (nothing stored, or refused and rebuilt).
    resumed_position: int | None = None


# The options that define a manager's state machine: a recipe that brings its own machine
# sets these itself and refuses them from its callers.
STATE_MACHINE_OPTIONS = frozenset(
    {
        "initial_state",
        "apply",
        "codec",
        "copy_state",
        "trial_state",
        "adopt_trial",
        "begin_record",
        "durable_state",
    }
)
