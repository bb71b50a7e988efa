"""The writer's idle wait: its end moves by a store, the loop's timer is set again only when
needed (pure asyncio, no broker)."""

from __future__ import annotations

import asyncio

import pytest

from pulsar_state._writer import _IdleWait

# Counts the timers of asyncio's own loop (uvloop keeps its timers in libuv).
pytestmark = pytest.mark.stock_asyncio


def _timers(loop: asyncio.AbstractEventLoop) -> int:
    return sum(not handle.cancelled() for handle in loop._scheduled)  # type: ignore[attr-defined]


async def test_it_ends_at_its_end_and_wakes_the_serve_loop() -> None:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    started = loop.time()
    wait = _IdleWait(loop, started + 0.05, wake)
    await asyncio.wait_for(wake.wait(), 5)
    assert wait.expired
    assert loop.time() - started >= 0.05


async def test_a_later_end_costs_no_timer_until_the_first_one_fires() -> None:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    before = _timers(loop)
    started = loop.time()
    wait = _IdleWait(loop, started + 0.05, wake)
    for step in range(1, 101):  # one write after another, each pushing the end back
        wait.move_to(started + 0.05 + step * 0.001)
    assert _timers(loop) == before + 1  # the first timer only: nothing cancelled or added
    await asyncio.sleep(0.07)  # the first end passed: the timer was set again, once
    assert not wait.expired
    assert not wake.is_set()
    await asyncio.wait_for(wake.wait(), 5)
    assert wait.expired
    assert loop.time() - started >= 0.15


async def test_a_sooner_end_sets_the_timer_again() -> None:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    started = loop.time()
    wait = _IdleWait(loop, started + 10.0, wake)
    wait.move_to(started + 0.05)  # idle_release shortened (the relay came up)
    await asyncio.wait_for(wake.wait(), 5)
    assert wait.expired
    assert loop.time() - started < 5.0


async def test_cancelled_it_never_wakes() -> None:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    wait = _IdleWait(loop, loop.time() + 0.02, wake)
    wait.cancel()
    await asyncio.sleep(0.06)
    assert not wait.expired
    assert not wake.is_set()
