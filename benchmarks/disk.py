"""A disk-backed PulsarMap against the in-memory one (issue 18): peak RSS, put and get
latency, and the time to open again: from the local store, from a snapshot, by a full replay.

    python -m benchmarks.disk [--keys 1000000] [--puts 1000] [--cache-mb 64] [--no-memory]
        [--url pulsar://127.0.0.1:6650 --admin-url http://127.0.0.1:8080] [--out FILE]

One topic is preloaded with ``--keys`` keys of 100-byte values (25,000-key ``put_all``
records) by a disk-backed writer. Every measurement then runs in its own Python process, so
that its peak RSS (``VmHWM``, which counts the store's file pages mapped in too) is its own,
with the peak of its own memory (``RssAnon``, sampled) beside it: it opens the map the way
named, reports the open time and how many records it read, times ``--puts`` sequential
``put`` calls (half new keys, half overwrites), then cached gets (keys it just wrote) and
uncached gets (random keys of the whole map). Results go to stdout as JSON and to
``benchmarks/disk_results.json`` (or ``--out``). ``--no-memory`` skips the in-memory map's
runs (at 10M keys it needs about 6 GB; the issue compares the disk map at 10M keys with the
in-memory map at 1M).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from recipes import DiskStore, PulsarMap

_VALUE = "v" * 100
_CHUNK = 25_000
_RECORD_BYTES = 4 * 1024 * 1024


def _key(i: int) -> str:
    return f"key-{i:09d}"


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "admin_url": args.admin_url,
        "max_record_bytes": _RECORD_BYTES,
        "write_timeout_s": 600,
        "read_timeout_s": 600,
        "open_timeout_s": 3600,
        "idle_release_s": 60,
        "max_hold_s": 600,
    }


def _rss() -> dict[str, float]:
    status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)

    def mb(name: str) -> float:
        return int(fields.get(name, "0 kB").split()[0]) / 1024

    return {
        # VmHWM, not ru_maxrss: that one keeps the parent's peak across fork and exec.
        "peak_rss_mb": mb("VmHWM"),
        "rss_anon_mb": mb("RssAnon"),
        "rss_file_mb": mb("RssFile"),
    }


class _PeakAnon:
    """The peak of RssAnon (the process's own memory, not the store's file pages mapped in
    and counted by VmHWM), sampled every 20 ms by a thread."""

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_mb = max(self.peak_mb, _rss()["rss_anon_mb"])

    def stop(self) -> float:
        self._stop.set()
        self.peak_mb = max(self.peak_mb, _rss()["rss_anon_mb"])
        return self.peak_mb


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement, in this process: open as ``args.mode`` says, then time."""
    options = _options(args)
    if args.mode.startswith("disk"):
        options["store"] = DiskStore(args.store, cache_bytes=args.cache_mb * 1024 * 1024)
    options["snapshots"] = args.snapshots
    if args.no_snapshot_load:
        options["load_snapshot"] = False
    baseline = _rss()["rss_anon_mb"]
    peak_anon = _PeakAnon()
    started = time.perf_counter()
    async with PulsarMap(args.url, args.topic, **options) as m:
        opened_s = time.perf_counter() - started
        result: dict[str, Any] = {
            "mode": args.mode,
            "open_s": opened_s,
            "records_read": m.stats.records_read,
            "bytes_read": m.stats.bytes_read,
            "resumed_position": m.stats.resumed_position,
            "snapshot_loaded_position": m.stats.snapshot_loaded_position,
            "keys": len(m),
            "rss_before_open_mb": baseline,
        }
        if args.snapshot_after:
            began = time.perf_counter()
            result["snapshot_position"] = await m.snapshot()
            result["snapshot_s"] = time.perf_counter() - began
        if args.puts:
            rng = random.Random(5)
            loop = asyncio.get_running_loop()
            latencies: list[float] = []
            written: list[str] = []
            for i in range(args.puts):
                key = _key(args.keys + i) if i % 2 else _key(rng.randrange(args.keys))
                began = loop.time()
                await m.put(key, _VALUE)
                latencies.append(loop.time() - began)
                written.append(key)
            result["put_p50_ms"] = _percentile(latencies, 0.5) * 1000
            result["put_p99_ms"] = _percentile(latencies, 0.99) * 1000
            for label, keys in (
                ("cached", written),
                ("uncached", [_key(rng.randrange(args.keys)) for _ in range(args.puts)]),
            ):
                times = []
                for key in keys:
                    began = time.perf_counter()
                    m.get_local(key)
                    times.append(time.perf_counter() - began)
                result[f"get_{label}_p50_us"] = _percentile(times, 0.5) * 1e6
        result.update(_rss())
        result["peak_anon_mb"] = peak_anon.stop()
    return result


async def _preload(args: argparse.Namespace, store: str) -> None:
    options = _options(args)
    options["store"] = DiskStore(store, cache_bytes=8 * 1024 * 1024)
    async with PulsarMap(args.url, args.topic, **options) as m:
        for start in range(0, args.keys, _CHUNK):
            await m.put_all((_key(i), _VALUE) for i in range(start, min(args.keys, start + _CHUNK)))


def _run_child(args: argparse.Namespace, mode: str, store: str = "", **flags: Any) -> Any:
    command = [
        sys.executable, "-m", "benchmarks.disk", "--child", mode, "--topic", args.topic,
        "--url", args.url, "--admin-url", args.admin_url, "--keys", str(args.keys),
        "--cache-mb", str(args.cache_mb), "--store", store,
        "--puts", str(flags.get("puts", 0)),
    ]  # fmt: skip
    for flag in ("snapshots", "no_snapshot_load", "snapshot_after"):
        if flags.get(flag):
            command.append("--" + flag.replace("_", "-"))
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--puts", type=int, default=1000)
    parser.add_argument("--cache-mb", type=int, default=64)
    parser.add_argument(
        "--url", default=os.environ.get("PULSAR_SERVICE_URL", "pulsar://127.0.0.1:6650")
    )
    parser.add_argument(
        "--admin-url", default=os.environ.get("PULSAR_ADMIN_URL", "http://127.0.0.1:8080")
    )
    parser.add_argument("--dir", default=None)
    parser.add_argument("--child", default=None)
    parser.add_argument("--topic", default=None)
    parser.add_argument("--store", default="")
    parser.add_argument("--snapshots", action="store_true")
    parser.add_argument("--no-snapshot-load", action="store_true")
    parser.add_argument("--snapshot-after", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        print(json.dumps(asyncio.run(_child(args))))
        return
    base = Path(args.dir or tempfile.mkdtemp(prefix="disk-bench-"))
    args.topic = f"persistent://public/default/bench-disk-{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    asyncio.run(_preload(args, str(base / "preload")))
    preload_s = time.perf_counter() - started
    shutil.rmtree(base / "preload")
    rows: dict[str, Any] = {"keys": args.keys, "preload_s": preload_s}
    # Full replays (no snapshot yet), each then timed on puts and gets.
    if not args.no_memory:
        rows["memory_replay"] = _run_child(args, "memory", puts=args.puts)
    rows["disk_replay"] = _run_child(args, "disk", str(base / "a"), puts=args.puts)
    # The disk map again on its up-to-date store: the restart with a local store.
    rows["disk_local_store"] = _run_child(args, "disk", str(base / "a"), puts=args.puts)
    # A snapshot, then opening from it: in memory, and into a new store.
    rows["snapshot_taken"] = _run_child(
        args, "disk", str(base / "a"), snapshots=True, snapshot_after=True
    )
    if not args.no_memory:
        rows["memory_snapshot"] = _run_child(args, "memory", snapshots=True)
    rows["disk_snapshot"] = _run_child(args, "disk", str(base / "b"), snapshots=True)
    shutil.rmtree(base, ignore_errors=True)
    results = {
        "environment": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "cache_mb": args.cache_mb,
        **rows,
    }
    print(json.dumps(results, indent=2))
    out = Path(args.out) if args.out else Path(__file__).with_name("disk_results.json")
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
