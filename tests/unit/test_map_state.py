"""PulsarMap's state, pure: the trial overlay gives what replicas apply, the key order stays
right through inserts and deletes, and values are frozen."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsar_state import JsonCodec, StrCodec
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
