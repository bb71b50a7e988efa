"""Do processes that use the library exit cleanly? Counts aborts over many short-lived processes.

    scripts/exit-loop [N]            N processes (default 200), 4 at a time
    python -m benchmarks.exit_crashes N --parallel 4 --pulsar-url URL --pulsar-admin-url URL

Each process opens a SharedStateManager and a PulsarMap (each on its own fresh topic), writes,
makes a latest read and then, depending on its mode (taken in turn):

* ``async-close``: closes both (``aclose``) inside ``asyncio.run``;
* ``sync-close``: the blocking facades (SyncSharedStateManager, SyncPulsarMap), closed;
* ``async-unclosed``: returns from ``asyncio.run`` without closing anything;
* ``sync-unclosed``: the blocking facades, never closed (their portal loop still runs at exit);
* ``spark-cache``: a map from the Spark integration's per-process cache, left for its
  ``atexit`` hook to close (no Spark needed);
* ``uvloop-close``, ``uvloop-unclosed``: as ``async-close`` and ``async-unclosed``, on uvloop's
  event loop.

and then exits normally (no ``os._exit``): interpreter shutdown is what is being tested. A
crash there is SIGABRT (``terminate called without an active exception``) or SIGSEGV. Prints
``aborts k/N`` and the exit codes; exits 1 when any process failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import faulthandler
import importlib
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODES = (
    "async-close",
    "sync-close",
    "async-unclosed",
    "sync-unclosed",
    "spark-cache",
    "uvloop-close",
    "uvloop-unclosed",
)
# A child still running after _HANG_S prints its threads' stacks and exits 1 (faulthandler);
# one that cannot even do that is killed at _CHILD_TIMEOUT_S and reported as exit -999.
_HANG_S = int(os.environ.get("EXIT_LOOP_HANG_S", "120"))
_CHILD_TIMEOUT_S = _HANG_S + 30.0


def _apply(state: dict[str, Any], op: dict[str, Any]) -> None:
    state[op["key"]] = op["value"]


def _manager_options(admin_url: str) -> dict[str, Any]:
    return {
        "admin_url": admin_url,
        "open_timeout_s": 60.0,
        "write_timeout_s": 60.0,
        "read_timeout_s": 60.0,
    }


async def _async_child(url: str, admin_url: str, topic: str, *, close: bool) -> None:
    from pulsar_state import SharedStateManager
    from recipes import PulsarMap

    manager: SharedStateManager[dict[str, Any], dict[str, Any]] = SharedStateManager(
        url, f"{topic}-state", initial_state=dict, apply=_apply, **_manager_options(admin_url)
    )
    pmap: PulsarMap[str, Any] = PulsarMap(url, f"{topic}-map", **_manager_options(admin_url))
    await manager.open()
    await pmap.open()
    await manager.write(lambda s: [{"key": "k", "value": 1}])
    await pmap.put("k", "v")
    assert await manager.read(lambda s: s.get("k"), latest=True) == 1
    assert await pmap.get("k", latest=True) == "v"
    if close:
        await pmap.aclose()
        await manager.aclose()


def _sync_child(url: str, admin_url: str, topic: str, *, close: bool) -> None:
    from pulsar_state import SyncSharedStateManager
    from recipes import SyncPulsarMap

    manager: SyncSharedStateManager[dict[str, Any], dict[str, Any]] = SyncSharedStateManager(
        url, f"{topic}-state", initial_state=dict, apply=_apply, **_manager_options(admin_url)
    )
    pmap: SyncPulsarMap[str, Any] = SyncPulsarMap(
        url, f"{topic}-map", **_manager_options(admin_url)
    )
    manager.open()
    pmap.open()
    manager.write(lambda s: [{"key": "k", "value": 1}])
    pmap.put("k", "v")
    assert manager.read(lambda s: s.get("k"), latest=True) == 1
    assert pmap.get("k", latest=True) == "v"
    if close:
        pmap.close()
        manager.close()


def _spark_module() -> Any:
    # The Spark integration is moving from pulsar_state.spark to recipes.spark.
    for name in ("recipes.spark", "pulsar_state.spark"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no Spark integration module found")


def _spark_child(url: str, admin_url: str, topic: str) -> None:
    from pulsar_state import SyncSharedStateManager

    spark = _spark_module()
    # Also a closed manager, so that the process holds two clients.
    with SyncSharedStateManager(
        url, f"{topic}-state", initial_state=dict, apply=_apply, **_manager_options(admin_url)
    ) as manager:
        manager.write(lambda s: [{"key": "k", "value": 1}])
        assert manager.read(lambda s: s.get("k"), latest=True) == 1
    options = {k: v for k, v in _manager_options(admin_url).items() if k != "admin_url"}
    spec = spark.MapSpec(url, f"{topic}-map", admin_url=admin_url, options=options)
    pmap = spark.get_map(spec)
    pmap.put("k", "v")
    assert pmap.get("k", latest=True) == "v"
    # Left open: spark's atexit hook closes it.


def child(mode: str, url: str, admin_url: str, topic: str) -> None:
    faulthandler.dump_traceback_later(_HANG_S, exit=True)
    if mode in ("async-close", "async-unclosed"):
        asyncio.run(_async_child(url, admin_url, topic, close=mode == "async-close"))
    elif mode in ("uvloop-close", "uvloop-unclosed"):
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_async_child(url, admin_url, topic, close=mode == "uvloop-close"))
    elif mode in ("sync-close", "sync-unclosed"):
        _sync_child(url, admin_url, topic, close=mode == "sync-close")
    elif mode == "spark-cache":
        _spark_child(url, admin_url, topic)
    else:
        raise ValueError(f"unknown mode {mode!r}")


def run_one(
    index: int, url: str, admin_url: str, modes: tuple[str, ...] = MODES
) -> tuple[str, int, str]:
    """Run one child process; returns (mode, exit code, stderr tail). A hang counts as -999."""
    mode = modes[index % len(modes)]
    topic = f"persistent://public/default/exit-{uuid.uuid4().hex[:12]}"
    argv = [sys.executable, "-m", "benchmarks.exit_crashes", "--child", mode, url, admin_url, topic]
    try:
        done = subprocess.run(
            argv, cwd=REPO, capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr if isinstance(exc.stderr, str) else (exc.stderr or b"").decode()
        return mode, -999, err[-2000:]
    return mode, done.returncode, done.stderr[-2000:]


def run_many(
    count: int, url: str, admin_url: str, *, parallel: int = 4, modes: tuple[str, ...] = MODES
) -> list[tuple[str, int, str]]:
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda i: run_one(i, url, admin_url, modes), range(count)))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        child(*argv[1:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("count", type=int, nargs="?", default=200)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--pulsar-url", default=os.environ.get("PULSAR_SERVICE_URL"))
    parser.add_argument("--pulsar-admin-url", default=os.environ.get("PULSAR_ADMIN_URL"))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    args = parser.parse_args(argv)
    from pulsar_state.testing import provide_broker

    broker = provide_broker(args.pulsar_url, args.pulsar_admin_url)
    modes = tuple(args.modes.split(","))
    results = run_many(
        args.count, broker.service_url, broker.admin_url, parallel=args.parallel, modes=modes
    )
    failed = [r for r in results if r[1] != 0]
    by_mode = collections.Counter((mode, code) for mode, code, _ in results)
    for (mode, code), n in sorted(by_mode.items()):
        print(f"  {mode:15} exit {code:5}: {n}")
    for mode, code, err in failed[:3]:
        print(f"--- a failed {mode} process (exit {code}), end of its stderr:\n{err[-800:]}")
    print(f"aborts {len(failed)}/{len(results)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
