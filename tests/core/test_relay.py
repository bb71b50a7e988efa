"""The write relay: records of a process without the writer, appended by the process holding it."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pulsar.asyncio as pulsar_asyncio
import pytest

from pulsar_state import PulsarStateError, SharedStateManager, WriteOutcomeUnknownError
from pulsar_state._envelope import Record, Write, encode_record
from pulsar_state._relay import TURN_REQUEST, Relay, is_release_notice, release_notice
from pulsar_state._writer import Writer
from tests.core.helpers import Counter, counter_manager, incr, seen_by
from tests.support.waiting import until

Manager = SharedStateManager[Counter, dict[str, Any]]
# Keeps the writer once it has it (no idle release, no turns).
HOLD = {"idle_release_s": 3600.0, "max_hold_s": 3600.0}


def tagged(tag: str) -> Callable[[Counter], list[dict[str, Any]]]:
    return lambda state: [incr(tag)]


def writer_of(manager: SharedStateManager[Any, Any]) -> Writer:
    writer = manager._parts.writer
    assert writer is not None
    return writer


def relay_of(manager: SharedStateManager[Any, Any]) -> Relay:
    relay = manager._parts.relay
    assert relay is not None
    return relay


def count_acquisitions(manager: SharedStateManager[Any, Any]) -> list[int]:
    """A one-item list counting the manager's writer acquisition attempts from now on."""
    writer = writer_of(manager)
    acquire = writer._acquire
    attempts = [0]

    async def counted(*, ahead: bool = False) -> None:
        attempts[0] += 1
        await acquire(ahead=ahead)

    writer._acquire = counted  # type: ignore[method-assign]
    return attempts


def slow_appends(manager: SharedStateManager[Any, Any], delay: float) -> None:
    """The manager appends relayed records only ``delay`` after they came."""
    writer = writer_of(manager)
    append = writer._append_foreign

    async def slowly() -> None:
        await asyncio.sleep(delay)
        await append()

    writer._append_foreign = slowly  # type: ignore[method-assign]


def note_releases(manager: SharedStateManager[Any, Any]) -> list[int]:
    """How many writes were queued at each release of the writer the manager holds."""
    writer = writer_of(manager)
    release = writer.release
    queued_at_release: list[int] = []

    async def noting() -> None:
        if writer._producer is not None:
            queued_at_release.append(len(writer._pending.queue))
        await release()

    writer.release = noting  # type: ignore[method-assign]
    return queued_at_release


def relay_ready(manager: SharedStateManager[Any, Any]) -> bool:
    relay = manager._parts.relay
    return relay is not None and relay.ready


@asynccontextmanager
async def turning_holder(
    service_url: str, admin_url: str, topic: str
) -> AsyncIterator[tuple[Manager, list[int]]]:
    """A manager that keeps the writer it takes but for turns (max_hold_s 50 ms), its relay
    open, and the writes queued at each of its releases (see note_releases)."""
    async with counter_manager(
        service_url, topic, admin_url, idle_release_s=3600, max_hold_s=0.05
    ) as holder:
        await until(lambda: relay_ready(holder), "the relay opens")
        yield holder, note_releases(holder)


@asynccontextmanager
async def holder_and_sender(
    service_url: str,
    admin_url: str,
    topic: str,
    *,
    holder: dict[str, Any] | None = None,
    sender: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[Manager, Manager]]:
    """(holder, sender): the holder wrote once and keeps the writer (``HOLD`` unless
    ``holder`` says otherwise); the relays are open; the sender has read the holder's
    record, so nothing it relays is stale (a stale record is retried: relayed twice)."""
    async with (
        counter_manager(service_url, topic, admin_url, **(HOLD if holder is None else holder)) as h,
        counter_manager(service_url, topic, admin_url, **(sender or {})) as s,
    ):
        await h.write(lambda state: [incr("holder")])
        await until(
            lambda: relay_ready(s) and (h._parts.relay is None or relay_ready(h)),
            "the relays open",
        )
        await s.read(lambda state: state, latest=True)
        yield h, s


async def test_a_write_is_relayed_through_the_process_holding_the_writer(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Without the relay the other write waits for the holder's writer forever (its
    # acquire_timeout_s); with it, it lands through the holder, once.
    async with holder_and_sender(
        service_url, admin_url, topic, sender={"acquire_timeout_s": 2.0}
    ) as (holder, other):
        result = await other.write(lambda s: [incr("other")], reader=lambda s: s["count"])
        assert result.value == 2
        assert other.stats.writer_acquisitions == 0
        assert other.stats.records_relayed == 1
        # (The sender may read it back before the holder counts it.)
        await until(lambda: holder.stats.relayed_appended == 1, "counted by the holder")
        for manager in (holder, other):
            state = await manager.read(lambda s: s, latest=True)
            assert state["count"] == 2
            assert state["seen"] == {"holder": 1, "other": 1}


async def test_relayed_writes_under_contention_apply_exactly_once(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Stale relayed records (built before the holder's latest) are ignored by every replica
    # and their writes retried; nothing is lost or applied twice.
    managers = [counter_manager(service_url, topic, admin_url) for _ in range(4)]
    for manager in managers:
        await manager.open()
    try:
        await until(lambda: all(relay_ready(m) for m in managers), "the relays open")

        async def writes(index: int, manager: SharedStateManager[Counter, Any]) -> None:
            for n in range(40):
                await manager.write(tagged(f"{index}-{n}"))
                await asyncio.sleep(random.uniform(0, 0.004))

        await asyncio.gather(*(writes(i, m) for i, m in enumerate(managers)))
        assert sum(m.stats.records_relayed for m in managers) > 0
        for manager in managers:
            state = await manager.read(lambda s: s, latest=True)
            assert state["count"] == 160
            assert set(state["seen"].values()) == {1}
            assert len(state["seen"]) == 160
    finally:
        for manager in managers:
            await manager.aclose()


async def test_a_relayed_record_nobody_appends_lands_once_through_the_writer(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The holder has no relay: the relayed record reaches nobody. The writer goes back to
    # polling for the writer, and once it has it, retries the write it did not see: once.
    async with holder_and_sender(
        service_url, admin_url, topic, holder={"relay_writes": False, **HOLD}
    ) as (holder, other):
        write = asyncio.ensure_future(other.write(lambda s: [incr("other")]))
        await until(lambda: other.stats.records_relayed == 1, "the write relayed")
        await asyncio.sleep(0.3)  # well past the relay's patience: polling for the writer
        assert not write.done()
        holder.release_writer()
        await asyncio.wait_for(write, 10)
        assert other.stats.writer_acquisitions == 1
        for manager in (holder, other):
            state = await manager.read(lambda s: s, latest=True)
            assert state["seen"] == {"holder": 1, "other": 1}


async def test_a_holder_drops_what_it_cannot_append_and_goes_on(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Bad input on the relay topic (anyone may publish there): not a record, a record built
    # on another history (appended, it would halt every replica as a fork), and one with an
    # op the codec cannot decode (appended, every replica would halt on it). All three are
    # dropped with a warning; a turn request from a stranger only asks for a turn.
    caplog.set_level(logging.WARNING, logger="pulsar_state")
    async with holder_and_sender(service_url, admin_url, topic) as (holder, other):
        relay = relay_of(holder)
        forked = Record("stranger", 1, 7, "stranger/0", [Write(1, [b'{"op": "incr"}'])])
        # Based on the log's latest, but with an op the codec cannot decode.
        undecodable = Record(
            "stranger", 2, holder.position, holder._replica.last_record_id, [Write(1, [b"\xff"])]
        )
        client = pulsar_asyncio.Client(service_url, operation_timeout_seconds=15)
        try:
            producer = await client.create_producer(relay.topic)
            for payload in (
                b"not a record",
                encode_record(forked),
                encode_record(undecodable),
                TURN_REQUEST,
            ):
                await producer.send(payload)
            await producer.close()
        finally:
            await client.close()
        await until(
            lambda: sum("dropping" in r.getMessage() for r in caplog.records) >= 3,
            "all three dropped",
        )
        await other.write(lambda s: [incr("other")])
        assert holder.halted is None
        assert other.halted is None
        await until(lambda: holder.stats.relayed_appended == 1, "counted by the holder")
        for manager in (holder, other):
            state = await manager.read(lambda s: s, latest=True)
            assert state["seen"] == {"holder": 1, "other": 1}


async def test_a_process_without_the_relay_still_gets_its_turn(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A holder with a relay gives turns only when asked (others' writes are relayed), but
    # still one unasked (after 10 x max_hold_s when no write is queued, one with a pause
    # after 20 x however busy), or a process without the relay, which can only poll for
    # the writer, would never write while the holder keeps writing.
    async with (
        counter_manager(service_url, topic, admin_url, idle_release_s=3600, max_hold_s=0.2) as busy,
        counter_manager(service_url, topic, admin_url, relay_writes=False) as poller,
    ):
        await until(lambda: relay_ready(busy), "the relay opens")
        stop = asyncio.Event()

        async def keep_writing() -> None:
            while not stop.is_set():
                await busy.write(lambda s: [incr()])

        writing = asyncio.ensure_future(keep_writing())
        try:
            await asyncio.sleep(0.3)  # past max_hold_s: no turn given unasked yet
            await poller.write(lambda s: [incr("poller")], timeout=15.0)
        finally:
            stop.set()
            await writing
        assert (await seen_by(poller))["poller"] == 1
        assert busy.stats.writer_releases >= 1


async def test_an_unasked_turn_is_given_with_no_write_queued(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The turn given unasked (for processes without the relay) was given while writes were
    # queued, each then paused 50 ms and more: every 10 s, in a lock benchmark's p99. With
    # nothing queued it costs a write at most taking the writer back.
    async with turning_holder(service_url, admin_url, topic) as (busy, queued_at_release):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        written = 0
        # The first turn (0.5 s in); the next may be the one with the pause (1 s in).
        while not queued_at_release and loop.time() < deadline:
            await busy.write(lambda s: [incr()])
            written += 1
        assert queued_at_release == [0]
        assert (await busy.read(lambda s: s["count"], latest=True)) == written


async def test_an_idle_turn_not_taken_back_at_once_restarts_the_count_to_the_next(
    service_url: str, admin_url: str, topic: str
) -> None:
    # An idle turn the holder takes straight back leaves the count to the turn with the
    # pause running; one followed by a long idle spell (pollers had their chance) restarts
    # it, or the next holding paused for a turn as soon as a write was queued.
    async with turning_holder(service_url, admin_url, topic) as (holder, queued_at_release):
        writer = writer_of(holder)
        while not queued_at_release:
            await holder.write(lambda s: [incr()])
        await holder.write(lambda s: [incr()])  # taken straight back
        assert writer._unpaused_since < writer._producer_since
        # Idle now: the next turn comes idle too, and nothing takes the writer back soon.
        await until(lambda: len(queued_at_release) == 2, "the second idle turn", seconds=5.0)
        assert queued_at_release == [0, 0]
        await asyncio.sleep(0.2)  # the writer free longer than a turn's pause (50 ms)
        await holder.write(lambda s: [incr()])
        assert writer._unpaused_since == writer._producer_since


async def test_a_holder_idle_when_the_relay_opens_gives_its_unasked_turn_idle(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer taken before the relay opened waited idle by the rules of no relay (an
    # hour here); told of the relay, it gives its unasked turn then, not at the next write.
    from pulsar_state._relay import Relay

    opening = Relay.open

    async def late(self: Relay, *args: Any) -> None:
        await asyncio.sleep(1.0)
        await opening(self, *args)

    monkeypatch.setattr(Relay, "open", late)
    async with counter_manager(
        service_url, topic, admin_url, idle_release_s=3600, max_hold_s=0.05
    ) as holder:
        await holder.write(lambda s: [incr()])  # takes the writer: no relay yet
        writer = writer_of(holder)
        queued_at_release = note_releases(holder)
        await until(lambda: relay_ready(holder), "the relay opens")
        # Held 1 s by now, past 10 x max_hold_s: the turn comes with no write to wait for.
        await until(lambda: bool(queued_at_release), "the idle turn", seconds=5.0)
        assert writer._producer is None
        assert queued_at_release == [0]
        await holder.write(lambda s: [incr()])


@pytest.mark.timeout(60)
async def test_a_relayed_record_appended_late_ends_the_wait_for_the_writer(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The holder appends the relayed record after the sender's patience (50 ms): the sender
    # is then polling for the writer, and its write completes from the relayed record. The
    # sender's writer loop must then go idle (it once spun, never yielding: this test hung).
    async with holder_and_sender(service_url, admin_url, topic) as (holder, other):
        slow_appends(holder, 0.3)
        attempts = count_acquisitions(other)
        await asyncio.wait_for(other.write(lambda s: [incr("other")]), 20)
        assert other.stats.records_relayed == 1
        assert other.stats.writer_acquisitions == 0
        await asyncio.sleep(0.1)
        settled = attempts[0]
        await asyncio.sleep(0.3)  # the loop runs, and the writer has stopped asking
        assert attempts[0] == settled
        assert (await seen_by(other)) == {"holder": 1, "other": 1}


async def test_a_sender_batch_of_several_records_is_appended_whole(
    service_url: str, admin_url: str, topic: str
) -> None:
    # One record per write: the sender's batch is a chain (each record based on the one
    # before it), which the holder must append whole, not only its first record.
    async with holder_and_sender(
        service_url, admin_url, topic, sender={"max_writes_per_record": 1}
    ) as (holder, other):
        slow_appends(holder, 0.02)  # all five wait together in the holder (within patience)
        writes = (other.write(tagged(f"o{n}")) for n in range(5))
        await asyncio.wait_for(asyncio.gather(*writes), 20)
        assert other.stats.writer_acquisitions == 0
        # (The sender may read them back before the holder counts them.)
        await until(lambda: holder.stats.relayed_appended == 5, "all five appended")
        assert (await holder.read(lambda s: s["count"], latest=True)) == 6


async def test_a_holder_whose_client_refuses_a_relayed_record_sends_none_built_on_it(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The holder's client refuses the first link of a chain relayed to it, inside its send
    # call (too large for the holder's broker, say). Before: the holder still sent the
    # next links, built on a record the log never got, and every replica halted as forked
    # (from helper 37's review).
    async with counter_manager(service_url, topic, admin_url, **HOLD) as holder:
        await holder.write(lambda state: [incr("holder")])
        writer = writer_of(holder)
        producer = writer._producer
        assert producer is not None
        send_nowait = producer.send_nowait
        sent: list[str] = []

        def refusing_the_first(
            payload: bytes, *, key: str, on_settled: Callable[[], None] | None = None
        ) -> asyncio.Future[Any]:
            sent.append(key)
            if key == "X/1":
                producer.refused = True  # as the client's own check refusing it does
                failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                failed.set_exception(PulsarStateError("injected: the client refused it"))
                return failed
            return send_nowait(payload, key=key, on_settled=on_settled)

        producer.send_nowait = refusing_the_first  # type: ignore[method-assign]
        base, base_id = holder.position, holder._replica.last_record_id  # test-only peek
        for seq in (1, 2, 3):  # X's chain, relayed whole
            op = f'{{"op":"incr","id":"x{seq}"}}'.encode()
            link = Record("X", seq, base + seq - 1, base_id, [Write(seq, [op])])
            base_id = link.record_id
            writer.accept_foreign(encode_record(link))
        await until(lambda: writer._producer is None, "the holder lets the writer go")
        assert sent == ["X/1"]
        await holder.write(lambda state: [incr("after")])
        assert holder.halted is None
        assert await seen_by(holder) == {"holder": 1, "after": 1}


async def test_a_holder_with_only_relayed_records_still_gives_turns(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The holder writes nothing of its own; a second process keeps relaying through it. A
    # process without the relay (it can only poll) still gets the writer within 20 x
    # max_hold_s.
    async with (
        counter_manager(
            service_url, topic, admin_url, idle_release_s=3600, max_hold_s=0.2
        ) as holder,
        counter_manager(service_url, topic, admin_url, max_hold_s=0.2) as relaying,
        counter_manager(service_url, topic, admin_url, relay_writes=False) as poller,
    ):
        await holder.write(lambda s: [incr("holder")])
        await until(lambda: relay_ready(holder) and relay_ready(relaying), "the relays open")
        stop = asyncio.Event()

        async def keep_relaying() -> None:
            while not stop.is_set():
                await relaying.write(lambda s: [incr()])

        writing = asyncio.ensure_future(keep_relaying())
        try:
            await until(lambda: holder.stats.relayed_appended > 3, "writes relayed")
            await poller.write(lambda s: [incr("poller")], timeout=30.0)
        finally:
            stop.set()
            await writing
        assert (await seen_by(poller))["poller"] == 1


async def test_a_write_whose_relayed_attempt_may_land_is_not_reported_unchanged(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The relayed attempt reaches nobody (the holder has no relay); the sender takes the
    # writer and runs the generator again on the same state, which now gives no ops (it is
    # not a function of the state alone). A process that received the relayed attempt late
    # could still append it, so the write's outcome is unknown, not "unchanged".
    calls = []

    def moody(state: Counter) -> list[dict[str, Any]]:
        calls.append(state["count"])
        return [incr("moody")] if len(calls) == 1 else []

    async with holder_and_sender(
        service_url, admin_url, topic, holder={"relay_writes": False, **HOLD}
    ) as (holder, other):
        write = asyncio.ensure_future(other.write(moody))
        await until(lambda: other.stats.records_relayed == 1, "the write relayed")
        holder.release_writer()
        with pytest.raises(WriteOutcomeUnknownError, match="relayed"):
            await asyncio.wait_for(write, 20)
        assert calls == [1, 1]


async def test_writes_queued_while_a_late_relayed_record_lands_are_relayed_too(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The first relayed record lands after the sender's patience, while it polls for the
    # writer with a second write queued: once the first is seen, the second is relayed too,
    # rather than waiting for a holder that never gives the writer up.
    async with holder_and_sender(
        service_url, admin_url, topic, sender={"acquire_timeout_s": 5.0}
    ) as (holder, other):
        slow_appends(holder, 0.3)
        first = asyncio.ensure_future(other.write(lambda s: [incr("first")]))
        await asyncio.sleep(0.1)  # past the patience: polling for the writer
        second = asyncio.ensure_future(other.write(lambda s: [incr("second")]))
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert other.stats.writer_acquisitions == 0
        assert other.stats.records_relayed == 2


async def test_an_idle_holder_gives_a_turn_when_asked(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The holder drops what is relayed to it (as if lost on the way) but hears turn requests.
    # The sender, its relayed record unseen, polls for the writer and asks for a turn: the
    # holder, idle for an hour otherwise, gives it after max_hold_s.
    async with holder_and_sender(
        service_url,
        admin_url,
        topic,
        holder={"idle_release_s": 3600, "max_hold_s": 0.3},
        sender={"acquire_timeout_s": 10.0},
    ) as (holder, other):
        writer = writer_of(holder)

        async def lose() -> None:
            writer._foreign.clear()

        writer._append_foreign = lose  # type: ignore[method-assign]
        await asyncio.wait_for(other.write(lambda s: [incr("other")]), 10)
        assert other.stats.records_relayed == 1
        assert other.stats.writer_acquisitions == 1
        assert holder.stats.writer_releases == 1
        assert (await seen_by(other)) == {"holder": 1, "other": 1}


async def test_a_relayed_chain_built_on_a_stale_state_is_retried_at_once(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The sender has not read the holder's latest record when it relays five records (one
    # per write, each based on the one before). The first is stale: appended, ignored by
    # everyone. The other four are based on it, so no replica could ever accept them (the
    # holder drops them); the sender retries their writes as soon as it sees the first
    # ignored, instead of waiting for them and then for a writer the holder keeps.
    async with holder_and_sender(
        service_url, admin_url, topic, sender={"max_writes_per_record": 1, "acquire_timeout_s": 5.0}
    ) as (holder, other):
        reader = other._replica._reader
        assert reader is not None
        read_batch = reader.read_batch
        gate = asyncio.Event()

        async def gated() -> Any:
            await gate.wait()
            return await read_batch()

        reader.read_batch = gated  # type: ignore[method-assign]
        await holder.write(lambda s: [incr("unseen")])  # the pump's pending read takes it...
        await until(lambda: other.position == 2, "read by the sender")
        await holder.write(lambda s: [incr("stale-maker")])  # ...this one waits at the gate
        slow_appends(holder, 0.02)  # the five arrive together
        writes = asyncio.ensure_future(
            asyncio.gather(*(other.write(tagged(f"o{n}")) for n in range(5)))
        )
        await until(lambda: other.stats.records_relayed == 5, "the chain relayed")
        await asyncio.sleep(0.2)  # appended (the first, stale) and dropped (the rest)
        gate.set()
        await asyncio.wait_for(writes, 10)
        assert other.stats.writer_acquisitions == 0
        state = await holder.read(lambda s: s, latest=True)
        assert state["count"] == 8
        assert set(state["seen"].values()) == {1}


async def test_records_a_process_appended_for_others_say_nothing_of_a_holder_once_it_let_go(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The holder appended another process's relayed record, then gave the writer up: that
    # record is no sign of some other holder, so its next write takes the writer at once
    # instead of being relayed to nobody (and retried after the relay's patience).
    async with holder_and_sender(service_url, admin_url, topic) as (holder, other):
        await other.write(tagged("other"))
        await until(lambda: holder.stats.relayed_appended == 1, "appended by the holder")
        writer = writer_of(holder)
        await writer.release()
        acquired = holder.stats.writer_acquisitions
        result = await holder.write(tagged("again"), reader=lambda s: s["count"])
        assert result.value == 3
        assert holder.stats.records_relayed == 0
        assert holder.stats.writer_acquisitions == acquired + 1


@pytest.mark.parametrize(
    ("hold", "read_ago"),
    [
        # The holder keeps the writer idle_release_s (1 s, the same for both) after its
        # latest append, and others read that record within milliseconds: 0.6 s later it
        # still holds it. It once tried to take the writer first whenever over half
        # idle_release_s had passed.
        ({"idle_release_s": 1.0}, 0.6),
        # With relay_idle_release_s (5 s) the holder keeps it well past idle_release_s
        # (0.1 s), and others count on that, not on idle_release_s.
        ({"relay_idle_release_s": 5.0}, 0.5),
    ],
)
async def test_a_holder_read_writing_more_than_half_its_idle_time_ago_is_relayed_to(
    service_url: str, admin_url: str, topic: str, hold: dict[str, float], read_ago: float
) -> None:
    # The write is relayed at once, not after first trying to take the writer (a refusal:
    # 1-4 ms on a lock's handover).
    async with holder_and_sender(
        service_url, admin_url, topic, holder={**hold, "max_hold_s": 3600.0}, sender=hold
    ) as (holder, other):
        await holder.write(tagged("holder"))
        await other.read(lambda state: state, latest=True)
        attempts = count_acquisitions(other)
        await asyncio.sleep(read_ago)
        await other.write(tagged("other"))
        assert attempts[0] == 0
        assert other.stats.records_relayed == 1
        assert holder.stats.writer_releases == 0
        assert (await seen_by(holder)) == {"holder": 2, "other": 1}


async def test_a_holder_that_lets_go_says_so_and_the_next_write_takes_the_writer(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Without the holder's notice, the other process (which read the holder's record within
    # 80% of its idle_release_s, 10 s) relays its write to nobody and takes the writer only
    # after the relay's patience.
    async with holder_and_sender(
        service_url, admin_url, topic, sender={"idle_release_s": 10.0}
    ) as (holder, other):
        holder_writer, writer = writer_of(holder), writer_of(other)
        await holder_writer.release()
        await until(lambda: writer._holder_released_at > 0, "the holder's notice")
        await other.write(tagged("other"))
        assert other.stats.records_relayed == 0
        assert other.stats.writer_acquisitions == 1
        assert (await seen_by(holder)) == {"holder": 1, "other": 1}


class _Dropped(list[bytes]):
    """A holder's queue of relayed records that keeps none (as if each came too late)."""

    def append(self, payload: bytes) -> None:
        pass


@pytest.mark.timeout(60)
async def test_a_relayed_record_stops_waiting_when_its_holder_says_it_let_go(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The holder drops the relayed record, then gives the writer up and says so: the sender
    # stops waiting (the patience is 30 s here) and takes the writer, with no quiet time on
    # the relay (it works: there was just nobody to append).
    monkeypatch.setattr("pulsar_state._writer._RELAY_PATIENCE_S", 30.0)
    async with holder_and_sender(service_url, admin_url, topic) as (holder, other):
        holder_writer, writer = writer_of(holder), writer_of(other)
        holder_writer._foreign = _Dropped()  # type: ignore[assignment]
        write = asyncio.ensure_future(other.write(tagged("other")))
        await until(lambda: other.stats.records_relayed == 1, "the write relayed")
        await holder_writer.release()
        await asyncio.wait_for(write, 10)
        assert other.stats.writer_acquisitions == 1
        assert writer._relay_quiet_until == float("-inf")
        assert (await seen_by(holder)) == {"holder": 1, "other": 1}


async def test_a_holder_that_lets_go_again_while_its_notice_is_on_its_way_says_so_again(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The first notice is slow to go out; the holder takes the writer back and lets it go
    # again meanwhile: that second release is said too (others read the holder's new
    # records after the first notice, and would take it to hold the writer still).
    async with holder_and_sender(service_url, admin_url, topic) as (holder, _):
        relay, writer = relay_of(holder), writer_of(holder)
        notices: list[bytes] = []
        send = relay.send

        async def slowly(payload: bytes) -> None:
            if is_release_notice(payload):
                notices.append(payload)
                await asyncio.sleep(0.3)
            await send(payload)

        relay.send = slowly  # type: ignore[method-assign]
        await writer.release()
        await holder.write(tagged("holder"))  # takes the writer back
        await writer.release()
        await until(lambda: len(notices) == 2, "a notice for each release")


async def test_a_relayed_record_seen_after_a_notice_is_no_sign_of_a_holder(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A notice comes while the relayed record is on its way, and the record is seen within
    # the grace that follows: it landed, but its holder has let go since, so the next write
    # must not be relayed to it on the strength of that landing.
    monkeypatch.setattr("pulsar_state._writer._RELEASED_GRACE_S", 10.0)
    async with holder_and_sender(service_url, admin_url, topic) as (_, other):
        relay, writer = relay_of(other), writer_of(other)
        send = relay.send

        async def then_a_notice(payload: bytes) -> None:
            await send(payload)
            writer.accept_foreign(release_notice("an-earlier-holder"))

        relay.send = then_a_notice  # type: ignore[method-assign]
        await other.write(tagged("other"))
        assert other.stats.records_relayed == 1
        assert writer._relay_landed_at == float("-inf")


async def test_relay_idle_release_s_keeps_the_writer_only_while_the_relay_is_up(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Holding the writer longer while idle costs others nothing only when their writes can
    # come through the holder: without the relay (switched off, or down: it may fail to
    # open or close), the plain idle_release_s applies, or a poller would wait it out.
    longer = {"relay_idle_release_s": 5.0}
    async with (
        counter_manager(service_url, topic, admin_url, **longer) as relayed,
        counter_manager(
            service_url, f"{topic}-off", admin_url, relay_writes=False, **longer
        ) as off,
        counter_manager(service_url, f"{topic}-down", admin_url, **longer) as down,
    ):
        await until(lambda: relay_ready(relayed) and relay_ready(down), "the relays open")
        await relay_of(down).close()  # down from now on, as after a failed open
        for manager in (relayed, off, down):
            await manager.write(tagged("first"))
        await asyncio.sleep(0.5)  # past idle_release_s (0.1 s), within 5 s
        for manager in (relayed, off, down):
            await manager.write(tagged("second"))
        assert (relayed.stats.writer_acquisitions, relayed.stats.writer_releases) == (1, 0)
        assert off.stats.writer_acquisitions == 2
        assert down.stats.writer_acquisitions == 2


async def test_a_refusal_decided_on_a_state_behind_the_log_is_decided_again(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The sender relays its writes: it builds them on its replica, which reads the holder's
    # records a moment late (held back here). A write whose generator fails on that state
    # (the key a finished write made is not there yet) must not fail on it: the failure
    # stands only once the state is confirmed the log's latest. Before: KeyError at once.
    async with holder_and_sender(
        service_url, admin_url, topic, sender={"acquire_timeout_s": 2.0}
    ) as (holder, sender):
        replica = sender._replica
        read_next = replica._next_batch
        gate = asyncio.Event()
        gate.set()

        async def held_back() -> Any:
            batch = await read_next()
            await gate.wait()
            return batch

        replica._next_batch = held_back  # type: ignore[method-assign]
        noise = await holder.write(lambda s: [incr("noise")])
        await until(lambda: sender.position >= noise.position, "the sender reads on")
        gate.clear()
        await holder.write(lambda s: [incr("made")])  # finished before the next write starts

        def needs_made(state: Counter) -> list[dict[str, Any]]:
            if "made" not in state["seen"]:
                raise KeyError("made is not there")
            return [incr("after-made")]

        write = asyncio.ensure_future(sender.write(needs_made))
        await asyncio.sleep(0.3)
        gate.set()
        await asyncio.wait_for(write, 30)
        assert (await seen_by(sender))["after-made"] == 1


async def test_a_holder_holds_no_relayed_record_it_could_not_send_nor_too_many_bytes(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: only the number of records relayed and not yet appended was bounded (1,000,
    # each up to the broker's 5 MB), and one larger than the holder could send was kept,
    # sent, refused, and cost the holder its writer.
    monkeypatch.setattr("pulsar_state._writer._MAX_FOREIGN_BYTES", 3000, raising=False)
    async with counter_manager(
        service_url, topic, admin_url, idle_release_s=30.0, max_record_bytes=2048
    ) as holder:
        await holder.write(lambda state: [incr("holder")])
        writer = holder._parts.writer
        assert writer is not None
        assert writer._producer is not None
        writer.accept_foreign(b"R" * 2049)  # more than this holder's max_record_bytes
        assert len(writer._foreign) == 0
        writer.accept_foreign(b"R" * 2000)
        writer.accept_foreign(b"R" * 1500)  # 3,500 bytes waiting would be more than 3,000
        assert [len(payload) for payload in writer._foreign] == [2000]
        # (Not records: the holder drops it when it comes to append it, and goes on.)
        await until(lambda: not writer._foreign, "the relayed bytes handled")
        writer.accept_foreign(b"R" * 1500)  # room again
        assert [len(payload) for payload in writer._foreign] == [1500]
        await holder.write(lambda state: [incr("after")])
        assert await seen_by(holder) == {"holder": 1, "after": 1}
        assert writer._producer is not None
