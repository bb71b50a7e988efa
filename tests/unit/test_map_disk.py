"""PulsarMap's disk store, pure (real LMDB on a temporary directory, no broker): the key
encoding keeps the map's key order, a disk state answers as the in-memory one on random
records, survives reopening at its mark, its snapshots are the in-memory codec's bytes, and
bad directories are refused untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recipes._map_disk as map_disk
from pulsar_state import BytesCodec, CodecError, JsonCodec, LogMark, LogPosition, StrCodec
from recipes._map_disk import (
    _MARK_HEAD,
    FORMAT,
    MARKER,
    DiskMapState,
    DiskSnapshotCodec,
    DiskStore,
    LocalStoreError,
    key_from_store,
    pack_mark,
    store_key,
)
from recipes._map_ops import MapCodecs, MapOp, MapSnapshotCodec, MapState, key_order

CODECS: MapCodecs[str, Any] = MapCodecs(StrCodec(), JsonCodec())
TOPIC = "persistent://public/default/disk-unit"

any_keys = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.binary(max_size=6),
    st.text(max_size=6),
)


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(any_keys, min_size=2, max_size=20))
def test_store_key_bytes_sort_as_the_map_orders_keys(keys: list[Any]) -> None:
    by_map = sorted(keys, key=key_order)
    by_store = sorted(keys, key=store_key)
    assert [key_order(k) for k in by_store] == [key_order(k) for k in by_map]
    for key in keys:
        assert key_from_store(store_key(key)) == key
        assert type(key_from_store(store_key(key))) is type(key)


def test_store_keys_edge_cases() -> None:
    ordered: list[Any] = [-(2**64), -256, -255, -1, 0, 1, 255, 256, 2**64, b"", b"\x00", b"\xff"]
    ordered += ["", "\x00", "\ud7ff", "\ud800", "\ue000", "\U0010ffff"]
    assert sorted(ordered, key=store_key) == ordered
    with pytest.raises(CodecError):
        store_key(1.5)


def open_state(path: Path, **options: Any) -> DiskMapState[str, Any]:
    state: DiskMapState[str, Any] = DiskMapState(DiskStore(path, **options), CODECS, TOPIC)
    state.open_store()
    return state


map_keys = st.text(alphabet="abcd", min_size=1, max_size=3)
map_values = st.one_of(
    st.integers(0, 9),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(map_keys, st.booleans(), max_size=2),
)
map_ops = st.one_of(
    st.builds(lambda k, v: CODECS.put(k, v), map_keys, map_values),
    st.builds(lambda k: MapOp("DELETE", k, None, k.encode()), map_keys),
    st.just(MapOp("CLEAR")),
)
records = st.lists(st.lists(map_ops, max_size=5), max_size=8)


def apply_records(
    state: MapState[str, Any], recs: list[list[MapOp[str, Any]]], start: int, commit: bool
) -> None:
    for offset, ops in enumerate(recs):
        position = start + offset
        state.begin(position)
        for op in ops:
            state.apply(op)
        if commit:
            assert isinstance(state, DiskMapState)
            state.commit(LogMark(position, f"r{position}", LogPosition(7, position)))


def answers(state: MapState[str, Any]) -> dict[str, Any]:
    """Every read the map makes, on one state."""
    return {
        "entries": [(k, e.value, int(e.version)) for k, e in state.entries_in_order()],
        "keys": list(state.sorted_keys()),
        "len": len(state.entries),
        "range": state.items_between("b", "c"),
        "range_open": state.items_between(None, "b"),
        "keys_between": state.keys_between("a", "bb"),
        "get": {k: state.entries.get(k) for k in ["a", "b", "ab", "dd", "zz"]},
        "in": {k: k in state.entries for k in ["a", "b", "ab", "dd", "zz"]},
        "values_get": {k: state.values.get(k) for k in ["a", "c", "dcd"]},
        "matching": [(k, e.value) for k, e in state.matching(lambda k: k.startswith("a"))],
    }


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(history=records, more=records, batch=records, cache=st.sampled_from([0, 600, 1 << 20]))
def test_disk_state_answers_as_the_memory_state(
    tmp_path_factory: pytest.TempPathFactory,
    history: list[list[MapOp[str, Any]]],
    more: list[list[MapOp[str, Any]]],
    batch: list[list[MapOp[str, Any]]],
    cache: int,
) -> None:
    path = tmp_path_factory.mktemp("store")
    memory: MapState[str, Any] = MapState()
    disk = open_state(path, cache_bytes=cache)
    apply_records(memory, history, 1, commit=False)
    apply_records(disk, history, 1, commit=True)
    assert answers(disk) == answers(memory)
    assert disk == memory
    # Reopened from disk (a new process): the same state, at the mark of its last record.
    disk.close_store()
    disk = open_state(path, cache_bytes=cache)
    assert disk.mark == (
        LogMark(len(history), f"r{len(history)}", LogPosition(7, len(history))) if history else None
    )
    assert disk.position == memory.position
    assert answers(disk) == answers(memory)
    apply_records(memory, more, len(history) + 1, commit=False)
    apply_records(disk, more, len(history) + 1, commit=True)
    assert answers(disk) == answers(memory)
    # The writer's trial over each gives the same, and leaves the live state alone.
    before = answers(disk)
    trial_memory, trial_disk = memory.trial(), disk.trial()
    apply_records(trial_memory, batch, 100, commit=False)
    apply_records(trial_disk, batch, 100, commit=False)
    assert answers(trial_disk) == answers(trial_memory)
    assert answers(disk) == before
    # Snapshots: the same bytes as the in-memory codec's, and loading them back streams in.
    memory_codec = MapSnapshotCodec(CODECS)
    disk_codec = DiskSnapshotCodec(CODECS)
    data = disk_codec.encode(disk.copy())
    assert data == memory_codec.encode(memory)
    assert disk_codec.encode(disk) == data
    mark = LogMark(memory.position, "snap", LogPosition(9, 9))
    for size in (1, 7, 4096, len(data)):  # entries (and the head) spanning chunks
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        loaded = open_state(tmp_path_factory.mktemp("loaded")).load_snapshot(chunks, mark)
        assert answers(loaded) == answers(memory)
        assert loaded.mark == mark
        loaded.close_store()
    disk.close_store()


def test_a_record_is_stored_whole_or_not_at_all(tmp_path: Path) -> None:
    state = open_state(tmp_path)
    apply_records(state, [[CODECS.put("a", 1), CODECS.put("b", 2)]], 1, commit=True)
    # The next record is applied but never committed (the process dies before its commit).
    state.begin(2)
    state.apply(CODECS.put("a", 10))
    state.apply(MapOp("DELETE", "b", None, b"b"))
    assert state.entries["a"].value == 10  # a write's reader sees its own record...
    assert "b" not in state.entries
    state.close_store(clean=False)
    reopened = open_state(tmp_path)
    # ...but only committed records are stored: record 1, whole.
    assert reopened.mark is not None
    assert reopened.mark.position == 1
    assert [(k, e.value) for k, e in reopened.entries_in_order()] == [("a", 1), ("b", 2)]
    reopened.close_store()


def test_the_cache_is_bounded_and_reads_stay_right(tmp_path: Path) -> None:
    state = open_state(tmp_path, cache_bytes=20_000)
    for position in range(1, 51):
        state.begin(position)
        for i in range(20):
            state.apply(CODECS.put(f"k{position:03d}-{i:02d}", "x" * 100))
        state.commit(LogMark(position, f"r{position}", LogPosition(1, position)))
    assert state.cache.size_bytes <= 20_000
    assert len(state.cache) < 1000
    assert state.entries.get("k001-00") is not None
    assert state.values.get("k001-00") == "x" * 100
    assert len(state.entries) == 1000
    state.close_store()


def test_a_key_the_store_cannot_hold_is_refused_by_the_trial(tmp_path: Path) -> None:
    state = open_state(tmp_path)
    trial = state.trial()
    trial.begin(1)
    with pytest.raises(CodecError, match="keys of at most"):
        trial.apply(CODECS.put("k" * 600, 1))
    state.close_store()


def test_a_directory_that_is_not_a_store_is_refused_untouched(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(LocalStoreError, match="not a PulsarMap store"):
        open_state(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
    a_file = tmp_path / "notes.txt"
    with pytest.raises(LocalStoreError, match="not a directory"):
        open_state(a_file)


def test_a_first_open_killed_before_its_marker_was_in_place_leaves_a_store_that_opens(
    tmp_path: Path,
) -> None:
    # Killed between writing the marker's scratch file and renaming it: nothing else is there.
    scratch = tmp_path / f".{MARKER}.0123abcd"
    scratch.write_text(json.dumps({"format": FORMAT}))
    state = open_state(tmp_path)
    assert (tmp_path / MARKER).exists()
    state.close_store()
    (tmp_path / "other").mkdir()  # the scratch file does not make another directory ours
    (tmp_path / "other" / "notes.txt").write_text("mine")
    (tmp_path / "other" / scratch.name).write_text("")
    with pytest.raises(LocalStoreError, match="not a PulsarMap store"):
        open_state(tmp_path / "other")


def test_a_store_of_a_newer_format_is_refused_untouched(tmp_path: Path) -> None:
    open_state(tmp_path).close_store()
    (tmp_path / MARKER).write_text(json.dumps({"format": FORMAT + 1}))
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    with pytest.raises(LocalStoreError, match="newer pulsar-state"):
        open_state(tmp_path)
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_a_store_of_another_topic_or_codec_is_refused_or_rebuilt(tmp_path: Path) -> None:
    state = open_state(tmp_path)
    apply_records(state, [[CODECS.put("a", 1)]], 1, commit=True)
    state.close_store()
    other: DiskMapState[str, Any] = DiskMapState(DiskStore(tmp_path), CODECS, TOPIC + "-other")
    with pytest.raises(LocalStoreError, match="holds the map of topic"):
        other.open_store()
    bytes_codecs: MapCodecs[str, Any] = MapCodecs(StrCodec(), StrCodec())
    with pytest.raises(LocalStoreError, match="codecs"):
        DiskMapState(DiskStore(tmp_path), bytes_codecs, TOPIC).open_store()
    # Refused twice, still the old topic's store, as it was.
    same = open_state(tmp_path)
    assert same.entries["a"].value == 1
    same.close_store()
    rebuilt: DiskMapState[str, Any] = DiskMapState(
        DiskStore(tmp_path, on_mismatch="rebuild"), CODECS, TOPIC + "-other"
    )
    rebuilt.open_store()
    assert rebuilt.mark is None
    assert len(rebuilt.entries) == 0
    rebuilt.close_store()


def test_a_store_left_open_across_a_machine_restart_is_not_trusted(tmp_path: Path) -> None:
    state = open_state(tmp_path)
    apply_records(state, [[CODECS.put("a", 1)]], 1, commit=True)
    state.close_store(clean=False)  # as if the machine died with it open...
    env = state._env
    env.open(TOPIC, state._codec_names())  # ...under another boot id
    with env.env.begin(write=True, db=env.meta) as txn:
        info = json.loads(txn.get(b"info"))
        info["boot_id"] = "another-boot"
        txn.put(b"info", json.dumps(info).encode())
    env.close(clean=False)
    with pytest.raises(LocalStoreError, match="machine restarted"):
        open_state(tmp_path)
    # A clean close (synced) is trusted on any boot.
    rebuilt = open_state(tmp_path, on_mismatch="rebuild")
    assert rebuilt.mark is None
    rebuilt.close_store()


def test_a_store_whose_history_is_refused_stays_as_cleanly_closed_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The mark is checked against the log after the store opened (and marked itself open):
    # refused, it was left "not closed cleanly", so after a machine restart it was refused
    # for that instead, as if a crash had hit it (review 45a, finding 6).
    state = open_state(tmp_path)
    apply_records(state, [[CODECS.put("a", 1)]], 1, commit=True)
    state.close_store()
    state = open_state(tmp_path)
    with pytest.raises(LocalStoreError, match="created again"):
        state.refuse_history("the topic was deleted and created again")
    monkeypatch.setattr(map_disk, "_boot_id", lambda: "another-boot")
    again = open_state(tmp_path)
    assert again.entries["a"].value == 1
    again.close_store()


def test_one_store_serves_one_process(tmp_path: Path) -> None:
    state = open_state(tmp_path)
    code = (
        "import sys\n"
        "from recipes._map_disk import DiskMapState, DiskStore, LocalStoreError\n"
        "from recipes._map_ops import MapCodecs\n"
        "from pulsar_state import StrCodec, JsonCodec\n"
        f"s = DiskMapState(DiskStore({str(tmp_path)!r}), MapCodecs(StrCodec(), JsonCodec()), "
        f"{TOPIC!r})\n"
        "try:\n    s.open_store()\nexcept LocalStoreError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "refused:" in out.stdout
    assert "open in another process" in out.stdout
    state.close_store()


def test_a_disk_map_watches_only_once_open(tmp_path: Path) -> None:
    from pulsar_state import ClosedError
    from recipes import PulsarMap

    m = PulsarMap("pulsar://127.0.0.1:1", "t", store=DiskStore(tmp_path), check_topic=False)
    with pytest.raises(ClosedError, match="disk store only watches once open"):
        m.changes()


class _LossyCodec(JsonCodec):
    """JSON that drops a dict's "drop" field: decode(encode(x)) != x."""

    def decode(self, data: bytes, /) -> Any:
        value = super().decode(data)
        if isinstance(value, dict):
            value.pop("drop", None)
        return value


class _SetCodec:
    """Values that cannot be frozen: sets."""

    def encode(self, value: Any, /) -> bytes:
        return json.dumps(sorted(value)).encode()

    def decode(self, data: bytes, /) -> Any:
        return set(json.loads(bytes(data)))


def test_values_that_cannot_be_frozen_are_read_as_copies_from_a_resumed_store(
    tmp_path: Path,
) -> None:
    # A resumed store decodes a value on its first read: the map's fast get_local
    # (state.values.get, bound while no value decoded was unfrozen) handed out the cached one.
    codecs: MapCodecs[str, Any] = MapCodecs(StrCodec(), _SetCodec())
    state: DiskMapState[str, Any] = DiskMapState(DiskStore(tmp_path), codecs, TOPIC)
    state.open_store()
    state.begin(1)
    state.apply(codecs.put("k", {1, 2}))
    state.commit(LogMark(1, "r1", LogPosition(1, 1)))
    state.close_store()
    resumed_codecs: MapCodecs[str, Any] = MapCodecs(StrCodec(), _SetCodec())
    resumed: DiskMapState[str, Any] = DiskMapState(DiskStore(tmp_path), resumed_codecs, TOPIC)
    resumed.open_store()
    got = resumed.values.get("k")
    assert got == {1, 2}
    got.add(999)  # a caller changing what it read
    assert resumed.values.get("k") == {1, 2}
    assert resumed.values["k"] == {1, 2}
    assert resumed.entries["k"].value == {1, 2}
    resumed.close_store()


def test_a_snapshot_of_a_disk_state_is_streamed_and_checked_entry_by_entry(
    tmp_path: Path,
) -> None:
    state = open_state(tmp_path)
    value = {"pad": "v" * 100}
    apply_records(state, [[CODECS.put(f"k{i:06d}", value) for i in range(20_000)]], 1, commit=True)
    codec = DiskSnapshotCodec(CODECS)
    parts = list(codec.encode_parts(state.copy()))
    assert len(parts) > 1  # a few megabytes: handed over in parts, never joined here
    assert all(len(part) < 2 * 1024 * 1024 for part in parts)
    data = b"".join(parts)
    assert data == MapSnapshotCodec(CODECS).encode(MapSnapshotCodec(CODECS).decode(data))
    assert codec.encode(state) == data  # the live state: through a view of its own
    image = codec.decode(data)
    assert codec.encode(image) is data  # checked entry by entry, no copy
    assert image == state
    # A lossy value codec is refused, as the in-memory map's snapshot codec refuses it.
    apply_records(state, [[CODECS.put("lossy", {"keep": 1, "drop": 2})]], 2, commit=True)
    lossy: MapCodecs[str, Any] = MapCodecs(StrCodec(), _LossyCodec())
    with pytest.raises(CodecError, match="lossy"):
        b"".join(DiskSnapshotCodec(lossy).encode_parts(state.copy()))
    state.close_store()


def test_snapshot_bytes_of_int_keys_whose_codec_bytes_sort_otherwise(tmp_path: Path) -> None:
    int_codecs: MapCodecs[int, Any] = MapCodecs(JsonCodec(), JsonCodec())
    state: DiskMapState[int, Any] = DiskMapState(DiskStore(tmp_path), int_codecs, TOPIC)
    state.open_store()
    memory: MapState[int, Any] = MapState()
    for target in (state, memory):
        target.begin(1)
        for key in (9, 10, -3, 100, 0):  # JSON bytes "10" < "9": not the store's order
            target.apply(int_codecs.put(key, key * 2))
    state.commit(LogMark(1, "r1", LogPosition(1, 1)))
    data = DiskSnapshotCodec(int_codecs).encode(state.copy())
    assert data == MapSnapshotCodec(int_codecs).encode(memory)
    assert list(state.sorted_keys()) == [-3, 0, 9, 10, 100]
    state.close_store()


def test_the_mark_keeps_the_origin_and_a_format_1_mark_reads_without_one(tmp_path: Path) -> None:
    state = open_state(tmp_path)
    state.begin(1)
    state.apply(CODECS.put("a", 1))
    state.commit(LogMark(1, "r1", LogPosition(3, 4), "r-first"))
    state.close_store()
    reopened = open_state(tmp_path)
    assert reopened.mark == LogMark(1, "r1", LogPosition(3, 4), "r-first")
    # A format-1 store's mark: state 1, the record id to the end (no origin), which is
    # also how a mark without an origin is still written.
    assert reopened._env.env is not None
    format_1 = _MARK_HEAD.pack(1, 1, 3, 4, 1) + b"r1"
    assert pack_mark(LogMark(1, "r1", LogPosition(3, 4)), 1) == format_1
    with reopened._env.env.begin(write=True, db=reopened._env.meta) as txn:
        txn.put(b"mark", format_1)
    reopened.close_store()
    old = open_state(tmp_path)
    assert old.mark == LogMark(1, "r1", LogPosition(3, 4), None)
    old.close_store()


def test_the_mark_keeps_the_stale_records_it_names(tmp_path: Path) -> None:
    # Records ignored as stale before the mark's record that claimed its position: a store
    # reopened resumes after the mark and must still know them (Replica.stale_at_applied).
    state = open_state(tmp_path)
    for position, stale in ((1, (("B/2", 1), ("odd\x00id", 2))), (2, ())):
        state.begin(position)
        state.apply(CODECS.put("a", position))
        state.commit(LogMark(position, f"r{position}", LogPosition(3, position), "r1", stale))
        state.close_store()
        state = open_state(tmp_path)
        assert state.mark == LogMark(
            position, f"r{position}", LogPosition(3, position), "r1", stale
        )
    state.close_store()


def state_with_one_key(path: Path, key: str) -> DiskMapState[str, Any]:
    """A store holding ``key`` (value 1) at mark 1."""
    state = open_state(path)
    state.begin(1)
    state.apply(CODECS.put(key, 1))
    state.commit(LogMark(1, "r1", LogPosition(1, 1)))
    return state


def snapshot_bytes(keys: list[str]) -> bytes:
    """A map snapshot of ``keys``, each key's value its index."""
    memory: MapState[str, Any] = MapState()
    memory.load({})
    for i, key in enumerate(keys):
        memory.apply(CODECS.put(key, i))
    return MapSnapshotCodec(CODECS).encode(memory)


def snapshot_of(entries: list[tuple[bytes, bytes]]) -> bytes:
    """Map snapshot bytes of (key bytes, value bytes) pairs as given, however wrong."""
    parts = [map_disk._SNAPSHOT_MAGIC, map_disk._SNAPSHOT_HEAD.pack(5, len(entries))]
    for key, value in entries:
        parts += [map_disk._SNAPSHOT_ENTRY.pack(1 << 32, len(key), len(value)), key, value]
    return b"".join(parts)


def test_a_snapshot_whose_chunks_fail_or_do_not_parse_leaves_the_store_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(map_disk, "_LOAD_TRANSACTION_BYTES", 50)  # fails after commits
    state = state_with_one_key(tmp_path, "kept")
    data = snapshot_bytes([f"k{i}" for i in range(50)])

    def damaged_after_most() -> Any:
        yield data[:10]
        yield data[10:-20]
        raise RuntimeError("the digest did not match")

    cases: list[tuple[Any, type[Exception], str]] = [
        (damaged_after_most(), RuntimeError, "digest"),
        ([data[:-3]], CodecError, "truncated"),
        ([data, b"x"], CodecError, "left over"),
        ([b"PSMAQ" + data[5:]], CodecError, "not a PulsarMap snapshot"),
        ([], CodecError, "truncated"),
    ]
    # A key a StrCodec could not have written (a bytes-keyed map's snapshot, read as str).
    bytes_codecs: MapCodecs[bytes, Any] = MapCodecs(BytesCodec(), JsonCodec())
    bytes_map: MapState[bytes, Any] = MapState()
    bytes_map.load({})
    bytes_map.apply(bytes_codecs.put(b"\xff", 1))
    cases.append(([MapSnapshotCodec(bytes_codecs).encode(bytes_map)], CodecError, "a key"))
    # A key named twice, in one transaction and in two: refused as the in-memory codec does.
    many = [(f"k{i:02d}".encode(), b"1") for i in range(20)]
    for twice in ([(b"a", b"1"), (b"a", b"2")], [*many, (b"k01", b"2")]):
        cases.append(([snapshot_of(twice)], CodecError, "names a key twice"))
    for chunks, error, message in cases:
        with pytest.raises(error, match=message):
            state.load_snapshot(chunks, LogMark(9, "snap", LogPosition(2, 2)))
        assert state.mark == LogMark(1, "r1", LogPosition(1, 1))
        assert [(k, e.value) for k, e in state.entries_in_order()] == [("kept", 1)]
    state.begin(2)  # and it goes on from where it was
    state.apply(CODECS.put("after", 2))
    state.commit(LogMark(2, "r2", LogPosition(1, 2)))
    state.close_store()
    reopened = open_state(tmp_path)
    assert [(k, e.value) for k, e in reopened.entries_in_order()] == [("after", 2), ("kept", 1)]
    reopened.close_store()


def test_reads_during_a_snapshot_load_see_the_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(map_disk, "_LOAD_TRANSACTION_BYTES", 200)  # many transactions
    state = state_with_one_key(tmp_path, "old")
    data = snapshot_bytes([f"k{i:03d}" for i in range(100)])
    seen: list[Any] = []

    def chunks() -> Any:
        for at in range(0, len(data), 100):
            yield data[at : at + 100]
            # The load's transactions have committed some entries by now.
            seen.append((state.lookup("old"), state.lookup("k000"), state.count()))

    state.load_snapshot(chunks(), LogMark(9, "snap", LogPosition(2, 2)))
    assert len(seen) > 10
    assert all(found[0] is not None and found[0].value == 1 for found in seen)
    assert all(found[1] is None and found[2] == 1 for found in seen)
    assert state.lookup("old") is None
    assert state.count() == 100
    assert [k for k, _ in state.entries_in_order()] == [f"k{i:03d}" for i in range(100)]
    with state._env.env.begin() as txn:  # the old entries are gone once the loop followed
        assert txn.stat(state._env.spare)["entries"] == 0
    state.close_store()
    reopened = open_state(tmp_path)
    assert reopened.mark == LogMark(9, "snap", LogPosition(2, 2))
    assert reopened.count() == 100
    assert reopened.lookup("k099") is not None
    reopened.close_store()


def test_a_failed_load_right_after_another_leaves_the_first_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two loads with no use of the store by the loop in between (a fall-forward right after
    # an open from a snapshot): the second's failure emptied the database the first filled.
    monkeypatch.setattr(map_disk, "_LOAD_TRANSACTION_BYTES", 200)
    state = state_with_one_key(tmp_path, "old")
    first = LogMark(5, "first", LogPosition(2, 1))
    state.load_snapshot([snapshot_bytes(["a", "b", "c"])], first)
    data = snapshot_bytes([f"k{i:03d}" for i in range(100)])

    def damaged() -> Any:
        yield data[: len(data) // 2]
        raise RuntimeError("the digest did not match")

    with pytest.raises(RuntimeError, match="digest"):
        state.load_snapshot(damaged(), LogMark(9, "snap", LogPosition(2, 2)))
    assert state.mark == first
    assert state.count() == 3
    assert [(k, e.value) for k, e in state.entries_in_order()] == [("a", 0), ("b", 1), ("c", 2)]
    state.close_store()
    reopened = open_state(tmp_path)
    assert reopened.mark == first
    assert reopened.count() == 3
    assert [(k, e.value) for k, e in reopened.entries_in_order()] == [("a", 0), ("b", 1), ("c", 2)]
    reopened.close_store()


def test_reads_during_a_load_right_after_another_see_the_first_and_lose_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(map_disk, "_LOAD_TRANSACTION_BYTES", 200)  # many transactions
    state = state_with_one_key(tmp_path, "old")
    state.load_snapshot([snapshot_bytes(["first"])], LogMark(5, "first", LogPosition(2, 1)))
    data = snapshot_bytes([f"k{i:03d}" for i in range(100)])
    seen: list[Any] = []

    def chunks() -> Any:
        for at in range(0, len(data), 100):
            yield data[at : at + 100]
            if at >= 1000:  # once the second load stored a few transactions
                seen.append((state.lookup("first"), state.lookup("k000")))

    mark = LogMark(9, "snap", LogPosition(2, 2))
    state.load_snapshot(chunks(), mark)
    assert len(seen) > 10
    # Until the second load ends the loop reads what the first loaded, then the second.
    assert all(found[0] is not None and found[1] is None for found in seen)
    assert state.count() == 100
    assert [k for k, _ in state.entries_in_order()] == [f"k{i:03d}" for i in range(100)]
    state.close_store()
    reopened = open_state(tmp_path)
    assert reopened.mark == mark
    assert reopened.count() == 100
    assert [k for k, _ in reopened.entries_in_order()] == [f"k{i:03d}" for i in range(100)]
    with reopened._env.env.begin() as txn:
        assert txn.stat(reopened._env.spare)["entries"] == 0
    reopened.close_store()


def test_a_scan_while_a_load_ends_gives_the_old_content_whole(tmp_path: Path) -> None:
    state = open_state(tmp_path, cache_bytes=0)
    apply_records(state, [[CODECS.put(f"k{i:03d}", i) for i in range(100)]], 1, commit=True)
    loaded = LogMark(9, "snap", LogPosition(2, 2))
    seen: list[str] = []

    def accept(key: str) -> bool:
        seen.append(key)
        if len(seen) == 3:  # a fall-forward's load ends in its worker thread meanwhile
            load = threading.Thread(
                target=state.load_snapshot, args=([snapshot_bytes(["new"])], loaded)
            )
            load.start()
            load.join()
        # A read from the scan's callback does not switch the store under the scan.
        entry = state.lookup("k000")
        assert entry is not None
        assert entry.value == 0
        return key.endswith("0")

    found = state.matching(accept)
    assert len(seen) == 100
    assert [(k, e.value) for k, e in found] == [(f"k{i:03d}", i) for i in range(0, 100, 10)]
    assert state.mark == loaded  # the scan ended: the next read follows the load
    assert [(k, e.value) for k, e in state.entries_in_order()] == [("new", 0)]
    assert state.lookup("k000") is None
    state.close_store()


_KILLED_MID_LOAD = """
import os, signal, sys
from typing import Any
sys.path[:0] = [{root!r}]
import recipes._map_disk as map_disk
from pulsar_state import JsonCodec, LogMark, LogPosition, StrCodec
from recipes._map_disk import DiskMapState, DiskStore
from recipes._map_ops import MapCodecs, MapSnapshotCodec, MapState

map_disk._LOAD_TRANSACTION_BYTES = 200
codecs = MapCodecs(StrCodec(), JsonCodec())
state = DiskMapState(DiskStore({path!r}), codecs, {topic!r})
state.open_store()
state.begin(1)
state.apply(codecs.put("old", 1))
state.commit(LogMark(1, "r1", LogPosition(1, 1)))

def snapshot(keys):
    memory = MapState()
    memory.load({{}})
    for i, key in enumerate(keys):
        memory.apply(codecs.put(key, i))
    return MapSnapshotCodec(codecs).encode(memory)

if {first_load!r}:  # loaded, and nothing used the store before the next load
    state.load_snapshot([snapshot(["first"])], LogMark(5, "first", LogPosition(2, 1)))
data = snapshot([f"k{{i:03d}}" for i in range(100)])

def chunks():
    for at in range(0, len(data), 100):
        yield data[at : at + 100]
        if at >= 2000:  # several transactions committed: killed half-way
            os.kill(os.getpid(), signal.SIGKILL)

state.load_snapshot(chunks(), LogMark(9, "snap", LogPosition(2, 2)))
"""


@pytest.mark.parametrize("first_load", [False, True])
def test_a_process_killed_while_loading_a_snapshot_reopens_to_the_old_content(
    tmp_path: Path, first_load: bool
) -> None:
    # first_load: a snapshot loaded just before, the loop never using the store in between
    # (the second load emptied and refilled the database the first had made active).
    script = _KILLED_MID_LOAD.format(
        root=str(Path(__file__).resolve().parents[2]),
        path=str(tmp_path),
        topic=TOPIC,
        first_load=first_load,
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == -9, done.stderr.decode()
    reopened = open_state(tmp_path)
    if first_load:
        assert reopened.mark == LogMark(5, "first", LogPosition(2, 1))
        assert [(k, e.value) for k, e in reopened.entries_in_order()] == [("first", 0)]
        assert reopened.count() == 1
    else:
        assert reopened.mark == LogMark(1, "r1", LogPosition(1, 1))
        assert [(k, e.value) for k, e in reopened.entries_in_order()] == [("old", 1)]
    with reopened._env.env.begin() as txn:  # the part loaded was dropped on open
        assert txn.stat(reopened._env.spare)["entries"] == 0
    reopened.close_store()


def test_a_snapshot_of_a_map_with_other_key_codecs_loads_into_the_store(tmp_path: Path) -> None:
    codecs: MapCodecs[Any, Any] = MapCodecs(JsonCodec(), JsonCodec())
    memory: MapState[Any, Any] = MapState()
    memory.load({})
    for key in (10, -3, 2**70, 0, 7):
        memory.apply(codecs.put(key, {"k": key}))
    data = MapSnapshotCodec(codecs).encode(memory)
    state: DiskMapState[Any, Any] = DiskMapState(DiskStore(tmp_path), codecs, TOPIC)
    state.open_store()
    state.load_snapshot([data[:5], data[5:]], LogMark(5, "snap", LogPosition(1, 1)))
    assert [(k, e.value) for k, e in state.entries_in_order()] == [
        (k, {"k": k}) for k in (-3, 0, 7, 10, 2**70)
    ]
    state.close_store()


def test_entries_larger_than_many_chunks_load_whole(tmp_path: Path) -> None:
    memory: MapState[str, Any] = MapState()
    memory.load({})
    memory.apply(CODECS.put("big", "x" * 300_000))
    memory.apply(CODECS.put("small", 1))
    memory.apply(CODECS.put("\x00nul", "y" * 5000))
    data = MapSnapshotCodec(CODECS).encode(memory)
    for size in (3, 1000, 65536):
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        state = open_state(tmp_path / str(size))
        state.load_snapshot(chunks, LogMark(3, "r\x00id", LogPosition(1, 1), "o\x00rigin"))
        assert [(k, e.value) for k, e in state.entries_in_order()] == [
            ("\x00nul", "y" * 5000),
            ("big", "x" * 300_000),
            ("small", 1),
        ]
        state.close_store()
        reopened = open_state(tmp_path / str(size))
        # Ids may hold a NUL: the mark keeps them apart by length.
        assert reopened.mark == LogMark(3, "r\x00id", LogPosition(1, 1), "o\x00rigin")
        reopened.close_store()


def test_a_snapshot_image_with_an_entry_more_is_not_equal() -> None:
    # The check that a snapshot decodes back to the state compared entries with zip(),
    # which dropped the first extra entry: an image of (a, b) equalled a state of (a).
    codecs = MapCodecs(StrCodec(), JsonCodec())
    two: MapState[Any, Any] = MapState()
    two.begin(1)
    two.apply(codecs.put("a", 1))
    two.apply(codecs.put("b", 2))
    one: MapState[Any, Any] = MapState()
    one.begin(1)
    one.apply(codecs.put("a", 1))
    image = DiskSnapshotCodec(codecs).decode(MapSnapshotCodec(codecs).encode(two))
    assert image == two
    assert image != one
    assert one != image
