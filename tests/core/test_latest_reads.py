"""Linearizable reads: the tail is captured over the binary protocol, shared by concurrent
readers, and needs no admin API."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pulsar.asyncio as pulsar_asyncio

from pulsar_state import SharedStateManager
from tests.core.helpers import Counter, apply_counter, counter_manager, new_counter
from tests.support.broker import REPO, Broker

# Writes values 1..N one at a time and prints each once acknowledged.
_WRITER = """
import asyncio, sys
from tests.core.helpers import counter_manager

async def main(url, admin, topic, count):
    async with counter_manager(url, topic, admin, name="other-process") as manager:
        for value in range(1, count + 1):
            await manager.write(lambda s, v=value: [{"op": "set", "key": "v", "value": v}])
            print(value, flush=True)
            sys.stdin.readline()  # the test reads before the next write

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


async def test_latest_read_sees_a_write_acked_by_another_process_just_before(
    broker: Broker, topic: str
) -> None:
    writes = 20
    async with counter_manager(broker.service_url, topic, broker.admin_url) as reader:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        argv = [sys.executable, "-c", _WRITER, broker.service_url, broker.admin_url, topic]
        writer = await asyncio.create_subprocess_exec(
            *argv, str(writes), cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert writer.stdout is not None
        assert writer.stdin is not None
        try:
            for expected in range(1, writes + 1):
                line = await asyncio.wait_for(writer.stdout.readline(), 60)
                assert int(line) == expected
                # Acknowledged in the other process just now: a latest read must see it.
                seen = await reader.read(lambda s: s.get("v"), latest=True)
                assert seen == expected
                writer.stdin.write(b"\n")
            assert await asyncio.wait_for(writer.wait(), 60) == 0
        finally:
            if writer.returncode is None:
                writer.kill()
                await writer.wait()


async def test_latest_reads_work_without_admin_url(broker: Broker, topic: str) -> None:
    client = pulsar_asyncio.Client(broker.service_url, operation_timeout_seconds=15)
    try:
        # A borrowed client and no admin_url: reads and writes use the binary protocol only.
        options = {"initial_state": new_counter, "apply": apply_counter, "check_topic": False}
        writer: SharedStateManager[Counter, dict[str, object]] = SharedStateManager(
            client, topic, **options
        )
        reader: SharedStateManager[Counter, dict[str, object]] = SharedStateManager(
            client, topic, **options
        )
        async with writer, reader:
            assert writer._admin is None
            assert reader._admin is None
            for value in range(5):
                await writer.write(lambda s, v=value: [{"op": "set", "key": "v", "value": v}])
                assert await reader.read(lambda s: s.get("v"), latest=True) == value
    finally:
        await client.close()


async def test_latest_read_on_an_empty_topic(broker: Broker, topic: str) -> None:
    async with counter_manager(broker.service_url, topic, broker.admin_url) as manager:
        assert await manager.read(lambda s: s["count"], latest=True, timeout=5.0) == 0
        assert await manager.sync(timeout=5.0) == 0


async def test_concurrent_latest_readers_share_tail_fetches(broker: Broker, topic: str) -> None:
    async with (
        counter_manager(broker.service_url, topic, broker.admin_url) as writer,
        counter_manager(broker.service_url, topic, broker.admin_url) as reader,
    ):
        for round_ in range(10):
            await writer.write(lambda s, v=round_: [{"op": "set", "key": "v", "value": v}])
            before = reader._tail.fetches
            seen = await asyncio.gather(
                *(reader.read(lambda s: s.get("v"), latest=True) for _ in range(50))
            )
            # Every read began after the write was acknowledged, so every one sees it ...
            assert seen == [round_] * 50
            # ... and 50 readers cost at most two round trips: the first reader's, and one
            # shared by all who came while it was under way.
            assert reader._tail.fetches - before <= 2
