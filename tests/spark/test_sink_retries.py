"""PulsarMapSink's retries: which failures are tried again, how often, and what is logged."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from pulsar_state import ConfigurationError, PulsarStateError, WriteOutcomeUnknownError
from recipes.spark import SINK_MARKER_PREFIX, MapSpec, PulsarMapSink, close_maps, get_map
from tests.spark.conftest import SPARK_MARKS

pytestmark = SPARK_MARKS


@pytest.fixture(autouse=True)
def _close_cached_maps() -> Iterator[None]:
    # No SparkSession here (whose teardown closes them): close this test's maps itself.
    yield
    close_maps()


def retry_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "pulsar_state.spark" and "retrying" in r.getMessage()
    ]


def test_a_write_that_times_out_is_retried_then_raised(
    spec: MapSpec, caplog: pytest.LogCaptureFixture
) -> None:
    get_map(spec)  # opened (and cached) with the tests' timeouts; the sink reuses it
    # A timeout no write can meet: every attempt fails with a retriable error.
    sink = PulsarMapSink(spec, "timeouts", retries=2, timeout=1e-6)
    with (
        caplog.at_level(logging.WARNING, logger="pulsar_state.spark"),
        pytest.raises(PulsarStateError) as raised,
    ):
        sink.write_rows([("k", 1)], 0)
    assert raised.value.retriable or isinstance(raised.value, WriteOutcomeUnknownError)
    messages = retry_messages(caplog)
    assert len(messages) == 2, messages
    assert messages[0].startswith("sink timeouts batch 0: ")
    assert messages[0].endswith("; retrying (1/2)")
    assert messages[1].endswith("; retrying (2/2)")
    # With time to finish, the batch lands once (a timed-out attempt may have landed it).
    PulsarMapSink(spec, "timeouts").write_rows([("k", 1)], 0)
    assert get_map(spec).get("k", latest=True) == 1
    assert get_map(spec).get(SINK_MARKER_PREFIX + "timeouts") == 0


def test_a_failure_retrying_cannot_fix_is_raised_at_once(
    spec: MapSpec, caplog: pytest.LogCaptureFixture
) -> None:
    m = get_map(spec)
    m.put(SINK_MARKER_PREFIX + "broken", "not a batch id")
    sink = PulsarMapSink(spec, "broken", retries=3)
    with (
        caplog.at_level(logging.WARNING, logger="pulsar_state.spark"),
        pytest.raises(ConfigurationError, match="not a batch id"),
    ):
        sink.write_rows([("k", 1)], 0)
    assert retry_messages(caplog) == []
    assert m.get("k", latest=True) is None
