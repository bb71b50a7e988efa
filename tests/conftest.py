"""Test wiring: one real broker per session, a unique topic per test.

Options (like redis-py's ``--redis-url``):
  --pulsar-url URL          use this broker (or PULSAR_SERVICE_URL)
  --pulsar-admin-url URL    its admin REST URL (or PULSAR_ADMIN_URL; default derived)
  --no-broker-ok            when no broker can be had, deselect broker tests instead of
                            failing. Refused under CI: there a missing broker fails the run.
"""

from __future__ import annotations

import os
import uuid

import pytest

from tests.support.broker import Broker, BrokerUnavailable, provide_broker


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pulsar-state")
    group.addoption("--pulsar-url", default=os.environ.get("PULSAR_SERVICE_URL"))
    group.addoption("--pulsar-admin-url", default=os.environ.get("PULSAR_ADMIN_URL"))
    group.addoption("--no-broker-ok", action="store_true", default=False)


def _needs_broker(item: pytest.Item) -> bool:
    return "broker" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _needs_broker(item):
            item.add_marker(pytest.mark.broker)
    # Fault tests kill the broker: run them last so a slow recovery cannot disturb the rest.
    # Spark tests run first: pulsar-client keeps a few file descriptors of every closed client
    # (epoll/timer/event fds of its I/O threads), and in one long session the count climbs past
    # 1024, where select()-based code in PySpark's py4j bridge and in tests stops working.
    items.sort(
        key=lambda item: (
            item.get_closest_marker("fault") is not None,
            item.get_closest_marker("spark") is None,
        )
    )


_BROKER: Broker | None = None
_BROKER_ERROR: BrokerUnavailable | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if config.getoption("--no-broker-ok") and os.environ.get("CI"):
        raise pytest.UsageError("--no-broker-ok is refused under CI: a missing broker must fail")


@pytest.fixture(scope="session")
def broker(request: pytest.FixtureRequest) -> Broker:
    """The session's real broker; fails the test (never skips) when there is none."""
    global _BROKER, _BROKER_ERROR
    if _BROKER is None and _BROKER_ERROR is None:
        try:
            _BROKER = provide_broker(
                request.config.getoption("--pulsar-url"),
                request.config.getoption("--pulsar-admin-url"),
            )
        except BrokerUnavailable as exc:
            _BROKER_ERROR = exc
    if _BROKER_ERROR is not None:
        if request.config.getoption("--no-broker-ok"):
            pytest.xfail(f"no broker and --no-broker-ok given: {_BROKER_ERROR}")
        pytest.fail(str(_BROKER_ERROR), pytrace=False)
    assert _BROKER is not None
    return _BROKER


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _BROKER is not None:
        _BROKER.stop()


@pytest.fixture
def service_url(broker: Broker) -> str:
    return broker.service_url


@pytest.fixture
def admin_url(broker: Broker) -> str:
    return broker.admin_url


@pytest.fixture
def topic(request: pytest.FixtureRequest) -> str:
    """A fresh topic name for this test."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")[:60]
    return f"persistent://public/default/test-{name}-{uuid.uuid4().hex[:8]}"
