"""The built-in codecs, pure: what decodes also encodes again."""

from __future__ import annotations

import pytest

from pulsar_state import CodecError, JsonCodec


@pytest.mark.parametrize(
    "data", [b"NaN", b"-Infinity", b'{"x": Infinity}', b"[1e999]", b"-1e400", b'{"a": [NaN]}']
)
def test_json_decode_refuses_what_json_encode_refuses(data: bytes) -> None:
    with pytest.raises(CodecError, match="not valid JSON"):
        JsonCodec().decode(data)


@pytest.mark.parametrize(
    ("data", "value"),
    [
        (b'{"a":1.5,"b":[1e300,-0.0,2]}', {"a": 1.5, "b": [1e300, -0.0, 2]}),
        (b"\xef\xbb\xbf[1]", [1]),  # a UTF-8 byte order mark, as json.loads takes it
        ('"\u00e9"'.encode("utf-16"), "\u00e9"),
        (b'"\\ud800"', "\ud800"),
    ],
)
def test_json_decode_takes_what_json_loads_takes(data: bytes, value: object) -> None:
    codec = JsonCodec()
    assert codec.decode(data) == value
    assert codec.decode(codec.encode(value)) == value


def test_json_refuses_surrogates_that_would_decode_as_another_string() -> None:
    # A high and a low surrogate in a row, escaped, decode as one character: the value
    # would change (the key of a map would be another key).
    with pytest.raises(CodecError, match="surrogates"):
        JsonCodec().encode({"k": "\ud83d\ude00"})


def test_json_takes_a_lone_surrogate_in_any_json_value() -> None:
    # Tuples and int dict keys come back as lists and str keys: the check compares JSON's
    # own forms, so these encode (before: refused as a surrogate pair).
    codec = JsonCodec()
    assert codec.decode(codec.encode(("\udcff",))) == ["\udcff"]
    assert codec.decode(codec.encode({1: "\udcff"})) == {"1": "\udcff"}
