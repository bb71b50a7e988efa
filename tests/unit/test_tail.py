"""The sharing rule of tail fetches (pure logic: the probe is a stand-in that answers on cue)."""

from __future__ import annotations

import asyncio

from pulsar_state._admin import TopicName
from pulsar_state._pulsar import LogPosition
from pulsar_state._tail import Tail


class CuedProbe:
    """Answers each last_id() with the tail as it is when the test releases the answer."""

    def __init__(self) -> None:
        self.tail = LogPosition(1, 0)
        self.asked: list[asyncio.Event] = []

    async def last_id(self) -> LogPosition | None:
        release = asyncio.Event()
        self.asked.append(release)
        seen = self.tail  # the broker answers as of the moment it gets the request
        await release.wait()
        return seen


async def settle() -> None:
    """Let every ready task run until all wait on something the test controls."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_reader_never_joins_a_fetch_sent_before_it_asked() -> None:
    tail = Tail(TopicName.parse("t"), None)
    probe = CuedProbe()
    tail._probe = probe  # type: ignore[assignment]
    early = asyncio.ensure_future(tail.position())
    await settle()
    assert len(probe.asked) == 1  # the early fetch is under way with the old tail
    probe.tail = LogPosition(1, 5)  # a write is acknowledged now
    late = [asyncio.ensure_future(tail.position()) for _ in range(10)]
    await settle()
    assert len(probe.asked) == 1  # the late readers wait for the early fetch to end ...
    probe.asked[0].set()
    assert await early == LogPosition(1, 0)
    await settle()
    assert len(probe.asked) == 2  # ... then share one new fetch
    probe.asked[1].set()
    assert await asyncio.gather(*late) == [LogPosition(1, 5)] * 10
    assert tail.fetches == 2


async def test_a_cancelled_reader_does_not_fail_the_others() -> None:
    tail = Tail(TopicName.parse("t"), None)
    probe = CuedProbe()
    tail._probe = probe  # type: ignore[assignment]
    first = asyncio.ensure_future(tail.position())
    second = asyncio.ensure_future(tail.position())
    await settle()
    first.cancel()
    probe.asked[0].set()
    await settle()
    probe.asked[1].set()
    assert await second == LogPosition(1, 0)
    assert first.cancelled()


async def test_the_background_look_asks_the_probe_only() -> None:
    # No admin client: a ledger just opened (entry -1) would need one. The look skips it
    # instead (a stuck reader matters once someone writes, and a write fills the ledger).
    tail = Tail(TopicName.parse("t"), None)
    probe = CuedProbe()
    tail._probe = probe  # type: ignore[assignment]
    for answer, expected in [
        (LogPosition(7, 3), LogPosition(7, 3)),
        (LogPosition(8, -1), None),
        (None, None),
    ]:
        probe.tail = answer  # type: ignore[assignment]
        look = asyncio.ensure_future(tail.position_in_current_ledger())
        await settle()
        probe.asked[-1].set()
        assert await look == expected
