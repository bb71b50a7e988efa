"""Shared pieces for the recipe tests: maps with test timeouts, and worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from recipes import Ownership, PulsarMap

REPO = Path(__file__).resolve().parents[2]
# Every wait in these tests is bounded by this; none of them measures speed.
WAIT_S = 60.0


def new_map(service_url: str, topic: str, admin_url: str, **options: Any) -> PulsarMap[Any, Any]:
    """A PulsarMap (str keys, JSON values unless given) with the tests' timeouts."""
    defaults: dict[str, Any] = {
        "admin_url": admin_url,
        "write_timeout_s": WAIT_S,
        "read_timeout_s": WAIT_S,
        "open_timeout_s": WAIT_S,
    }
    defaults.update(options)
    return PulsarMap(service_url, topic, **defaults)


class Worker:
    """A ``python -m tests.recipes.map_worker`` process speaking JSON lines on stdout."""

    def __init__(self, process: asyncio.subprocess.Process, stderr_path: Path) -> None:
        self.process = process
        self.stderr_path = stderr_path

    def stderr(self) -> str:
        with contextlib.suppress(OSError):
            return self.stderr_path.read_text()[-4000:]
        return ""

    async def read(self, timeout: float = WAIT_S) -> Any:
        """The next JSON line the worker prints."""
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            await asyncio.wait_for(self.process.wait(), timeout)
            raise AssertionError(
                f"worker exited ({self.process.returncode}) without output:\n{self.stderr()}"
            )
        return json.loads(line)

    async def send(self, message: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message).encode() + b"\n")
        await self.process.stdin.drain()

    async def finish(self, timeout: float = WAIT_S) -> None:
        code = await asyncio.wait_for(self.process.wait(), timeout)
        assert code == 0, f"worker failed ({code}):\n{self.stderr()}"


@contextlib.asynccontextmanager
async def worker(
    tmp_path: Path, *args: str, module: str = "tests.recipes.map_worker"
) -> AsyncIterator[Worker]:
    """Start a worker process; it is killed if the test leaves before it finished."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    stderr_path = tmp_path / f"worker-{os.urandom(4).hex()}.log"
    with stderr_path.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            module,
            *args,
            cwd=REPO,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )
    try:
        yield Worker(process, stderr_path)
    finally:
        if process.returncode is None:
            process.kill()
            await asyncio.wait_for(process.wait(), WAIT_S)


def recipe_options(admin_url: str, **options: Any) -> dict[str, Any]:
    """Manager options with the tests' timeouts (for any recipe)."""
    defaults: dict[str, Any] = {
        "admin_url": admin_url,
        "write_timeout_s": WAIT_S,
        "read_timeout_s": WAIT_S,
        "open_timeout_s": WAIT_S,
    }
    defaults.update(options)
    return defaults


def owners(service_url: str, topic: str, admin_url: str, **options: Any) -> Ownership:
    """An Ownership with the tests' timeouts."""
    return Ownership(service_url, topic, **recipe_options(admin_url, **options))
