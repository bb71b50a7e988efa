"""pulsar-state: one consistent, replicated state object shared through an Apache Pulsar topic.

The public API is what this module exports; everything in ``pulsar_state._*`` is private.
See the README for the model, the guarantees and the exception tree.
"""

from ._codecs import AvroCodec, BytesCodec, Codec, JsonCodec, StrCodec, StreamingCodec
from ._durable import DurableState, LogMark
from ._envelope import SnapshotManifest
from ._errors import (
    AccessDeniedError,
    ApplyError,
    BrokerError,
    BrokerUnavailableError,
    ClosedError,
    CodecError,
    ConfigurationError,
    CorruptRecordError,
    FencedError,
    ForkedHistoryError,
    OperationTimeoutError,
    PartitionedTopicError,
    PulsarStateError,
    RecordTooLargeError,
    ReplicaHaltedError,
    SchemaMismatchError,
    TopicError,
    UnsafeTopicPolicyError,
    WriteOutcomeUnknownError,
    WriterBusyError,
)
from ._machine import IMMUTABLE_TYPES
from ._manager import SharedStateManager
from ._overlay import DictOverlay
from ._pulsar import LogPosition
from ._sync import BlockingPortal, SyncFacade, SyncSharedStateManager, backstop
from ._types import STATE_MACHINE_OPTIONS, AppliedRecord, ManagerStats, ReplayProgress, WriteResult

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "AppliedRecord",
    "ApplyError",
    "AvroCodec",
    "BlockingPortal",
    "BrokerError",
    "BrokerUnavailableError",
    "BytesCodec",
    "ClosedError",
    "Codec",
    "CodecError",
    "ConfigurationError",
    "CorruptRecordError",
    "DictOverlay",
    "DurableState",
    "FencedError",
    "ForkedHistoryError",
    "JsonCodec",
    "LogMark",
    "LogPosition",
    "ManagerStats",
    "OperationTimeoutError",
    "PartitionedTopicError",
    "PulsarStateError",
    "RecordTooLargeError",
    "ReplayProgress",
    "ReplicaHaltedError",
    "IMMUTABLE_TYPES",
    "STATE_MACHINE_OPTIONS",
    "SchemaMismatchError",
    "SharedStateManager",
    "SnapshotManifest",
    "StrCodec",
    "StreamingCodec",
    "SyncFacade",
    "SyncSharedStateManager",
    "TopicError",
    "UnsafeTopicPolicyError",
    "WriteOutcomeUnknownError",
    "WriteResult",
    "WriterBusyError",
    "backstop",
    "__version__",
]

# Public objects report the public module (``pulsar_state.ClosedError``, not
# ``pulsar_state._errors.ClosedError``) in reprs, tracebacks and docs, as httpx does.
for _name in __all__:
    if not _name.startswith("__") and hasattr(globals()[_name], "__module__"):
        globals()[_name].__module__ = __name__
del _name
