"""Loading a snapshot into a durable state while its chunks are read (pure logic: the chunk
source is a stand-in for the snapshot reader, the durable state a recording one)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pulsar_state import CorruptRecordError, JsonCodec, LogMark, LogPosition, WriterBusyError
from pulsar_state import _snapshots as snapshots
from pulsar_state._snapshots import SnapshotPolicy

MARK = LogMark(5, "r5", LogPosition(1, 1), "r1")


class Chunks:
    """What SnapshotStore.load_chunks yields: ``parts``, then ``error`` if any (as a digest
    mismatch found at the end), pausing ``pause`` seconds before each."""

    def __init__(self, parts: list[bytes], error: Exception | None = None, pause: float = 0):
        self.parts, self.error, self.pause = parts, error, pause
        self.closed = False

    async def load_chunks(
        self, _manifest: Any, *, progress: Any = None
    ) -> AsyncGenerator[bytes, None]:
        try:
            for part in self.parts:
                await asyncio.sleep(self.pause)
                yield part
            if self.error is not None:
                raise self.error
        finally:
            self.closed = True


class Recording:
    """A durable state that keeps what it read, in a transaction it commits at the end."""

    def __init__(self, read_all: bool = True) -> None:
        self.read_all = read_all
        self.committed: bytes | None = None
        self.thread = ""
        self.ended = threading.Event()

    def load_snapshot(self, state: Any, chunks: Iterable[bytes], mark: LogMark) -> Any:
        self.thread = threading.current_thread().name
        try:
            taken = []
            for chunk in chunks:
                taken.append(chunk)
                if not self.read_all:
                    break
            self.committed = b"".join(taken)
            return "loaded"
        finally:
            self.ended.set()


class Manifest:
    snapshot_id = "ab" * 16


def policy(chunks: Chunks) -> Any:
    made: Any = object.__new__(SnapshotPolicy)
    made._store = chunks
    made._replica = type("R", (), {"state": "old"})()
    made._takes = set()
    return made


async def test_chunks_are_stored_as_they_arrive_in_a_thread_of_their_own() -> None:
    durable = Recording()
    state = await policy(Chunks([b"ab", b"cd", b"e"]))._store_streamed(durable, Manifest(), MARK)
    assert state == "loaded"
    assert durable.committed == b"abcde"
    assert durable.thread.startswith("pulsar-state-store-snapshot-")


async def test_a_snapshot_found_damaged_at_its_end_stores_nothing() -> None:
    durable, chunks = (
        Recording(),
        Chunks([b"ab", b"cd"], CorruptRecordError("digest", message_id="1:1")),
    )
    with pytest.raises(CorruptRecordError, match="digest"):
        await policy(chunks)._store_streamed(durable, Manifest(), MARK)
    assert durable.ended.is_set()  # the thread has ended when the error is raised
    assert durable.committed is None
    assert chunks.closed


async def test_a_durable_state_that_stops_reading_early_fails_loudly() -> None:
    durable = Recording(read_all=False)
    with pytest.raises(RuntimeError, match="must iterate the chunks to their end"):
        await policy(Chunks([b"ab", b"cd"]))._store_streamed(durable, Manifest(), MARK)


async def test_a_cancelled_load_ends_its_thread_before_it_returns() -> None:
    durable, chunks = Recording(), Chunks([b"a"] * 100, pause=0.05)
    task = asyncio.create_task(policy(chunks)._store_streamed(durable, Manifest(), MARK))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert durable.ended.is_set()
    assert durable.committed is None
    assert chunks.closed


async def test_a_load_cancelled_while_the_state_commits_waits_for_the_commit() -> None:
    class SlowCommit(Recording):
        def load_snapshot(self, state: Any, chunks: Iterable[bytes], mark: LogMark) -> Any:
            taken = b"".join(chunks)
            threading.Event().wait(0.5)  # committing, after the last chunk
            self.committed = taken
            self.ended.set()
            return "loaded"

    durable = SlowCommit()
    task = asyncio.create_task(policy(Chunks([b"ab"]))._store_streamed(durable, Manifest(), MARK))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert durable.ended.is_set()  # not left committing behind the caller's back
    assert durable.committed == b"ab"


async def test_no_snapshot_is_taken_while_one_is_being_stored() -> None:
    # The store's content changes before the replica's version does: a snapshot taken then
    # would label the new content with the old version.
    loading: Any = policy(Chunks([]))
    loading._storing, loading._topic = True, "persistent://public/default/t"
    with pytest.raises(WriterBusyError, match="being loaded into this replica"):
        await loading.take(1.0)


async def test_chunks_are_read_ahead_of_a_slow_state_only_so_far(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(snapshots, "_STORE_AHEAD_BYTES", 10)
    source = Chunks([b"abcd"] * 30)
    yielded = 0
    real = source.load_chunks

    async def counting(manifest: Any, *, progress: Any = None) -> AsyncGenerator[bytes, None]:
        nonlocal yielded
        async for part in real(manifest, progress=progress):
            yielded += 1
            yield part

    source.load_chunks = counting  # type: ignore[method-assign]
    ahead: list[int] = []

    class Slow(Recording):
        def load_snapshot(self, state: Any, chunks: Iterable[bytes], mark: LogMark) -> Any:
            for taken, _chunk in enumerate(chunks, 1):
                threading.Event().wait(0.01)
                ahead.append(yielded - taken)
            return "loaded"

    assert await policy(source)._store_streamed(Slow(), Manifest(), MARK) == "loaded"
    assert len(ahead) == 30
    # 10 bytes ahead is 3 chunks of 4, one more may be on its way from the source.
    assert max(ahead) <= 4


# ---------------------------------------------------------------------- taking, streamed


@pytest.mark.parametrize(
    "parts",
    [
        [],
        [b""],
        [b"abc"],
        [b"a" * 10],
        [b"a" * 25],
        [b"ab", b"cdefghij", b"k", b"", b"lmnopqrstuvwxyz" * 3],
        [bytes(range(7))] * 9,
    ],
)
def test_chunked_cuts_the_joined_parts_into_chunks_and_digests_them(parts: list[bytes]) -> None:
    chunked = snapshots.Chunked(iter(parts), 10)
    chunks = list(chunked)
    joined = b"".join(parts)
    assert b"".join(chunks) == joined
    assert chunks == ([joined[i : i + 10] for i in range(0, len(joined), 10)] or [b""])
    assert chunked.count == len(chunks)
    assert chunked.total == len(joined)
    assert chunked.digest.hexdigest() == snapshots.digest_of(joined)


async def test_parts_stepped_in_a_worker_are_closed_after_the_step_under_way() -> None:
    """A consumer that stops (cancelled while a part is being made) closes the parts only
    once that step is over: the parts may read a store whose transaction the close ends."""
    events: list[str] = []
    making = threading.Event()
    release = threading.Event()

    def parts() -> Any:
        try:
            yield b"first"
            making.set()
            release.wait(5)
            events.append("second made")
            yield b"second"
        finally:
            events.append("closed")

    async def consume() -> list[bytes]:
        got = []
        async with contextlib.aclosing(snapshots.step_in_worker(parts())) as stepped:
            async for part in stepped:
                got.append(part)
        return got

    task = asyncio.create_task(consume())
    await asyncio.to_thread(making.wait, 5)
    task.cancel()
    await asyncio.sleep(0.1)
    assert not task.done()  # waiting out the step under way
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert events == ["second made", "closed"]


async def test_a_snapshot_timing_out_before_its_encode_started_blocks_no_later_one() -> None:
    # The encode waited in the default executor's queue (its one worker busy) when the
    # snapshot timed out: the executor dropped it, and the flag set before it was submitted
    # stayed set, refusing every later snapshot (WriterBusyError) until the manager closed
    # (the review of the fix for the piling-up encodes).
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    release = threading.Event()
    busy = loop.run_in_executor(None, release.wait)
    policy = SnapshotPolicy.__new__(SnapshotPolicy)
    policy._encoding, policy._codec = False, JsonCodec()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await policy._encode({"a": 1})
    release.set()
    await busy
    assert not policy._encoding
    assert await policy._encode({"a": 1}) == JsonCodec().encode({"a": 1})
