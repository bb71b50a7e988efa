"""Bad input gets a clear error and loses nothing: each case against the real broker."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from pulsar_state import (
    ApplyError,
    AvroCodec,
    ConfigurationError,
    CorruptRecordError,
    DictOverlay,
    OperationTimeoutError,
    PartitionedTopicError,
    PulsarStateError,
    RecordTooLargeError,
    ReplicaHaltedError,
    SchemaMismatchError,
    UnsafeTopicPolicyError,
    WriteOutcomeUnknownError,
    WriterBusyError,
)
from pulsar_state._envelope import Record, Write, encode_record
from tests.core.helpers import (
    counter_manager,
    incr,
    raw_producer,
    seen_by,
    topic_message_count,
    writer_held_elsewhere,
)
from tests.support.broker import admin_request


def rest_path(topic: str) -> str:
    return "/admin/v2/persistent/public/default/" + topic.split("/")[-1]


async def test_generator_that_raises_fails_that_write_and_appends_nothing(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url) as manager:
        await manager.write(lambda s: [incr()])

        def broken(state: Any) -> list[Any]:
            raise KeyError("no such thing")

        with pytest.raises(KeyError, match="no such thing"):
            await manager.write(broken)
        # Other writes in the same batch are unaffected.
        ok, bad = await asyncio.gather(
            manager.write(lambda s: [incr()]), manager.write(broken), return_exceptions=True
        )
        assert not isinstance(ok, BaseException)
        assert isinstance(bad, KeyError)
        assert await manager.read(lambda s: s["count"], latest=True) == 2
    assert await topic_message_count(service_url, topic) == 2


async def test_a_generator_failing_on_an_earlier_write_of_its_batch_is_decided_again(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The second write fails because of the first, in the same batch. The first may not
    # land (its record ignored as stale, say): the failure is decided again on the state the
    # log holds, once the first has its outcome. Before: it failed at once, on the trial.
    async with counter_manager(service_url, topic, admin_url) as manager:
        await manager.write(lambda s: [incr("seed")])
        decided_on: list[dict[str, int]] = []

        def unless_a(state: Any) -> list[Any]:
            decided_on.append(dict(state["seen"]))
            if "a" in state["seen"]:
                raise KeyError("a is there")
            return [incr("b")]

        outcomes = await asyncio.gather(
            manager.write(lambda s: [incr("a")]), manager.write(unless_a), return_exceptions=True
        )
        assert not isinstance(outcomes[0], BaseException)
        assert isinstance(outcomes[1], KeyError)
        assert decided_on == [{"seed": 1, "a": 1}] * 2  # the trial, then the log's state
        assert await manager.read(lambda s: s["seen"], latest=True) == {"seed": 1, "a": 1}


async def test_op_whose_apply_raises_is_refused_before_sending(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url) as manager:
        await manager.write(lambda s: [incr()])
        with pytest.raises(ApplyError, match="boom"):
            await manager.write(lambda s: [incr(), {"op": "boom"}])
        with pytest.raises(ApplyError, match="unknown op"):
            await manager.write(lambda s: [{"op": "no-such-op"}])
        # The half-applied trial state was thrown away: the increment before "boom" is absent.
        assert await manager.read(lambda s: s["count"], latest=True) == 1
        await manager.write(lambda s: [incr()])
        assert await manager.read(lambda s: s["count"]) == 2
    assert await topic_message_count(service_url, topic) == 2


async def test_oversize_write_is_refused_before_sending(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url, max_record_bytes=4096) as manager:
        with pytest.raises(RecordTooLargeError) as error:
            await manager.write(lambda s: [{"op": "set", "key": "big", "value": "x" * 10_000}])
        assert error.value.limit == 4096
        assert error.value.size > 10_000
        await manager.write(lambda s: [incr()])
    assert await topic_message_count(service_url, topic) == 1


async def test_write_over_broker_limit_fails_clearly_without_retrying(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(
        service_url, topic, admin_url, max_record_bytes=16 * 1024 * 1024, write_timeout_s=20
    ) as manager:
        started = time.monotonic()
        with pytest.raises(RecordTooLargeError):
            await manager.write(lambda s: [{"op": "set", "key": "k", "value": "x" * 6_000_000}])
        assert time.monotonic() - started < 15  # refused, not retried until the timeout
        await manager.write(lambda s: [incr()])
        assert await manager.read(lambda s: s["count"], latest=True) == 1


async def test_a_record_over_broker_limit_keeps_the_records_built_on_it_unsent(
    service_url: str, admin_url: str, topic: str
) -> None:
    # One batch of two records (one write each), the second built on the first. The client
    # refuses the first (over the broker's limit): the second, sent anyway, was stored on
    # top of a record the log never got, so every replica halted on it as a forked history.
    options: dict[str, Any] = {"max_record_bytes": 16 * 1024 * 1024, "max_writes_per_record": 1}
    async with counter_manager(service_url, topic, admin_url, **options) as manager:
        too_big = manager.write(lambda s: [{"op": "set", "key": "k", "value": "x" * 6_000_000}])
        small = manager.write(lambda s: [incr()])
        outcomes = await asyncio.gather(too_big, small, return_exceptions=True)
        assert isinstance(outcomes[0], RecordTooLargeError)
        assert not isinstance(outcomes[1], BaseException), outcomes[1]
        assert manager.halted is None
        assert await manager.read(lambda s: s["count"], latest=True) == 1
    async with counter_manager(service_url, topic, admin_url) as fresh:
        assert fresh.halted is None
        assert await fresh.read(lambda s: s["count"], latest=True) == 1


@pytest.mark.parametrize(
    "payload",
    [b"not a pulsar-state record", b"PSR\x09future format", b"", b"PSR\x01\x00\x00garbage"],
    ids=["foreign", "newer-format", "empty", "damaged"],
)
async def test_corrupt_message_halts_replica_at_last_good_state(
    service_url: str, admin_url: str, topic: str, payload: bytes
) -> None:
    async with counter_manager(service_url, topic, admin_url) as live:
        await live.write(lambda s: [incr()])
        async with raw_producer(service_url, topic) as producer:
            message_id = await producer.send(payload, partition_key="x")
        expected_id = f"{message_id.ledger_id()}:{message_id.entry_id()}"
        # A replica that was running stops at the message and keeps its last good state.
        with pytest.raises(ReplicaHaltedError) as halted:
            await live.read(lambda s: s["count"], latest=True)
        cause = halted.value.__cause__
        assert isinstance(cause, CorruptRecordError)
        assert cause.message_id == expected_id
        assert expected_id in str(halted.value)
        assert halted.value.position == 1
        with pytest.raises(ReplicaHaltedError):
            await live.write(lambda s: [incr()])
        assert live._state["count"] == 1  # consistent at the last good position
    # A replica opening on that topic refuses to open, naming the message.
    with pytest.raises(ReplicaHaltedError, match=expected_id):
        async with counter_manager(service_url, topic, admin_url):
            pass


async def test_corrupt_message_skipped_and_counted_when_asked(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url) as writer:
        await writer.write(lambda s: [incr()])
    async with raw_producer(service_url, topic) as producer:
        await producer.send(b"\x00\x01garbage", partition_key="x")
    async with counter_manager(service_url, topic, admin_url, on_corrupt="skip") as replica:
        assert replica.stats.records_skipped == 1
        await replica.write(lambda s: [incr()])
        assert await replica.read(lambda s: s["count"], latest=True) == 2


async def test_undecodable_op_in_valid_record_halts_naming_message(
    service_url: str, admin_url: str, topic: str
) -> None:
    record = Record("intruder", 1, 0, "", [Write(1, [b"{not json"])])
    async with raw_producer(service_url, topic) as producer:
        await producer.send(encode_record(record), partition_key=record.record_id)
    with pytest.raises(ReplicaHaltedError, match="cannot decode") as halted:
        async with counter_manager(service_url, topic, admin_url):
            pass
    assert halted.value.position == 0


async def test_op_that_apply_rejects_on_replay_halts_the_replica(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A record from a writer whose apply differs (e.g. a newer version with a new op type).
    record = Record("other-version", 1, 0, "", [Write(1, [b'{"op":"from-the-future"}'])])
    async with raw_producer(service_url, topic) as producer:
        await producer.send(encode_record(record), partition_key=record.record_id)
    with pytest.raises(ReplicaHaltedError) as halted:
        async with counter_manager(service_url, topic, admin_url):
            pass
    assert isinstance(halted.value.__cause__, ApplyError)
    assert "from-the-future" in str(halted.value)


async def test_an_apply_that_raises_only_on_the_live_state_fails_the_write_at_once(
    service_url: str, admin_url: str, topic: str
) -> None:
    """A non-deterministic apply (fine on the writer's trial state, raising on the live one)
    halts the writer's replica while it applies its own record: the write fails then, with
    its outcome unknown (the record is in the log), not at its 30 s deadline."""

    def apply(state: dict[str, Any], op: dict[str, Any]) -> None:
        if not isinstance(state, DictOverlay) and op.get("flaky"):
            raise RuntimeError("only on the live state")
        state[op["k"]] = 1

    async with counter_manager(
        service_url, topic, admin_url, initial_state=dict, apply=apply, write_timeout_s=30.0
    ) as writer:
        await writer.write(lambda s: [{"k": "a"}])
        started = asyncio.get_running_loop().time()
        with pytest.raises(WriteOutcomeUnknownError, match="halted while applying"):
            await writer.write(lambda s: [{"k": "b", "flaky": True}])
        assert asyncio.get_running_loop().time() - started < 10
        with pytest.raises(ReplicaHaltedError, match="only on the live state"):
            await writer.read(lambda s: s)


async def test_schema_mismatch_is_a_clear_error(
    service_url: str, admin_url: str, topic: str
) -> None:
    v1 = {"type": "record", "name": "Op", "fields": [{"name": "n", "type": "int"}]}
    other = {"type": "record", "name": "Op", "fields": [{"name": "n", "type": "string"}]}

    def apply(state: dict[str, int], op: dict[str, Any]) -> None:
        state["n"] = state.get("n", 0) + int(op["n"])

    async with counter_manager(
        service_url, topic, admin_url, initial_state=dict, apply=apply, codec=AvroCodec(v1)
    ) as writer:
        await writer.write(lambda s: [{"n": 2}])
        with pytest.raises(Exception, match="Avro schema"):
            await writer.write(lambda s: [{"n": "not an int"}])
    with pytest.raises(ReplicaHaltedError) as halted:
        async with counter_manager(
            service_url,
            topic,
            admin_url,
            initial_state=dict,
            apply=apply,
            codec=AvroCodec(other, writer_schemas=[v1]),
        ):
            pass
    assert isinstance(halted.value.__cause__, CorruptRecordError)
    assert isinstance(halted.value.__cause__.__cause__, SchemaMismatchError)


async def test_stale_record_is_ignored_by_every_replica(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        counter_manager(service_url, topic, admin_url) as a,
        counter_manager(service_url, topic, admin_url) as b,
    ):
        await a.write(lambda s: [incr("real")])
        await b.sync()
        # A zombie writer that still believes the log is empty (base 0) appends a record.
        stale = Record("zombie", 1, 0, "", [Write(1, [b'{"op":"incr","id":"zombie","by":100}'])])
        async with raw_producer(service_url, topic) as producer:
            await producer.send(encode_record(stale), partition_key=stale.record_id)
        for replica in (a, b):
            assert await replica.read(lambda s: s["count"], latest=True) == 1
            assert replica.stats.records_rejected == 1
        await b.write(lambda s: [incr("after")])
        assert await a.read(lambda s: s["count"], latest=True) == 2
    async with counter_manager(service_url, topic, admin_url) as fresh:
        assert await fresh.read(lambda s: s["count"]) == 2
        assert fresh.stats.records_rejected == 1


async def test_partitioned_topic_is_refused(service_url: str, admin_url: str, topic: str) -> None:
    admin_request(admin_url, "PUT", rest_path(topic) + "/partitions", 2)
    with pytest.raises(PartitionedTopicError, match="partitioned"):
        async with counter_manager(service_url, topic, admin_url):
            pass


async def wait_policy(admin_url: str, path: str, expected: Any) -> None:
    # Topic policies travel through a system topic: they apply after a short delay.
    for _ in range(100):
        if admin_request(admin_url, "GET", path) == expected:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"policy {path} never became {expected}")


async def test_topic_with_finite_retention_is_refused(
    service_url: str, admin_url: str, topic: str
) -> None:
    admin_request(admin_url, "PUT", rest_path(topic))
    policy = {"retentionTimeInMinutes": 60, "retentionSizeInMB": 100}
    admin_request(admin_url, "POST", rest_path(topic) + "/retention", policy)
    await wait_policy(admin_url, rest_path(topic) + "/retention?applied=true", policy)
    with pytest.raises(UnsafeTopicPolicyError, match="retention"):
        async with counter_manager(service_url, topic, admin_url):
            pass


async def test_topic_with_compaction_is_refused(
    service_url: str, admin_url: str, topic: str
) -> None:
    admin_request(admin_url, "PUT", rest_path(topic))
    admin_request(admin_url, "POST", rest_path(topic) + "/compactionThreshold", 1048576)
    await wait_policy(admin_url, rest_path(topic) + "/compactionThreshold?applied=true", 1048576)
    with pytest.raises(UnsafeTopicPolicyError, match="compaction"):
        async with counter_manager(service_url, topic, admin_url):
            pass


async def set_backlog_quota(admin_url: str, topic: str, action: str) -> None:
    quota = {"limitSize": 10_000_000, "limitTime": -1, "policy": action}
    admin_request(admin_url, "PUT", rest_path(topic))
    path = rest_path(topic) + "/backlogQuota?backlogQuotaType=destination_storage"
    admin_request(admin_url, "POST", path, quota)
    applied = rest_path(topic) + "/backlogQuotaMap?applied=true"
    for _ in range(100):  # topic policies apply after a short delay
        if admin_request(admin_url, "GET", applied)["destination_storage"]["policy"] == action:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the backlog quota never became {action}")


@pytest.mark.parametrize("action", ["producer_exception", "producer_request_hold"])
async def test_a_backlog_quota_that_will_stop_writes_is_warned_of(
    service_url: str, admin_url: str, topic: str, action: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The library's subscription keeps the whole history as backlog without trim_history:
    # measured, once it passed a 20 kB quota with producer_exception every write timed out
    # (ProducerBlockedQuotaExceededException). Before, such a topic opened unwarned (review
    # 45d F2); refusing it would break deployments whose quota the topic never reaches.
    await set_backlog_quota(admin_url, topic, action)
    with caplog.at_level(logging.WARNING, logger="pulsar_state"):
        async with counter_manager(service_url, topic, admin_url) as manager:
            await manager.write(lambda s: [incr()])
    assert f"backlog quota with {action}" in caplog.text
    assert "every write will fail once the history passes the quota" in caplog.text


async def test_a_backlog_quota_that_evicts_is_accepted_without_trimming(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    # It only moves the library's subscription, which holds nothing without trim_history.
    await set_backlog_quota(admin_url, topic, "consumer_backlog_eviction")
    with caplog.at_level(logging.WARNING, logger="pulsar_state"):
        async with counter_manager(service_url, topic, admin_url) as manager:
            await manager.write(lambda s: [incr()])
    assert "backlog quota" not in caplog.text


async def test_in_place_apply_with_copy_state_none_is_caught(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(service_url, topic, admin_url, copy_state=None) as manager:
        with pytest.raises(ConfigurationError, match="copy_state"):
            await manager.write(lambda s: [incr()])
        assert manager.halted is not None


async def test_a_halt_while_a_batch_is_built_ends_the_other_writes_of_it_at_once(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The first write's trial run changes the live state (copy_state=None, an apply that
    # mutates): the replica halts while the batch is built. The second write of that batch
    # was taken out of the queue and never in flight: it waited for its deadline (30 s, or
    # for ever once the manager closed).
    async with counter_manager(
        service_url, topic, admin_url, copy_state=None, write_timeout_s=30.0
    ) as manager:
        started = asyncio.get_running_loop().time()
        culprit = manager.write(lambda s: [incr()])
        other = manager.write(lambda s: [incr("other")])
        outcomes = await asyncio.gather(culprit, other, return_exceptions=True)
        assert asyncio.get_running_loop().time() - started < 10
        assert isinstance(outcomes[0], ConfigurationError)
        assert isinstance(outcomes[1], ReplicaHaltedError), outcomes[1]
        assert manager.halted is not None


async def test_busy_writer_times_out_with_writer_busy(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Without the write relay (the waiter's write would go through the holder).
    held = writer_held_elsewhere(service_url, topic, admin_url, acquire_timeout_s=1.5)
    async with held as (_, waiter):
        with pytest.raises(WriterBusyError) as busy:
            await waiter.write(lambda s: [incr()])
        assert busy.value.retriable
        assert await waiter.read(lambda s: s["count"], latest=True) == 1


async def test_takeover_with_fencing_after_configured_wait(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Without the write relay (the taker's writes would go through `stuck`, which appends).
    hold = {"idle_release_s": 3600.0, "max_hold_s": 3600.0, "relay_writes": False}
    async with (
        counter_manager(service_url, topic, admin_url, **hold) as stuck,
        counter_manager(
            service_url, topic, admin_url, takeover_after_s=0.5, relay_writes=False
        ) as taker,
    ):
        await stuck.write(lambda s: [incr("stuck-1")])
        await taker.write(lambda s: [incr("taker-1")])  # fences `stuck`
        # The fenced writer notices on its next send, re-acquires, and its write lands once.
        await stuck.write(lambda s: [incr("stuck-2")])
        for replica in (stuck, taker):
            state = await replica.read(lambda s: s, latest=True)
            assert state["count"] == 3
            assert state["seen"] == {"stuck-1": 1, "taker-1": 1, "stuck-2": 1}


async def test_write_timeout_is_enforced_while_waiting_for_the_writer(
    service_url: str, admin_url: str, topic: str
) -> None:
    held = writer_held_elsewhere(service_url, topic, admin_url, acquire_timeout_s=3600)
    async with held as (holder, waiter):
        # A timeout (its deadline came before acquire_timeout_s), whichever of the deadline
        # watchdog and the attempt at the writer sees it first: it was either error before.
        with pytest.raises(OperationTimeoutError) as timed_out:
            await waiter.write(lambda s: [incr()], timeout=0.5)
        assert timed_out.value.retriable
        assert "nothing was appended" in str(timed_out.value)
        assert "exclusive writer" in str(timed_out.value)  # the cause, named
        assert await holder.read(lambda s: s["count"], latest=True) == 1


async def test_unreachable_broker_fails_open_with_a_clear_retriable_error(topic: str) -> None:
    manager = counter_manager(
        "pulsar://127.0.0.1:1", topic, "http://127.0.0.1:1", open_timeout_s=5.0
    )
    with pytest.raises(PulsarStateError) as failed:
        await manager.open()
    assert failed.value.retriable
    assert manager.closed


async def test_a_write_whose_reader_raises_stands(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The reader runs once the write's ops were applied: its error is the caller's, and the
    # write is in the log, applied by every replica (as the write() docstring says).
    async with counter_manager(service_url, topic, admin_url) as manager:
        with pytest.raises(ZeroDivisionError):
            await manager.write(lambda s: [incr("x")], reader=lambda s: 1 / 0)
        async with counter_manager(service_url, topic, admin_url) as other:
            assert await seen_by(other) == {"x": 1}


def _cancelled_result(_state: Any) -> Any:
    """A callback that raises CancelledError, a BaseException: the result() of a future
    that was cancelled (say, a generator consulting a cache of futures)."""
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.cancel()
    return future.result()


async def test_a_generator_raising_a_base_exception_fails_only_its_write(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Before: the CancelledError escaped the writer (its loop ended, still holding the
    # exclusive producer, or the batch built at the end of a loop turn was dropped): that
    # write and the ones after it ended at their deadline, "nothing was appended".
    async with counter_manager(service_url, topic, admin_url, write_timeout_s=10.0) as manager:
        for _ in range(2):  # the writer's loop takes the writer; then it idles holding it
            with pytest.raises(PulsarStateError, match="generator raised CancelledError"):
                await manager.write(_cancelled_result)
            await manager.write(lambda s: [incr()])
        assert manager.halted is None
        assert await manager.read(lambda s: s["count"], latest=True) == 2
    assert await topic_message_count(service_url, topic) == 2


async def test_a_reader_raising_a_base_exception_fails_its_write_which_stands_once(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Before: the CancelledError escaped the replica while it applied the record (the state
    # changed, its position not), so the record was handled again: applied twice here,
    # once everywhere else, and the write's caller waited for its deadline.
    async with counter_manager(service_url, topic, admin_url, write_timeout_s=10.0) as manager:
        with pytest.raises(PulsarStateError, match="reader raised CancelledError"):
            await manager.write(lambda s: [incr("x")], reader=_cancelled_result)
        await manager.write(lambda s: [incr("y")])
        assert manager.halted is None
        assert await seen_by(manager) == {"x": 1, "y": 1}
        async with counter_manager(service_url, topic, admin_url) as other:
            assert await seen_by(other) == {"x": 1, "y": 1}


async def test_a_write_whose_batch_could_not_be_built_once_is_retried(
    service_url: str, admin_url: str, topic: str
) -> None:
    # copy_state (the trial copy of a batch) raised once: not any write's own failure.
    # Before: the writes taken for that batch were dropped and ended at their deadline,
    # "nothing was appended"; they are built again, and land.
    armed = {"fail": 0}

    def flaky_copy(state: Any) -> Any:
        if armed["fail"]:
            armed["fail"] -= 1
            raise MemoryError("injected: no memory for the trial copy, this once")
        return {"count": state["count"], "seen": dict(state["seen"])}

    async with counter_manager(
        service_url, topic, admin_url, copy_state=flaky_copy, write_timeout_s=10.0
    ) as manager:
        await manager.write(lambda s: [incr()])  # the writer is taken, then it idles
        for _ in range(2):  # built at the end of a loop turn, then by the serve loop
            armed["fail"] = 1
            await manager.write(lambda s: [incr()], timeout=10.0)
        assert await manager.read(lambda s: s["count"], latest=True) == 3


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (MemoryError("injected: no memory for the trial copy"), MemoryError),
        (asyncio.CancelledError("injected: a cancelled future's result()"), PulsarStateError),
    ],
)
async def test_a_batch_that_cannot_be_built_fails_its_writes_and_the_writer_goes_on(
    service_url: str, admin_url: str, topic: str, raised: BaseException, expected: type
) -> None:
    # copy_state fails every time. Before: the writes were retried, the writer released and
    # taken again every 0.1 s until their deadline (measured: 19 producers for a 2 s write),
    # and a CancelledError ended the writer task still holding the topic's writer.
    armed = {"on": False}

    def failing_copy(state: Any) -> Any:
        if armed["on"]:
            raise raised
        return {"count": state["count"], "seen": dict(state["seen"])}

    async with counter_manager(
        service_url, topic, admin_url, copy_state=failing_copy, idle_release_s=30.0
    ) as manager:
        await manager.write(lambda s: [incr()])  # the writer is taken, then it idles
        releases = manager.stats.writer_releases
        armed["on"] = True
        started = time.monotonic()
        with pytest.raises(expected):
            await manager.write(lambda s: [incr()], timeout=20.0)
        assert time.monotonic() - started < 10.0  # at once, not at its deadline
        armed["on"] = False
        await manager.write(lambda s: [incr()], timeout=10.0)
        assert manager.stats.writer_releases == releases
        assert await manager.read(lambda s: s["count"], latest=True) == 2
