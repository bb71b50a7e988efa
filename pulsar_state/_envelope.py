"""The wire format of a record: the one message that carries one or more writes.

A record is ``MAGIC`` (4 bytes: ``PSR`` and a format version), an Avro body (fastavro,
schemaless) and a CRC-32 of everything before it (4 bytes, big-endian), so that a damaged
message is refused rather than decoded into a plausible but wrong record. The body::

    Record {
        writer_id: string      who sent it (one id per manager instance)
        record_seq: long       per-writer counter; (writer_id, record_seq) is the record id
        base_position: long    how many records the writer's state had accepted
        base_record_id: string the id of the last record accepted at that point ("" if none)
        writes: [ Write { write_seq: long, ops: [bytes] } ]   group commit: many writes, all or none
        meta: {string: string} extension point; unknown keys are ignored
    }

A replica accepts a record only if ``base_position`` and ``base_record_id`` match its own
count of accepted records and its last accepted record id. That compare-and-set, checked the
same way by every replica, makes a stale or fenced writer harmless whatever the broker does.
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import fastavro

from ._errors import CorruptRecordError

__all__ = [
    "MAGIC",
    "Record",
    "SnapshotManifest",
    "Write",
    "decode_chunk",
    "decode_manifest",
    "decode_record",
    "encode_chunk",
    "encode_manifest",
    "encode_record",
    "record_overhead",
]

MAGIC = b"PSR\x01"
_CRC = struct.Struct(">I")

_SCHEMA = fastavro.parse_schema(
    {
        "type": "record",
        "name": "Record",
        "namespace": "pulsar_state.v1",
        "fields": [
            {"name": "writer_id", "type": "string"},
            {"name": "record_seq", "type": "long"},
            {"name": "base_position", "type": "long"},
            {"name": "base_record_id", "type": "string"},
            {
                "name": "writes",
                "type": {
                    "type": "array",
                    "items": {
                        "type": "record",
                        "name": "Write",
                        "fields": [
                            {"name": "write_seq", "type": "long"},
                            {"name": "ops", "type": {"type": "array", "items": "bytes"}},
                        ],
                    },
                },
            },
            {"name": "meta", "type": {"type": "map", "values": "string"}, "default": {}},
        ],
    }
)


@dataclass(frozen=True, slots=True)
class Write:
    """One write: the ops a generator returned, applied together or not at all."""

    write_seq: int
    ops: list[bytes]


@dataclass(frozen=True, slots=True)
class Record:
    """One message on the state topic."""

    writer_id: str
    record_seq: int
    base_position: int
    base_record_id: str
    writes: list[Write]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def record_id(self) -> str:
        return f"{self.writer_id}/{self.record_seq}"


def write_id(writer_id: str, write_seq: int) -> str:
    return f"{writer_id}#{write_seq}"


def encode_record(record: Record) -> bytes:
    buffer = io.BytesIO()
    buffer.write(MAGIC)
    fastavro.schemaless_writer(
        buffer,
        _SCHEMA,
        {
            "writer_id": record.writer_id,
            "record_seq": record.record_seq,
            "base_position": record.base_position,
            "base_record_id": record.base_record_id,
            "writes": [{"write_seq": w.write_seq, "ops": w.ops} for w in record.writes],
            "meta": record.meta,
        },
    )
    buffer.write(_CRC.pack(zlib.crc32(buffer.getbuffer())))
    return buffer.getvalue()


def record_overhead(writer_id: str) -> int:
    """Bytes a record takes beyond its ops, generously: for size checks before encoding."""
    return len(MAGIC) + _CRC.size + 3 * len(writer_id) + 64


def decode_record(payload: bytes, *, message_id: str) -> Record:
    """Decode a record, or raise :class:`CorruptRecordError` naming the message."""
    if not payload.startswith(MAGIC):
        if payload[:3] == MAGIC[:3]:
            reason = f"record format version {payload[3:4]!r} is newer than this library knows"
        else:
            reason = "not a pulsar-state record (foreign message or damaged header)"
        raise CorruptRecordError(f"message {message_id}: {reason}", message_id=message_id)
    end = len(payload) - _CRC.size
    if end < len(MAGIC) or _CRC.unpack_from(payload, end)[0] != zlib.crc32(payload[:end]):
        raise CorruptRecordError(
            f"message {message_id}: damaged pulsar-state record (checksum mismatch)",
            message_id=message_id,
        )
    buffer = io.BytesIO(payload[:end])
    buffer.seek(len(MAGIC))
    try:
        body: Any = fastavro.schemaless_reader(buffer, _SCHEMA, None)
        if buffer.tell() != end:
            raise ValueError(f"{end - buffer.tell()} trailing bytes")
        return Record(
            writer_id=body["writer_id"],
            record_seq=body["record_seq"],
            base_position=body["base_position"],
            base_record_id=body["base_record_id"],
            writes=[Write(w["write_seq"], list(w["ops"])) for w in body["writes"]],
            meta=dict(body["meta"]),
        )
    except CorruptRecordError:
        raise
    except Exception as exc:  # fastavro raises many types on damaged input
        raise CorruptRecordError(
            f"message {message_id}: damaged pulsar-state record ({type(exc).__name__}: {exc})",
            message_id=message_id,
        ) from exc


# ---------------------------------------------------------------- snapshots
#
# A snapshot is a run of chunk messages on the snapshot data topic, then one manifest message
# on the snapshot index topic. The manifest is written last: a snapshot without one (a process
# died half-way) is never used.

CHUNK_MAGIC = b"PSC\x01"
MANIFEST_MAGIC = b"PSM\x01"
_CHUNK_HEADER = struct.Struct(">16sII")  # snapshot id (uuid bytes), chunk index, chunk count


@dataclass(frozen=True, slots=True)
class SnapshotManifest:
    """Describes one complete snapshot: what it covers and where its chunks are."""

    snapshot_id: str  # 32 hex digits
    position: int  # records accepted in the state it holds
    record_id: str  # the last accepted record at that point
    log_ledger: int  # the main topic's last message covered: the replay resumes after it
    log_entry: int
    size: int  # bytes of the encoded state
    chunks: int
    digest: str  # sha256 of the encoded state
    first_chunk_ledger: int  # where its first chunk is on the data topic
    first_chunk_entry: int
    created_at: float
    writer_id: str


def encode_manifest(manifest: SnapshotManifest) -> bytes:
    import dataclasses
    import json

    body = MANIFEST_MAGIC + json.dumps(dataclasses.asdict(manifest), sort_keys=True).encode()
    return body + _CRC.pack(zlib.crc32(body))


def decode_manifest(payload: bytes, *, message_id: str) -> SnapshotManifest:
    import json

    end = len(payload) - _CRC.size
    if (
        not payload.startswith(MANIFEST_MAGIC)
        or end < len(MANIFEST_MAGIC)
        or _CRC.unpack_from(payload, end)[0] != zlib.crc32(payload[:end])
    ):
        raise CorruptRecordError(
            f"message {message_id}: not a valid snapshot manifest", message_id=message_id
        )
    try:
        return SnapshotManifest(**json.loads(payload[len(MANIFEST_MAGIC) : end]))
    except (TypeError, ValueError) as exc:
        raise CorruptRecordError(
            f"message {message_id}: damaged snapshot manifest ({exc})", message_id=message_id
        ) from exc


def encode_chunk(snapshot_id: str, index: int, count: int, data: bytes) -> bytes:
    header = CHUNK_MAGIC + _CHUNK_HEADER.pack(bytes.fromhex(snapshot_id), index, count)
    crc = zlib.crc32(data, zlib.crc32(header))
    return b"".join((header, data, _CRC.pack(crc)))


def decode_chunk(payload: bytes, *, message_id: str) -> tuple[str, int, int, bytes]:
    """(snapshot id, index, count, data) of a chunk, or CorruptRecordError."""
    start = len(CHUNK_MAGIC) + _CHUNK_HEADER.size
    end = len(payload) - _CRC.size
    if (
        not payload.startswith(CHUNK_MAGIC)
        or end < start
        or _CRC.unpack_from(payload, end)[0] != zlib.crc32(memoryview(payload)[:end])
    ):
        raise CorruptRecordError(
            f"message {message_id}: not a valid snapshot chunk", message_id=message_id
        )
    raw_id, index, count = _CHUNK_HEADER.unpack_from(payload, len(CHUNK_MAGIC))
    return raw_id.hex(), index, count, payload[start:end]
