"""The lock benchmark's harness (benchmarks/locks.py) still runs: the library only, a few
rounds, so the script does not rot. The peers (ZooKeeper, etcd) are not started here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import locks
from pulsar_state.testing import Broker


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [1, 2])
def test_library_rounds_through_the_cli(broker: Broker, tmp_path: Path, blocks: int) -> None:
    # blocks 1: one system after another; 2: in turns (the rounds split between the blocks).
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"mode": "quick", "metrics": ["kept"]}))
    code = locks.main(
        [
            "--only",
            "library",
            "--uncontended",
            "5",
            "--handovers",
            "3",
            "--pulsar-url",
            broker.service_url,
            "--pulsar-admin-url",
            broker.admin_url,
            "--out",
            str(out),
            "--blocks",
            str(blocks),
            "--after-idle",
            "2",
        ]
    )
    assert code == 0
    document = json.loads(out.read_text())
    assert document["metrics"] == ["kept"]  # run.py's section is left alone
    assert document["locks"]["blocks"] == blocks
    # The library's workers on asyncio's loop, then on uvloop's (the test extra installs it).
    systems = {system["system"]: system for system in document["locks"]["systems"]}
    assert list(systems) == ["library", locks.UVLOOP_LABEL], document["locks"]["skipped"]
    library, on_uvloop = systems.values()
    assert on_uvloop["uncontended_rounds"] == 5
    assert library["uncontended_rounds"] == 5
    assert library["handover_rounds"] == 3
    # A handover is measured from the holder's release to the waiter's grant: never negative,
    # and it includes at least the release record's round trip.
    assert 0 < library["handover_p50_ms"] <= library["handover_p99_ms"]
    assert 0 < library["uncontended_p50_ms"] <= library["uncontended_p99_ms"]
    # Each round after 0.5-1.5 s of nothing (a lock taken now and then).
    assert library["after_idle_rounds"] == 2
    assert library["after_idle_p50_ms"] > 0
    # The raw client's floors, measured in the same run on the same broker.
    floor = document["locks"]["floor"]
    assert set(floor) == {
        "pulsar_two_sends_p50_ms",
        "pulsar_handover_p50_ms",
        "python_op_us",
        "python_op_after_idle_us",
    }
    assert all(value > 0 for value in floor.values())
    # No peer measured: the metrics say so instead of claiming the target.
    found = document["locks"]["metrics"]
    assert all(not m["met"] and m["note"] == "no peer measured" for m in found)
    names = [m["name"] for m in found]
    assert "lock acquire+release after 0.5-1.5 s idle p50" in names
    assert names[-1] == "lock acquire+release after 0.5-1.5 s idle p50 (uvloop)"


def result(system: str, p50: float) -> locks.SystemResult:
    return locks.SystemResult(system, p50, p50 * 2, p50 * 10, p50 * 20, 10, 10)


def test_metrics_compare_with_the_faster_peer() -> None:
    found = locks.metrics(
        [result("library", 3.0), result("zookeeper", 2.0), result("etcd", 4.0)],
        {},
    )
    uncontended = found[0]
    assert uncontended.name == "lock acquire+release uncontended p50"
    assert uncontended.baseline == 2.0
    assert uncontended.note == "baseline: the faster peer (zookeeper)"
    assert not uncontended.met
    assert uncontended.details["etcd"] == 4.0
    assert len(found) == 6  # no after-idle rounds measured: no such figure


def test_metrics_with_a_skipped_peer_and_library_variants() -> None:
    found = locks.metrics(
        [result("library", 3.0), result("library idle_release_s=0.01", 1.0), result("etcd", 4.0)],
        {"zookeeper": "no ZooKeeper"},
    )
    assert [m.baseline for m in found][:1] == [4.0]  # a library variant is no peer
    assert found[0].met
    assert found[0].details["zookeeper skipped"] == "no ZooKeeper"


def test_metrics_of_the_library_on_uvloop_follow_those_on_asyncio() -> None:
    found = locks.metrics(
        [result("library", 3.0), result(locks.UVLOOP_LABEL, 1.0), result("zookeeper", 2.0)],
        {},
    )
    assert len(found) == 12
    on_uvloop = found[6]
    assert on_uvloop.name == "lock acquire+release uncontended p50 (uvloop)"
    assert (on_uvloop.library, on_uvloop.baseline, on_uvloop.met) == (1.0, 2.0, True)
    assert not found[0].met  # asyncio's: 3.0 against 2.0


def test_rounds_are_shared_out_between_the_blocks() -> None:
    rounds = locks.Rounds(500, 203, 7, warmup=99)
    shares = [rounds.share(10, block) for block in range(10)]
    assert sum(s.uncontended for s in shares) == 500
    assert sum(s.handovers for s in shares) == 203
    assert [s.after_idle for s in shares] == [1] * 7 + [0] * 3
    assert all(s.warmup == 0 for s in shares)  # warmed up once, before the blocks
