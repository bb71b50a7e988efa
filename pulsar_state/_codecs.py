"""Codecs turn ops, keys and values into bytes and back. Never pickle: a topic is shared data.

A codec is any object with ``encode(value) -> bytes`` and ``decode(data) -> value`` that raises
:class:`CodecError` on bad input. Built in: bytes, UTF-8 text, JSON, and Avro records through
fastavro (schema-checked, with schema evolution).
"""

from __future__ import annotations

import io
import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar, cast, runtime_checkable

import fastavro
import fastavro.schema
import fastavro.validation

from ._errors import CodecError, ConfigurationError, SchemaMismatchError

__all__ = ["AvroCodec", "BytesCodec", "Codec", "JsonCodec", "StrCodec", "StreamingCodec"]

T = TypeVar("T")


@runtime_checkable
class Codec(Protocol[T]):
    """Encodes values of one type to bytes and back."""

    def encode(self, value: T, /) -> bytes: ...

    def decode(self, data: bytes, /) -> T: ...


@runtime_checkable
class StreamingCodec(Codec[T], Protocol[T]):
    """A snapshot codec that also writes a state's bytes in parts, never all at once: for
    states larger than memory (a disk-backed PulsarMap's). The manager takes snapshots with
    :meth:`encode_parts` when the codec has it, in a worker thread, part by part.

    ``b"".join(encode_parts(state)) == encode(state)``. The manager cannot check such a codec
    for losslessness (``encode(decode(b)) == b`` needs the whole bytes): it checks itself as
    it goes, raising :class:`CodecError`.
    """

    def encode_parts(self, value: T, /) -> Iterator[bytes]: ...


class BytesCodec:
    """Bytes as they are."""

    def encode(self, value: bytes, /) -> bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise CodecError(f"BytesCodec needs bytes, got {type(value).__name__}")
        return bytes(value)

    def decode(self, data: bytes, /) -> bytes:
        return bytes(data)


class StrCodec:
    """Text as UTF-8."""

    def encode(self, value: str, /) -> bytes:
        if not isinstance(value, str):
            raise CodecError(f"StrCodec needs str, got {type(value).__name__}")
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates
            raise CodecError(f"text is not encodable as UTF-8: {exc}") from exc

    def decode(self, data: bytes, /) -> str:
        try:
            return bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CodecError(f"bytes are not UTF-8 text: {exc}") from exc


# Built once: json.dumps with options builds an encoder per call (6 us against 2.6 us an op).
_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # 1e999
        raise ValueError(f"number {text} is out of range")
    return number


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_JSON_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)


class JsonCodec:
    """JSON values (dict, list, str, int, float, bool, None) as compact UTF-8 JSON.

    Whatever decodes also encodes again (a snapshot, a disk store re-encode values), so every
    replica treats a value from another program alike: NaN and infinite numbers are refused
    both ways, and a lone surrogate (``"\\ud800"``, which JSON may escape) is written as
    that escape.
    """

    def encode(self, value: Any, /) -> bytes:
        try:
            text = _JSON_ENCODER.encode(value)
        except (TypeError, ValueError) as exc:
            raise CodecError(f"value is not JSON-serialisable: {exc}") from exc
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            pass
        # Only a surrogate cannot be UTF-8, and only inside a string: its backslash escape
        # is the JSON escape. A high and a low one in a row would decode as ONE character,
        # so the escaped text is kept only if it decodes to the value itself.
        data = text.encode("utf-8", "backslashreplace")
        if self.decode(data) != json.loads(text):  # JSON's own form (tuples are lists...)
            raise CodecError(
                "value holds a pair of surrogates in a row, which JSON reads as one character"
            )
        return data

    def decode(self, data: bytes, /) -> Any:
        try:
            raw = bytes(data)  # decoded to text as json.loads does it
            return _JSON_DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CodecError(f"bytes are not valid JSON: {exc}") from exc


# Avro single-object encoding: 0xC3 0x01, then the writer schema's CRC-64-AVRO fingerprint.
_AVRO_MARKER = b"\xc3\x01"
_FINGERPRINT = struct.Struct("<Q")


def _fingerprint(parsed: Any) -> int:
    canonical = fastavro.schema.to_parsing_canonical_form(parsed)
    digest = fastavro.schema.fingerprint(canonical, "CRC-64-AVRO")
    return int(digest, 16) if isinstance(digest, str) else int(digest)


def _plain(value: Any) -> Any:
    """``value`` with every dict and list (subclasses included) as a plain dict and list."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


class AvroCodec(Generic[T]):
    """Avro values checked against ``schema``, in Avro's single-object encoding.

    Each encoded value starts with the fingerprint of the schema it was written with, so data
    written with an older (or newer) schema is resolved against the reader's schema by Avro's
    rules: add a field with a default and old data still reads. ``writer_schemas`` lists the
    other schemas that may have written data on the topic. Data whose schema is unknown, or
    cannot be resolved, raises :class:`SchemaMismatchError`.
    """

    def __init__(self, schema: Mapping[str, Any], *, writer_schemas: Iterable[Any] = ()) -> None:
        try:
            self.schema = fastavro.parse_schema(dict(schema))
        except Exception as exc:
            raise ConfigurationError(f"invalid Avro schema: {exc}") from exc
        self.fingerprint = _fingerprint(self.schema)
        self._prefix = _AVRO_MARKER + _FINGERPRINT.pack(self.fingerprint)
        self._writers: dict[int, Any] = {self.fingerprint: self.schema}
        for other in writer_schemas:
            self.add_writer_schema(other)

    def add_writer_schema(self, schema: Any) -> int:
        """Make data written with ``schema`` readable; returns its fingerprint."""
        parsed = fastavro.parse_schema(dict(schema) if isinstance(schema, Mapping) else schema)
        fingerprint = _fingerprint(parsed)
        self._writers[fingerprint] = parsed
        return fingerprint

    def encode(self, value: T, /) -> bytes:
        buffer = io.BytesIO()
        buffer.write(self._prefix)
        try:
            fastavro.validation.validate(value, self.schema, raise_errors=True)
            try:
                fastavro.schemaless_writer(buffer, self.schema, value)
            except TypeError:
                # fastavro's writer takes only exact lists for arrays, where its validation
                # (and Avro) take any list: a PulsarMap's read-only values hold FrozenLists.
                buffer.seek(len(self._prefix))
                buffer.truncate()
                fastavro.schemaless_writer(buffer, self.schema, _plain(value))
        except Exception as exc:
            raise CodecError(f"value does not match the Avro schema: {exc}") from exc
        return buffer.getvalue()

    def decode(self, data: bytes, /) -> T:
        data = bytes(data)
        if len(data) < 10 or data[:2] != _AVRO_MARKER:
            raise CodecError("bytes are not Avro single-object encoded")
        (fingerprint,) = _FINGERPRINT.unpack_from(data, 2)
        writer = self._writers.get(fingerprint)
        if writer is None:
            raise SchemaMismatchError(
                f"data was written with an unknown Avro schema (fingerprint {fingerprint:#018x});"
                " pass that schema in writer_schemas="
            )
        buffer = io.BytesIO(data)
        buffer.seek(10)
        try:
            value = cast(T, fastavro.schemaless_reader(buffer, writer, self.schema))
        except fastavro.read.SchemaResolutionError as exc:
            raise SchemaMismatchError(f"cannot resolve the writer's schema: {exc}") from exc
        except Exception as exc:
            raise CodecError(f"damaged Avro data: {exc}") from exc
        return value
