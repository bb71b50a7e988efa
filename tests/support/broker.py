"""The broker for the tests: now :mod:`pulsar_state.testing` (kept for the tests' imports)."""

from __future__ import annotations

from pathlib import Path

from pulsar_state.testing import (
    REGISTRATION_LINES_MAX,
    Broker,
    BrokerUnavailable,
    admin_request,
    provide_broker,
    wait_ready,
)

REPO = Path(__file__).resolve().parents[2]

__all__ = [
    "REGISTRATION_LINES_MAX",
    "REPO",
    "Broker",
    "BrokerUnavailable",
    "admin_request",
    "provide_broker",
    "wait_ready",
]
