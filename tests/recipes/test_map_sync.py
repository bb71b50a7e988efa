"""SyncPulsarMap: the same map through a BlockingPortal, for code that is not async."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pulsar_state import (
    BlockingPortal,
    ClosedError,
    CodecError,
    ConfigurationError,
    OperationTimeoutError,
)
from recipes import MapEntry, MapEvent, MapVersion, PulsarMap, SyncPulsarMap

WAIT_S = 60.0


def sync_map(
    service_url: str, topic: str, admin_url: str, **options: Any
) -> SyncPulsarMap[str, Any]:
    return SyncPulsarMap(
        service_url,
        topic,
        admin_url=admin_url,
        write_timeout_s=WAIT_S,
        read_timeout_s=WAIT_S,
        **options,
    )


def test_sync_facade_forwards_every_call(service_url: str, admin_url: str, topic: str) -> None:
    with (
        sync_map(service_url, topic, admin_url) as a,
        sync_map(service_url, topic, admin_url) as b,
    ):
        assert isinstance(a.async_map, PulsarMap)
        position = a.put("k", {"n": 1})
        b.wait_for(position, timeout=WAIT_S)
        assert b.get("k") == {"n": 1}
        assert b.version("k") == position
        assert b.get_or_default("zz", 0, latest=True) == 0
        assert a.put_if_absent("k", "other") == {"n": 1}
        assert a.replace("k", {"n": 1}, {"n": 2}) is True
        assert b.replace_version("k", position, "stale") is False
        assert b.update("k", lambda key, v: {"n": (v or {"n": 0})["n"] + 1}) == {"n": 3}
        a.put_all([("x", 1), ("y", 2), ("z", 3)])
        a.update_multiple(lambda key: key in "xyz", lambda key, v: v * 10)
        assert b.range("x", "z", latest=True) == [("x", 10), ("y", 20)]
        assert b.all() == [("k", {"n": 3}), ("x", 10), ("y", 20), ("z", 30)]
        assert b.list_keys() == ["k", "x", "y", "z"]
        seen: list[str] = []
        assert b.scan(lambda key: key > "k", lambda key, v: seen.append(key)) == 3
        assert seen == ["x", "y", "z"]
        assert b.entry("x") is not None
        assert a.delete("x") is True
        b.sync(timeout=WAIT_S)
        # The local view, run on the portal's thread.
        assert len(b) == 3
        assert "y" in b
        assert "x" not in b
        assert list(b) == b.keys() == ["k", "y", "z"]
        assert b.values() == [{"n": 3}, 20, 30]
        assert b.items()[1] == ("y", 20)
        assert b.get_local("z") == 30
        with pytest.raises(CodecError):
            a.put("bad", object())
        a.clear()
        assert b.list_keys(latest=True) == []
        assert b.position == a.position
        assert b.stats.position == b.position
    with pytest.raises(ClosedError):
        a.get("k")


def test_sync_entries_forwards(service_url: str, admin_url: str, topic: str) -> None:
    with (
        sync_map(service_url, topic, admin_url) as a,
        sync_map(service_url, topic, admin_url) as b,
    ):
        position = a.put_all({"y": 2, "x": 1})
        assert b.entries(latest=True, timeout=WAIT_S) == [
            ("x", MapEntry(1, MapVersion.of(position, 1))),  # put second in the write
            ("y", MapEntry(2, MapVersion.of(position, 0))),
        ]
        assert a.entries() == b.entries()


def test_sync_watch_and_close_from_another_thread(
    service_url: str, admin_url: str, topic: str
) -> None:
    portal = BlockingPortal()  # one portal shared by two maps
    try:
        with (
            sync_map(service_url, topic, admin_url, portal=portal) as writer,
            sync_map(service_url, topic, admin_url, portal=portal) as watcher,
        ):
            writer.put("a", 1)
            watcher.sync()
            with watcher.changes() as watch:
                assert watch.start_position == watcher.position
                position = writer.put("a", 2)
                first = watch.next(timeout=WAIT_S)
                second = watch.next(timeout=WAIT_S)
                first_version = MapVersion.of(1, 0)
                assert first == MapEvent(
                    "put", "a", 1, first_version, watch.start_position, initial=True
                )
                assert second == MapEvent("put", "a", 2, position, position.position)
                with pytest.raises(OperationTimeoutError):
                    watch.next(timeout=0.2)

                received: list[MapEvent[str, Any]] = []
                got_one = threading.Event()

                def consume() -> None:
                    for event in watch:  # blocks between events; ends when closed
                        received.append(event)
                        got_one.set()

                consumer = threading.Thread(target=consume)
                consumer.start()
                writer.put("b", 3)
                assert got_one.wait(WAIT_S)
                watch.close()  # from this thread: the consumer's iteration ends
                consumer.join(WAIT_S)
                assert not consumer.is_alive()
                assert [(e.kind, e.key, e.value) for e in received] == [("put", "b", 3)]
    finally:
        portal.stop()


def test_sync_snapshot_and_a_watch_resumed_from_a_position(
    service_url: str, admin_url: str, topic: str
) -> None:
    with sync_map(service_url, topic, admin_url, snapshots=True) as a:
        a.put("a", 1)
        resume_after = a.put("b", 2).position
        a.put("c", 3)
        snapshot_position = a.snapshot(timeout=WAIT_S)
        assert snapshot_position == a.position
        with a.changes(from_position=a.position) as watch:
            assert not watch.closed
            a.put("d", 4)
            event = watch.next(timeout=WAIT_S)
            assert event is not None
            assert (event.key, event.initial) == ("d", False)
        assert watch.closed
        with pytest.raises(ConfigurationError, match="keeps no history"):
            a.changes(from_position=resume_after)
    with sync_map(service_url, topic, admin_url, snapshots=True) as b:
        assert b.stats.snapshot_loaded_position == snapshot_position
        assert b.get("d") == 4
