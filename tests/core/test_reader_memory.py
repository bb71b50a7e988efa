"""A replica's reader holds a bounded number of bytes ahead of a slow event loop.

Measured before the bound: batches were cut at 4 MB and 8 of them could wait, so a replica
replaying records of megabytes held 32 MB or more of them in Python on top of the client's
own prefetch (a 1M-key map replayed from 3 MB records peaked 10 MB higher)."""

from __future__ import annotations

import asyncio

import pytest

import pulsar_state._pulsar
from pulsar_state._memory import release_free_memory
from pulsar_state._pulsar import PulsarConnection, StateReader

MB = 1024 * 1024
BOUND = 8 * MB


def bytes_handed_over(reader: StateReader) -> int:
    # Queue items are (batch, bytes); whatever the thread is still holding is not counted,
    # it is at most one batch.
    return sum(
        sum(len(message.payload) for message in item[0]) for item in list(reader._batches.queue)
    )


async def write_megabytes(conn: PulsarConnection, topic: str, count: int) -> None:
    """``count`` messages of 1 MB, message i made of byte i."""
    writer = await conn.create_writer(topic, fencing=False, send_timeout_s=30)
    for i in range(count):
        await writer.send(bytes([i]) * MB, key="k")
    await writer.close()


async def test_a_reader_hands_over_a_bounded_number_of_bytes_and_loses_none(
    service_url: str, topic: str
) -> None:
    conn = PulsarConnection(service_url)
    try:
        await write_megabytes(conn, topic, 40)
        reader = await conn.create_reader(topic, prefetch=16)
        await asyncio.sleep(2)  # nobody reads: the reader thread goes as far as it may
        assert 0 < bytes_handed_over(reader) <= BOUND
        received = []
        while len(received) < 40:
            received += [message.payload for message in await reader.read_batch()]
            assert bytes_handed_over(reader) <= BOUND
        assert received == [bytes([i]) * MB for i in range(40)]
        await reader.close()
    finally:
        await conn.close()


async def test_a_replaying_reader_gives_freed_memory_back(
    service_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """glibc keeps the freed buffers of a long replay: the reader trims the heap as it goes
    (measured: a 1M-key map replayed from 3 MB records peaked at 4.17x its raw data without,
    2.9x with). How often is TrimPolicy's business (tests/unit/test_memory.py)."""
    assert release_free_memory()  # glibc here: the trim is available
    trims = []
    monkeypatch.setattr(pulsar_state._pulsar, "release_free_memory", lambda: trims.append(1))
    conn = PulsarConnection(service_url)
    try:
        await write_megabytes(conn, topic, 20)
        reader = await conn.create_reader(topic, prefetch=16)
        received = 0
        while received < 20:
            received += len(await reader.read_batch())
        await reader.close()
    finally:
        await conn.close()
    assert trims
