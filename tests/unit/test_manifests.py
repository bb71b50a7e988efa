"""Snapshot manifests on the wire, pure: what decodes is a manifest the library can use."""

from __future__ import annotations

import dataclasses
import json
import zlib

import pytest

from pulsar_state import CorruptRecordError, SnapshotManifest
from pulsar_state._envelope import MANIFEST_MAGIC, decode_manifest, encode_manifest

GOOD = SnapshotManifest(
    snapshot_id="0123456789abcdef0123456789abcdef",
    position=9,
    record_id="w/9",
    log_ledger=3,
    log_entry=8,
    size=100,
    chunks=1,
    digest="0" * 64,
    first_chunk_ledger=4,
    first_chunk_entry=0,
    created_at=1.5,
    writer_id="w",
    log_origin="w/1",
)


def raw(fields: dict[str, object]) -> bytes:
    body = MANIFEST_MAGIC + json.dumps(fields).encode()
    return body + zlib.crc32(body).to_bytes(4, "big")


def test_a_manifest_round_trips_and_ignores_fields_of_newer_versions() -> None:
    assert decode_manifest(encode_manifest(GOOD), message_id="m") == GOOD
    newer = {**dataclasses.asdict(GOOD), "added_later": [1, 2]}
    assert decode_manifest(raw(newer), message_id="m") == GOOD


def test_a_manifest_names_the_stale_records_it_resumes_after_and_older_ones_none() -> None:
    with_stale = dataclasses.replace(GOOD, log_stale=(("B/2", 9), ("B/3", 10)))
    decoded = decode_manifest(encode_manifest(with_stale), message_id="m")
    assert decoded == with_stale
    hash(decoded)  # listed in sets (identical manifests stored twice are listed once)
    older = {k: v for k, v in dataclasses.asdict(GOOD).items() if k != "log_stale"}
    assert decode_manifest(raw(older), message_id="m").log_stale == ()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("position", "9"),
        ("position", True),
        ("log_ledger", 3.5),
        ("chunks", None),
        ("record_id", 7),
        ("created_at", "now"),
        ("log_origin", 1),
        ("log_stale", "B/2"),
        ("log_stale", ["B/2"]),
        ("log_stale", [["B/2"]]),
        ("log_stale", [["B/2", "9"]]),
        ("log_stale", [["B/2", True]]),
        ("log_stale", [[2, 9]]),
        ("log_stale", None),
        ("snapshot_id", "not hex"),
        # Values no snapshot has (review 45b F6): with no chunk, none was read, neither size
        # nor digest was checked, and the snapshot loaded as no bytes at all.
        ("chunks", 0),
        ("chunks", -3),
        ("size", -1),
        ("position", -1),
        ("snapshot_id", "0123456789abcdef"),
        ("snapshot_id", "01 23456789abcdef0123456789abcdef"),
        ("digest", "0" * 63),
        ("digest", "sha256"),
    ],
)
def test_a_manifest_with_a_field_of_another_type_is_damaged(field: str, value: object) -> None:
    # Before: it decoded, and failed later wherever the field was used (a TypeError in the
    # middle of a load or a trim).
    fields = {**dataclasses.asdict(GOOD), field: value}
    with pytest.raises(CorruptRecordError, match="damaged snapshot manifest"):
        decode_manifest(raw(fields), message_id="m")
