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

__all__ = ["MAGIC", "Record", "Write", "decode_record", "encode_record", "record_overhead"]

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
