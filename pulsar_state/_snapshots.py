"""Snapshots: the state at a position, so that opening replays only the records after it.

Where they live: two side topics next to the state topic, ``<topic>-snapshots`` (the state's
bytes, in chunks of at most ``chunk_bytes``, so no single-message cap applies) and
``<topic>-snapshot-index`` (one small manifest per complete snapshot, written after all its
chunks). Keeping them off the state topic means the log stays a pure sequence of records,
and opening reads only the small index, the chosen snapshot's chunks, and the log's tail.

The state topic is never trimmed by the library: the log stays the source of truth, so a
missing or damaged snapshot falls back to an older one, or to a full replay.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid

from ._admin import AdminClient, TopicName
from ._envelope import (
    SnapshotManifest,
    decode_chunk,
    decode_manifest,
    encode_chunk,
    encode_manifest,
)
from ._errors import CorruptRecordError
from ._pulsar import LogPosition, PulsarConnection, StateWriter

__all__ = ["SnapshotStore"]

logger = logging.getLogger("pulsar_state")


class SnapshotStore:
    """Reads and writes the snapshots of one state topic."""

    def __init__(
        self,
        conn: PulsarConnection,
        admin: AdminClient,
        topic: TopicName,
        *,
        chunk_bytes: int,
        timeout_s: float,
    ) -> None:
        self._conn = conn
        self._admin = admin
        self.data_topic = TopicName.parse(f"{topic}-snapshots")
        self.index_topic = TopicName.parse(f"{topic}-snapshot-index")
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s

    async def manifests(self) -> list[SnapshotManifest]:
        """Every complete snapshot's manifest, oldest first (the index is small)."""
        status, _ = await self._admin.get(self.index_topic.rest_path + "/lastMessageId")
        if status == 404:
            return []
        tail = await self._admin.last_position(self.index_topic)
        if tail is None:
            return []
        reader = await self._conn.create_reader(str(self.index_topic))
        found: list[SnapshotManifest] = []
        try:
            async with asyncio.timeout(self._timeout_s):
                while True:
                    message = await reader.read_next()
                    try:
                        found.append(
                            decode_manifest(message.payload, message_id=str(message.position))
                        )
                    except CorruptRecordError as exc:
                        logger.warning("ignoring a damaged snapshot manifest: %s", exc)
                    if message.position >= tail:
                        return found
        finally:
            await reader.close()

    async def load(self, manifest: SnapshotManifest) -> bytes:
        """The snapshot's bytes, checked chunk by chunk and against its digest."""
        at = LogPosition(manifest.first_chunk_ledger, manifest.first_chunk_entry)
        missing = CorruptRecordError(
            f"snapshot {manifest.snapshot_id}: chunks missing from {self.data_topic}",
            message_id=f"{at.ledger}:{at.entry}",
        )
        tail = await self._admin.last_position(self.data_topic)
        if tail is None or tail < at:
            raise missing
        reader = await self._conn.create_reader(str(self.data_topic), at=at)
        parts: list[bytes] = []
        last_seen: LogPosition | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                while len(parts) < manifest.chunks:
                    if last_seen is not None and last_seen >= tail:
                        raise missing  # the data topic ends before the snapshot's last chunk
                    message = await reader.read_next()
                    last_seen = message.position
                    snapshot_id, index, count, data = decode_chunk(
                        message.payload, message_id=str(message.position)
                    )
                    if snapshot_id != manifest.snapshot_id or count != manifest.chunks:
                        continue  # a chunk of an unfinished snapshot written in between
                    if index != len(parts):
                        raise CorruptRecordError(
                            f"snapshot {snapshot_id}: chunk {index} where {len(parts)} was due",
                            message_id=str(message.position),
                        )
                    parts.append(data)
        finally:
            await reader.close()
        data = b"".join(parts)
        if len(data) != manifest.size or hashlib.sha256(data).hexdigest() != manifest.digest:
            raise CorruptRecordError(
                f"snapshot {manifest.snapshot_id} does not match its digest",
                message_id=f"{at.ledger}:{at.entry}",
            )
        return data

    async def write(
        self,
        data: bytes,
        *,
        position: int,
        record_id: str,
        log_position: LogPosition,
        writer_id: str,
    ) -> SnapshotManifest:
        """Write the chunks, then the manifest. Raises WriterBusyError if another process is
        writing a snapshot right now."""
        snapshot_id = uuid.uuid4().hex
        chunks = [
            data[i : i + self._chunk_bytes] for i in range(0, len(data), self._chunk_bytes)
        ] or [b""]
        data_writer = await self._exclusive_writer(self.data_topic)
        try:
            index_writer = await self._exclusive_writer(self.index_topic)
            try:
                async with asyncio.timeout(self._timeout_s):
                    sends = [
                        asyncio.ensure_future(
                            data_writer.send(
                                encode_chunk(snapshot_id, i, len(chunks), chunk),
                                key=f"{snapshot_id}/{i}",
                            )
                        )
                        for i, chunk in enumerate(chunks)
                    ]
                    positions = await asyncio.gather(*sends)
                    manifest = SnapshotManifest(
                        snapshot_id=snapshot_id,
                        position=position,
                        record_id=record_id,
                        log_ledger=log_position.ledger,
                        log_entry=log_position.entry,
                        size=len(data),
                        chunks=len(chunks),
                        digest=hashlib.sha256(data).hexdigest(),
                        first_chunk_ledger=positions[0].ledger,
                        first_chunk_entry=positions[0].entry,
                        created_at=time.time(),
                        writer_id=writer_id,
                    )
                    # Written last: a snapshot is used only once all its chunks are durable.
                    await index_writer.send(encode_manifest(manifest), key=snapshot_id)
            finally:
                await index_writer.close()
        finally:
            await data_writer.close()
        return manifest

    async def _exclusive_writer(self, topic: TopicName) -> StateWriter:
        # Exclusive: one snapshotting process at a time; another gets WriterBusyError.
        return await self._conn.create_writer(
            str(topic),
            fencing=False,
            name=None,
            send_timeout_s=self._timeout_s,
            timeout_s=self._timeout_s,
        )

    async def latest(self) -> SnapshotManifest | None:
        """The newest manifest (the index topic's last message), or None."""
        status, _ = await self._admin.get(self.index_topic.rest_path + "/lastMessageId")
        if status == 404 or await self._admin.last_position(self.index_topic) is None:
            return None
        reader = await self._conn.create_reader(str(self.index_topic), last=True)
        try:
            async with asyncio.timeout(self._timeout_s):
                # The C++ reader positions a "latest, inclusive" start on this call.
                if not await reader.has_message_available():
                    return None
                message = await reader.read_next()
            return decode_manifest(message.payload, message_id=str(message.position))
        except CorruptRecordError:
            return None
        finally:
            await reader.close()


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
