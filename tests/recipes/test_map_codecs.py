"""Codecs: str, bytes, JSON and Avro values; schema evolution both ways; bad input."""

from __future__ import annotations

from typing import Any

import pytest

from pulsar_state import (
    AvroCodec,
    BytesCodec,
    CodecError,
    CorruptRecordError,
    JsonCodec,
    ReplicaHaltedError,
    SchemaMismatchError,
    StrCodec,
)
from recipes import DiskStore, PulsarMap
from tests.core.helpers import topic_message_count
from tests.recipes.helpers import WAIT_S, new_map

USER_V1 = {
    "type": "record",
    "name": "User",
    "fields": [{"name": "name", "type": "string"}],
}
USER_V2 = {
    "type": "record",
    "name": "User",
    "fields": [
        {"name": "name", "type": "string"},
        {"name": "age", "type": "int", "default": 0},
    ],
}
USER_INCOMPATIBLE = {
    "type": "record",
    "name": "User",
    "fields": [{"name": "name", "type": "int"}],
}

User = dict[str, Any]


def causes(error: BaseException) -> list[type[BaseException]]:
    chain: list[type[BaseException]] = []
    current: BaseException | None = error
    while current is not None:
        chain.append(type(current))
        current = current.__cause__
    return chain


async def test_str_bytes_and_json_codecs_round_trip(
    service_url: str, admin_url: str, topic: str
) -> None:
    options: dict[str, Any] = {"key_codec": BytesCodec(), "value_codec": StrCodec()}
    async with (
        new_map(service_url, topic, admin_url, **options) as a,
        new_map(service_url, topic, admin_url, **options) as b,
    ):
        await a.put(b"\x00\xffkey", "välue")
        assert await b.get(b"\x00\xffkey", latest=True) == "välue"
        await a.put(bytearray(b"ba"), "normalised to bytes")
        assert b"ba" in a


async def test_avro_values_and_schema_evolution_both_ways(
    service_url: str, admin_url: str, topic: str
) -> None:
    # An old process (v1) and a new one (v2, a field added with a default) share the map;
    # each is told the other's schema as a writer schema.
    old_codec: AvroCodec[User] = AvroCodec(USER_V1, writer_schemas=[USER_V2])
    new_codec: AvroCodec[User] = AvroCodec(USER_V2, writer_schemas=[USER_V1])
    async with (
        new_map(service_url, topic, admin_url, value_codec=old_codec) as old,
        new_map(service_url, topic, admin_url, value_codec=new_codec) as new,
    ):
        await old.put("ann", {"name": "Ann"})
        # New reader, old data: the added field takes its default.
        assert await new.get("ann", latest=True) == {"name": "Ann", "age": 0}
        await new.put("bob", {"name": "Bob", "age": 42})
        # Old reader, new data: resolved to the old shape.
        assert await old.get("bob", latest=True) == {"name": "Bob"}
        # Each writer stores what its own replica decodes, so compare-and-set works per side.
        assert await new.replace("ann", {"name": "Ann", "age": 0}, {"name": "Ann", "age": 7})
        assert await old.get("ann", latest=True) == {"name": "Ann"}
        # A value that does not fit the schema is refused before anything is sent.
        position = new.position
        with pytest.raises(CodecError):
            await new.put("bad", {"name": 12})
        with pytest.raises(CodecError):
            await new.put("bad", {"nom": "x"})
        # One bad value among many is named by its key (before: the codec's error alone, for
        # a Spark sink's batch of thousands; review 45c F6).
        with pytest.raises(CodecError, match=r"the value of key 'bad': "):
            await new.put_all({"fine": {"name": "Fine"}, "bad": {"name": 12}})
        assert await new.sync() == position


async def test_reader_without_the_writer_schema_halts_with_schema_mismatch(
    service_url: str, admin_url: str, topic: str
) -> None:
    new_codec: AvroCodec[User] = AvroCodec(USER_V2)
    async with new_map(service_url, topic, admin_url, value_codec=new_codec) as new:
        await new.put("bob", {"name": "Bob", "age": 42})
    unknown: AvroCodec[User] = AvroCodec(USER_V1)  # v2's schema was never given
    with pytest.raises(ReplicaHaltedError) as error:
        await new_map(service_url, topic, admin_url, value_codec=unknown).open()
    assert causes(error.value)[1:3] == [CorruptRecordError, SchemaMismatchError]
    incompatible: AvroCodec[User] = AvroCodec(USER_INCOMPATIBLE, writer_schemas=[USER_V2])
    with pytest.raises(ReplicaHaltedError) as error:
        await new_map(service_url, topic, admin_url, value_codec=incompatible).open()
    assert causes(error.value)[1:3] == [CorruptRecordError, SchemaMismatchError]
    assert "resolve" in str(error.value.__cause__)


async def test_wrong_types_are_refused_before_sending_and_leave_the_map_intact(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url) as m:
        await m.put_all({"a": 1, "b": 2})
        before = (m.items(), m.position)
        bad_calls: list[Any] = [
            m.put(5, 1),  # StrCodec keys need str
            m.put("c", object()),  # not JSON
            m.put("c", float("nan")),  # not valid JSON either
            m.put("c", None),  # None means absent: never stored
            m.put_all({"c": 3, "d": object()}),  # one bad value: nothing at all
            m.put_all([("c", 3), (b"d", 4)]),
            m.put_if_absent(5, 1),
            m.replace(5, None, 1),
            m.replace("a", object(), 1),
            m.replace_version("a", 1, {1, 2}),
            m.delete(5),
            m.update(5, lambda k, v: 1),
            m.update("a", lambda k, v: {"set": {1}}),  # fn's result is checked too
            m.update_multiple(lambda k: True, lambda k, v: object()),
        ]
        for call in bad_calls:
            with pytest.raises(CodecError):
                await call
        with pytest.raises(CodecError):
            m.changes(key=5)
        assert (m.items(), m.position) == before
        assert await m.sync() == before[1]
    assert await topic_message_count(service_url, topic) == 1


async def test_json_keys_must_be_str_or_int(service_url: str, admin_url: str, topic: str) -> None:
    async with new_map(service_url, topic, admin_url, key_codec=JsonCodec()) as m:
        for bad_key in [("a", 1), 1.5, True, None]:
            with pytest.raises(CodecError):
                await m.put(bad_key, 1)
        await m.put("text", 1)
        await m.put(7, 2)
        assert m.keys() == [7, "text"]  # mixed types: ints first, then str


async def test_undecodable_value_on_the_topic_halts_the_replica(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        new_map(service_url, topic, admin_url) as json_map,
        new_map(service_url, topic, admin_url, value_codec=BytesCodec()) as raw,
    ):
        await json_map.put("good", {"ok": True})
        good_position = json_map.position
        await raw.put("bad", b"\xff\xfe not json")
        with pytest.raises(ReplicaHaltedError) as error:
            await json_map.get("good", latest=True, timeout=WAIT_S)
        assert causes(error.value)[1:3] == [CorruptRecordError, CodecError]
        # Halted at the last good state: everything from then on says so, nothing changed.
        assert json_map.position == good_position
        with pytest.raises(ReplicaHaltedError):
            len(json_map)
        with pytest.raises(ReplicaHaltedError):
            json_map.get_local("good")  # the fast local read stops at the halt too
        with pytest.raises(ReplicaHaltedError):
            await json_map.put("more", 1)
        assert await raw.get("bad") == b"\xff\xfe not json"  # the other codec reads it fine
    with pytest.raises(ReplicaHaltedError):
        await new_map(service_url, topic, admin_url).open()


async def test_undecodable_key_on_the_topic_halts_the_replica(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with new_map(service_url, topic, admin_url, key_codec=BytesCodec()) as raw:
        await raw.put(b"fine", 1)
        await raw.put(b"\xff\xfe", 2)  # not UTF-8: no str key
    with pytest.raises(ReplicaHaltedError) as error:
        await new_map(service_url, topic, admin_url).open()
    assert causes(error.value)[1:3] == [CorruptRecordError, CodecError]
    json_keys: PulsarMap[Any, Any] = new_map(service_url, topic, admin_url, key_codec=JsonCodec())
    with pytest.raises(ReplicaHaltedError):
        await json_keys.open()  # b"fine" is not JSON either


ORDER = {
    "type": "record",
    "name": "Order",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "items", "type": {"type": "array", "items": "string"}},
    ],
}


async def test_avro_values_holding_arrays_are_encoded_again_once_stored(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Stored values are read-only (their arrays FrozenLists), and fastavro's writer took only
    # exact lists: a snapshot, a disk store's commit, and a write given a value read from the
    # map all raised CodecError ("Expected list, got FrozenList").
    options: dict[str, Any] = {"value_codec": AvroCodec(ORDER), "snapshots": True}
    async with new_map(service_url, topic, admin_url, **options) as orders:
        await orders.put("o1", {"id": "o1", "items": ["apple", "pear"]})
        current = orders.get_local("o1")
        assert current == {"id": "o1", "items": ["apple", "pear"]}
        await orders.put("o2", current)
        assert await orders.replace("o1", current, {"id": "o1", "items": []})
        position = await orders.snapshot()
    async with new_map(service_url, topic, admin_url, **options) as reopened:
        assert reopened.manager.stats.snapshot_loaded_position == position
        assert reopened.get_local("o2") == {"id": "o1", "items": ["apple", "pear"]}
        assert reopened.get_local("o1") == {"id": "o1", "items": []}


@pytest.mark.parametrize("foreign", [b"NaN", b'{"x": Infinity}', b"[1e999]"])
async def test_a_json_value_that_cannot_be_encoded_again_halts_every_replica_alike(
    service_url: str, admin_url: str, topic: str, tmp_path: Any, foreign: bytes
) -> None:
    # Python's JSON decoder takes NaN and infinite numbers, its encoder (strict JSON) does
    # not: before, a memory replica took such a value from another writer and went on (its
    # snapshots then failed) while a disk replica halted storing it. Now decoding refuses
    # it, so every replica halts at the same record, loudly.
    async with (
        new_map(service_url, topic, admin_url) as memory,
        new_map(service_url, topic, admin_url, store=DiskStore(tmp_path / "s")) as disk,
        new_map(service_url, topic, admin_url, value_codec=BytesCodec()) as raw,
    ):
        await memory.put("good", 1)
        await disk.sync()
        good = memory.position
        await raw.put("bad", foreign)
        for replica in (memory, disk):
            with pytest.raises(ReplicaHaltedError) as error:
                await replica.sync(timeout=WAIT_S)
            assert CodecError in causes(error.value)
            assert replica.position == good
    with pytest.raises(CodecError):
        JsonCodec().decode(foreign)
