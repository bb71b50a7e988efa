"""retry_transient, pure: the first attempt (a fast path without the retry machinery) and
the retries after it keep one contract."""

from __future__ import annotations

import asyncio

import pytest

from pulsar_state import BrokerUnavailableError, ConfigurationError, OperationTimeoutError
from pulsar_state._retry import retry_transient


class Calls:
    def __init__(self, *outcomes: object) -> None:
        self.outcomes = list(outcomes)
        self.count = 0

    async def __call__(self) -> object:
        self.count += 1
        outcome = self.outcomes.pop(0) if self.outcomes else self.outcomes_exhausted()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def outcomes_exhausted(self) -> object:
        return BrokerUnavailableError("still down")


def deadline_in(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def test_a_first_success_is_returned_with_one_call() -> None:
    call = Calls("tail")
    assert await retry_transient(call, deadline=deadline_in(5), what="x") == "tail"
    assert call.count == 1


async def test_transient_failures_are_retried_until_a_success() -> None:
    call = Calls(BrokerUnavailableError("down"), BrokerUnavailableError("down"), "tail")
    assert await retry_transient(call, deadline=deadline_in(10), what="x") == "tail"
    assert call.count == 3


@pytest.mark.parametrize("failures", [0, 1])
async def test_a_permanent_failure_is_raised_at_once(failures: int) -> None:
    call = Calls(*[BrokerUnavailableError("down")] * failures, ConfigurationError("bad"))
    with pytest.raises(ConfigurationError, match="bad"):
        await retry_transient(call, deadline=deadline_in(10), what="x")
    assert call.count == failures + 1


async def test_at_the_deadline_the_last_transient_cause_is_named() -> None:
    call = Calls()  # always transiently down
    with pytest.raises(OperationTimeoutError, match=r"capturing the tail.*still down"):
        await retry_transient(call, deadline=deadline_in(0.5), what="capturing the tail")
    assert call.count >= 2


async def test_a_first_attempt_that_hangs_past_the_deadline_times_out() -> None:
    async def hang() -> None:
        await asyncio.sleep(60)

    with pytest.raises(OperationTimeoutError, match="did not succeed in time"):
        await retry_transient(hang, deadline=deadline_in(0.2), what="x")


async def test_a_retriable_time_out_of_the_first_attempt_is_retried() -> None:
    call = Calls(OperationTimeoutError("the broker did not answer in 10 s"), "tail")
    assert await retry_transient(call, deadline=deadline_in(10), what="x") == "tail"
    assert call.count == 2


async def test_the_second_attempt_waits_the_backoff() -> None:
    times: list[float] = []

    async def flaky() -> str:
        times.append(asyncio.get_running_loop().time())
        if len(times) == 1:
            raise BrokerUnavailableError("down")
        return "tail"

    assert await retry_transient(flaky, deadline=deadline_in(10), what="x") == "tail"
    assert times[1] - times[0] >= 0.05  # not at once: a broker restarting gets a moment
