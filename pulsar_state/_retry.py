"""Retrying transient failures until a call's own deadline, then failing with the last cause.

Which failures are transient is decided in one place, ``_pulsar.TRANSIENT``; the errors built
from it carry the answer as ``retriable``. A broker restart thus costs a call the restart's
duration, not the call itself, as long as its deadline allows.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    wait_exponential,
    wait_random,
)

from ._errors import OperationTimeoutError, PulsarStateError

__all__ = ["backoff", "is_transient", "retry_transient"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# From a few milliseconds (a topic being loaded) up to a second (a broker restarting): a
# process started during an outage notices the broker's return within about a second.
# (wait_exponential_jitter's arguments changed between tenacity 8.2 and 9: composed instead.)
_FIRST_WAIT_S, _MAX_WAIT_S, _JITTER_S = 0.05, 1.0, 0.1
backoff = wait_exponential(multiplier=_FIRST_WAIT_S, max=_MAX_WAIT_S) + wait_random(0, _JITTER_S)


def _pause_after_first() -> float:
    """``backoff``'s wait after a first attempt (the fast path's, outside tenacity)."""
    return _FIRST_WAIT_S + random.uniform(0, _JITTER_S)


def is_transient(exc: BaseException) -> bool:
    """True for a library error that may pass by itself (see ``_pulsar.TRANSIENT``)."""
    return isinstance(exc, PulsarStateError) and exc.retriable


async def retry_transient(call: Callable[[], Awaitable[T]], *, deadline: float, what: str) -> T:
    """``await call()``, again after each transient failure, until the loop time ``deadline``.

    A permanent failure is raised at once. At the deadline, the attempt under way is cancelled
    and :class:`OperationTimeoutError` (retriable) names the last transient failure.
    """
    last: list[BaseException] = []
    # The first attempt without the retry machinery (most calls succeed at once: a latest
    # read makes two of them, and tenacity's bookkeeping cost more than the call).
    timeout = asyncio.timeout_at(deadline)
    try:
        async with timeout:
            return await call()
    except Exception as exc:
        if timeout.expired():
            raise OperationTimeoutError(f"{what} did not succeed in time") from exc
        if not is_transient(exc):  # (a retriable time-out of the call's own is retried)
            raise
        logger.info("%s failed (%s); retrying until the deadline", what, exc)
        last.append(exc)

    def remember(state: RetryCallState) -> None:
        failed = state.outcome.exception() if state.outcome is not None else None
        if failed is not None:
            if not last:
                logger.info("%s failed (%s); retrying until the deadline", what, failed)
            last[:] = [failed]

    try:
        async with asyncio.timeout_at(deadline):
            await asyncio.sleep(_pause_after_first())  # as tenacity waits between attempts
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(is_transient),
                wait=backoff,
                before_sleep=remember,
                reraise=True,
            ):
                with attempt:
                    return await call()
    except TimeoutError as exc:
        if isinstance(exc, PulsarStateError):
            raise  # the call's own time-out, already named
        cause = last[0] if last else None
        because = f"; last error: {cause}" if cause is not None else ""
        raise OperationTimeoutError(f"{what} did not succeed in time{because}") from (cause or exc)
    raise AssertionError("unreachable: AsyncRetrying returns or raises")
