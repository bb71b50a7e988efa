"""The writer's idle wait: its end moves by a store, the loop's timer is set again only when
needed (pure asyncio, no broker); on uvloop's loop too."""

from __future__ import annotations

import asyncio

import pytest

from pulsar_state._writer import _TIMER_SLACK_S, _IdleWait


def _timers(loop: asyncio.AbstractEventLoop) -> int:
    return sum(not handle.cancelled() for handle in loop._scheduled)  # type: ignore[attr-defined]


async def test_it_ends_at_its_end_and_wakes_the_serve_loop() -> None:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    started = loop.time()
    wait = _IdleWait(loop, started + 0.05, wake)
    await asyncio.wait_for(wake.wait(), 5)
    assert wait.expired
    assert loop.time() - started >= 0.05 - _TIMER_SLACK_S


# Counts the timers of asyncio's own loop (uvloop keeps its timers in libuv).
@pytest.mark.stock_asyncio
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
    assert loop.time() - started >= 0.15 - _TIMER_SLACK_S


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


def test_on_uvloop_it_ends_without_spinning_on_the_clocks_last_millisecond(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # uvloop's timers fire up to 1 ms before its clock reaches their end: each check that
    # found the end not reached set the timer again, and it fired again at once (up to 364
    # checks in one wait, measured, where asyncio's loop makes one).
    import uvloop  # the test extra installs it

    checks: list[float] = []
    check = _IdleWait._check

    def counted(self: _IdleWait) -> None:
        checks.append(self.until)
        check(self)

    monkeypatch.setattr(_IdleWait, "_check", counted)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        most = 0
        for i in range(30):  # ends at odd fractions of a millisecond
            checks.clear()
            wake = asyncio.Event()
            started = loop.time()
            wait = _IdleWait(loop, started + 0.0103 + i * 0.000037, wake)
            await asyncio.wait_for(wake.wait(), 5)
            assert wait.expired
            assert loop.time() - started >= 0.0103 - _TIMER_SLACK_S
            most = max(most, len(checks))
        return most

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) <= 2
