"""Snapshots: open from the newest good one, fall back safely, and catch non-determinism."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pulsar_state import (
    CodecError,
    JsonCodec,
    OperationTimeoutError,
    PulsarStateError,
    ReplayProgress,
    ReplicaHaltedError,
    SharedStateManager,
    SnapshotManifest,
    WriterBusyError,
    _snapshots,
)
from pulsar_state._envelope import encode_chunk, encode_manifest
from pulsar_state._pulsar import RawMessage, ReopeningReader
from tests.core.helpers import Counter, apply_counter, counter_manager, incr, raw_producer
from tests.support.broker import REPO, Broker, admin_request

json_state = {"snapshot_codec": JsonCodec()}


async def write_increments(manager: Any, count: int, prefix: str) -> None:
    await asyncio.gather(
        *(manager.write(lambda s, i=i: [incr(f"{prefix}{i}")]) for i in range(count))
    )


async def test_snapshot_plus_tail_equals_full_replay(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(
        service_url, topic, admin_url, max_writes_per_record=1, **json_state
    ) as writer:
        await write_increments(writer, 60, "a")
        manifest = await writer.snapshot()
        assert manifest.position == 60
        await write_increments(writer, 25, "b")
        expected = await writer.read(lambda s: s, latest=True)
    reports: list[ReplayProgress] = []
    async with (
        counter_manager(
            service_url, topic, admin_url, on_progress=reports.append, **json_state
        ) as from_snapshot,
        counter_manager(
            service_url, topic, admin_url, load_snapshot=False, **json_state
        ) as full_replay,
    ):
        assert from_snapshot.stats.snapshot_loaded_position == 60
        assert from_snapshot.stats.records_read == 25  # only the tail was replayed
        # Progress counts the work left after the snapshot, not the whole history.
        assert reports[-1].done
        assert reports[-1].snapshot_position == 60
        assert (reports[-1].records_read, reports[-1].records_total) == (25, 25)
        assert full_replay.stats.records_read == 85
        for replica in (from_snapshot, full_replay):
            assert replica.position == 85
            assert await replica.read(lambda s: s) == expected
        assert full_replay.stats.determinism_failures == 0
        # Both keep working as ordinary replicas.
        await from_snapshot.write(lambda s: [incr("c")])
        assert await full_replay.read(lambda s: s["count"], latest=True) == 86


async def test_automatic_snapshots_by_record_count(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with counter_manager(
        service_url, topic, admin_url, snapshot_every_records=20, **json_state
    ) as writer:
        for i in range(65):
            await writer.write(lambda s, i=i: [incr(f"x{i}")])
        # A snapshot is taken while writes go on, so it covers some position past the one
        # that triggered it: at least one after 20 records, another 20 or more after that.
        for _ in range(50):
            if writer.stats.snapshots_written >= 2:
                break
            await asyncio.sleep(0.1)
        assert writer.stats.snapshots_written >= 2
    async with counter_manager(service_url, topic, admin_url, **json_state) as reader:
        assert reader.stats.snapshot_loaded_position is not None
        assert reader.stats.snapshot_loaded_position >= 40
        assert await reader.read(lambda s: s["count"]) == 65


async def two_snapshots(
    service_url: str, topic: str, admin_url: str
) -> tuple[SnapshotManifest, SnapshotManifest, Any]:
    """Writes, a snapshot, writes, a newer snapshot, writes: (older, newest, final state)."""
    async with counter_manager(service_url, topic, admin_url, **json_state) as writer:
        await write_increments(writer, 10, "a")
        older = await writer.snapshot()
        await write_increments(writer, 10, "b")
        newest = await writer.snapshot()
        await write_increments(writer, 5, "c")
        return older, newest, await writer.read(lambda s: s, latest=True)


async def test_corrupt_newest_snapshot_falls_back_to_older_one(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    older, newest, expected = await two_snapshots(service_url, topic, admin_url)
    # A manifest whose digest does not match its chunks, and a damaged index message.
    forged = SnapshotManifest(**{**_fields(newest), "position": 22, "digest": "0" * 64})
    async with raw_producer(service_url, topic + "-snapshot-index") as producer:
        await producer.send(encode_manifest(forged), partition_key="forged")
        await producer.send(b"not a manifest", partition_key="junk")
    with caplog.at_level(logging.WARNING, logger="pulsar_state"):
        async with counter_manager(service_url, topic, admin_url, **json_state) as replica:
            assert replica.stats.snapshot_loaded_position == newest.position
            assert await replica.read(lambda s: s) == expected
    assert "unusable, falling back" in caplog.text
    assert "damaged snapshot manifest" in caplog.text or "not a valid" in caplog.text
    assert older.position < newest.position


async def test_the_snapshot_at_the_highest_position_is_loaded_not_the_last_written(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A lagging replica (or one that encodes slowly) writes a snapshot of an older position
    # after a newer one. Before: opening loaded the one written last and replayed more; with
    # trim_history, whose trim point follows the newest positions, it found that one's
    # covered message trimmed and warned of a topic created again (review 45b F5).
    older, newest, expected = await two_snapshots(service_url, topic, admin_url)
    late = SnapshotManifest(**{**_fields(older), "writer_id": "lagging", "created_at": 1.0})
    async with raw_producer(service_url, topic + "-snapshot-index") as producer:
        await producer.send(encode_manifest(late), partition_key="late")
    async with counter_manager(service_url, topic, admin_url, **json_state) as replica:
        assert replica.stats.snapshot_loaded_position == newest.position
        assert await replica.read(lambda s: s) == expected
    assert older.position < newest.position


class _SlowCodec(JsonCodec):
    """Encodes slowly while ``slow`` is set, counting the encodes under way at once."""

    def __init__(self) -> None:
        super().__init__()
        self.slow, self.idle = threading.Event(), threading.Event()
        self.running = self.most = 0

    def encode(self, value: Any) -> bytes:
        self.idle.clear()
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.slow.is_set():
                time.sleep(1.0)
            return super().encode(value)
        finally:
            self.running -= 1
            if not self.running:
                self.idle.set()


async def test_a_snapshot_that_timed_out_encoding_blocks_the_next_until_its_thread_ends(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A worker thread cannot be stopped: before, each retry started another copy and encode
    # beside the ones still running (four at once in review 45b F3's run), so a state that
    # took longer to encode than the timeout piled up copies and never got a snapshot.
    codec = _SlowCodec()
    async with counter_manager(service_url, topic, admin_url, snapshot_codec=codec) as manager:
        await write_increments(manager, 5, "a")
        codec.slow.set()
        with pytest.raises(OperationTimeoutError, match="took over"):
            await manager.snapshot(timeout=0.2)
        for _ in range(3):
            with pytest.raises(WriterBusyError, match="still encoding"):
                await manager.snapshot(timeout=0.2)
        codec.slow.clear()
        # The timed-out attempt's thread ends on its own.
        assert await asyncio.to_thread(codec.idle.wait, 10)
        assert (await manager.snapshot(timeout=30)).position == manager.position
    assert codec.most == 1


async def test_the_trim_after_a_snapshot_keeps_to_the_snapshot_timeout(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the trim ran after the timeout's scope: snapshot(timeout=T) took T plus as long
    # as reading the snapshot index took (up to open_timeout_s; review 45b F4). A trim slowed
    # down here stands for a slow index read.
    trim = _snapshots.SnapshotPolicy.trim

    async def slow_trim(self: Any) -> Any:
        await asyncio.sleep(20)
        return await trim(self)

    monkeypatch.setattr(_snapshots.SnapshotPolicy, "trim", slow_trim)
    async with counter_manager(
        service_url, topic, admin_url, trim_history=True, **json_state
    ) as manager:
        await write_increments(manager, 5, "a")
        started = time.monotonic()
        manifest = await manager.snapshot(timeout=2.0)  # the snapshot stands, untrimmed
        assert time.monotonic() - started < 10
        assert manifest.position == manager.position


async def test_an_automatic_snapshot_trims_within_a_bound_of_its_own(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Within the snapshot's own timeout (write_timeout_s), a snapshot taking most of it left
    # its trim none, and the history was never trimmed (the review of the trim-timeout fix).
    trim, trimmed = _snapshots.SnapshotPolicy.trim, asyncio.Event()

    async def slow_trim(self: Any) -> Any:
        await asyncio.sleep(4)  # longer than write_timeout_s
        result = await trim(self)
        trimmed.set()
        return result

    monkeypatch.setattr(_snapshots.SnapshotPolicy, "trim", slow_trim)
    async with counter_manager(
        service_url,
        topic,
        admin_url,
        trim_history=True,
        snapshot_every_records=1,
        write_timeout_s=3.0,
        **json_state,
    ) as manager:
        await manager.write(lambda s: [incr()])
        await asyncio.wait_for(trimmed.wait(), 30)


def _fields(manifest: SnapshotManifest) -> dict[str, Any]:
    return {name: getattr(manifest, name) for name in manifest.__slots__}  # type: ignore[attr-defined]


async def test_missing_chunks_fall_back_to_full_replay(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with counter_manager(service_url, topic, admin_url, **json_state) as writer:
        await write_increments(writer, 12, "a")
        real = await writer.snapshot()
        expected = await writer.read(lambda s: s, latest=True)
    # A manifest pointing past the end of the data topic: its chunks never arrived.
    ghost = SnapshotManifest(
        **{
            **_fields(real),
            "snapshot_id": "f" * 32,
            "first_chunk_entry": real.first_chunk_entry + 99,
        }
    )
    async with raw_producer(service_url, topic + "-snapshot-index") as producer:
        await producer.send(encode_manifest(ghost), partition_key="ghost")
    with caplog.at_level(logging.WARNING, logger="pulsar_state"):
        async with counter_manager(service_url, topic, admin_url, **json_state) as replica:
            assert replica.stats.snapshot_loaded_position == real.position  # the older one
            assert await replica.read(lambda s: s) == expected
    assert "chunks missing" in caplog.text


async def test_a_chunk_stored_twice_is_read_once(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The client sends again what the broker stored but did not acknowledge (a reconnect),
    # in order, from the first unacknowledged: a chunk can come twice, even after the next.
    async with counter_manager(service_url, topic, admin_url, **json_state) as writer:
        await write_increments(writer, 10, "a")
        real = await writer.snapshot()
        expected = await writer.read(lambda s: s, latest=True)
        data = await writer._snapshots._store.load(real)
    snapshot_id = uuid.uuid4().hex
    parts = [data[: len(data) // 2], data[len(data) // 2 :]]
    async with raw_producer(service_url, topic + "-snapshots") as producer:
        first = await producer.send(encode_chunk(snapshot_id, 0, 2, parts[0]))
        for index in (0, 1, 0, 1):
            await producer.send(encode_chunk(snapshot_id, index, 2, parts[index]))
    twice = dataclasses.replace(
        real,
        snapshot_id=snapshot_id,
        chunks=2,
        first_chunk_ledger=first.ledger_id(),
        first_chunk_entry=first.entry_id(),
        created_at=time.time(),
    )
    async with raw_producer(service_url, topic + "-snapshot-index") as producer:
        await producer.send(encode_manifest(twice))
    with caplog.at_level(logging.WARNING, logger="pulsar_state"):
        async with counter_manager(service_url, topic, admin_url, **json_state) as replica:
            assert replica.stats.snapshot_loaded_position == real.position
            assert await replica.read(lambda s: s) == expected
    assert "falling back" not in caplog.text


async def test_replica_with_nondeterministic_apply_is_reported(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with counter_manager(service_url, topic, admin_url, **json_state) as writer:
        await write_increments(writer, 8, "a")
        await writer.snapshot()

    def drifting_apply(state: Counter, op: dict[str, Any]) -> None:
        apply_counter(state, op)
        state["clock"] = time.monotonic()  # differs on every replica

    with caplog.at_level(logging.ERROR, logger="pulsar_state"):
        async with counter_manager(
            service_url, topic, admin_url, apply=drifting_apply, load_snapshot=False, **json_state
        ) as replica:
            assert replica.stats.determinism_failures == 1
    assert "DETERMINISM CHECK FAILED" in caplog.text


class BlobCodec:
    """dict[str, bytes] <-> length-prefixed binary, for big states without JSON overhead."""

    def encode(self, state: dict[str, bytes]) -> bytes:
        parts = []
        for key in sorted(state):
            raw = key.encode()
            parts += [struct.pack(">II", len(raw), len(state[key])), raw, state[key]]
        return b"".join(parts)

    def decode(self, data: bytes) -> dict[str, bytes]:
        state, offset, view = {}, 0, memoryview(data)
        while offset < len(data):
            key_len, value_len = struct.unpack_from(">II", data, offset)
            offset += 8
            key = bytes(view[offset : offset + key_len]).decode()
            offset += key_len
            state[key] = bytes(view[offset : offset + value_len])
            offset += value_len
        return state


class BlobOpCodec:
    def encode(self, op: tuple[str, bytes]) -> bytes:
        return op[0].encode() + b"\x00" + op[1]

    def decode(self, data: bytes) -> tuple[str, bytes]:
        key, _, value = data.partition(b"\x00")
        return key.decode(), value


def apply_blob(state: dict[str, bytes], op: tuple[str, bytes]) -> None:
    state[op[0]] = op[1]


@pytest.mark.slow
async def test_100_mb_state_round_trips(service_url: str, admin_url: str, topic: str) -> None:
    options: dict[str, Any] = {
        "initial_state": dict,
        "apply": apply_blob,
        "codec": BlobOpCodec(),
        "snapshot_codec": BlobCodec(),
        "copy_state": dict.copy,  # values are immutable bytes: a shallow copy is enough
        "write_timeout_s": 120,
        "open_timeout_s": 300,
    }
    value_size, count = 800_000, 126  # about 100 MB in one state
    async with counter_manager(service_url, topic, admin_url, **options) as writer:
        for start in range(0, count, 6):
            await asyncio.gather(
                *(
                    writer.write(
                        lambda s, i=i: [(f"k{i:04d}", os.urandom(16) * (value_size // 16))]
                    )
                    for i in range(start, min(count, start + 6))
                )
            )
        manifest = await writer.snapshot(timeout=300)
        digest = await writer.read(lambda s: BlobCodec().encode(s))
    assert manifest.size >= 100_000_000
    assert manifest.chunks >= 96
    async with counter_manager(service_url, topic, admin_url, **options) as replica:
        assert replica.stats.snapshot_loaded_position == count
        assert await replica.read(lambda s: BlobCodec().encode(s)) == digest


@pytest.mark.slow
async def test_process_killed_during_snapshot_loses_nothing(
    broker: Broker, topic: str, tmp_path: Path
) -> None:
    """A snapshotting process dies half-way: no manifest, so nothing uses the partial one."""
    script = tmp_path / "snapshotter.py"
    script.write_text(
        "import asyncio, sys\n"
        "from tests.core.helpers import counter_manager, incr\n"
        "from pulsar_state import JsonCodec\n"
        "async def main():\n"
        f"    async with counter_manager({broker.service_url!r}, {topic!r}, {broker.admin_url!r},"
        " snapshot_codec=JsonCodec(), snapshot_chunk_bytes=8192, write_timeout_s=120) as m:\n"
        "        await m.write(lambda s: [incr('first')])\n"
        "        await m.snapshot()\n"
        "        for i in range(20):\n"
        "            pad = {'op': 'set', 'key': f'pad{i}', 'value': 'x' * 900_000}\n"
        "            await m.write(lambda s, pad=pad: [pad])\n"
        "        await m.write(lambda s: [incr('second')])\n"
        "        print('snapshotting', flush=True)\n"
        "        await m.snapshot(timeout=120)\n"
        "        print('done', flush=True)\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once; the test waits on its output
        [sys.executable, str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "snapshotting"
    await asyncio.sleep(0.2)  # some of its ~2,200 chunks are out, not all
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    async with counter_manager(
        broker.service_url, topic, broker.admin_url, **json_state
    ) as replica:
        assert replica.stats.snapshot_loaded_position == 1  # the complete, older one
        state = await replica.read(lambda s: s)
        assert state["count"] == 2
        assert state["seen"] == {"first": 1, "second": 1}
        assert all(len(state[f"pad{i}"]) == 900_000 for i in range(20))


def delete_topic(admin_url: str, topic: str) -> None:
    """Delete the state topic (not its snapshot topics), as an operator would."""
    local = topic.removeprefix("persistent://")
    admin_request(admin_url, "DELETE", f"/admin/v2/persistent/{local}?force=true")


@pytest.mark.parametrize("new_records", [3, 50])
async def test_snapshot_of_a_deleted_topic_is_not_loaded_into_its_successor(
    service_url: str,
    admin_url: str,
    topic: str,
    new_records: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Issue 11 (c): fewer records than the old snapshot covers (3) or more (50).
    async with counter_manager(
        service_url, topic, admin_url, max_writes_per_record=1, **json_state
    ) as old:
        await write_increments(old, 20, "old")
        await old.snapshot()
    delete_topic(admin_url, topic)
    async with counter_manager(service_url, topic, admin_url, max_writes_per_record=1) as new:
        await write_increments(new, new_records, "new")
        expected = await new.read(lambda s: s, latest=True)
    with caplog.at_level(logging.WARNING, logger="pulsar_state"):
        async with (
            counter_manager(service_url, topic, admin_url, **json_state) as with_snapshots,
            counter_manager(
                service_url, topic, admin_url, load_snapshot=False, **json_state
            ) as verifying,
        ):
            assert with_snapshots.stats.snapshot_loaded_position is None
            for replica in (with_snapshots, verifying):
                assert replica.position == new_records
                assert await replica.read(lambda s: s) == expected
                assert not any(key.startswith("old") for key in expected["seen"])
            assert verifying.stats.determinism_failures == 0
            # A snapshot of the new history is bound to it and loads again.
            await with_snapshots.snapshot()
    assert "another history of the topic" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pulsar_state"):
        async with counter_manager(service_url, topic, admin_url, **json_state) as reopened:
            assert reopened.stats.snapshot_loaded_position == new_records
            assert await reopened.read(lambda s: s) == expected
    # The history of the snapshot written last is tried first, even below the old one's
    # position (3 < 20): the old one is not checked (a reader, an admin call and a warning
    # at every open, with a sort by position alone).
    assert "another history of the topic" not in caplog.text


async def test_manifest_without_fingerprint_is_checked_on_its_covered_position(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A manifest of an older version (no incarnation fields) still loads on its own topic.
    async with counter_manager(
        service_url, topic, admin_url, max_writes_per_record=1, **json_state
    ) as writer:
        await write_increments(writer, 10, "a")
        manifest = await writer.snapshot()
        expected = await writer.read(lambda s: s)
    legacy = dataclasses.replace(
        manifest,
        snapshot_id=uuid.uuid4().hex,
        log_first_ledger=None,
        log_first_entry=None,
        log_first_record=None,
        log_covered_record=None,
    )
    async with raw_producer(service_url, f"{topic}-snapshot-index") as producer:
        await producer.send(encode_manifest(legacy))
    async with counter_manager(service_url, topic, admin_url, **json_state) as reopened:
        assert reopened.stats.snapshot_loaded_position == 10
        assert await reopened.read(lambda s: s) == expected
    # Its covered position is checked: on a new incarnation of the topic it is not loaded.
    delete_topic(admin_url, topic)
    async with counter_manager(service_url, topic, admin_url) as new:
        await write_increments(new, 3, "new")
    async with counter_manager(service_url, topic, admin_url, **json_state) as reopened:
        assert reopened.stats.snapshot_loaded_position is None
        assert await reopened.read(lambda s: s["count"]) == 3


async def test_a_lossy_snapshot_codec_is_refused_at_snapshot_time(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Issue 11 (g): JSON turns the int key into "1"; a snapshot would load a different state.
    def apply_set(state: dict[Any, Any], op: dict[str, Any]) -> None:
        state[int(op["key"])] = op["value"]

    async with SharedStateManager(
        service_url,
        topic,
        admin_url=admin_url,
        initial_state=dict,
        apply=apply_set,
        snapshot_codec=JsonCodec(),
        write_timeout_s=30.0,
        open_timeout_s=60.0,
    ) as manager:
        await manager.write_ops([{"key": "1", "value": "one"}])
        with pytest.raises(CodecError, match="lossy"):
            await manager.snapshot()
        assert manager.stats.snapshots_written == 0
        await manager.write_ops([{"key": "2", "value": "two"}])  # still usable
        assert await manager.read(lambda s: s) == {1: "one", 2: "two"}


async def test_no_automatic_snapshot_of_a_replica_halted_by_a_failing_apply(
    service_url: str, admin_url: str, topic: str
) -> None:
    # An apply that is not deterministic passes the writer's trial run, then raises on the
    # record after changing the live state: the replica halts with that half-applied state.
    # Before: the batch's end still started an automatic snapshot of it, which a replica
    # loading it would build on (the record applied again on top).
    calls = {"poison": 0}

    def flaky(state: Counter, op: dict[str, Any]) -> None:
        if op.get("id") == "poison":
            calls["poison"] += 1
            if calls["poison"] == 2:
                state["count"] += 1000
                raise RuntimeError("not deterministic")
        apply_counter(state, op)

    async with counter_manager(
        service_url,
        topic,
        admin_url,
        apply=flaky,
        snapshot_every_bytes=1,
        max_writes_per_record=1,
        **json_state,
    ) as m:
        await m.write(lambda s: [incr("a")])
        for _ in range(100):  # the automatic snapshot of position 1
            if m.stats.snapshots_written:
                break
            await asyncio.sleep(0.05)
        assert m.stats.snapshots_written == 1
        # Two records in one batch (the second halts): the batch's end is reached normally.
        results = await asyncio.gather(
            m.write(lambda s: [incr("b")]),
            m.write(lambda s: [incr("poison")]),
            return_exceptions=True,
        )
        assert isinstance(results[1], PulsarStateError)
        assert m.halted is not None
        await asyncio.sleep(1.5)
        assert m.stats.snapshots_written == 1
        # What an automatic snapshot runs (test-only: snapshot() itself checks the halt
        # first): before, it wrote the half-applied state.
        with pytest.raises(ReplicaHaltedError):
            await m._snapshots.take(10.0)
        assert m.stats.snapshots_written == 1


async def test_a_failing_automatic_snapshot_waits_before_it_is_tried_again(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Each attempt copies and encodes the whole state on the way. Before: after a failure
    # every later batch started another (here about one per write).
    attempts = {"encode": 0}

    class Refusing(JsonCodec):
        def encode(self, value: Any, /) -> bytes:
            attempts["encode"] += 1
            raise CodecError("injected: this state cannot be encoded")

    async with counter_manager(
        service_url, topic, admin_url, snapshot_codec=Refusing(), snapshot_every_records=1
    ) as m:
        with caplog.at_level(logging.ERROR, logger="pulsar_state"):
            for i in range(20):
                await m.write(lambda s, i=i: [incr(f"w{i}")])
                await asyncio.sleep(0.01)
        assert 1 <= attempts["encode"] <= 2, attempts
        assert "automatic snapshot" in caplog.text


def slow_reads(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every read of the snapshot store (``ReopeningReader.read_next``) waits ``seconds``."""
    read_next = ReopeningReader.read_next

    async def slow(self: ReopeningReader) -> RawMessage:
        await asyncio.sleep(seconds)
        return await read_next(self)

    monkeypatch.setattr(ReopeningReader, "read_next", slow)


async def test_a_slow_snapshot_index_read_is_an_operation_timeout(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: a plain TimeoutError, which callers of the library's errors do not catch
    # (it escaped an automatic snapshot and halted a fall-forward).
    async with counter_manager(service_url, topic, admin_url, **json_state) as m:
        await m.write(lambda s: [incr("a")])
        await m.snapshot()
        store = m._snapshots._store  # test-only: the store's read of its index, made slow
        store._timeout_s = 0.2
        # Slow for sure: a timeout alone (1 us, as before) never fired when the message was
        # already there (the read then never gave the event loop a turn).
        slow_reads(monkeypatch, 1.0)
        with pytest.raises(OperationTimeoutError, match="snapshot index"):
            await store.manifests()


async def test_automatic_snapshots_of_a_recreated_topic_ignore_the_old_ones(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The old topic's newest manifest (position 20) stays in the index. Before: the new
    # history's automatic snapshots counted from 20, so none was taken until position 22.
    async with counter_manager(
        service_url, topic, admin_url, max_writes_per_record=1, **json_state
    ) as old:
        await write_increments(old, 20, "old")
        await old.snapshot()
    delete_topic(admin_url, topic)
    async with counter_manager(
        service_url, topic, admin_url, snapshot_every_records=2, **json_state
    ) as new:
        for i in range(6):
            await new.write(lambda s, i=i: [incr(f"new{i}")])
            await asyncio.sleep(0.2)  # an automatic snapshot may finish before the next
        for _ in range(100):
            if new.stats.snapshots_written:
                break
            await asyncio.sleep(0.05)
        assert new.stats.snapshots_written >= 1


async def test_an_automatic_snapshot_not_due_after_another_process_s_does_not_back_off(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        counter_manager(service_url, topic, admin_url, snapshot_every_records=5, **json_state) as m,
        counter_manager(service_url, topic, admin_url, **json_state) as other,
    ):
        await other.write(lambda s: [incr("a")])
        await other.snapshot()
        await m.sync()
        policy = m._snapshots  # test-only: what the next batch's check would run
        await policy._auto()  # another process took one since: not due, nothing failed
        # Before: counted as a failure, so the next automatic snapshot waited (doubling).
        assert policy._auto_after == float("-inf")


async def test_automatic_snapshots_wait_longer_while_others_keep_writing_one(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each attempt copies and encodes the state before it finds the writer busy. Before:
    # tried again every second for as long as another process's snapshot took.
    async with counter_manager(service_url, topic, admin_url, **json_state) as m:
        policy = m._snapshots  # test-only: the automatic path, with a busy writer

        async def busy(timeout: float) -> SnapshotManifest:
            raise WriterBusyError("another process is writing a snapshot")

        monkeypatch.setattr(policy, "take", busy)
        pauses = []
        for _ in range(3):
            started = asyncio.get_running_loop().time()
            await policy._auto()
            pauses.append(round(policy._auto_after - started))
        assert pauses == [1, 2, 4]


async def test_a_snapshot_loads_as_long_as_its_chunks_keep_coming(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each read of a chunk is bounded, not the whole load. Before: one deadline for all the
    # chunks, so a snapshot too big to read within it could never load (fall-forward, or a
    # durable store built from it). Injected: every read takes 0.3 s, the bound is 1 s.
    async with counter_manager(
        service_url, topic, admin_url, snapshot_chunk_bytes=64, **json_state
    ) as m:
        for i in range(6):
            await m.write(lambda s, i=i: [incr(f"key-{i:04d}-" + "x" * 100)])
        manifest = await m.snapshot()
        assert manifest.chunks >= 6
        store = m._snapshots._store  # test-only: the store, its bound, its reads made slow
        store._timeout_s = 1.0
        slow_reads(monkeypatch, 0.3)
        data = await store.load(manifest)
        assert JsonCodec().decode(data) == await m.read(lambda s: s)


async def test_a_snapshot_codec_raising_its_own_error_falls_back_to_an_older_snapshot(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Before: an exception other than CodecError from the codec's decode failed the open.
    async with counter_manager(service_url, topic, admin_url, **json_state) as writer:
        await write_increments(writer, 3, "a")
        older = await writer.snapshot()
        await write_increments(writer, 3, "newer")
        await writer.snapshot()
        expected = await writer.read(lambda s: s, latest=True)

    class Picky(JsonCodec):
        def decode(self, data: bytes, /) -> Any:
            if b"newer" in data:
                raise RuntimeError("a bug in the codec")
            return super().decode(data)

    async with counter_manager(service_url, topic, admin_url, snapshot_codec=Picky()) as m:
        assert m.stats.snapshot_loaded_position == older.position
        assert await m.read(lambda s: s) == expected


async def test_a_snapshot_being_loaded_reports_its_progress(
    service_url: str,
    admin_url: str,
    topic: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A snapshot of gigabytes takes minutes to load: opening says how far it is, as a long
    # replay does (here after every chunk instead of every 2 s).
    monkeypatch.setattr(_snapshots, "_LOAD_REPORT_EVERY_S", 0.0)

    def put(state: dict[str, str], op: dict[str, str]) -> None:
        state[op["k"]] = op["v"]

    options: dict[str, Any] = {
        "initial_state": dict,
        "apply": put,
        "snapshot_chunk_bytes": 1024,
        **json_state,
    }
    async with counter_manager(service_url, topic, admin_url, **options) as writer:
        await writer.write(lambda s: [{"k": f"key-{i}", "v": "x" * 100} for i in range(50)])
        manifest = await writer.snapshot()
    assert manifest.chunks > 3
    seen: list[ReplayProgress] = []
    with caplog.at_level(logging.INFO, logger="pulsar_state"):
        async with counter_manager(
            service_url, topic, admin_url, on_progress=seen.append, **options
        ) as replica:
            assert replica.stats.snapshot_loaded_position == manifest.position
    loading = [p for p in seen if p.loading_snapshot]
    loaded = [p.snapshot_bytes_loaded for p in loading]
    assert len(loaded) == manifest.chunks
    assert loaded == sorted(loaded)
    assert loaded[-1] == manifest.size
    assert {(p.snapshot_position, p.snapshot_bytes, p.done) for p in loading} == {
        (manifest.position, manifest.size, False)
    }
    assert seen[-1].done
    assert not seen[-1].loading_snapshot
    assert f"loading snapshot {manifest.snapshot_id}" in caplog.text


async def test_a_manifest_stored_twice_is_listed_once(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Sent again by the client after a reconnect: counted twice, keep_snapshots=2 would keep
    # one snapshot, and trim the log and the index behind it.
    async with counter_manager(service_url, topic, admin_url, **json_state) as writer:
        await write_increments(writer, 3, "a")
        manifest = await writer.snapshot()
    async with raw_producer(service_url, topic + "-snapshot-index") as producer:
        await producer.send(encode_manifest(manifest))
    async with counter_manager(service_url, topic, admin_url, **json_state) as replica:
        listed = await replica._snapshots._store.manifests()
        assert [m.snapshot_id for m in listed] == [manifest.snapshot_id]
