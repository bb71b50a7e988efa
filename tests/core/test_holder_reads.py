"""The holder of the exclusive writer stops reading its own records back (it applies them on
their acks), and still sees at once what any other process appends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from pulsar_state import SharedStateManager
from pulsar_state._pulsar import StateReader
from tests.core.helpers import Counter, counter_manager, incr
from tests.support.waiting import until

Manager = SharedStateManager[Counter, dict[str, Any]]
# Keeps the writer once it has it (no idle release, no turns).
HOLD = {"idle_release_s": 3600.0, "max_hold_s": 3600.0}


def count_delivered(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-item list counting the messages every reader hands over from now on (a holder's
    own records read back included, which the pump then skips)."""
    read_batch = StateReader.read_batch
    delivered = [0]

    async def counted(self: StateReader) -> list[Any]:
        batch = await read_batch(self)
        delivered[0] += len(batch)
        return batch

    monkeypatch.setattr(StateReader, "read_batch", counted)
    return delivered


def reader_of(manager: SharedStateManager[Any, Any]) -> StateReader:
    reader = manager._replica._reader
    assert reader is not None
    return reader


async def write_until_paused(manager: SharedStateManager[Any, Any], tag: str) -> int:
    """Write until the manager's reader pauses (a ledger's first entry is read back: the
    replica cannot know it comes next; unread records are read first); returns the writes
    made."""
    for made in range(1, 11):
        await manager.write(lambda s, made=made: [incr(f"{tag}{made}")])  # type: ignore[misc]
        if reader_of(manager).paused:
            return made
    raise AssertionError("the holder's reader never paused")


async def test_the_holder_does_not_read_its_own_records_back(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    delivered = count_delivered(monkeypatch)
    async with counter_manager(service_url, topic, admin_url, **HOLD) as holder:
        await holder.write(lambda s: [incr("first")])
        delivered[0] = 0
        for i in range(40):
            await holder.write(lambda s, i=i: [incr(f"w{i}")])  # type: ignore[misc]
        assert reader_of(holder).paused
        # The record the reader was already waiting for when it paused, and a second's
        # backlog should the writes outlast the pause's bound: not 40.
        assert delivered[0] < 10, delivered[0]
        state = await holder.read(lambda s: s, latest=True)
        assert state["count"] == 41
        assert set(state["seen"].values()) == {1}


async def test_an_idle_holders_reader_looks_at_the_log_and_pauses_again(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A second after the holder's latest write its paused reader looks at the log (a fencer's
    # records), then pauses again: the holder's next write, after a longer idle, is applied
    # on its ack, not raced to the pump by a reader that had started reading for good.
    delivered = count_delivered(monkeypatch)
    async with counter_manager(service_url, topic, admin_url, **HOLD) as holder:
        await write_until_paused(holder, "first")
        for i in range(3):
            await asyncio.sleep(StateReader._PAUSE_MAX_S + 0.3)  # a look came and went
            assert reader_of(holder).paused
            delivered[0] = 0
            await holder.write(lambda s, i=i: [incr(f"idle{i}")])  # type: ignore[misc]
            await asyncio.sleep(0.2)  # well within the next look
            assert delivered[0] == 0, f"round {i}: read back {delivered[0]}"
        state: Counter = await holder.read(lambda s: s, latest=True)
        assert {f"idle{i}" for i in range(3)} <= set(state["seen"])
        assert set(state["seen"].values()) == {1}


async def test_a_holder_that_lets_the_writer_go_reads_again(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Records appended by another process once the writer was released are read at once.
    async with (
        counter_manager(service_url, topic, admin_url, idle_release_s=0.2) as first,
        counter_manager(service_url, topic, admin_url, relay_writes=False) as second,
    ):
        made = await write_until_paused(first, "first")
        await until(lambda: first.stats.writer_releases == 1, "the idle release", 5.0)
        assert not reader_of(first).paused  # resumed by the release (not the pause's bound)
        await second.write(lambda s: [incr("second")])
        await until(
            lambda: first.read_local(lambda s: s["count"]) == made + 1, "seen by first", 5.0
        )


@asynccontextmanager
async def fenced_while_paused(
    service_url: str, admin_url: str, topic: str, *, backlog: int = 0
) -> AsyncIterator[tuple[Manager, Manager, int]]:
    """(holder, fencer, writes the holder made): the holder keeps the writer with its reader
    paused (``backlog`` more writes left unread by it); the fencer then took the writer over
    with fencing and wrote once."""
    async with (
        counter_manager(service_url, topic, admin_url, **HOLD) as holder,
        counter_manager(
            service_url, topic, admin_url, takeover_after_s=0.3, relay_writes=False
        ) as fencer,
    ):
        made = await write_until_paused(holder, "holder")
        for i in range(backlog):
            await holder.write(lambda s, i=i: [incr(f"more{i}")])  # type: ignore[misc]
        assert reader_of(holder).paused
        await fencer.write(lambda s: [incr("fencer")])
        yield holder, fencer, made + backlog


async def test_a_paused_holder_fenced_by_another_process_sees_its_writes(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The holder keeps the writer (idle) with its reader paused; another process takes the
    # writer over with fencing and writes. The fenced holder's linearizable read, local
    # state (within the pause's bound) and next write all see that write, applied once.
    async with fenced_while_paused(service_url, admin_url, topic) as (holder, fencer, made):
        assert fencer.stats.writer_fencings == 1
        seen_at = time.monotonic()
        await until(
            lambda: holder.read_local(lambda s: s["count"]) == made + 1, "seen locally", 5.0
        )
        # Bounded by the pause (one second), not by the holder's idle release (an hour).
        assert time.monotonic() - seen_at < 3.0
        assert (await holder.read(lambda s: s["count"], latest=True)) == made + 1
        result = await holder.write(lambda s: [incr("again")], reader=lambda s: s["count"])
        assert result.value == made + 2
        for manager in (holder, fencer):
            state: Counter = await manager.read(lambda s: s, latest=True)
            assert set(state["seen"]) == {f"holder{i}" for i in range(1, made + 1)} | {
                "fencer",
                "again",
            }
            assert set(state["seen"].values()) == {1}


async def test_a_holder_fenced_with_many_own_records_unread_sees_the_fencer_within_seconds(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Its paused reader holds several read-aheads of the holder's own records: a look reads
    # through all of them (not one client queue a second) and reads on at the fencer's.
    backlog = 320  # five read-aheads at the default max_record_bytes (checked below)
    async with fenced_while_paused(service_url, admin_url, topic, backlog=backlog) as (
        holder,
        fencer,
        made,
    ):
        assert holder._replica._read_ahead * 5 == backlog
        seen_at = time.monotonic()
        await until(lambda: holder.read_local(lambda s: s["count"]) == made + 1, "seen", 10.0)
        assert time.monotonic() - seen_at < 3.0
        assert holder.stats.readers_replaced == 0  # read through, not skipped
        await asyncio.sleep(0.2)
        assert not reader_of(holder).paused  # reads on: the fencer's next records at once
        await fencer.write(lambda s: [incr("fencer2")])
        await until(lambda: holder.read_local(lambda s: s["count"]) == made + 2, "next", 0.5)


async def test_a_paused_holders_linearizable_read_sees_a_fencers_write_at_once(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with fenced_while_paused(service_url, admin_url, topic) as (holder, _, made):
        # Well within the pause's one-second bound: the read resumes the reader itself.
        count = await asyncio.wait_for(holder.read(lambda s: s["count"], latest=True), 0.5)
        assert count == made + 1


async def test_what_a_paused_holder_leaves_unread_is_skipped_not_read(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Unread records are what the reader would get through before anything new (the first
    # entry of the next ledger, another process's records): past a bound, a new reader
    # replaces the paused one just after what was applied, and they are never read.
    # 4 MiB records: a read-ahead of 16, replaced past 16 * 16 unread.
    delivered = count_delivered(monkeypatch)
    options = {**HOLD, "max_record_bytes": 4 * 1024 * 1024}
    async with counter_manager(service_url, topic, admin_url, **options) as holder:
        await write_until_paused(holder, "first")
        replica = holder._replica
        bound = replica._skip_after
        assert bound == 256
        delivered[0], worst = 0, 0
        for i in range(2 * bound + 50):
            await holder.write(lambda s, i=i: [incr(f"w{i}")])  # type: ignore[misc]
            assert replica.read_to is not None
            worst = max(worst, reader_of(holder).behind(replica.read_to) or 0)
        assert holder.stats.readers_replaced >= 2
        assert worst <= bound + 16, worst  # (plus the few written while one is made)
        # Those written while a new reader is made are read: a few dozen, not the 562.
        assert delivered[0] < 150, delivered[0]
        state: Counter = await holder.read(lambda s: s, latest=True)
        assert state["count"] == len(state["seen"]) >= 2 * bound + 51
        assert set(state["seen"].values()) == {1}


async def test_a_late_ack_does_not_pause_a_reader_a_waiter_resumed(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A read waits for a record this process did not write (a fencer's) and resumes the
    # reader; an ack of this process's own that arrives next must not pause it again, or
    # the read waits out the pause's bound.
    async with counter_manager(service_url, topic, admin_url, **HOLD) as holder:
        await write_until_paused(holder, "first")
        replica = holder._replica
        assert replica.read_to is not None
        ahead = replica.read_to._replace(entry=replica.read_to.entry + 1)
        waiter = replica.log_waiter(ahead)
        assert not reader_of(holder).paused
        replica.pause_reading(replica.read_to)  # what the writer does on an ack
        assert not reader_of(holder).paused
        waiter.cancel()


async def test_closing_a_holder_far_behind_makes_no_new_reader(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Closing releases the writer, which wants reading again with more than a read-ahead
    # unread: no new reader may be made for a manager that is closing.
    options = {**HOLD, "max_record_bytes": 4 * 1024 * 1024}  # a read-ahead of 16
    holder = counter_manager(service_url, topic, admin_url, **options)
    async with holder:
        await write_until_paused(holder, "first")
        for i in range(40):
            await holder.write(lambda s, i=i: [incr(f"w{i}")])  # type: ignore[misc]
        replica = holder._replica
        assert replica.read_to is not None
        assert (reader_of(holder).behind(replica.read_to) or 0) > replica._read_ahead
        conn = replica._conn
        assert conn is not None
        create_reader, created = conn.create_reader, []

        async def counted(*args: Any, **kwargs: Any) -> StateReader:
            created.append(args)
            return await create_reader(*args, **kwargs)

        monkeypatch.setattr(conn, "create_reader", counted)
    assert created == []
    assert holder._replica._replacing is None
    pending = [t for t in asyncio.all_tasks() if "_replace_reader" in repr(t.get_coro())]
    assert pending == []


async def test_writes_during_a_replacement_leave_the_old_reader_paused(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # While a new reader is being made, the holder's writes keep the old one paused: it
    # does not read back the records it is about to skip.
    delivered = count_delivered(monkeypatch)
    options = {**HOLD, "max_record_bytes": 4 * 1024 * 1024}  # replaced past 256 unread
    async with counter_manager(service_url, topic, admin_url, **options) as holder:
        await write_until_paused(holder, "first")
        conn = holder._replica._conn
        assert conn is not None
        create_reader = conn.create_reader

        async def slowly(*args: Any, **kwargs: Any) -> StateReader:
            await asyncio.sleep(0.5)
            return await create_reader(*args, **kwargs)

        monkeypatch.setattr(conn, "create_reader", slowly)
        delivered[0] = 0
        for i in range(270):
            await holder.write(lambda s, i=i: [incr(f"w{i}")])  # type: ignore[misc]
        assert holder._replica._replacing is not None
        for i in range(30):
            await holder.write(lambda s, i=i: [incr(f"x{i}")])  # type: ignore[misc]
        await until(lambda: holder.stats.readers_replaced == 1, "replaced", 5.0)
        # The new reader starts after what was applied when it was asked for, so it reads
        # the 30 written since; the old one read none of the 270 it left.
        assert delivered[0] < 100, delivered[0]
