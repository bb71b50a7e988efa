"""The pytest plugin of :mod:`pulsar_state.testing`: ``pulsar_broker`` and ``state_topic``.

Options (like redis-py's ``--redis-url``):
  --pulsar-url URL          use this broker (or PULSAR_SERVICE_URL)
  --pulsar-admin-url URL    its admin REST URL (or PULSAR_ADMIN_URL; default derived)
  --pulsar-standalone PATH  scripts/pulsar-standalone of a pulsar-state checkout, to start a
                            broker without Docker (or PULSAR_STANDALONE_SCRIPT)
  --no-broker-ok            when no broker can be had, report the tests that need one as
                            xfail instead of failing them. Refused under CI (CI set): there a
                            missing broker fails the run.
"""

from __future__ import annotations

import os

import pytest

from ._broker import Broker, BrokerUnavailable, provide_broker

__all__ = ["pulsar_broker", "state_topic"]

# The session's broker, or why there is none: found once, on first use.
_BROKER_KEY = pytest.StashKey[Broker]()
_ERROR_KEY = pytest.StashKey[BrokerUnavailable]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pulsar-state", "pulsar-state: the Apache Pulsar broker for tests")
    group.addoption(
        "--pulsar-url",
        default=os.environ.get("PULSAR_SERVICE_URL"),
        help="service URL of a running broker (default: PULSAR_SERVICE_URL)",
    )
    group.addoption(
        "--pulsar-admin-url",
        default=os.environ.get("PULSAR_ADMIN_URL"),
        help="its admin REST URL (default: PULSAR_ADMIN_URL, else derived from the service URL)",
    )
    group.addoption(
        "--pulsar-standalone",
        default=os.environ.get("PULSAR_STANDALONE_SCRIPT"),
        help="scripts/pulsar-standalone of a pulsar-state checkout, to start a broker "
        "without Docker (default: PULSAR_STANDALONE_SCRIPT, else the checkout's own)",
    )
    group.addoption(
        "--no-broker-ok",
        action="store_true",
        default=False,
        help="with no broker, xfail the tests needing one instead of failing (refused under CI)",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.getoption("--no-broker-ok") and os.environ.get("CI"):
        raise pytest.UsageError("--no-broker-ok is refused under CI: a missing broker must fail")


@pytest.fixture(scope="session")
def pulsar_broker(request: pytest.FixtureRequest) -> Broker:
    """The session's real broker; fails the test (never skips) when there is none."""
    config = request.config
    stash = config.stash
    if _BROKER_KEY not in stash and _ERROR_KEY not in stash:
        try:
            stash[_BROKER_KEY] = provide_broker(
                config.getoption("--pulsar-url"),
                config.getoption("--pulsar-admin-url"),
                standalone=config.getoption("--pulsar-standalone"),
            )
        except BrokerUnavailable as exc:
            stash[_ERROR_KEY] = exc
    if _ERROR_KEY in stash:
        if config.getoption("--no-broker-ok"):
            pytest.xfail(f"no broker and --no-broker-ok given: {stash[_ERROR_KEY]}")
        pytest.fail(str(stash[_ERROR_KEY]), pytrace=False)
    return stash[_BROKER_KEY]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    broker = session.config.stash.get(_BROKER_KEY, None)
    if broker is not None:
        broker.stop()  # only a broker this session started


@pytest.fixture
def state_topic(request: pytest.FixtureRequest) -> str:
    """A fresh topic name for this test (``persistent://public/default/test-<test>-<random>``)."""
    from . import unique_topic

    return unique_topic(f"test-{request.node.name}")
