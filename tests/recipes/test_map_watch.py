"""Watches: a consistent snapshot, then every change once and in order; overflow and cleanup."""

from __future__ import annotations

import asyncio
import enum
import gc
import sys
from collections.abc import Sequence
from typing import Any

import pytest

from pulsar_state import (
    BytesCodec,
    ClosedError,
    ConfigurationError,
    JsonCodec,
    OperationTimeoutError,
    ReplicaHaltedError,
)
from recipes import MapEvent, MapWatch, PulsarMap, WatchOverflowError
from tests.recipes.helpers import WAIT_S, new_map


def listener_count(m: PulsarMap[Any, Any]) -> int:
    return len(m.manager._listeners)  # test-only peek: did the watch unsubscribe?


async def drain(watch: MapWatch[Any, Any], count: int) -> list[MapEvent[Any, Any]]:
    events = []
    for _ in range(count):
        event = await watch.next(timeout=WAIT_S)
        assert event is not None
        events.append(event)
    return events


def brief(events: list[MapEvent[Any, Any]]) -> list[tuple[Any, ...]]:
    return [(e.kind, e.key, e.value, e.position) for e in events]


async def test_snapshot_then_every_change_in_log_order(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as writer,
        new_map(service_url, topic, admin_url) as watcher,
    ):
        await writer.put_all({"b": 2, "a": 1})
        await watcher.sync()
        async with watcher.changes() as watch:
            assert watch.start_position == watcher.position
            p1 = (await writer.put("c", 3)).position
            p2 = await writer.put_all({"a": 10, "z": 26})
            assert await writer.delete("b")
            p3 = writer.position
            await writer.delete("b")  # absent: no event
            await writer.replace("a", "wrong", 0)  # fails: no event
            p4 = await writer.update_multiple(lambda k: True, lambda k, v: v + 1)
            p5 = await writer.clear()
            p6 = (await writer.put("after", "clear")).position
            events = await drain(watch, 2 + 7 + 1 + 1)
            assert [e.initial for e in events] == [True, True] + [False] * 9
            assert brief(events) == [
                ("put", "a", 1, watch.start_position),
                ("put", "b", 2, watch.start_position),
                ("put", "c", 3, p1),
                ("put", "a", 10, p2),
                ("put", "z", 26, p2),
                ("delete", "b", None, p3),
                ("put", "a", 11, p4),
                ("put", "c", 4, p4),
                ("put", "z", 27, p4),
                ("clear", None, None, p5),
                ("put", "after", "clear", p6),
            ]
            assert all(e.version.position == e.position for e in events[2:])
            changes = [e.version for e in events[2:]]
            assert changes == sorted(set(changes))  # one version per change, in log order
            with pytest.raises(OperationTimeoutError):
                await watch.next(timeout=0.2)  # nothing more, and the watch stays usable
        assert await watch.next(timeout=WAIT_S) is None  # closed: the stream has ended


async def test_key_and_prefix_watches(service_url: str, admin_url: str, topic: str) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        await m.put_all({"user:1": "ann", "user:2": "bob", "job:1": "x"})
        by_key = m.changes(key="user:2")
        by_prefix = m.changes(prefix="user:", snapshot=False)
        await m.put("job:2", "y")
        p_put = (await m.put("user:2", "bo")).position
        p_new = (await m.put("user:3", "cy")).position
        p_clear = await m.clear()
        assert brief(await drain(by_key, 3)) == [
            ("put", "user:2", "bob", by_key.start_position),
            ("put", "user:2", "bo", p_put),
            ("clear", None, None, p_clear),
        ]
        assert brief(await drain(by_prefix, 3)) == [
            ("put", "user:2", "bo", p_put),
            ("put", "user:3", "cy", p_new),
            ("clear", None, None, p_clear),
        ]
        by_key.close()
        by_prefix.close()
        assert listener_count(m) == 0


async def test_watch_started_between_writes_misses_nothing_and_repeats_nothing(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as writer,
        new_map(service_url, topic, admin_url) as watcher,
    ):
        # Writes land while watches are being opened: each watch's snapshot plus its changes
        # must rebuild exactly the final map, with each write seen once.
        async def write_all() -> None:
            for i in range(60):
                await writer.put(f"k{i % 7}", i)
            await writer.put("~end", True)  # sorts last: ends a snapshot too

        writing = asyncio.create_task(write_all())
        watches = [watcher.changes()]
        while not writing.done():
            await asyncio.sleep(0.01)
            watches.append(watcher.changes())
        await writing
        await watcher.sync()
        final = dict(watcher.items())
        for watch in watches:
            rebuilt: dict[str, Any] = {}
            changes: list[int] = []
            while True:
                event = await watch.next(timeout=WAIT_S)
                assert event is not None
                if event.initial:
                    assert event.position == watch.start_position
                    assert not changes
                else:
                    changes.append(event.position)
                rebuilt[str(event.key)] = event.value
                if event.key == "~end":
                    break
            assert rebuilt == final
            # One put per write: exactly the positions after the snapshot, in order.
            assert changes == list(range(watch.start_position + 1, watcher.position + 1))
            watch.close()


async def test_consumer_that_falls_behind_gets_overflow_and_the_listener_is_removed(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        await m.put("seed", 0)
        watch = m.changes(max_queue=3)
        for i in range(3):
            await m.put(f"k{i}", i)
        # Three changes queued: still fine. One more puts the consumer over the limit.
        await m.put("k3", 3)
        assert listener_count(m) == 0  # unsubscribed at once, the pump does no more work
        first = await watch.next(timeout=WAIT_S)
        assert first is not None
        assert first.initial  # the snapshot is not counted in max_queue
        with pytest.raises(WatchOverflowError) as error:
            await watch.next(timeout=WAIT_S)
        assert error.value.max_queue == 3
        assert error.value.position == watch.start_position  # nothing delivered since
        assert error.value.retriable
        with pytest.raises(WatchOverflowError):
            await watch.next(timeout=WAIT_S)  # stays stopped
        # A new watch resynchronises from a fresh snapshot.
        fresh = m.changes()
        assert {e.key for e in await drain(fresh, 5)} == {"seed", "k0", "k1", "k2", "k3"}
        fresh.close()


async def test_cancelled_and_dropped_watches_unsubscribe(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        received: list[MapEvent[str, Any]] = []
        got_one = asyncio.Event()
        watch = m.changes(snapshot=False)

        async def consume() -> None:
            async with watch:
                async for event in watch:
                    received.append(event)
                    got_one.set()

        task = asyncio.create_task(consume())
        await m.put("a", 1)
        await asyncio.wait_for(got_one.wait(), WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        assert listener_count(m) == 0  # `async with` closed it (we still hold the watch)
        assert watch.closed

        async for _ in m.changes():  # break out of a bare `async for`: dropped, unsubscribed
            break
        gc.collect()
        assert listener_count(m) == 0


async def test_watches_end_when_the_map_closes(
    service_url: str, admin_url: str, topic: str
) -> None:
    m = new_map(service_url, topic, admin_url)
    await m.open()
    watch = m.changes(snapshot=False)
    waiting = asyncio.create_task(watch.next(timeout=WAIT_S))
    await m.put("a", 1)
    await m.aclose()
    event = await asyncio.wait_for(waiting, WAIT_S)
    assert event is not None
    assert event.key == "a"  # queued before the close: still delivered
    with pytest.raises(ClosedError):
        await watch.next(timeout=WAIT_S)
    with pytest.raises(ClosedError):
        m.changes()


async def test_watch_on_a_replica_that_halts_raises_after_the_good_events(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as watcher,
        new_map(service_url, topic, admin_url, value_codec=BytesCodec()) as foreign,
    ):
        watch = watcher.changes(snapshot=False)
        await foreign.put("ok", b'"fine"')  # valid JSON bytes: the watcher decodes it
        await foreign.put("bad", b"\xff not json")
        event = await watch.next(timeout=WAIT_S)
        assert event is not None
        assert (event.key, event.value) == ("ok", "fine")
        with pytest.raises(ReplicaHaltedError):
            await watch.next(timeout=WAIT_S)


async def test_a_watch_opened_before_open_yields_the_whole_history(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as writer:
        live = writer.changes(snapshot=False)
        await writer.put("a", 1)
        await writer.put_all({"b": 2, "c": 3})
        await writer.delete("a")
        await writer.delete("a")  # absent: no change, but a record
        await writer.clear()
        await writer.put("d", 4)
        seen_live = await drain(live, 1 + 2 + 1 + 1 + 1)
        live.close()
    history_map = new_map(service_url, topic, admin_url)
    history = history_map.changes(max_queue=1000)
    assert history.start_position == 0
    await history_map.open()
    try:
        replayed = await drain(history, len(seen_live))
        assert replayed == seen_live  # same kinds, keys, values, versions and positions
        assert not any(event.initial for event in replayed)
        await writer_put_after_open(history_map)
        later = await history.next(timeout=WAIT_S)
        assert later is not None
        assert (later.kind, later.key, later.position) == ("put", "e", history_map.position)
    finally:
        await history_map.aclose()
    with pytest.raises(ClosedError):
        await history.next(timeout=WAIT_S)


async def writer_put_after_open(m: PulsarMap[Any, Any]) -> None:
    await m.put("e", 5)


async def test_a_map_with_snapshots_refuses_a_watch_before_open(
    service_url: str, admin_url: str, topic: str
) -> None:
    m = new_map(service_url, topic, admin_url, snapshots=True)
    with pytest.raises(ClosedError, match="with snapshots only watches once open"):
        m.changes()
    await m.aclose()


async def test_a_watch_opened_before_a_failed_open_ends_with_the_failure(
    service_url: str, admin_url: str, topic: str
) -> None:
    m = new_map("pulsar://127.0.0.1:1", topic, admin_url, open_timeout_s=1.0)
    watch = m.changes()
    with pytest.raises(OperationTimeoutError, match="opening") as failed:
        await m.open()
    # The open's own error (itself a timeout: it must not read as "no change came").
    with pytest.raises(OperationTimeoutError, match="opening") as ended:
        await watch.next(timeout=WAIT_S)
    assert ended.value is failed.value
    await m.aclose()


async def test_a_watch_resumes_from_a_position(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as writer:
        await writer.put("a", 1)
        await writer.put("b", 2)
        await writer.delete("a")
        await writer.put("c", 3)
        with pytest.raises(ConfigurationError, match="keeps no history"):
            writer.changes(from_position=1)  # open, at 4: no history kept
        with pytest.raises(ConfigurationError, match=">= 0"):
            writer.changes(from_position=-1)
        ahead = writer.changes(from_position=writer.position)  # nothing missed: allowed
        await writer.put("d", 4)
        [event] = await drain(ahead, 1)
        assert (event.kind, event.key, event.position) == ("put", "d", 5)
        ahead.close()
    resumed_map = new_map(service_url, topic, admin_url)
    # max_queue=3: the 2 changes up to position 2 are not even queued (5 would overflow).
    resumed = resumed_map.changes(prefix="", from_position=2, max_queue=3)
    async with resumed_map:
        got = await drain(resumed, 3)
    assert [(e.kind, e.key, e.position) for e in got] == [
        ("delete", "a", 3),
        ("put", "c", 4),
        ("put", "d", 5),
    ]
    assert not any(e.initial for e in got)


async def test_a_map_whose_replica_falls_forward_reads_the_new_state(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Falling forward (trim_history: the log was trimmed past a replica that was behind)
    # replaces the replica's state object; the map's views must follow it, and its watches
    # end (the changes skipped are not known). Injected: what the replica does when it falls
    # forward (load a snapshot, tell the listeners), on an open map.
    async with new_map(service_url, topic, admin_url, snapshots=True, trim_history=True) as m:
        await m.put_all({"a": 1, "b": 2})
        await m.snapshot()
        await m.put("c", 3)
        watch = m.changes(snapshot=False)
        replica = m.manager._replica
        assert replica.fall_forward is not None
        assert await replica.fall_forward(0)  # the snapshot, without "c"
        for hook in list(replica.on_state_replaced):
            hook()
        assert m.get_local("c") is None  # before: the old state object, which has "c"
        assert m.get_local("a") == 1
        assert sorted(m.keys()) == ["a", "b"]
        with pytest.raises(WatchOverflowError, match="fell forward"):
            await watch.next(timeout=WAIT_S)
        # The ended watches' task that waited for a halt ended with them (before: one more
        # such task stayed until the map closed, for each fall-forward).
        fresh = m.changes()
        await asyncio.sleep(0)
        assert len(sentinels()) == 1
        fresh.close()


def sentinels() -> list[asyncio.Task[Any]]:
    return [
        task
        for task in asyncio.all_tasks()
        if task.get_name().startswith("pulsar-map-watch-sentinel") and not task.done()
    ]


async def test_a_prefix_given_as_a_str_enum_member_matches_as_its_value(
    service_url: str, admin_url: str, topic: str
) -> None:
    class Area(enum.StrEnum):
        USERS = "user:"

    async with new_map(service_url, topic, admin_url) as m:
        await m.put_all({"user:1": "ann", "job:1": "x"})
        watch = m.changes(prefix=Area.USERS)
        position = (await m.put("user:2", "bob")).position
        await m.put("job:2", "y")
        assert brief(await drain(watch, 2)) == [
            ("put", "user:1", "ann", watch.start_position),
            ("put", "user:2", "bob", position),
        ]
        watch.close()


async def test_a_prefix_watch_snapshot_holds_exactly_the_keys_with_the_prefix(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Edge prefixes of the key-order range the snapshot reads: the largest code point and
    # byte, an empty prefix, and keys of another type around the range.
    top = chr(sys.maxunicode)
    keys = ["a", "ab", "ab" + top, "ac", top, top + "x", top * 2, "", "b"]
    async with new_map(service_url, topic, admin_url, key_codec=JsonCodec()) as m:
        await m.put_all({**{key: key for key in keys}, 7: "int"})
        await watched_prefixes_hold_exactly(
            m, keys, ["a", "ab", "ab" + top, top, top * 2, "", "zz"]
        )
    async with new_map(service_url, topic + "-bytes", admin_url, key_codec=BytesCodec()) as b:
        byte_keys = [b"\xff", b"\xff\x00", b"\xfe\xff", b"\xfe\xff\x01", b"\xff\xff", b""]
        await b.put_all({key: 1 for key in byte_keys})
        await watched_prefixes_hold_exactly(b, byte_keys, [b"\xff", b"\xfe\xff", b"\xfe", b""])


async def watched_prefixes_hold_exactly(
    state_map: Any, keys: Sequence[Any], prefixes: Sequence[Any]
) -> None:
    """A watch of each prefix starts with exactly the keys of ``keys`` that have it, in order."""
    for prefix in prefixes:
        async with state_map.changes(prefix=prefix) as watch:
            expected = sorted(key for key in keys if key.startswith(prefix))
            got = await drain(watch, len(expected))
            assert [e.key for e in got] == expected, prefix
            with pytest.raises(OperationTimeoutError):
                await watch.next(timeout=0.2)


async def test_a_caught_up_consumer_takes_a_write_with_more_changes_than_max_queue(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        watch = m.changes(max_queue=3)
        await m.put_all({f"k{i}": i for i in range(10)})  # one record, ten changes
        assert [e.key for e in await drain(watch, 10)] == [f"k{i}" for i in range(10)]
        await m.put_all({f"k{i}": -i for i in range(5)})
        first = await watch.next(timeout=WAIT_S)  # four changes still wait: 4 + 1 > 3
        assert first is not None
        await m.put("k9", 0)
        with pytest.raises(WatchOverflowError):
            await watch.next(timeout=WAIT_S)
