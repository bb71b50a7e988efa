"""Calls made while the broker is down ride the outage out within their own deadline.

Each test SIGKILLs the broker, makes a call while it is down, then starts the broker again:
the call must succeed once the broker is back, not fail at the first refused connection.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from pulsar_state import OperationTimeoutError
from tests.core.helpers import counter_manager, incr
from tests.support.broker import Broker

pytestmark = [pytest.mark.fault, pytest.mark.slow]

# Long enough for the bundled broker to come back on a busy 2-core machine.
BUDGET_S = 120.0


async def restart(broker: Broker) -> float:
    """Start the (killed) broker again without blocking the event loop; seconds taken."""
    started = time.monotonic()
    await asyncio.to_thread(broker.start)
    return time.monotonic() - started


async def test_latest_read_issued_during_outage_succeeds_after_restart(
    broker: Broker, topic: str
) -> None:
    async with counter_manager(broker.service_url, topic, broker.admin_url) as manager:
        await manager.write(lambda s: [incr("before")])
        broker.kill()
        read = asyncio.create_task(
            manager.read(lambda s: s["count"], latest=True, timeout=BUDGET_S)
        )
        await asyncio.sleep(1.0)  # the read is under way while nothing answers
        assert not read.done(), read
        print(f"broker back after {await restart(broker):.1f}s")
        assert await read == 1


async def test_open_started_during_outage_opens_and_writes_after_restart(
    broker: Broker, topic: str
) -> None:
    async with counter_manager(broker.service_url, topic, broker.admin_url) as first:
        await first.write(lambda s: [incr("before")])
    broker.kill()
    late = counter_manager(
        broker.service_url,
        topic,
        broker.admin_url,
        open_timeout_s=BUDGET_S,
        write_timeout_s=BUDGET_S,
    )

    async def open_and_write() -> tuple[int, float]:
        await late.open()
        opened = time.monotonic()
        result = await late.write(lambda s: [incr("after")])
        return result.position, time.monotonic() - opened

    opening = asyncio.create_task(open_and_write())
    try:
        await asyncio.sleep(1.0)
        assert not opening.done(), opening
        seconds = await restart(broker)
        ready = time.monotonic()
        position, write_s = await opening
        after = time.monotonic() - ready
        print(f"broker back after {seconds:.1f}s; opened and wrote {after:.1f}s later")
        assert position == 2
        # The first write of a process opened during the outage does not stall.
        assert write_s < 15.0
        state = await late.read(lambda s: s, latest=True)
        assert state["seen"] == {"before": 1, "after": 1}
    finally:
        await late.aclose()


async def test_write_queued_during_outage_lands_exactly_once(
    broker: Broker, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pulsar_state")
    async with counter_manager(
        broker.service_url, topic, broker.admin_url, write_timeout_s=BUDGET_S
    ) as manager:
        await manager.write(lambda s: [incr("before")])
        await asyncio.sleep(0.5)  # the writer is released (idle), so the write must acquire it
        broker.kill()
        write = asyncio.create_task(manager.write(lambda s: [incr("during")]))
        await asyncio.sleep(1.0)
        assert not write.done(), write
        outage_s = await restart(broker)
        ready = time.monotonic()
        result = await write
        landed_s = time.monotonic() - ready
        assert result.position == 2
        print(f"the queued write landed {landed_s:.1f}s after the broker was back")
        assert landed_s < 15.0
    # Backoff, not a retry storm against the restarting broker: a writer turn that fails is
    # logged, and with backoff there are few (a turn retries for up to acquire_timeout_s).
    failed_turns = [r for r in caplog.records if "retrying" in r.getMessage()]
    print(f"{len(failed_turns)} failed writer turns logged during a {outage_s:.0f}s outage")
    assert len(failed_turns) <= 10, failed_turns[:3]
    async with counter_manager(broker.service_url, topic, broker.admin_url) as fresh:
        state = await fresh.read(lambda s: s, latest=True)
    assert state == {"count": 2, "seen": {"before": 1, "during": 1}}


async def test_call_fails_at_its_own_deadline_naming_the_cause(broker: Broker, topic: str) -> None:
    async with counter_manager(broker.service_url, topic, broker.admin_url) as manager:
        broker.kill()
        try:
            started = time.monotonic()
            with pytest.raises(OperationTimeoutError) as caught:
                await manager.read(lambda s: s, latest=True, timeout=3.0)
            elapsed = time.monotonic() - started
        finally:
            await restart(broker)
    assert 2.5 < elapsed < 6.0, elapsed
    assert caught.value.retriable
    assert "refused" in str(caught.value).lower() or "unreachable" in str(caught.value).lower()
