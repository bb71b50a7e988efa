"""The guarantees off the happy path (issue 11): loud halts instead of silent divergence,
no write left pending, no misleading errors. Every case runs against the real broker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from pulsar_state import (
    ClosedError,
    CodecError,
    CorruptRecordError,
    ForkedHistoryError,
    JsonCodec,
    ReplicaHaltedError,
    SharedStateManager,
)
from pulsar_state._envelope import Record, Write, encode_record
from pulsar_state._records import OutgoingRecord
from tests.core.helpers import counter_manager, incr, raw_producer, seen_by, topic_message_count

POISON = {"op": "set", "key": "poison", "value": 1}


class PoisonKeyErrorCodec(JsonCodec):
    """A user codec with a bug: raises KeyError (not CodecError) on one op."""

    def decode(self, data: bytes, /) -> Any:
        op = super().decode(data)
        if op.get("key") == "poison":
            raise KeyError("no decoder for 'poison'")
        return op


class PoisonRefusingCodec(JsonCodec):
    """A codec that cannot decode one op another process writes (it refuses it properly)."""

    def decode(self, data: bytes, /) -> Any:
        op = super().decode(data)
        if op.get("key") == "poison":
            raise CodecError("unknown op 'poison'")
        return op


async def wait_halted(manager: Any) -> None:
    """Catch up with the tail: a replica that halts on the way fails the wait."""
    with pytest.raises(ReplicaHaltedError):
        await manager.sync(timeout=20)


# ---------------------------------------------------------------- (d) raising user code


async def test_codec_raising_keyerror_halts_the_replica_loudly(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        counter_manager(service_url, topic, admin_url) as writer,
        counter_manager(service_url, topic, admin_url, codec=PoisonKeyErrorCodec()) as victim,
    ):
        await writer.write(lambda s: [incr()])
        with caplog.at_level(logging.ERROR, logger="pulsar_state"):
            result = await writer.write(lambda s: [POISON])
            await wait_halted(victim)
        assert victim.position == 1  # stopped before the record it could not decode
        with pytest.raises(ReplicaHaltedError) as halted:
            await victim.read(lambda s: s, latest=True, timeout=5)
        reason = halted.value.__cause__
        assert reason is victim.halted
        assert isinstance(reason.__cause__, KeyError)
        assert str(result.position) in str(halted.value) or "poison" in str(halted.value)
        assert "message" in str(reason)
        with pytest.raises(ReplicaHaltedError):
            await victim.write(lambda s: [incr()], timeout=5)
        # The pump ended by halting, not by dying with an exception nobody reads.
        pump = victim._pump_task
        assert pump is not None
        await asyncio.wait_for(asyncio.shield(pump), 5)
        assert pump.exception() is None
    assert "halted" in caplog.text
    assert any(r.levelno == logging.ERROR for r in caplog.records)


class FailingSnapshotCodec(JsonCodec):
    """A snapshot codec that cannot encode the states it meets."""

    def encode(self, value: Any, /) -> bytes:
        if value.get("count", 0) >= 2 and "fail" in value:
            raise TypeError("cannot encode this state")
        return super().encode(value)


async def test_snapshot_codec_failing_in_determinism_check_halts(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with counter_manager(service_url, topic, admin_url, snapshot_codec=JsonCodec()) as writer:
        await writer.write(lambda s: [{"op": "set", "key": "fail", "value": True}])
        await writer.write(lambda s: [incr()])
        await writer.write(lambda s: [incr()])
        await writer.snapshot()
    replica = counter_manager(
        service_url,
        topic,
        admin_url,
        snapshot_codec=FailingSnapshotCodec(),
        load_snapshot=False,
        open_timeout_s=20,
    )
    with (
        caplog.at_level(logging.ERROR, logger="pulsar_state"),
        pytest.raises(ReplicaHaltedError) as halted,
    ):
        await replica.open()
    assert isinstance(halted.value.__cause__, Exception)
    assert isinstance(halted.value.__cause__.__cause__, TypeError)
    assert any(r.levelno == logging.ERROR for r in caplog.records)


# ---------------------------------------------------------------- (b) forked histories


async def test_skip_never_skips_an_accepted_record_so_no_write_is_lost(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        counter_manager(service_url, topic, admin_url) as writer,
        counter_manager(
            service_url, topic, admin_url, codec=PoisonRefusingCodec(), on_corrupt="skip"
        ) as skipper,
    ):
        await writer.write(lambda s: [incr("a")])
        await writer.write(lambda s: [POISON])
        with contextlib.suppress(ReplicaHaltedError):
            await skipper.sync(timeout=10)  # it has read the poison record
        try:
            acknowledged = await skipper.write(lambda s: [incr("b")], timeout=10)
        except ReplicaHaltedError:
            acknowledged = None
        if acknowledged is not None:
            # The guarantee itself: an acknowledged write is applied by a fresh replica.
            async with counter_manager(service_url, topic, admin_url) as fresh:
                seen = await seen_by(fresh)
            assert "b" in seen, "an acknowledged write that a fresh replica never applies"
        assert isinstance(skipper.halted, CorruptRecordError)
        assert skipper.position == 1


async def send_raw(service_url: str, topic: str, record: Record) -> None:
    async with raw_producer(service_url, topic) as producer:
        await producer.send(encode_record(record), partition_key=record.record_id)


async def test_record_based_ahead_of_the_replica_halts_as_forked_history(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with counter_manager(service_url, topic, admin_url) as manager:
        await manager.write(lambda s: [incr()])
        ahead = Record("elsewhere", 7, 5, "elsewhere/6", [Write(1, [b'{"op":"incr"}'])])
        with caplog.at_level(logging.ERROR, logger="pulsar_state"):
            await send_raw(service_url, topic, ahead)
            await wait_halted(manager)
        fork = manager.halted
        assert isinstance(fork, ForkedHistoryError)
        assert fork.message_id in str(fork)
        assert "forked history" in str(fork)
        assert manager.position == 1
        with pytest.raises(ReplicaHaltedError, match="forked history"):
            await manager.write(lambda s: [incr()], timeout=5)
    assert "forked history" in caplog.text


async def test_same_position_other_base_record_halts_as_forked_history(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url) as manager:
        await manager.write(lambda s: [incr()])
        other = Record("elsewhere", 2, 1, "elsewhere/1", [Write(1, [b'{"op":"incr"}'])])
        await send_raw(service_url, topic, other)
        await wait_halted(manager)
        assert isinstance(manager.halted, ForkedHistoryError)
        assert manager.position == 1
    # A fresh replica halts at the same message while opening.
    with pytest.raises(ReplicaHaltedError, match="forked history"):
        async with counter_manager(service_url, topic, admin_url):
            pass


async def two_records(manager: SharedStateManager[Any, Any]) -> str:
    """Writes "a" then "x"; returns the first one's record id (a stale chain's base)."""
    await manager.write(lambda s: [incr("a")])
    first_id: str = manager._replica.last_record_id  # test-only peek
    await manager.write(lambda s: [incr("x")])
    return first_id


async def send_stale_chain(service_url: str, topic: str, first_id: str, links: list[int]) -> None:
    """Links of writer B's pipelined chain: B/1 on ``first_id`` at 1 (stale once "x" is
    there), each B/n on B/n-1 at n."""
    for seq in links:
        base_id = first_id if seq == 1 else f"B/{seq - 1}"
        op = f'{{"op":"incr","id":"b{seq}"}}'.encode()
        await send_raw(service_url, topic, Record("B", seq, seq, base_id, [Write(seq, [op])]))


async def test_a_chain_built_on_a_stale_record_is_ignored_also_after_a_snapshot(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A writer's pipelined records B/1 -> B/2 land after another record on B/1's base (one
    # persisted late): B/1 is stale, B/2 is built on it. Before: B/2 halted every replica
    # as a forked history. And a snapshot taken between them named how far its replica had
    # read (past B/1), so a replica loading it could not know B/1 was stale.
    async with counter_manager(service_url, topic, admin_url, snapshot_codec=JsonCodec()) as m:
        first_id = await two_records(m)
        await send_stale_chain(service_url, topic, first_id, [1])
        await m.sync(timeout=20)
        manifest = await m.snapshot()
        await send_stale_chain(service_url, topic, first_id, [2])
        await m.write(lambda s: [incr("c")])
        assert await seen_by(m) == {"a": 1, "x": 1, "c": 1}
        assert m.stats.records_rejected == 2
    async with counter_manager(
        service_url, topic, admin_url, snapshot_codec=JsonCodec()
    ) as resumed:
        assert resumed.stats.snapshot_loaded_position == manifest.position == 2
        assert await seen_by(resumed) == {"a": 1, "x": 1, "c": 1}
        assert resumed.stats.records_rejected == 2  # B/1 read again, then B/2


async def test_a_stale_chain_across_an_accepted_record_is_ignored_also_after_a_snapshot(
    service_url: str, admin_url: str, topic: str
) -> None:
    # B's pipelined chain B/1 -> B/2 -> B/3, stale from B/1 on, with a record of this writer
    # accepted between B/2 and B/3 (a chain relayed in pieces lands like this). Before: that
    # accept made the replica forget B/2, and B/3 halted every replica as a forked history.
    # A snapshot taken at that record names B/2: a replica loading it does not read B/2.
    async with counter_manager(service_url, topic, admin_url, snapshot_codec=JsonCodec()) as m:
        first_id = await two_records(m)
        await send_stale_chain(service_url, topic, first_id, [1, 2])
        await m.sync(timeout=20)
        await m.write(lambda s: [incr("c")])
        manifest = await m.snapshot()
        assert (manifest.position, manifest.log_stale) == (3, (("B/2", 3),))
        await send_stale_chain(service_url, topic, first_id, [3])
        await m.write(lambda s: [incr("d")])
        assert await seen_by(m) == {"a": 1, "x": 1, "c": 1, "d": 1}
        assert m.stats.records_rejected == 3
    async with counter_manager(
        service_url, topic, admin_url, snapshot_codec=JsonCodec()
    ) as resumed:
        assert resumed.stats.snapshot_loaded_position == 3
        assert await seen_by(resumed) == {"a": 1, "x": 1, "c": 1, "d": 1}
        assert resumed.stats.records_rejected == 1  # B/3


async def test_a_record_sent_twice_stops_no_later_write(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A producer that reconnects resends what it had in flight (no deduplication on the
    # topic): the copy is ignored as stale, and the records built on the original go on.
    first = Record("Z", 1, 0, "", [Write(1, [b'{"op":"incr","id":"z"}'])])
    await send_raw(service_url, topic, first)
    await send_raw(service_url, topic, first)
    async with counter_manager(service_url, topic, admin_url) as m:
        for i in range(3):
            await m.write(lambda s, i=i: [incr(f"w{i}")], timeout=20)
        assert await seen_by(m) == {"z": 1, "w0": 1, "w1": 1, "w2": 1}
        assert m.stats.records_rejected == 1


# ---------------------------------------------------------------- (h) smaller defects


# uvloop's clock counts whole milliseconds: a deadline 1 us away has not passed when the
# write is built within the same millisecond, and the write lands.
@pytest.mark.stock_asyncio
async def test_writes_expiring_while_acquiring_log_no_error(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with counter_manager(service_url, topic, admin_url) as manager:
        with caplog.at_level(logging.ERROR, logger="pulsar_state"):
            for _ in range(20):
                with pytest.raises(TimeoutError):
                    await manager.write(lambda s: [incr()], timeout=1e-6)
                await asyncio.sleep(0.02)  # let the writer loop run its turn
            assert await manager.read(lambda s: s["count"], latest=True) == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def test_write_whose_record_is_ignored_during_close_does_not_hang(
    service_url: str, admin_url: str, topic: str
) -> None:
    manager = counter_manager(service_url, topic, admin_url)
    await manager.open()
    await manager.write(lambda s: [incr()])
    await asyncio.sleep(0.5)  # the idle writer is released, so the raw producer gets in
    # A write in flight in a record that will turn out stale (based on position 0).
    pending = manager._pending
    future = pending.submit(lambda s: [incr()], None, 30.0)
    [write] = pending.take(1)
    stale = Record(manager.writer_id, 999, 0, "", [Write(write.write_seq, [b'{"op":"incr"}'])])
    pending.launch([OutgoingRecord(stale, encode_record(stale), [write])])
    closing = asyncio.create_task(manager.aclose(timeout=8.0))
    await asyncio.sleep(0)  # closed from here on; it waits for the write in flight
    await send_raw(service_url, topic, stale)
    await closing
    with pytest.raises(ClosedError):
        await asyncio.wait_for(future, 5)


async def test_writes_that_change_nothing_append_nothing(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A conditional write whose generator returns no ops was still appended as an empty
    # record. Alone, it appends nothing now; among other writes it rides in their record.
    async with counter_manager(service_url, topic, admin_url) as manager:
        await manager.write(lambda s: [incr("a")])
        nothing = await manager.write(lambda s: [], reader=lambda s: s["count"])
        assert (nothing.value, nothing.position) == (1, 1)
        results = await asyncio.gather(
            manager.write(lambda s: [] if s["count"] else [incr("never")]),
            manager.write(lambda s: [incr("b")]),
            manager.write(lambda s: [], reader=lambda s: s["count"]),
        )
        assert results[0].position == 1  # decided on the state before the batch's writes
        assert results[2].value == 2  # after "b", in its record
        assert await manager.read(lambda s: s["count"], latest=True) == 2
        with pytest.raises(ZeroDivisionError):  # the reader's error, its caller's
            await manager.write(lambda s: [], reader=lambda s: 1 / 0)
        assert manager.position == 2
        assert manager.stats.writes_failed == {"ZeroDivisionError": 1}  # by error, for metrics
        assert manager.stats.write_latency.count == 6
    assert await topic_message_count(service_url, topic) == 2
