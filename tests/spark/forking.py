"""Run a function in a forked child (as PySpark's daemon forks its Python workers) and get
what it reports, without the child ever returning into pytest."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.spark.conftest import WAIT_S


def in_forked_child(
    child: Callable[[], dict[str, Any]],
    *,
    around_fork: contextlib.AbstractContextManager[Any] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Fork (inside ``around_fork``, e.g. a lock held across the fork), run ``child()`` in
    the child and return (its pid, its JSON report); fails the test if the child raised,
    gave no answer within WAIT_S or did not exit 0."""
    read_end, write_end = os.pipe()
    with around_fork or contextlib.nullcontext():
        pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        code = 1
        try:
            os.close(read_end)
            os.write(write_end, json.dumps(child()).encode())
            code = 0
        except BaseException as exc:
            os.write(write_end, json.dumps({"error": repr(exc)}).encode())
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        poller = select.poll()  # not select(): descriptors can be above 1024 in a long session
        poller.register(read_end, select.POLLIN)
        if not poller.poll(WAIT_S * 1000):
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the forked child gave no answer in {WAIT_S}s")
        report: dict[str, Any] = json.loads(os.read(read_end, 65536) or b"{}")
    finally:
        os.close(read_end)
        code = _reap(pid)
    assert "error" not in report, report
    assert code == 0, report
    return pid, report


def _reap(pid: int) -> int:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child did not exit")
