"""When a reader gives freed heap memory back (TrimPolicy, pure: a fake clock and trim)."""

from __future__ import annotations

from pulsar_state._memory import TrimPolicy, release_free_memory

MB = 1024 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.trim_takes = 0.0
        self.trims: list[float] = []

    def __call__(self) -> float:
        return self.now

    def trim(self) -> bool:
        self.trims.append(self.now)
        self.now += self.trim_takes
        return True


def policy(clock: Clock) -> TrimPolicy:
    return TrimPolicy(trim=clock.trim, clock=clock)


def test_small_messages_never_trim() -> None:
    clock = Clock()
    trims = policy(clock)
    for _ in range(100_000):
        trims.read(1000)  # 100 MB of 1 KB messages: glibc reuses such buffers itself
    assert clock.trims == []


def test_every_4_mb_of_big_messages_trims_at_most_every_quarter_second() -> None:
    clock = Clock()
    trims = policy(clock)
    for _ in range(3):
        trims.read(MB)
    assert clock.trims == []
    trims.read(MB)
    assert clock.trims == [100.0]
    for _ in range(8):  # 8 MB more at once: too soon after the last trim
        trims.read(MB)
    assert len(clock.trims) == 1
    clock.now += 0.25
    trims.read(MB)
    assert clock.trims == [100.0, 100.25]


def test_a_slow_trim_spaces_the_next_by_twenty_times_its_duration() -> None:
    clock = Clock()
    clock.trim_takes = 0.1  # a fragmented heap of a gigabyte
    trims = policy(clock)
    for _ in range(4):
        trims.read(MB)
    clock.now += 1.0
    for _ in range(4):
        trims.read(MB)
    assert len(clock.trims) == 1  # 1.1 s after the first, 2 s are due
    clock.now += 1.0
    trims.read(MB)
    assert len(clock.trims) == 2


def test_the_trim_is_there_on_glibc() -> None:
    assert release_free_memory()
