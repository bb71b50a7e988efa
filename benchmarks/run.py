"""pulsar-state against a raw pulsar-client program, as ratios measured side by side.

    scripts/bench            full run (several minutes)
    scripts/bench --quick    about a minute; what .ci/run may use as a smoke check

Each metric runs the library and the raw baseline in the same run, on the same broker, with
the same payload sizes, and reports library / baseline. Writes a table to stdout and
``benchmarks/results.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
import urllib.error
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pulsar
import pulsar.asyncio as pulsar_asyncio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.scale import map_scale, ownership_scale  # noqa: E402
from pulsar_state import JsonCodec, SharedStateManager  # noqa: E402
from pulsar_state.testing import Broker, admin_request, provide_broker  # noqa: E402
from recipes import PulsarMap  # noqa: E402


@dataclass
class Metric:
    name: str
    unit: str
    library: float
    baseline: float
    target: str
    met: bool
    ratio: float = 0.0
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def topic(label: str) -> str:
    return f"persistent://public/default/bench-{label}-{uuid.uuid4().hex[:8]}"


def apply_kv(state: dict[str, Any], op: dict[str, Any]) -> None:
    state[op["k"]] = op["v"]


def kv_manager(
    broker: Broker, name: str, **options: Any
) -> SharedStateManager[dict[str, Any], Any]:
    defaults: dict[str, Any] = {
        "initial_state": dict,
        "apply": apply_kv,
        "admin_url": broker.admin_url,
        "copy_state": dict.copy,
        "write_timeout_s": 120,
        "open_timeout_s": 600,
    }
    defaults.update(options)
    return SharedStateManager(broker.service_url, name, **defaults)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class RawClient:
    """The baseline: what a hand-written pulsar-client program does for the same I/O."""

    def __init__(self, broker: Broker) -> None:
        self.client = pulsar_asyncio.Client(broker.service_url, operation_timeout_seconds=60)

    async def producer(self, name: str, mode: Any = pulsar.ProducerAccessMode.Exclusive) -> Any:
        return await self.client.create_producer(
            name,
            access_mode=mode,
            batching_enabled=False,
            max_pending_messages=10_000,
            block_if_queue_full=True,
        )

    async def close(self) -> None:
        await self.client.close()


# ---------------------------------------------------------------- metrics


async def local_read(broker: Broker, quick: bool) -> Metric:
    """A local read (no I/O) against a plain dict get."""
    keys = [f"key-{i}" for i in range(1000)]
    plain = {k: i for i, k in enumerate(keys)}
    rounds = 200 if quick else 1000

    def dict_gets() -> float:
        started = time.perf_counter()
        for _ in range(rounds):
            for key in keys:
                plain.get(key)
        return rounds * len(keys) / (time.perf_counter() - started)

    async with PulsarMap(broker.service_url, topic("local"), admin_url=broker.admin_url) as kv:
        await kv.put_all({k: i for i, k in enumerate(keys)})
        # Let the writer go idle and release the producer first: its teardown would otherwise
        # take the GIL during the first timed loop.
        await asyncio.sleep(0.5)
        best_lib, best_raw = 0.0, 0.0
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(rounds):
                for key in keys:
                    kv.get_local(key)
            best_lib = max(best_lib, rounds * len(keys) / (time.perf_counter() - started))
            best_raw = max(best_raw, dict_gets())
    return Metric(
        "local read (map get, no I/O)",
        "gets/s",
        best_lib,
        best_raw,
        ">= 0.5x",
        best_lib / best_raw >= 0.5,
    )


async def pipelined_writes(broker: Broker, quick: bool) -> Metric:
    """One op per message, 100-byte values, many in flight: records/s vs raw send_async."""
    count = 2000 if quick else 10_000
    value = "x" * 100
    raw = RawClient(broker)
    try:
        producer = await raw.producer(topic("raw-pipe"))
        payload = b"x" * 160  # about the size of the library's record for the same op
        started = time.perf_counter()
        await asyncio.gather(*(producer.send(payload) for _ in range(count)))
        raw_rate = count / (time.perf_counter() - started)
    finally:
        await raw.close()
    async with kv_manager(
        broker, topic("lib-pipe"), max_writes_per_record=1, max_writes_per_batch=count
    ) as manager:
        await manager.write_ops([{"k": "warm", "v": 0}])
        started = time.perf_counter()
        await asyncio.gather(
            *(manager.write_ops([{"k": f"k{i}", "v": value}]) for i in range(count))
        )
        lib_rate = count / (time.perf_counter() - started)
        assert manager.stats.records_sent >= count
    return Metric(
        "pipelined writes, one op per message, 100 B",
        "records/s",
        lib_rate,
        raw_rate,
        ">= 0.8x",
        lib_rate / raw_rate >= 0.8,
    )


async def group_commit(broker: Broker, quick: bool) -> Metric:
    """Many concurrent writes packed into few messages: ops/s vs raw messages/s."""
    count = 5000 if quick else 50_000
    raw = RawClient(broker)
    try:
        producer = await raw.producer(topic("raw-group"))
        started = time.perf_counter()
        await asyncio.gather(*(producer.send(b"x" * 160) for _ in range(min(count, 5000))))
        raw_rate = min(count, 5000) / (time.perf_counter() - started)
    finally:
        await raw.close()
    async with kv_manager(broker, topic("lib-group")) as manager:
        await manager.write_ops([{"k": "warm", "v": 0}])
        started = time.perf_counter()
        await asyncio.gather(
            *(manager.write_ops([{"k": f"k{i}", "v": "x" * 100}]) for i in range(count))
        )
        lib_rate = count / (time.perf_counter() - started)
        records = manager.stats.records_sent
    return Metric(
        "group-commit writes (ops/s vs raw messages/s)",
        "ops/s",
        lib_rate,
        raw_rate,
        ">= 5x",
        lib_rate / raw_rate >= 5,
        details={"records": records, "ops": count},
    )


async def write_latency(broker: Broker, quick: bool) -> list[Metric]:
    count = 200 if quick else 1000
    raw = RawClient(broker)
    try:
        producer = await raw.producer(topic("raw-lat"))
        await producer.send(b"warm")
        raw_lat = []
        for _ in range(count):
            started = time.perf_counter()
            await producer.send(b"x" * 160)
            raw_lat.append(time.perf_counter() - started)
    finally:
        await raw.close()
    async with kv_manager(broker, topic("lib-lat"), idle_release_s=60, max_hold_s=600) as manager:
        await manager.write_ops([{"k": "warm", "v": 0}])
        lib_lat = []
        for i in range(count):
            started = time.perf_counter()
            await manager.write_ops([{"k": f"k{i}", "v": "x" * 100}])
            lib_lat.append(time.perf_counter() - started)
    ms = 1000.0
    p50 = (percentile(lib_lat, 0.5) * ms, percentile(raw_lat, 0.5) * ms)
    p99 = (percentile(lib_lat, 0.99) * ms, percentile(raw_lat, 0.99) * ms)
    return [
        Metric(
            "single write latency p50",
            "ms",
            p50[0],
            p50[1],
            "<= raw + 0.1 ms",
            p50[0] <= p50[1] + 0.1,
            note="a write returns once the record is read back and applied",
        ),
        Metric("single write latency p99", "ms", p99[0], p99[1], "<= 1.2x", p99[0] <= 1.2 * p99[1]),
    ]


async def visibility(broker: Broker, quick: bool) -> Metric:
    """From the start of a write to the change being applied on another replica."""
    count = 100 if quick else 500
    raw = RawClient(broker)
    try:
        name = topic("raw-vis")
        producer = await raw.producer(name)
        reader = await raw.client.create_reader(name, pulsar.MessageId.latest)
        raw_lat = []
        for _ in range(count):
            started = time.perf_counter()
            await producer.send(b"x" * 160)
            await reader.read_next()
            raw_lat.append(time.perf_counter() - started)
    finally:
        await raw.close()
    name = topic("lib-vis")
    async with (
        kv_manager(broker, name, idle_release_s=60) as writer,
        kv_manager(broker, name) as other,
    ):
        seen: asyncio.Queue[float] = asyncio.Queue()
        other.add_listener(lambda record: seen.put_nowait(time.perf_counter()))
        await writer.write_ops([{"k": "warm", "v": 0}])
        await seen.get()
        lib_lat = []
        for i in range(count):
            started = time.perf_counter()
            await writer.write_ops([{"k": "k", "v": i}])
            lib_lat.append(await seen.get() - started)
    p50 = (percentile(lib_lat, 0.5) * 1000, percentile(raw_lat, 0.5) * 1000)
    return Metric(
        "visibility on another replica p50",
        "ms",
        p50[0],
        p50[1],
        "<= raw + 0.2 ms",
        p50[0] <= p50[1] + 0.2,
    )


async def bootstrap(broker: Broker, quick: bool) -> Metric:
    """Open (replay everything) vs a raw reader from earliest, 1 KB values."""
    count = 5000 if quick else 50_000
    name = topic("boot")
    value = "v" * 1000
    async with kv_manager(broker, name, max_writes_per_record=1) as writer:
        for start in range(0, count, 1000):
            await asyncio.gather(
                *(
                    writer.write_ops([{"k": f"k{i}", "v": value}])
                    for i in range(start, min(count, start + 1000))
                )
            )

    def raw_replay() -> tuple[float, int]:
        # The fastest raw reader: the blocking API in a loop (as the library's reader thread).
        client = pulsar.Client(broker.service_url)
        try:
            reader = client.create_reader(name, pulsar.MessageId.earliest, receiver_queue_size=2000)
            started = time.perf_counter()
            size = sum(len(reader.read_next().data()) for _ in range(count))
            return time.perf_counter() - started, size
        finally:
            client.close()

    raw_s, raw_bytes = await asyncio.to_thread(raw_replay)
    started = time.perf_counter()
    async with kv_manager(broker, name) as replica:
        lib_s = time.perf_counter() - started
        assert replica.position == count
        lib_bytes = replica.stats.bytes_read
    lib_rate, raw_rate = lib_bytes / lib_s / 1e6, raw_bytes / raw_s / 1e6
    return Metric(
        "bootstrap replay, 1 KB values",
        "MB/s",
        lib_rate,
        raw_rate,
        ">= 0.9x and >= 100 MB/s",
        lib_rate / raw_rate >= 0.9 and lib_rate >= 100,
        details={"records": count, "library_s": lib_s, "raw_s": raw_s},
    )


async def snapshot_open(broker: Broker, quick: bool) -> Metric:
    """Open with a snapshot vs a full replay, after many ops on many keys."""
    keys, ops = (10_000, 100_000) if quick else (100_000, 1_000_000)
    name = topic("snap")
    options: dict[str, Any] = {"snapshot_codec": JsonCodec()}
    async with kv_manager(broker, name, max_writes_per_record=512, **options) as writer:
        step = 20_000
        for start in range(0, ops, step):
            await asyncio.gather(
                *(
                    writer.write_ops([{"k": f"k{i % keys}", "v": i}])
                    for i in range(start, min(ops, start + step))
                )
            )
        await writer.snapshot(timeout=600)
    started = time.perf_counter()
    async with kv_manager(broker, name, load_snapshot=False, **options) as full:
        full_s = time.perf_counter() - started
        assert full.position > 0
    started = time.perf_counter()
    async with kv_manager(broker, name, **options) as snap:
        snap_s = time.perf_counter() - started
        assert snap.stats.snapshot_loaded_position is not None
    return Metric(
        f"open with snapshot, {keys} keys after {ops} ops",
        "s",
        snap_s,
        full_s,
        "<= 0.1x",
        snap_s / full_s <= 0.1,
        note="baseline: the library's full replay",
    )


async def latest_read(broker: Broker, quick: bool) -> Metric:
    """A linearizable map read (the tail over the binary protocol) vs a raw program asking the
    broker for the last message id on a consumer it keeps (the PIP's Java sample does this)."""
    rounds = 500 if quick else 3000
    name = topic("latest")

    async def timed(call: Callable[[], Awaitable[object]]) -> list[float]:
        samples = []
        for _ in range(rounds):
            started = time.perf_counter()
            await call()
            samples.append((time.perf_counter() - started) * 1e3)
        return samples

    raw = RawClient(broker)
    try:
        async with PulsarMap(broker.service_url, name, admin_url=broker.admin_url) as kv:
            await kv.put("k", 1)
            consumer = await raw.client.subscribe(
                name, "bench-raw", receiver_queue_size=0, consumer_type=pulsar.ConsumerType.Failover
            )
            admin_client, state_topic = kv.manager._admin, kv.manager.topic
            assert admin_client is not None
            lib, base, admin = [], [], []
            for _ in range(3):  # interleaved, so that both see the same machine load
                lib += await timed(lambda: kv.get("k", latest=True))
                base += await timed(consumer.get_last_message_id)
                # The previous way, for the record: the admin REST lastMessageId.
                admin += await timed(lambda: admin_client.last_position(state_topic))
            await consumer.unsubscribe()
    finally:
        await raw.close()
    p50 = percentile(lib, 0.5), percentile(base, 0.5)
    return Metric(
        "latest read p50 (map get, latest=True)",
        "ms",
        p50[0],
        p50[1],
        "<= 0.5 ms",
        p50[0] <= 0.5,
        note="baseline: raw get_last_message_id on a kept consumer",
        details={
            "library_p99_ms": percentile(lib, 0.99),
            "raw_p99_ms": percentile(base, 0.99),
            "admin_rest_tail_p50_ms": percentile(admin, 0.5),
            "samples": len(lib),
        },
    )


async def map_snapshot_open(broker: Broker, quick: bool) -> list[Metric]:
    """A PulsarMap (snapshots=True, no codec argument) opened from its snapshot vs a full
    replay, and vs decoding the snapshot alone (the issue's bound: <= 2x the decode)."""
    # Scaled down from the 1M keys / 10M updates to fit a 2-core machine's run.
    keys, updates = (20_000, 200_000) if quick else (100_000, 1_000_000)
    per_write, in_flight = 1000, 8
    name = topic("mapsnap")
    value = "v" * 50
    options: dict[str, Any] = {"admin_url": broker.admin_url, "open_timeout_s": 1200}
    async with PulsarMap(broker.service_url, name, snapshots=True, **options) as writer:
        for start in range(0, updates, per_write * in_flight):
            await asyncio.gather(
                *(
                    writer.put_all(
                        {f"key-{i % keys:07d}": f"{value}{i}" for i in range(s, s + per_write)}
                    )
                    for s in range(start, min(updates, start + per_write * in_flight), per_write)
                )
            )
        await writer.snapshot(timeout=600)
        records = writer.position
    started = time.perf_counter()
    async with PulsarMap(
        broker.service_url, name, snapshots=True, load_snapshot=False, **options
    ) as full:
        full_s = time.perf_counter() - started
        assert len(full) == keys
    started = time.perf_counter()
    async with PulsarMap(broker.service_url, name, snapshots=True, **options) as snap:
        snap_s = time.perf_counter() - started
        assert snap.stats.snapshot_loaded_position == records
        assert len(snap) == keys
        codec = snap.manager._snapshot_codec
        assert codec is not None
        data = codec.encode(snap.manager.read_local(lambda state: state))
    started = time.perf_counter()
    codec.decode(data)
    decode_s = time.perf_counter() - started
    details = {
        "keys": keys,
        "updates": updates,
        "records": records,
        "snapshot_bytes": len(data),
        "decode_s": decode_s,
        "scaled_down_from": "1M keys / 10M updates (issue 13)",
    }
    return [
        Metric(
            f"map open from snapshot, {keys} keys after {updates} updates",
            "s",
            snap_s,
            full_s,
            "<= 0.1x",
            snap_s / full_s <= 0.1,
            note="baseline: the same map's full replay",
            details=details,
        ),
        Metric(
            f"map open from snapshot vs decoding it, {keys} keys",
            "s",
            snap_s,
            decode_s,
            "<= 2x",
            snap_s <= 2 * decode_s,
            note="baseline: MapSnapshotCodec.decode of the snapshot's bytes alone",
            details=details,
        ),
    ]


def _rest(name: str) -> str:
    return "/admin/v2/persistent/public/default/" + name.rsplit("/", 1)[-1]


def _close_ledgers(broker: Broker, names: list[str]) -> None:
    """Close each topic's current ledger and ask the broker to delete what it may.

    Stands in for the broker's own ledger rollover (managedLedgerMaxEntriesPerLedger, at most
    every managedLedgerMinLedgerRolloverTimeMinutes, 10 by default) and retention check
    (retentionCheckIntervalInSeconds), which a benchmark of minutes cannot wait for.
    """
    present = []
    for name in names:
        try:
            admin_request(broker.admin_url, "PUT", _rest(name) + "/unload")
            present.append(name)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:  # a snapshot topic before the first snapshot
                raise
    for name in present:
        for _ in range(50):
            try:
                admin_request(broker.admin_url, "POST", _rest(name) + "/trim")
                break
            except OSError:  # being loaded again
                time.sleep(0.1)


async def trimmed_storage(broker: Broker, quick: bool) -> Metric:
    """Storage (admin stats storageSize, the state topic and both snapshot topics) after many
    updates to few keys, with trim_history vs without."""
    # Scaled down from the 1M updates to fit a 2-core machine's run.
    keys, updates = 1000, (100_000 if quick else 1_000_000)
    # One write at a time, so one record each (concurrent writes would be group-committed).
    per_write, in_flight = 10 if quick else 20, 1
    snapshot_every = 1000 if quick else 5000  # records; a ledger is closed as often
    value = "v" * 50
    sizes: dict[bool, int] = {}
    details: dict[str, Any] = {"keys": keys, "updates": updates, "scaled_down_from": "1M"}
    for trim in (False, True):
        name = topic("trim" if trim else "keep")
        names = [name, f"{name}-snapshots", f"{name}-snapshot-index"]
        if trim:
            for each in names:  # the configuration trim_history accepts: no retention
                admin_request(broker.admin_url, "PUT", _rest(each))
                admin_request(
                    broker.admin_url,
                    "POST",
                    _rest(each) + "/retention",
                    {"retentionTimeInMinutes": 0, "retentionSizeInMB": 0},
                )
            await asyncio.sleep(2)  # topic policies apply through a system topic
        async with PulsarMap(
            broker.service_url,
            name,
            admin_url=broker.admin_url,
            snapshots=True,
            snapshot_every_records=snapshot_every,
            trim_history=trim,
            write_timeout_s=120,
        ) as kv:
            written = closed_at = 0
            while written < updates:
                await asyncio.gather(
                    *(
                        kv.put_all(
                            {
                                f"key-{(written + w * per_write + i) % keys:04d}": f"{value}{i}"
                                for i in range(per_write)
                            }
                        )
                        for w in range(in_flight)
                    )
                )
                written += per_write * in_flight
                if kv.position - closed_at >= snapshot_every:
                    closed_at = kv.position
                    await asyncio.to_thread(_close_ledgers, broker, names)
            await kv.snapshot(timeout=600)
            snapshot_bytes = len(kv.manager._snapshot_codec.encode(kv.manager._state))  # type: ignore[union-attr]
            records = kv.position
        await asyncio.to_thread(_close_ledgers, broker, names)
        await asyncio.sleep(2)
        await asyncio.to_thread(_close_ledgers, broker, names)
        total = 0
        for each in names:
            stats = admin_request(broker.admin_url, "GET", _rest(each) + "/stats")
            total += int(stats.get("storageSize", 0))
        sizes[trim] = total
        internal = admin_request(broker.admin_url, "GET", _rest(name) + "/internalStats")
        details["with_trim" if trim else "without_trim"] = {
            "storage_bytes": total,
            "records": records,
            "state_topic_ledgers": len(internal["ledgers"]),
        }
        details["snapshot_bytes"] = snapshot_bytes
    # One ledger: the records written between two ledger closes (snapshot_every records).
    ledger_bytes = sizes[False] // max(1, details["without_trim"]["records"]) * snapshot_every
    bound = 3 * (details["snapshot_bytes"] + ledger_bytes)
    details["one_ledger_bytes"] = ledger_bytes
    details["bound_bytes_3x_snapshot_plus_ledger"] = bound
    return Metric(
        f"storage after {updates} updates to {keys} keys, trim_history",
        "bytes",
        sizes[True],
        sizes[False],
        "<= 3x (snapshot + ledger)",
        sizes[True] <= bound,
        note="baseline: the same writes without trimming; ledgers closed by unloading",
        details=details,
    )


async def acquisition(broker: Broker, quick: bool) -> list[Metric]:
    """Getting the writer: first write, handover after a clean close, takeover by fencing."""
    rounds = 10 if quick else 40
    raw = RawClient(broker)
    raw_first, raw_fence = [], []
    try:
        for _ in range(rounds):
            name = topic("raw-acq")
            started = time.perf_counter()
            producer = await raw.producer(name)
            await producer.send(b"x" * 160)
            raw_first.append(time.perf_counter() - started)
            started = time.perf_counter()
            fencer = await raw.producer(name, pulsar.ProducerAccessMode.ExclusiveWithFencing)
            await fencer.send(b"x" * 160)
            raw_fence.append(time.perf_counter() - started)
    finally:
        await raw.close()
    lib_first, lib_handover, lib_fence = [], [], []
    # Without the write relay: with it, the waiting process's write would go through the
    # holder instead of taking the writer over, which is what these rows measure.
    hold = {"idle_release_s": 3600.0, "max_hold_s": 3600.0, "relay_writes": False}
    no_relay = {"relay_writes": False}
    for _ in range(rounds):
        name = topic("lib-acq")
        async with kv_manager(broker, name, **hold) as a, kv_manager(broker, name, **no_relay) as b:
            started = time.perf_counter()
            await a.write_ops([{"k": "a", "v": 1}])
            lib_first.append(time.perf_counter() - started)
            # a holds the writer; closing it hands over to b at once.
            pending = asyncio.create_task(b.write_ops([{"k": "b", "v": 1}]))
            await asyncio.sleep(0.02)
            started = time.perf_counter()
            await a.aclose()
            await pending
            lib_handover.append(time.perf_counter() - started)
        # A stuck holder (it keeps the writer and never writes again) taken over by fencing.
        async with (
            kv_manager(broker, name, **hold) as stuck,
            kv_manager(broker, name, takeover_after_s=0.0, **no_relay) as taker,
        ):
            await stuck.write_ops([{"k": "s", "v": 1}])
            started = time.perf_counter()
            await taker.write_ops([{"k": "t", "v": 1}])
            lib_fence.append(time.perf_counter() - started)
    ms = 1000.0
    first = (percentile(lib_first, 0.5) * ms, percentile(raw_first, 0.5) * ms)
    fence = (percentile(lib_fence, 0.5) * ms, percentile(raw_fence, 0.5) * ms)
    handover = percentile(lib_handover, 0.5) * ms
    return [
        Metric(
            "writer acquisition + first write p50",
            "ms",
            first[0],
            first[1],
            "<= 1.3x",
            first[0] <= 1.3 * first[1],
            note="library: producer, tail capture, catch-up, write; raw: producer, send",
        ),
        Metric(
            "handover after clean close p50",
            "ms",
            handover,
            fence[1],
            "p50 <= 30 ms",
            handover <= 30,
            note="from the holder's close to the waiter's write done; baseline: raw fencing",
        ),
        Metric(
            "takeover of a stuck writer with fencing p50",
            "ms",
            fence[0],
            fence[1],
            "<= 1.3x",
            fence[0] <= 1.3 * fence[1],
            note="library: fencing producer, catch-up, write; raw: fencing producer, send",
        ),
    ]


WORKER = """
import asyncio, sys, time
sys.path.insert(0, {repo!r})
from benchmarks.run import kv_manager
from pulsar_state.testing import Broker
async def main():
    broker = Broker({url!r}, {admin!r}, "external")
    async with kv_manager(broker, {topic!r}) as m:
        await m.sync()
        start = time.time()
        count = 0
        while time.time() - start < {seconds}:
            ops = [m.write_ops([{{"k": "{name}", "v": count + i}}]) for i in range(50)]
            await asyncio.gather(*ops)
            count += 50
        print(count / (time.time() - start), flush=True)
asyncio.run(main())
"""


async def multi_writers(broker: Broker, quick: bool) -> list[Metric]:
    seconds = 3 if quick else 10
    results: dict[int, float] = {}
    for n in (1, 2, 4, 8):
        name = topic(f"multi{n}")
        procs = [
            subprocess.Popen(  # noqa: ASYNC220 - started together, then awaited in threads
                [
                    sys.executable,
                    "-c",
                    WORKER.format(
                        repo=str(REPO),
                        url=broker.service_url,
                        admin=broker.admin_url,
                        topic=name,
                        seconds=seconds,
                        name=f"w{i}",
                    ),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(n)
        ]
        rates = []
        for proc in procs:
            out, _ = await asyncio.to_thread(proc.communicate, timeout=300)
            rates.append(float(out.strip().splitlines()[-1]))
        results[n] = sum(rates)
    return [
        Metric(
            f"aggregate writes, {n} writer processes vs 1",
            "ops/s",
            results[n],
            results[1],
            ">= 0.8x",
            results[n] >= 0.8 * results[1],
            note="each process: 50 concurrent one-op writes at a time",
        )
        for n in (2, 4, 8)
    ]


# ---------------------------------------------------------------- runner


async def run(broker: Broker, quick: bool, only: set[str] | None) -> list[Metric]:
    suites: list[tuple[str, Callable[[Broker, bool], Awaitable[Metric | list[Metric]]]]] = [
        ("local", local_read),
        ("pipelined", pipelined_writes),
        ("group", group_commit),
        ("latency", write_latency),
        ("visibility", visibility),
        ("bootstrap", bootstrap),
        ("snapshot", snapshot_open),
        ("mapsnapshot", map_snapshot_open),
        ("latest", latest_read),
        ("trim", trimmed_storage),
        ("acquisition", acquisition),
        ("writers", multi_writers),
        ("scale", lambda b, quick: map_scale(b, quick, Metric)),
        ("ownerscale", lambda b, quick: ownership_scale(b, quick, Metric)),
    ]
    metrics: list[Metric] = []
    for key, suite in suites:
        if only and key not in only:
            continue
        print(f"... {key}", file=sys.stderr, flush=True)
        result = await suite(broker, quick)
        for metric in result if isinstance(result, list) else [result]:
            metric.ratio = metric.library / metric.baseline if metric.baseline else 0.0
            metrics.append(metric)
            print(
                f"    {metric.name}: {metric.library:.3g} vs {metric.baseline:.3g} {metric.unit}"
                f" ({metric.ratio:.2f}x, {'met' if metric.met else 'MISSED'})",
                file=sys.stderr,
            )
    return metrics


def environment() -> dict[str, Any]:
    def version(package: str) -> str:
        try:
            from importlib.metadata import version as v

            return v(package)
        except Exception:
            return "?"

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "pulsar_client": version("pulsar-client"),
        "pulsar_state": version("pulsar-state"),
        "broker": os.environ.get("PULSAR_VERSION", "4.0.7 (scripts/pulsar-standalone)"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def table(metrics: list[Metric]) -> str:
    lines = [f"{'metric':<52} {'library':>12} {'baseline':>12} {'ratio':>7}  {'target':<24} met"]
    for m in metrics:
        lines.append(
            f"{m.name:<52} {m.library:>12.4g} {m.baseline:>12.4g} {m.ratio:>6.2f}x"
            f"  {m.target:<24} {'yes' if m.met else 'NO'}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--pulsar-url", default=os.environ.get("PULSAR_SERVICE_URL"))
    parser.add_argument("--pulsar-admin-url", default=os.environ.get("PULSAR_ADMIN_URL"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results.json"))
    args = parser.parse_args()
    broker = provide_broker(args.pulsar_url, args.pulsar_admin_url)
    try:
        metrics = asyncio.run(run(broker, args.quick, set(args.only) if args.only else None))
    finally:
        broker.stop()
    print(table(metrics))
    rows = [asdict(m) for m in metrics]
    out = Path(args.out)
    # benchmarks/locks.py keeps its own section of the file: leave it as it is.
    sections = (
        {k: v for k, v in json.loads(out.read_text()).items() if k == "locks"}
        if out.exists()
        else {}
    )
    if args.only and out.exists():
        # A partial run updates its own rows and keeps the others of the last full run.
        fresh = {row["name"] for row in rows}
        kept = [row for row in json.loads(out.read_text())["metrics"] if row["name"] not in fresh]
        rows = kept + rows
    result = {
        **sections,
        "mode": "quick" if args.quick else "full",
        "environment": environment(),
        "metrics": rows,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
