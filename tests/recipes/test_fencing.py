"""Fenced writes off their happy path, against the real broker: what else writes to the map
(clear, update_multiple), keys the map normalises, and fences or leases that are not tokens."""

from __future__ import annotations

import enum
from typing import Any

import pytest

from pulsar_state import ConfigurationError, StrCodec
from recipes import (
    Ownership,
    PulsarMap,
    StaleTokenError,
    claim,
    fence_key,
    fenced_transact,
    sync_fenced_transact,
)
from recipes._lease_table import Lease
from tests.recipes.helpers import new_map, owners


async def two_leases(table: Ownership, name: str = "db") -> tuple[Lease, Lease]:
    """An older lease on ``name`` (released, as one lost is) and the newer one holding it."""
    old = await table.acquire(name, ttl=600.0, keep_alive=False)
    await table.release(old)
    new = await table.acquire(name, ttl=600.0, keep_alive=False)
    assert new.token > old.token
    return old, new


@pytest.mark.parametrize("wipe", ["clear", "update_multiple"])
async def test_clearing_the_map_keeps_the_fences(
    service_url: str, admin_url: str, topic: str, wipe: str
) -> None:
    async with (
        owners(service_url, topic, admin_url) as table,
        new_map(service_url, topic + "-data", admin_url) as shared,
    ):
        old, new = await two_leases(table)
        await claim(shared, new)
        await shared.put("balance", 10)
        if wipe == "clear":
            await shared.clear()
        else:
            await shared.update_multiple(lambda key: True, lambda key, value: None)
        assert await shared.get("balance", latest=True) is None
        # Before: the fence went with the data, so the old holder was accepted again (and
        # set the fence back to its own token, after which the new holder was accepted too).
        with pytest.raises(StaleTokenError):
            await fenced_transact(shared, old, lambda view: {"balance": 99})
        assert await shared.get(fence_key("db"), latest=True) == new.token
        await fenced_transact(shared, new, lambda view: {"balance": 1})


class Key(enum.StrEnum):
    FENCE = "__fence__/payments"


async def test_a_fenced_write_may_not_change_a_fence_by_any_spelling(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        owners(service_url, topic, admin_url) as table,
        new_map(service_url, topic + "-data", admin_url) as shared,
    ):
        payments = await table.acquire("payments", ttl=600.0, keep_alive=False)
        await claim(shared, payments)
        db = await table.acquire("db", ttl=600.0, keep_alive=False)
        # Before: the guard tested str(key), 'Key.FENCE' for this key, which the map stores
        # as "__fence__/payments": a holder of "db" could delete the fence of "payments".
        with pytest.raises(ConfigurationError, match="may not change fence keys"):
            await fenced_transact(shared, db, lambda view: {Key.FENCE: None})
        assert await shared.get(fence_key("payments"), latest=True) == payments.token


class LowerCase(StrCodec):
    """A key codec that normalises: keys are stored lower-cased."""

    def encode(self, value: str, /) -> bytes:
        return super().encode(value.lower())


async def test_fences_are_the_keys_the_map_stores(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        owners(service_url, topic, admin_url) as table,
        new_map(service_url, topic + "-data", admin_url, key_codec=LowerCase()) as shared,
    ):
        old, new = await two_leases(table, "DB")
        await claim(shared, new)
        assert await shared.get(fence_key("db"), latest=True) == new.token
        # Before: the check looked up "__fence__/DB", which the map does not hold (it holds
        # "__fence__/db"): every token passed, and the old holder set the fence back.
        with pytest.raises(StaleTokenError):
            await fenced_transact(shared, old, lambda view: {"balance": 99})


def hand_made(**fields: Any) -> Lease:
    defaults: dict[str, Any] = {
        "id": "by-hand",
        "owner": "me",
        "names": ("db",),
        "mode": "write",
        "ttl": 10.0,
        "expires_at": 2e9,
        "token": 5,
    }
    return Lease(**{**defaults, **fields})


async def test_bad_leases_maps_and_fences_are_refused_and_write_nothing(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as shared:
        await shared.put("kept", 1)
        position = shared.position
        for lease, words in [
            (hand_made(names=()), "names no resources"),
            (hand_made(names="db"), "names no resources"),  # would fence "d" and "b"
            (hand_made(names=("",)), "names no resources"),
            (hand_made(token=True), "no fencing token"),
            (hand_made(token="5"), "no fencing token"),  # (was a bare TypeError)
            (hand_made(mode="read"), "granted lease in write mode"),
            (hand_made(token=0), "granted lease"),
        ]:
            with pytest.raises(ConfigurationError, match=words):
                await fenced_transact(shared, lease, lambda view: {"kept": 2})
        await shared.put(fence_key("db"), "not a token")
        with pytest.raises(ConfigurationError, match="not a fencing token"):
            await fenced_transact(shared, hand_made(), lambda view: {"kept": 2})
        with pytest.raises(ConfigurationError, match="expected a SyncPulsarMap, not PulsarMap"):
            sync_fenced_transact(shared, hand_made(), lambda view: {})  # type: ignore[arg-type]
        assert await shared.get("kept", latest=True) == 1
        assert shared.position == position + 1  # the fence put by hand only
    async with PulsarMap(
        service_url, topic + "-text", value_codec=StrCodec(), admin_url=admin_url
    ) as text:
        with pytest.raises(ConfigurationError, match="cannot hold fencing tokens"):
            await fenced_transact(text, hand_made(), lambda view: {})
    with pytest.raises(ConfigurationError, match="expected a PulsarMap, not dict"):
        await fenced_transact({}, hand_made(), lambda view: {})  # type: ignore[arg-type]
