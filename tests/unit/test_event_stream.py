"""EventStream, the queue behind leaders() and events(), and MapWatch's: what counts against
max_queue and the position an overflow names (no broker)."""

from __future__ import annotations

import pytest

from pulsar_state import AppliedRecord, ConfigurationError, OperationTimeoutError
from recipes import MapEvent, MapVersion, WatchOverflowError
from recipes._map_ops import MapState
from recipes._map_watch import MapWatch, _Feed
from recipes._streams import EventStream


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
