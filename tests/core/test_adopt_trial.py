"""``adopt_trial``: the holder of the writer applies its own record of one write by adopting
the trial state the write was built and checked on, instead of decoding the record and
applying it again, once its ops decode to exactly those the trial ran; every other replica
(and the holder, for anything else) applies the decoded ops. Each test checks which path a
record took (adoptions counted) and that the holder and a plain replica agree."""

from __future__ import annotations

import asyncio
import datetime
import decimal
from typing import Any

import pytest

from pulsar_state import (
    ApplyError,
    AvroCodec,
    ConfigurationError,
    DictOverlay,
    JsonCodec,
    PulsarStateError,
    WriteOutcomeUnknownError,
)
from tests.core.helpers import counter_manager, incr
from tests.core.test_send_at_once import HELD, holding, parked


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


async def test_the_holder_adopts_its_one_write_records_and_applies_the_rest(
    service_url: str, admin_url: str, topic: str
) -> None:
    codec, adopt = CountingCodec(), Adopter()
    manager = counter_manager(service_url, topic, admin_url, codec=codec, adopt_trial=adopt, **HELD)
    peer = counter_manager(service_url, topic, admin_url)
    async with manager, peer:
        await holding(manager)
        codec.decoded, adopt.calls = 0, 0
        # One write of two ops: adopted (its two ops decoded, to compare them with those the
        # trial ran); its reader sees the write.
        result = await manager.write(
            lambda s: [incr("b"), incr("c", by=2)], reader=lambda s: (s["count"], dict(s["seen"]))
        )
        assert result.value == (4, {"a": 1, "b": 1, "c": 1})
        assert (adopt.calls, codec.decoded) == (1, 2)
        # Two writes queued in one loop turn share a record: decoded and applied as usual.
        first, second = await asyncio.gather(
            manager.write(lambda s: [incr("d")], reader=lambda s: s["count"]),
            manager.write(lambda s: [incr("e")], reader=lambda s: s["count"]),
        )
        assert first.position == second.position
        assert (first.value, second.value) == (5, 6)
        assert (adopt.calls, codec.decoded) == (1, 4)
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


async def test_ops_that_do_not_decode_to_themselves_are_applied_not_adopted(
    service_url: str, admin_url: str, topic: str
) -> None:
    """A tuple in an op comes back a list from JSON: the trial ran the tuple, every replica
    applies the list. The holder must apply the list too (no adoption), or it would hold a
    tuple where every other replica holds a list."""

    def apply(state: dict[str, Any], op: dict[str, Any]) -> None:
        state[op["k"]] = op["v"]

    codec, adopt = CountingCodec(), Adopter()
    options: dict[str, Any] = {"initial_state": dict, "apply": apply}
    manager = counter_manager(
        service_url, topic, admin_url, codec=codec, adopt_trial=adopt, **options, **HELD
    )
    peer = counter_manager(service_url, topic, admin_url, **options)
    async with manager, peer:
        await manager.write(lambda s: [{"k": "first", "v": 1}])
        await parked(manager)
        adopt.calls = 0
        await manager.write(lambda s: [{"k": "pair", "v": (1, 2)}])
        assert adopt.calls == 0
        await manager.write(lambda s: [{"k": "list", "v": [1, 2]}])
        assert adopt.calls == 1
        mine = await manager.read(lambda s: dict(s), latest=True)
        theirs = await peer.read(lambda s: dict(s), latest=True)
        assert mine == theirs == {"first": 1, "pair": [1, 2], "list": [1, 2]}
        assert type(mine["pair"]) is list


async def test_ops_that_decode_equal_but_not_the_same_are_applied_not_adopted(
    service_url: str, admin_url: str, topic: str
) -> None:
    """Avro gives a timestamp back in UTC and a decimal at its schema's scale: equal to what
    was sent, yet another value to an apply (another hour, another str). The holder adopted
    the trial state built on the values sent, and silently held another state than every
    other replica."""
    schema = {
        "type": "record",
        "name": "Payment",
        "fields": [
            {"name": "k", "type": "string"},
            {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
            {
                "name": "amount",
                "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2},
            },
        ],
    }

    def apply(state: dict[str, Any], op: dict[str, Any]) -> None:
        state[op["k"]] = f"{op['at'].hour}h {op['amount']}"

    paris = datetime.timezone(datetime.timedelta(hours=1))
    op = {"k": "p1", "at": datetime.datetime(2026, 11, 27, 12, tzinfo=paris)}
    adopt = Adopter()
    options: dict[str, Any] = {"initial_state": dict, "apply": apply, "codec": AvroCodec(schema)}
    manager = counter_manager(service_url, topic, admin_url, adopt_trial=adopt, **options, **HELD)
    peer = counter_manager(service_url, topic, admin_url, **options)
    async with manager, peer:
        await manager.write(lambda s: [{**op, "k": "first", "amount": decimal.Decimal("0.50")}])
        await parked(manager)
        adopt.calls = 0
        await manager.write(lambda s: [{**op, "amount": decimal.Decimal("1")}])
        assert adopt.calls == 0
        mine = await manager.read(lambda s: dict(s), latest=True)
        theirs = await peer.read(lambda s: dict(s), latest=True)
        assert mine == theirs == {"first": "11h 0.50", "p1": "11h 1.00"}


def test_adopt_trial_is_not_for_a_durable_state(service_url: str, topic: str) -> None:
    with pytest.raises(ConfigurationError, match="durable_state"):
        counter_manager(
            service_url,
            topic,
            "http://127.0.0.1:1",
            adopt_trial=Adopter(),
            durable_state=object(),
        )


def test_adopt_trial_must_be_a_function(service_url: str, topic: str) -> None:
    with pytest.raises(ConfigurationError, match="adopt_trial"):
        counter_manager(service_url, topic, "http://127.0.0.1:1", adopt_trial="yes")
