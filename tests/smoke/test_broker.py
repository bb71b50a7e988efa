"""The broker is real and configured as the library needs.

These talk to Pulsar directly with ``pulsar-client`` (not through the library): they check
the broker behaviour that pulsar-state's guarantees stand on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pulsar
import pulsar.asyncio as pulsar_asyncio
import pytest

from tests.support.broker import REGISTRATION_LINES_MAX, Broker, admin_request
from tests.support.classfile import declared_methods_in_jar


@pytest.fixture
async def client(service_url: str) -> AsyncIterator[pulsar_asyncio.Client]:
    client = pulsar_asyncio.Client(service_url, operation_timeout_seconds=15)
    yield client
    await client.close()


async def exclusive(client: pulsar_asyncio.Client, topic: str, mode: object) -> object:
    return await client.create_producer(topic, access_mode=mode, batching_enabled=False)


async def test_second_exclusive_producer_is_refused(
    client: pulsar_asyncio.Client, topic: str
) -> None:
    first = await exclusive(client, topic, pulsar.ProducerAccessMode.Exclusive)
    with pytest.raises(pulsar_asyncio.PulsarException) as refused:
        await exclusive(client, topic, pulsar.ProducerAccessMode.Exclusive)
    assert refused.value.error() in (pulsar.Result.ProducerFenced, pulsar.Result.ProducerBusy)
    await first.send(b"still the writer")  # type: ignore[attr-defined]


async def test_fencing_producer_fences_the_old_one(
    client: pulsar_asyncio.Client, topic: str
) -> None:
    old = await exclusive(client, topic, pulsar.ProducerAccessMode.Exclusive)
    await old.send(b"before")  # type: ignore[attr-defined]
    new = await exclusive(client, topic, pulsar.ProducerAccessMode.ExclusiveWithFencing)
    with pytest.raises(pulsar_asyncio.PulsarException) as fenced:
        await old.send(b"zombie")  # type: ignore[attr-defined]
    assert fenced.value.error() in (pulsar.Result.ProducerFenced, pulsar.Result.AlreadyClosed)
    await new.send(b"after")  # type: ignore[attr-defined]
    reader = await client.create_reader(topic, pulsar.MessageId.earliest)
    seen = [(await asyncio.wait_for(reader.read_next(), 10)).data() for _ in range(2)]
    assert seen == [b"before", b"after"]
    assert not await reader.has_message_available()


async def test_reader_from_earliest_sees_whole_history(
    client: pulsar_asyncio.Client, topic: str
) -> None:
    producer = await exclusive(client, topic, pulsar.ProducerAccessMode.Exclusive)
    sent = [f"m{i}".encode() for i in range(200)]
    await asyncio.gather(*(producer.send(m) for m in sent))  # type: ignore[attr-defined]
    reader = await client.create_reader(topic, pulsar.MessageId.earliest)
    got = [(await asyncio.wait_for(reader.read_next(), 10)).data() for _ in sent]
    assert got == sent


def test_broker_keeps_history(broker: Broker, topic: str) -> None:
    """Infinite retention and no inactive-topic deletion, as the broker settings say
    (pulsar_state/testing/broker-settings.env)."""
    local = topic.split("/")[-1]
    admin_request(broker.admin_url, "PUT", f"/admin/v2/persistent/public/default/{local}")
    base = f"/admin/v2/persistent/public/default/{local}"
    retention = admin_request(broker.admin_url, "GET", base + "/retention?applied=true")
    assert retention == {"retentionTimeInMinutes": -1, "retentionSizeInMB": -1}
    inactive = admin_request(broker.admin_url, "GET", base + "/inactiveTopicPolicies?applied=true")
    assert inactive["deleteWhileInactive"] is False


@pytest.mark.fault
@pytest.mark.slow
async def test_message_survives_broker_sigkill(broker: Broker, topic: str) -> None:
    client = pulsar_asyncio.Client(broker.service_url, operation_timeout_seconds=30)
    try:
        producer = await exclusive(client, topic, pulsar.ProducerAccessMode.Exclusive)
        await producer.send(b"durable")  # type: ignore[attr-defined]
        await producer.close()  # type: ignore[attr-defined]
    finally:
        await client.close()
    seconds = await asyncio.to_thread(broker.restart_after_kill)
    print(f"broker ready {seconds:.1f}s after SIGKILL")
    client = pulsar_asyncio.Client(broker.service_url, operation_timeout_seconds=30)
    try:
        reader = await client.create_reader(topic, pulsar.MessageId.earliest)
        message = await asyncio.wait_for(reader.read_next(), 30)
        assert message.data() == b"durable"
    finally:
        await client.close()


async def write_and_read_back(service_url: str, topic: str, payload: bytes) -> None:
    """A real round trip: an exclusive producer on ``topic`` writes, a reader gets it back."""
    client = pulsar_asyncio.Client(service_url, operation_timeout_seconds=30)
    try:
        producer = await exclusive(client, topic, pulsar.ProducerAccessMode.Exclusive)
        await asyncio.wait_for(producer.send(payload), 30)  # type: ignore[attr-defined]
        await producer.close()  # type: ignore[attr-defined]
        reader = await client.create_reader(topic, pulsar.MessageId.earliest)
        assert (await asyncio.wait_for(reader.read_next(), 30)).data() == payload
    finally:
        await client.close()


async def read_first(service_url: str, topic: str) -> bytes:
    client = pulsar_asyncio.Client(service_url, operation_timeout_seconds=30)
    try:
        reader = await client.create_reader(topic, pulsar.MessageId.earliest)
        return bytes((await asyncio.wait_for(reader.read_next(), 30)).data())
    finally:
        await client.close()


@pytest.mark.fault
@pytest.mark.slow
async def test_broker_comes_back_after_each_sigkill(broker: Broker, topic: str) -> None:
    """Issue 12b: after a SIGKILL, BookKeeper 4.17.2 (Pulsar 4.0.7's) could re-register its
    bookie forever (``BookieServiceInfo`` has no ``equals``, so its registration lock never
    recognises its own value) and every new ledger failed with "not enough bookies".

    The classpath check fails every time without the fix (standalone broker). The restarts
    catch the race itself only by chance: about 1 restart in 3 hit it, so two restarts (kept
    to two for time: a start takes 30-90 s on a loaded 2-core machine) miss it almost half the
    time. scripts/restart-loop is the real measurement (20/20 healthy with the fix).
    """
    if broker.kind == "standalone":
        jar = broker.classpath_jar("org.apache.bookkeeper.bookkeeper-server-")
        methods = declared_methods_in_jar(jar, "org.apache.bookkeeper.discover.BookieServiceInfo")
        assert {"equals", "hashCode"} <= methods, f"{jar.name} has the restart livelock"
    for restart in range(2):
        before = f"{topic}-before-{restart}".encode()
        await write_and_read_back(broker.service_url, f"{topic}-before-{restart}", before)
        # For a standalone broker, start itself fails when the registration flaps.
        seconds = await asyncio.to_thread(broker.restart_after_kill)
        lines = await asyncio.to_thread(broker.registration_lines)
        print(f"restart {restart}: ready after {seconds:.1f}s, {lines} registration log lines")
        assert lines <= REGISTRATION_LINES_MAX, f"bookie registration flapping: {lines} lines"
        # A fresh topic needs a new ledger on a working bookie; the old one must still be there.
        await write_and_read_back(broker.service_url, f"{topic}-after-{restart}", b"after")
        assert await read_first(broker.service_url, f"{topic}-before-{restart}") == before


def test_warming_a_broker_up_that_is_warm_takes_one_round(broker: Broker) -> None:
    # A broker the session started is warmed up before the first test (a cold one took
    # seconds per producer and send, expiring short test leases); a warm one passes at once.
    spent = broker.warm_up(budget_s=60.0)
    assert spent < 30.0, spent
