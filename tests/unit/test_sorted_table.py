"""The sorted table behind a PulsarMap: keys in key order with their values and versions,
checked against a plain dict through inserts, overwrites, deletes, clears, runs splitting
and merging (small loads), mixed key types and range bounds of any type."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recipes._sorted_table import SortedTable, key_order

any_key = st.one_of(st.integers(-5, 5), st.text("abc", max_size=2), st.binary(max_size=2))
str_key = st.text("abcd", min_size=1, max_size=3)


def check_against(table: SortedTable[Any, Any], model: dict[Any, tuple[Any, int]]) -> None:
    expected = sorted(model, key=key_order)
    assert list(table) == expected
    assert len(table) == len(model)
    assert list(table.items()) == [(key, *model[key]) for key in expected]
    for key in expected:
        assert table.version(key) == model[key][1]


def in_range(keys: list[Any], low: Any, high: Any) -> list[Any]:
    return [
        key
        for key in keys
        if (low is None or key_order(key) >= key_order(low))
        and (high is None or key_order(key) < key_order(high))
    ]


@settings(max_examples=300, deadline=None)
@given(
    script=st.lists(
        st.tuples(st.sampled_from(["put", "put", "remove", "clear"]), any_key), max_size=60
    ),
    load=st.integers(2, 5),
    low=st.one_of(st.none(), any_key),
    high=st.one_of(st.none(), any_key),
)
def test_the_table_follows_a_dict_through_any_changes(
    script: list[tuple[str, Any]], load: int, low: Any, high: Any
) -> None:
    table: SortedTable[Any, Any] = SortedTable(load=load)
    model: dict[Any, tuple[Any, int]] = {}
    for version, (action, key) in enumerate(script, start=1):
        if action == "put":
            assert table.put(key, f"v{version}", version) is (key not in model)
            model[key] = (f"v{version}", version)
        elif action == "remove":
            assert table.remove(key) is (key in model)
            model.pop(key, None)
        else:
            table.clear()
            model.clear()
        check_against(table, model)
    ordered = sorted(model, key=key_order)
    assert table.keys_between(low, high) == in_range(ordered, low, high)
    assert table.items_between(low, high) == [
        (key, model[key][0]) for key in in_range(ordered, low, high)
    ]
    copied = table.copy()
    check_against(copied, model)
    copied.put("zz-only-in-the-copy", "x", 0)
    check_against(table, model)
    rebuilt = SortedTable([(key, *model[key]) for key in model], load=load)
    check_against(rebuilt, model)
    assert rebuilt.items_between(low, high) == table.items_between(low, high)


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(str_key, unique=True, max_size=80), load=st.integers(2, 4))
def test_many_runs_split_and_merge_back(keys: list[str], load: int) -> None:
    table: SortedTable[str, int] = SortedTable(load=load)
    for i, key in enumerate(keys):
        table.put(key, i, i)
    for i, key in enumerate(keys):
        if i % 3:
            assert table.remove(key)
    model = {key: (i, i) for i, key in enumerate(keys) if not i % 3}
    check_against(table, model)
    assert not table.remove("not there")
    assert table.version("not there") is None
    assert table.version(7) is None  # another key type: not there, no error


def test_versions_hold_64_bits_and_a_load_below_two_is_refused() -> None:
    table: SortedTable[str, str] = SortedTable()
    table.put("a", "x", (1 << 62) + 5)
    assert table.version("a") == (1 << 62) + 5
    with pytest.raises(ValueError, match="load"):
        SortedTable(load=1)
