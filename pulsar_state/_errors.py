"""The exceptions of pulsar-state: one tree, rooted at :class:`PulsarStateError`.

::

    PulsarStateError                      root; ``retriable`` says whether retrying may help
    ├── ConfigurationError                bad arguments (ValueError too)
    ├── TopicError                        the topic cannot hold replicated state
    │   ├── PartitionedTopicError         partitioned topics have no total order
    │   └── UnsafeTopicPolicyError        retention / compaction / deletion would lose history
    ├── BrokerError                       the broker refused or failed a call (retriable)
    │   ├── BrokerUnavailableError        cannot connect / lookup failed (retriable)
    │   └── AccessDeniedError             no or bad credentials (401) or no permission (403)
    ├── OperationTimeoutError             a call did not finish in time (a TimeoutError; retriable)
    ├── WriterBusyError                   another process holds the topic's writer (retriable)
    ├── FencedError                       this process's writer was taken over (retriable)
    ├── WriteOutcomeUnknownError          a write was sent but its fate is not known yet
    ├── RecordTooLargeError               a write does not fit in one message
    ├── CodecError                        a value or op cannot be encoded / decoded
    │   └── SchemaMismatchError           data written with an incompatible or unknown schema
    ├── ApplyError                        the ``apply`` function raised on an op
    ├── CorruptRecordError                a message on the topic is not a valid record
    ├── ForkedHistoryError                a record proves two histories of one topic
    ├── ReplicaHaltedError                this replica stopped applying (see ``__cause__``)
    └── ClosedError                       the manager is closed

A generator passed to ``write`` that raises makes that write fail with the generator's own
exception, unchanged: it is the caller's error, not the library's. (A BaseException that is
not an Exception, such as the CancelledError of a cancelled future's ``result()``, comes
wrapped in a PulsarStateError, so that it ends that write only; KeyboardInterrupt and
SystemExit propagate.)
"""

from __future__ import annotations

__all__ = [
    "AccessDeniedError",
    "ApplyError",
    "BrokerError",
    "BrokerUnavailableError",
    "ClosedError",
    "CodecError",
    "ConfigurationError",
    "CorruptRecordError",
    "FencedError",
    "ForkedHistoryError",
    "OperationTimeoutError",
    "PartitionedTopicError",
    "PulsarStateError",
    "RecordTooLargeError",
    "ReplicaHaltedError",
    "SchemaMismatchError",
    "TopicError",
    "UnsafeTopicPolicyError",
    "WriteOutcomeUnknownError",
    "WriterBusyError",
    "callback_error",
]


class PulsarStateError(Exception):
    """Root of every error raised by pulsar-state.

    ``retriable`` is true when the same call may succeed if made again later (a timeout, a busy
    writer, a broker restart); false when retrying cannot help without a change (bad input,
    a corrupt topic, a closed manager).
    """

    retriable: bool = False


class ConfigurationError(PulsarStateError, ValueError):
    """An argument or setting is invalid."""


class TopicError(PulsarStateError):
    """The topic cannot hold replicated state as configured."""

    def __init__(self, message: str, *, topic: str) -> None:
        super().__init__(message)
        self.topic = topic


class PartitionedTopicError(TopicError):
    """The topic is partitioned; replicated state needs one totally ordered log."""


class UnsafeTopicPolicyError(TopicError):
    """Retention, compaction or inactive-topic deletion would lose the topic's history."""


class BrokerError(PulsarStateError):
    """The broker failed or refused a call. ``result`` is Pulsar's result name, if known."""

    retriable = True

    def __init__(self, message: str, *, result: str | None = None) -> None:
        super().__init__(message)
        self.result = result


class BrokerUnavailableError(BrokerError):
    """The broker could not be reached."""


class AccessDeniedError(BrokerError):
    """The broker refused the credentials (none, invalid, expired) or the role's permission.

    Not retriable: only new credentials or a grant can help.
    """

    retriable = False


class OperationTimeoutError(PulsarStateError, TimeoutError):
    """A call did not complete within its timeout. Nothing it would have written was written."""

    retriable = True


class WriterBusyError(PulsarStateError):
    """Another process held the topic's exclusive writer for the whole acquisition timeout
    (or, for a snapshot, this replica is still loading one, or encoding one that timed out)."""

    retriable = True


class FencedError(PulsarStateError):
    """This process's exclusive writer was fenced by another process taking over."""

    retriable = True


class WriteOutcomeUnknownError(PulsarStateError):
    """A write reached the broker (or may have) but its outcome was not seen in time.

    The write either committed exactly once or not at all; it never commits twice. Wait for the
    manager to catch up (``read(..., latest=True)``) and inspect the state to tell which.
    """

    def __init__(self, message: str, *, write_id: str) -> None:
        super().__init__(message)
        self.write_id = write_id


class RecordTooLargeError(PulsarStateError):
    """A write's encoded size exceeds ``max_record_bytes``; nothing was sent."""

    def __init__(self, message: str, *, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class CodecError(PulsarStateError):
    """A value or an op could not be encoded or decoded."""


class SchemaMismatchError(CodecError):
    """Data was written with a schema this reader does not know or cannot resolve."""


class ApplyError(PulsarStateError):
    """The ``apply`` function raised. On a writer the write is refused before it is sent."""


class CorruptRecordError(PulsarStateError):
    """A message on the state topic is not a valid pulsar-state record (foreign or damaged)."""

    def __init__(self, message: str, *, message_id: str) -> None:
        super().__init__(message)
        self.message_id = message_id


class ForkedHistoryError(PulsarStateError):
    """A record was written on a history this replica does not have: its base is ahead of
    this replica, or at the same position with a different last record. The replica halts
    (this is the ``__cause__`` of its :class:`ReplicaHaltedError`)."""

    def __init__(self, message: str, *, message_id: str) -> None:
        super().__init__(message)
        self.message_id = message_id


class ReplicaHaltedError(PulsarStateError):
    """This replica stopped applying records; its state stays at the last good position.

    The reason is in ``__cause__`` (for example a :class:`CorruptRecordError`).
    """

    def __init__(self, message: str, *, position: int) -> None:
        super().__init__(message)
        self.position = position


class ClosedError(PulsarStateError):
    """The manager (or map) is closed."""


def callback_error(exc: BaseException, what: str) -> Exception:
    """The error a write ends with when the caller's ``what`` (its generator, its reader)
    raised ``exc``: ``exc`` itself when it is an Exception. Any other BaseException (the
    CancelledError of a cancelled future's ``result()``, a GeneratorExit) is wrapped in a
    PulsarStateError, so that it ends that write only and not the task that ran the code
    (the writer's loop, the replica's pump, which would stop unseen). KeyboardInterrupt and
    SystemExit are raised again: the process is stopping."""
    if isinstance(exc, Exception):
        return exc
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        raise exc
    error = PulsarStateError(f"{what} raised {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
