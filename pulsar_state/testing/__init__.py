"""Testing against a real Apache Pulsar broker (as ``kazoo.testing`` does for ZooKeeper).

The pytest plugin (:mod:`pulsar_state.testing.plugin`, loaded automatically through the
``pytest11`` entry point once pulsar-state is installed) gives a test suite:

* ``pulsar_broker``: the session's :class:`Broker` (its ``service_url`` and ``admin_url``):
  the one named by ``--pulsar-url`` / ``PULSAR_SERVICE_URL``, else one started in Docker
  (the ``docker`` extra), else one started by ``scripts/pulsar-standalone`` of a pulsar-state
  checkout (``--pulsar-standalone PATH``). With none, tests using it FAIL, never skip.
* ``state_topic``: a fresh topic name for each test.

This module needs no pytest: :func:`provide_broker` works in any script (the benchmarks use it).
"""

from ._broker import (
    DOCKER_IMAGE,
    REGISTRATION_LINES_MAX,
    SETTINGS,
    Broker,
    BrokerUnavailable,
    admin_request,
    broker_settings,
    http_ok,
    is_ready,
    provide_broker,
    standalone_script,
    wait_ready,
)

__all__ = [
    "DOCKER_IMAGE",
    "REGISTRATION_LINES_MAX",
    "SETTINGS",
    "Broker",
    "BrokerUnavailable",
    "admin_request",
    "broker_settings",
    "http_ok",
    "is_ready",
    "provide_broker",
    "standalone_script",
    "unique_topic",
    "wait_ready",
]


def unique_topic(hint: str = "test", namespace: str = "public/default") -> str:
    """A topic name no other test uses: ``persistent://NAMESPACE/HINT-<random>``."""
    import re
    import uuid

    # Topic names allow letters, digits and -_.= ; test ids carry brackets, slashes, colons.
    safe = re.sub(r"[^A-Za-z0-9_.=-]+", "-", hint).strip("-")[:60] or "test"
    return f"persistent://{namespace}/{safe}-{uuid.uuid4().hex[:8]}"
