"""The user's state machine: ``apply``, ``begin_record``, the trial state and the op codec.

Every place that changes a state (the replica's pump, the writer's trial run, rebuilding a
trial state after a failed write) goes through :meth:`StateMachine.apply_write`, so all of them
run ``begin_record`` and the ops in exactly the same way.
"""

from __future__ import annotations

import copy
import datetime
import decimal
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final, Generic, TypeVar, cast

from ._codecs import Codec
from ._envelope import Record
from ._errors import ApplyError, CodecError, CorruptRecordError, callback_error
from ._overlay import DictOverlay
from ._pulsar import LogPosition

__all__ = ["DEFAULT_COPY", "IMMUTABLE_TYPES", "MutatedInPlaceError", "StateMachine", "identical"]

S = TypeVar("S")
Op = TypeVar("Op")


class _DefaultCopy:
    """The default of ``copy_state``: an overlay for a plain dict state, else ``deepcopy``."""

    def __repr__(self) -> str:
        return "DEFAULT_COPY"


DEFAULT_COPY: Final[Any] = _DefaultCopy()

# Values that nothing can change in place: an overlay shares them instead of copying them.
IMMUTABLE_TYPES: Final[frozenset[type]] = frozenset(
    {
        str,
        bytes,
        int,
        float,
        complex,
        bool,
        type(None),
        decimal.Decimal,
        uuid.UUID,
        datetime.date,
        datetime.datetime,
        datetime.time,
        datetime.timedelta,
    }
)


# Values that compare equal without being the same value to an apply: 0.0 and -0.0, Decimal
# 1 and 1.00, one instant in two time zones (as an Avro timestamp decodes, in UTC). Their
# reprs tell them apart.
_EQUAL_IS_NOT_SAME: Final[frozenset[type]] = frozenset(
    {float, complex, decimal.Decimal, datetime.datetime, datetime.time}
)


def identical(a: Any, b: Any) -> bool:
    """Whether ``b`` (an op decoded) is ``a`` (the op encoded) to ``apply``: equal, of the
    same types all the way down (1 and 1.0, True and 1, a tuple and a list differ), dict
    keys in the same order, and numbers and times the same value (not only equal: -0.0,
    Decimal 1.00, a time zone). Anything else compares by ``==`` (an object without
    ``__eq__`` decoded again is not identical; one whose ``==`` raises is not either)."""
    # Loops rather than all(<generator>): this runs on every op the writer adopts.
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is dict:
        if len(a) != len(b):
            return False
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            if type(ka) is not type(kb) or ka != kb or not identical(va, vb):
                return False
        return True
    if kind is list or kind is tuple:
        if len(a) != len(b):
            return False
        for x, y in zip(a, b, strict=True):  # noqa: SIM110 (a loop: see above)
            if not identical(x, y):
                return False
        return True
    try:
        if kind in _EQUAL_IS_NOT_SAME:
            return bool(a == b) and repr(a) == repr(b)
        return bool(a == b)
    except Exception:  # an == that raises (an array's): not provably the same
        return False


def _private_copy(value: Any) -> Any:
    # What the default overlay does to a value read from the live dict: apply may change it
    # in place (append to a list), so the trial works on its own copy of that value only.
    return value if type(value) in IMMUTABLE_TYPES else copy.deepcopy(value)


class MutatedInPlaceError(Exception):
    """``apply`` or ``begin_record`` returned None (mutated its input) although
    ``copy_state=None`` promised neither does: the trial run has just changed the live
    state."""


class StateMachine(Generic[S, Op]):
    """Applies ops to states; encodes and decodes them."""

    def __init__(
        self,
        apply: Callable[[S, Op], S | None],
        codec: Codec[Op],
        *,
        copy_state: Callable[[S], S] | None,
        begin_record: Callable[[S, int], S | None] | None,
        trial_state: Callable[[S], S] | None = None,
        adopt_trial: Callable[[S, S], S] | None = None,
    ) -> None:
        self._apply = apply
        self._codec = codec
        self._copy_state = copy_state
        self._trial_state = trial_state
        self._begin_record = begin_record
        # Without copy_state or trial_state, ``apply`` promises never to mutate its input.
        self._pure = trial_state is None and copy_state is None
        self._adopt_trial = adopt_trial

    @property
    def adopts(self) -> bool:
        """Whether the writer's own one-write records are applied by adopting their trial
        state (``adopt_trial``) rather than decoded and applied again."""
        return self._adopt_trial is not None

    def adopt(self, state: S, trial: S) -> S:
        """The live state after the one-write record whose trial state is ``trial``."""
        assert self._adopt_trial is not None
        return self._adopt_trial(state, trial)

    def trial_copy(self, state: S) -> S:
        """A state the writer may change without touching ``state``, discarded after the
        trial run: ``trial_state(state)`` if given, else ``copy_state(state)``; by default a
        :class:`DictOverlay` over a plain dict state (each value copied when first read) and
        a deep copy of any other state; ``state`` itself when ``copy_state`` is None."""
        if self._trial_state is not None:
            return self._trial_state(state)
        return self._copy(state, trial=True)

    def full_copy(self, state: S) -> S:
        """An independent copy of ``state`` that may outlive the trial (a snapshot encodes it
        in another thread while the live state changes): ``copy_state`` (deepcopy by
        default); ``state`` itself when ``copy_state`` is None (never mutated)."""
        return self._copy(state, trial=False)

    def _copy(self, state: S, *, trial: bool) -> S:
        copy_state = self._copy_state
        if copy_state is None:
            return state
        if copy_state is DEFAULT_COPY:
            if trial and type(state) is dict:
                overlay: Any = DictOverlay(cast(dict[Any, Any], state), copy_value=_private_copy)
                return cast(S, overlay)
            return copy.deepcopy(state)
        return copy_state(state)

    def apply_write(
        self, state: S, ops: Sequence[Op], *, begins: int | None = None, trial: bool = False
    ) -> S:
        """Apply one write's ops; ``begins`` is the version of the record this write opens
        (``begin_record`` runs first). The only apply loop of the library.

        ``trial``: ``state`` is the writer's trial copy, so a failing op raises
        :class:`ApplyError` naming it, and an in-place ``apply`` without ``copy_state`` raises
        :class:`MutatedInPlaceError`.
        """
        if begins is not None and self._begin_record is not None:
            begun = self._begin_record(state, begins)
            if begun is not None:
                state = begun
            elif trial and self._pure:
                raise MutatedInPlaceError(
                    "begin_record returned None (changed the state in place) but "
                    "copy_state=None promises the state is never mutated; return a new state "
                    "from begin_record, or pass copy_state (default copy.deepcopy)"
                )
        for op in ops:
            try:
                new_state = self._apply(state, op)
            except BaseException as exc:
                if not trial or isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise  # (on a replica: it halts, see Replica.on_message)
                raise ApplyError(f"apply raised on op {op!r}: {type(exc).__name__}: {exc}") from exc
            if new_state is not None:
                state = new_state
            elif trial and self._pure:
                raise MutatedInPlaceError(
                    "apply returned None (mutated the state in place) but copy_state=None "
                    "promises apply never mutates its input; pass copy_state (default "
                    "copy.deepcopy)"
                )
        return state

    def apply_record(
        self,
        state: S,
        version: int,
        writes: Sequence[Sequence[Op]],
        after_write: Callable[[int, S], None],
    ) -> S:
        """Apply a whole record as version ``version``; ``after_write(index, state)`` runs
        after each write (for the reader of a write this process made)."""
        state = self.apply_write(state, (), begins=version)
        for index, ops in enumerate(writes):
            state = self.apply_write(state, ops)
            after_write(index, state)
        return state

    def encode(self, ops: Sequence[Op]) -> list[bytes]:
        """Encode one write's ops; any failure is a :class:`CodecError`."""
        try:
            return [self._codec.encode(op) for op in ops]
        except CodecError:
            raise
        except BaseException as exc:
            raise CodecError(f"cannot encode op: {callback_error(exc, 'the codec')}") from exc

    def decode(self, record: Record, at: LogPosition) -> list[list[Op]]:
        """The ops of each write of ``record``, read at ``at``; :class:`CorruptRecordError`
        if the codec refuses one (a foreign or damaged message)."""
        try:
            return [[self._codec.decode(op) for op in w.ops] for w in record.writes]
        except CodecError as exc:
            raise CorruptRecordError(
                f"message {at}: record {record.record_id} holds an op the codec "
                f"cannot decode ({exc})",
                message_id=str(at),
            ) from exc
