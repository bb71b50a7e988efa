"""The one table of transport failures: Pulsar results become our errors, with ``retriable``."""

from __future__ import annotations

import pulsar
import pulsar.asyncio as pulsar_asyncio

from pulsar_state import BrokerError, BrokerUnavailableError
from pulsar_state._pulsar import TRANSIENT, result_name, translate


def test_a_disconnect_the_binding_cannot_name_is_transient() -> None:
    # A broker SIGKILLed under a get_last_message_id: the C++ client answers ResultDisconnected
    # (46), which pulsar-client 3.x's Python enum does not name ("46 ???"). It was taken for a
    # permanent BrokerError, so a linearizable read gave up at once during a broker restart.
    disconnected = pulsar.Result(46)
    error = translate(pulsar_asyncio.PulsarException(disconnected), "get the last message id")
    assert isinstance(error, BrokerUnavailableError)
    assert error.retriable
    assert result_name(disconnected) == "Disconnected"


def test_a_result_nobody_can_name_is_permanent_and_says_its_number() -> None:
    unknown = pulsar.Result(99)
    error = translate(pulsar_asyncio.PulsarException(unknown), "send")
    assert isinstance(error, BrokerError)
    assert not error.retriable
    assert result_name(unknown) == "Result 99"


def test_named_results_keep_their_classification() -> None:
    for name, transient in [("ConnectError", True), ("AuthorizationError", False)]:
        error = translate(pulsar_asyncio.PulsarException(getattr(pulsar.Result, name)), "x")
        assert isinstance(error, BrokerError)
        assert error.retriable is transient is TRANSIENT[name]
