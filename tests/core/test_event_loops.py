"""The core on uvloop's event loop, which many asyncio apps run on (uvicorn's default).

The library never picks the loop: it runs on the caller's. These tests run managers on a
uvloop loop made here, whatever PULSAR_STATE_TEST_LOOP says (with PULSAR_STATE_TEST_LOOP=uvloop
the whole suite runs on it). Exit on uvloop is counted by scripts/exit-loop (its uvloop modes).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvloop  # the test extra installs it

from pulsar_state import AppliedRecord, ApplyError
from tests.core.helpers import counter_manager, incr, seen_by


def run_on_uvloop(main: Any) -> Any:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def test_two_managers_on_uvloop_write_read_and_watch_in_log_order(
    service_url: str, admin_url: str, topic: str
) -> None:
    async def main() -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        async with (
            counter_manager(service_url, topic, admin_url) as a,
            counter_manager(service_url, topic, admin_url) as b,
        ):
            seen: list[int] = []

            def on_record(record: AppliedRecord[Any]) -> None:
                seen.append(record.position)

            b.add_listener(on_record)
            # Both processes' writes interleave (the writer changes hands), each applied once.
            await asyncio.gather(
                *(a.write(lambda s, i=i: [incr(f"a{i}")]) for i in range(20)),
                *(b.write(lambda s, i=i: [incr(f"b{i}")]) for i in range(20)),
            )
            assert await a.read(lambda s: s["count"], latest=True) == 40
            assert await b.read(lambda s: s["count"], latest=True) == 40
            assert set((await seen_by(b)).values()) == {1}
            assert seen == sorted(set(seen))  # each record once, in log order
            assert seen[-1] == b.position

    run_on_uvloop(main())


def test_write_latencies_on_uvloop_are_not_rounded_to_its_milliseconds(
    service_url: str, admin_url: str, topic: str
) -> None:
    # They were timed with loop.time(), which uvloop counts in whole milliseconds: writes of
    # 0.1 ms were seen as 0 or 1 ms, and the histogram's sub-millisecond buckets meant nothing.
    async def main() -> float:
        async with counter_manager(service_url, topic, admin_url) as manager:
            await manager.write(lambda s: [incr()])  # the writer is now held: no I/O below
            before = manager.stats.write_latency.sum_s
            for _ in range(20):
                with pytest.raises(ApplyError):  # refused on the trial state: sub-millisecond
                    await manager.write(lambda s: [{"op": "no such op"}])
            return manager.stats.write_latency.sum_s - before

    observed_ms = run_on_uvloop(main()) * 1000
    assert observed_ms > 0
    assert abs(observed_ms - round(observed_ms)) > 1e-6, observed_ms
