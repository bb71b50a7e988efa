"""PulsarMap's state, pure: the trial overlay gives what replicas apply, the key order stays
right through inserts and deletes, and values are frozen."""

from __future__ import annotations

import copy
import enum
import gc
import pickle
import weakref
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsar_state import CodecError, JsonCodec, StrCodec
from recipes import FrozenDict, FrozenList, thaw
from recipes._map_ops import (
    MapCodecs,
    MapOp,
    MapSnapshotCodec,
    MapState,
    freeze,
    readable,
)

CODECS: MapCodecs[str, Any] = MapCodecs(StrCodec(), JsonCodec())

map_keys = st.text(alphabet="abcd", min_size=1, max_size=3)
map_values = st.one_of(
    st.integers(0, 9),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(map_keys, st.booleans(), max_size=2),
)
map_ops = st.one_of(
    st.builds(lambda k, v: CODECS.put(k, v), map_keys, map_values),
    st.builds(lambda k: MapOp("DELETE", *CODECS.key(k)[:1], None, CODECS.key(k)[1]), map_keys),
    st.just(MapOp("CLEAR")),
)
records = st.lists(st.lists(map_ops, max_size=5), max_size=6)


def run_records(state: MapState[str, Any], recs: list[list[MapOp[str, Any]]], start: int) -> None:
    for offset, ops in enumerate(recs):
        state.begin(start + offset)
        for op in ops:
            state.apply(op)


def snapshot_of(state: MapState[str, Any]) -> list[tuple[str, Any, int]]:
    return [(key, entry.value, int(entry.version)) for key, entry in state.entries.items()]


@settings(max_examples=300, deadline=None)
@given(history=records, batch=records)
def test_trial_equals_what_replicas_apply_and_leaves_the_live_state_alone(
    history: list[list[MapOp[str, Any]]], batch: list[list[MapOp[str, Any]]]
) -> None:
    live: MapState[str, Any] = MapState()
    run_records(live, history, 1)
    before = sorted(snapshot_of(live))
    before_order = list(live.sorted_keys())

    trial = live.trial()
    run_records(trial, batch, len(history) + 1)
    # What a replica gets applying the same records to its own copy of the live state.
    replica = live.copy()
    run_records(replica, batch, len(history) + 1)

    assert trial == replica
    assert dict(trial.values) == dict(replica.values)
    assert list(trial.sorted_keys()) == list(replica.sorted_keys()) == sorted(replica.entries)
    assert trial.matching(lambda key: key < "c") == replica.matching(lambda key: key < "c")
    assert trial.items_between("b", "c") == replica.items_between("b", "c")
    assert trial.last_tag == replica.last_tag
    # The live state did not change at all.
    assert sorted(snapshot_of(live)) == before
    assert list(live.sorted_keys()) == before_order
    assert dict(live.values) == {key: entry.value for key, entry in live.entries.items()}


@settings(max_examples=300, deadline=None)
@given(history=records)
def test_key_order_follows_inserts_deletes_and_clears(history: list[list[MapOp[str, Any]]]) -> None:
    state: MapState[str, Any] = MapState()
    for offset, ops in enumerate(history):
        state.begin(offset + 1)
        for op in ops:
            state.apply(op)
            assert list(state.sorted_keys()) == sorted(state.entries)
    for low, high in [(None, None), ("b", None), (None, "c"), ("ab", "cd"), ("d", "a")]:
        expected = [
            (key, state.values[key])
            for key in sorted(state.entries)
            if (low is None or key >= low) and (high is None or key < high)
        ]
        assert state.items_between(low, high) == expected


def test_snapshot_round_trip_keeps_order_and_values() -> None:
    state: MapState[str, Any] = MapState()
    state.begin(1)
    for key in ["b", "a", "c"]:
        state.apply(CODECS.put(key, {"k": [key]}))
    codec = MapSnapshotCodec(CODECS)
    loaded = codec.decode(codec.encode(state))
    assert loaded == state
    assert list(loaded.sorted_keys()) == ["a", "b", "c"]
    assert loaded.values["a"] == {"k": ["a"]}
    assert isinstance(loaded.values["a"], FrozenDict)
    assert codec.encode(loaded) == codec.encode(state)


def test_freeze_thaw_and_readable() -> None:
    value = {"a": [1, {"b": (2, [3])}], "s": "x"}
    frozen, ok = freeze(value)
    assert ok
    assert frozen == value
    assert isinstance(frozen, FrozenDict)
    assert isinstance(frozen["a"], FrozenList)
    assert isinstance(frozen["a"][1]["b"][1], FrozenList)
    assert readable(frozen) is frozen
    for change in (
        lambda: frozen.__setitem__("a", 1),
        lambda: frozen.pop("a"),
        lambda: frozen.setdefault("z", 1),
        lambda: frozen.clear(),
        lambda: frozen["a"].append(1),
        lambda: frozen["a"].sort(),
        lambda: frozen["a"].__setitem__(0, 5),
    ):
        with pytest.raises(TypeError, match="read-only"):
            change()
    thawed = thaw(frozen)
    assert thawed == value
    assert type(thawed) is dict
    assert type(thawed["a"]) is list
    for plain in (copy.deepcopy(frozen), pickle.loads(pickle.dumps(frozen))):
        assert plain == value
        assert type(plain) is dict
        assert type(plain["a"]) is list
    assert type(copy.copy(frozen)) is dict

    class Custom:
        pass

    odd = {"c": Custom()}
    kept, ok = freeze(odd)
    assert not ok
    assert kept is odd
    assert readable(odd) is not odd  # not freezable: readers get copies


def test_codecs_report_the_first_value_that_cannot_be_frozen() -> None:
    class Box:
        def __init__(self, items: list[int]) -> None:
            self.items = items

    class BoxCodec:
        def encode(self, value: Box) -> bytes:
            return bytes(value.items)

        def decode(self, data: bytes) -> Box:
            return Box(list(data))

    codecs: MapCodecs[str, Box] = MapCodecs(StrCodec(), BoxCodec())
    calls: list[bool] = []
    codecs.on_unfrozen = lambda: calls.append(True)
    assert codecs.all_frozen
    codecs.put("a", Box([1]))
    codecs.put("b", Box([2]))
    assert not codecs.all_frozen
    assert calls == [True]


class Color(str, enum.Enum):  # noqa: UP042  (the classic str enum, not StrEnum)
    RED = "red"


class Level(enum.IntEnum):
    ONE = 1


def test_a_key_equal_to_a_bound_one_but_of_another_type_reads_its_entry() -> None:
    """Found by review: the values dict matched a str enum member (or True for 1) but the
    sorted table did not, and reading its version raised."""
    state: MapState[Any, Any] = MapState()
    state.begin(1)
    state.apply(CODECS.put("red", 1))
    state.apply(MapOp("PUT", 1, "one", b"1", b'"one"'))  # a mixed map: str and int keys
    expected_red, expected_one = state.entries.get("red"), state.entries.get(1)
    assert expected_red is not None
    assert expected_one is not None
    assert state.entries.get(Color.RED) == expected_red
    assert state.entries[Color.RED] == expected_red
    assert state.entries.get(True) == state.entries.get(Level.ONE) == expected_one
    assert state.entries.get(1.0) == expected_one
    trial = state.trial()
    assert trial.entries.get(Color.RED) == expected_red
    single: MapState[str, Any] = MapState()
    single.begin(1)
    single.apply(CODECS.put("red", 1))
    assert single.entries.get(Color.RED) == single.entries.get("red")
    assert single.entries.get(Color.RED, "absent") != "absent"
    assert single.entries.get(b"red", "absent") == "absent"


class Sentinel:
    """A value that tells when it is freed."""


def test_a_dropped_state_is_freed_at_once_not_by_the_cycle_collector() -> None:
    """Found by review: a state holding a view of itself was a reference cycle, so a
    snapshot's copy of a big map stayed in memory until the cyclic collector ran."""
    state: MapState[str, Any] = MapState()
    value = Sentinel()
    freed = weakref.ref(value)
    state.begin(1)
    state.apply(MapOp("PUT", "k", value, b"k", b"v"))
    del value
    copied = state.copy()
    assert copied.entries.get("k") is not None
    gc.disable()
    try:
        del state, copied
        assert freed() is None
    finally:
        gc.enable()


def test_versions_past_two_to_the_31_records_are_refused_on_trial_and_replica_alike() -> None:
    live: MapState[str, Any] = MapState()
    trial = live.trial()
    for state in (live, trial):
        state.begin(1 << 31)
        with pytest.raises(ValueError, match="no version at position"):
            state.apply(CODECS.put("k", 1))
    assert len(live.entries) == 0
    assert list(live.sorted_keys()) == []


def test_a_value_refused_by_its_codec_is_named_by_key_and_keeps_the_codec_s_error_type() -> None:
    class Refused(CodecError):
        pass

    class Strict(JsonCodec):
        def encode(self, value: Any) -> bytes:
            if value == "bad":
                raise Refused("no")
            return super().encode(value)

    codecs: MapCodecs[str, Any] = MapCodecs(StrCodec(), Strict())
    with pytest.raises(Refused) as caught:  # (before the key was named: Refused itself)
        codecs.put("k", "bad")
    assert caught.value.__notes__ == ["(the value of key 'k')"]
    with pytest.raises(CodecError, match="the value of key 'k': ") as plain:
        MapCodecs(StrCodec(), JsonCodec()).put("k", {1, 2})
    assert type(plain.value) is CodecError
