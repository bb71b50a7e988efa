"""The wire format of a record: the one message that carries one or more writes.

A record is ``MAGIC`` (4 bytes: ``PSR`` and a format version), a body, and a CRC-32 of
everything before it (4 bytes, big-endian), so that a damaged message is refused rather than
decoded into a plausible but wrong record. The body, all integers big-endian::

    record_seq: i64, base_position: i64, len(writer_id): u16, len(base_record_id): u16,
    writes: u32, then writer_id and base_record_id (UTF-8), then for each write:
        write_seq: i64, ops: u32, then for each op: length u32 and its bytes,
    then meta: count u16 and for each entry: key length u16, value length u32, key, value.

``writer_id`` sent the record (one id per manager instance); ``(writer_id, record_seq)`` is
the record id; ``base_position`` and ``base_record_id`` are how many records the writer's
state had accepted and the last of them; each write holds the ops of one generator run
(group commit: many writes, all applied or none); ``meta`` is an extension point.

A hand-written layout rather than fastavro: this header is on every record's hot path, and
struct is about five times faster here. fastavro stays for ops and values, which carry user
schemas.

A replica accepts a record only if ``base_position`` and ``base_record_id`` match its own
count of accepted records and its last accepted record id. That compare-and-set, checked the
same way by every replica, makes a stale or fenced writer harmless whatever the broker does.
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    "message_fingerprint",
    "record_overhead",
    "write_size",
]

MAGIC = b"PSR\x01"
_CRC = struct.Struct(">I")

_HEAD = struct.Struct(">qqHHI")
_WRITE = struct.Struct(">qI")
_U32 = struct.Struct(">I")
_META = struct.Struct(">HI")
_U16 = struct.Struct(">H")


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
    # Derived, made once: it is read several times per record on the writer's path.
    record_id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "record_id", f"{self.writer_id}/{self.record_seq}")


def write_id(writer_id: str, write_seq: int) -> str:
    return f"{writer_id}#{write_seq}"


def encode_record(record: Record) -> bytes:
    writer = record.writer_id.encode()
    base = record.base_record_id.encode()
    parts = [
        MAGIC,
        _HEAD.pack(
            record.record_seq, record.base_position, len(writer), len(base), len(record.writes)
        ),
        writer,
        base,
    ]
    for write in record.writes:
        parts.append(_WRITE.pack(write.write_seq, len(write.ops)))
        for op in write.ops:
            parts.append(_U32.pack(len(op)))
            parts.append(op)
    parts.append(_U16.pack(len(record.meta)))
    for key, value in record.meta.items():
        raw_key, raw_value = key.encode(), value.encode()
        parts += [_META.pack(len(raw_key), len(raw_value)), raw_key, raw_value]
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def record_overhead(writer_id: str, base_record_id: str) -> int:
    """The bytes of a record (without meta) besides its writes: its size is this plus each
    write's :func:`write_size`, exactly."""
    return (
        len(MAGIC)
        + _HEAD.size
        + len(writer_id.encode())
        + len(base_record_id.encode())
        + _U16.size
        + _CRC.size
    )


def write_size(ops: Sequence[bytes]) -> int:
    """The bytes a write of these encoded ops takes in a record."""
    return _WRITE.size + sum(_U32.size + len(op) for op in ops)


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
    try:
        record_seq, base_position, writer_len, base_len, count = _HEAD.unpack_from(payload, 4)
        offset = 4 + _HEAD.size
        writer_id = payload[offset : offset + writer_len].decode()
        offset += writer_len
        base_record_id = payload[offset : offset + base_len].decode()
        offset += base_len
        writes = []
        for _ in range(count):
            write_seq, ops_count = _WRITE.unpack_from(payload, offset)
            offset += _WRITE.size
            ops = []
            for _ in range(ops_count):
                (size,) = _U32.unpack_from(payload, offset)
                offset += 4
                if offset + size > end:
                    raise ValueError("op runs past the end of the record")
                ops.append(payload[offset : offset + size])
                offset += size
            writes.append(Write(write_seq, ops))
        (meta_count,) = _U16.unpack_from(payload, offset)
        offset += 2
        meta = {}
        for _ in range(meta_count):
            key_len, value_len = _META.unpack_from(payload, offset)
            offset += _META.size
            key = payload[offset : offset + key_len].decode()
            offset += key_len
            meta[key] = payload[offset : offset + value_len].decode()
            offset += value_len
        if offset != end:
            raise ValueError(f"{end - offset} bytes left over")
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CorruptRecordError(
            f"message {message_id}: damaged pulsar-state record ({type(exc).__name__}: {exc})",
            message_id=message_id,
        ) from exc
    return Record(writer_id, record_seq, base_position, base_record_id, writes, meta)


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
    # The incarnation of the state topic it describes (None in manifests written before they
    # existed): the first message of the log and the covered message (log_ledger:log_entry),
    # each by position and record id. A topic deleted and created again under the same name
    # has other ledgers and other record ids, so a snapshot of the old one never matches it.
    log_first_ledger: int | None = None
    log_first_entry: int | None = None
    log_first_record: str | None = None
    log_covered_record: str | None = None
    # The id of the history's first record (None: not known to the writer, or an older
    # manifest). It outlives trimming, unlike log_first_*: a store whose own mark was trimmed
    # away proves with it that it holds an earlier state of this very history.
    log_origin: str | None = None
    # The records ignored as stale before record_id that may still have a chain built on
    # them, with the positions they claimed (see LogMark.stale): a replica resuming after
    # log_ledger:log_entry does not read them again. Empty in older manifests.
    log_stale: tuple[tuple[str, int], ...] = ()


_MANIFEST_FIELDS = frozenset(SnapshotManifest.__dataclass_fields__)
# Each field's accepted JSON types (None allowed where the field has a default of None).
_MANIFEST_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("snapshot_id", "record_id", "digest", "writer_id"), (str,)),
    **dict.fromkeys(
        (
            "position",
            "log_ledger",
            "log_entry",
            "size",
            "chunks",
            "first_chunk_ledger",
            "first_chunk_entry",
        ),
        (int,),
    ),
    "created_at": (int, float),
    "log_stale": (tuple,),
    **dict.fromkeys(("log_first_ledger", "log_first_entry"), (int, type(None))),
    **dict.fromkeys(("log_first_record", "log_covered_record", "log_origin"), (str, type(None))),
}


_HEX32 = re.compile("[0-9a-f]{32}")
_HEX64 = re.compile("[0-9a-f]{64}")


def _check_manifest(manifest: SnapshotManifest) -> None:
    for name, allowed in _MANIFEST_TYPES.items():
        value = getattr(manifest, name)
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise TypeError(f"field {name} is {value!r}")
    for pair in manifest.log_stale:
        if not (
            isinstance(pair, tuple)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and type(pair[1]) is int
        ):
            raise TypeError(f"field log_stale holds {pair!r}, not a (record id, position)")
    # Chunks carry the id as 16 bytes; the digest is checked as SHA-256 hex.
    if not _HEX32.fullmatch(manifest.snapshot_id) or not _HEX64.fullmatch(manifest.digest):
        raise ValueError(f"snapshot id {manifest.snapshot_id!r} or digest {manifest.digest!r}")
    # A snapshot has at least one chunk (an empty state: one empty chunk): with none, its
    # size and digest would never be checked and it would load as no bytes at all.
    if manifest.chunks < 1 or manifest.size < 0 or manifest.position < 0:
        raise ValueError(
            f"{manifest.chunks} chunks, {manifest.size} bytes, position {manifest.position}"
        )


def message_fingerprint(payload: bytes, *, message_id: str) -> str:
    """What identifies a log message besides its position: its record id, or for a message
    that is not a valid record, a digest of its bytes."""
    try:
        return decode_record(payload, message_id=message_id).record_id
    except CorruptRecordError:
        return "sha256:" + hashlib.sha256(payload).hexdigest()[:32]


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
        fields = json.loads(payload[len(MANIFEST_MAGIC) : end])
        if isinstance(fields.get("log_stale"), list):  # JSON lists, hashable again
            fields["log_stale"] = tuple(
                tuple(pair) if isinstance(pair, list) else pair for pair in fields["log_stale"]
            )
        # Fields a newer version added are ignored: what this version checks stays checked.
        manifest = SnapshotManifest(**{k: v for k, v in fields.items() if k in _MANIFEST_FIELDS})
        _check_manifest(manifest)  # a field of another type would fail later, elsewhere
        return manifest
    except (TypeError, ValueError, AttributeError) as exc:
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
