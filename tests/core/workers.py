"""Worker processes for the multi-process core tests: ``python -m tests.core.workers ...``.

Each worker appends one JSON line per event to its own file, flushed and fsynced, so that a
SIGKILLed worker leaves an exact account of what it invoked and what was acknowledged.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from typing import Any, TextIO

from pulsar_state import PulsarStateError, WriteOutcomeUnknownError
from tests.core.helpers import counter_manager, incr
from tests.support.linearizability import HistoryRecorder


def emit(out: TextIO, **event: Any) -> None:
    out.write(json.dumps(event) + "\n")
    out.flush()
    os.fsync(out.fileno())


async def increments(args: argparse.Namespace) -> None:
    """Apply ``count`` increments, each with a unique id, then wait for ``expect`` in total."""
    with open(args.out, "a") as out:  # noqa: ASYNC230 - a test worker, one file per process
        options: dict[str, Any] = {"takeover_after_s": args.takeover}
        if args.hold:  # keep the writer between writes, as a stuck process would
            options.update(idle_release_s=3600.0, max_hold_s=3600.0)
        async with counter_manager(
            args.url, args.topic, args.admin, name=args.name, write_timeout_s=20.0, **options
        ) as manager:
            emit(out, event="open", position=manager.position)
            for i in range(args.count):
                op_id = f"{args.name}-{i}"
                emit(out, event="invoke", id=op_id)
                while True:
                    try:
                        result = await manager.write(lambda s, op_id=op_id: [incr(op_id)])
                        emit(out, event="ack", id=op_id, position=result.position)
                        break
                    except WriteOutcomeUnknownError:
                        # Applied once or not at all: look before retrying, never double.
                        if await applied(manager, op_id):
                            emit(out, event="ack", id=op_id, position=-1)
                            break
                    except PulsarStateError as exc:
                        if not exc.retriable:
                            raise
                        emit(out, event="retry", id=op_id, error=type(exc).__name__)
                        await asyncio.sleep(0.2)
            deadline = time.monotonic() + 120
            while args.expect and time.monotonic() < deadline:
                try:
                    if await manager.read(lambda s: s["count"], latest=True) >= args.expect:
                        break
                except PulsarStateError:
                    pass
                await asyncio.sleep(0.2)
            state = await manager.read(lambda s: s, latest=True)
            emit(
                out,
                event="final",
                count=state["count"],
                distinct=len(state["seen"]),
                max_applied=max(state["seen"].values(), default=0),
                stats=dataclasses.asdict(manager.stats),
            )


async def applied(manager: Any, op_id: str) -> bool:
    while True:
        try:
            return bool(await manager.read(lambda s: op_id in s["seen"], latest=True))
        except PulsarStateError:
            await asyncio.sleep(0.5)


async def registers(args: argparse.Namespace) -> None:
    """Random reads, writes and compare-and-sets on a few registers, recorded for the checker."""
    rng = random.Random(args.seed)
    keys = [f"k{i}" for i in range(args.keys)]
    async with counter_manager(
        args.url, args.topic, args.admin, initial_state=dict, apply=apply_register, name=args.name
    ) as manager:
        with HistoryRecorder(args.out, process=args.name) as history:
            for i in range(args.count):
                key = rng.choice(keys)
                kind = rng.choice(["read", "read", "write", "cas"])
                if kind == "read":
                    op = history.invoke("read", key)
                    value = await manager.read(lambda s, key=key: s.get(key), latest=True)
                    history.ok(op, value)
                elif kind == "write":
                    value = f"{args.name}-{i}"
                    op = history.invoke("write", key, value)
                    await manager.write(lambda s, k=key, v=value: [{"key": k, "value": v}])
                    history.ok(op, None)
                else:
                    expected = rng.choice([None, *(f"{n}-{j}" for n in "ab" for j in range(3))])
                    current = await manager.read(lambda s, key=key: s.get(key))
                    if rng.random() < 0.6:
                        expected = current  # mostly plausible expectations, so some succeed
                    new = f"{args.name}-{i}"
                    op = history.invoke("cas", key, [expected, new])
                    decision = {"swapped": False}

                    def cas(
                        state: dict[str, Any],
                        key: str = key,
                        expected: Any = expected,
                        new: str = new,
                        decision: dict[str, bool] = decision,
                    ) -> list[dict[str, Any]]:
                        # Runs again on retries: the committed attempt's decision is the last.
                        decision["swapped"] = state.get(key) == expected
                        return [{"key": key, "value": new}] if decision["swapped"] else []

                    await manager.write(cas)
                    history.ok(op, decision["swapped"])


def apply_register(state: dict[str, Any], op: dict[str, Any]) -> None:
    state[op["key"]] = op["value"]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["incr", "registers"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--admin", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--expect", type=int, default=0)
    parser.add_argument("--keys", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--takeover", type=float, default=None)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args(argv)
    asyncio.run(increments(args) if args.mode == "incr" else registers(args))
    # Skip interpreter teardown: pulsar-client can crash while Python shuts down
    # (apache/pulsar-client-python#153); everything is closed and flushed by now.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
