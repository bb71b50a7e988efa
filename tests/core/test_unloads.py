"""A topic being unloaded (a ledger closed, trimming, a broker handing it over) is a short
outage that readers opened meanwhile must ride out in seconds, not at the client's timeout;
and a reader left receiving nothing (the broker can attach one subscribed during an unload to
the closed topic) is replaced once a replica that must reach a position reads nothing: as it
opens, for a linearizable read, for a writer's catch-up, and unasked while it only follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import pulsar
import pytest

from pulsar_state._pulsar import PulsarConnection, StateReader
from tests.core.helpers import counter_manager, incr
from tests.support.broker import admin_request
from tests.support.trimming import rest_path

pytestmark = [pytest.mark.fault]

ROUNDS = 60
# The client's operation timeout is 30 s: an open that waits it out fails here.
OPEN_BOUND_S = 15.0


@contextlib.asynccontextmanager
async def reading_nothing(manager: Any, service_url: str, topic: str) -> AsyncIterator[None]:
    """``manager``'s reader thread polls a reader of an empty topic meanwhile: nothing ever
    comes, as from a reader the broker attached to a closed topic."""
    client = pulsar.Client(service_url)
    try:
        nothing = client.create_reader(topic + "-empty", pulsar.MessageId.earliest)
        stuck = manager._replica._reader
        stuck._reader, parked = nothing, stuck._reader
        try:
            await asyncio.sleep(0.5)  # the poll under way on the real reader ends first
            yield
        finally:
            stuck._reader = parked
    finally:
        await asyncio.to_thread(client.close)


async def test_readers_opened_while_the_topic_unloads_open_in_seconds(
    service_url: str, admin_url: str, topic: str
) -> None:
    """Measured before the fix: 3 of 60 readers opened during an unload waited 30 s (the C++
    client does not ask again after a SUBSCRIBE refused as "temporarily unavailable")."""
    conn = PulsarConnection(service_url)
    try:
        writer = await conn.create_writer(topic, fencing=False, send_timeout_s=30)
        await writer.send(b"x", key="k")
        await writer.close()
        slowest = 0.0
        for round_ in range(ROUNDS):
            unload = asyncio.create_task(
                asyncio.to_thread(admin_request, admin_url, "PUT", rest_path(topic) + "/unload")
            )
            await asyncio.sleep(random.random() * 0.01)  # land the open inside the unload
            started = time.monotonic()
            async with asyncio.timeout(OPEN_BOUND_S):
                if round_ % 2:
                    probe = await conn.create_tail_probe(topic, name=f"probe-{round_}")
                    await probe.close()
                else:  # (reading from it is the replica's business: see the test below)
                    reader = await conn.create_reader(topic)
                    await reader.close()
            slowest = max(slowest, time.monotonic() - started)
            await unload
        print(f"slowest open during an unload: {slowest:.1f}s")
    finally:
        await conn.close()


async def test_a_replica_whose_reader_receives_nothing_replaces_it_to_catch_up(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        counter_manager(service_url, topic, admin_url) as writer,
        counter_manager(service_url, topic, admin_url) as replica,
    ):
        await writer.write(lambda s: [incr()])
        assert await replica.read(lambda s: s["count"], latest=True) == 1
        async with reading_nothing(replica, service_url, topic):
            await writer.write(lambda s: [incr()])
            with caplog.at_level(logging.WARNING, logger="pulsar_state._replica"):
                assert await replica.read(lambda s: s["count"], latest=True) == 2
            assert "reopening the reader" in caplog.text


async def test_a_replica_opening_with_a_reader_that_receives_nothing_replaces_it(
    service_url: str,
    admin_url: str,
    topic: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same stuck reader as above, got by a replica as it opens: its replay to the tail
    waited for it to the open's deadline."""
    async with counter_manager(service_url, topic, admin_url) as writer:
        for _ in range(3):
            await writer.write(lambda s: [incr()])
    real_create_reader = PulsarConnection.create_reader
    stuck: list[str] = []

    async def create_reader(self: PulsarConnection, of: str, **options: Any) -> StateReader:
        if of == topic and options.get("name") is not None and not stuck:
            stuck.append(of)  # the replica's own reader (named), the first one
            return await real_create_reader(self, f"{of}-nothing", **options)
        return await real_create_reader(self, of, **options)

    monkeypatch.setattr(PulsarConnection, "create_reader", create_reader)
    with caplog.at_level(logging.WARNING, logger="pulsar_state._replica"):
        async with counter_manager(service_url, topic, admin_url, open_timeout_s=20) as replica:
            assert stuck
            assert await replica.read(lambda s: s["count"]) == 3
    assert "reopening the reader" in caplog.text


async def test_a_writer_whose_reader_receives_nothing_replaces_it_to_catch_up(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer's catch-up, once it has the producer, reads to the tail: with the reader
    stuck, each write waited to its timeout."""
    options: dict[str, Any] = {"relay_writes": False, "write_timeout_s": 15.0}
    async with (
        counter_manager(service_url, topic, admin_url, **options) as other,
        counter_manager(service_url, topic, admin_url, **options) as writer,
    ):
        await writer.write(lambda s: [incr()])
        async with reading_nothing(writer, service_url, topic):
            await other.write(lambda s: [incr()])  # takes the producer from the writer
            with caplog.at_level(logging.WARNING, logger="pulsar_state._replica"):
                await writer.write(lambda s: [incr()])  # takes it back: catches up first
            assert "reopening the reader" in caplog.text
            assert await writer.read(lambda s: s["count"]) == 3


async def test_a_follower_whose_reader_receives_nothing_replaces_it_unasked(
    service_url: str,
    admin_url: str,
    topic: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A replica nobody asks to catch up (it only follows: watches, local reads) went stale
    for good, without an error, once its reader was stuck."""
    monkeypatch.setattr("pulsar_state._replica._WATCH_S", 1.0)  # (10 s by default)
    async with (
        counter_manager(service_url, topic, admin_url) as writer,
        counter_manager(service_url, topic, admin_url) as follower,
    ):
        await writer.write(lambda s: [incr()])
        assert await follower.read(lambda s: s["count"], latest=True) == 1
        async with reading_nothing(follower, service_url, topic):
            await writer.write(lambda s: [incr()])
            with caplog.at_level(logging.WARNING, logger="pulsar_state._replica"):
                deadline = time.monotonic() + 20
                while follower.read_local(lambda s: s["count"]) != 2:
                    assert time.monotonic() < deadline, "the follower stayed stale"
                    await asyncio.sleep(0.1)
            assert "reopening the reader" in caplog.text
