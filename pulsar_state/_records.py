"""From a batch of waiting writes to the records that carry them (group commit).

Pure: no I/O and no asyncio. The generators run on a trial copy of the state, their ops are
encoded and validated by applying them to that copy, and the writes are packed into records
that fit the size limits. What goes wrong with one write is reported for that write alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from ._envelope import Record, Write, encode_record, record_overhead, write_size
from ._errors import (
    ApplyError,
    CodecError,
    ConfigurationError,
    RecordTooLargeError,
    callback_error,
)
from ._machine import MutatedInPlaceError, StateMachine

__all__ = ["Adoption", "Batch", "OutgoingRecord", "RecordBuilder", "RecordLimits", "WriteRequest"]

S = TypeVar("S")
Op = TypeVar("Op")


class WriteRequest(Protocol):
    """What the builder needs of a write: its generator and its number."""

    @property
    def generator(self) -> Callable[[Any], Sequence[Any]]: ...

    @property
    def write_seq(self) -> int: ...


class RecordLimits(Protocol):
    """Read at each build, so a change to the manager's settings applies to the next batch."""

    @property
    def max_record_bytes(self) -> int: ...

    @property
    def max_writes_per_record(self) -> int: ...


W = TypeVar("W", bound=WriteRequest)


@dataclass(slots=True)
class Adoption:
    """What the writer needs to apply its own one-write record by adopting the trial state
    it was built on (``StateMachine.adopt``): only while the live state is still ``base``
    (the same object, at the record's base: the replica checks the position), and once the
    record's ops, decoded while its acknowledgement is awaited, proved identical to the ops
    the trial ran (``decoded``; None: not decoded, or not identical)."""

    base: Any
    trial: Any
    ops: list[Any]
    decoded: list[Any] | None = None


@dataclass(slots=True)
class OutgoingRecord(Generic[W]):
    record: Record
    payload: bytes
    writes: list[W]
    adoption: Adoption | None = None


@dataclass(slots=True)
class Batch(Generic[W]):
    """The outcome of one build."""

    records: list[OutgoingRecord[W]] = field(default_factory=list)
    # Writes that will not be sent, each with the error its caller gets.
    refused: list[tuple[W, BaseException]] = field(default_factory=list)
    # Writes that failed on a state holding earlier writes of this batch (their generator
    # raised, an op failed, too large): not sent, and decided again once those writes have
    # their outcome, since a refusal must rest on a state the log holds.
    deferred: list[W] = field(default_factory=list)
    # Set when the trial run changed the live state: nothing is sent, the replica must halt.
    halt: tuple[W, ConfigurationError] | None = None
    # Writes with no ops decided on the base state itself (before any write of the batch):
    # nothing to append; they stand if that state is still the log's latest.
    unchanged: list[W] = field(default_factory=list)


class RecordBuilder(Generic[S, Op]):
    """Builds the records of one writer (it numbers them: ``record_seq``)."""

    def __init__(self, machine: StateMachine[S, Op], writer_id: str, limits: RecordLimits) -> None:
        self._machine = machine
        self._writer_id = writer_id
        self._limits = limits
        self._next_seq = 1  # the sequence number of this writer's next record

    def build(self, batch: Sequence[W], state: S, version: int, last_record_id: str) -> Batch[W]:
        """Run ``batch``'s generators on a copy of ``state`` (at ``version``, last record
        ``last_record_id``) and pack the writes that succeed into records based there.

        Writes are packed as they are generated, so the trial state knows the version each
        write's record will have (``begin_record``) exactly as the replicas will.
        """
        machine = self._machine
        max_bytes = self._limits.max_record_bytes
        max_writes = self._limits.max_writes_per_record
        writer_id = self._writer_id
        # A write must fit a record of its own on this base or, once a record of this batch
        # is full, on that record (whose id is this writer's, with a sequence number).
        largest_overhead = max(
            record_overhead(writer_id, last_record_id),
            record_overhead(writer_id, f"{writer_id}/{self._next_seq + len(batch)}"),
        )
        result: Batch[W] = Batch()

        def refuse(index: int, error: BaseException) -> bool:
            """Refuse ``batch[index]``, or (decided on this batch's earlier writes, which may
            not land) defer it and every write after it, in order: True then, the batch ends
            here."""
            if applied:
                result.deferred.extend(batch[index:])
                return True
            result.refused.append((batch[index], error))
            return False

        trial = machine.trial_copy(state)
        # What was applied to the trial state, to rebuild it when a write fails half-way.
        applied: list[tuple[int, list[Any]]] = []
        base_version, base_id = version, last_record_id
        group: list[tuple[W, list[bytes]]] = []
        group_size = record_overhead(writer_id, base_id)

        def make_room(size: int) -> None:
            # A write of ``size`` bytes joins the group: first send the group if it is full.
            if group and (len(group) >= max_writes or group_size + size > max_bytes):
                flush()

        def flush() -> None:
            nonlocal base_version, base_id, group, group_size
            if not group:
                return
            record_seq, self._next_seq = self._next_seq, self._next_seq + 1
            record = Record(
                writer_id=self._writer_id,
                record_seq=record_seq,
                base_position=base_version,
                base_record_id=base_id,
                writes=[Write(w.write_seq, encoded) for w, encoded in group],
            )
            result.records.append(
                OutgoingRecord(record, encode_record(record), [w for w, _ in group])
            )
            base_version, base_id = base_version + 1, record.record_id
            group, group_size = [], record_overhead(writer_id, base_id)

        for index, request in enumerate(batch):
            try:
                ops = list(request.generator(trial))
            except BaseException as exc:  # the caller's generator: its exception, unchanged
                if refuse(index, callback_error(exc, "the write's generator")):
                    break
                continue
            if not ops and not (group or applied):
                # A conditional write that changes nothing appends nothing: decided on the
                # base state itself, it is confirmed there.
                result.unchanged.append(request)
                continue
            # After writes of this batch, one that changes nothing rides in their record, or
            # the next (its outcome depends on theirs): as any write, it may open that record.
            try:
                encoded = machine.encode(ops)
            except CodecError as exc:
                if refuse(index, exc):
                    break
                continue
            size = write_size(encoded)
            if size + largest_overhead > max_bytes:
                error = RecordTooLargeError(
                    f"a write of {size} bytes does not fit a record of "
                    f"max_record_bytes={max_bytes} (with the record's own "
                    f"{largest_overhead} bytes)",
                    size=size,
                    limit=max_bytes,
                )
                if refuse(index, error):
                    break
                continue
            make_room(size)
            record_version = base_version + 1  # the version of the record this write joins
            try:
                trial = machine.apply_write(
                    trial, ops, begins=None if group else record_version, trial=True
                )
            except MutatedInPlaceError as exc:
                # The live state now holds an unacknowledged write: send nothing.
                return Batch(
                    refused=result.refused,
                    deferred=result.deferred,
                    halt=(request, ConfigurationError(str(exc))),
                )
            except BaseException as exc:
                failure: BaseException = callback_error(exc, "begin_record")
                if not isinstance(exc, ApplyError):  # begin_record raised
                    failure = ApplyError(f"begin_record raised: {type(exc).__name__}: {exc}")
                    failure.__cause__ = exc
                if refuse(index, failure):
                    break
                # The trial state may hold part of this write: rebuild it from the real one.
                trial = machine.trial_copy(state)
                begun = -1
                for step_version, good_ops in applied:
                    fresh = step_version != begun
                    trial = machine.apply_write(
                        trial, good_ops, begins=step_version if fresh else None
                    )
                    begun = step_version
                continue
            applied.append((record_version, ops))
            group.append((request, encoded))
            group_size += size
        flush()
        if machine.adopts and len(batch) == 1 and len(applied) == 1 and len(result.records) == 1:
            # One write alone in its record, and the trial holds exactly its ops (a write
            # that failed half-way would have rebuilt it and is refused).
            result.records[0].adoption = Adoption(state, trial, applied[0][1])
        return result
