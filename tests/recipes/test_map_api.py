"""PulsarMap's methods and local view, against the real broker (two replicas in one process)."""

from __future__ import annotations

import asyncio
import copy
import json
import pickle
from typing import Any

import pytest

from pulsar_state import BytesCodec, ClosedError, ConfigurationError, JsonCodec
from recipes import FrozenDict, FrozenList, MapEntry, PulsarMap, thaw
from recipes.map import PROTECTED_PREFIX
from tests.recipes.helpers import WAIT_S, new_map


async def test_pip_reads_and_writes(service_url: str, admin_url: str, topic: str) -> None:
    async with (
        new_map(service_url, topic, admin_url) as writer,
        new_map(service_url, topic, admin_url) as reader,
    ):
        assert await writer.get("a") is None
        assert await writer.get_or_default("a", "none") == "none"
        await writer.put("a", {"n": 1})
        await writer.put("b", [1, 2])
        assert await writer.get("a") == {"n": 1}  # local: the call returned after applying
        assert await reader.get("b", latest=True) == [1, 2]
        assert await reader.get_or_default("zz", 0, latest=True) == 0
        assert await reader.list_keys() == ["a", "b"]

        seen: list[tuple[str, Any]] = []
        count = await reader.scan(lambda key: key != "a", lambda k, v: seen.append((k, v)))
        assert count == 1
        assert seen == [("b", [1, 2])]

        assert await writer.delete("a") is True
        assert await writer.delete("a") is False  # already absent
        assert await reader.get("a", latest=True) is None

        await writer.clear()
        assert await reader.list_keys(latest=True) == []
        assert len(writer) == 0


async def test_update_runs_on_the_latest_value_and_none_deletes(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as a,
        new_map(service_url, topic, admin_url) as b,
    ):

        def increment(key: str, hits: int | None) -> int:
            return (hits or 0) + 1

        # Two replicas racing: every increment counts once, whoever wins the writer.
        results = await asyncio.gather(
            *(m.update("hits", increment) for m in (a, b) for _ in range(15))
        )
        assert sorted(int(hits or 0) for hits in results) == list(range(1, 31))
        assert await b.get("hits", latest=True) == 30

        version = await a.version("hits", latest=True)
        assert await a.update("hits", lambda key, hits: hits) == 30  # unchanged: not written
        assert await a.version("hits") == version

        # fn gets its own copy of the value: changing it in place is safe.
        await a.put("doc", {"tags": ["x"]})

        def add_tag(key: str, doc: dict[str, Any] | None) -> dict[str, Any]:
            assert doc is not None
            doc["tags"].append("y")
            return doc

        assert await a.update("doc", add_tag) == {"tags": ["x", "y"]}
        assert await b.get("doc", latest=True) == {"tags": ["x", "y"]}

        assert await a.update("hits", lambda key, hits: None) is None
        assert "hits" not in a
        assert await a.update("never", lambda key, value: None) is None


async def test_update_multiple_is_one_atomic_write(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        await m.put_all({"acct:a": 10, "acct:b": 20, "acct:c": 30, "other": 1})
        before = m.stats.records_sent
        visited: list[str] = []

        def halve_or_drop(key: str, balance: int) -> int | None:
            visited.append(key)
            return None if key == "acct:c" else balance // 2

        position = await m.update_multiple(lambda key: key.startswith("acct:"), halve_or_drop)
        assert m.stats.records_sent == before + 1
        assert visited == ["acct:a", "acct:b", "acct:c"]  # key order
        assert m.items() == [("acct:a", 5), ("acct:b", 10), ("other", 1)]
        assert (await m.version("acct:a")).position == position
        assert (await m.version("acct:b")).position == position
        assert (await m.version("other")).position < position


async def test_replace_is_compare_and_set_on_the_value(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as a,
        new_map(service_url, topic, admin_url) as b,
    ):
        assert await a.replace("k", None, "v1") is True  # None: only if absent
        assert await b.replace("k", None, "other") is False
        assert await b.replace("k", "wrong", "v2") is False
        assert await b.replace("k", "v1", "v2") is True
        assert await a.get("k", latest=True) == "v2"
        assert await a.replace("k", "v2", None) is True  # value None deletes
        assert await b.get("k", latest=True) is None
        # JSON normalises on the way in: a tuple is stored (and compared) as a list.
        await a.put("t", (1, 2))
        assert await a.replace("t", (1, 2), "matched") is True


async def test_put_if_absent_returns_the_value_now_bound(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        assert await m.put_if_absent("k", "first") == "first"
        assert await m.put_if_absent("k", "second") == "first"
        assert await m.get("k") == "first"


async def test_put_all_is_atomic_and_samza_range_and_all_are_ordered(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as a,
        new_map(service_url, topic, admin_url) as b,
    ):
        position = await a.put_all([("b", 2), ("a", 1), ("d", 4), ("c", 3), ("a", 10)])
        await b.wait_for(position, timeout=WAIT_S)
        assert await b.all() == [("a", 10), ("b", 2), ("c", 3), ("d", 4)]
        assert await b.range("b", "d") == [("b", 2), ("c", 3)]  # half-open
        assert await b.range(None, "b") == [("a", 10)]
        assert await b.range("c", None) == [("c", 3), ("d", 4)]
        assert await b.range("x", "y") == []
        assert {(await b.version(k)).position for k in "abcd"} == {position}
        with pytest.raises(ConfigurationError):
            await b.range(1.5, None)


async def test_bytes_keys_are_ordered_by_unsigned_byte(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url, key_codec=BytesCodec()) as m:
        await m.put_all({b"\xff": 1, b"a": 2, b"ab": 3, b"\x00": 4, b"B": 5})
        assert m.keys() == [b"\x00", b"B", b"a", b"ab", b"\xff"]
        assert await m.range(b"a", b"b") == [(b"a", 2), (b"ab", 3)]


async def test_str_keys_are_ordered_by_code_point(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        await m.put_all({"é": 1, "z": 2, "Z": 3, "aa": 4, "a": 5, "😀": 6})
        keys = m.keys()
        assert keys == ["Z", "a", "aa", "z", "é", "😀"]
        assert keys == sorted(keys, key=lambda k: k.encode("utf-8"))  # = UTF-8 byte order


async def test_int_keys_through_json(service_url: str, admin_url: str, topic: str) -> None:
    async with new_map(service_url, topic, admin_url, key_codec=JsonCodec()) as m:
        await m.put_all({10: "ten", 2: "two", -1: "minus one"})
        assert m.keys() == [-1, 2, 10]
        assert await m.range(0, 10) == [(2, "two")]


async def test_local_view_has_no_io_and_hands_out_read_only_values(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        await m.put_all({"b": {"n": 2}, "a": {"n": 1}})
        assert len(m) == 2
        assert "a" in m
        assert "zz" not in m
        assert m.keys() == ["a", "b"]
        assert list(m) == ["a", "b"]
        assert m.values() == [{"n": 1}, {"n": 2}]
        assert m.items() == [("a", {"n": 1}), ("b", {"n": 2})]
        assert m.get_local("a") == {"n": 1}
        assert m.get_local("zz") is None
        assert m.get_local("zz", "default") == "default"
        # What a read returns is the stored value, read-only: it cannot change the map.
        read_only = [
            m.values()[0],
            m.items()[0][1],
            await m.get("a"),
            await m.get_or_default("a", {}),
            m.get_local("a"),
            m.get_local("a", {}),
            (await m.entry("a")).value,  # type: ignore[union-attr]
            (await m.range(None, None))[0][1],
        ]
        for value in read_only:
            assert isinstance(value, FrozenDict)
            assert isinstance(value, dict)
            with pytest.raises(TypeError, match="read-only"):
                value["n"] = 99
            with pytest.raises(TypeError, match="read-only"):
                value.update(n=99)
        assert m.get_local("a") == {"n": 1}
        # A mutable copy is one call away, and changing it changes nothing in the map.
        mutable = thaw(m.get_local("a"))
        mutable["n"] = 99
        copied = copy.deepcopy(m.get_local("a"))
        copied["n"] = 98
        assert type(mutable) is dict
        assert type(copied) is dict
        assert m.get_local("a") == {"n": 1}


async def test_nested_values_are_frozen_all_the_way_down(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        await m.put("d", {"items": [1, {"x": [2]}], "n": 1})
        value = m.get_local("d")
        assert value == {"items": [1, {"x": [2]}], "n": 1}
        assert isinstance(value["items"], FrozenList)
        with pytest.raises(TypeError, match="read-only"):
            value["items"].append(3)
        with pytest.raises(TypeError, match="read-only"):
            value["items"][1]["x"] += [3]
        # JSON, pickle and equality see plain dicts and lists.
        assert json.loads(json.dumps(value)) == value
        unpickled = pickle.loads(pickle.dumps(value))
        assert type(unpickled) is dict
        assert type(unpickled["items"]) is list
        unpickled["items"].append(3)
        # update functions get a mutable copy: changing it in place is fine.
        await m.update("d", lambda key, current: {**current, "items": current["items"] + [3]})
        assert m.get_local("d") == {"items": [1, {"x": [2]}, 3], "n": 1}


async def test_versions_are_the_changes_that_set_the_keys(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as a,
        new_map(service_url, topic, admin_url) as b,
    ):
        assert await a.version("k") == 0
        # Concurrent puts from two replicas, group-committed: each key's version is exactly
        # the version its own write returned, on both replicas.
        keys = [f"k{i}" for i in range(20)]
        versions = await asyncio.gather(
            *((a if i % 2 else b).put(key, i) for i, key in enumerate(keys))
        )
        assert len(set(versions)) == len(versions)
        await a.sync()
        await b.sync()
        for key, version in zip(keys, versions, strict=True):
            assert await a.version(key) == version
            assert await b.version(key) == version
            assert await b.entry(key) == MapEntry(keys.index(key), version)
            assert version.position <= a.position
        assert await a.entry("absent") is None


async def test_group_committed_writes_to_one_key_have_distinct_versions(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as a,
        new_map(service_url, topic, admin_url) as b,
    ):
        # Issue 11 (e): both puts land in one record; each must get its own version, and a
        # compare-and-set on x's version must fail once y has overwritten it.
        for _ in range(5):
            x, y = await asyncio.gather(a.put("k", "x"), a.put("k", "y"))
            assert x != y
            assert x.position == y.position  # group-committed: one record
            assert x < y  # ordered like the log
            assert await a.version("k") == y
            assert await b.version("k", latest=True) == y  # the same on every replica
            assert await a.replace_version("k", x, "lost update") is False
            assert await a.get("k") == "y"
            assert await a.replace_version("k", y, "next") is True


async def test_entries_are_every_key_with_its_version_from_one_state(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as a,
        new_map(service_url, topic, admin_url) as b,
    ):
        assert await b.entries(latest=True) == []
        first = await a.put_all({"b": {"n": 1}, "a": 1})
        second = await a.put("c", "x")
        found = await b.entries(latest=True)
        assert [(key, entry.value, entry.version.position) for key, entry in found] == [
            ("a", 1, first),
            ("b", {"n": 1}, first),
            ("c", "x", second.position),
        ]
        assert found[2][1].version == second
        local = await a.entries()  # latest=False: this replica, no I/O
        assert [key for key, _ in local] == ["a", "b", "c"]
        with pytest.raises(TypeError, match="read-only"):
            local[1][1].value["n"] = 99  # the stored value, read-only
        assert await a.get("b") == {"n": 1}

        # Every write sets all the keys at once: a read from one state sees them all with the
        # same value and version, however the reads and writes interleave.
        keys = [f"k{i:02d}" for i in range(30)]

        async def write_rounds() -> None:
            for n in range(20):
                await a.put_all({key: n for key in keys})

        async def read_rounds() -> int:
            reads = 0
            while not writer.done():
                entries = await b.entries(latest=True)
                found = [entry for key, entry in entries if key in keys]
                if found:
                    assert len(found) == len(keys)
                    assert len({(e.value, e.version.position) for e in found}) == 1, found
                reads += 1
            return reads

        writer = asyncio.ensure_future(write_rounds())
        assert await asyncio.wait_for(read_rounds(), WAIT_S) > 0
        await writer


async def test_replace_version_is_compare_and_set_on_the_version(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as a,
        new_map(service_url, topic, admin_url) as b,
    ):
        assert await a.replace_version("lock", 0, "a") is True  # 0: only if absent
        assert await b.replace_version("lock", None, "b") is False  # None: same
        version = await b.version("lock", latest=True)
        assert version > 0
        assert await b.replace_version("lock", version, "b") is True
        assert await a.replace_version("lock", version, "a-again") is False  # stale version
        newer = await a.version("lock", latest=True)
        assert newer > version
        assert await a.get("lock") == "b"
        assert await a.replace_version("lock", newer, None) is True  # delete at that version
        assert await b.version("lock", latest=True) == 0


async def test_lifecycle_errors(service_url: str, admin_url: str, topic: str) -> None:
    with pytest.raises(ConfigurationError, match="apply"):
        PulsarMap(service_url, topic, admin_url=admin_url, apply=lambda s, op: None)
    m = new_map(service_url, topic, admin_url)
    with pytest.raises(ClosedError):
        await m.get("a")
    with pytest.raises(ClosedError):
        len(m)
    with pytest.raises(ClosedError):
        m.get_local("a")
    async with m:
        await m.put("a", 1)
        assert m.get_local("a") == 1
        assert m.position == 1
        assert m.stats.writes_committed == 1
        assert m.manager.position == 1
        assert m.topic == topic
    with pytest.raises(ClosedError):
        await m.put("a", 2)
    with pytest.raises(ClosedError):
        "a" in m  # noqa: B015
    with pytest.raises(ClosedError):
        m.get_local("a")


class Box:
    """A value type that cannot be frozen: readers must get copies of it."""

    def __init__(self, items: list[int]) -> None:
        self.items = items

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Box) and other.items == self.items


class BoxCodec:
    def encode(self, value: Box) -> bytes:
        return bytes(value.items)

    def decode(self, data: bytes) -> Box:
        return Box(list(data))


async def test_values_that_cannot_be_frozen_are_read_as_copies(
    service_url: str, admin_url: str, topic: str
) -> None:
    m: PulsarMap[str, Box] = PulsarMap(
        service_url, topic, admin_url=admin_url, value_codec=BoxCodec()
    )
    async with m:
        await m.put("b", Box([1]))
        for read in (m.get_local("b"), await m.get("b"), m.values()[0], m.items()[0][1]):
            assert read is not None
            read.items.append(99)
        assert m.get_local("b") == Box([1])
        assert (await m.get("b")) == Box([1])


async def test_map_opened_from_a_snapshot_reads_the_loaded_state_everywhere(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Issue 11 (f): snapshots with the map's own codec; every view reads the loaded state.
    async with new_map(service_url, topic, admin_url, snapshots=True) as writer:
        await writer.put_all({"a": 1, "b": {"n": 2}})
        await writer.put("c", [3])
        assert await writer.snapshot() == writer.position
        await writer.put("d", 4)  # after the snapshot: replayed
        expected = await writer.entries()
    async with new_map(service_url, topic, admin_url, snapshots=True) as m:
        assert m.stats.snapshot_loaded_position == 2
        assert await m.entries() == expected
        assert len(m) == 4
        assert m.keys() == ["a", "b", "c", "d"]
        assert m.get_local("b") == {"n": 2}
        assert "a" in m
        async with m.changes() as watch:
            first = await watch.next(timeout=WAIT_S)
            assert first is not None
            assert (first.key, first.value) == ("a", 1)
            await m.put("e", 5)
            assert len(m) == 5
    with pytest.raises(ConfigurationError, match="snapshot_codec"):
        PulsarMap(service_url, topic, admin_url=admin_url, snapshot_codec=JsonCodec())


async def test_map_from_automatic_snapshots_equals_a_full_replay(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Issue 13 (4): no codec argument; snapshots taken by the writer's policy; values, versions
    # and order after loading one (plus the records after it) are those of a full replay.
    async with new_map(
        service_url, topic, admin_url, snapshots=True, snapshot_every_records=25
    ) as writer:
        for i in range(300):
            key = f"k{i % 40:02d}"
            if i % 7 == 3:
                await writer.delete(key)
            else:
                await writer.put(key, {"i": i, "tags": [i % 3]})
        expected = await writer.entries(latest=True)
    async with new_map(service_url, topic, admin_url, snapshots=True) as loaded:
        assert loaded.stats.snapshot_loaded_position is not None
        assert loaded.stats.snapshot_loaded_position >= 200
        assert loaded.stats.records_read < 100  # only the records after the snapshot
        loaded_entries = await loaded.entries()
    async with new_map(
        service_url, topic, admin_url, snapshots=True, load_snapshot=False
    ) as replayed:
        assert replayed.stats.snapshot_loaded_position is None
        replayed_entries = await replayed.entries()
    assert loaded_entries == replayed_entries == expected


async def test_swapping_absent_for_absent_is_not_a_change(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Issue 11 (h): delete-if-absent on an absent key changed nothing, yet returned True.
    async with new_map(service_url, topic, admin_url) as m:
        assert await m.replace("nokey", None, None) is False
        assert await m.replace_version("nokey", 0, None) is False
        assert await m.replace_version("nokey", None, None) is False
        assert "nokey" not in m
        await m.put("k", 1)
        assert await m.replace("k", 1, None) is True  # a real delete still succeeds
        assert "k" not in m


async def test_clear_and_update_multiple_keep_the_protected_keys(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A Spark sink's exactly-once marker lives under PROTECTED_PREFIX in the same map: a
    # clear() of the data (or a bulk delete) that removed it made the sink apply its
    # batches again.
    marker = PROTECTED_PREFIX + "job"
    async with new_map(service_url, topic, admin_url) as m:
        await m.put_all({"a": 1, "b": {"n": 2}, marker: 7})
        await m.clear()
        assert await m.all(latest=True) == [(marker, 7)]
        position = m.position
        await m.clear()  # only protected keys left: nothing to clear, nothing appended
        assert m.position == position
        await m.put_all({"c": 3, "d": 4})
        await m.update_multiple(lambda k: True, lambda k, v: None)
        assert await m.all(latest=True) == [(marker, 7)]
        assert await m.delete(marker)  # named: changed like any key
        assert await m.all(latest=True) == []
