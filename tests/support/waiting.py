"""Waiting in tests for something another task or process makes true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], object], what: str, seconds: float = 10.0) -> None:
    """Poll ``condition`` every 10 ms; AssertionError naming ``what`` after ``seconds``."""
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {seconds}s: {what}")
