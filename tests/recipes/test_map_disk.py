"""PulsarMap on a local disk store (issue 18), against a real broker and real disk: it answers
as the in-memory map, resumes from its store replaying only the tail, refuses (or rebuilds) a
store of another history, builds itself from a snapshot, and a replica SIGKILLed at any moment
reopens to exactly a record boundary of the log."""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import random
import signal
import sys
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from pulsar_state import ClosedError, JsonCodec, LogMark, SnapshotManifest, StrCodec
from pulsar_state._envelope import encode_manifest
from pulsar_state.testing import admin_request
from recipes import DiskStore, LocalStoreError, MapEvent, PulsarMap
from recipes._map_disk import DiskMapState
from recipes._map_ops import MapCodecs
from tests.core.helpers import raw_producer
from tests.recipes.helpers import REPO, WAIT_S, new_map
from tests.support.trimming import (
    NO_RETENTION,
    close_ledger_and_trim,
    ledgers,
    set_policy,
    trim_ledger_away,
)

KEYS = [f"k{i:02d}" for i in range(40)]


async def answers(m: PulsarMap[str, Any]) -> dict[str, Any]:
    """Every read API of the map, on its local state."""
    scanned: list[tuple[str, Any]] = []
    await m.scan(lambda k: k.startswith("k1"), lambda k, v: scanned.append((k, v)))
    return {
        "all": await m.all(),
        "entries": [(k, e.value, int(e.version)) for k, e in await m.entries()],
        "list_keys": await m.list_keys(),
        "range": await m.range("k05", "k12"),
        "range_open": await m.range(None, "k03"),
        "scan": scanned,
        "len": len(m),
        "keys": m.keys(),
        "values": m.values(),
        "items": m.items(),
        "get_local": {k: m.get_local(k) for k in KEYS[:12]},
        "get": {k: await m.get(k) for k in KEYS[:12]},
        "version": {k: int(await m.version(k)) for k in KEYS[:12]},
        "in": {k: k in m for k in KEYS[:12]},
        "entry": {k: await m.entry(k) for k in KEYS[:5]},
    }


def event_tuple(event: MapEvent[str, Any]) -> tuple[Any, ...]:
    return (event.kind, event.key, event.value, int(event.version), event.position)


async def random_op(m: PulsarMap[str, Any], rng: random.Random) -> Any:
    key = rng.choice(KEYS)
    roll = rng.random()
    if roll < 0.3:
        return int(
            await m.put(key, {"n": rng.randrange(100), "tags": ["a", "b"][: rng.randrange(3)]})
        )
    if roll < 0.45:
        return await m.put_all(
            {rng.choice(KEYS): rng.randrange(100) for _ in range(rng.randrange(1, 6))}
        )
    if roll < 0.55:
        return await m.delete(key)
    if roll < 0.63:
        return await m.update(key, lambda _k, v: rng.randrange(5) if v is None else None)
    if roll < 0.7:
        return await m.replace(key, rng.randrange(100), rng.randrange(100))
    if roll < 0.75:
        return await m.put_if_absent(key, "first")
    if roll < 0.8:
        return await m.replace_version(key, int(await m.version(key)), "cas")
    if roll < 0.88:
        other = rng.choice(KEYS)
        return await m.transact(lambda view: {other: len(view), key: None if key in view else 1})
    if roll < 0.94:
        digit = rng.choice("0123")
        return await m.update_multiple(
            lambda k: k.startswith(f"k{digit}"), lambda _k, v: None if v == 0 else 0
        )
    if roll < 0.97:
        return await m.clear()
    return await m.put(key, "x" * 300)


async def test_disk_map_answers_as_the_memory_map(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    # A model check: the same random operations, written from either map, read from both.
    rng = random.Random(1807)
    async with (
        new_map(service_url, topic, admin_url) as memory,
        new_map(
            service_url, topic, admin_url, store=DiskStore(tmp_path / "s", cache_bytes=4000)
        ) as disk,
    ):
        watches = [memory.changes(), disk.changes(prefix="k1")]
        for round_ in range(5):
            for _ in range(12):
                await random_op(rng.choice([memory, disk]), rng)
            await memory.sync()
            await disk.sync()
            assert memory.position == disk.position
            assert await answers(disk) == await answers(memory), f"round {round_}"
        seen: list[list[tuple[Any, ...]]] = []
        for watch in watches:
            events: list[tuple[Any, ...]] = []
            while True:
                try:
                    event = await watch.next(timeout=0.5)
                except Exception:
                    break
                assert event is not None
                events.append(event_tuple(event))
            watch.close()
            seen.append(events)
        expected = [e for e in seen[0] if e[0] == "clear" or str(e[1]).startswith("k1")]
        assert seen[1] == expected
        assert disk._disk is not None
        assert disk._disk.cache.size_bytes <= 4000


async def test_reopening_replays_only_the_tail(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    store = DiskStore(tmp_path / "s")
    async with new_map(service_url, topic, admin_url, store=store) as disk:
        for i in range(12):
            await disk.put(f"k{i:02d}", i)
        stored_at = disk.position
    async with new_map(service_url, topic, admin_url) as memory:
        for i in range(4):
            await memory.put(f"t{i}", i)
        await memory.delete("k03")
        expected = await answers(memory)
        tail = memory.position - stored_at
    async with new_map(service_url, topic, admin_url, store=store) as disk:
        assert disk.stats.resumed_position == stored_at
        assert disk.stats.records_read == tail == 5  # only the tail, not the 17 records
        assert disk.position == stored_at + tail
        assert await answers(disk) == expected
    async with new_map(service_url, topic, admin_url, store=store) as disk:
        assert disk.stats.resumed_position == stored_at + tail
        assert disk.stats.records_read == 0
        assert await answers(disk) == expected


def delete_topic(admin_url: str, topic: str) -> None:
    local = topic.removeprefix("persistent://")
    admin_request(admin_url, "DELETE", f"/admin/v2/persistent/{local}?force=true")


async def test_a_store_of_another_topic_is_refused(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    store = DiskStore(tmp_path / "s")
    async with new_map(service_url, topic, admin_url, store=store) as disk:
        await disk.put("a", 1)
    other = new_map(service_url, topic + "-other", admin_url, store=store)
    with pytest.raises(LocalStoreError, match="holds the map of topic"):
        await other.open()
    await other.aclose()
    async with new_map(service_url, topic, admin_url, store=store) as disk:
        assert disk.stats.resumed_position == 1
        assert disk.get_local("a") == 1


@pytest.mark.parametrize("new_records", [0, 40])
async def test_a_store_of_a_recreated_topic_is_refused_or_rebuilt(
    service_url: str, admin_url: str, topic: str, tmp_path: Path, new_records: int
) -> None:
    # 0: the new topic is empty (the stored mark is past its tail); 40: more records than
    # the store holds (20), so its position exists there: positions alone would not tell.
    path = tmp_path / "s"
    async with new_map(service_url, topic, admin_url, store=DiskStore(path)) as disk:
        for i in range(20):
            await disk.put(f"old{i}", i)
    delete_topic(admin_url, topic)
    async with new_map(service_url, topic, admin_url) as memory:
        for i in range(new_records):
            await memory.put(f"new{i}", i)
        expected = await answers(memory)
    refused = new_map(service_url, topic, admin_url, store=DiskStore(path))
    with pytest.raises(LocalStoreError, match=r"not part of .* history"):
        await refused.open()
    await refused.aclose()
    untouched = DiskMapState(DiskStore(path), MapCodecs(StrCodec(), JsonCodec()), "")
    untouched.bind_topic(str(refused.manager.topic))
    untouched.open_store()
    assert untouched.mark is not None
    assert untouched.mark.position == 20
    untouched.close_store()
    rebuild = DiskStore(path, on_mismatch="rebuild")
    async with new_map(service_url, topic, admin_url, store=rebuild) as disk:
        assert disk.stats.resumed_position is None
        assert disk.position == new_records
        assert await answers(disk) == expected
    async with new_map(service_url, topic, admin_url, store=DiskStore(path)) as disk:
        assert disk.stats.resumed_position == (new_records or None)
        assert await answers(disk) == expected


async def test_a_new_store_is_built_from_the_newest_snapshot_and_the_tail(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    store = DiskStore(tmp_path / "s")
    async with new_map(service_url, topic, admin_url, snapshots=True) as memory:
        for i in range(20):
            await memory.put(f"k{i:02d}", {"i": i})
        snapshot_at = await memory.snapshot()
        for i in range(5):
            await memory.put(f"t{i}", i)
        expected = await answers(memory)
    async with new_map(service_url, topic, admin_url, snapshots=True, store=store) as disk:
        assert disk.stats.snapshot_loaded_position == snapshot_at
        assert disk.stats.records_read == 5
        assert await answers(disk) == expected
        # A disk map's own snapshot is byte for byte the memory map's: a memory replica
        # loads it, and the determinism check of a replaying one agrees.
        await disk.put("after", 1)
        taken_at = await disk.snapshot()
        expected = await answers(disk)
    async with (
        new_map(service_url, topic, admin_url, snapshots=True) as loaded,
        new_map(service_url, topic, admin_url, snapshots=True, load_snapshot=False) as replayed,
    ):
        assert loaded.stats.snapshot_loaded_position == taken_at
        assert await answers(loaded) == expected
        assert await answers(replayed) == expected
        assert replayed.stats.determinism_failures == 0
    async with new_map(service_url, topic, admin_url, snapshots=True, store=store) as disk:
        assert disk.stats.resumed_position == taken_at
        assert disk.stats.snapshot_loaded_position is None
        assert disk.stats.records_read == 0


async def test_a_damaged_snapshot_stores_nothing_and_the_store_falls_back(
    service_url: str, admin_url: str, topic: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The newest manifest's digest does not match its chunks (many small ones): the store had
    # them streamed in by then, so its transaction must abort; the good snapshot is loaded.
    small_chunks = {"snapshots": True, "snapshot_chunk_bytes": 64}
    async with new_map(service_url, topic, admin_url, **small_chunks) as memory:
        await memory.put_all({f"k{i:02d}": i for i in range(30)})
        good = await memory.manager.snapshot()
        await memory.put("t", 1)
        expected = await answers(memory)
    fields = {name: getattr(good, name) for name in good.__dataclass_fields__}
    forged = SnapshotManifest(**{**fields, "digest": "0" * 64})  # the same chunks
    async with raw_producer(service_url, topic + "-snapshot-index") as producer:
        await producer.send(encode_manifest(forged), partition_key="forged")
    store = DiskStore(tmp_path / "s")
    with caplog.at_level(logging.WARNING, logger="pulsar_state"):
        async with new_map(service_url, topic, admin_url, snapshots=True, store=store) as disk:
            assert disk.stats.snapshot_loaded_position == good.position
            assert await answers(disk) == expected
    assert "does not match its digest" in caplog.text


TRIMMING: dict[str, Any] = {"snapshots": True, "trim_history": True, "keep_snapshots": 1}


async def trimmed_map_topic(
    service_url: str, admin_url: str, topic: str, stale_store: DiskStore | None = None
) -> tuple[dict[str, Any], int]:
    """A map topic whose first ledger the broker deleted, with a snapshot and a tail after it;
    returns the answers of its map and the snapshot's position. A disk replica on
    ``stale_store`` took part before the trim: its store's mark is in the deleted ledger."""
    await set_policy(admin_url, topic, "retention", NO_RETENTION)
    if stale_store is not None:
        async with new_map(service_url, topic, admin_url, store=stale_store, **TRIMMING) as stale:
            for i in range(10):
                await stale.put(f"k{i:02d}", {"stale": i})
    async with new_map(service_url, topic, admin_url, **TRIMMING) as writer:
        for i in range(10):
            await writer.put(f"k{i:02d}", i)
        await writer.snapshot()
        await close_ledger_and_trim(admin_url, topic)
        first = ledgers(admin_url, topic)[0]
        for i in range(20):
            await writer.put(KEYS[5 + i], {"second": i})
        await writer.delete("k01")
        kept = await writer.snapshot()  # keep 1: the trim point passes the first ledger
        await trim_ledger_away(admin_url, topic, first)
        for i in range(3):
            await writer.put(f"t{i}", i)  # a tail after the snapshot
        return await answers(writer), kept


async def write_then_resume(
    disk: PulsarMap[str, Any], store: DiskStore, service_url: str, admin_url: str, topic: str
) -> None:
    """A write on ``disk`` (open on ``store``, which it then closes); reopened, the store
    resumes where it was, with nothing to read."""
    await disk.put("after", 1)
    expected = await answers(disk)
    stored_at = disk.position
    await disk.aclose()
    async with new_map(service_url, topic, admin_url, store=store, **TRIMMING) as resumed:
        assert resumed.stats.resumed_position == stored_at
        assert resumed.stats.records_read == 0
        assert await answers(resumed) == expected


async def test_a_disk_replica_replaying_a_trimmed_log_falls_forward_into_its_store(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    expected, _ = await trimmed_map_topic(service_url, admin_url, topic)
    store = DiskStore(tmp_path / "s")
    # load_snapshot=False: it replays from the log's first message, whose records are based
    # on records the broker deleted: the snapshot it falls forward to is stored on disk.
    async with new_map(
        service_url, topic, admin_url, store=store, load_snapshot=False, **TRIMMING
    ) as disk:
        assert disk.manager.halted is None
        assert disk.stats.fell_forward == 1
        assert await answers(disk) == expected
        await write_then_resume(disk, store, service_url, admin_url, topic)


async def test_a_store_behind_the_trimmed_history_falls_forward_to_a_snapshot(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    # Its mark's message was trimmed away while it was closed: the newest snapshot names the
    # same history (origin), so it is stale, not foreign, and that snapshot replaces it (no
    # record is read on top of the trimmed mark), with no option.
    store = DiskStore(tmp_path / "s")
    expected, kept = await trimmed_map_topic(service_url, admin_url, topic, stale_store=store)
    async with new_map(service_url, topic, admin_url, store=store, **TRIMMING) as disk:
        assert disk.manager.halted is None
        assert disk.stats.resumed_position is None
        assert disk.stats.snapshot_loaded_position == kept
        assert disk.stats.records_read == 3
        assert await answers(disk) == expected
        await write_then_resume(disk, store, service_url, admin_url, topic)


async def test_a_store_of_a_recreated_topic_is_refused_under_trim_history_too(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    # The old history's snapshots are still on the side topics, with the store's origin:
    # they do not describe the topic as it is now, so they prove nothing.
    path = tmp_path / "s"
    await set_policy(admin_url, topic, "retention", NO_RETENTION)
    async with new_map(service_url, topic, admin_url, store=DiskStore(path), **TRIMMING) as disk:
        for i in range(20):
            await disk.put(f"old{i}", i)
        await disk.snapshot()
    delete_topic(admin_url, topic)
    await set_policy(admin_url, topic, "retention", NO_RETENTION)
    async with new_map(service_url, topic, admin_url, **TRIMMING) as memory:
        for i in range(40):
            await memory.put(f"new{i}", i)
        await memory.snapshot()
    refused = new_map(service_url, topic, admin_url, store=DiskStore(path), **TRIMMING)
    with pytest.raises(LocalStoreError, match=r"not part of .* history"):
        await refused.open()
    await refused.aclose()


async def test_a_full_disk_halts_the_replica_and_loses_nothing(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    path = tmp_path / "s"
    async with (
        new_map(service_url, topic, admin_url) as memory,
        new_map(service_url, topic, admin_url, store=DiskStore(path, map_size=256 * 1024)) as disk,
    ):
        for batch in range(12):
            await memory.put_all({f"k{batch}-{i}": "x" * 4000 for i in range(10)})
        for _ in range(int(WAIT_S / 0.05)):
            if disk.manager.halted is not None:
                break
            await asyncio.sleep(0.05)
        halted = disk.manager.halted
        assert halted is not None
        assert "could not store record" in str(halted)
        assert disk._disk is not None
        mark = disk._disk.mark
        assert mark is not None
        assert mark.position == disk.position < memory.position
        expected = await answers(memory)
    # The log is the durable copy: with room again, the store resumes and catches up.
    async with new_map(service_url, topic, admin_url, store=DiskStore(path)) as disk:
        assert disk.stats.resumed_position == mark.position
        assert await answers(disk) == expected


def read_store(path: Path, topic: str) -> tuple[LogMark | None, list[tuple[str, Any, int]]]:
    state: DiskMapState[str, Any] = DiskMapState(
        DiskStore(path), MapCodecs(StrCodec(), JsonCodec()), topic
    )
    state.open_store()
    try:
        return state.mark, [(k, e.value, int(e.version)) for k, e in state.entries_in_order()]
    finally:
        state.close_store(clean=False)  # as it was: the killed process did not close it


KILLS = int(os.environ.get("DISK_KILLS", "5"))


@pytest.mark.slow
async def test_a_replica_killed_at_any_moment_reopens_at_a_record_boundary(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    store = tmp_path / "s"
    # The log as replayed by an in-memory replica: the state after each record, and its id.
    history: dict[int, tuple[str, list[tuple[str, Any, int]]]] = {0: ("", [])}
    async with new_map(service_url, topic, admin_url) as observer:
        state = observer.manager.read_local(lambda s: s)

        def record(applied: Any) -> None:
            history[applied.position] = (
                applied.record_id,
                [(k, e.value, int(e.version)) for k, e in state.entries_in_order()],
            )

        observer.manager.add_listener(record)
        rng = random.Random(int.from_bytes(os.urandom(4), "big"))
        stored_at: int | None = None
        boundaries: list[int] = []
        for kill in range(KILLS + 1):
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.recipes.disk_worker",
                service_url,
                admin_url,
                str(observer.manager.topic),
                str(store),
                str(rng.randrange(10**9)),
                cwd=REPO,
                env=dict(os.environ, PYTHONPATH=str(REPO)),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
            try:
                assert process.stdout is not None
                ready = json.loads(await asyncio.wait_for(process.stdout.readline(), WAIT_S))
                # It resumed from the store as it was found after the last kill.
                assert ready["resumed"] == (stored_at or None), ready
                if kill == KILLS:
                    # The last one catches up with the tail and stops cleanly.
                    process.send_signal(signal.SIGTERM)
                else:
                    await asyncio.sleep(rng.uniform(0.2, 1.5))  # heavy applies going on
                    process.send_signal(signal.SIGKILL)
                await asyncio.wait_for(process.wait(), WAIT_S)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            mark, entries = read_store(store, str(observer.manager.topic))
            assert mark is not None
            await observer.sync()
            assert mark.position in history
            record_id, replayed = history[mark.position]
            # Exactly the log replayed to the stored position: never half a record.
            assert mark.record_id == record_id
            assert entries == replayed, f"kill {kill}: store at {mark.position}"
            stored_at = mark.position
            boundaries.append(stored_at)
        assert boundaries == sorted(boundaries)
        assert boundaries[-1] > 0
    print(f"stored positions after {KILLS} kills: {boundaries}")


async def test_a_disk_map_closed_while_a_snapshot_is_taken_ends_it_first(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    """Closing waits until the snapshot's worker thread stops reading the store (the next
    part it would make ends with ClosedError), then closes the store under it."""
    store = DiskStore(tmp_path / "s")
    async with new_map(service_url, topic, admin_url, snapshots=True, store=store) as m:
        value = "v" * 100
        for start in range(0, 300_000, 5_000):
            await m.put_all({f"k{i:07d}": value for i in range(start, start + 5_000)})
        taking = asyncio.create_task(m.snapshot())
        await asyncio.sleep(0.3)  # tens of megabytes: still being made
        assert not taking.done()
    with pytest.raises(ClosedError, match="closed while a snapshot was made"):
        await taking
    async with new_map(service_url, topic, admin_url, snapshots=True, store=store) as again:
        assert again.stats.records_read == 0  # resumed from its store, which is whole
        assert len(again) == 300_000


async def test_a_disk_map_finds_a_key_by_an_equal_key_of_another_type(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    # A str enum member names its str key, True and an IntEnum their int key, as in the
    # memory map (a dict): also once the entry has left the cache (cache_bytes=0).
    class Color(enum.StrEnum):
        RED = "red"

    class Level(enum.IntEnum):
        HIGH = 3

    async with (
        new_map(service_url, topic, admin_url, key_codec=JsonCodec()) as memory,
        new_map(
            service_url,
            topic,
            admin_url,
            key_codec=JsonCodec(),
            store=DiskStore(tmp_path / "s", cache_bytes=0),
        ) as disk,
    ):
        await memory.put_all({"red": "r", 1: "one", 3: "three"})
        await disk.sync()
        for m in (memory, disk):
            # The map's calls take what the key codec takes (JSON: the enum members).
            for alias, stored in [(Color.RED, "red"), (Level.HIGH, 3)]:
                assert await m.get(alias) == await m.get(stored), (m, alias)
                assert await m.version(alias) == await m.version(stored)
                assert await m.entry(alias) == await m.entry(stored)
            # The state itself, as a Mapping (transact's view, update's generators, the
            # local reads) takes any equal key, as a dict does.
            aliases = [(Color.RED, "red"), (True, 1), (Level.HIGH, 3), (3.0, 3)]
            aliases += [(Decimal(3), 3), (Fraction(3), 3), (3 + 0j, 3)]
            for alias, stored in aliases:
                assert m.get_local(alias) == m.get_local(stored), (m, alias)
                assert alias in m
                found: list[Any] = []
                await m.transact(
                    lambda view: found.append((view.get(alias), alias in view)) or {}  # noqa: B023
                )
                assert found == [(await m.get(stored), True)], (m, alias)
            assert m.get_local(2.5) is None
            assert 2.5 not in m
        assert await disk.delete(Color.RED) is True
        await memory.sync()
        assert await memory.all() == await disk.all() == [(1, "one"), (3, "three")]


async def test_a_disk_watch_on_a_key_or_a_prefix_decodes_only_those_entries(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    decoded: list[Any] = []

    class CountingCodec(JsonCodec):
        def decode(self, data: bytes, /) -> Any:
            decoded.append(data)
            return super().decode(data)

    store = DiskStore(tmp_path / "s", cache_bytes=0)
    async with new_map(service_url, topic, admin_url, value_codec=CountingCodec()) as writer:
        await writer.put_all({f"k{i:04d}": i for i in range(2000)})
    async with new_map(
        service_url, topic, admin_url, value_codec=CountingCodec(), store=store
    ) as disk:
        decoded.clear()
        async with disk.changes(key="k0007") as one:
            event = await one.next(timeout=WAIT_S)
            assert event is not None
            assert (event.key, event.value) == ("k0007", 7)
        async with disk.changes(prefix="k001") as some:
            keys = [getattr(await some.next(timeout=WAIT_S), "key", None) for _ in range(10)]
            assert keys == [f"k{i:04d}" for i in range(10, 20)]
        assert len(decoded) <= 11 * 2, len(decoded)  # not the 2000 entries of the map
