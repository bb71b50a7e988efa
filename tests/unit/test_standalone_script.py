"""scripts/pulsar-standalone's own logic, on files (no broker): the count of bookie
registration log lines since the last start, which decides whether a start failed."""

from __future__ import annotations

import gzip
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINE = "INFO Deleted /ledgers/available/127.0.0.1:3181\n"
OTHER = "INFO something else\n"


def registrations(home: Path) -> int:
    result = subprocess.run(
        [str(REPO / "scripts" / "pulsar-standalone"), "registrations"],
        env={**os.environ, "PULSAR_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(result.stdout.strip())


def test_lines_of_earlier_starts_in_a_log_rolled_since_do_not_count(tmp_path: Path) -> None:
    # The log rolled over after this start: the rolled part holds the lines of earlier
    # starts (before the offset recorded at the start) and of this one. Before: all of it
    # counted (194 lines of the day's restarts failed a healthy broker's check).
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "pulsar-standalone.log"
    log.write_text(LINE * 150 + OTHER)  # earlier starts
    (tmp_path / "log-start").write_text(f"{log.stat().st_ino} {log.stat().st_size}\n")
    os.utime(tmp_path / "log-start", (1_000, 1_000))
    with log.open("a") as current:
        current.write(LINE * 3 + OTHER)  # this start, before the rollover
    assert registrations(tmp_path) == 3
    rolled = logs / "pulsar-standalone-3.log.gz"
    rolled.write_bytes(gzip.compress(log.read_bytes()))
    os.utime(rolled, (2_000, 2_000))
    fresh = logs / "pulsar-standalone.log.new"
    fresh.write_text(OTHER + LINE * 2)  # created before the old one goes: another inode
    fresh.replace(log)
    assert registrations(tmp_path) == 5
    second = logs / "pulsar-standalone-4.log.gz"  # a second rollover: counts whole
    second.write_bytes(gzip.compress((LINE * 4).encode()))
    os.utime(second, (3_000, 3_000))
    assert registrations(tmp_path) == 9
