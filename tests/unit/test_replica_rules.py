"""The replica's rules for the next record of the log (accept, ignore as stale, or halt as a
forked history), pure: records handed to a Replica, no broker."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pulsar_state import ForkedHistoryError, JsonCodec
from pulsar_state._admin import TopicName
from pulsar_state._context import Context, Settings
from pulsar_state._envelope import Record, Write, encode_record
from pulsar_state._machine import StateMachine
from pulsar_state._pulsar import LogPosition, RawMessage
from pulsar_state._replica import Replica
from pulsar_state._types import ManagerStats

SETTINGS = Settings(
    idle_release_s=0.1,
    relay_idle_release_s=None,
    max_hold_s=1.0,
    acquire_timeout_s=5.0,
    takeover_after_s=None,
    write_timeout_s=5.0,
    read_timeout_s=5.0,
    open_timeout_s=5.0,
    max_record_bytes=1 << 20,
    max_writes_per_record=256,
    max_writes_per_batch=1024,
    snapshot_every_records=None,
    snapshot_every_bytes=None,
)


class Owner:
    def __init__(self) -> None:
        self.rejected: list[str] = []

    def claim(self, record_id: str) -> None:
        return None

    def reject(self, record_id: str) -> None:
        self.rejected.append(record_id)


def put(state: dict[str, Any], op: dict[str, Any]) -> None:
    state[op["k"]] = op["v"]


def replica() -> tuple[Replica[dict[str, Any], Any], Owner]:
    machine: StateMachine[dict[str, Any], Any] = StateMachine(
        put, JsonCodec(), copy_state=copy.deepcopy, begin_record=None
    )
    context = Context(TopicName.parse("rules"), "reader", SETTINGS, ManagerStats())
    owner = Owner()
    return Replica({}, machine, context, on_corrupt="halt", owner=owner), owner


def record(writer: str, seq: int, base: int, base_id: str, key: str) -> Record:
    op = JsonCodec().encode({"k": key, "v": seq})
    return Record(writer, seq, base, base_id, [Write(seq, [op])])


def feed(target: Replica[dict[str, Any], Any], records: list[Record], start: int = 0) -> None:
    for entry, each in enumerate(records, start=start):
        target.on_message(RawMessage(encode_record(each), LogPosition(1, entry)))


# A writer's pipelined batch B/1 -> B/2 -> B/3 lands after another record X on B/1's base
# (a record sent before the writer was fenced and persisted late, or an earlier attempt):
# B/1 is stale, and so is every record built on it.
LOG = [
    record("A", 1, 0, "", "a"),
    record("A", 2, 1, "A/1", "x"),
    record("B", 1, 1, "A/1", "b1"),
    record("B", 2, 2, "B/1", "b2"),
    record("B", 3, 3, "B/2", "b3"),
    record("C", 1, 2, "A/2", "c"),  # on the real latest: accepted
]


def test_a_chain_built_on_a_stale_record_is_stale_not_a_fork() -> None:
    # Before: B/2 (based on the ignored B/1, at the replica's version) halted every replica
    # with ForkedHistoryError, though the log holds one history.
    target, owner = replica()
    feed(target, LOG)
    assert target.halt is None
    assert owner.rejected == ["B/1", "B/2", "B/3"]
    assert (target.version, target.last_record_id) == (3, "C/1")
    assert target.state == {"a": 1, "x": 2, "c": 1}


def test_a_replica_resuming_where_the_last_record_was_accepted_agrees() -> None:
    # A snapshot or a stored mark names where its last record is (applied_at), not how far
    # the replica read: resuming there re-reads the stale records the chain is built on.
    first, _owner = replica()
    feed(first, LOG[:3])  # read up to the stale B/1
    assert first.read_to == LogPosition(1, 2)
    assert first.applied_at == LogPosition(1, 1)
    resumed, owner = replica()
    resumed.load(copy.deepcopy(first.state), first.version, first.last_record_id, first.applied_at)
    feed(resumed, LOG[2:], start=2)
    assert resumed.halt is None
    assert owner.rejected == ["B/1", "B/2", "B/3"]
    assert resumed.state == {"a": 1, "x": 2, "c": 1}


@pytest.mark.parametrize(
    "forked",
    [
        record("D", 1, 2, "D/0", "d"),  # at the replica's version, on a record it never saw
        record("D", 1, 5, "A/2", "d"),  # ahead of the replica
    ],
)
def test_a_record_on_a_record_never_in_the_log_still_halts_as_forked(forked: Record) -> None:
    target, _owner = replica()
    feed(target, [*LOG[:3], forked])
    assert isinstance(target.halt, ForkedHistoryError)


def test_duplicates_of_accepted_records_never_stop_later_records() -> None:
    # A producer that reconnects resends what it had in flight: accepted records come
    # again. Those are ignored, and the records built on the originals are accepted.
    target, owner = replica()
    a1, a2 = record("A", 1, 0, "", "a"), record("A", 2, 1, "A/1", "b")
    feed(
        target,
        [
            a1,
            a2,
            a1,
            a2,
            *(
                record("C", i, i + 1, f"C/{i - 1}" if i > 1 else "A/2", f"c{i}")
                for i in range(1, 4)
            ),
        ],
    )
    assert target.halt is None
    assert owner.rejected == ["A/1", "A/2"]
    assert (target.version, target.last_record_id) == (5, "C/3")


def test_a_record_on_an_ignored_record_at_another_position_still_halts_as_forked() -> None:
    # B/1 claimed position 2 (it was ignored there): a record built on it as if it were at
    # position 3 is not its writer's pipelined chain, and no replica saw that history.
    target, _owner = replica()
    feed(target, [*LOG[:3], record("B", 2, 3, "B/1", "b2")])
    assert isinstance(target.halt, ForkedHistoryError)
