"""The writer after a failed send, on the real broker with one fault injected into the
library's own code: its send wrapper (``StateWriter.send_nowait``, as if the client had failed the
send) and, for one test, its read-back of the records sent (``Replica.wait_log``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pulsar_state import (
    BrokerUnavailableError,
    OperationTimeoutError,
    PulsarStateError,
    ReplicaHaltedError,
    WriteOutcomeUnknownError,
    WriterBusyError,
)
from pulsar_state._pulsar import LogPosition, StateReader, StateWriter
from pulsar_state._replica import Replica
from pulsar_state._writer import Writer
from tests.core.helpers import (
    counter_manager,
    fail_send_number,
    incr,
    seen_by,
    writer_held_elsewhere,
)


async def wait_until_forgotten(manager: Any, timeout: float = 10.0) -> int:
    # Polled: the watchdog prunes on its own schedule; nothing to wait on.
    for _ in range(int(timeout / 0.1)):
        if not manager._pending.records_in_flight:
            break
        await asyncio.sleep(0.1)
    return int(manager._pending.records_in_flight)


async def test_a_failed_send_is_retried_and_then_forgotten(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The failed send's record stays in flight (it may still land) until its write has its
    # outcome; then nothing waits on it. Before: kept, with its generator, forever.
    fail_send_number(monkeypatch, 1)
    async with counter_manager(service_url, topic, admin_url) as manager:
        result = await manager.write(lambda s: [incr("a")])
        assert await manager.read(lambda s: (s["count"], s["seen"]), latest=True) == (1, {"a": 1})
        assert result.position == 1
        assert await wait_until_forgotten(manager) == 0


async def test_a_failed_send_is_retried_even_when_the_read_back_times_out(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One batch, two records: the first is acked, the second's send fails, and reading back
    # the first takes longer than write_timeout_s. The failed write must still be retried
    # (its own timeout is longer); before, only its deadline ended it, with an unknown outcome.
    calls = fail_send_number(monkeypatch, 2)
    wait_log = Replica.wait_log
    stalled: list[bool] = []
    # The pump reads nothing until the read-back stalls: were it to read the first record
    # before the writer looks, there would be nothing to read back (seen under CPU load).
    gate = asyncio.Event()
    read_batch = StateReader.read_batch

    async def gated(self: StateReader) -> Any:
        await gate.wait()
        return await read_batch(self)

    async def slow_read_back(self: Replica, target: LogPosition | None) -> None:
        if calls["send"] == 2 and not stalled:
            stalled.append(True)
            gate.set()  # the retry's catch-up reads the log
            await asyncio.sleep(3600)
        await wait_log(self, target)

    monkeypatch.setattr(StateReader, "read_batch", gated)
    monkeypatch.setattr(Replica, "wait_log", slow_read_back)
    manager = counter_manager(
        service_url, topic, admin_url, write_timeout_s=1.0, max_writes_per_record=1
    )
    async with manager:
        results = await asyncio.gather(
            manager.write(lambda s: [incr("a")], timeout=30.0),
            manager.write(lambda s: [incr("b")], timeout=30.0),
        )
        assert stalled == [True]
        assert sorted(r.position for r in results) == [1, 2]
        state = await manager.read(lambda s: (s["count"], s["seen"]), latest=True)
        assert state == (2, {"a": 1, "b": 1})


async def test_a_write_in_flight_when_the_replica_halts_ends_at_once(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its record is sent; the replica halts before seeing it (injected: halted from the send
    # wrapper). Nothing can settle the write any more: it ended only at its deadline (here
    # 600 s); it ends now, with an unknown outcome (the record may be in the log).
    send_nowait = StateWriter.send_nowait
    manager = counter_manager(service_url, topic, admin_url)

    def halting(
        self: StateWriter, payload: bytes, *, key: str, on_settled: Any = None
    ) -> asyncio.Future[LogPosition]:
        manager._replica.halt_with(PulsarStateError("injected: the replica stopped"))
        return send_nowait(self, payload, key=key, on_settled=on_settled)

    async with manager:
        monkeypatch.setattr(StateWriter, "send_nowait", halting)
        write = asyncio.ensure_future(manager.write(lambda s: [incr("a")], timeout=600.0))
        with pytest.raises(WriteOutcomeUnknownError, match="the replica halted") as caught:
            await asyncio.wait_for(write, 60.0)
        assert isinstance(caught.value.__cause__, ReplicaHaltedError)
        assert manager.position == 0  # its own acked record was not applied after the halt


async def test_closing_with_a_write_queued_again_after_a_failed_send_reports_it_unknown(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A send that failed may still have been persisted, so its write, queued for a retry,
    # may be applied by other replicas. Closing before the retry gave it ClosedError ("not
    # appended"); its outcome is unknown.
    manager = counter_manager(service_url, topic, admin_url)
    await manager.open()
    try:
        await manager.write(lambda s: [incr("a")])
        fail_send_number(monkeypatch, 1)
        acquire = Writer._acquire

        async def slow_acquire(self: Writer, **options: Any) -> None:
            await asyncio.sleep(2.0)  # the close comes while the write waits for its retry
            await acquire(self, **options)

        monkeypatch.setattr(Writer, "_acquire", slow_acquire)
        write = asyncio.ensure_future(manager.write(lambda s: [incr("b")]))
        for _ in range(200):
            if manager.stats.write_retries:
                break
            await asyncio.sleep(0.05)
        assert manager.stats.write_retries == 1
        assert not write.done()
    finally:
        await manager.aclose()
    with pytest.raises(WriteOutcomeUnknownError, match="closed before"):
        await write


async def test_a_write_built_beside_a_write_of_no_ops_whose_check_failed_is_retried(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One batch: a write with no ops (decided on the base state, so it first checks that
    # state is the latest) and a write with ops. The check fails once (injected: the
    # catch-up with the tail). Before: the write with ops, taken from the queue and built,
    # was neither sent nor queued again, so it ended only at its deadline; now both are
    # decided again and succeed.
    bounded = Writer._bounded
    failures: list[str] = []

    async def failing_once(self: Writer, awaitable: Any, what: str) -> None:
        if "writes with no ops" in what and not failures:
            failures.append(what)
            awaitable.close()
            raise BrokerUnavailableError("injected: the catch-up failed")
        await bounded(self, awaitable, what)

    async with counter_manager(service_url, topic, admin_url, write_timeout_s=20.0) as manager:
        await manager.write(lambda s: [incr("a")])
        monkeypatch.setattr(Writer, "_bounded", failing_once)
        nothing, something = await asyncio.wait_for(
            asyncio.gather(
                manager.write(lambda s: [], reader=lambda s: s["count"]),
                manager.write(lambda s: [incr("b")]),
            ),
            15.0,  # under write_timeout_s: a write that waits for its deadline fails here
        )
        assert failures
        assert nothing.value in (1, 2)
        assert something.position == 2
        assert await seen_by(manager) == {"a": 1, "b": 1}


@pytest.mark.parametrize("ending", ["deadline", "cancel"])
async def test_a_write_that_ended_while_its_batch_checked_its_state_is_never_sent(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    # One batch: a write with no ops (so the batch first checks that its state is the
    # latest: a tail round trip, slow here) and a write with ops that ends meanwhile, told
    # "timed out; nothing was appended" (or cancelled by its caller). Before: its record
    # was sent anyway once the check passed, and applied (from helper 37's review).
    bounded = Writer._bounded
    slowed: list[str] = []

    async def slow_once(self: Writer, awaitable: Any, what: str) -> None:
        if "writes with no ops" in what and not slowed:
            slowed.append(what)
            await asyncio.sleep(0.6)
        await bounded(self, awaitable, what)

    async with counter_manager(service_url, topic, admin_url) as manager:
        await manager.write(lambda s: [incr("a")])
        monkeypatch.setattr(Writer, "_bounded", slow_once)
        nothing = asyncio.ensure_future(manager.write(lambda s: []))
        timeout = 0.2 if ending == "deadline" else None
        doomed = asyncio.ensure_future(manager.write(lambda s: [incr("doomed")], timeout=timeout))
        if ending == "cancel":
            await asyncio.sleep(0.2)
            doomed.cancel()
        with pytest.raises(
            OperationTimeoutError if ending == "deadline" else asyncio.CancelledError
        ):
            await doomed
        await nothing
        assert slowed
        after = await manager.write(lambda s: [incr("b")])
        assert after.position == 2
        assert await seen_by(manager) == {"a": 1, "b": 1}


async def test_a_write_that_times_out_waiting_for_a_held_writer_says_it_was_held(
    service_url: str, admin_url: str, topic: str
) -> None:
    held = writer_held_elsewhere(service_url, topic, admin_url)
    async with held as (_, waiter):
        with pytest.raises(OperationTimeoutError) as caught:
            await waiter.write(lambda s: [incr("late")], timeout=1.0)
        # Before: "timed out; nothing was appended", the cause unnamed.
        assert "exclusive writer" in str(caught.value)
        assert "nothing was appended" in str(caught.value)


async def test_a_write_queued_late_in_a_wait_for_the_writer_waits_its_own_acquire_timeout(
    service_url: str, admin_url: str, topic: str
) -> None:
    held = writer_held_elsewhere(service_url, topic, admin_url, acquire_timeout_s=2.0)
    async with held as (holder, waiter):
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = asyncio.ensure_future(waiter.write(lambda s: [incr("first")], timeout=30.0))
        await asyncio.sleep(1.5)  # the waiter has tried to take the writer for 1.5 s
        second = asyncio.ensure_future(waiter.write(lambda s: [incr("second")], timeout=30.0))
        with pytest.raises(WriterBusyError):
            await first
        assert loop.time() - started < 3.0  # its own wait, not stretched by the second's
        await asyncio.sleep(0.8)  # 2.8 s after the start: 1.3 s into the second's wait
        # Before: the second failed with the first at 2 s from the start of the attempt
        # (WriterBusyError after 0.5 s of its own 2 s).
        assert not second.done()
        holder.release_writer()
        await asyncio.wait_for(second, 30.0)
        assert await seen_by(waiter) == {"second": 1}


async def test_a_write_queued_while_another_waits_for_the_writer_keeps_its_own_timeout(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Without the write relay, so that the waiter's writes wait for the topic's writer.
    held = writer_held_elsewhere(service_url, topic, admin_url)
    async with held as (holder, waiter):
        first = asyncio.ensure_future(waiter.write(lambda s: [incr("first")], timeout=1.0))
        await asyncio.sleep(0.3)  # the waiter is trying to take the writer for the first
        second = asyncio.ensure_future(waiter.write(lambda s: [incr("second")], timeout=30.0))
        with pytest.raises(PulsarStateError):
            await first
        await asyncio.sleep(0.5)
        # Before: the second failed with the first's WriterBusyError ("held the writer for
        # 1.0s"), the attempt at the writer bounded by the first write's deadline only.
        assert not second.done()
        holder.release_writer()
        await asyncio.wait_for(second, 30.0)
        assert await seen_by(waiter) == {"second": 1}
        assert await waiter.read(lambda s: s["count"], latest=True) == 2


async def test_a_holder_whose_replica_halts_gives_the_writer_up(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A holds the topic's writer and would keep it idle for a minute; its replica halts (a
    # durable store that cannot commit, an apply that is not deterministic). Before: its
    # writer loop stopped at the halt without closing the exclusive producer (once a record
    # relayed by B woke it), so B's writes failed until A was closed (measured: a relayed
    # one WriteOutcomeUnknownError at its 20 s deadline).
    async with (
        counter_manager(service_url, topic, admin_url, idle_release_s=60.0) as a,
        counter_manager(service_url, topic, admin_url) as b,
    ):
        await a.write(lambda s: [incr("a")])
        await b.sync()
        a._replica.halt_with(PulsarStateError("injected: the replica stopped"))
        result = await b.write(lambda s: [incr("b")], timeout=20.0)
        assert result.position == 2
        assert await b.read(lambda s: s["count"], latest=True) == 2
        assert a.halted is not None
