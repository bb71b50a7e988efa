"""PulsarMap.transact: a conditional multi-key write (adds, changes, deletes) in one record."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from pulsar_state import CodecError, RecordTooLargeError
from recipes import PulsarMap
from tests.recipes.helpers import WAIT_S, new_map
from tests.recipes.test_map_sync import sync_map


async def test_adds_changes_and_deletes_in_one_write(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as a,
        new_map(service_url, topic, admin_url) as b,
    ):
        await a.put_all({"keep": 1, "bump": 10, "drop": "x"})
        seen: list[tuple[list[str], int, Any, bool]] = []

        def fn(view: Mapping[str, Any]) -> Mapping[str, Any]:
            seen.append((list(view), len(view), view.get("bump"), "drop" in view))
            return {"bump": view["bump"] + 1, "new": {"n": 1}, "drop": None, "keep": 1}

        position = await a.transact(fn)
        assert position is not None
        assert seen[-1] == (["bump", "drop", "keep"], 3, 10, True)  # the view, in key order
        await b.wait_for(position, timeout=WAIT_S)
        assert await b.all() == [("bump", 11), ("keep", 1), ("new", {"n": 1})]
        # Changed and added keys carry the write's position; the unchanged one does not.
        assert (await b.version("bump")).position == position
        assert (await b.version("new")).position == position
        assert (await b.version("keep")).position < position


async def test_no_change_writes_nothing_and_returns_none(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        await m.put("a", 1)
        version = await m.version("a")
        assert await m.transact(lambda view: {}) is None
        assert await m.transact(lambda view: {"a": 1, "absent": None}) is None
        assert await m.all(latest=True) == [("a", 1)]
        assert await m.version("a") == version


async def test_decides_on_the_up_to_date_map_across_replicas(
    service_url: str, admin_url: str, topic: str
) -> None:
    """Racing replicas each add a new key and bump a counter read in the same write: every
    call counts once, so the counter equals the number of keys added."""
    async with (
        new_map(service_url, topic, admin_url) as a,
        new_map(service_url, topic, admin_url) as b,
    ):

        def add(name: str) -> Any:
            def fn(view: Mapping[str, Any]) -> Mapping[str, Any]:
                return {f"seen/{name}": True, "count": view.get("count", 0) + 1}

            return fn

        calls = [
            m.transact(add(f"{label}{i}")) for label, m in (("a", a), ("b", b)) for i in range(15)
        ]
        positions = await asyncio.gather(*calls)
        assert all(position is not None for position in positions)
        assert await b.get("count", latest=True) == 30
        assert len(await b.range("seen/", "seen0")) == 30


async def test_view_values_are_copies(service_url: str, admin_url: str, topic: str) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        await m.put("d", {"items": [1]})

        def fn(view: Mapping[str, Any]) -> Mapping[str, Any]:
            value = view["d"]
            value["items"].append(2)  # the caller's own copy
            assert view["d"] == {"items": [1]}
            return {}

        assert await m.transact(fn) is None
        assert m.get_local("d") == {"items": [1]}


async def test_failures_write_nothing(service_url: str, admin_url: str, topic: str) -> None:
    async with new_map(service_url, topic, admin_url, max_record_bytes=4096) as m:
        await m.put("a", 1)
        position = m.position

        def boom(view: Mapping[str, Any]) -> Mapping[str, Any]:
            raise ValueError("no")

        with pytest.raises(ValueError, match="no"):
            await m.transact(boom)
        with pytest.raises(CodecError):
            await m.transact(lambda view: {"a": 2, "b": object()})
        with pytest.raises(RecordTooLargeError):
            await m.transact(lambda view: {f"k{i}": "x" * 100 for i in range(100)})
        assert await m.all(latest=True) == [("a", 1)]
        assert m.position == position


def test_sync_transact(service_url: str, admin_url: str, topic: str) -> None:
    with sync_map(service_url, topic, admin_url) as m:
        position = m.transact(lambda view: {"x": (view.get("x") or 0) + 5})
        assert position is not None
        assert m.get("x") == 5
        assert m.version("x").position == position
        assert isinstance(m.async_map, PulsarMap)
