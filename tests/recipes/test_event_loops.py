"""Ownership and fenced map writes on uvloop's event loop (see tests/core/test_event_loops.py)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop  # the test extra installs it

from recipes import StaleTokenError, claim, fenced_transact
from tests.recipes.helpers import new_map
from tests.recipes.test_ownership_api import owners


def test_a_lock_handed_over_and_a_stale_token_refused_on_uvloop(
    service_url: str, admin_url: str, topic: str
) -> None:
    async def main() -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        async with (
            owners(service_url, topic, admin_url) as a,
            owners(service_url, topic, admin_url) as b,
            new_map(service_url, topic + "-data", admin_url) as data,
        ):
            first = await a.acquire("account", ttl=30)
            await claim(data, first)
            waiting = asyncio.create_task(b.acquire("account", ttl=30, timeout=30))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # queued behind a's lease
            await a.release(first)
            second = await waiting
            assert second.token > first.token
            await fenced_transact(data, second, lambda view: {"balance": 1})
            with pytest.raises(StaleTokenError):
                await fenced_transact(data, first, lambda view: {"balance": 0})
            assert await data.get("balance", latest=True) == 1
            await b.release(second)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
