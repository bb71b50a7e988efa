"""Handing freed heap memory back to the operating system, where the C library allows it.

A replica replaying records of megabytes allocates and frees a buffer per message (the
client's copy, and Python's ``bytes``). glibc serves buffers of that size from its heap
once one has been freed (its mmap threshold adapts upward), and keeps the freed memory for
reuse, so the process's RSS grows by the history replayed, not by the state kept: a 1M-key
map replayed from 3 MB records peaked 120 MB above its live data. ``malloc_trim(0)`` gives
back every free page. It runs in the caller's thread, without the GIL (ctypes releases it),
but holds each malloc arena's lock while it walks it: a few milliseconds on the heap of a
1M-key replay, about 100 ms on a badly fragmented heap of a gigabyte, during which other
threads' allocations wait. :class:`TrimPolicy` therefore trims only for big messages (the
buffers glibc keeps), and spaces trims by at least 20 times the last one's duration.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

__all__ = ["TrimPolicy", "release_free_memory"]


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system; False where that is not possible."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class TrimPolicy:
    """When a reader thread should call :func:`release_free_memory`: after ``every`` bytes of
    messages of at least ``big`` bytes (smaller buffers come from pools glibc reuses), and no
    sooner than ``min_interval`` seconds, nor than ``spacing`` times the last trim's
    duration, after the previous one (a slow trim stalls other threads' allocations)."""

    def __init__(
        self,
        *,
        big: int = 128 * 1024,
        every: int = 4 * 1024 * 1024,
        min_interval: float = 0.25,
        spacing: float = 20.0,
        trim: Callable[[], bool] = release_free_memory,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._big, self._every = big, every
        self._min_interval, self._spacing = min_interval, spacing
        self._trim, self._clock = trim, clock
        self._counted = 0
        self._next_at = 0.0

    def read(self, size: int) -> None:
        """Note a message of ``size`` bytes just read; trims here when it is time."""
        if size < self._big:
            return
        self._counted += size
        if self._counted < self._every:
            return
        now = self._clock()
        if now < self._next_at:
            return
        self._counted = 0
        self._trim()
        took = self._clock() - now
        self._next_at = now + max(self._min_interval, self._spacing * took)
