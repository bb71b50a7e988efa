"""The record builder (batch of writes -> records), pure: no broker, no event loop."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from pulsar_state import (
    ApplyError,
    CodecError,
    ConfigurationError,
    JsonCodec,
    RecordTooLargeError,
)
from pulsar_state._envelope import decode_record
from pulsar_state._machine import DEFAULT_COPY, StateMachine
from pulsar_state._records import Batch, RecordBuilder

State = dict[str, Any]
Op = dict[str, Any]


@dataclass
class Request:
    generator: Callable[[Any], Sequence[Any]]
    write_seq: int


@dataclass
class Limits:
    max_record_bytes: int = 1024 * 1024
    max_writes_per_record: int = 256


def apply_op(state: State, op: Op) -> None:
    if op.get("boom"):
        raise RuntimeError("boom")
    state["count"] += op.get("by", 1)
    state["log"].append(op.get("tag"))


def new_state() -> State:
    return {"count": 0, "log": [], "begun": []}


def begin(state: State, version: int) -> None:
    state["begun"].append(version)


def builder(
    limits: Limits | None = None,
    *,
    apply: Callable[[State, Op], State | None] = apply_op,
    copy_state: Callable[[State], State] | None = copy.deepcopy,
    begin_record: Callable[[State, int], State | None] | None = begin,
) -> RecordBuilder[State, Op]:
    machine: StateMachine[State, Op] = StateMachine(
        apply, JsonCodec(), copy_state=copy_state, begin_record=begin_record
    )
    return RecordBuilder(machine, "w1", limits or Limits())


# The manager's default (an overlay over a dict state, values copied when first read) and an
# explicit deep copy per batch: the trial run must behave the same with both.
COPY_MODES = pytest.mark.parametrize(
    "copy_state", [DEFAULT_COPY, copy.deepcopy], ids=["default-overlay", "deepcopy"]
)


def ops(*tags: str) -> Callable[[State], list[Op]]:
    return lambda _state: [{"tag": t} for t in tags]


def requests(*generators: Callable[[State], Sequence[Op]]) -> list[Request]:
    return [Request(g, seq) for seq, g in enumerate(generators, start=1)]


def sent_ops(batch: Batch[Request]) -> list[list[list[Any]]]:
    """The ops of each write of each record, decoded from the payloads actually built."""
    decoded = [decode_record(o.payload, message_id="test") for o in batch.records]
    codec: JsonCodec[Any] = JsonCodec()
    return [[[codec.decode(op)["tag"] for op in w.ops] for w in r.writes] for r in decoded]


def test_writes_are_group_committed_into_one_record_based_on_the_given_version() -> None:
    batch = builder().build(requests(ops("a"), ops("b", "c")), new_state(), 7, "x/3")
    assert batch.refused == []
    assert batch.halt is None
    (outgoing,) = batch.records
    record = outgoing.record
    assert (record.base_position, record.base_record_id) == (7, "x/3")
    assert [w.write_seq for w in record.writes] == [1, 2]
    assert [r.write_seq for r in outgoing.writes] == [1, 2]
    assert decode_record(outgoing.payload, message_id="test") == record
    assert sent_ops(batch) == [[["a"], ["b", "c"]]]


def test_records_chain_when_a_record_is_full() -> None:
    batch = builder(Limits(max_writes_per_record=2)).build(
        requests(*(ops(str(i)) for i in range(5))), new_state(), 0, ""
    )
    records = [o.record for o in batch.records]
    assert [len(r.writes) for r in records] == [2, 2, 1]
    assert [r.base_position for r in records] == [0, 1, 2]
    assert [r.base_record_id for r in records] == ["", records[0].record_id, records[1].record_id]
    assert [r.record_seq for r in records] == [1, 2, 3]


def test_records_split_by_size() -> None:
    big = "x" * 400
    batch = builder(Limits(max_record_bytes=1024)).build(
        requests(ops(big), ops(big), ops(big)), new_state(), 0, ""
    )
    assert [len(o.writes) for o in batch.records] == [2, 1]
    assert all(len(o.payload) <= 1024 for o in batch.records)


@COPY_MODES
def test_generators_see_earlier_writes_of_the_batch_and_the_live_state_is_untouched(
    copy_state: Any,
) -> None:
    seen: list[int] = []

    def counting(state: State) -> list[Op]:
        seen.append(state["count"])
        return [{"tag": "n", "by": 10}]

    live = new_state()
    builder(copy_state=copy_state).build(requests(counting, counting, counting), live, 0, "")
    assert seen == [0, 10, 20]
    assert live == new_state()


@COPY_MODES
def test_begin_record_gets_the_version_of_the_record_each_write_joins(copy_state: Any) -> None:
    seen: list[list[int]] = []

    def look(state: State) -> list[Op]:
        seen.append(list(state["begun"]))
        return [{"tag": "t"}]

    builder(Limits(max_writes_per_record=2), copy_state=copy_state).build(
        requests(look, look, look, look), new_state(), 10, "r"
    )
    # Writes 1-2 join record 11, writes 3-4 record 12: begin runs once per record.
    assert seen == [[], [11], [11], [11, 12]]


def test_a_raising_generator_refuses_only_its_write() -> None:
    error = KeyError("mine")

    def bad(_state: State) -> list[Op]:
        raise error

    reqs = requests(bad, ops("a"), ops("c"))
    batch = builder().build(reqs, new_state(), 0, "")
    assert batch.refused == [(reqs[0], error)]  # the generator's own exception, unchanged
    assert batch.deferred == []
    assert sent_ops(batch) == [[["a"], ["c"]]]


def test_a_write_failing_on_the_batch_s_earlier_writes_is_decided_again_later() -> None:
    # Its failure rests on "a", which may not land (its record ignored as stale, say): it
    # is deferred to a later batch, decided on the state holding the outcome. Before: it
    # failed at once, on a state the log might never hold.
    def bad(_state: State) -> list[Op]:
        raise KeyError("mine")

    reqs = requests(ops("a"), bad, ops("c"))
    batch = builder().build(reqs, new_state(), 0, "")
    assert batch.refused == []
    # It and every write after it, in order: the writes keep their order in the log.
    assert batch.deferred == [reqs[1], reqs[2]]
    assert sent_ops(batch) == [[["a"]]]


def test_an_op_the_codec_cannot_encode_is_a_codec_error() -> None:
    reqs = requests(lambda _s: [{"tag": object()}], ops("b"))
    batch = builder().build(reqs, new_state(), 0, "")
    ((request, error),) = batch.refused
    assert request is reqs[0]
    assert isinstance(error, CodecError)
    assert sent_ops(batch) == [[["b"]]]


def test_a_write_over_max_record_bytes_is_refused_before_sending() -> None:
    reqs = requests(ops("x" * 5000), ops("small"))
    batch = builder(Limits(max_record_bytes=4096)).build(reqs, new_state(), 0, "")
    ((request, error),) = batch.refused
    assert request is reqs[0]
    assert isinstance(error, RecordTooLargeError)
    assert error.limit == 4096
    assert sent_ops(batch) == [[["small"]]]


@COPY_MODES
def test_a_failing_op_refuses_its_write_and_rolls_back_its_earlier_ops(copy_state: Any) -> None:
    seen: list[list[str]] = []

    def look(state: State) -> list[Op]:
        seen.append(list(state["log"]))
        return [{"tag": "after"}]

    failing = lambda _s: [{"tag": "half"}, {"boom": True}]  # noqa: E731
    reqs = requests(ops("a"), failing, look)
    live = new_state()
    batch = builder(copy_state=copy_state).build(reqs, live, 0, "")
    assert live == new_state()
    assert batch.deferred == [reqs[1], reqs[2]]  # decided on "a": again later, in order
    assert seen == []
    assert sent_ops(batch) == [[["a"]]]
    # First in its batch, on the state the log holds: refused.
    reqs = requests(failing, look)
    batch = builder(copy_state=copy_state).build(reqs, live, 0, "")
    ((request, error),) = batch.refused
    assert request is reqs[0]
    assert isinstance(error, ApplyError)
    assert "boom" in str(error)
    assert isinstance(error.__cause__, RuntimeError)
    assert seen == [[]]  # "half" was applied to the trial state, then rebuilt away
    assert sent_ops(batch) == [[["after"]]]


def test_a_raising_begin_record_is_an_apply_error() -> None:
    def bad_begin(_state: State, _version: int) -> None:
        raise ValueError("no")

    reqs = requests(ops("a"))
    batch = builder(begin_record=bad_begin).build(reqs, new_state(), 0, "")
    ((_request, error),) = batch.refused
    assert isinstance(error, ApplyError)
    assert "begin_record" in str(error)
    assert batch.records == []


def test_in_place_apply_without_copy_state_halts_and_sends_nothing() -> None:
    reqs = requests(ops("a"), ops("b"))
    batch = builder(copy_state=None).build(reqs, new_state(), 0, "")
    assert batch.records == []
    assert batch.halt is not None
    request, error = batch.halt
    assert request is reqs[0]
    assert isinstance(error, ConfigurationError)


def test_in_place_begin_record_without_copy_state_halts_and_sends_nothing() -> None:
    # Before: apply was checked, begin_record was not; its in-place stamp on the trial run
    # changed the live state, which then got the stamp twice (once more on the apply).
    def pure(state: State, op: Op) -> State:
        return {**state, "count": state["count"] + 1}

    live = new_state()
    batch = builder(apply=pure, copy_state=None, begin_record=begin).build(
        requests(ops("a")), live, 0, ""
    )
    assert batch.records == []
    assert batch.halt is not None
    assert isinstance(batch.halt[1], ConfigurationError)
    assert "begin_record" in str(batch.halt[1])


def test_pure_apply_without_copy_state_is_fine() -> None:
    def pure(state: State, op: Op) -> State:
        return {**state, "count": state["count"] + 1}

    live = new_state()
    batch = builder(apply=pure, copy_state=None, begin_record=None).build(
        requests(ops("a"), ops("b")), live, 0, ""
    )
    assert len(batch.records) == 1
    assert batch.halt is None
    assert live == new_state()


def test_record_numbers_continue_across_builds() -> None:
    records = builder()
    first = records.build(requests(ops("a")), new_state(), 0, "")
    second = records.build(requests(ops("b")), new_state(), 1, first.records[0].record.record_id)
    assert [b.records[0].record.record_seq for b in (first, second)] == [1, 2]


@pytest.mark.parametrize("max_writes", [1, 3, 256])
def test_every_good_write_is_sent_once_in_order(max_writes: int) -> None:
    reqs = requests(*(ops(str(i)) for i in range(10)))
    batch = builder(Limits(max_writes_per_record=max_writes)).build(reqs, new_state(), 0, "")
    assert [w.write_seq for o in batch.records for w in o.writes] == list(range(1, 11))


def test_writes_with_no_ops_riding_in_records_count_against_both_limits() -> None:
    # Before: writes with no ops after a write joined its record uncounted, so a record
    # carried 39 writes (limit 4) and went past max_record_bytes.
    limits = Limits(max_record_bytes=1024, max_writes_per_record=4)
    reqs = requests(ops("x" * 850), *(lambda _s: [] for _ in range(38)))
    batch = builder(limits).build(reqs, new_state(), 0, "")
    assert batch.refused == []
    assert batch.unchanged == []  # all decided after the first write: they ride with it
    assert sum(len(o.writes) for o in batch.records) == 39
    for outgoing in batch.records:
        assert len(outgoing.record.writes) <= 4
        assert len(outgoing.payload) <= 1024


def test_a_long_base_record_id_counts_against_max_record_bytes() -> None:
    # Before: the size check counted this writer's id, not the base record's (another
    # writer's id, which may be much longer): the record went past the limit.
    long_base = "some-long-process-name-" * 8 + "0123456789ab/7"
    for size in range(700, 1000, 7):
        batch = builder(Limits(max_record_bytes=1024)).build(
            requests(ops("y" * size)), new_state(), 5, long_base
        )
        for outgoing in batch.records:
            assert len(outgoing.payload) <= 1024, size
        assert len(batch.records) + len(batch.refused) == 1


@pytest.mark.parametrize("seed", range(20))
def test_records_never_pass_either_limit(seed: int) -> None:
    rng = random.Random(seed)
    limits = Limits(
        max_record_bytes=rng.randrange(300, 3000), max_writes_per_record=rng.randrange(1, 6)
    )
    generators = [
        (lambda _s: [])
        if rng.random() < 0.3
        else ops(*("z" * rng.randrange(0, 900) for _ in range(rng.randrange(1, 3))))
        for _ in range(40)
    ]
    base = "b" * rng.randrange(0, 300) + "/1"
    batch = builder(limits).build(requests(*generators), new_state(), 3, base)
    for outgoing in batch.records:
        assert len(outgoing.record.writes) <= limits.max_writes_per_record
        assert len(outgoing.payload) <= limits.max_record_bytes
        assert decode_record(outgoing.payload, message_id="t") == outgoing.record
    built = sum(len(o.writes) for o in batch.records)
    assert built + len(batch.refused) + len(batch.deferred) + len(batch.unchanged) == 40


def test_a_write_with_no_ops_decided_after_a_write_of_the_batch_is_never_unchanged() -> None:
    # "unchanged" writes are confirmed on the base state: one decided on a state holding an
    # earlier write of the batch must ride in a record after it, even when the record that
    # write is in is full (it then opens a record of its own).
    seen: list[int] = []

    def decide(state: State) -> list[Op]:
        seen.append(state["count"])
        return []

    reqs = requests(ops("a"), decide)
    batch = builder(Limits(max_writes_per_record=1)).build(reqs, new_state(), 0, "")
    assert seen == [1]  # decided on the state with "a"
    assert batch.unchanged == []
    assert [[w.write_seq for w in o.writes] for o in batch.records] == [[1], [2]]
    assert batch.records[1].record.base_record_id == batch.records[0].record.record_id


@pytest.mark.parametrize("seed", range(30))
def test_every_generator_sees_the_state_the_replicas_have_before_its_write(seed: int) -> None:
    # Writes with and without ops, records split by a small limit: a record may be opened
    # by a write with no ops, and must then be begun on the trial state as the replicas
    # begin it. Before: it was not, so the writes after it saw another state.
    rng = random.Random(seed)
    seen: dict[int, list[int]] = {}

    def generator(seq: int, with_ops: bool) -> Callable[[State], list[Op]]:
        def generate(state: State) -> list[Op]:
            seen[seq] = list(state["begun"])
            return [{"tag": str(seq)}] if with_ops else []

        return generate

    reqs = [Request(generator(seq, seq == 1 or rng.random() < 0.6), seq) for seq in range(1, 30)]
    limits = Limits(max_writes_per_record=rng.randrange(1, 4))
    machine: StateMachine[State, Op] = StateMachine(
        apply_op, JsonCodec(), copy_state=copy.deepcopy, begin_record=begin
    )
    batch = RecordBuilder(machine, "w1", limits).build(reqs, new_state(), 0, "")
    assert batch.unchanged == []
    assert batch.refused == []
    # A generator runs before its write joins a record: the first write of a record sees
    # the state before the record begins, the others the state after the writes before it.
    replica, before = new_state(), {}
    for outgoing in batch.records:
        record = decode_record(outgoing.payload, message_id="t")
        before[record.writes[0].write_seq] = list(replica["begun"])
        replica = machine.apply_write(replica, (), begins=record.base_position + 1)
        for index, (write, ops) in enumerate(
            zip(record.writes, machine.decode(record, None), strict=True)  # type: ignore[arg-type]
        ):
            if index:
                before[write.write_seq] = list(replica["begun"])
            replica = machine.apply_write(replica, ops)
    assert seen == before
