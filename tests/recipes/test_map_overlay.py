"""The writer's trial run works on an overlay of the live map: batches that mix inserts,
deletes, whole-map updates and failing writes give exactly what every replica applies, and a
refused write leaves no trace."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from recipes import PulsarMap
from recipes._map_ops import MapState
from tests.recipes.helpers import new_map


def state_of(m: PulsarMap[str, Any]) -> MapState[str, Any]:
    return m.manager.read_local(lambda state: state)


def assert_consistent(m: PulsarMap[str, Any]) -> None:
    """The live state's three views of the map agree."""
    state = state_of(m)
    assert list(state.sorted_keys()) == sorted(state.entries)
    assert dict(state.values) == {key: entry.value for key, entry in state.entries.items()}


async def test_mixed_batches_give_what_replicas_apply(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as writer,
        new_map(service_url, topic, admin_url) as other,
    ):
        await writer.put_all({f"k{i}": i for i in range(10)})

        def bump_all(key: str, value: Any) -> Any:
            return None if value == 3 else value + 100

        def failing(view: Mapping[str, Any]) -> Mapping[str, Any]:
            raise RuntimeError("refused")

        for round_ in range(5):
            # Issued together, so they are built as one batch on one trial state: each sees
            # the earlier ones' changes (new keys, deleted keys) in key order.
            calls = [
                writer.put(f"new{round_}", round_),
                writer.delete("k1"),
                writer.update_multiple(lambda key: True, bump_all),
                writer.transact(failing),
                writer.put_if_absent("k1", -1),
                writer.update("k2", lambda key, value: None),
                writer.transact(
                    lambda view: {"sum": sum(v for k, v in view.items() if k != "sum")}
                ),
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert isinstance(results[3], RuntimeError)
            assert all(not isinstance(r, BaseException) for i, r in enumerate(results) if i != 3)
            await other.sync()
            assert state_of(writer) == state_of(other)
            assert writer.items() == other.items()
            assert_consistent(writer)
            assert_consistent(other)
        # A replica opened now replays the same history to the same state.
        async with new_map(service_url, topic, admin_url) as late:
            assert state_of(late) == state_of(writer)
            assert late.keys() == writer.keys()


async def test_a_refused_write_in_a_batch_leaves_no_trace(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url, max_record_bytes=4096) as m:
        await m.put_all({"a": 1, "b": 2})
        before = state_of(m).copy()

        def big_and_new(view: Mapping[str, Any]) -> Mapping[str, Any]:
            return {"a": None, "c": 3, "huge": "x" * 10_000}  # over max_record_bytes

        def raising_half_way(key: str, value: Any) -> Any:
            if key == "b":
                raise ValueError("no")
            return value + 1

        results = await asyncio.gather(
            m.transact(big_and_new),
            m.update_multiple(lambda key: True, raising_half_way),
            return_exceptions=True,
        )
        assert [type(r).__name__ for r in results] == ["RecordTooLargeError", "ValueError"]
        assert state_of(m) == before
        assert m.items() == [("a", 1), ("b", 2)]
        assert_consistent(m)
        # The next write sees the map as it was.
        assert await m.transact(lambda view: {"c": sorted(view)}) is not None
        assert m.get_local("c") == ["a", "b"]


@pytest.mark.parametrize("count", [3, 40])
async def test_scans_after_inserts_and_deletes_stay_ordered(
    service_url: str, admin_url: str, topic: str, count: int
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        await m.put_all({f"k{i:03d}": i for i in range(0, 2 * count, 2)})
        for i in range(1, 2 * count, 4):
            await m.put(f"k{i:03d}", i)
            await m.delete(f"k{i + 1:03d}")
            keys = await m.list_keys()
            assert keys == sorted(keys)
            assert [k for k, _ in await m.range("k010", "k020")] == [
                k for k in keys if "k010" <= k < "k020"
            ]
            seen: list[str] = []
            await m.scan(
                lambda key: key.endswith("1"), lambda key, value, out=seen: out.append(key)
            )
            assert seen == [k for k in keys if k.endswith("1")]
        assert_consistent(m)
