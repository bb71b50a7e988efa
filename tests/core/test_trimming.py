"""trim_history: the history behind the kept snapshots goes; what replicas need stays.

How the tests make the broker trim now: :mod:`tests.support.trimming`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from pulsar_state import (
    BrokerUnavailableError,
    JsonCodec,
    PulsarStateError,
    SnapshotManifest,
    UnsafeTopicPolicyError,
)
from pulsar_state._admin import AdminClient
from pulsar_state._envelope import Record, Write, encode_record
from pulsar_state._pulsar import LogPosition, PulsarConnection, StateReader
from pulsar_state._replica import Replica
from pulsar_state._snapshots import SnapshotPolicy, SnapshotStore
from tests.core.helpers import counter_manager, incr, raw_producer
from tests.support.broker import admin_request
from tests.support.trimming import (
    NO_RETENTION,
    TRIM_WAIT_S,
    close_ledger_and_trim,
    ledgers,
    mark_delete,
    rest_path,
    set_policy,
    trim_ledger_away,
)


def trimming_manager(service_url: str, topic: str, admin_url: str, **options: Any) -> Any:
    defaults: dict[str, Any] = {
        "snapshot_codec": JsonCodec(),
        "trim_history": True,
        "keep_snapshots": 1,
    }
    return counter_manager(service_url, topic, admin_url, **{**defaults, **options})


async def write_and_snapshot(manager: Any, writes: int) -> None:
    for _ in range(writes):
        await manager.write(lambda s: [incr()])
    await manager.snapshot()


async def trimmed_topic(service_url: str, admin_url: str, topic: str) -> tuple[int, list[int]]:
    """A topic whose first ledger the broker deleted; returns (count, ledgers before)."""
    await set_policy(admin_url, topic, "retention", NO_RETENTION)
    async with trimming_manager(service_url, topic, admin_url) as writer:
        await write_and_snapshot(writer, 20)
        await close_ledger_and_trim(admin_url, topic)
        before = ledgers(admin_url, topic)
        await write_and_snapshot(writer, 20)  # keep 1: the trim point passes the first ledger
        expected = writer.position
        await trim_ledger_away(admin_url, topic, before[0])
        count = await writer.read(lambda s: s["count"], latest=True)
    assert count == 40
    assert expected > 0
    return count, before


async def test_history_behind_the_kept_snapshot_is_deleted_and_a_replica_opens_from_it(
    service_url: str, admin_url: str, topic: str
) -> None:
    count, _ = await trimmed_topic(service_url, admin_url, topic)
    async with trimming_manager(service_url, topic, admin_url) as replica:
        assert replica.stats.snapshot_loaded_position is not None
        assert await replica.read(lambda s: s["count"], latest=True) == count


async def test_a_replica_replaying_from_a_trimmed_point_falls_forward_not_forks(
    service_url: str, admin_url: str, topic: str
) -> None:
    count, _ = await trimmed_topic(service_url, admin_url, topic)
    # load_snapshot=False: it replays from the log's first message, whose records are based
    # on records the broker deleted. It must load a snapshot, not halt as forked.
    async with trimming_manager(service_url, topic, admin_url, load_snapshot=False) as replica:
        assert replica.halted is None
        assert replica.stats.fell_forward == 1
        assert await replica.read(lambda s: s["count"], latest=True) == count
        await replica.write(lambda s: [incr()])
        assert await replica.read(lambda s: s["count"], latest=True) == count + 1


async def test_falling_forward_looks_again_when_its_list_of_snapshots_is_stale(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race behind a replica halted as forked while a writer snapshotted and trimmed: the
    # replica listed the snapshots, then the writer wrote a newer one and trimmed the log
    # behind it, so every snapshot on the replica's list was older than the log's beginning.
    # Made certain here: the first list a fall-forward reads lacks the newest snapshot.
    count, _ = await trimmed_topic(service_url, admin_url, topic)
    stale = {"next": False, "served": 0}
    real_manifests = SnapshotStore.manifests
    real_fall_forward = SnapshotPolicy.fall_forward

    async def manifests(self: SnapshotStore) -> list[SnapshotManifest]:
        found = await real_manifests(self)
        if stale["next"]:
            stale["next"] = False
            stale["served"] += 1
            return found[:-1]  # as listed just before the newest snapshot was written
        return found

    async def fall_forward(self: SnapshotPolicy[Any], needed: int) -> bool:
        stale["next"] = True
        return await real_fall_forward(self, needed)

    monkeypatch.setattr(SnapshotStore, "manifests", manifests)
    monkeypatch.setattr(SnapshotPolicy, "fall_forward", fall_forward)
    async with trimming_manager(service_url, topic, admin_url, load_snapshot=False) as replica:
        assert stale["served"] >= 1  # (more if a transient failure made it start over)
        assert replica.halted is None
        assert replica.stats.fell_forward == 1
        assert await replica.read(lambda s: s["count"], latest=True) == count


async def test_a_fall_forward_whose_reader_receives_nothing_opens_another(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The broker can leave a reader subscribed while the topic unloads attached to the closed
    # topic, where nothing ever comes. The fall-forward's check that a snapshot's covered
    # message is on the log got one in a CI run (a replica opening while the writer trimmed):
    # it waited the whole open (60 s, "1 records replayed"). Made certain here: that check's
    # first reader reads an empty topic.
    count, _ = await trimmed_topic(service_url, admin_url, topic)
    real_create_reader = PulsarConnection.create_reader
    stuck: list[LogPosition] = []

    async def create_reader(self: PulsarConnection, of: str, **options: Any) -> StateReader:
        at = options.get("at")
        if of == topic and at is not None and not stuck:
            stuck.append(at)
            return await real_create_reader(self, f"{of}-nothing", **options)
        return await real_create_reader(self, of, **options)

    monkeypatch.setattr(PulsarConnection, "create_reader", create_reader)
    async with trimming_manager(
        service_url, topic, admin_url, load_snapshot=False, open_timeout_s=20
    ) as replica:
        assert stuck  # the fall-forward's check got the reader that reads nothing
        assert replica.halted is None
        assert replica.stats.fell_forward == 1
        assert await replica.read(lambda s: s["count"], latest=True) == count


async def test_finite_retention_is_accepted_only_with_trim_history(
    service_url: str, admin_url: str, topic: str
) -> None:
    await set_policy(admin_url, topic, "retention", NO_RETENTION)
    with pytest.raises(UnsafeTopicPolicyError, match="retention"):
        async with counter_manager(service_url, topic, admin_url, snapshot_codec=JsonCodec()):
            pass
    async with trimming_manager(service_url, topic, admin_url) as manager:
        await manager.write(lambda s: [incr()])


async def test_trim_history_refuses_a_message_ttl(
    service_url: str, admin_url: str, topic: str
) -> None:
    await set_policy(admin_url, topic, "retention", NO_RETENTION)
    await set_policy(admin_url, topic, "messageTTL", 60)
    with pytest.raises(UnsafeTopicPolicyError, match="TTL"):
        async with trimming_manager(service_url, topic, admin_url):
            pass


async def test_replicas_opening_while_trimming_runs_reach_the_same_state(
    service_url: str, admin_url: str, topic: str
) -> None:
    await set_policy(admin_url, topic, "retention", NO_RETENTION)
    rounds, done = 12, asyncio.Event()

    async def write_snapshot_and_trim() -> int:
        async with trimming_manager(service_url, topic, admin_url) as writer:
            for _ in range(rounds):
                before = mark_delete(admin_url, topic)
                await write_and_snapshot(writer, 10)
                await trim_point_moved(writer, admin_url, topic, before)
                await asyncio.to_thread(_close_and_trim_blocking, admin_url, topic)
            done.set()
            return int(writer.position)

    async def open_replicas() -> int:
        opened = 0
        while not done.is_set() or opened < 2:
            # Alternately from the newest snapshot and from the log's first message.
            load = opened % 2 == 0
            async with trimming_manager(
                service_url, topic, admin_url, load_snapshot=load
            ) as replica:
                # One increment per record: the count is the position, whatever path it took.
                assert replica.halted is None
                assert await replica.read(lambda s: s["count"]) == replica.position
                await replica.sync()
                assert await replica.read(lambda s: s["count"]) == replica.position
            opened += 1
        return opened

    final, opened = await asyncio.gather(write_snapshot_and_trim(), open_replicas())
    assert opened >= 2
    async with trimming_manager(service_url, topic, admin_url, load_snapshot=False) as last:
        assert last.stats.fell_forward == 1  # the log's beginning is gone by now
        assert await last.read(lambda s: s["count"], latest=True) == final == rounds * 10


async def trim_point_moved(
    writer: Any, admin_url: str, topic: str, before: tuple[int, int]
) -> None:
    """Wait until the broker has the trim point the last snapshot set. Acknowledgements are
    not confirmed: one sent while the writer's consumer reconnects after an unload is lost,
    and is sent again here, as the next snapshot would."""
    for attempt in range(200):
        if mark_delete(admin_url, topic) > before:
            return
        if attempt % 10 == 9:
            with contextlib.suppress(PulsarStateError):
                await writer._snapshots.trim()
        await asyncio.sleep(0.05)
    raise AssertionError(f"the trim point stayed at {before}")


def _close_and_trim_blocking(admin_url: str, topic: str) -> None:
    admin_request(admin_url, "PUT", rest_path(topic) + "/unload")
    for _ in range(100):
        try:
            admin_request(admin_url, "POST", rest_path(topic) + "/trim")
            return
        except OSError:
            time.sleep(0.1)


async def test_a_trim_point_the_broker_lost_is_sent_again(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The broker can lose an acknowledged mark (taken while the topic unloads, it was never
    # persisted); here the mark is put back by hand. The library sends it again 1 s and 5 s
    # later, through a new consumer: the probe's own would drop an ack it already sent.
    async with trimming_manager(service_url, topic, admin_url) as writer:
        await write_and_snapshot(writer, 5)
        before = mark_delete(admin_url, topic)
        await write_and_snapshot(writer, 5)
        for _ in range(100):
            moved = mark_delete(admin_url, topic)
            if moved > before:
                break
            await asyncio.sleep(0.05)
        assert moved > before
        admin_request(
            admin_url, "POST", rest_path(topic) + "/subscription/pulsar-state/resetcursor/0"
        )
        assert mark_delete(admin_url, topic) < moved
        for _ in range(200):
            if mark_delete(admin_url, topic) >= moved:
                break
            await asyncio.sleep(0.05)
        assert mark_delete(admin_url, topic) >= moved


async def test_snapshots_written_out_of_position_order_keep_their_chunks(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Process 1 captures its state at position 5 and encodes slowly; process 2, at 7, writes
    # its snapshot first. Kept (2): positions 5 and 7, and the one at 7 has the EARLIER
    # chunks. Before: the chunk trim point was taken from the one at 5 (the oldest by
    # position), past the chunks of the newest snapshot, which no replica could then load.
    trims: list[LogPosition] = []
    trim_chunks = SnapshotStore.trim_chunks_through

    async def spy(self: SnapshotStore, position: LogPosition) -> None:
        trims.append(position)
        await trim_chunks(self, position)

    monkeypatch.setattr(SnapshotStore, "trim_chunks_through", spy)
    slow = asyncio.Event()

    class SlowCodec(JsonCodec):
        def encode(self, value: Any, /) -> bytes:
            if slow.is_set():
                time.sleep(3.0)  # in the encoding thread
            return super().encode(value)

    async with (
        trimming_manager(
            service_url, topic, admin_url, keep_snapshots=2, snapshot_codec=SlowCodec()
        ) as first,
        trimming_manager(service_url, topic, admin_url, keep_snapshots=2) as second,
    ):
        await write_and_snapshot(first, 3)
        for _ in range(2):
            await first.write(lambda s: [incr()])
        slow.set()
        slow_snapshot = asyncio.ensure_future(first.snapshot())
        await asyncio.sleep(0.5)  # captured at 5, encoding
        for _ in range(2):
            await second.write(lambda s: [incr()])
        newest = await second.snapshot()
        slow.clear()
        older = await slow_snapshot
        assert (older.position, newest.position) == (5, 7)
        newest_first_chunk = LogPosition(newest.first_chunk_ledger, newest.first_chunk_entry)
        assert LogPosition(older.first_chunk_ledger, older.first_chunk_entry) > newest_first_chunk
        assert trims
        assert all(point < newest_first_chunk for point in trims), (trims, newest_first_chunk)


async def test_a_replica_behind_a_trimmed_ledger_ignores_the_stale_record_left_after_it(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A record based on exactly this replica's position is accepted, unless another record
    # was accepted there first: then it is stale for every replica that read the whole log.
    # If that other record was trimmed away meanwhile, a replica behind the trim sees the
    # stale one first: it must fall forward to a snapshot, not apply it.
    await set_policy(admin_url, topic, "retention", NO_RETENTION)
    gate, held, applied = asyncio.Event(), [], []
    real_open_reader = Replica.open_reader

    async def open_reader(self: Replica[Any, Any], conn: PulsarConnection) -> None:
        if self.read_to is not None and not held and self is not writer_replica:
            held.append(self)  # the replica just loaded the first snapshot: wait here
            self.listeners.append(lambda record: applied.append(record.record_id))
            await gate.wait()
        await real_open_reader(self, conn)

    monkeypatch.setattr(Replica, "open_reader", open_reader)
    async with trimming_manager(service_url, topic, admin_url) as writer:
        writer_replica = writer._replica
        await write_and_snapshot(writer, 5)
        base_record_id = writer._replica.last_record_id
        opening = asyncio.ensure_future(
            trimming_manager(service_url, topic, admin_url).__aenter__()
        )
        for _ in range(600):
            if held or opening.done():
                break
            await asyncio.sleep(0.05)
        assert held, "the second replica never loaded the snapshot"
        await writer.write(lambda s: [incr()])  # the record accepted at position 5
        first_ledger = ledgers(admin_url, topic)[0]
        await close_ledger_and_trim(admin_url, topic)
        # A zombie that missed it appends a record built on position 5, in the next ledger.
        stale = Record("zombie", 1, 5, base_record_id, [Write(1, [b'{"op":"incr","by":100}'])])
        async with raw_producer(service_url, topic) as producer:
            await producer.send(encode_record(stale), partition_key=stale.record_id)
        # A snapshot covering a later message of that ledger moves the trim point past the
        # first ledger (just before the covered message, which must stay).
        await write_and_snapshot(writer, 1)
        assert await writer.read(lambda s: s["count"], latest=True) == 7
        deadline = time.monotonic() + TRIM_WAIT_S
        while first_ledger in ledgers(admin_url, topic) and time.monotonic() < deadline:
            await close_ledger_and_trim(admin_url, topic)
            await asyncio.sleep(0.2)
        assert first_ledger not in ledgers(admin_url, topic), "the broker kept the ledger"
    gate.set()
    replica = await opening
    try:
        assert replica.halted is None
        assert await replica.read(lambda s: s["count"], latest=True) == 7
        assert stale.record_id not in applied
        assert replica.stats.fell_forward == 1
    finally:
        await replica.__aexit__(None, None, None)


async def test_the_snapshot_index_is_trimmed_behind_the_kept_snapshots(
    service_url: str, admin_url: str, topic: str
) -> None:
    # One manifest a snapshot, for ever: every open and every trim reads the whole index.
    index = f"{topic}-snapshot-index"
    await set_policy(admin_url, topic, "retention", NO_RETENTION)
    await set_policy(admin_url, index, "retention", NO_RETENTION)
    async with trimming_manager(service_url, topic, admin_url) as writer:
        await write_and_snapshot(writer, 3)
        await write_and_snapshot(writer, 3)
        first_ledger = ledgers(admin_url, index)[0]
        await close_ledger_and_trim(admin_url, index)  # the next manifests go to a new ledger
        await write_and_snapshot(writer, 3)  # keep 1: the kept one is its ledger's first
        newest = (await writer._snapshots._store.manifests())[-1]
        deadline = time.monotonic() + TRIM_WAIT_S
        while first_ledger in ledgers(admin_url, index) and time.monotonic() < deadline:
            # Trimmed again (as the next snapshot would): the unload above may have had the
            # index's subscription reconnecting when the snapshot trimmed.
            with contextlib.suppress(PulsarStateError):
                await writer._snapshots.trim()
            with contextlib.suppress(OSError):
                admin_request(admin_url, "POST", rest_path(index) + "/trim")
            await asyncio.sleep(0.2)
        assert first_ledger not in ledgers(admin_url, index), "the index was not trimmed"
    async with trimming_manager(service_url, topic, admin_url) as replica:
        assert replica.stats.snapshot_loaded_position == newest.position
        assert await replica.read(lambda s: s["count"], latest=True) == 9


async def test_a_replica_that_loaded_the_empty_snapshot_reads_on(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A snapshot of the empty state covers no message (-1:-1): the first message read is in
    # another ledger, but nothing can have been trimmed before it.
    async with trimming_manager(service_url, topic, admin_url) as writer:
        empty = await writer.snapshot()
        assert empty.position == 0
        await writer.write(lambda s: [incr()])
        await writer.write(lambda s: [incr()])
    async with trimming_manager(service_url, topic, admin_url, open_timeout_s=20) as replica:
        assert replica.stats.snapshot_loaded_position == 0
        assert await replica.read(lambda s: s["count"], latest=True) == 2
        assert replica.stats.fell_forward == 0


async def test_a_replica_whose_ledger_check_is_slow_asks_again_and_reads_on(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The check at a new ledger asks the broker (a reader, the admin API): both can be slow
    # or fail just when ledgers change (an unload, a restart). The replica waits and asks
    # again; it does not halt.
    asked: list[LogPosition] = []
    real_holds_message = SnapshotPolicy.holds_message

    async def holds_message(self: SnapshotPolicy[Any], at: LogPosition) -> bool:
        if self._replica is not writer._replica:
            asked.append(at)
            if len(asked) == 1:
                await asyncio.sleep(6)  # past the replica's open_timeout_s
                raise TimeoutError("no answer")
        return await real_holds_message(self, at)

    async with trimming_manager(service_url, topic, admin_url) as writer:
        for _ in range(3):
            await writer.write(lambda s: [incr()])
        monkeypatch.setattr(SnapshotPolicy, "holds_message", holds_message)
        async with trimming_manager(service_url, topic, admin_url, open_timeout_s=5) as replica:
            await close_ledger_and_trim(admin_url, topic)  # the next records: a new ledger
            for _ in range(3):
                await writer.write(lambda s: [incr()])
            assert await replica.read(lambda s: s["count"], latest=True) == 6
            assert replica.halted is None
            assert len(asked) >= 2


async def test_the_ledger_check_reads_the_log_with_no_admin_request(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The admin REST API can be down while the data path is up: reading on must not wait
    # for it at each new ledger.
    real_get, real_last_position = AdminClient.get, AdminClient.last_position
    down: list[AdminClient] = []

    async def get(self: AdminClient, path: str) -> Any:
        if self in down:
            raise BrokerUnavailableError("the admin REST API is down")
        return await real_get(self, path)

    async def last_position(self: AdminClient, of: Any) -> Any:
        if self in down:
            raise BrokerUnavailableError("the admin REST API is down")
        return await real_last_position(self, of)

    monkeypatch.setattr(AdminClient, "get", get)
    monkeypatch.setattr(AdminClient, "last_position", last_position)
    async with trimming_manager(service_url, topic, admin_url) as writer:
        for _ in range(3):
            await writer.write(lambda s: [incr()])
        async with trimming_manager(service_url, topic, admin_url) as replica:
            down.append(replica._snapshots._store._admin)  # the replica's, not the writer's
            await close_ledger_and_trim(admin_url, topic)  # the next records: a new ledger
            for _ in range(3):
                await writer.write(lambda s: [incr()])
            await replica._replica.wait_version(6, 30)
            assert await replica.read(lambda s: s["count"]) == 6
            assert replica.halted is None


async def test_a_replica_halted_during_the_ledger_check_stays_where_it_is(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer can halt the replica while the pump awaits the check: a halted replica keeps
    # its last good state, whatever the check says.
    snapshot_taken = asyncio.Event()

    async def holds_message(self: SnapshotPolicy[Any], at: LogPosition) -> bool:
        if self._replica is writer._replica:
            return True
        await snapshot_taken.wait()
        self._replica.halt_with(PulsarStateError("halted by a test"))
        return False  # "trimmed": would fall forward to the newest snapshot

    async with trimming_manager(service_url, topic, admin_url) as writer:
        for _ in range(3):
            await writer.write(lambda s: [incr()])
        monkeypatch.setattr(SnapshotPolicy, "holds_message", holds_message)
        async with trimming_manager(service_url, topic, admin_url) as replica:
            await close_ledger_and_trim(admin_url, topic)  # the next records: a new ledger
            await write_and_snapshot(writer, 3)
            snapshot_taken.set()
            for _ in range(300):
                if replica.halted is not None:
                    break
                await asyncio.sleep(0.05)
            assert replica.halted is not None
            await asyncio.sleep(1)  # (a fall-forward would have loaded the snapshot by now)
            assert replica.stats.fell_forward == 0
            assert replica.position == 3
