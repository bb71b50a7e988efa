"""The only module that imports ``pulsar``: client, exclusive writer, log reader, error mapping.

Everything Pulsar-specific the rest of the library needs is here, so that a client upgrade or
a behaviour change (exception classes, defaults) is handled in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import pulsar
import pulsar.asyncio as pulsar_asyncio
import pulsar.exceptions as pulsar_exceptions

from ._errors import (
    BrokerError,
    BrokerUnavailableError,
    ClosedError,
    FencedError,
    OperationTimeoutError,
    PulsarStateError,
    RecordTooLargeError,
    TopicError,
    WriterBusyError,
)

__all__ = [
    "LogPosition",
    "PulsarConnection",
    "RawMessage",
    "StateReader",
    "StateWriter",
    "translate_errors",
]

logger = logging.getLogger("pulsar_state")

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


class _ExpectedContention(logging.Filter):
    """Drop the C++ client's warnings for expected writer contention (we log it at DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "existing exclusive producer" not in record.getMessage()


_client_logger = logging.getLogger("pulsar_state.client")
_client_logger.addFilter(_ExpectedContention())


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


def _result_of(exc: BaseException) -> Any | None:
    """Pulsar's result code carried by either flavour of Pulsar exception, else None."""
    if isinstance(exc, pulsar_asyncio.PulsarException):
        return exc.error()
    if isinstance(exc, pulsar_exceptions.PulsarException):
        name = type(exc).__name__
        return getattr(pulsar.Result, name, pulsar.Result.UnknownError)
    return None


def translate(exc: BaseException, context: str, *, creating_writer: bool = False) -> BaseException:
    """Map a Pulsar exception (sync or asyncio flavour) to this library's tree.

    Anything that is not a Pulsar exception is returned unchanged.
    """
    result = _result_of(exc)
    if result is None:
        return exc
    detail = f"{context}: {exc}"
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
    if result in _UNAVAILABLE:
        return BrokerUnavailableError(detail, result=result.name)
    return BrokerError(detail, result=result.name)


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

    def __init__(self, producer: Any, topic: str) -> None:
        self._producer = producer
        self._topic = topic

    async def send(self, payload: bytes, *, key: str) -> LogPosition:
        # Every message is keyed: since Pulsar 3.2 compaction drops keyless messages (PIP-318).
        with translate_errors(f"send to {self._topic}"):
            msg_id = await self._producer.send(payload, partition_key=key)
        return LogPosition(msg_id.ledger_id(), msg_id.entry_id())

    async def close(self) -> None:
        try:
            with translate_errors(f"close writer on {self._topic}"):
                await asyncio.wait_for(self._producer.close(), _CLOSE_TIMEOUT_S)
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
    _BATCH = 1000

    def __init__(self, reader: Any, topic: str) -> None:
        self._async_reader = reader
        self._reader = reader._reader  # the C++ reader under pulsar.asyncio's wrapper
        self._topic = topic
        self._loop = asyncio.get_running_loop()
        self._batches: queue.Queue[list[RawMessage]] = queue.Queue(maxsize=32)
        self._ready = asyncio.Event()
        self._pending: deque[RawMessage] = deque()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"pulsar-state-reader-{topic}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        batch: list[RawMessage] = []
        while not self._stop.is_set():
            try:
                # Block while idle; once a batch has started, take only what is already there.
                msg = self._reader.read_next(0 if batch else self._POLL_MS)
            except pulsar_exceptions.Timeout:
                if batch:
                    self._hand_over(batch)
                    batch = []
                continue
            except Exception as exc:
                if not self._stop.is_set():
                    self._error = translate(exc, f"read from {self._topic}")
                    self._loop.call_soon_threadsafe(self._ready.set)
                return
            mid = msg.message_id()
            # The key is not read: the pump has no use for it, and each call crosses into C++.
            batch.append(RawMessage(msg.data(), LogPosition(mid.ledger_id(), mid.entry_id())))
            if len(batch) >= self._BATCH:
                self._hand_over(batch)
                batch = []

    def _hand_over(self, batch: list[RawMessage]) -> None:
        while not self._stop.is_set():
            try:
                self._batches.put(batch, timeout=0.1)  # bounded: waits while the loop catches up
                break
            except queue.Full:
                continue
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is reading
            self._loop.call_soon_threadsafe(self._ready.set)

    async def read_batch(self) -> list[RawMessage]:
        """The next messages in log order (at least one); waits for them."""
        if self._pending:
            batch = list(self._pending)
            self._pending.clear()
            return batch
        while True:
            try:
                return self._batches.get_nowait()
            except queue.Empty:
                pass
            if self._error is not None:
                raise self._error
            if self._stop.is_set():
                raise ClosedError(f"reader on {self._topic} is closed")
            self._ready.clear()
            try:  # a batch may have arrived between the check and the clear
                return self._batches.get_nowait()
            except queue.Empty:
                await self._ready.wait()

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

    async def close(self) -> None:
        self._stop.set()
        self._ready.set()
        await asyncio.to_thread(self._thread.join, 5.0)
        try:
            with translate_errors(f"close reader on {self._topic}"):
                await asyncio.wait_for(self._async_reader.close(), _CLOSE_TIMEOUT_S)
        except (PulsarStateError, TimeoutError) as exc:
            logger.debug("closing reader on %s: %s", self._topic, exc)


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
        options: dict[str, Any] = {
            "operation_timeout_seconds": max(1, int(operation_timeout_s)),
            "connection_timeout_ms": int(connection_timeout_s * 1000),
            # The C++ client logs to stdout by default; route it to Python logging instead.
            "logger": _client_logger,
        }
        options.update(client_options or {})
        with translate_errors(f"connect to {service_url}"):
            self._client = pulsar_asyncio.Client(service_url, **options)

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
        return conn

    async def create_writer(
        self,
        topic: str,
        *,
        fencing: bool,
        send_timeout_s: float,
        timeout_s: float = 30.0,
    ) -> StateWriter:
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
                producer = await asyncio.wait_for(asyncio.shield(creation), timeout_s)
        except OperationTimeoutError:
            # Creation can hang while the broker fails (apache/pulsar #10721). If it succeeds
            # later, close that producer at once: an orphan would hold exclusivity forever.
            creation.add_done_callback(_close_orphan)
            raise
        except TimeoutError as exc:
            creation.add_done_callback(_close_orphan)
            raise OperationTimeoutError(
                f"acquiring the writer of {topic} took over {timeout_s}s"
            ) from exc
        return StateWriter(producer, topic)

    async def create_reader(
        self,
        topic: str,
        *,
        name: str | None = None,
        after: LogPosition | None = None,
        at: LogPosition | None = None,
        last: bool = False,
    ) -> StateReader:
        """A reader from the start, just ``after`` a message, ``at`` one, or at the ``last``."""
        start = pulsar.MessageId.earliest
        inclusive = False
        if after is not None:
            start = pulsar.MessageId(-1, after.ledger, after.entry, -1)
        elif at is not None:
            start, inclusive = pulsar.MessageId(-1, at.ledger, at.entry, -1), True
        elif last:
            start, inclusive = pulsar.MessageId.latest, True
        with translate_errors(f"open a reader on {topic}"):
            reader = await self._client.create_reader(
                topic,
                start,
                reader_name=name,
                receiver_queue_size=2000,
                start_message_id_inclusive=inclusive,
            )
        return StateReader(reader, topic)

    async def partitions(self, topic: str) -> list[str]:
        with translate_errors(f"look up {topic}"):
            return list(await self._client.get_topic_partitions(topic))

    async def close(self) -> None:
        try:
            with translate_errors("close client"):
                await asyncio.wait_for(self._client.close(), _CLOSE_TIMEOUT_S)
        except (PulsarStateError, TimeoutError) as exc:
            logger.debug("closing client: %s", exc)


def _close_orphan(creation: asyncio.Future[Any]) -> None:
    if creation.cancelled() or creation.exception() is not None:
        return
    producer = creation.result()
    logger.warning("closing a writer whose creation completed after its timeout")
    task = asyncio.ensure_future(producer.close())
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
