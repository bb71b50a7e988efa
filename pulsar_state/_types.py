"""The manager's public result types: what a write returns, what listeners and progress
callbacks receive, and the counters of ``manager.stats``.

Two kinds of "position" appear here and must not be confused: a *version* is a count of
accepted records (an ``int``: ``WriteResult.position``, ``ManagerStats.position``), a
:class:`LogPosition` is a message's place in the topic (ledger, entry). The public fields keep
their historical name ``position``; the code behind them says ``version``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from ._pulsar import LogPosition

__all__ = [
    "STATE_MACHINE_OPTIONS",
    "AppliedRecord",
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
    up to and including this write's record: pass it to ``wait_for`` on another replica to
    read your own writes there.
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
    """Progress of the bootstrap replay (``on_progress`` callback and INFO logs)."""

    records_read: int
    bytes_read: int
    records_total: int | None
    bytes_total: int | None
    elapsed_s: float
    done: bool
    snapshot_position: int | None = None  # the snapshot the replay started from, if any
    snapshot_bytes: int = 0


@dataclass(slots=True)
class ManagerStats:
    """Counters for monitoring. Read with ``manager.stats``."""

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


# The options that define a manager's state machine: a recipe that brings its own machine
# sets these itself and refuses them from its callers.
STATE_MACHINE_OPTIONS = frozenset(
    {"initial_state", "apply", "codec", "copy_state", "trial_state", "begin_record"}
)
