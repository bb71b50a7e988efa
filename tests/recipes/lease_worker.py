"""A process using the lease recipes with the tests: ``python -m tests.recipes.lease_worker``.

Prints JSON lines on stdout (logs go to stderr), reads JSON lines on stdin.

* ``contend URL ADMIN TOPIC DATA NAME ROUNDS SEED``: ROUNDS times, take a random set of the
  resources r0..r4 in a random mode; while holding a write lease, mark each name in the map
  on DATA (fenced) and check that nobody changed the mark before releasing. Prints
  ``{"ready": ...}``, waits for a line, runs, prints ``{"summary": ...}``.
* ``hold URL ADMIN TOPIC DATA NAME TTL``: take "res" in write mode (kept alive), claim it in
  the map, print ``{"lease": ...}``, then run ``["write", value]`` (a fenced put of "value")
  and ``["read"]`` commands from stdin until ``["exit"]``.
* ``elect URL ADMIN TOPIC NAME TTL``: campaign; print ``{"leader": name, "token": ...}`` when
  leading; stay until killed.
* ``observe URL ADMIN TOPIC N``: print ``{"ready": ...}``, then the first N leaders of the
  election's ``leaders()`` stream, then exit.
* ``member URL ADMIN TOPIC NAME TTL``: join the group, print ``{"joined": name}``, stay.
* ``count URL ADMIN TOPIC N``: wait for a line, add 1 N times; print the values returned.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from recipes import (
    Counter,
    LeaderElection,
    Lease,
    Membership,
    Ownership,
    PulsarMap,
    StaleTokenError,
    claim,
    fenced_transact,
)

WAIT_S = 60.0


def emit(message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def read_stdin_line() -> Any:
    line = await asyncio.wait_for(asyncio.to_thread(sys.stdin.readline), WAIT_S * 5)
    return json.loads(line)


def options(admin: str) -> dict[str, Any]:
    return {
        "admin_url": admin,
        "write_timeout_s": WAIT_S,
        "read_timeout_s": WAIT_S,
        "open_timeout_s": WAIT_S,
    }


def map_options(admin: str) -> dict[str, Any]:
    # A process frozen while holding the map's writer must not block the next holder.
    return {**options(admin), "takeover_after_s": 1.0}


def lease_json(lease: Lease) -> dict[str, Any]:
    return {"id": lease.id, "token": lease.token, "names": list(lease.names), "mode": lease.mode}


async def contend(url: str, admin: str, topic: str, data: str, name: str, rounds: str, seed: str):
    rng = random.Random(int(seed))
    violations: list[str] = []
    tokens: list[int] = []
    async with (
        Ownership(url, topic, owner=name, **options(admin)) as owners,
        PulsarMap(url, data, **map_options(admin)) as marks,
    ):
        emit({"ready": name})
        await read_stdin_line()
        for round_ in range(int(rounds)):
            names = rng.sample([f"r{i}" for i in range(5)], rng.randint(1, 3))
            mode = rng.choice(["read", "write"])
            lease = await owners.acquire(names, mode=mode, ttl=20, timeout=WAIT_S)
            tokens.append(lease.token)
            mark = f"{name}/{round_}"
            if mode == "write":
                await fenced_transact(
                    marks, lease, lambda view, names=names, mark=mark: {n: mark for n in names}
                )
                expected = {n: mark for n in names}
            else:  # readers: no writer may change the marks while they hold
                expected = {n: await marks.get(n, latest=True) for n in names}
            await asyncio.sleep(rng.random() * 0.03)
            seen = {n: await marks.get(n, latest=True) for n in names}
            if seen != expected:
                violations.append(f"{mark} {mode} {names}: {expected} changed to {seen}")
            await owners.release(lease)
    emit({"summary": {"rounds": int(rounds), "tokens": tokens, "violations": violations}})


async def hold(url: str, admin: str, topic: str, data: str, name: str, ttl: str) -> None:
    async with (
        Ownership(url, topic, owner=name, **options(admin)) as owners,
        PulsarMap(url, data, **map_options(admin)) as shared,
    ):
        lease = await owners.acquire("res", mode="write", ttl=float(ttl), timeout=WAIT_S)
        await claim(shared, lease)
        emit({"lease": lease_json(lease)})
        while True:
            command = await read_stdin_line()
            if command[0] == "exit":
                return
            if command[0] == "read":
                emit({"value": await shared.get("value", latest=True)})
                continue
            value = command[1]
            try:
                await fenced_transact(shared, lease, lambda view, value=value: {"value": value})
                emit({"wrote": value})
            except StaleTokenError as exc:
                emit({"refused": type(exc).__name__, "seen": exc.seen})


async def elect(url: str, admin: str, topic: str, name: str, ttl: str) -> None:
    async with LeaderElection(url, topic, name=name, ttl=float(ttl), **options(admin)) as e:
        term = await e.campaign()
        emit({"leader": name, "token": term.token})
        await asyncio.sleep(3600)


async def observe(url: str, admin: str, topic: str, count: str) -> None:
    async with LeaderElection(url, topic, **options(admin)) as election:
        seen: list[Any] = []
        async with election.leaders() as leaders:
            emit({"ready": election.ownership.position})
            while len(seen) < int(count):
                leader = await leaders.next(timeout=WAIT_S * 2)
                seen.append(None if leader is None else [leader.name, leader.token])
        emit({"seen": seen})


async def member(url: str, admin: str, topic: str, name: str, ttl: str) -> None:
    async with Membership(url, topic, name=name, ttl=float(ttl), **options(admin)) as group:
        await group.join()
        emit({"joined": name})
        await asyncio.sleep(3600)


async def count(url: str, admin: str, topic: str, n: str) -> None:
    async with Counter(url, topic, **options(admin)) as counter:
        emit({"ready": counter.position})
        await read_stdin_line()
        values = [await counter.add(1) for _ in range(int(n))]
        emit({"values": values})


COMMANDS: dict[str, Callable[..., Coroutine[Any, Any, None]]] = {
    "contend": contend,
    "hold": hold,
    "elect": elect,
    "observe": observe,
    "member": member,
    "count": count,
}

if __name__ == "__main__":
    asyncio.run(COMMANDS[sys.argv[1]](*sys.argv[2:]))
    # Skip interpreter teardown: pulsar-client can crash while Python shuts down
    # (apache/pulsar-client-python#153); everything is closed and flushed by now.
    sys.stdout.flush()
    os._exit(0)
