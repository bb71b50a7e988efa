"""A state that keeps itself on durable storage together with the log position it reflects.

The manager's ``durable_state=`` hook. Such a state (a PulsarMap on a local disk store, say)
commits each accepted record's changes *and* that record's :class:`LogMark` in one atomic step
of its own storage, so a process killed at any instant reopens to exactly one record boundary.
Opening then starts from the stored mark, as it would from a snapshot: the mark is checked
against the topic as it is now (the covered message must be at its position with the same
record, as for a snapshot's manifest), the reader starts right after it, and only the tail is
replayed. A state with nothing stored starts as usual (from the newest snapshot, if any, which
it is then asked to store, or from the empty state).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ._pulsar import LogPosition

__all__ = ["DurableState", "LogMark"]

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class LogMark:
    """Where a state stands in its log: ``position`` records accepted (the version), the
    last accepted record's id, and the message it was read at (``log_position``). A record's
    id and its message's place identify one history of the topic: a topic deleted and created
    again under the same name has neither. ``origin``: the id of the history's first record
    (None when not known): it still names the history once the log's beginning, and the
    mark's own message, were trimmed away (``trim_history``)."""

    position: int
    record_id: str
    log_position: LogPosition
    origin: str | None = None
    # The records ignored as stale before the mark's record that may still have a record
    # built on them, each with the position it claimed: one built on it there is stale too
    # (a writer's pipelined chain). A replica resuming after the mark does not read them
    # again, so the mark names them: a store must keep them with the rest (usually none).
    stale: tuple[tuple[str, int], ...] = ()


class DurableState(Protocol[S]):
    """What the manager asks of a state that carries its own durable position.

    Every method runs on the event loop's thread except :meth:`load_snapshot`, which runs in
    a worker thread (it may be long) while the pump is stopped. An exception from
    :meth:`commit` halts the replica (nothing of the record is taken as applied); from the
    others, it fails the open (or the fall-forward) with that exception.
    """

    def stored_mark(self, state: S) -> LogMark | None:
        """The mark the stored state is at; None when nothing is stored (a new store).
        Every field as committed, ``stale`` included: a replica resumed with fewer stale
        records than the mark named may halt as forked where the others ignore a record."""
        ...

    def commit(self, state: S, mark: LogMark) -> None:
        """Make the changes ``apply`` made for the record at ``mark`` durable, with ``mark``,
        in one atomic step. Called once per accepted record, after its ops, in log order."""
        ...

    def load_snapshot(self, state: S, chunks: Iterable[bytes], mark: LogMark) -> S:
        """Replace everything stored by the snapshot at ``mark``, whose bytes (the
        ``snapshot_codec``'s) are ``chunks`` joined; returns the state to use from now on
        (``state`` itself or a new object). The chunks arrive while it runs (iterating
        blocks until the next one is read); the iterator raises if the snapshot turns out
        damaged, and nothing may then be kept. Must be atomic too: a process killed
        meanwhile reopens to the old content or to an empty store, never to a mix."""
        ...

    def refuse(self, state: S, reason: str) -> S:
        """The stored mark is not part of this topic's history (``reason`` says why: a
        topic deleted and created again, another topic, a position past its tail). Raise to
        refuse the open, or empty the storage and return the empty state to rebuild it."""
        ...
