"""The client wrappers' own logic, pure: stand-ins for the C++ reader and client (no broker)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pulsar.exceptions
import pytest

from pulsar_state import _pulsar
from pulsar_state._pulsar import (
    LogPosition,
    PulsarConnection,
    RawMessage,
    ReopeningReader,
    StallLimit,
    StateReader,
)


class _FailingReader:
    """Times out until ``fail`` is set, then fails as a reader of a closed client does."""

    def __init__(self) -> None:
        self.fail = threading.Event()

    def read_next(self, timeout_ms: int) -> Any:
        if self.fail.is_set():
            raise pulsar.exceptions.AlreadyClosed("client closed")
        time.sleep(timeout_ms / 1000)
        raise pulsar.exceptions.Timeout("nothing")


def test_a_read_failing_after_the_event_loop_closed_ends_the_thread_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A manager left open when asyncio.run returned, its client then closed by its owner:
    # before, the thread died with "RuntimeError: Event loop is closed" on stderr (review
    # 45d F5).
    uncaught: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: uncaught.append(args.exc_value))
    cpp = _FailingReader()

    class _Reader:
        _reader = cpp

    async def open_reader() -> StateReader:
        return StateReader(_Reader(), "persistent://public/default/t")

    reader = asyncio.run(open_reader())  # its loop is closed now
    cpp.fail.set()
    reader._thread.join(10)
    assert not reader._thread.is_alive()
    assert uncaught == []


class _Producer:
    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class _Client:
    def __init__(self) -> None:
        self.creation: asyncio.Future[_Producer] | None = None

    def create_producer(self, topic: str, **options: Any) -> asyncio.Future[_Producer]:
        self.creation = asyncio.get_running_loop().create_future()
        return self.creation


async def test_a_writer_cancelled_as_its_producer_is_created_is_cancelled_and_closed() -> None:
    # Python 3.11's wait_for returns the result when it is cancelled in the loop turn the
    # awaited creation completes: the cancellation (a closing manager's) was swallowed and a
    # producer taken after the close began (review 45d F4).
    connection = PulsarConnection.__new__(PulsarConnection)
    connection._pid = os.getpid()
    client = connection._client = _Client()
    task = asyncio.ensure_future(
        connection.create_writer("persistent://public/default/t", fencing=False, send_timeout_s=5)
    )
    for _ in range(3):  # the creation is asked for, then awaited
        await asyncio.sleep(0)
    assert client.creation is not None
    producer = _Producer()
    client.creation.set_result(producer)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(10):  # the orphan's close is a task of its own
        await asyncio.sleep(0)
    assert producer.closed


class _SlowFirstMessage:
    """A reader whose first message comes ``latency`` seconds after it subscribed."""

    def __init__(self, latency: float) -> None:
        self.latency = latency

    async def read_next(self) -> RawMessage:
        await asyncio.sleep(self.latency)
        return RawMessage(b"chunk", LogPosition(5, 0))

    async def close(self) -> None:
        pass


class _Connection:
    def __init__(self) -> None:
        self.readers = 0

    async def create_reader(self, topic: str, **options: Any) -> _SlowFirstMessage:
        self.readers += 1
        return _SlowFirstMessage(0.3)


async def test_a_reader_whose_first_message_is_slow_is_given_longer_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A first message slower than the stall limit (a cold or offloaded ledger, a big chunk):
    # before, every replacement started the same slow read and was replaced in turn, until the
    # caller's deadline (15 readers in 3 s, nothing read; review 45d F3). Time scaled down.
    monkeypatch.setattr(_pulsar, "READER_STALL_S", 0.2)
    connection = _Connection()
    reader = ReopeningReader(connection, "persistent://public/default/t")  # type: ignore[arg-type]
    async with asyncio.timeout(3.0):
        message = await reader.read_next()
    await reader.close()
    assert message.position == LogPosition(5, 0)
    assert reader.reopened == 1  # the second reader had 0.4 s
    # The limit doubles while replacements bring nothing, and is back once a message was read
    # since, by whoever read it (a replica's pump, between two watched waits: the review of
    # this fix found it stuck at the maximum after an outage).
    limit = StallLimit()
    assert limit.seconds(read=7) == 0.2
    for _ in range(20):
        limit.replaced(read=7)
    assert limit.seconds(read=7) == _pulsar.READER_STALL_MAX_S
    assert limit.seconds(read=8) == 0.2
    limit.replaced(read=8)
    assert limit.seconds(read=8) == 0.4


_FORKED_CHILD = """
import logging, os, threading, time
import pulsar_state._pulsar as P
logging.getLogger("pulsar_state.client").disabled = True  # (the lines below are filler)
P.PulsarConnection("pulsar://127.0.0.1:1", operation_timeout_s=1)
first_logger = P._log_pipe.path  # where the C++ client logs, for good
parent = os.getpid()
if os.fork():
    os._exit(0)  # the parent goes at once
while os.getppid() == parent:
    time.sleep(0.05)
P.PulsarConnection("pulsar://127.0.0.1:1", operation_timeout_s=1)
done = threading.Event()

def log_a_lot():  # as the C++ client does, into the logger of the first client (the parent's)
    with open(first_logger, "w") as log:
        log.write(("x" * 99 + "\\n") * 30_000)
    done.set()

threading.Thread(target=log_a_lot, daemon=True).start()
print("drained" if done.wait(20) else "blocked", flush=True)
os._exit(0)
"""


def test_a_forked_child_outliving_its_parent_drains_the_client_log_pipe() -> None:
    # The C++ client keeps the first client's logger: a forked child's clients log into the
    # parent's pipe. Once the parent was gone nobody read it, and when it filled (3 MB here;
    # 17 min of an outage's warnings) every client thread that logs blocked (review 45d F1).
    # No broker: the clients point at a closed port and are never used.
    out = subprocess.run(
        [sys.executable, "-c", _FORKED_CHILD], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "drained", out.stdout + out.stderr[-2000:]
