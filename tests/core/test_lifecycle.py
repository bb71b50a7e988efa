"""A manager's lifecycle: dropped without aclose() it says so with a ResourceWarning
(aiokafka's habit); closed, it leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import warnings
import weakref
from typing import Any

import pulsar.asyncio as pulsar_asyncio
import pytest

from pulsar_state import PulsarStateError, SharedStateManager
from pulsar_state._pulsar import PulsarConnection
from tests.core.helpers import counter_manager, incr


def forget(holder: list[Any]) -> None:
    """Drop the last reference (held only by ``holder``) and collect."""
    holder.clear()
    gc.collect()


async def close_parts(parts: dict[str, Any]) -> None:
    """Close what a dropped manager left running, from a copy of its attributes."""
    shell: SharedStateManager[Any, Any] = SharedStateManager.__new__(SharedStateManager)
    vars(shell).update(parts)
    await shell.aclose()


async def test_an_open_manager_dropped_without_aclose_warns(
    service_url: str, admin_url: str, topic: str
) -> None:
    holder = [counter_manager(service_url, topic, admin_url)]
    await holder[0].open()
    await holder[0].write(lambda s: [incr()])
    parts = dict(vars(holder[0]))
    ref = weakref.ref(holder[0])
    with pytest.warns(ResourceWarning, match=f"unclosed SharedStateManager on .*{topic}"):
        forget(holder)
    # Nothing the running parts hold (tasks, the reader's thread) leads back to the manager.
    assert ref() is None
    await close_parts(parts)


async def test_closed_or_never_opened_managers_do_not_warn(
    service_url: str, admin_url: str, topic: str
) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "unclosed SharedStateManager", ResourceWarning)
        holder = [counter_manager(service_url, topic, admin_url)]
        async with holder[0]:
            await holder[0].write(lambda s: [incr()])
        holder.append(counter_manager(service_url, topic, admin_url))  # never opened
        refs = [weakref.ref(m) for m in holder]
        forget(holder)
        assert all(ref() is None for ref in refs)


async def test_a_closed_manager_leaves_no_socket_open(
    service_url: str, admin_url: str, topic: str
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        holder = [counter_manager(service_url, topic, admin_url)]
        async with holder[0]:
            await holder[0].read(lambda s: s, latest=True)  # uses the admin connection
        forget(holder)
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


async def test_a_close_during_writer_acquisition_leaves_no_orphan_producer(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aclose() cancels the writer while its exclusive producer is being created. If that
    # creation completes afterwards, the producer must be closed: on a borrowed client it
    # would otherwise hold the topic's writer until the client closes.
    entered = asyncio.Event()
    create_writer = PulsarConnection.create_writer

    async def spy(self: PulsarConnection, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        return await create_writer(self, *args, **kwargs)

    monkeypatch.setattr(PulsarConnection, "create_writer", spy)
    client = pulsar_asyncio.Client(service_url, operation_timeout_seconds=15)
    try:
        first = counter_manager(client, topic, admin_url, takeover_after_s=None)
        await first.open()
        write = asyncio.ensure_future(first.write(lambda s: [incr()]))
        await asyncio.wait_for(entered.wait(), 30)
        await asyncio.sleep(0)  # the creation is in flight
        await first.aclose()
        with contextlib.suppress(PulsarStateError):
            await write
        monkeypatch.undo()
        second = counter_manager(
            client, topic, admin_url, takeover_after_s=None, acquire_timeout_s=10.0
        )
        async with second:
            await second.write(lambda s: [incr()])  # WriterBusyError with an orphan
    finally:
        await client.close()
