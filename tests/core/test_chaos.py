"""The chaos run (scripts/chaos) for one minute: writer kills, pauses past the takeover time,
broker kills, then exactly-once on every replica, agreeing digests and a linearizable history."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.chaos import FAULT_KINDS, run_chaos
from tests.support.broker import Broker

pytestmark = [pytest.mark.fault, pytest.mark.slow]


def test_one_minute_of_chaos(broker: Broker, tmp_path: Path) -> None:
    assert broker.kind == "standalone", (
        "the chaos run restarts the broker through scripts/pulsar-standalone; "
        f"this session's broker is {broker.kind}"
    )
    summary = run_chaos(1.0, writers=3, run_dir=tmp_path, env=broker.env)
    print(summary.line())
    assert summary.ok, "\n".join([summary.line(), *summary.problems])
    # Each kind comes once among the first three faults, the broker's restart included.
    assert all(summary.faults[kind] >= 1 for kind in FAULT_KINDS), summary.line()
    assert summary.acked_writes > 0
    assert summary.acked_reads > 0
    # Three writers (and any that replaced a killed one) and two fresh replicas reported.
    assert summary.replicas == 5
    assert summary.linearizable == "yes"
