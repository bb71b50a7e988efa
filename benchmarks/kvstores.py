"""The embedded ordered key-value store under PulsarMap's disk store: lmdb against rocksdict.

Measures, for each, on a fresh directory: random-order puts in atomic batches (one write
transaction / WriteBatch per 1,000 keys, with a small "position" key in every batch, as the
disk store commits one log record), point gets of random keys, one ordered iteration over every
key, and the size on disk; then 20,000 puts that each commit on their own (one record of
one put). Values are 100 bytes, keys ``key-%08d``.

    python -m benchmarks.kvstores [--keys 300000] [--dir /tmp/kv-bench]

Needs both packages (``pip install lmdb rocksdict``); only the chosen one is a dependency of
the project (the ``disk`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

_BATCH = 1000
_SINGLES = 20_000


def _keys(n: int) -> list[bytes]:
    return [b"key-%08d" % i for i in range(n)]


# 100-byte values of random letters (compressible about as much as JSON text, not more).
_RNG = random.Random(11)
_VALUES = [bytes(_RNG.choices(b"abcdefghijklmnopqrstuvwxyz0123456789", k=100)) for _ in range(4096)]


def _value(key: bytes) -> bytes:
    return _VALUES[hash(key) % len(_VALUES)]


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            total += os.stat(os.path.join(root, name)).st_blocks * 512  # sparse files: used
    return total


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def bench_lmdb(
    path: str, keys: list[bytes], order: list[bytes], probes: list[bytes], writemap: bool = False
) -> dict[str, Any]:
    import lmdb

    # As the disk store opens it (writemap off), or with writemap (commits write to the map).
    env = lmdb.open(
        path, map_size=1 << 34, max_dbs=2, metasync=False, sync=False, writemap=writemap
    )
    data = env.open_db(b"data")

    def puts() -> None:
        for start in range(0, len(order), _BATCH):
            with env.begin(write=True) as txn:
                for key in order[start : start + _BATCH]:
                    txn.put(key, _value(key), db=data)
                txn.put(b"position", start.to_bytes(8, "big"))

    def puts_one_each() -> None:  # one record, one put: a commit each
        for i, key in enumerate(order[:_SINGLES]):
            with env.begin(write=True) as txn:
                txn.put(key, _value(key) + b"!", db=data)
                txn.put(b"position", i.to_bytes(8, "big"))

    def gets() -> None:
        with env.begin() as txn:
            for key in probes:
                txn.get(key, db=data)

    def gets_txn_each() -> None:
        for key in probes:
            with env.begin() as txn:
                txn.get(key, db=data)

    def iterate() -> None:
        count = 0
        with env.begin() as txn:
            for _key, _value in txn.cursor(db=data):
                count += 1
        assert count == len(keys)

    result = {
        "put_s": _timed(puts),
        "put_one_s": _timed(puts_one_each),
        "get_s": _timed(gets),
        "get_own_txn_s": _timed(gets_txn_each),
        "iterate_s": _timed(iterate),
    }
    env.sync(True)
    env.close()
    result["disk_bytes"] = _dir_bytes(path)
    return result


def bench_rocksdict(
    path: str, keys: list[bytes], order: list[bytes], probes: list[bytes]
) -> dict[str, Any]:
    from rocksdict import Options, Rdict, WriteBatch, WriteOptions

    options = Options(raw_mode=True)
    options.create_if_missing(True)
    db = Rdict(path, options)
    write_options = WriteOptions()

    def puts() -> None:
        for start in range(0, len(order), _BATCH):
            batch = WriteBatch(raw_mode=True)
            for key in order[start : start + _BATCH]:
                batch.put(key, _value(key))
            batch.put(b"position", start.to_bytes(8, "big"))
            db.write(batch, write_options)

    def puts_one_each() -> None:  # one record, one put: a write each
        for i, key in enumerate(order[:_SINGLES]):
            batch = WriteBatch(raw_mode=True)
            batch.put(key, _value(key) + b"!")
            batch.put(b"position", i.to_bytes(8, "big"))
            db.write(batch, write_options)

    def gets() -> None:
        for key in probes:
            db.get(key)

    def iterate() -> None:
        count = 0
        for _key, _value in db.items():
            count += 1
        assert count == len(keys) + 1  # the position key shares the keyspace

    result = {
        "put_s": _timed(puts),
        "put_one_s": _timed(puts_one_each),
        "get_s": _timed(gets),
        "iterate_s": _timed(iterate),
    }
    result["get_own_txn_s"] = result["get_s"]  # no read transactions: each get is one call
    db.flush()
    db.close()
    result["disk_bytes"] = _dir_bytes(path)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=300_000)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    keys = _keys(args.keys)
    rng = random.Random(7)
    order = keys[:]
    rng.shuffle(order)
    probes = [rng.choice(keys) for _ in range(100_000)]
    base = args.dir or tempfile.mkdtemp(prefix="kv-bench-")
    results: dict[str, dict[str, list[float]]] = {}
    for _round in range(args.rounds):
        benches: list[tuple[str, Callable[..., dict[str, Any]]]] = [
            ("lmdb", bench_lmdb),
            ("lmdb-writemap", lambda *a: bench_lmdb(*a, writemap=True)),
            ("rocksdict", bench_rocksdict),
        ]
        for name, bench in benches:
            path = os.path.join(base, name)
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
            for metric, value in bench(path, keys, order, probes).items():
                results.setdefault(name, {}).setdefault(metric, []).append(value)
            shutil.rmtree(path, ignore_errors=True)
    summary: dict[str, dict[str, float]] = {}
    for name, metrics in results.items():
        put_s = statistics.median(metrics["put_s"])
        summary[name] = {
            "put_us": put_s / args.keys * 1e6,
            "put_one_commit_us": statistics.median(metrics["put_one_s"]) / _SINGLES * 1e6,
            "get_us": statistics.median(metrics["get_s"]) / len(probes) * 1e6,
            "get_own_txn_us": statistics.median(metrics["get_own_txn_s"]) / len(probes) * 1e6,
            "iterate_us": statistics.median(metrics["iterate_s"]) / args.keys * 1e6,
            "disk_mb": statistics.median(metrics["disk_bytes"]) / 1e6,
        }
    print(json.dumps({"keys": args.keys, "rounds": args.rounds, "median": summary}, indent=2))
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
