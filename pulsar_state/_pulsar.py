"""The only module that imports ``pulsar``: client, exclusive writer, log reader, error mapping.

Everything Pulsar-specific the rest of the library needs is here, so that a client upgrade or
a behaviour change (exception classes, defaults) is handled in one place.

Clean exits: the C++ client aborts the process (``terminate called without an active
exception``) or crashes if the interpreter exits while the client's threads still run or call
into Python. Hence (each measured with ``scripts/exit-loop``): the client is closed with its
blocking ``close()``, which joins its threads, on a thread of its own (never the event loop,
and never the default executor, which is already shut down when ``atexit`` hooks run); clients
still open at exit are closed by an ``atexit`` hook; and the client logs through a C++ logger
into a pipe that a Python thread forwards to the ``pulsar_state.client`` logger, instead of a
Python logger that the C++ threads would call (apache/pulsar-client-python#256).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import itertools
import logging
import os
import queue
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import _pulsar
import pulsar
import pulsar.asyncio as pulsar_asyncio
import pulsar.exceptions as pulsar_exceptions

from ._errors import (
    BrokerError,
    BrokerUnavailableError,
    ClosedError,
    ConfigurationError,
    FencedError,
    OperationTimeoutError,
    PulsarStateError,
    RecordTooLargeError,
    TopicError,
    WriterBusyError,
)
from ._memory import TrimPolicy, release_free_memory

if sys.platform == "linux":
    import fcntl

__all__ = [
    "LogPosition",
    "PulsarConnection",
    "READER_STALL_MAX_S",
    "READER_STALL_S",
    "RawMessage",
    "RelayChannel",
    "ReopeningReader",
    "StallLimit",
    "StateReader",
    "StateWriter",
    "TAIL_SUBSCRIPTION",
    "TRANSIENT",
    "TailProbe",
    "client_authentication",
    "http_cause",
    "is_transient_cause",
    "read_log",
    "translate_errors",
]

logger = logging.getLogger("pulsar_state")

T = TypeVar("T")

# Closing never waits longer than this on an unresponsive broker.
_CLOSE_TIMEOUT_S = 10.0

# Results that mean "someone else holds the exclusive writer" when creating a producer.
_HELD = {pulsar.Result.ProducerFenced, pulsar.Result.ProducerBusy}
_UNAVAILABLE = {
    pulsar.Result.ConnectError,
    pulsar.Result.ServiceUnitNotReady,
    pulsar.Result.LookupError,
    pulsar.Result.BrokerMetadataError,
    pulsar.Result.BrokerPersistenceError,
    pulsar.Result.TooManyLookupRequestException,
    pulsar.Result.NotConnected,
}

# The one classification of transport failures, Pulsar's binary protocol and the admin REST
# API alike: True = transient (the same call may succeed a moment later, so every call retries
# it with backoff until its own deadline), False = permanent (retrying cannot help without a
# change; the call fails at once). A cause missing here is permanent: fail loudly when unsure.
TRANSIENT: dict[str, bool] = {
    # The broker is down, restarting, or its connection broke.
    "ConnectError": True,
    "NotConnected": True,
    "ReadError": True,
    "Timeout": True,
    "LookupError": True,
    "TooManyLookupRequestException": True,
    # The topic is being loaded, fenced, unloaded or moved to another broker.
    "ServiceUnitNotReady": True,
    "BrokerMetadataError": True,
    # Includes "Not enough non-faulty bookies available" while the bookie comes back.
    "BrokerPersistenceError": True,
    "ChecksumError": True,
    # Another process holds the writer, or ours was taken over: a later turn may get it.
    "ProducerBusy": True,
    "ProducerFenced": True,
    # A reader of the same name not yet dropped after a reconnect; a client still reconnecting.
    "ConsumerBusy": True,
    "ProducerNotInitialized": True,
    "ConsumerNotInitialized": True,
    "ProducerQueueIsFull": True,
    "MemoryBufferIsFull": True,
    # The client's connection broke under a request (C++ ResultDisconnected, a broker killed
    # mid-call); the Python binding has no name for it (see _RESULT_NAMES).
    "Disconnected": True,
    # Bad input, configuration, credentials or topic: no retry can fix these.
    "UnknownError": False,
    "InvalidConfiguration": False,
    "AuthenticationError": False,
    "AuthorizationError": False,
    "ErrorGettingAuthenticationData": False,
    "AlreadyClosed": False,
    "InvalidMessage": False,
    "InvalidTopicName": False,
    "InvalidUrl": False,
    "OperationNotSupported": False,
    "ProducerBlockedQuotaExceededError": False,
    "ProducerBlockedQuotaExceededException": False,
    "MessageTooBig": False,
    "TopicNotFound": False,
    "TopicTerminated": False,
    "SubscriptionNotFound": False,
    "ConsumerNotFound": False,
    "UnsupportedVersionError": False,
    "IncompatibleSchema": False,
    "CryptoError": False,
    "NotAllowedError": False,
    "Interrupted": False,
    # Admin REST API. Connection refused/reset/closed, and a socket time-out.
    "http connection": True,
    "http timeout": True,
    # A redirect to the broker that owns the topic (its ownership may be moving).
    "http 3xx": True,
    # Topic being loaded ("temporarily unavailable"), broker starting, overloaded.
    "http 5xx": True,
    "http 429": True,
    "http 4xx": False,  # 401/403 credentials, 404 no such topic, 409/412 a conflict
}


def is_transient_cause(cause: str) -> bool:
    """Whether a failure named as in :data:`TRANSIENT` may pass by itself."""
    return TRANSIENT.get(cause, False)


def http_cause(status: int) -> str:
    """The :data:`TRANSIENT` key of an HTTP status that is not a success."""
    if status == 429:
        return "http 429"
    return f"http {status // 100}xx"


class _ExpectedContention(logging.Filter):
    """Drop the C++ client's warnings for expected writer contention (we log it at DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "existing exclusive producer" not in record.getMessage()


_client_logger = logging.getLogger("pulsar_state.client")
_client_logger.addFilter(_ExpectedContention())

# "2026-01-02 03:04:05.678 WARN  [1403] ClientConnection:209 | message", as the C++ client writes.
_CLIENT_LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+)\s+\[\d+\] (?P<where>\S+) \| (?P<msg>.*)$")
_CLIENT_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
}


class _ClientLogPipe:
    """Carries the C++ client's log lines to the ``pulsar_state.client`` Python logger.

    The client writes them (a C++ ``FileLogger``) into a pipe; a daemon thread reads the pipe
    and logs each line. The client's threads never call into Python, which can abort the
    process at exit (apache/pulsar-client-python#256), and the log still goes wherever the
    application's logging sends it (not to stdout, the C++ console logger's stream).
    """

    _PIPE_BYTES = 1 << 20  # room for bursts, so a C++ thread never waits on a slow reader

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._read_fd, self._write_fd = os.pipe()
        if sys.platform == "linux":
            with contextlib.suppress(OSError):
                fcntl.fcntl(self._write_fd, fcntl.F_SETPIPE_SZ, self._PIPE_BYTES)
        threading.Thread(
            target=self._forward, args=(self._read_fd,), name="pulsar-state-client-log", daemon=True
        ).start()

    def follow_into_child(self) -> None:
        """In a forked child about to open a client: the C++ client keeps the logger of the
        process's first client, the parent's, so the child's clients write into this very
        pipe. The parent reads it while it lives (the child's lines are logged there); once
        it is gone, this process does. Else nobody would, and once the pipe filled every
        client thread that logs would block (measured: a child's producer creation hung)."""
        parent, self.pid = self.pid, os.getpid()
        read_fd = self._read_fd

        def drain_once_orphaned() -> None:
            while os.getppid() == parent:  # (two readers would split lines between them)
                time.sleep(1.0)
            self._forward(read_fd)

        threading.Thread(
            target=drain_once_orphaned, name="pulsar-state-client-log", daemon=True
        ).start()

    @property
    def path(self) -> str:
        return f"/dev/fd/{self._write_fd}"

    @staticmethod
    def _forward(read_fd: int) -> None:
        with open(read_fd, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                _log_client_line(line.rstrip("\n"))


def _log_client_line(line: str) -> None:
    match = _CLIENT_LINE.match(line)
    if match is None:
        if line.strip():
            _client_logger.warning("%s", line)
        return
    level = _CLIENT_LEVELS.get(match["level"], logging.WARNING)
    _client_logger.log(level, "%s | %s", match["where"], match["msg"])


_log_pipe: _ClientLogPipe | None = None
_log_pipe_lock = threading.Lock()


def _client_log_option() -> Any:
    """The ``logger`` option for a new client: a C++ file logger writing into this process's
    pipe, at the level the ``pulsar_state.client`` logger lets through (WARNING by default).

    pulsar-client keeps the logger of the first client of the process (for all clients), so
    the level is the one in effect when that client opened.
    """
    global _log_pipe
    if not os.path.isdir("/dev/fd"):  # no pipe path to give the C++ logger (Windows)
        return pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn)
    with _log_pipe_lock:
        if _log_pipe is None:
            _log_pipe = _ClientLogPipe()
        elif _log_pipe.pid != os.getpid():
            _log_pipe.follow_into_child()
        path = _log_pipe.path
    level = _client_logger.getEffectiveLevel()
    if level <= logging.DEBUG:
        cpp_level = pulsar.LoggerLevel.Debug
    elif level <= logging.INFO:
        cpp_level = pulsar.LoggerLevel.Info
    elif level <= logging.WARNING:
        cpp_level = pulsar.LoggerLevel.Warn
    else:
        cpp_level = pulsar.LoggerLevel.Error
    return pulsar.FileLogger(cpp_level, path)


def close_in_own_thread(close: Callable[[], object], timeout: float, what: str) -> bool:
    """Run a blocking ``close`` on a thread of its own and wait up to ``timeout``; True if done.

    Usable where nothing else is, e.g. in an ``atexit`` hook, where the default executor
    (``asyncio.to_thread``) is already shut down. An exception from ``close`` is logged.
    """
    error: list[BaseException] = []

    def run() -> None:
        try:
            close()
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name=f"pulsar-state-close-{what}", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no new threads this late in interpreter shutdown: close right here
        run()
    else:
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("closing %s took over %ss; not waiting for it", what, timeout)
            return False
    if error:
        logger.debug("closing %s: %s", what, error[0])
    return True


async def wait_bounded(awaitable: Awaitable[T], timeout: float) -> T:
    """``asyncio.wait_for`` that never swallows a cancellation.

    On Python 3.11, ``wait_for`` returns normally when it is cancelled just as the awaited
    operation completes; a loop around it then never ends (measured: ``asyncio.run`` hung at
    exit on a manager left open, its writer loop cancelled during the idle writer release).
    Raises ``TimeoutError`` after ``timeout`` (the operation is cancelled, as with wait_for).
    """
    future = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({future}, timeout=timeout)
    except asyncio.CancelledError:
        future.cancel()
        raise
    if not done:
        future.cancel()
        raise TimeoutError
    return future.result()


# The C++ client leaves a consumer whose SUBSCRIBE the broker refused as "Retryable" (the
# topic being unloaded: "temporarily unavailable") attached to that connection, so its own
# reconnection is skipped ("already connected") and the creation fails only at the operation
# timeout: measured 30 s for 3 of 60 readers created during an unload (pulsar-client 3.13;
# ConsumerImpl::handleCreateConsumer resets the connection only for a consumer created
# before). Asking again after a short wait subscribes anew.
_SUBSCRIBE_ATTEMPTS_S = (2.0, 4.0, 8.0)
_late: set[asyncio.Task[None]] = set()


def _close_when_created(pending: asyncio.Future[Any], what: str) -> None:
    """Close whatever an abandoned creation gives, whenever it gives it."""

    async def close(handle: Any) -> None:
        try:
            await wait_bounded(handle.close(), _CLOSE_TIMEOUT_S)
        except Exception as exc:  # best effort: it is gone either way
            logger.debug("closing an abandoned %s: %r", what, exc)

    def created(done: asyncio.Future[Any]) -> None:
        if done.cancelled() or done.exception() is not None:
            return  # failed (the exception is retrieved here, so nothing warns about it)
        task = asyncio.ensure_future(close(done.result()))
        _late.add(task)
        task.add_done_callback(_late.discard)

    pending.add_done_callback(created)


async def subscribe_bounded(create: Callable[[], Awaitable[T]], *, timeout: float, what: str) -> T:
    """``await create()`` (a consumer or reader creation), asked again when no attempt has
    answered after a few seconds (see :data:`_SUBSCRIBE_ATTEMPTS_S`); the first attempt to
    answer wins, the others are closed when they come. OperationTimeoutError after
    ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    attempts: list[asyncio.Future[T]] = []
    try:
        for attempt in itertools.count():
            attempts.append(asyncio.ensure_future(create()))
            step = _SUBSCRIBE_ATTEMPTS_S[min(attempt, len(_SUBSCRIBE_ATTEMPTS_S) - 1)]
            wait = max(0.0, min(step, deadline - loop.time()))
            done, _ = await asyncio.wait(
                attempts, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
            if done:
                # A success if there is one, else the first failure.
                answered = min(done, key=lambda f: f.exception() is not None)
                attempts.remove(answered)
                with translate_errors(what):
                    return answered.result()
            if loop.time() >= deadline:
                break
            logger.info("%s: no answer in %.0fs; asking the broker again", what, step)
        raise OperationTimeoutError(f"{what}: no answer from the broker in {timeout:.0f}s")
    finally:
        for pending in attempts:
            _close_when_created(pending, what)


async def close_in_own_thread_async(close: Callable[[], object], timeout: float, what: str) -> bool:
    """:func:`close_in_own_thread` awaited from the event loop, which keeps running meanwhile."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[BaseException | None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():
            done.set_result(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            close()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    try:
        threading.Thread(target=run, name=f"pulsar-state-close-{what}", daemon=True).start()
    except RuntimeError:  # no new threads this late in interpreter shutdown
        return close_in_own_thread(close, timeout, what)
    try:
        error = await wait_bounded(asyncio.shield(done), timeout)
    except TimeoutError:
        logger.warning("closing %s took over %ss; not waiting for it", what, timeout)
        return False
    if error is not None:
        logger.debug("closing %s: %s", what, error)
    return True


def _tolerate_closed_loops() -> None:
    """Make pulsar.asyncio's completion callbacks a no-op once their event loop is closed.

    They run on the C++ client's threads and call ``loop.call_soon_threadsafe``, which raises
    when the loop is closed; the C++ client then aborts the process (``terminate called after
    throwing an instance of 'pybind11::error_already_set'``). It happens when ``asyncio.run``
    returns while an operation is still in flight, e.g. the idle release of the writer (a
    producer close) of a manager left open. Nobody can await a closed loop's future.
    """

    def guard(complete: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(complete)
        def guarded(future: asyncio.Future[Any], *args: Any, **kwargs: Any) -> None:
            try:
                complete(future, *args, **kwargs)
            except RuntimeError:
                if not future.get_loop().is_closed():
                    raise

        guarded._pulsar_state_guarded = True  # type: ignore[attr-defined]
        return guarded

    for name in ("_set_future", "_set_future_v2"):
        complete = getattr(pulsar_asyncio, name, None)
        if complete is not None and not getattr(complete, "_pulsar_state_guarded", False):
            setattr(pulsar_asyncio, name, guard(complete))


_tolerate_closed_loops()


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _check_process(pid: int, what: str) -> None:
    """Refuse to use, in a forked child, a client created in the parent: pulsar-client is not
    fork-safe (apache/pulsar-client-python#127) and would hang or crash instead."""
    if os.getpid() != pid:
        raise ClosedError(
            f"{what} was created in process {pid}, before a fork; pulsar-client cannot be used "
            "across fork: open a new manager (or map) in this process"
        )


class LogPosition(NamedTuple):
    """A message's place in a non-partitioned topic: ledger then entry. Ordered."""

    ledger: int
    entry: int

    def __str__(self) -> str:
        return f"{self.ledger}:{self.entry}"


@dataclass(frozen=True, slots=True)
class RawMessage:
    """A message as read from the topic, before any decoding."""

    payload: bytes
    position: LogPosition


# Results of the C++ client that this version of the Python binding's enum does not name
# (pybind11 calls them "???"): named by their number in the C++ ``pulsar::Result``.
_RESULT_NAMES = {46: "Disconnected"}


def result_name(result: Any) -> str:
    """The :data:`TRANSIENT` key of a ``pulsar.Result``, also for one the binding cannot name."""
    name = str(result.name)
    if name == "???":
        return _RESULT_NAMES.get(int(result), f"Result {int(result)}")
    return name


def _result_of(exc: BaseException) -> Any | None:
    """Pulsar's result code carried by either flavour of Pulsar exception, else None."""
    if isinstance(exc, pulsar_asyncio.PulsarException):
        return exc.error()
    if isinstance(exc, pulsar_exceptions.PulsarException):
        name = type(exc).__name__
        return getattr(pulsar.Result, name, pulsar.Result.UnknownError)
    return None


def translate(exc: BaseException, context: str, *, creating_writer: bool = False) -> BaseException:
    """Map a Pulsar exception (sync or asyncio flavour) to this library's tree, with
    ``retriable`` from :data:`TRANSIENT`.

    Anything that is not a Pulsar exception is returned unchanged.
    """
    result = _result_of(exc)
    if result is None:
        return exc
    error = _library_error(result, f"{context}: {exc}", context, creating_writer=creating_writer)
    error.retriable = is_transient_cause(result_name(result))
    return error


def _library_error(
    result: Any, detail: str, context: str, *, creating_writer: bool
) -> PulsarStateError:
    if creating_writer and result in _HELD:
        return WriterBusyError(f"{context}: another process holds the topic's exclusive writer")
    if result == pulsar.Result.ProducerFenced:
        return FencedError(f"{context}: this writer was fenced by a newer exclusive writer")
    if result == pulsar.Result.Timeout:
        return OperationTimeoutError(detail)
    if result == pulsar.Result.MessageTooBig:
        return RecordTooLargeError(detail, size=-1, limit=-1)
    if result == pulsar.Result.AlreadyClosed:
        return ClosedError(detail)
    if result in (pulsar.Result.TopicNotFound, pulsar.Result.TopicTerminated):
        return TopicError(detail, topic=context)
    if result in _UNAVAILABLE or result_name(result) == "Disconnected":
        return BrokerUnavailableError(detail, result=result_name(result))
    return BrokerError(detail, result=result_name(result))


@contextmanager
def translate_errors(context: str, *, creating_writer: bool = False) -> Iterator[None]:
    """Re-raise Pulsar exceptions raised inside the block as :class:`PulsarStateError`."""
    try:
        yield
    except PulsarStateError:
        raise
    except (pulsar_asyncio.PulsarException, pulsar_exceptions.PulsarException) as exc:
        # pulsar.asyncio.PulsarException derived from BaseException up to 3.12; both are
        # named explicitly so that neither version slips through.
        raise translate(exc, context, creating_writer=creating_writer) from exc


class StateWriter:
    """An exclusive, non-batching producer on the state topic: one message per record."""

    def __init__(self, producer: Any, topic: str, *, fencing: bool = False) -> None:
        self._producer = producer
        self._topic = topic
        self._context = f"send to {topic}"
        self._what = f"the writer on {topic}"
        self._pid = os.getpid()
        self.fencing = fencing  # taken by fencing the previous holder
        # Whether the client refused the last message inside send_nowait's own call (too
        # large for the broker, or the producer closed): it was certainly not sent.
        self.refused = False

    async def send(self, payload: bytes, *, key: str) -> LogPosition:
        return await self.send_nowait(payload, key=key)

    def send_nowait(
        self, payload: bytes, *, key: str, on_settled: Callable[[], None] | None = None
    ) -> asyncio.Future[LogPosition]:
        """Hand the message to the client now, in order with the sends before it; the future
        gets its position once the broker acknowledges it (or the translated error).

        Not a coroutine: pulsar.asyncio's ``send`` hands the message over only when its task
        first runs, one event-loop turn later (50-100 us on a CPU that was idle), and the
        writer sends from whichever task has the record ready. ``on_settled`` is called on
        the loop right after the future is settled (before the tasks awaiting it resume).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[LogPosition] = loop.create_future()
        context = self._context

        def settle(result: Any, msg_id: Any) -> None:  # on the loop
            if future.done():
                return
            if result == pulsar.Result.Ok:
                future.set_result(LogPosition(msg_id.ledger_id(), msg_id.entry_id()))
            else:
                cause = pulsar_asyncio.PulsarException(result)
                error = translate(cause, context)
                error.__cause__ = cause
                future.set_exception(error)
            if on_settled is not None:
                on_settled()  # its own errors are its own: it never raises (see Writer)

        calling = [True]

        def acknowledged(result: Any, msg_id: Any) -> None:  # on the client's thread
            # Never raises: an exception here aborts the process (see _tolerate_closed_loops).
            if calling[0] and result != pulsar.Result.Ok:
                self.refused = True  # inside send_async: the client's own check refused it
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits it
                loop.call_soon_threadsafe(settle, result, msg_id)

        # A failure nobody awaits (the writer stopped meanwhile) is not an unretrieved error.
        future.add_done_callback(_retrieve)
        self.refused = False
        try:
            # Never raises either: a send refused here is a failed send, handled (retried)
            # where its acknowledgement is awaited, as one failed by the broker.
            _check_process(self._pid, self._what)
            builder = _pulsar.MessageBuilder()
            builder.content(payload)
            # Every message is keyed: since Pulsar 3.2 compaction drops keyless messages.
            builder.partition_key(key)
            # The C++ producer under pulsar.asyncio's wrapper (as StateReader its reader).
            # Translated here rather than by translate_errors: a generator-based context
            # manager per record is measurable on a lone writer's path.
            self._producer._producer.send_async(builder.build(), acknowledged)
            calling[0] = False
        # pulsar.asyncio.PulsarException derived from BaseException up to 3.12.
        except (Exception, pulsar_asyncio.PulsarException) as exc:
            calling[0] = False
            self.refused = True
            error = translate(exc, context)
            if error is not exc:
                error.__cause__ = exc
            future.set_exception(error)
            if on_settled is not None:
                loop.call_soon(on_settled)  # as from settle(), once the caller has the future
        return future

    async def close(self) -> None:
        if os.getpid() != self._pid:
            return  # the parent's producer: nothing to do with it here
        try:
            with translate_errors(f"close writer on {self._topic}"):
                await wait_bounded(self._producer.close(), _CLOSE_TIMEOUT_S)
        except (PulsarStateError, TimeoutError) as exc:
            # A fenced or disconnected producer is already released on the broker side.
            logger.debug("closing writer on %s: %s", self._topic, exc)


class StateReader:
    """A reader over the topic, in log order, delivering messages to the event loop in batches.

    A dedicated thread makes the blocking reads (each async read costs a callback and a loop
    wake-up per message) and hands over batches through a bounded queue, so a long replay
    neither floods memory nor wakes the loop once per message. No read is ever cancelled
    half-way, so no message can be dropped between the client and the replica.
    """

    _POLL_MS = 100
    _PAUSE_MAX_S = 1.0
    # A paused reader looks at the log once a _PAUSE_MAX_S (see pause()): once it has read
    # the holder's own records, it waits this long for more before pausing again.
    _CHECK_MS = 10
    _BATCH = 1000
    # Also cut by bytes, and the bytes handed over but not yet taken are bounded: batches of
    # big messages (snapshot chunks, records of megabytes) would otherwise hold hundreds of
    # megabytes ahead of a replaying replica (its peak memory).
    _BATCH_BYTES = 2 * 1024 * 1024
    _QUEUED_BYTES = 8 * 1024 * 1024

    def __init__(self, reader: Any, topic: str, *, after: LogPosition | None = None) -> None:
        self._async_reader = reader
        self._reader = reader._reader  # the C++ reader under pulsar.asyncio's wrapper
        self._topic = topic
        self._pid = os.getpid()
        self._loop = asyncio.get_running_loop()
        self._batches: queue.Queue[tuple[list[RawMessage], int]] = queue.Queue(maxsize=8)
        self._queued_bytes = 0
        self._room = threading.Condition()
        self._ready = asyncio.Event()
        self._loop_waiting = False  # read_batch is waiting for a batch (set on the loop)
        self._pending: deque[RawMessage] = deque()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        # Cleared while the holder of the topic's exclusive writer has applied all it wrote:
        # nothing but its own records can come (see pause()). Set again to stop the thread.
        self._reading = threading.Event()
        self._reading.set()
        self._paused_at = 0.0
        # Reading only to look at the log while paused (see pause()); pause again after it.
        self._looking = False
        self._own_until: LogPosition | None = None  # the holder's last record at pause()
        self._switch = threading.Lock()  # pause/resume against the thread's own
        # The last message read off the client (by the thread; handed over or not yet).
        self.last_read: LogPosition | None = after
        self._thread = threading.Thread(
            target=self._run, name=f"pulsar-state-reader-{topic}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        batch: list[RawMessage] = []
        batch_bytes = 0
        # Freed heap memory goes back to the system as big messages are read (see _memory):
        # a 1M-key replay of 3 MB records peaked 120 MB higher without.
        trims = TrimPolicy(trim=release_free_memory)
        while not self._stop.is_set():
            if not self._reading.is_set():
                if batch:
                    self._hand_over(batch, batch_bytes)
                    batch, batch_bytes = [], 0
                # Bounded: a holder fenced while idle (its writer not yet released) sees
                # the fencer's records a second after its last write (a write of its own
                # would fail, and its writer be released).
                left = self._paused_at + self._PAUSE_MAX_S - time.monotonic()
                if left <= 0:
                    with self._switch:
                        if not self._reading.is_set():  # else resumed meanwhile: read on
                            self._looking = True
                            self._reading.set()
                else:
                    self._reading.wait(left)
                continue
            if batch and self._loop_waiting:
                # The loop waits for messages: hand these over now rather than probe for
                # more. A probe that finds nothing costs ~85 us (the client raises Timeout
                # through pybind11's exception translators), once per record when following
                # the tail; while the loop is busy, the batch keeps growing instead.
                self._loop_waiting = False
                self._hand_over(batch, batch_bytes)
                batch, batch_bytes = [], 0
            try:
                # Block while idle; once a batch has started, take only what is already there.
                msg = self._reader.read_next(
                    0 if batch else self._CHECK_MS if self._looking else self._POLL_MS
                )
            except pulsar_exceptions.Timeout:
                if batch:
                    self._hand_over(batch, batch_bytes)
                    batch, batch_bytes = [], 0
                elif self._looking:  # a look's wait found nothing more
                    self._pause_again()
                continue
            except Exception as exc:
                if not self._stop.is_set():
                    self._error = translate(exc, f"read from {self._topic}")
                    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads
                        self._loop.call_soon_threadsafe(self._ready.set)
                return
            mid = msg.message_id()
            # The key is not read: the pump has no use for it, and each call crosses into C++.
            data = msg.data()
            position = LogPosition(mid.ledger_id(), mid.entry_id())
            batch.append(RawMessage(data, position))
            self.last_read = position
            if self._looking and self._own_until is not None and position > self._own_until:
                self._read_on()  # a record the holder did not write (a fencer's): read on
            batch_bytes += len(data)
            if len(batch) >= self._BATCH or batch_bytes >= self._BATCH_BYTES:
                self._hand_over(batch, batch_bytes)
                batch, batch_bytes = [], 0
            trims.read(len(data))  # this thread, not the loop's: no GIL held while trimming

    def _hand_over(self, batch: list[RawMessage], size: int) -> None:
        with self._room:  # bounded by bytes: waits while the loop catches up
            while (
                self._queued_bytes
                and self._queued_bytes + size > self._QUEUED_BYTES
                and not self._stop.is_set()
            ):
                self._room.wait(0.1)
            self._queued_bytes += size
        while not self._stop.is_set():
            try:
                self._batches.put((batch, size), timeout=0.1)  # and by count
                break
            except queue.Full:
                continue
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is reading
            self._loop.call_soon_threadsafe(self._ready.set)

    def pause(self, own_until: LogPosition) -> None:
        """Stop reading until :meth:`resume`; from the loop's thread, by the holder of the
        topic's writer, whose last record is at ``own_until``. Messages not read stay in the
        client's prefetch queue, and once it is full the broker sends no more. Nothing is
        skipped: reading resumes where it stopped.

        Meanwhile, a second after the latest call and then every second, the reader looks at
        the log: it reads up to ``own_until`` (the holder's own records it left unread) and
        what comes within ``_CHECK_MS`` after, then pauses again; a record past
        ``own_until`` (a fencer's: a holder fenced while idle sees it within about a second)
        makes it read on as after :meth:`resume`. It used to read on from that second until
        the next pause, so a holder's first write after a second idle raced its own record
        to the pump, which then applied it (decoded) before its acknowledgement came."""
        with self._switch:
            self._paused_at = time.monotonic()
            self._own_until = own_until
            self._looking = False
            if self._reading.is_set():
                self._reading.clear()

    def _pause_again(self) -> None:
        # From the thread: its look found nothing more within _CHECK_MS.
        with self._switch:
            last, own_until = self.last_read, self._own_until
            caught_up = own_until is None or (last is not None and last >= own_until)
            if self._looking and caught_up:  # not resumed (nor paused) by the loop meanwhile
                self._looking = False
                self._paused_at = time.monotonic()
                self._reading.clear()

    def _read_on(self) -> None:
        # From the thread: a look found a record past the holder's own.
        with self._switch:
            self._looking = False

    def resume(self) -> None:
        with self._switch:
            self._looking = False
            if not self._reading.is_set():
                self._reading.set()

    def behind(self, position: LogPosition) -> int | None:
        """How many messages this reader has yet to read up to ``position``; None when that
        is not known (another ledger: its entry count is the broker's)."""
        last = self.last_read
        if last is None or last.ledger != position.ledger:
            return None
        return max(0, position.entry - last.entry)

    @property
    def paused(self) -> bool:
        # A look at the log ends paused again: only resume() makes the reader read on.
        # Under the lock: the thread sets both as a look starts.
        with self._switch:
            return self._looking or not self._reading.is_set()

    async def read_batch(self) -> list[RawMessage]:
        """The next messages in log order (at least one); waits for them."""
        _check_process(self._pid, f"the reader on {self._topic}")
        if self._pending:
            batch = list(self._pending)
            self._pending.clear()
            return batch
        while True:
            try:
                return self._taken(self._batches.get_nowait())
            except queue.Empty:
                pass
            if self._error is not None:
                raise self._error
            if self._stop.is_set():
                raise ClosedError(f"reader on {self._topic} is closed")
            self._ready.clear()
            try:  # a batch may have arrived between the check and the clear
                return self._taken(self._batches.get_nowait())
            except queue.Empty:
                self._loop_waiting = True
                try:
                    await self._ready.wait()
                finally:
                    self._loop_waiting = False

    def _taken(self, handed: tuple[list[RawMessage], int]) -> list[RawMessage]:
        batch, size = handed
        with self._room:
            self._queued_bytes -= size
            self._room.notify()
        return batch

    def abandon(self, reason: str) -> None:
        """Make the next read fail (after what was read already), so that the replica
        replaces this reader; from the loop's thread."""
        if self._error is None:
            self._error = BrokerUnavailableError(f"reader on {self._topic}: {reason}")
        self._ready.set()

    async def read_next(self) -> RawMessage:
        if not self._pending:
            self._pending.extend(await self.read_batch())
        return self._pending.popleft()

    async def has_message_available(self) -> bool:
        """A hint only (it has had bugs); used where a wrong answer cannot lose data."""
        if self._pending or not self._batches.empty():
            return True
        with translate_errors(f"read from {self._topic}"):
            return bool(await self._async_reader.has_message_available())

    def stop_at_exit(self, timeout: float) -> None:
        """Stop the reading thread quietly, from any thread (the client closes next)."""
        self._stop.set()
        self._reading.set()
        self._thread.join(timeout)

    async def close(self) -> None:
        if os.getpid() != self._pid:
            return  # the parent's reader: its thread does not exist here
        self._stop.set()
        self._reading.set()
        self._ready.set()
        with self._room:
            self._room.notify_all()
        # The client's reader first: its close wakes the thread's blocking read at once
        # (AlreadyClosed, ignored once stopping) instead of after the poll (100 ms a close).
        try:
            with translate_errors(f"close reader on {self._topic}"):
                await wait_bounded(self._async_reader.close(), _CLOSE_TIMEOUT_S)
        except (PulsarStateError, TimeoutError) as exc:
            logger.debug("closing reader on %s: %s", self._topic, exc)
        # Not asyncio.to_thread: the default executor is shut down before atexit hooks run.
        await close_in_own_thread_async(
            lambda: self._thread.join(5.0), 6.0, f"the reader thread of {self._topic}"
        )


# A reader expected to deliver (the log holds more) that delivers nothing for this long is
# taken for one the broker attached to a closed topic, and replaced (see ReopeningReader);
# doubled after each replacement that brought nothing, up to READER_STALL_MAX_S.
READER_STALL_S = 5.0
READER_STALL_MAX_S = 60.0


class StallLimit:
    """How long a reader expected to deliver may deliver nothing before it is replaced.

    :data:`READER_STALL_S`, doubled after each replacement that brought nothing (up to
    :data:`READER_STALL_MAX_S`), and back once a message was read since: with a fixed limit,
    a reader whose first message is merely slow (a cold ledger, an offloaded one, a big
    chunk) was replaced again and again, each replacement starting the same slow read.
    ``read``: a count of the messages read so far (by whoever reads them).
    """

    __slots__ = ("_read_at_replacement", "_seconds")

    def __init__(self) -> None:
        self._seconds = READER_STALL_S
        self._read_at_replacement: int | None = None

    def seconds(self, read: int) -> float:
        if read != self._read_at_replacement:
            self._seconds = READER_STALL_S
        return self._seconds

    def replaced(self, read: int) -> None:
        self._seconds = min(self.seconds(read) * 2, READER_STALL_MAX_S)
        self._read_at_replacement = read


class ReopeningReader:
    """Reads one topic message by message from a start, replacing its reader when it
    delivers nothing for a while (:class:`StallLimit`): a reader subscribed while the topic unloads
    can stay attached to the closed topic, where no message ever comes (measured: about 1
    reader in 700 opened during unloads). The replacement starts just after the last message
    delivered (or where the first began), so nothing is skipped or read twice.

    For reads that expect a message (the caller knows the log holds one); the caller bounds
    the whole wait. Not for following a tail that may stay quiet: each quiet
    :data:`READER_STALL_S` costs a new reader.
    """

    def __init__(
        self,
        conn: PulsarConnection,
        topic: str,
        *,
        at: LogPosition | None = None,
        prefetch: int = 2000,
    ) -> None:
        self._conn = conn
        self._topic = topic
        self._at = at
        self._prefetch = prefetch
        self._last: LogPosition | None = None
        self._reader: StateReader | None = None
        self._closing: set[asyncio.Future[None]] = set()  # stalled readers being closed
        self.reopened = 0  # readers replaced after a stall (tests, logs)
        self._read = 0
        self._stall = StallLimit()

    async def open(self) -> ReopeningReader:
        """Create the first reader (apart, so that callers bound the reads only, as before)."""
        if self._reader is None:
            self._reader = await self._conn.create_reader(
                self._topic,
                after=self._last,
                at=self._at if self._last is None else None,
                prefetch=self._prefetch,
            )
        return self

    async def read_next(self) -> RawMessage:
        while True:
            await self.open()
            assert self._reader is not None
            stall = self._stall.seconds(self._read)
            try:
                async with asyncio.timeout(stall):
                    message = await self._reader.read_next()
            except TimeoutError:
                logger.info(
                    "no message from %s for %.0fs after %s: reopening the reader",
                    self._topic,
                    stall,
                    self._last or self._at or "its start",
                )
                stalled, self._reader = self._reader, None
                self.reopened += 1
                self._stall.replaced(self._read)
                # Closed meanwhile, not first: a reader stuck on a closed topic may be slow
                # to close (up to _CLOSE_TIMEOUT_S), time the caller's wait has not to spare.
                closing = asyncio.ensure_future(stalled.close())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
                continue
            self._read += 1
            if self._last is not None and message.position <= self._last:
                continue  # (a start is exclusive, so never: but a chunk read twice is corrupt)
            self._last = message.position
            return message

    async def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            await reader.close()
        if self._closing:
            await asyncio.wait(self._closing)


def client_authentication(authentication: Any) -> tuple[Any, str | Callable[[], str] | None]:
    """The binary client's ``pulsar.Authentication`` for the manager's ``authentication=``,
    and the token the admin REST client can send too (None for other kinds).

    A token (str, or a function returning the current one) becomes ``AuthenticationToken``,
    which calls the function again when it reconnects; any ``pulsar.Authentication`` (OAuth2,
    TLS, Athenz...) is passed through, and its credentials stay inside the C++ client.
    """
    if authentication is None:
        return None, None
    if isinstance(authentication, pulsar.Authentication):
        return authentication, None
    if isinstance(authentication, str):
        if not authentication.strip():
            raise ConfigurationError("authentication= is an empty token")
        return pulsar.AuthenticationToken(authentication.strip()), authentication.strip()
    if callable(authentication):
        return pulsar.AuthenticationToken(authentication), authentication
    raise ConfigurationError(
        "authentication= takes a token (str), a function returning one, or a "
        f"pulsar.Authentication (AuthenticationOauth2, AuthenticationTLS...), not "
        f"{type(authentication).__name__}"
    )


# The library's own durable subscription on a state topic: every replica attaches a consumer
# to it to ask the broker for the topic's last message id over the binary protocol.
# Durable because pulsar-client (Python) offers no other way: its Reader has no
# get_last_message_id and its subscribe() no non-durable mode. One fixed name per topic, so
# a process that dies leaves nothing new behind.
TAIL_SUBSCRIPTION = "pulsar-state"


class TailProbe:
    """Asks the broker for a topic's last message id: one binary round trip, no admin API.

    A consumer on :data:`TAIL_SUBSCRIPTION` with a zero receiver queue: it never asks for a
    message, so the broker dispatches nothing to it. Failover, so that any number of
    replicas can attach to the one subscription.
    """

    # After moving the mark, it is sent again after these pauses (seconds): measured, an
    # acknowledgement the broker took while the topic unloaded was never persisted (its
    # cursor was closed), so the mark went back and nothing moved it until the next snapshot.
    _REACK_AFTER_S = (1.0, 4.0)

    def __init__(
        self,
        consumer: Any,
        topic: str,
        *,
        resubscribe: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self._consumer = consumer
        self._topic = topic
        self._pid = os.getpid()
        self._reack: asyncio.Task[None] | None = None
        # Another consumer on the same subscription, for _acknowledge_again.
        self._resubscribe = resubscribe

    async def last_id(self) -> LogPosition | None:
        """The topic's last message id as the broker has it now; None when the topic is
        empty. ``entry`` is -1 when the broker's current ledger holds no entry yet (the last
        message, if any, is then in an earlier ledger, which this call does not tell)."""
        _check_process(self._pid, f"the tail probe on {self._topic}")
        # Asked now, the C++ client would retry quietly until its operation timeout: fail
        # fast instead, so the caller's retry (to its own deadline) can name the cause.
        self._check_connected()
        with translate_errors(f"get the last message id of {self._topic}"):
            msg_id = await self._consumer.get_last_message_id()
        position = LogPosition(msg_id.ledger_id(), msg_id.entry_id())
        return None if position.ledger < 0 else position

    def _check_connected(self) -> None:
        if not self._consumer._consumer.is_connected():
            down = BrokerUnavailableError(
                f"broker unreachable: the tail probe on {self._topic} is not connected (the "
                "client reconnects by itself)",
                result="NotConnected",
            )
            down.retriable = is_transient_cause("NotConnected")
            raise down

    async def hold_after(self, position: LogPosition) -> None:
        """Move the subscription's mark past ``position``: the broker may then delete the
        ledgers wholly behind it (retention permitting). Never moves it back.

        Acknowledgements are not confirmed by the broker: one sent as the connection drops, or
        taken while the topic unloads, can be lost; it is sent again 1 s and 5 s later, and the
        next call (after the next snapshot) moves the mark in any case."""
        _check_process(self._pid, f"the tail probe on {self._topic}")
        self._check_connected()
        mark = pulsar.MessageId(-1, position.ledger, position.entry, -1)
        with translate_errors(f"move the trim point of {self._topic}"):
            await self._consumer.acknowledge_cumulative(mark)
        if self._reack is not None:
            self._reack.cancel()
        self._reack = asyncio.get_running_loop().create_task(self._acknowledge_again(mark))

    async def _acknowledge_again(self, mark: Any) -> None:
        """Send ``mark`` again a little later: idempotent (the broker ignores a cumulative ack
        at or behind the current mark), and it restores a mark lost in an unload.

        Through a short-lived consumer of the same subscription: the probe's own consumer
        would not send it at all (the client drops a cumulative ack at or behind the last one
        it sent, whatever the broker kept). Closing that consumer flushes the ack."""
        if self._resubscribe is None:
            return
        for pause in self._REACK_AFTER_S:
            await asyncio.sleep(pause)
            try:
                consumer = await self._resubscribe()
                try:
                    with translate_errors(f"move the trim point of {self._topic} again"):
                        await consumer.acknowledge_cumulative(mark)
                finally:
                    await wait_bounded(consumer.close(), _CLOSE_TIMEOUT_S)
            except (PulsarStateError, TimeoutError) as exc:
                # Best effort: the next snapshot moves the mark anyway.
                logger.debug("re-sending the trim point of %s: %s", self._topic, exc)

    async def close(self) -> None:
        if os.getpid() != self._pid:
            return
        if self._reack is not None:
            self._reack.cancel()
            self._reack = None
        try:
            with translate_errors(f"close the tail probe on {self._topic}"):
                await wait_bounded(self._consumer.close(), _CLOSE_TIMEOUT_S)
        except (PulsarStateError, TimeoutError) as exc:
            logger.debug("closing the tail probe on %s: %s", self._topic, exc)


class RelayChannel:
    """A non-persistent topic that carries records from processes without the writer to the
    process that holds it: a shared producer and this process's own subscription (every
    process receives every relayed record; only the writer's holder appends it).

    Received by a thread making blocking receives, as :class:`StateReader` reads: an async
    receive left pending when a manager is dropped unclosed aborts the process when the
    garbage collector destroys the consumer (measured: ``std::bad_weak_ptr``).
    """

    _POLL_MS = 100

    def __init__(self, producer: Any, consumer: Any, topic: str) -> None:
        self._producer = producer
        self._async_consumer = consumer
        self._consumer = consumer._consumer  # the C++ consumer under pulsar.asyncio's wrapper
        self._topic = topic
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def listen(self, deliver: Callable[[bytes], None]) -> None:
        """Call ``deliver(payload)`` on the event loop for each message received."""
        loop = asyncio.get_running_loop()

        def run() -> None:
            while not self._stop.is_set():
                try:
                    message = self._consumer.receive(self._POLL_MS)
                except pulsar_exceptions.Timeout:
                    continue
                except Exception as exc:
                    if not self._stop.is_set():
                        logger.debug("receiving from %s: %s", self._topic, exc)
                        self._stop.wait(0.1)
                    continue
                try:
                    loop.call_soon_threadsafe(deliver, bytes(message.data()))
                except RuntimeError:  # the loop is closed: nobody listens any more
                    return

        self._thread = threading.Thread(
            target=run, name=f"pulsar-state-relay-{self._topic}", daemon=True
        )
        self._thread.start()

    async def send(self, payload: bytes) -> None:
        _check_process(self._pid, f"the relay on {self._topic}")
        with translate_errors(f"relay a record through {self._topic}"):
            await self._producer.send(payload)

    def stop_at_exit(self, timeout: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    async def close(self) -> None:
        if os.getpid() != self._pid:
            return
        self._stop.set()
        for handle, what in ((self._producer, "producer"), (self._async_consumer, "consumer")):
            try:
                with translate_errors(f"close the relay {what} on {self._topic}"):
                    await wait_bounded(handle.close(), _CLOSE_TIMEOUT_S)
            except (PulsarStateError, TimeoutError) as exc:
                logger.debug("closing the relay %s on %s: %s", what, self._topic, exc)
        thread = self._thread
        if thread is not None:
            await close_in_own_thread_async(
                lambda: thread.join(5.0), 6.0, f"the relay thread of {self._topic}"
            )


class PulsarConnection:
    """A ``pulsar.asyncio.Client`` plus the few calls the state manager makes with it."""

    def __init__(
        self,
        service_url: str,
        *,
        operation_timeout_s: float = 30.0,
        connection_timeout_s: float = 10.0,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        self.service_url = service_url
        self._pid = os.getpid()
        # Threads to stop before the client closes at exit.
        self._readers: list[StateReader | RelayChannel] = []
        self._operation_timeout_s = float(max(1, int(operation_timeout_s)))
        options: dict[str, Any] = {
            "operation_timeout_seconds": max(1, int(operation_timeout_s)),
            "connection_timeout_ms": int(connection_timeout_s * 1000),
        }
        options.update(client_options or {})
        if "logger" not in options:
            # The C++ client logs to stdout by default; to Python logging through a pipe here.
            options["logger"] = _client_log_option()
        elif isinstance(options["logger"], logging.Logger):
            logger.warning(
                "a Python logger given to pulsar-client can abort the process at exit "
                "(apache/pulsar-client-python#256); pass a pulsar.FileLogger or leave the "
                "default (the pulsar_state.client logger, through a pipe)"
            )
        with translate_errors(f"connect to {service_url}"):
            self._client = pulsar_asyncio.Client(service_url, **options)
        with _open_lock:
            _open_connections.add(self)

    @classmethod
    def wrap(cls, client: Any) -> PulsarConnection:
        """Borrow an existing ``pulsar.asyncio.Client`` (the caller keeps ownership)."""
        if not isinstance(client, pulsar_asyncio.Client):
            raise TypeError(
                f"pass a service URL (str) or a pulsar.asyncio.Client, not {type(client).__name__}"
            )
        conn = cls.__new__(cls)
        conn.service_url = getattr(client, "service_url", "")
        conn._client = client
        conn._pid = os.getpid()
        conn._readers = []
        conn._operation_timeout_s = 30.0  # the client's default; a borrowed one may differ
        return conn

    async def create_writer(
        self,
        topic: str,
        *,
        fencing: bool,
        send_timeout_s: float,
        timeout_s: float = 30.0,
    ) -> StateWriter:
        _check_process(self._pid, "the Pulsar client")
        mode = (
            pulsar.ProducerAccessMode.ExclusiveWithFencing
            if fencing
            else pulsar.ProducerAccessMode.Exclusive
        )
        creation = asyncio.ensure_future(
            self._client.create_producer(
                topic,
                access_mode=mode,
                # One message = one record: batching would merge records and chunking needs it off.
                batching_enabled=False,
                send_timeout_millis=int(send_timeout_s * 1000),
                max_pending_messages=10_000,
                block_if_queue_full=True,
            )
        )
        try:
            with translate_errors(f"acquire the writer of {topic}", creating_writer=True):
                producer = await wait_bounded(asyncio.shield(creation), timeout_s)
        except (OperationTimeoutError, asyncio.CancelledError):
            # Creation can hang while the broker fails (apache/pulsar #10721), or the manager
            # closes meanwhile. If it succeeds later, close that producer at once: an orphan
            # would hold exclusivity until the client closes (never, for a borrowed client).
            creation.add_done_callback(_close_orphan)
            raise
        except TimeoutError as exc:
            creation.add_done_callback(_close_orphan)
            raise OperationTimeoutError(
                f"acquiring the writer of {topic} took over {timeout_s}s"
            ) from exc
        return StateWriter(producer, topic, fencing=fencing)

    async def create_reader(
        self,
        topic: str,
        *,
        name: str | None = None,
        after: LogPosition | None = None,
        at: LogPosition | None = None,
        last: bool = False,
        prefetch: int = 2000,
    ) -> StateReader:
        """A reader from the start, just ``after`` a message, ``at`` one, or at the ``last``;
        ``prefetch``: messages the client may receive ahead of reads (fewer for big ones)."""
        start = pulsar.MessageId.earliest
        inclusive = False
        if after is not None:
            start = pulsar.MessageId(-1, after.ledger, after.entry, -1)
        elif at is not None:
            start, inclusive = pulsar.MessageId(-1, at.ledger, at.entry, -1), True
        elif last:
            start, inclusive = pulsar.MessageId.latest, True
        _check_process(self._pid, "the Pulsar client")
        reader = await subscribe_bounded(
            lambda: self._client.create_reader(
                topic,
                start,
                reader_name=name,
                receiver_queue_size=prefetch,
                start_message_id_inclusive=inclusive,
            ),
            timeout=self._operation_timeout_s,
            what=f"open a reader on {topic}",
        )
        state_reader = StateReader(reader, topic, after=after)
        self._readers = [r for r in self._readers if not r._stop.is_set()]
        self._readers.append(state_reader)
        return state_reader

    async def create_tail_probe(self, topic: str, *, name: str) -> TailProbe:
        """A :class:`TailProbe` on ``topic`` (creates :data:`TAIL_SUBSCRIPTION` at the topic's
        first message if it does not exist yet)."""
        _check_process(self._pid, "the Pulsar client")

        def subscribe(consumer_name: str) -> Callable[[], Awaitable[Any]]:
            return lambda: self._client.subscribe(
                topic,
                TAIL_SUBSCRIPTION,
                consumer_type=pulsar.ConsumerType.Failover,
                receiver_queue_size=0,
                consumer_name=consumer_name,
                initial_position=pulsar.InitialPosition.Earliest,
            )

        consumer = await subscribe_bounded(
            subscribe(name),
            timeout=self._operation_timeout_s,
            what=f"open the tail probe on {topic}",
        )
        return TailProbe(
            consumer,
            topic,
            resubscribe=lambda: subscribe_bounded(
                subscribe(f"{name}-mark"),
                timeout=self._operation_timeout_s,
                what=f"open a consumer to move the trim point of {topic}",
            ),
        )

    async def create_relay(self, topic: str, *, name: str) -> RelayChannel:
        """A :class:`RelayChannel` on the non-persistent ``topic``; ``name``: this process's
        subscription (messages sent while it is not subscribed are not kept for it)."""
        _check_process(self._pid, "the Pulsar client")
        creation = asyncio.ensure_future(
            self._client.create_producer(topic, batching_enabled=False, send_timeout_millis=5000)
        )
        try:
            with translate_errors(f"open the relay producer on {topic}"):
                producer = await wait_bounded(asyncio.shield(creation), self._operation_timeout_s)
        except BaseException:
            # Given up (or the manager closes): a producer created later is closed at once.
            _close_when_created(creation, f"relay producer on {topic}")
            raise
        try:
            consumer = await subscribe_bounded(
                lambda: self._client.subscribe(
                    topic,
                    name,
                    consumer_type=pulsar.ConsumerType.Exclusive,
                    receiver_queue_size=100,
                    consumer_name=name,
                ),
                timeout=self._operation_timeout_s,
                what=f"subscribe to {topic}",
            )
        except BaseException:
            with contextlib.suppress(Exception):
                await wait_bounded(producer.close(), _CLOSE_TIMEOUT_S)
            raise
        channel = RelayChannel(producer, consumer, topic)
        self._readers = [r for r in self._readers if not r._stop.is_set()]
        self._readers.append(channel)
        return channel

    async def partitions(self, topic: str) -> list[str]:
        _check_process(self._pid, "the Pulsar client")
        with translate_errors(f"look up {topic}"):
            return list(await self._client.get_topic_partitions(topic))

    async def close(self) -> None:
        """Close the client and join its threads, without blocking the event loop.

        ``pulsar.asyncio.Client.close()`` returns before the C++ client's threads are joined,
        and a process exiting then can abort; the blocking close joins them.
        """
        with _open_lock:
            _open_connections.discard(self)
        if os.getpid() != self._pid:
            return  # the parent's client: its threads do not exist here, closing would hang
        await close_in_own_thread_async(
            self._client._client.close, _CLOSE_TIMEOUT_S, f"the client of {self.service_url}"
        )

    def close_at_exit(self) -> None:
        """Close from an ``atexit`` hook, whatever the state of the event loop using it."""
        with _open_lock:
            _open_connections.discard(self)
        if os.getpid() != self._pid:
            return
        for reader in self._readers:
            reader.stop_at_exit(1.0)  # quietly: no "read failed" from a client closed under it
        close_in_own_thread(
            self._client._client.close, _CLOSE_TIMEOUT_S, f"the client of {self.service_url}"
        )


# Clients this library opened and nobody closed yet; closed at interpreter exit.
_open_connections: set[PulsarConnection] = set()
_open_lock = threading.Lock()


def close_connections_at_exit() -> None:
    """Close every client this process opened and left open (an ``atexit`` hook).

    Registered when this module is imported, so it runs after the hooks of modules imported
    later (``atexit`` runs last-registered first), e.g. the Spark integration's cache close.
    """
    with _open_lock:
        left_open = [c for c in _open_connections if c._pid == os.getpid()]
    for conn in left_open:
        conn.close_at_exit()


atexit.register(close_connections_at_exit)


def _close_orphan(creation: asyncio.Future[Any]) -> None:
    if creation.cancelled() or creation.exception() is not None:
        return
    producer = creation.result()
    logger.warning("closing a writer whose creation completed after its timeout")
    task = asyncio.ensure_future(producer.close())
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


@dataclass(frozen=True, slots=True)
class LogMessage:
    """A message of a topic as the tools show it (``pulsar-state log``)."""

    payload: bytes
    position: LogPosition
    publish_time_ms: int
    message_id: str


def read_log(
    service_url: str,
    topic: str,
    *,
    limit: int | None = None,
    timeout_s: float = 30.0,
    client_options: dict[str, Any] | None = None,
) -> Iterator[LogMessage]:
    """The topic's messages from the first up to its tail as of now, read with a blocking
    client of the same make as the library's (C++ logger, closed before returning): for
    command-line tools, which have no event loop. ``client_options``: credentials, TLS."""
    client = pulsar.Client(
        service_url,
        operation_timeout_seconds=max(1, int(timeout_s)),
        logger=_client_log_option(),
        **(client_options or {}),
    )
    try:
        with translate_errors(f"read {topic}"):
            reader = client.create_reader(topic, pulsar.MessageId.earliest)
            count = 0
            while (limit is None or count < limit) and reader.has_message_available():
                message = reader.read_next(timeout_millis=int(timeout_s * 1000))
                message_id = message.message_id()
                yield LogMessage(
                    message.data(),
                    LogPosition(message_id.ledger_id(), message_id.entry_id()),
                    message.publish_timestamp(),
                    str(message_id),
                )
                count += 1
            reader.close()
    finally:
        client.close()
