"""pulsar_state.metrics: scrape each process's /metrics during a multi-process run."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.broker import REPO, Broker

WRITERS = 3
WRITES_EACH = 40

# Each process: a manager with its exporter; it prints its port, writes, waits until it has
# applied every process's writes, says so, then holds still until told to end (stdin closes).
WORKER = """
import asyncio, sys
from pulsar_state.metrics import ManagerCollector, start_http_server
from tests.core.helpers import counter_manager, incr

async def main(url, admin, topic, writes, total):
    async with counter_manager(url, topic, admin) as manager:
        collector = ManagerCollector()
        collector.add(manager)
        server, _ = start_http_server(0, collector)
        print(server.server_port, flush=True)
        sys.stdin.readline()  # go
        await asyncio.gather(*(manager.write(lambda s: [incr()]) for _ in range(writes)))
        # Writes share records (group commit): wait for the count, not a position.
        while await manager.read(lambda s: s["count"], latest=True) < total:
            await asyncio.sleep(0.05)
        print("applied", flush=True)
        await asyncio.to_thread(sys.stdin.read)

url, admin, topic, writes, total = sys.argv[1:]
asyncio.run(main(url, admin, topic, int(writes), int(total)))
"""


def scrape(port: int) -> dict[str, float]:
    """Each sample's value by name (one manager per process, so one sample per name)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


@pytest.mark.slow
def test_counters_add_up_across_processes(broker: Broker, topic: str) -> None:
    total = WRITERS * WRITES_EACH
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", WORKER, broker.service_url, broker.admin_url, topic]
    procs = [
        subprocess.Popen(
            [*argv, str(WRITES_EACH), str(total)],
            env=env,
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(WRITERS)
    ]
    try:
        ports = []
        for proc in procs:
            assert proc.stdout is not None
            ports.append(int(proc.stdout.readline()))
        before = [scrape(port) for port in ports]
        assert all(sample["pulsar_state_writes_committed_total"] == 0 for sample in before)
        assert all(sample["pulsar_state_halted"] == 0 for sample in before)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "applied"
        after = [scrape(port) for port in ports]
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs:
            assert proc.wait(timeout=60) == 0

    # Every write committed exactly once, by its own process; every replica is at the same
    # position (records accepted; group commit puts many writes in one record).
    assert sum(sample["pulsar_state_writes_committed_total"] for sample in after) == total
    positions = {sample["pulsar_state_position"] for sample in after}
    assert len(positions) == 1
    assert 1 <= positions.pop() <= total
    # Each record read was applied or rejected (nothing corrupt to skip); records are shared
    # by group commit, so the records sent add up to the records applied.
    for sample in after:
        applied = (
            sample["pulsar_state_records_read_total"]
            - sample["pulsar_state_records_rejected_total"]
        )
        assert sample["pulsar_state_records_skipped_total"] == 0
        assert sample["pulsar_state_halted"] == 0
        assert (
            applied
            == after[0]["pulsar_state_records_read_total"]
            - after[0]["pulsar_state_records_rejected_total"]
        )
    # Every write's outcome timed once, every applied record's apply too; the latest reads
    # captured the tail, so the lag gauges have values (and none is negative).
    assert sum(sample["pulsar_state_write_duration_seconds_count"] for sample in after) == total
    for sample in after:
        applied = (
            sample["pulsar_state_records_read_total"]
            - sample["pulsar_state_records_rejected_total"]
        )
        assert sample["pulsar_state_apply_duration_seconds_count"] == applied
        assert sample["pulsar_state_tail_lag_records"] >= 0
        assert sample["pulsar_state_replay_progress"] == 1.0
        assert sample["pulsar_state_tail_lag_duration_seconds"] >= 0
        assert "pulsar_state_writes_failed_total" not in sample  # nothing failed
    sent = sum(sample["pulsar_state_records_sent_total"] for sample in after)
    rejected_max = max(sample["pulsar_state_records_rejected_total"] for sample in after)
    assert sent - rejected_max == after[0]["pulsar_state_records_read_total"] - rejected_max
    # Counters only grow.
    for old, new in zip(before, after, strict=True):
        for name, value in old.items():
            if name.endswith("_total"):
                assert new[name] >= value, name
