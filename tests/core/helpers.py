"""Shared pieces for core tests: a counter state, raw topic access, managers with test timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pulsar
import pulsar.asyncio as pulsar_asyncio
import pytest

from pulsar_state import BrokerUnavailableError, SharedStateManager
from pulsar_state._pulsar import LogPosition, StateWriter

Counter = dict[str, Any]


Manager = SharedStateManager[Counter, dict[str, Any]]


def new_counter() -> Counter:
    return {"count": 0, "seen": {}}


def apply_counter(state: Counter, op: dict[str, Any]) -> None:
    """A non-idempotent op: applying it twice would show in ``count`` and ``seen``."""
    kind = op.get("op")
    if kind == "incr":
        state["count"] += op.get("by", 1)
        op_id = op.get("id")
        if op_id is not None:
            state["seen"][op_id] = state["seen"].get(op_id, 0) + 1
    elif kind == "set":
        state[op["key"]] = op["value"]
    elif kind == "boom":
        raise RuntimeError("boom op")
    else:
        raise ValueError(f"unknown op {kind!r}")


def incr(op_id: str | None = None, by: int = 1) -> dict[str, Any]:
    return {"op": "incr", "id": op_id, "by": by}


async def seen_by(manager: SharedStateManager[Counter, dict[str, Any]]) -> dict[str, int]:
    """How many times each op id was applied, as of the log's latest record."""
    seen: dict[str, int] = await manager.read(lambda s: s["seen"], latest=True)
    return seen


def counter_manager(
    service_url: str, topic: str, admin_url: str, **options: Any
) -> SharedStateManager[Counter, dict[str, Any]]:
    defaults: dict[str, Any] = {
        "initial_state": new_counter,
        "apply": apply_counter,
        "admin_url": admin_url,
        "write_timeout_s": 30.0,
        "read_timeout_s": 30.0,
        "open_timeout_s": 60.0,
    }
    defaults.update(options)
    return SharedStateManager(service_url, topic, **defaults)


@asynccontextmanager
async def raw_producer(service_url: str, topic: str) -> AsyncIterator[Any]:
    """An exclusive producer straight from pulsar-client, to put arbitrary bytes on a topic."""
    client = pulsar_asyncio.Client(service_url, operation_timeout_seconds=15)
    try:
        for _ in range(100):  # the manager may hold the writer for a moment
            try:
                producer = await client.create_producer(
                    topic,
                    access_mode=pulsar.ProducerAccessMode.Exclusive,
                    batching_enabled=False,
                )
                break
            except pulsar_asyncio.PulsarException:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("could not get the topic's producer")
        try:
            yield producer
        finally:
            await producer.close()
    finally:
        await client.close()


async def topic_message_count(service_url: str, topic: str) -> int:
    client = pulsar_asyncio.Client(service_url, operation_timeout_seconds=15)
    try:
        reader = await client.create_reader(topic, pulsar.MessageId.earliest)
        count = 0
        while await reader.has_message_available():
            await asyncio.wait_for(reader.read_next(), 10)
            count += 1
        return count
    finally:
        await client.close()


def fail_send_number(monkeypatch: pytest.MonkeyPatch, number: int) -> dict[str, int]:
    """Make the ``number``-th send of the process fail (not persisted); count the sends."""
    calls = {"send": 0}
    send_nowait = StateWriter.send_nowait

    def failing(
        self: StateWriter,
        payload: bytes,
        *,
        key: str,
        on_settled: Callable[[], None] | None = None,
    ) -> asyncio.Future[LogPosition]:
        calls["send"] += 1
        if calls["send"] == number:
            loop = asyncio.get_running_loop()
            failed: asyncio.Future[LogPosition] = loop.create_future()
            failed.set_exception(BrokerUnavailableError("injected: the send failed"))
            if on_settled is not None:
                loop.call_soon(on_settled)  # as send_nowait does for a send it refuses
            return failed
        return send_nowait(self, payload, key=key, on_settled=on_settled)

    monkeypatch.setattr(StateWriter, "send_nowait", failing)
    return calls


@asynccontextmanager
async def writer_held_elsewhere(
    service_url: str, topic: str, admin_url: str, **waiter_options: Any
) -> AsyncIterator[tuple[Manager, Manager]]:
    """A ``holder`` that has written and keeps the topic's writer (an hour), and a
    ``waiter``; neither relays writes, so the waiter's writes wait for the writer."""
    hold = {"idle_release_s": 3600.0, "max_hold_s": 3600.0, "relay_writes": False}
    async with (
        counter_manager(service_url, topic, admin_url, **hold) as holder,
        counter_manager(
            service_url, topic, admin_url, relay_writes=False, **waiter_options
        ) as waiter,
    ):
        await holder.write(lambda s: [incr()])
        yield holder, waiter
