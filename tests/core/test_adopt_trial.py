"""``adopt_trial``: the holder of the writer applies its own record of one write by adopting
the trial state the write was built and checked on, instead of decoding the record and
applying it again; every other replica (and the holder, for anything else) decodes and
applies. Each test checks which path a record took (decodes counted) and that the holder
and a plain replica agree."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pulsar_state import (
    ApplyError,
    ConfigurationError,
    DictOverlay,
    JsonCodec,
    PulsarStateError,
    WriteOutcomeUnknownError,
)
from tests.core.helpers import counter_manager, incr
from tests.core.test_send_at_once import HELD, holding


class CountingCodec(JsonCodec):
    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, data: bytes, /) -> Any:
        self.decoded += 1
        return super().decode(data)


class Adopter:
    """``adopt_trial`` for a dict state: the default trial is a DictOverlay over it."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self, state: dict[str, Any], trial: Any) -> dict[str, Any]:
        self.calls += 1
        if self.fail:
            raise RuntimeError("adopt failed")
        assert isinstance(trial, DictOverlay)
        assert trial.base is state
        trial.commit()
        return state


async def test_the_holder_adopts_its_one_write_records_and_decodes_the_rest(
    service_url: str, admin_url: str, topic: str
) -> None:
    codec, adopt = CountingCodec(), Adopter()
    manager = counter_manager(service_url, topic, admin_url, codec=codec, adopt_trial=adopt, **HELD)
    peer = counter_manager(service_url, topic, admin_url)
    async with manager, peer:
        await holding(manager)
        codec.decoded, adopt.calls = 0, 0
        # One write of two ops: adopted, nothing decoded; its reader sees the write.
        result = await manager.write(
            lambda s: [incr("b"), incr("c", by=2)], reader=lambda s: (s["count"], dict(s["seen"]))
        )
        assert result.value == (4, {"a": 1, "b": 1, "c": 1})
        assert (adopt.calls, codec.decoded) == (1, 0)
        # Two writes queued in one loop turn share a record: decoded and applied as usual.
        first, second = await asyncio.gather(
            manager.write(lambda s: [incr("d")], reader=lambda s: s["count"]),
            manager.write(lambda s: [incr("e")], reader=lambda s: s["count"]),
        )
        assert first.position == second.position
        assert (first.value, second.value) == (5, 6)
        assert (adopt.calls, codec.decoded) == (1, 2)
        expected = {"count": 6, "seen": {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1}}
        assert await manager.read(lambda s: s, latest=True) == expected
        assert await peer.read(lambda s: s, latest=True) == expected


async def test_an_adopt_trial_that_raises_halts_the_holder_loudly(
    service_url: str, admin_url: str, topic: str
) -> None:
    adopt = Adopter()
    manager = counter_manager(service_url, topic, admin_url, adopt_trial=adopt, **HELD)
    peer = counter_manager(service_url, topic, admin_url)
    async with manager, peer:
        await holding(manager)
        adopt.fail, adopt.calls = True, 0
        started = asyncio.get_running_loop().time()
        with pytest.raises(WriteOutcomeUnknownError, match="halted while applying"):
            await manager.write(lambda s: [incr("b")])
        assert asyncio.get_running_loop().time() - started < 10  # not at its 30 s deadline
        assert adopt.calls == 1
        with pytest.raises(PulsarStateError) as halted:
            await manager.read(lambda s: s)
        cause = halted.value.__cause__
        assert isinstance(cause, ApplyError)
        assert "adopt_trial raised" in str(cause)
        # The record is in the log: every other replica applies it.
        assert await peer.read(lambda s: s["seen"], latest=True) == {"a": 1, "b": 1}


def test_adopt_trial_must_be_a_function(service_url: str, topic: str) -> None:
    with pytest.raises(ConfigurationError, match="adopt_trial"):
        counter_manager(service_url, topic, "http://127.0.0.1:1", adopt_trial="yes")
