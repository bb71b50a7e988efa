"""The method names a compiled Java class declares, read from its class file.

Enough of the class-file format (JVM spec, chapter 4) to list declared methods, so a test can
check which BookKeeper build the broker runs without a JDK's ``javap``.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

_MAGIC = b"\xca\xfe\xba\xbe"
# Constant-pool entry sizes after the tag byte, by tag (UTF-8 entries are sized by their length).
_CONSTANT_SIZES = {3: 4, 4: 4, 5: 8, 6: 8, 7: 2, 8: 2, 9: 4, 10: 4, 11: 4, 12: 4}
_CONSTANT_SIZES |= {15: 3, 16: 2, 17: 4, 18: 4, 19: 2, 20: 2}
_UTF8, _LONG, _DOUBLE = 1, 5, 6


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, size: int) -> bytes:
        if self.pos + size > len(self.data):
            raise ValueError("truncated class file")
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "big")


def declared_methods(class_file: bytes) -> set[str]:
    """The names of the methods (constructors included) a class file declares."""
    reader = _Reader(class_file)
    if reader.take(4) != _MAGIC:
        raise ValueError("not a Java class file")
    reader.take(4)  # minor and major version
    strings: dict[int, str] = {}
    count = reader.u16()
    index = 1
    while index < count:
        tag = reader.take(1)[0]
        if tag == _UTF8:
            strings[index] = reader.take(reader.u16()).decode("utf-8", errors="replace")
        elif tag in _CONSTANT_SIZES:
            reader.take(_CONSTANT_SIZES[tag])
        else:
            raise ValueError(f"unknown constant-pool tag {tag}")
        index += 2 if tag in (_LONG, _DOUBLE) else 1  # these take two pool slots
    reader.take(6)  # access flags, this class, super class
    reader.take(2 * reader.u16())  # interfaces

    def members() -> list[str]:
        names = []
        for _ in range(reader.u16()):
            reader.take(2)  # access flags
            names.append(strings[reader.u16()])
            reader.take(2)  # descriptor
            for _ in range(reader.u16()):
                reader.take(2)
                reader.take(reader.u32())
        return names

    members()  # fields
    return set(members())


def declared_methods_in_jar(jar: Path, class_name: str) -> set[str]:
    """``declared_methods`` of ``class_name`` (dotted) inside ``jar``."""
    with zipfile.ZipFile(jar) as archive:
        return declared_methods(archive.read(class_name.replace(".", "/") + ".class"))
