"""SharedStateManager's contract in one process (several replicas), against the real broker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pulsar_state import (
    ClosedError,
    ReplayProgress,
    SharedStateManager,
    SyncSharedStateManager,
    WriteResult,
)
from tests.core.helpers import Counter, apply_counter, counter_manager, incr, new_counter
from tests.support.waiting import until


async def test_write_then_read_locally_and_latest(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url) as manager:
        result = await manager.write(lambda s: [incr("a")], reader=lambda s: s["count"])
        assert result == WriteResult(value=1, position=1)
        assert await manager.read(lambda s: s["count"]) == 1
        assert await manager.read(lambda s: s["count"], latest=True) == 1
        assert manager.position == 1


async def test_other_replica_reads_latest_and_waits_for_position(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        counter_manager(service_url, topic, admin_url) as a,
        counter_manager(service_url, topic, admin_url) as b,
    ):
        first = await a.write(lambda s: [incr("1")])
        assert await b.read(lambda s: s["count"], latest=True) == 1
        second = await a.write(lambda s: [incr("2")])
        await b.wait_for(second.position, timeout=10)
        assert await b.read(lambda s: s["count"]) == 2
        assert first.position < second.position == b.position


async def test_generator_sees_up_to_date_state_and_value_comes_from_committed_attempt(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        counter_manager(service_url, topic, admin_url) as a,
        counter_manager(service_url, topic, admin_url) as b,
    ):
        await a.write(lambda s: [incr(), incr(), incr()])
        seen: list[int] = []

        def double(state: Counter) -> list[dict[str, object]]:
            seen.append(state["count"])
            return [incr(by=state["count"])]

        # b never read anything itself: its generator must still run on the tail state.
        result = await b.write(double, reader=lambda s: s["count"])
        assert seen[-1] == 3
        assert result.value == 6
        assert await a.read(lambda s: s["count"], latest=True) == 6


async def test_ops_of_one_write_are_applied_together(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        counter_manager(service_url, topic, admin_url) as a,
        counter_manager(service_url, topic, admin_url) as b,
    ):
        observed: list[int] = []
        b.add_listener(lambda record: observed.append(b_state_count(b)))
        for _ in range(20):
            await a.write(lambda s: [incr(), incr(), incr(), incr()])
        await b.sync()
        # After every record, b's state had moved by whole writes of 4 increments.
        assert observed
        assert all(count % 4 == 0 for count in observed)
        assert await b.read(lambda s: s["count"]) == 80


def b_state_count(manager: SharedStateManager[Counter, dict[str, object]]) -> int:
    return int(manager._state["count"])  # test-only peek from inside a listener


async def test_concurrent_writes_are_group_committed_and_exact(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url) as manager:
        results = await asyncio.gather(
            *(
                manager.write(lambda s, i=i: [incr(f"w{i}")], reader=lambda s: s["count"])
                for i in range(300)
            )
        )
        values = sorted(r.value for r in results)
        assert values == list(range(1, 301))  # each write saw exactly its own increment
        state = await manager.read(lambda s: s, latest=True)
        assert state["count"] == 300
        assert set(state["seen"].values()) == {1}
        # Group commit: far fewer records than writes.
        assert manager.stats.records_sent < 300


async def test_empty_write_is_a_linearizable_no_op(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url) as manager:
        await manager.write(lambda s: [incr()])
        result = await manager.write(lambda s: [], reader=lambda s: s["count"])
        assert result.value == 1


async def test_write_ops_unconditional(service_url: str, admin_url: str, topic: str) -> None:
    async with counter_manager(service_url, topic, admin_url) as manager:
        await manager.write_ops([incr("x"), {"op": "set", "key": "name", "value": "v"}])
        state = await manager.read(lambda s: dict(s))
        assert state["count"] == 1
        assert state["name"] == "v"


async def test_reopen_replays_history_with_progress(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url) as manager:
        await asyncio.gather(*(manager.write(lambda s: [incr()]) for _ in range(50)))
        for _ in range(10):
            await manager.write(lambda s: [incr()])
        position = manager.position
    reports: list[ReplayProgress] = []
    async with counter_manager(service_url, topic, admin_url, on_progress=reports.append) as again:
        assert again.position == position
        assert await again.read(lambda s: s["count"]) == 60
    assert reports
    assert reports[-1].done
    assert reports[-1].records_read == position


async def test_close_releases_the_writer_at_once(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Without the write relay (b's write would go through a).
    hold = {"idle_release_s": 3600, "max_hold_s": 3600, "relay_writes": False}
    a = counter_manager(service_url, topic, admin_url, **hold)
    await a.open()
    await a.write(lambda s: [incr()])  # a now holds the exclusive producer, and would keep it
    no_relay = {"acquire_timeout_s": 20, "relay_writes": False}
    async with counter_manager(service_url, topic, admin_url, **no_relay) as b:
        started = time.monotonic()
        write = asyncio.create_task(b.write(lambda s: [incr()]))
        await asyncio.sleep(0.5)
        assert not write.done()  # held by a
        await a.aclose()
        await write
        # Far below the broker's keepalive (30-60 s): the close released the producer.
        assert time.monotonic() - started < 15
        assert await b.read(lambda s: s["count"]) == 2
    with pytest.raises(ClosedError):
        await a.read(lambda s: s)


async def test_calls_after_close_raise_closed(service_url: str, admin_url: str, topic: str) -> None:
    manager = counter_manager(service_url, topic, admin_url)
    with pytest.raises(ClosedError):
        await manager.read(lambda s: s)
    async with manager:
        pass
    with pytest.raises(ClosedError):
        await manager.write(lambda s: [incr()])


def test_sync_facade_runs_the_same_implementation(
    service_url: str, admin_url: str, topic: str
) -> None:
    with (
        SyncSharedStateManager(
            service_url, topic, initial_state=new_counter, apply=apply_counter, admin_url=admin_url
        ) as a,
        SyncSharedStateManager(
            service_url, topic, initial_state=new_counter, apply=apply_counter, admin_url=admin_url
        ) as b,
    ):
        result = a.write(lambda s: [incr("s1")], reader=lambda s: s["count"])
        assert result.value == 1
        b.wait_for(result.position, timeout=10)
        assert b.read(lambda s: s["count"]) == 1
        b.write_ops([incr("s2")])
        assert a.read(lambda s: s["count"], latest=True) == 2
        assert isinstance(a.manager, SharedStateManager)


async def test_begin_record_stamps_the_same_positions_on_writer_and_replicas(
    service_url: str, admin_url: str, topic: str
) -> None:
    def begin(state: Counter, position: int) -> None:
        state["at"] = position

    def stamp(state: Counter, op: dict[str, object]) -> None:
        state.setdefault("stamps", {})[str(op["id"])] = state["at"]

    options = {"initial_state": dict, "apply": stamp, "begin_record": begin}
    async with (
        counter_manager(service_url, topic, admin_url, max_writes_per_record=3, **options) as a,
        counter_manager(service_url, topic, admin_url, **options) as b,
    ):
        results = await asyncio.gather(
            *(
                a.write(lambda s, i=i: [{"id": i}], reader=lambda s, i=i: s["stamps"][str(i)])
                for i in range(10)
            )
        )
        for result in results:
            assert result.value == result.position  # the trial and the replica agree
        await b.sync()
        stamps_a = await a.read(lambda s: dict(s["stamps"]))
        assert stamps_a == await b.read(lambda s: dict(s["stamps"]))
        assert {r.position for r in results} == set(stamps_a.values())


async def test_finished_writes_do_not_pile_up_until_their_deadline(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url, write_timeout_s=600) as manager:
        await asyncio.gather(*(manager.write(lambda s: [incr()]) for _ in range(5000)))
        for _ in range(40):
            if len(manager._deadlines) <= 4096:  # the watchdog pruned the finished ones
                break
            await asyncio.sleep(0.05)
        assert len(manager._deadlines) <= 4096
        assert await manager.read(lambda s: s["count"]) == 5000


async def test_take_writer_acquires_ahead_and_the_next_write_finds_it_held(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url, idle_release_s=0.5) as a:
        a.take_writer()
        await until(lambda: a.stats.writer_acquisitions == 1, "the writer taken ahead")
        await a.write(lambda s: [incr()])
        assert a.stats.writer_acquisitions == 1  # no second acquisition for the write
        # Held as after a write: released once idle_release_s passes without one.
        await until(lambda: a.stats.writer_releases == 1, "the idle writer released")
        a.take_writer()
        a.take_writer()  # a second hint while the first is served changes nothing
        await until(lambda: a.stats.writer_acquisitions == 2, "the writer taken again")
        assert await a.read(lambda s: s["count"], latest=True) == 1


@contextlib.asynccontextmanager
async def hint_while_another_holds_the_writer(
    service_url: str, admin_url: str, topic: str
) -> AsyncIterator[tuple[Any, Any]]:
    """(b, a): b wrote once and keeps the writer; a (which fences holders for its own writes
    after 0.2 s) has just taken the hint take_writer(). Without the write relay (a's writes
    would go through b)."""
    hold = {"idle_release_s": 60.0, "max_hold_s": 60.0, "relay_writes": False}
    async with (
        counter_manager(service_url, topic, admin_url, **hold) as b,
        counter_manager(
            service_url, topic, admin_url, takeover_after_s=0.2, relay_writes=False
        ) as a,
    ):
        await b.write(lambda s: [incr()])
        a.take_writer()
        yield b, a


async def test_take_writer_is_a_hint_that_never_fences_the_holder(
    service_url: str, admin_url: str, topic: str
) -> None:
    # a's hint gives up quietly after its budget (1 s) even though a fences holders for its
    # writes after 0.2 s, and b goes on writing with its producer.
    async with hint_while_another_holds_the_writer(service_url, admin_url, topic) as (b, a):
        await asyncio.sleep(2.0)
        assert (a.stats.writer_acquisitions, a.stats.writer_fencings) == (0, 0)
        await b.write(lambda s: [incr()])
        assert b.stats.writer_acquisitions == 1  # still its first producer: not fenced
        b.release_writer()
        await until(lambda: b.stats.writer_releases == 1, "b's writer released")
        await a.write(lambda s: [incr()], timeout=10.0)
        assert a.stats.writer_fencings == 0
        assert await a.read(lambda s: s["count"], latest=True) == 3


async def test_a_write_queued_during_a_take_ahead_fences_on_its_own_terms(
    service_url: str, admin_url: str, topic: str
) -> None:
    # a's hint is busy retrying (it would give up only after 1 s); a's write, queued
    # meanwhile, must not wait that out: it takes over after takeover_after_s.
    async with hint_while_another_holds_the_writer(service_url, admin_url, topic) as (_, a):
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await a.write(lambda s: [incr()], timeout=10.0)
        # ~0.25 s; waiting out the hint's budget first would take over 1.2 s.
        assert time.monotonic() - started < 1.0
        assert a.stats.writer_fencings == 1
        assert await a.read(lambda s: s["count"], latest=True) == 2


async def test_release_writer_gives_the_writer_up_without_the_idle_wait(
    service_url: str, admin_url: str, topic: str
) -> None:
    # b would keep the exclusive writer for a minute after its write; release_writer() hands
    # it over at once, so a's write gets in well inside its own (much shorter) timeout.
    # (Without the write relay, which makes release_writer() a no-op.)
    async with (
        counter_manager(
            service_url, topic, admin_url, idle_release_s=60.0, relay_writes=False
        ) as b,
        counter_manager(
            service_url, topic, admin_url, acquire_timeout_s=10.0, relay_writes=False
        ) as a,
    ):
        await b.write(lambda s: [incr()])
        b.release_writer()
        await a.write(lambda s: [incr()], timeout=10.0)
        assert b.stats.writer_releases == 1
        assert await a.read(lambda s: s["count"], latest=True) == 2
