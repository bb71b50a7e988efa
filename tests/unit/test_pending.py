"""The writes in flight (PendingWrites), pure: no broker, no writer."""

from __future__ import annotations

import pytest

from pulsar_state import RecordTooLargeError, WriteOutcomeUnknownError
from pulsar_state._admin import TopicName
from pulsar_state._context import Context
from pulsar_state._envelope import Record, Write
from pulsar_state._pending import PendingWrite, PendingWrites
from pulsar_state._records import OutgoingRecord
from pulsar_state._types import ManagerStats
from tests.unit.test_replica_rules import SETTINGS


def launched(pending: PendingWrites, base: int) -> OutgoingRecord[PendingWrite]:
    """One write, taken from the queue and sent in a record based on position ``base``."""
    pending.submit(lambda state: [b"op"], None, timeout=30.0)
    (write,) = pending.take(1)
    record = Record("P", base + 1, base, f"R/{base}", [Write(write.write_seq, [b"op"])])
    outgoing = OutgoingRecord(record, b"", [write])
    pending.launch([outgoing])
    return outgoing


async def test_a_fall_forward_ends_the_writes_of_records_it_may_have_skipped() -> None:
    # The replica loaded a snapshot at position 5 without reading what came before (a
    # trimmed log): our records claiming positions up to 5 may be in it, or were ignored.
    # Before: they stayed in flight, and a retry built on the snapshot's state could apply a
    # write in it twice (from helper 37's review).
    pending = PendingWrites(Context(TopicName.parse("t"), "P", SETTINGS, ManagerStats()))
    skipped = launched(pending, 4)  # claims 5: maybe in the snapshot
    read_next = launched(pending, 5)  # claims 6: read after it, decided as any record
    retried = launched(pending, 2)  # claims 3, and queued again after a failed send
    pending.requeue_unseen([retried])
    pending.skipped_to(5)
    for outgoing in (skipped, retried):
        (write,) = outgoing.writes
        with pytest.raises(WriteOutcomeUnknownError, match="applied once or not at all"):
            await write.future
        assert not pending.in_flight(outgoing.record.record_id)
        assert not write.outstanding
    (write,) = pending.take(1)  # the retry is still queued, and ended: never built again
    assert write is retried.writes[0]
    assert write.future.done()
    assert pending.in_flight(read_next.record.record_id)
    assert not read_next.writes[0].future.done()
    assert pending.settled.is_set()
    assert pending.records_in_flight == 1


async def test_a_refused_retry_of_a_write_whose_earlier_attempt_may_land_is_unknown() -> None:
    # The first attempt was sent (relayed, say) and not seen in time; the retry's record is
    # refused by the client (too large). Before: the write failed with that refusal, "not
    # appended", though the first attempt could still be appended and apply it.
    pending = PendingWrites(Context(TopicName.parse("t"), "P", SETTINGS, ManagerStats()))
    first = launched(pending, 4)
    pending.requeue_unseen([first])
    (write,) = pending.take(1)
    record = Record("P", 9, 4, "R/4", [Write(write.write_seq, [b"op"])])
    retry = OutgoingRecord(record, b"", [write])
    pending.launch([retry])
    pending.refuse([retry], lambda _outgoing: RecordTooLargeError("too large", size=9, limit=1))
    with pytest.raises(WriteOutcomeUnknownError, match="earlier one was sent") as caught:
        await write.future
    assert isinstance(caught.value.__cause__, RecordTooLargeError)


async def test_a_refused_write_with_no_earlier_attempt_gets_the_refusal() -> None:
    pending = PendingWrites(Context(TopicName.parse("t"), "P", SETTINGS, ManagerStats()))
    only = launched(pending, 4)
    pending.refuse([only], lambda _outgoing: RecordTooLargeError("too large", size=9, limit=1))
    with pytest.raises(RecordTooLargeError):
        await only.writes[0].future
