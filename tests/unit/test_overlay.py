"""DictOverlay behaves exactly as a copy of its base would, and never changes the base."""

from __future__ import annotations

import copy
import datetime
import decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsar_state import DictOverlay, JsonCodec
from pulsar_state._machine import DEFAULT_COPY, StateMachine

keys = st.sampled_from(["a", "b", "c", "d", "e", "f"])
values = st.integers(0, 5)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), keys, values),
        st.tuples(st.just("del"), keys, st.none()),
        st.tuples(st.just("pop"), keys, st.none()),
        st.tuples(st.just("setdefault"), keys, values),
        st.tuples(st.just("popitem"), st.none(), st.none()),
        st.tuples(st.just("clear"), st.none(), st.none()),
        st.tuples(st.just("update"), keys, values),
    ),
    max_size=30,
)


def run(target: Any, op: tuple[str, Any, Any]) -> Any:
    """One operation on a dict or an overlay; its result or the type of error it raised."""
    kind, key, value = op
    try:
        if kind == "set":
            target[key] = value
        elif kind == "del":
            del target[key]
        elif kind == "pop":
            return target.pop(key)
        elif kind == "setdefault":
            return target.setdefault(key, value)
        elif kind == "popitem":
            return target.popitem()
        elif kind == "clear":
            target.clear()
        else:
            target.update({key: value})
    except KeyError:
        return KeyError
    return None


@settings(max_examples=500, deadline=None)
@given(base=st.dictionaries(keys, values), script=ops)
def test_overlay_matches_a_copy_and_leaves_the_base_alone(
    base: dict[str, int], script: list[tuple[str, Any, Any]]
) -> None:
    before = dict(base)
    expected = dict(base)
    overlay: DictOverlay[str, int] = DictOverlay(base)
    for op in script:
        assert run(overlay, op) == run(expected, op)
        # Same contents, same iteration order (dict order), same length, same lookups.
        assert list(overlay.items()) == list(expected.items())
        assert len(overlay) == len(expected)
        for key in "abcdefz":
            assert (key in overlay) == (key in expected)
            assert overlay.get(key) == expected.get(key)
    assert base == before
    assert list(base) == list(before)
    assert overlay == expected
    assert overlay.copy() == expected
    assert type(overlay.copy()) is dict


def test_values_read_through_are_private_copies_when_asked() -> None:
    base = {"list": [1], "n": 1}
    overlay: DictOverlay[str, Any] = DictOverlay(base, copy_value=copy.deepcopy)
    overlay["list"].append(2)  # apply changing a value in place
    overlay.setdefault("list", []).append(3)
    assert overlay["list"] == [1, 2, 3]
    assert base == {"list": [1], "n": 1}


def test_without_copy_value_values_are_shared() -> None:
    shared = [1]
    overlay: DictOverlay[str, list[int]] = DictOverlay({"k": shared})
    assert overlay["k"] is shared


def test_or_and_repr() -> None:
    overlay: DictOverlay[str, int] = DictOverlay({"a": 1})
    assert overlay | {"b": 2} == {"a": 1, "b": 2}
    overlay |= {"c": 3}
    assert dict(overlay) == {"a": 1, "c": 3}
    assert "DictOverlay" in repr(overlay)


def apply_in_place(state: dict[str, Any], op: dict[str, Any]) -> None:
    if op["op"] == "append":
        state.setdefault(op["k"], []).append(op["v"])
    elif op["op"] == "del":
        del state[op["k"]]
    else:
        state[op["k"]] = op["v"]


@settings(max_examples=200, deadline=None)
@given(
    base=st.dictionaries(keys, st.lists(values, max_size=3)),
    script=st.lists(
        st.fixed_dictionaries(
            {"op": st.sampled_from(["append", "del", "set"]), "k": keys, "v": values}
        ),
        max_size=20,
    ),
)
def test_default_trial_of_a_dict_state_equals_what_replicas_apply(
    base: dict[str, Any], script: list[dict[str, Any]]
) -> None:
    """The manager's default trial state (an overlay that copies values on first read) gives
    the state that applying the same ops to the live state gives, and never changes it."""
    machine: StateMachine[dict[str, Any], Any] = StateMachine(
        apply_in_place, JsonCodec(), copy_state=DEFAULT_COPY, begin_record=None
    )
    live = copy.deepcopy(base)
    trial = machine.trial_copy(live)
    assert isinstance(trial, DictOverlay)
    replica = copy.deepcopy(base)
    for op in script:
        trial_error = replica_error = None
        try:
            trial = machine.apply_write(trial, [op], trial=True)
        except Exception as exc:
            trial_error = type(exc.__cause__)
        try:
            replica = machine.apply_write(replica, [op])
        except Exception as exc:
            replica_error = type(exc)
        assert trial_error == replica_error
        assert dict(trial) == replica
    assert live == base


def test_copy_state_choices() -> None:
    def machine(**options: Any) -> StateMachine[Any, Any]:
        return StateMachine(apply_in_place, JsonCodec(), begin_record=None, **options)

    state: dict[str, Any] = {"k": [1]}
    default = machine(copy_state=DEFAULT_COPY)
    assert isinstance(default.trial_copy(state), DictOverlay)
    snapshot = default.full_copy(state)
    assert snapshot == state
    assert type(snapshot) is dict
    assert snapshot["k"] is not state["k"]
    # Any other state: a deep copy, as before.
    other = [[1]]
    assert default.trial_copy(other) == other
    assert default.trial_copy(other) is not other
    # copy_state given: used for both, as before.
    deep = machine(copy_state=copy.deepcopy)
    assert type(deep.trial_copy(state)) is dict
    # trial_state given: used for trials; copy_state for snapshots.
    both = machine(copy_state=dict.copy, trial_state=DictOverlay)
    assert isinstance(both.trial_copy(state), DictOverlay)
    assert type(both.full_copy(state)) is dict
    # copy_state=None: the state itself (apply promises not to mutate it).
    pure = machine(copy_state=None)
    assert pure.trial_copy(state) is state
    assert pure.full_copy(state) is state


def test_in_place_apply_is_fine_on_a_trial_state() -> None:
    machine: StateMachine[dict[str, Any], Any] = StateMachine(
        apply_in_place, JsonCodec(), copy_state=None, trial_state=DictOverlay, begin_record=None
    )
    live: dict[str, Any] = {"a": 1}
    trial = machine.apply_write(
        machine.trial_copy(live), [{"op": "set", "k": "b", "v": 2}], trial=True
    )
    assert dict(trial) == {"a": 1, "b": 2}
    assert live == {"a": 1}


@pytest.mark.parametrize("method", ["pop", "__delitem__"])
def test_missing_keys_raise_key_error(method: str) -> None:
    overlay: DictOverlay[str, int] = DictOverlay({"a": 1})
    del overlay["a"]
    with pytest.raises(KeyError):
        getattr(overlay, method)("a")
    with pytest.raises(KeyError):
        overlay["a"]


@settings(max_examples=500, deadline=None)
@given(base=st.dictionaries(keys, values), script=ops)
def test_commit_leaves_the_base_as_the_overlay_shows_it_in_order(
    base: dict[str, int], script: list[tuple[str, Any, Any]]
) -> None:
    """What a writer adopting its trial state (``adopt_trial``) relies on: after ``commit``,
    the base holds the overlay's contents in the overlay's (a copy's) order."""
    expected = dict(base)
    overlay: DictOverlay[str, int] = DictOverlay(base)
    for op in script:
        run(overlay, op)
        run(expected, op)
    overlay.commit()
    assert list(base.items()) == list(expected.items())


def test_commit_needs_a_mutable_base() -> None:
    import types

    overlay: DictOverlay[str, int] = DictOverlay(types.MappingProxyType({"a": 1}))
    overlay["b"] = 2
    with pytest.raises(TypeError, match="mappingproxy"):
        overlay.commit()


def test_identical_ops_have_the_same_values_and_types_all_the_way_down() -> None:
    """The writer adopts a trial state only if its record's ops decode to exactly the ops
    the trial ran (``adopt_trial``)."""
    from pulsar_state._machine import identical

    op = {"op": "acquire", "names": ["a", "b"], "ttl": 1.5, "n": 2, "ok": True, "x": None}
    assert identical(op, JsonCodec().decode(JsonCodec().encode(op)))
    for sent, got in [
        (1, 1.0),
        (True, 1),
        (("a",), ["a"]),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),  # apply may iterate an op in order
        ({1: "x"}, {"1": "x"}),
        ({"k": [1, (2,)]}, {"k": [1, [2]]}),
        (float("nan"), float("nan")),
        (object(), object()),  # no __eq__: a decoded copy is another object
        ([1, 2], [1, 2, 3]),
        # Equal but not the same value (adopted, the holder diverged from the replicas):
        (0.0, -0.0),
        (decimal.Decimal("1"), decimal.Decimal("1.00")),  # an Avro decimal at its scale
        (noon_in_paris, noon_in_paris.astimezone(datetime.UTC)),  # an Avro timestamp
        (datetime.time(12, tzinfo=paris), datetime.time(12)),
        (AmbiguousEquality(), AmbiguousEquality()),  # an == that raises: not identical
    ]:
        assert not identical(sent, got), (sent, got)
    same = [1.5, -0.0, decimal.Decimal("1.00"), noon_in_paris, datetime.time(12, tzinfo=paris)]
    assert identical(same, copy.deepcopy(same))


paris = datetime.timezone(datetime.timedelta(hours=1))
noon_in_paris = datetime.datetime(2026, 11, 27, 12, tzinfo=paris)


class AmbiguousEquality:
    """As a numpy array: ``==`` gives something that refuses to be a bool."""

    def __eq__(self, other: object) -> Any:
        return self

    def __bool__(self) -> bool:
        raise ValueError("the truth value of an array is ambiguous")

    __hash__ = object.__hash__
