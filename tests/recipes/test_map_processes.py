"""One map shared by several OS processes (workers: tests/recipes/map_worker.py)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from recipes import MapVersion, PulsarMap
from tests.recipes.helpers import Worker, new_map, worker

pytestmark = pytest.mark.slow


async def call(process: Worker, method: str, *args: Any, **kwargs: Any) -> Any:
    await process.send([method, list(args), kwargs])
    return (await process.read())["result"]


async def test_two_processes_read_and_write_one_map(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    async with new_map(service_url, topic, admin_url) as here:
        position = (await here.put("from-test", 1)).position
        async with worker(tmp_path, "script", service_url, admin_url, topic) as other:
            assert (await other.read())["ready"] >= position  # it replayed our write at open
            assert await call(other, "get", "from-test") == 1
            # A version sent as a plain int: MapVersion(...) gives its position back.
            their_version = MapVersion(await call(other, "put", "from-worker", {"x": 2}))
            await here.wait_for(their_version.position, timeout=60)
            assert here.get_local("from-worker") == {"x": 2}
            # Compare-and-set across processes: the worker swaps first, ours then fails.
            assert await call(other, "replace", "from-test", 1, 2) is True
            assert await here.replace("from-test", 1, 3) is False
            assert await here.get("from-test") == 2
            assert await call(other, "delete", "from-worker") is True
            await call(other, "sync")
            assert await call(other, "items") == [["from-test", 2]]
            await other.send(["exit"])
            await other.finish()
        assert await here.list_keys(latest=True) == ["from-test"]


async def test_put_if_absent_race_has_exactly_one_winner_everywhere(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    # 2 processes x 4 maps + 4 maps here = 12 contenders for one key.
    args = (service_url, admin_url, topic)
    async with (
        worker(tmp_path, "contend", *args, "p1", "4") as p1,
        worker(tmp_path, "contend", *args, "p2", "4") as p2,
        contextlib.AsyncExitStack() as stack,
    ):
        local: list[PulsarMap[str, Any]] = [
            await stack.enter_async_context(new_map(service_url, topic, admin_url))
            for _ in range(4)
        ]
        assert (await p1.read())["ready"] == (await p2.read())["ready"] == 4
        ids = [f"here-{i}" for i in range(len(local))]
        await p1.send("go")
        await p2.send("go")
        bound_here, swapped_here = await asyncio.gather(
            asyncio.gather(*(m.put_if_absent("pia", me) for m, me in zip(local, ids, strict=True))),
            asyncio.gather(*(m.replace("cas", None, me) for m, me in zip(local, ids, strict=True))),
        )
        outcomes = [await p1.read(), await p2.read()]
        all_ids = ids + [i for o in outcomes for i in o["ids"]]
        bound = list(bound_here) + [b for o in outcomes for b in o["bound"]]
        swapped = list(swapped_here) + [s for o in outcomes for s in o["swapped"]]
        assert len(all_ids) == 12

        # put_if_absent: everyone got the same value back, and exactly one bound it.
        assert len(set(bound)) == 1
        assert [me for me, value in zip(all_ids, bound, strict=True) if value == me] == [bound[0]]
        # replace(key, None, ...): exactly one True, and that contender's value is bound.
        winners = [me for me, won in zip(all_ids, swapped, strict=True) if won]
        assert len(winners) == 1

        await p1.send("read")
        await p2.send("read")
        seen = [(await m.get("pia", latest=True), await m.get("cas")) for m in local]
        seen += [tuple(s) for o in [await p1.read(), await p2.read()] for s in o["seen"]]
        assert set(seen) == {(bound[0], winners[0])}
        await p1.finish()
        await p2.finish()


async def test_update_multiple_is_atomic_for_a_watcher_in_another_process(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    accounts = [f"acct:{i}" for i in range(5)]
    total = 500
    async with (
        new_map(service_url, topic, admin_url) as a,
        new_map(service_url, topic, admin_url) as b,
    ):
        await a.put_all({key: total // len(accounts) for key in accounts})
        async with worker(
            tmp_path, "watch", service_url, admin_url, topic, ",".join(accounts)
        ) as watcher:
            await watcher.read()  # ready: watching
            rng = random.Random(7)

            async def transfer(m: PulsarMap[str, Any]) -> None:
                source, target = rng.sample(accounts, 2)
                amount = rng.randint(1, 30)
                await m.update_multiple(
                    lambda key: key in (source, target),
                    lambda key, balance: balance - amount if key == source else balance + amount,
                )

            # Two replicas racing, so transfers also retry on stale states.
            await asyncio.gather(*(transfer(m) for _ in range(40) for m in (a, b)))
            await a.put("__done__", True)

            events: list[dict[str, Any]] = []
            while True:
                line = await watcher.read()
                if "summary" in line:
                    summary = line["summary"]
                    break
                events.append(line["event"])
            await watcher.finish()

        # The watcher's own check: its local view never showed a partial transfer.
        assert summary["violations"] == []
        assert summary["checks"] == len(events)
        # Rebuild every state it was told about, write by write: the sum never moves.
        balances: dict[str, int] = {}
        by_position: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for event in events:
            if event["initial"]:
                balances[event["key"]] = event["value"]
            else:
                by_position[event["position"]].append(event)
        assert sum(balances.values()) == total
        assert list(by_position) == sorted(by_position)
        for changes in by_position.values():
            for event in changes:
                if event["key"] in accounts:
                    balances[event["key"]] = event["value"]
            assert sum(balances.values()) == total
        # Every transfer was seen, as its two changes (several transfers may share a record).
        assert sum(event["key"] in accounts for event in events if not event["initial"]) == 160
        assert {k: v for k, v in await a.all(latest=True) if k in accounts} == balances


async def test_watcher_in_another_process_sees_every_change_in_order(
    service_url: str, admin_url: str, topic: str, tmp_path: Path
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        await m.put("before", 0)
        async with worker(tmp_path, "watch", service_url, admin_url, topic) as watcher:
            await watcher.read()  # ready
            expected: list[list[Any]] = []  # [kind, key, value, position], as the writer did
            rng = random.Random(11)
            keys = ["a", "b", "c", "d"]
            for step in range(80):
                key = rng.choice(keys)
                choice = rng.random()
                if choice < 0.35:
                    position = (await m.put(key, step)).position
                    expected.append(["put", key, step, position])
                elif choice < 0.45:
                    pairs = {k: step for k in rng.sample(keys, 2)}
                    position = await m.put_all(pairs)
                    expected += [["put", k, v, position] for k, v in pairs.items()]
                elif choice < 0.6:
                    if await m.delete(key):
                        expected.append(["delete", key, None, m.position])
                elif choice < 0.7:
                    value = await m.update(key, lambda k, v: (v or 0) + 1000)
                    expected.append(["put", key, value, m.position])
                elif choice < 0.8:
                    if await m.replace(key, step - 1, step):  # usually fails: no event
                        expected.append(["put", key, step, m.position])
                elif choice < 0.95:
                    before = dict(m.items())
                    position = await m.update_multiple(lambda k: k in keys, lambda k, v: v + 1)
                    expected += [
                        ["put", k, before[k] + 1, position] for k in sorted(before) if k in keys
                    ]
                else:
                    position = await m.clear()
                    expected.append(["clear", None, None, position])
            done = (await m.put("__done__", True)).position
            expected.append(["put", "__done__", True, done])

            changes = []
            while True:
                line = await watcher.read()
                if "summary" in line:
                    break
                event = line["event"]
                if event["initial"]:
                    assert event["key"] == "before"
                    continue
                changes.append([event["kind"], event["key"], event["value"], event["position"]])
            await watcher.finish()
        assert changes == expected
