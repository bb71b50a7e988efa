"""A write queued while the writer idles holding the topic's producer is built and sent by a
callback at the end of that loop turn (``Writer.queued``), not after the writer's task wakes;
a batch of one record is finished on its acknowledgement (``Writer._finish_at_once``), any
other by the writer's task. Each test checks that the write took that path (the batch is
issued before the writer's task runs; the writer's task stays in its idle wait) and that it
keeps every guarantee of the other, group commit included."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import pulsar_state._pulsar
from pulsar_state import ApplyError, BrokerUnavailableError, ClosedError
from tests.core.helpers import (
    counter_manager,
    fail_send_number,
    incr,
    seen_by,
    topic_message_count,
)
from tests.support.waiting import until

# Held between the tests' writes (no idle release, no turn given): only the first takes it.
HELD = {"idle_release_s": 30.0, "max_hold_s": 30.0}


def held_manager(service_url: str, topic: str, admin_url: str) -> Any:
    return counter_manager(service_url, topic, admin_url, **HELD)


async def holding(manager: Any) -> Any:
    """Take the writer with a first write ("a"); its writer, once idle holding the producer
    with its relay open (the relay opening wakes the writer's task)."""
    await manager.write(lambda s: [incr("a")])
    relay = manager._parts.relay
    if relay is not None:
        await until(lambda: relay.ready, "the relay opens")
    return await parked(manager)


async def parked(manager: Any) -> Any:
    """The manager's writer, once its serve loop waits holding the producer."""
    writer = manager._parts.writer
    for _ in range(200):
        if writer._parked:
            return writer
        await asyncio.sleep(0.01)
    raise AssertionError("the writer never idled holding the producer")


def submit(manager: Any, generator: Any, reader: Any = None) -> asyncio.Future[Any]:
    # What write() does, without the await.
    return manager._pending.submit(generator, reader, 30.0)


async def end_of_turn(writer: Any) -> Any:
    """The batch sent at the end of the loop turn, looked at before the writer's task runs
    (this task resumes after that callback, and before the task it wakes)."""
    assert writer._send_soon is not None
    await asyncio.sleep(0)
    assert writer._send_soon is None
    return writer._issued


async def test_a_write_to_an_idle_holder_is_sent_without_waking_the_writer(
    service_url: str, admin_url: str, topic: str
) -> None:
    manager = held_manager(service_url, topic, admin_url)
    async with manager:
        writer = await holding(manager)
        written = submit(manager, lambda s: [incr("b")], lambda s: s["count"])
        issued = await end_of_turn(writer)
        assert issued is not None
        assert len(issued.records) == 1
        result = await asyncio.wait_for(written, 30)
        assert (result.value, result.position) == (2, 2)
        assert await seen_by(manager) == {"a": 1, "b": 1}
        assert manager.stats.writer_acquisitions == 1  # the producer was kept throughout
    assert await topic_message_count(service_url, topic) == 2


async def test_a_refused_write_sent_at_once_appends_nothing(
    service_url: str, admin_url: str, topic: str
) -> None:
    manager = held_manager(service_url, topic, admin_url)

    def raising(state: Any) -> list[Any]:
        raise KeyError("the caller's own error")

    async with manager:
        writer = await holding(manager)
        refused = submit(manager, raising)
        # Refused once the state it raised on is confirmed the latest (as a write with no
        # ops is), not while built: that state may be behind the log.
        with pytest.raises(KeyError, match="the caller's own error"):
            await refused
        await parked(manager)
        failing_op = submit(manager, lambda s: [{"op": "boom"}])
        with pytest.raises(ApplyError, match="boom op"):
            await failing_op
        assert (await manager.write(lambda s: [incr("b")])).position == 2
        assert writer._issued is None
    assert await topic_message_count(service_url, topic) == 2


async def test_a_write_with_no_ops_sent_at_once_is_confirmed_by_the_writer(
    service_url: str, admin_url: str, topic: str
) -> None:
    manager = held_manager(service_url, topic, admin_url)
    async with manager:
        writer = await holding(manager)
        nothing = submit(manager, lambda s: [], lambda s: s["count"])
        issued = await end_of_turn(writer)
        assert issued is not None
        assert issued.unchanged
        assert not nothing.done()  # settled once the writer confirmed the state is the latest
        result = await asyncio.wait_for(nothing, 30)
        assert (result.value, result.position) == (1, 1)
    assert await topic_message_count(service_url, topic) == 1


async def test_a_failed_send_at_once_is_retried_and_applied_once(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sends = fail_send_number(monkeypatch, 2)  # the write sent at once (not persisted)
    manager = held_manager(service_url, topic, admin_url)
    async with manager:
        writer = await holding(manager)
        retried = submit(manager, lambda s: [incr("b")])
        assert await end_of_turn(writer) is not None
        assert (await asyncio.wait_for(retried, 30)).position == 2
        assert await seen_by(manager) == {"a": 1, "b": 1}
        assert sends["send"] == 3
        assert manager.stats.write_retries == 1
    assert await topic_message_count(service_url, topic) == 2


async def test_writes_queued_behind_one_sent_at_once_follow_it_in_order(
    service_url: str, admin_url: str, topic: str
) -> None:
    manager = held_manager(service_url, topic, admin_url)
    async with manager:
        writer = await holding(manager)
        first = submit(manager, lambda s: [incr("first")], lambda s: s["count"])
        assert await end_of_turn(writer) is not None
        # Queued while it is in flight: the serve loop sends them after it, in one batch.
        followers = [
            submit(manager, lambda s, i=i: [incr(f"w{i}")], lambda s: s["count"]) for i in range(20)
        ]
        results = await asyncio.wait_for(asyncio.gather(first, *followers), 30)
        assert [r.value for r in results] == list(range(2, 23))  # applied in queue order
        seen = await seen_by(manager)
        assert len(seen) == 22
        assert set(seen.values()) == {1}


async def test_writes_queued_in_one_loop_turn_share_a_record(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Group commit as when the writer's task builds the batch: sending the first write as it
    # is queued, alone, would make the others wait for its acknowledgement.
    manager = held_manager(service_url, topic, admin_url)
    async with manager:
        await holding(manager)
        results = await asyncio.gather(*(manager.write(lambda s: [incr()]) for _ in range(10)))
        assert {r.position for r in results} == {2}
    assert await topic_message_count(service_url, topic) == 2


async def test_closing_right_after_a_write_sent_at_once_ends_it(
    service_url: str, admin_url: str, topic: str
) -> None:
    manager = held_manager(service_url, topic, admin_url)
    await manager.open()
    writer = await holding(manager)
    written = submit(manager, lambda s: [incr("b")])
    assert await end_of_turn(writer) is not None
    await asyncio.wait_for(manager.aclose(), 30)
    # The closing writer finished the batch first: the write's outcome is known.
    assert (await asyncio.wait_for(written, 5)).position == 2
    assert await topic_message_count(service_url, topic) == 2


async def test_closing_right_after_a_write_with_no_ops_sent_at_once_ends_it(
    service_url: str, admin_url: str, topic: str
) -> None:
    manager = held_manager(service_url, topic, admin_url)
    await manager.open()
    writer = await holding(manager)
    unchanged = submit(manager, lambda s: [])
    issued = await end_of_turn(writer)
    assert issued is not None
    assert issued.unchanged
    await asyncio.wait_for(manager.aclose(), 30)
    # Before: the write was in the writer's hands, neither queued nor in flight, when the
    # close cancelled the writer's task and stopped the deadline watchdog: it never ended.
    done, _ = await asyncio.wait({unchanged}, timeout=5)
    assert done
    with pytest.raises(ClosedError, match="closed before"):
        unchanged.result()


async def test_closing_while_a_batch_is_checked_ends_every_write_of_it(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = held_manager(service_url, topic, admin_url)
    await manager.open()
    writer = await holding(manager)
    catch_up = writer._catch_up

    async def slow_catch_up(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.5)  # the close comes while the batch's no-op write is checked
        return await catch_up(*args, **kwargs)

    monkeypatch.setattr(writer, "_catch_up", slow_catch_up)
    unchanged = submit(manager, lambda s: [])
    counted = submit(manager, lambda s: [incr("b")])
    await until(lambda: not manager._pending.queue, "the serve loop takes the batch")
    await asyncio.wait_for(manager.aclose(), 30)
    # Before: the no-op write was queued again and failed, but the other, taken into the
    # batch and not sent yet, was neither queued nor in flight: it never ended.
    done, _ = await asyncio.wait({unchanged, counted}, timeout=5)
    assert done == {unchanged, counted}
    for write in (unchanged, counted):
        with pytest.raises(ClosedError):
            write.result()
    assert await topic_message_count(service_url, topic) == 1


async def test_a_write_with_no_ops_batched_with_others_is_confirmed_before_they_are_sent(
    service_url: str, admin_url: str, topic: str
) -> None:
    # In one batch, a conditional write that appends nothing is decided on the state before
    # the batch's record, and confirmed (that state is the log's latest) before the record is
    # sent. Sent at once, the record would come first, and the decision would be reported at
    # the record's position, where its condition no longer holds: such a batch is left to the
    # writer's task, which builds it again and does it in that order.
    manager = held_manager(service_url, topic, admin_url)
    async with manager:
        writer = await holding(manager)
        conditional = submit(
            manager,
            lambda s: [] if s["count"] < 2 else [incr("late")],
            lambda s: s["count"],
        )
        other = submit(manager, lambda s: [incr("b")])
        assert await end_of_turn(writer) is None  # nothing sent: the batch is the loop's
        result = await asyncio.wait_for(conditional, 30)
        assert (result.value, result.position) == (1, 1)  # where its condition held
        assert (await asyncio.wait_for(other, 30)).position == 2
        assert await seen_by(manager) == {"a": 1, "b": 1}
        assert manager.stats.write_retries == 0


async def test_a_send_refused_before_it_leaves_is_retried(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client can refuse a send as it is handed over (here: the process check); that is a
    # failed send like any other, retried, not an error escaping to the writer loop with the
    # write launched but never sent (it then ended at its deadline, outcome unknown).
    refusals = {"left": 1}
    check = pulsar_state._pulsar._check_process

    def refusing_once(pid: int, what: str) -> None:
        if what.startswith("the writer") and refusals["left"]:
            refusals["left"] -= 1
            raise BrokerUnavailableError("injected: the client refused the send")
        check(pid, what)

    manager = held_manager(service_url, topic, admin_url)
    async with manager:
        writer = await holding(manager)
        monkeypatch.setattr(pulsar_state._pulsar, "_check_process", refusing_once)
        written = submit(manager, lambda s: [incr("b")])
        assert await end_of_turn(writer) is not None
        assert (await asyncio.wait_for(written, 30)).position == 2
        assert refusals["left"] == 0
        assert await seen_by(manager) == {"a": 1, "b": 1}
    assert await topic_message_count(service_url, topic) == 2


async def test_a_write_sent_at_once_is_finished_without_waking_the_writer(
    service_url: str, admin_url: str, topic: str
) -> None:
    manager = held_manager(service_url, topic, admin_url)
    async with manager:
        writer = await holding(manager)
        idle_wait = writer._idle_wait
        assert idle_wait is not None
        for expected in (2, 3, 4):
            result = await manager.write(lambda s: [incr("a")], reader=lambda s: s["count"])
            assert (result.value, result.position) == (expected, expected)
            # The same idle wait: the writer's task never left it, and the next write may
            # be sent at once again.
            assert writer._idle_wait is idle_wait
            assert writer._parked
            assert writer._issued is None
        assert manager.stats.records_sent == 4
        assert await seen_by(manager) == {"a": 4}
    assert await topic_message_count(service_url, topic) == 4


async def test_writes_finished_at_once_keep_the_writer_past_its_idle_release(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The writer is given up idle_release_s after the last write, not after the first one
    # finished without the writer's task: each pushes its idle wait back.
    manager = counter_manager(service_url, topic, admin_url, idle_release_s=0.6, max_hold_s=30.0)
    async with manager:
        await holding(manager)
        for _ in range(8):  # 1.6 s in all, a write every 0.2 s
            await asyncio.sleep(0.2)
            await manager.write(lambda s: [incr()])
        assert manager.stats.writer_releases == 0
        assert manager.stats.writer_acquisitions == 1
        await asyncio.sleep(1.5)  # idle: released as before
        assert manager.stats.writer_releases == 1
    assert await topic_message_count(service_url, topic) == 9


async def test_a_write_acknowledged_out_of_step_with_the_replica_is_finished_by_the_writer(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A record not provably next in the log (the first of a new ledger, or the replica's
    # pump behind) is read back by the pump: the writer's task finishes that batch.
    manager = held_manager(service_url, topic, admin_url)
    async with manager:
        writer = await holding(manager)
        replica = manager._replica
        monkeypatch.setattr(replica, "is_next", lambda at: False)
        monkeypatch.setattr(replica, "apply_own", lambda payload, record, at: None)
        idle_wait = writer._idle_wait
        result = await asyncio.wait_for(
            manager.write(lambda s: [incr("b")], reader=lambda s: s["count"]), 30
        )
        assert (result.value, result.position) == (2, 2)
        assert writer._idle_wait is not idle_wait  # the writer's task was woken for it
        assert await seen_by(manager) == {"a": 1, "b": 1}
    assert await topic_message_count(service_url, topic) == 2


async def test_writes_left_queued_by_a_batch_sent_at_once_follow_without_delay(
    service_url: str, admin_url: str, topic: str
) -> None:
    # One write per batch: the second, queued in the same loop turn, is left in the queue;
    # the writer's task sends it next (it waited for the writer's task to wake: here at
    # the unasked turn, 5 s or more, or after idle_release_s, 30 s).
    manager = counter_manager(service_url, topic, admin_url, max_writes_per_batch=1, **HELD)
    async with manager:
        await holding(manager)
        results = await asyncio.wait_for(
            asyncio.gather(*(manager.write(lambda s: [incr()]) for _ in range(2))), 3
        )
        assert sorted(r.position for r in results) == [2, 3]
    assert await topic_message_count(service_url, topic) == 3


async def test_a_lone_writer_finishing_writes_at_once_still_gives_its_idle_turn(
    service_url: str, admin_url: str, topic: str
) -> None:
    # With the relay open, the holder gives one turn unasked at a moment nothing is queued,
    # at half of _unasked_turn_after() (here 20 x max_hold_s = 1 s: at 0.5 s), as its
    # writer's task would when it waits again after each batch; a writer finishing writes
    # at once must not push that wait past it (the turn then came only at 1 s, as a busy
    # one with its pause).
    manager = counter_manager(service_url, topic, admin_url, idle_release_s=0.3, max_hold_s=0.05)
    async with manager:
        await manager.write(lambda s: [incr("a")])
        await until(lambda: manager._parts.relay.ready, "the relay opens")
        releases = manager.stats.writer_releases
        loop = asyncio.get_running_loop()
        started = loop.time()
        while loop.time() - started < 0.8:
            await asyncio.sleep(0.05)
            await manager.write(lambda s: [incr()])
        assert manager.stats.writer_releases > releases
