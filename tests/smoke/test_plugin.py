"""pulsar_state.testing's pytest plugin, as a user's suite sees it: run in a fresh pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pulsar_state.testing import Broker

USER_SUITE = """
from pulsar_state import SyncSharedStateManager

SEEN = set()

def test_uses_the_broker(pulsar_broker, state_topic):
    assert state_topic.startswith("persistent://public/default/test-test_uses_the_broker-")
    assert state_topic not in SEEN
    SEEN.add(state_topic)
    with SyncSharedStateManager(
        pulsar_broker.service_url,
        state_topic,
        admin_url=pulsar_broker.admin_url,
        initial_state=dict,
        apply=lambda state, op: {**state, **op},
    ) as manager:
        manager.write(lambda state: [{"hello": "world"}])
        assert manager.read(lambda state: state["hello"], latest=True) == "world"

def test_topics_differ(state_topic):
    assert state_topic not in SEEN

# The README's example, as written there.
from recipes import SyncPulsarMap

def test_counts_visits(pulsar_broker, state_topic):
    with SyncPulsarMap(
        pulsar_broker.service_url, state_topic, admin_url=pulsar_broker.admin_url
    ) as visits:
        visits.update("home", lambda key, hits: (hits or 0) + 1)
        assert visits.get("home", latest=True) == 1
"""


def run_user_suite(
    tmp_path: Path, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_user.py").write_text(USER_SUITE)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_user_suite_gets_broker_and_topics(broker: Broker, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PULSAR_SERVICE")}
    result = run_user_suite(
        tmp_path,
        "--pulsar-url",
        broker.service_url,
        "--pulsar-admin-url",
        broker.admin_url,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


def test_missing_broker_fails_never_skips(tmp_path: Path) -> None:
    # No URL, and a standalone script that is not there (as for an installed package): the
    # test needing the broker errors with the reason; the one that does not still passes.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PULSAR_SERVICE_URL", "PULSAR_ADMIN_URL", "PULSAR_STANDALONE_SCRIPT")
    }
    env["DOCKER_HOST"] = "unix:///nonexistent/docker.sock"  # no Docker engine either
    result = run_user_suite(
        tmp_path, "--pulsar-standalone", str(tmp_path / "no-such-script"), env=env
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 passed, 2 errors" in result.stdout  # a fixture failing is an error, not a skip
    assert "no executable pulsar-standalone script" in result.stdout
    assert "skipped" not in result.stdout

    ci = run_user_suite(tmp_path, "--no-broker-ok", env={**env, "CI": "true"})
    assert ci.returncode != 0
    assert "--no-broker-ok is refused under CI" in ci.stdout + ci.stderr
