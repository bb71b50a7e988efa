"""A process sharing a PulsarMap with the tests: ``python -m tests.recipes.map_worker CMD ...``.

It prints JSON lines on stdout (logs go to stderr) and reads JSON lines on stdin.

* ``watch URL ADMIN TOPIC [SUM_KEYS]``: print ``{"ready": position}``, then every event of a
  watch on the whole map until a put of ``__done__``; then ``{"summary": ...}``. With
  SUM_KEYS (comma-separated), also check at every event that the local view's sum of those
  keys equals their sum in the first state seen.
* ``contend URL ADMIN TOPIC NAME N``: open N maps, print ``{"ready": N}``, wait for a line on
  stdin, then race ``put_if_absent("pia", ...)`` and ``replace("cas", None, ...)`` from all of
  them; print each contender's outcome and what each map reads afterwards.
* ``script URL ADMIN TOPIC``: run the calls read from stdin (``[method, args, kwargs]``),
  printing each result, until ``["exit"]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from recipes import MapEvent, PulsarMap

WAIT_S = 60.0


def emit(message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def event_json(event: MapEvent[Any, Any]) -> dict[str, Any]:
    return {
        "kind": event.kind,
        "key": event.key,
        "value": event.value,
        "version": event.version,
        "position": event.position,
        "initial": event.initial,
    }


async def read_stdin_line() -> Any:
    line = await asyncio.wait_for(asyncio.to_thread(sys.stdin.readline), WAIT_S)
    return json.loads(line)


def open_map(url: str, admin: str, topic: str, name: str = "worker") -> PulsarMap[str, Any]:
    return PulsarMap(
        url,
        topic,
        admin_url=admin,
        name=name,
        write_timeout_s=WAIT_S,
        read_timeout_s=WAIT_S,
        open_timeout_s=WAIT_S,
    )


async def watch(url: str, admin: str, topic: str, sum_keys: str = "") -> None:
    keys = [key for key in sum_keys.split(",") if key]
    async with open_map(url, admin, topic) as shared, shared.changes() as changes:
        emit({"ready": changes.start_position})
        expected_sum = sum(shared.get_local(key, 0) for key in keys)
        checks = 0
        violations: list[dict[str, Any]] = []
        while True:
            event = await changes.next(timeout=WAIT_S)
            assert event is not None
            emit({"event": event_json(event)})
            if keys:
                # The local view always holds whole writes: the sum never moves.
                local_sum = sum(shared.get_local(key, 0) for key in keys)
                checks += 1
                if local_sum != expected_sum:
                    violations.append({"position": shared.position, "sum": local_sum})
            if event.kind == "put" and event.key == "__done__":
                break
        emit({"summary": {"checks": checks, "violations": violations[:20]}})


async def contend(url: str, admin: str, topic: str, name: str, count: str) -> None:
    maps = [open_map(url, admin, topic, f"{name}-{i}") for i in range(int(count))]
    async with contextlib.AsyncExitStack() as stack:
        for shared in maps:
            await stack.enter_async_context(shared)
        emit({"ready": len(maps)})
        await read_stdin_line()
        ids = [f"{name}-{i}" for i in range(len(maps))]
        bound = await asyncio.gather(
            *(shared.put_if_absent("pia", me) for shared, me in zip(maps, ids, strict=True))
        )
        swapped = await asyncio.gather(
            *(shared.replace("cas", None, me) for shared, me in zip(maps, ids, strict=True))
        )
        emit({"ids": ids, "bound": bound, "swapped": swapped})
        # Wait until the test says every contender is done, then read what each map holds.
        await read_stdin_line()
        seen = [[await m.get("pia", latest=True), await m.get("cas")] for m in maps]
        emit({"seen": seen})


async def script(url: str, admin: str, topic: str) -> None:
    async with open_map(url, admin, topic) as shared:
        emit({"ready": shared.position})
        while True:
            call = await read_stdin_line()
            method, args, kwargs = [*call, [], {}][:3]
            if method == "exit":
                return
            if method == "items":  # the local view
                emit({"result": shared.items(), "position": shared.position})
                continue
            result = await getattr(shared, method)(*args, **kwargs)
            emit({"result": result, "position": shared.position})


COMMANDS: dict[str, Callable[..., Coroutine[Any, Any, None]]] = {
    "watch": watch,
    "contend": contend,
    "script": script,
}

if __name__ == "__main__":
    asyncio.run(COMMANDS[sys.argv[1]](*sys.argv[2:]))
    # Skip interpreter teardown: pulsar-client can crash while Python shuts down
    # (apache/pulsar-client-python#153); everything is closed and flushed by now.
    sys.stdout.flush()
    os._exit(0)
