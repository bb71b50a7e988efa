"""Several OS processes on one topic: exactness, crashes, broker restarts, linearizability."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.core.helpers import counter_manager
from tests.support.broker import REPO, Broker
from tests.support.linearizability import RegisterModel, check, load_history

pytestmark = pytest.mark.slow


class Workers:
    def __init__(self, broker: Broker, topic: str, tmp_path: Path) -> None:
        self.broker, self.topic, self.tmp_path = broker, topic, tmp_path
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, mode: str, name: str, **options: Any) -> Path:
        out = self.tmp_path / f"{name}.jsonl"
        argv = [sys.executable, "-m", "tests.core.workers", mode, "--name", name]
        argv += ["--url", self.broker.service_url, "--admin", self.broker.admin_url]
        argv += ["--topic", self.topic, "--out", str(out)]
        for option, value in options.items():
            argv += [f"--{option}"] if value is True else [f"--{option}", str(value)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        log = open(self.tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=log)
        return out

    def events(self, name: str) -> list[dict[str, Any]]:
        path = self.tmp_path / f"{name}.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait_for_acks(self, name: str, acks: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while sum(e["event"] == "ack" for e in self.events(name)) < acks:
            assert self.procs[name].poll() is None, self.log(name)
            assert time.monotonic() < deadline, f"{name}: fewer than {acks} acks in {timeout}s"
            time.sleep(0.05)

    def join(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            if proc.returncode is not None and proc.returncode < 0:
                continue  # killed on purpose
            remaining = max(1.0, deadline - time.monotonic())
            try:
                proc.wait(remaining)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError(f"{name} did not finish:\n{self.log(name)}") from None
            assert proc.returncode == 0, f"{name} failed:\n{self.log(name)}"

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text()[-4000:]

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def workers(broker: Broker, topic: str, tmp_path: Path) -> Iterator[Workers]:
    group = Workers(broker, topic, tmp_path)
    yield group
    group.kill_all()


async def final_state(broker: Broker, topic: str) -> dict[str, Any]:
    async with counter_manager(broker.service_url, topic, broker.admin_url) as fresh:
        return dict(await fresh.read(lambda s: s, latest=True))


def acked_ids(workers: Workers, name: str) -> set[str]:
    return {e["id"] for e in workers.events(name) if e["event"] == "ack"}


def invoked_ids(workers: Workers, name: str) -> set[str]:
    return {e["id"] for e in workers.events(name) if e["event"] == "invoke"}


async def test_four_processes_increment_exactly(
    workers: Workers, broker: Broker, topic: str
) -> None:
    names = [f"p{i}" for i in range(4)]
    for name in names:
        workers.start("incr", name, count=200, expect=800)
    workers.join()
    for name in names:
        final = workers.events(name)[-1]
        assert final["event"] == "final"
        assert final == {**final, "count": 800, "distinct": 800, "max_applied": 1}
    state = await final_state(broker, topic)
    assert state["count"] == 800
    assert set(state["seen"].values()) == {1}


async def test_writer_sigkilled_midway_loses_and_doubles_nothing(
    workers: Workers, broker: Broker, topic: str
) -> None:
    names = ["a", "b", "c", "victim"]
    for name in names:
        workers.start("incr", name, count=200)
    workers.wait_for_acks("victim", 50)
    workers.procs["victim"].send_signal(signal.SIGKILL)
    workers.procs["victim"].wait()
    workers.join()
    state = await final_state(broker, topic)
    acked = set().union(*(acked_ids(workers, n) for n in names))
    invoked = set().union(*(invoked_ids(workers, n) for n in names))
    assert set(state["seen"].values()) == {1}, "an increment was applied twice"
    assert acked <= set(state["seen"]), "an acknowledged increment was lost"
    assert set(state["seen"]) <= invoked
    assert state["count"] == len(state["seen"])
    # Only the victim's last in-flight increment may have landed without an acknowledgement.
    assert len(state["seen"]) - len(acked) in (0, 1)
    assert all(len(acked_ids(workers, n)) == 200 for n in ("a", "b", "c"))


async def test_paused_writer_is_fenced_and_its_writes_land_exactly_once(
    workers: Workers, broker: Broker, topic: str
) -> None:
    """A zombie: a writer frozen (SIGSTOP) while holding the writer, taken over, resumed."""
    workers.start("incr", "zombie", count=150, hold=True)
    workers.wait_for_acks("zombie", 20)
    workers.procs["zombie"].send_signal(signal.SIGSTOP)
    try:
        for name in ("a", "b"):
            workers.start("incr", name, count=100, takeover=1.0)
        workers.wait_for_acks("a", 30)  # they got the writer from the frozen holder
        workers.wait_for_acks("b", 30)
    finally:
        workers.procs["zombie"].send_signal(signal.SIGCONT)
    workers.join()
    state = await final_state(broker, topic)
    acked = set().union(*(acked_ids(workers, n) for n in ("zombie", "a", "b")))
    assert len(acked) == 350
    assert state["count"] == 350
    assert set(state["seen"]) == acked
    assert set(state["seen"].values()) == {1}, "a write of the zombie landed twice"


@pytest.mark.fault
async def test_broker_sigkill_and_restart_during_writes(
    workers: Workers, broker: Broker, topic: str
) -> None:
    names = ["a", "b", "c"]
    for name in names:
        workers.start("incr", name, count=150, expect=450)
    workers.wait_for_acks("a", 30)
    seconds = broker.restart_after_kill()
    print(f"broker back {seconds:.1f}s after SIGKILL")
    workers.join(timeout=400)
    for name in names:
        final = workers.events(name)[-1]
        assert final == {**final, "event": "final", "count": 450, "distinct": 450}
    state = await final_state(broker, topic)
    acked = set().union(*(acked_ids(workers, n) for n in names))
    assert len(acked) == 450
    assert state["count"] == 450
    assert set(state["seen"].values()) == {1}


async def test_concurrent_history_is_linearizable(
    workers: Workers, broker: Broker, topic: str, tmp_path: Path
) -> None:
    paths = [
        workers.start("registers", name, count=120, keys=3, seed=seed)
        for seed, name in enumerate(["a", "b", "c"])
    ]
    workers.join()
    history = load_history(paths)
    assert len(history) == 360
    assert any(op.op == "cas" and op.result is True for op in history)
    result = check(history, RegisterModel(), timeout_s=120)
    assert not result.timed_out
    assert result.ok, result.explanation
