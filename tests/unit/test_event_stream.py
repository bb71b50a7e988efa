"""EventStream, the queue behind leaders() and events(), and MapWatch's: what counts against
max_queue and the position an overflow names (no broker)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from pulsar_state import AppliedRecord, ConfigurationError, OperationTimeoutError
from recipes import MapEvent, MapVersion, WatchOverflowError
from recipes._lease_table import LeaseTable
from recipes._map_ops import MapOp, MapState
from recipes._map_watch import MapWatch, WatchHub, _Feed
from recipes._streams import EventStream
from recipes.election import LeaderElection
from recipes.membership import Membership


async def test_the_snapshot_does_not_count_against_max_queue() -> None:
    stream = EventStream(["a", "b", "c"], max_queue=2, position=7)
    # Before: three snapshot items and one change were four against two: the stream failed
    # before the consumer read anything.
    stream.push(["d"], 8)
    assert [await stream.next(timeout=1) for _ in range(4)] == ["a", "b", "c", "d"]


async def test_a_consumer_with_none_waiting_takes_a_whole_record() -> None:
    stream: EventStream[str] = EventStream([], max_queue=2, position=0)
    stream.push(["a", "b", "c", "d"], 1)  # before: four against two, the stream failed
    assert [await stream.next(timeout=1) for _ in range(4)] == ["a", "b", "c", "d"]


async def test_a_consumer_behind_overflows_at_the_last_position_it_received() -> None:
    stream: EventStream[str] = EventStream(["s"], max_queue=2, position=5)
    stream.push(["a"], 6)
    stream.push(["b"], 7)
    assert await stream.next(timeout=1) == "s"
    assert await stream.next(timeout=1) == "a"
    stream.push(["c"], 8)
    stream.push(["d"], 9)  # b, c waiting: one more is three against two
    with pytest.raises(WatchOverflowError) as caught:
        await stream.next(timeout=1)
    assert caught.value.position == 6  # before: -1
    assert caught.value.max_queue == 2
    with pytest.raises(WatchOverflowError):  # it stays failed
        await stream.next(timeout=0.01)


async def test_an_overflow_before_any_change_was_received_names_the_snapshot() -> None:
    stream: EventStream[str] = EventStream(["s1", "s2"], max_queue=1, position=3)
    stream.push(["a"], 4)
    stream.push(["b"], 5)
    # The snapshot is the state the consumer starts from: still delivered, then the error.
    assert [await stream.next(timeout=1) for _ in range(2)] == ["s1", "s2"]
    with pytest.raises(WatchOverflowError) as caught:
        await stream.next(timeout=1)
    assert caught.value.position == 3


async def test_next_times_out_and_close_ends_iteration() -> None:
    stream: EventStream[str] = EventStream([], max_queue=1, position=0)
    with pytest.raises(OperationTimeoutError):
        await stream.next(timeout=0.01)
    stream.push(["a"], 1)
    stream.close()
    assert [item async for item in stream] == []


@pytest.mark.parametrize("bad", [0, -1, True, "10", None, 1.5])
def test_max_queue_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="max_queue"):
        EventStream([], max_queue=bad, position=0)  # type: ignore[arg-type]


async def test_an_overflow_in_the_middle_of_a_record_names_the_position_before_it() -> None:
    stream: EventStream[str] = EventStream([], max_queue=3, position=0)
    stream.push(["a1", "a2", "a3"], 4)  # one record, three items (a membership change)
    assert await stream.next(timeout=1) == "a1"
    stream.push(["b1", "b2"], 5)  # a2, a3 waiting: two more is four against three
    with pytest.raises(WatchOverflowError) as caught:
        await stream.next(timeout=1)
    # a2 and a3 were dropped: a consumer resuming after position 4 would never see them.
    # Before: 4.
    assert caught.value.position == 3


async def test_a_record_taken_whole_counts_as_received() -> None:
    stream: EventStream[str] = EventStream([], max_queue=2, position=0)
    stream.push(["a1", "a2"], 4)
    assert [await stream.next(timeout=1) for _ in range(2)] == ["a1", "a2"]
    stream.push(["b"], 5)
    stream.push(["c", "d"], 6)
    with pytest.raises(WatchOverflowError) as caught:
        await stream.next(timeout=1)
    assert caught.value.position == 4


async def test_a_map_watch_overflow_in_the_middle_of_a_record_names_the_position_before_it() -> (
    None
):
    state = MapState[str, int]()
    feed = _Feed(state, lambda _event: True, [], 0, max_queue=3)
    watch = MapWatch(feed, 0)

    def record(position: int, keys: str) -> None:
        state.events = [
            MapEvent("put", key, index, MapVersion.of(position, index), position)
            for index, key in enumerate(keys)
        ]
        feed.on_record(AppliedRecord(position, f"r{position}", None, []))  # type: ignore[arg-type]

    record(4, "xyz")  # one record (a transact), three changes
    first = await watch.next(timeout=1)
    assert first is not None
    assert first.key == "x"
    record(5, "uv")  # y, z waiting: two more is four against three
    with pytest.raises(WatchOverflowError) as caught:
        await watch.next(timeout=1)
    assert caught.value.position == 3  # before: 4, though y and z were dropped
    watch.close()


class _Source:
    """What leaders() and events() subscribe to (an Ownership's subscribe and on_close)."""

    def __init__(self) -> None:
        self.listeners: list[Any] = []
        self.closers: list[Any] = []
        self.table = LeaseTable()

    def read_local(self, read: Any) -> Any:
        return read(self.table)

    def subscribe(self, listener: Any) -> Any:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def on_close(self, closer: Any) -> Any:
        self.closers.append(closer)
        return lambda: self.closers.remove(closer)


async def test_a_stream_dropped_without_close_leaves_nothing_subscribed() -> None:
    # `async for leader in election.leaders(): ... break`, or a cancelled consumer: before,
    # each stream stayed subscribed (queueing, its listener run on every record) as long as
    # the recipe was open (review 45g: 1,000 dropped streams, 1,000 listeners).
    source = _Source()
    election = object.__new__(LeaderElection)
    election._ownership = source  # type: ignore[assignment]
    membership = object.__new__(Membership)
    membership._ownership = source  # type: ignore[assignment]
    alive = [weakref.ref(election.leaders()) for _ in range(100)]
    alive += [weakref.ref(membership.events()) for _ in range(100)]
    gc.collect()
    assert [ref for ref in alive if ref() is not None] == []
    assert source.listeners == []
    assert source.closers == []
    kept = election.leaders()  # one still held is fed
    assert len(source.listeners) == 1
    kept.close()
    assert source.listeners == []


class _Applying:
    """What a WatchHub needs of a manager: its position, listeners, and records applied."""

    topic = "t"

    def __init__(self, state: MapState[str, Any]) -> None:
        self.state, self.position = state, 0
        self.listeners: list[Any] = []

    def add_listener(self, listener: Any) -> Any:
        self.listeners.append(listener)
        return lambda: listener in self.listeners and self.listeners.remove(listener)

    def apply(self, key: str) -> None:
        self.position += 1
        self.state.begin(self.position)
        ops = [MapOp("PUT", key, 1, key.encode())]
        for op in ops:
            self.state.apply(op)
        for listener in list(self.listeners):
            listener(AppliedRecord(self.position, "r", None, [ops]))


async def test_a_resumed_watch_overflowing_at_once_names_at_least_its_resume_position() -> None:
    # changes(from_position=5) opened before open(), overflowing during the replay before
    # anything was delivered: the error named 0, the open's position, and a consumer
    # resuming there got every change up to 5 again (review 45g).
    state: MapState[str, Any] = MapState()
    manager = _Applying(state)
    hub: WatchHub[str, Any] = WatchHub(state, manager)  # type: ignore[arg-type]
    watch = hub.open(lambda e: e.position > 5, snapshot=False, max_queue=3, after=5)
    for index in range(10):
        manager.apply(f"k{index}")
    with pytest.raises(WatchOverflowError) as overflow:
        await watch.next(timeout=1)
    assert overflow.value.position == 5
