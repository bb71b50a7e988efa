"""The replica's rules for the next record of the log (accept, ignore as stale, or halt as a
forked history), pure: records handed to a Replica, no broker."""

from __future__ import annotations

import asyncio
import copy
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsar_state import ForkedHistoryError, JsonCodec
from pulsar_state._admin import TopicName
from pulsar_state._context import Context, Settings
from pulsar_state._durable import LogMark
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


def mark_of(target: Replica[dict[str, Any], Any]) -> LogMark:
    """Where a snapshot taken of ``target`` now resumes (as its stored mark would)."""
    assert target.applied_at is not None
    return LogMark(
        target.version,
        target.last_record_id,
        target.applied_at,
        target.origin,
        target.stale_at_applied,
    )


def resume(
    state: dict[str, Any], mark: LogMark, log: list[Record]
) -> tuple[Replica[dict[str, Any], Any], Owner]:
    """A replica loaded at ``mark`` with ``state``, fed the rest of ``log`` until it halts."""
    resumed, owner = replica()
    resumed.load(
        copy.deepcopy(state),
        mark.position,
        mark.record_id,
        mark.log_position,
        mark.origin,
        mark.stale,
    )
    for entry in range(mark.log_position.entry + 1, len(log)):
        feed(resumed, [log[entry]], start=entry)
        if resumed.halt is not None:
            break
    return resumed, owner


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
    resumed, owner = resume(first.state, mark_of(first), LOG)
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


# B's pipelined chain goes on after C's record is accepted: B/3 (on B/2, at the version C/1
# made) is as stale as B/1 and B/2. A writer's chain relayed in pieces through the holder of
# the topic's writer, between the holder's own records, lands like this.
INTERRUPTED = [*LOG[:4], LOG[5], LOG[4], record("D", 1, 3, "C/1", "d")]


def test_a_stale_chain_goes_on_across_another_writers_record() -> None:
    # Before: the accept of C/1 forgot B/2, so B/3 halted every replica as a forked history.
    target, owner = replica()
    feed(target, INTERRUPTED)
    assert target.halt is None
    assert owner.rejected == ["B/1", "B/2", "B/3"]
    assert (target.version, target.last_record_id) == (4, "D/1")
    assert target.state == {"a": 1, "x": 2, "c": 1, "d": 1}


class Store:
    """A durable state that keeps the marks it was given."""

    def __init__(self) -> None:
        self.marks: list[LogMark] = []

    def commit(self, state: object, mark: LogMark) -> None:
        self.marks.append(mark)


def test_a_replica_resuming_after_the_record_inside_a_stale_chain_agrees() -> None:
    # Resuming just after C/1 (a snapshot's or a stored mark's position), a replica does not
    # read B/2 again: the mark names it, and B/3 is stale there too.
    first, _owner = replica()
    store = Store()
    first.durable = store  # type: ignore[assignment]
    feed(first, INTERRUPTED[:5])  # up to C/1
    assert first.stale_at_applied == (("B/2", 3),)
    mark = store.marks[-1]
    assert (mark.position, mark.record_id, mark.stale) == (3, "C/1", (("B/2", 3),))
    assert mark == mark_of(first)
    assert mark.log_position == LogPosition(1, 4)
    resumed, owner = resume(first.state, mark, INTERRUPTED)
    assert resumed.halt is None
    assert owner.rejected == ["B/3"]
    assert resumed.state == {"a": 1, "x": 2, "c": 1, "d": 1}
    assert resumed.stale_at_applied == (("B/3", 4),)  # D/1's position: B/4 on it is stale


# The same chain one link further before C/1 lands: B/3 claims 4, ahead of C/1's version.
AHEAD = [*LOG[:5], LOG[5], record("D", 1, 3, "C/1", "d"), record("B", 4, 4, "B/3", "b4")]


def test_a_stale_chain_ahead_of_the_version_goes_on_after_an_accept() -> None:
    target, owner = replica()
    feed(target, AHEAD)
    assert target.halt is None
    assert owner.rejected == ["B/1", "B/2", "B/3", "B/4"]
    assert target.state == {"a": 1, "x": 2, "c": 1, "d": 1}


@pytest.mark.parametrize("after", range(1, len(AHEAD)))
def test_a_replica_resuming_from_any_mark_decides_as_one_that_read_everything(after: int) -> None:
    # Resumed at the last record accepted among the first ``after`` messages (where a
    # snapshot taken then, or the stored mark, puts it), with what the mark names.
    whole, whole_owner = replica()
    feed(whole, AHEAD)
    first, _owner = replica()
    store = Store()
    first.durable = store  # type: ignore[assignment]
    feed(first, AHEAD[:after])
    assert store.marks[-1] == mark_of(first)
    resumed, owner = resume(first.state, mark_of(first), AHEAD)
    start = mark_of(first).log_position.entry + 1
    assert resumed.halt is None
    assert (resumed.state, resumed.version) == (whole.state, whole.version)
    assert owner.rejected == [
        r.record_id for r in AHEAD[start:] if r.record_id in whole_owner.rejected
    ]


def test_a_chain_on_a_stale_record_from_before_the_last_two_accepts_still_halts() -> None:
    # B/2 claimed position 3, which C/1 took; D/1 took 4. A record on B/2 at 4 is not B's
    # pipelined chain (that would be at 3): no replica saw that history.
    target, _owner = replica()
    feed(target, [*INTERRUPTED, record("B", 4, 4, "B/2", "b4")])
    assert isinstance(target.halt, ForkedHistoryError)


def test_stale_records_past_the_bound_are_forgotten_alike_by_every_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With room for one, C/1's accept keeps B/3 (the latest) and forgets B/2: a record on
    # B/2 at 3 then halts as forked, on a replica resumed at C/1 as on one that read it all.
    monkeypatch.setattr("pulsar_state._replica.MAX_STALE_KEPT", 1)
    log = [*LOG[:5], LOG[5], record("E", 1, 3, "B/2", "e")]
    whole, _owner = replica()
    feed(whole, log)
    first, _owner = replica()
    feed(first, log[:6])
    assert first.stale_at_applied == (("B/3", 4),)
    resumed, _owner = resume(first.state, mark_of(first), log)
    assert isinstance(whole.halt, ForkedHistoryError)
    assert isinstance(resumed.halt, ForkedHistoryError)


def random_log(seed: int) -> list[Record]:
    """Records of four writers, most built on one of the last few records written (accepted
    or not: chains, forks), some on nothing ever written, some sent twice."""
    rng = random.Random(seed)
    log: list[Record] = []
    bases: list[tuple[int, str]] = [(0, "")]
    seqs = dict.fromkeys("ABCD", 0)
    for _ in range(rng.randint(5, 25)):
        roll = rng.random()
        if log and roll < 0.1:
            log.append(rng.choice(log))
            continue
        writer = rng.choice("ABCD")
        seqs[writer] += 1
        if roll < 0.15:
            base = (rng.randint(0, 6), f"{rng.choice('ABCD')}/{rng.randint(0, 5)}")
        else:
            base = rng.choice(bases[-6:])
        made = record(writer, seqs[writer], base[0], base[1], f"k{len(log)}")
        log.append(made)
        bases.append((base[0] + 1, made.record_id))
    return log


def outcome(target: Replica[dict[str, Any], Any]) -> tuple[object, ...]:
    return (target.version, target.last_record_id, target.halt is not None, target.state)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32))
def test_a_replica_resumed_at_any_accept_ends_as_one_that_read_everything(seed: int) -> None:
    log = random_log(seed)
    whole, _owner = replica()
    store = Store()
    whole.durable = store  # type: ignore[assignment]
    resumed_from: list[tuple[dict[str, Any], LogMark]] = []
    for entry, each in enumerate(log):
        feed(whole, [each], start=entry)
        if store.marks and store.marks[-1].log_position == LogPosition(1, entry):
            resumed_from.append((copy.deepcopy(whole.state), store.marks[-1]))
        if whole.halt is not None:
            break
    for state, mark in resumed_from:
        resumed, _owner = resume(state, mark, log)
        assert outcome(resumed) == outcome(whole), (mark, log)


def test_an_apply_raising_a_base_exception_halts_the_replica_never_applies_twice() -> None:
    # A CancelledError (a BaseException, not an Exception) from apply on a live replica: the
    # state may hold part of the record. Before: it escaped, the replica's position stayed,
    # and the same message handled again was applied a second time.
    calls: list[str] = []

    def cancelling_put(state: dict[str, Any], op: dict[str, Any]) -> None:
        calls.append(op["k"])
        state[op["k"]] = op["v"]
        if op["k"] == "boom":
            raise asyncio.CancelledError("a cancelled future's result(), in apply")

    machine: StateMachine[dict[str, Any], Any] = StateMachine(
        cancelling_put, JsonCodec(), copy_state=copy.deepcopy, begin_record=None
    )
    context = Context(TopicName.parse("rules"), "reader", SETTINGS, ManagerStats())
    target = Replica({}, machine, context, on_corrupt="halt", owner=Owner())
    boom = record("W", 1, 0, "", "boom")
    message = RawMessage(encode_record(boom), LogPosition(1, 0))
    target.on_message(message)
    target.on_message(message)  # the pump's next delivery of the same message
    assert target.halt is not None
    assert "CancelledError" in str(target.halt)
    assert calls == ["boom"]
    assert target.version == 0


def test_a_listener_raising_a_base_exception_is_logged_not_a_halt() -> None:
    # Its record is applied and committed: as for a listener raising an Exception, logged.
    # Before: a CancelledError from a listener halted the replica for good.
    target, _ = replica()

    def listener(_applied: Any) -> None:
        raise asyncio.CancelledError("a cancelled future's result(), in a listener")

    target.listeners.append(listener)
    feed(target, [record("W", 1, 0, "", "a"), record("W", 2, 1, "W/1", "b")])
    assert target.halt is None
    assert target.version == 2
    assert target.state == {"a": 1, "b": 2}
