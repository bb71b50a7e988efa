"""Linearizability checking for histories recorded by concurrent processes (test support).

The checker is a Wing-Gong-Lowe (WGL) search with memoization, in the spirit of Porcupine
and Knossos:

* Events (invocations and completions) are kept in a doubly linked list sorted by time. The
  search repeatedly picks a pending operation whose invocation precedes the first
  outstanding completion, applies it to a sequential :class:`Model`, and "lifts" it out of
  the list. Reaching the completion of an operation that has not been linearized yet is a
  dead end and the search backtracks.
* A cache of ``(set of linearized operations, model state)`` pairs prunes configurations that
  were already explored, so the search is polynomial for the low concurrency typical of tests.
  Two sound refinements keep it fast: a legal read-only candidate is linearized without
  branching, and a configuration is skipped if an explored one differs only by having fewer
  indeterminate operations applied.
* The search is iterative (explicit stack), so long histories never hit the recursion limit.
* Operations on different keys are checked independently (P-compositionality), which is sound
  when the model treats every key as an independent object, as :class:`RegisterModel` and
  :class:`CounterModel` do.

Guarantees of :func:`check`:

* ``ok=True`` only if a linearization was found, i.e. the history is linearizable with
  respect to the model (under the recorded times).
* ``ok=False, timed_out=False`` only if the search was exhaustive: no linearization exists.
* ``ok=False, timed_out=True`` means "unknown": the time budget ran out first.

Operations whose completion is unknown (``ret is None``: the process crashed or the call timed
out) may have taken effect at any instant after their invocation, or never; the checker tries
both. Their ``result`` is unknown and models must not check it.

:class:`HistoryRecorder` and :func:`load_history` record such histories from several OS
processes through per-process JSON-lines files.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Generator, Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

__all__ = [
    "CheckResult",
    "CounterModel",
    "HistoryRecorder",
    "Model",
    "Operation",
    "RegisterModel",
    "check",
    "load_history",
]

StateT = TypeVar("StateT", bound=Hashable)

# Search steps per time slice (between looks at the clock, which is cheap but not free).
_SLICE_STEPS: Final = 1024
# How many operations of the prefix / candidates an explanation shows.
_EXPLAIN_TAIL: Final = 12


@dataclass(frozen=True, slots=True)
class Operation:
    """One completed, or possibly completed, operation of a history.

    ``call`` and ``ret`` are invocation and completion times on a clock shared by every
    recording process (any unit, ints or floats). ``ret is None`` means the outcome is
    unknown (crash or timeout): the operation may have taken effect at any instant after
    ``call``, or never, and ``result`` is meaningless. ``op_id`` is the recorder's id of the
    operation (empty when not recorded), to match it with what the system under test stored.
    """

    process: str
    op: str
    key: str
    arg: Any
    result: Any
    call: float
    ret: float | None
    op_id: str = ""

    def __post_init__(self) -> None:
        if self.ret is not None and self.ret < self.call:
            raise ValueError(f"operation returns before it is invoked: {self!r}")

    @property
    def indeterminate(self) -> bool:
        """True if it is unknown whether (and with what result) the operation took effect."""
        return self.ret is None

    def describe(self) -> str:
        """A one-line human-readable rendering, used in failure explanations."""
        arg = "" if self.arg is None else repr(self.arg)
        result = "?" if self.ret is None else repr(self.result)
        ret = "never" if self.ret is None else _fmt_time(self.ret)
        return (
            f"[{self.process}] {self.op}({self.key!r}{', ' if arg else ''}{arg}) -> {result}"
            f"  (called {_fmt_time(self.call)}, returned {ret})"
        )


def _fmt_time(t: float) -> str:
    return str(t) if isinstance(t, int) else f"{t:.6f}"


class Model(Protocol[StateT]):
    """A sequential specification: the behaviour of the object when used by one caller.

    States must be hashable (they are memoized) and treated as immutable.
    """

    def init(self) -> StateT:
        """The state before any operation."""
        ...

    def step(self, state: StateT, op: Operation) -> tuple[bool, StateT]:
        """Apply ``op`` to ``state``.

        Returns ``(ok, new_state)``, where ``ok`` tells whether ``op`` (with its recorded
        result) is a legal behaviour in ``state``. If ``op.indeterminate``, its result is
        unknown and must not be checked; ``ok`` then only says whether the operation could
        have taken effect at all. Unknown operation names should raise ``ValueError``.
        """
        ...


# A model may also define ``is_read_only(op) -> bool``: True promises that whenever ``op`` is
# legal in a state it leaves that state unchanged. The checker then drops such operations
# when indeterminate and linearizes them without branching, which prunes the search a lot.


@runtime_checkable
class _SupportsReadOnly(Protocol):
    def is_read_only(self, op: Operation) -> bool: ...


class RegisterModel:
    """A single read/write/compare-and-set register per key.

    * ``read``: ``result`` is the current value.
    * ``write``: sets the value to ``arg``; ``result`` is ignored.
    * ``cas``: ``arg = (expected, new)``; if the value equals ``expected`` it becomes ``new``
      and ``result`` must be True, otherwise the value is unchanged and ``result`` must be
      False. Lists are accepted for ``arg`` (JSON round trips turn tuples into lists).
    """

    def __init__(self, initial: Hashable = None) -> None:
        self.initial = initial

    def init(self) -> Hashable:
        return self.initial

    def step(self, state: Hashable, op: Operation) -> tuple[bool, Hashable]:
        if op.op == "read":
            return (op.indeterminate or op.result == state), state
        if op.op == "write":
            return True, op.arg
        if op.op == "cas":
            expected, new = op.arg
            swapped = state == expected
            if not op.indeterminate and bool(op.result) != swapped:
                return False, state
            return True, (new if swapped else state)
        raise ValueError(f"RegisterModel does not support operation {op.op!r}")

    def is_read_only(self, op: Operation) -> bool:
        """Reads, and compare-and-sets known to have failed, never change the state."""
        return op.op == "read" or (op.op == "cas" and op.ret is not None and op.result is False)


class CounterModel:
    """An integer counter per key.

    * ``incr``: adds ``arg`` (default 1); ``result`` must be the new value.
    * ``read``: ``result`` is the current value.
    """

    def __init__(self, initial: int = 0) -> None:
        self.initial = initial

    def init(self) -> int:
        return self.initial

    def step(self, state: int, op: Operation) -> tuple[bool, int]:
        if op.op == "read":
            return (op.indeterminate or op.result == state), state
        if op.op == "incr":
            new = state + (1 if op.arg is None else int(op.arg))
            return (op.indeterminate or op.result == new), new
        raise ValueError(f"CounterModel does not support operation {op.op!r}")

    def is_read_only(self, op: Operation) -> bool:
        """Reads never change the state."""
        return op.op == "read"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """Outcome of :func:`check`.

    ``ok`` is True only if the history was proven linearizable. ``key`` names the key whose
    sub-history failed or timed out (None otherwise, or when not partitioned by key).
    ``explanation`` is human-readable; for a failure it shows the longest linearizable prefix
    found and the first operation that could not be linearized after it.
    """

    ok: bool
    key: str | None
    explanation: str
    timed_out: bool = False

    def __bool__(self) -> bool:
        return self.ok


def check(
    history: Iterable[Operation],
    model: Model[Any],
    *,
    timeout_s: float = 30.0,
    by_key: bool = True,
) -> CheckResult:
    """Check whether ``history`` is linearizable with respect to ``model``.

    With ``by_key`` (the default) each key's operations are checked on their own, which is
    only sound if ``model`` describes one independent object per key; pass ``by_key=False``
    for a model whose state spans keys. ``timeout_s`` bounds the total search time; when it
    runs out the result has ``ok=False, timed_out=True`` (unknown, not a proven violation).
    Raises ``ValueError`` if the model does not understand an operation.
    """
    deadline = time.monotonic() + timeout_s
    read_only = model.is_read_only if isinstance(model, _SupportsReadOnly) else None
    partitions: dict[str | None, list[Operation]] = {}
    total = 0
    for op in history:
        # An indeterminate read-only operation can neither change the state nor be observed.
        if op.ret is None and read_only is not None and read_only(op):
            continue
        partitions.setdefault(op.key if by_key else None, []).append(op)
        total += 1

    for key in sorted(partitions, key=lambda k: "" if k is None else k):
        ops = partitions[key]
        outcome = _check_partition(ops, model, deadline)
        if isinstance(outcome, _TimedOut):
            where = f" while checking key {key!r}" if key is not None else ""
            return CheckResult(
                ok=False,
                key=key,
                explanation=f"timed out after {timeout_s}s{where}: linearizability unknown",
                timed_out=True,
            )
        if outcome is not None:
            return CheckResult(ok=False, key=key, explanation=_explain(key, ops, model, outcome))
    scope = f" over {len(partitions)} key(s)" if by_key else ""
    return CheckResult(ok=True, key=None, explanation=f"linearizable: {total} operation(s){scope}")


@dataclass(frozen=True, slots=True)
class _Failure:
    """The deepest dead end of an exhaustive search."""

    # Linearized prefix as a cons list (op index, state after it, rest), newest first.
    path: tuple[int, Any, Any] | None
    state: Any
    blocker: int


class _TimedOut:
    """Marker: the search ran out of time."""


_TIMED_OUT: Final = _TimedOut()


def _check_partition(
    ops: Sequence[Operation], model: Model[Any], deadline: float
) -> _Failure | _TimedOut | None:
    """Decide one partition: None if linearizable, else the deepest dead end found.

    Where to place an indeterminate operation is the hard part, and no single candidate order
    suits every history: trying them early (in invocation order) finds a linearization fast
    when one exists, trying them last lets the memo prune an exhaustive search well. Both
    searches are complete, so they run in alternating slices and the first to finish decides.
    """
    searches = [_search(ops, model, indeterminate_last=False)]
    if any(op.ret is None for op in ops):
        searches.append(_search(ops, model, indeterminate_last=True))
    while True:
        for search in searches:
            try:
                next(search)
            except StopIteration as finished:
                outcome: _Failure | None = finished.value
                return outcome
        if time.monotonic() > deadline:
            return _TIMED_OUT


def _search(
    ops: Sequence[Operation], model: Model[Any], *, indeterminate_last: bool
) -> Generator[None, None, _Failure | None]:
    """WGL search with memoization; yields every few steps so the caller can stop it."""
    # Events sorted by time; at equal times invocations come first, so operations that merely
    # touch are treated as concurrent (never reports a violation the clock cannot prove).
    events: list[tuple[float, int, int]] = []
    for i, op in enumerate(ops):
        events.append((op.call, 0, i))
        if op.ret is not None:
            events.append((op.ret, 1, i))
    events.sort()

    # Doubly linked list over event slots 1..m; slot 0 is the head sentinel; -1 terminates.
    m = len(events)
    nxt = [*range(1, m + 1), -1]
    prv = [-1, *range(m)]
    is_ret = [False] * (m + 1)
    ev_op = [-1] * (m + 1)
    call_slot = [0] * len(ops)
    ret_slot = [-1] * len(ops)
    for slot, (_, kind, i) in enumerate(events, start=1):
        ev_op[slot] = i
        if kind:
            is_ret[slot] = True
            ret_slot[i] = slot
        else:
            call_slot[i] = slot

    def unlink(slot: int) -> None:
        nxt[prv[slot]] = nxt[slot]
        if nxt[slot] != -1:
            prv[nxt[slot]] = prv[slot]

    def relink(slot: int) -> None:
        nxt[prv[slot]] = slot
        if nxt[slot] != -1:
            prv[nxt[slot]] = slot

    # Operations that leave the state unchanged whenever they are legal (e.g. reads). When
    # one is a legal candidate, linearizing it first loses no solution: it can be moved to
    # the front of any successful continuation. So it is taken without branching.
    indeterminate = [op.ret is None for op in ops]
    read_only = [False] * len(ops)
    if isinstance(model, _SupportsReadOnly):
        read_only = [model.is_read_only(op) and op.ret is not None for op in ops]

    # Memo: (linearized determinate ops, state) -> sets of linearized indeterminate ops
    # explored from there (bitmasks). A configuration is dominated by an explored one with
    # the same determinate ops and state but fewer indeterminate ops applied, since those
    # need never be applied. With `indeterminate_last` this prunes well: histories with and
    # without an unobserved indeterminate write merge once it is overwritten, instead of
    # multiplying the search by 2**(number of such writes).
    seen: dict[tuple[int, Any], list[int]] = {}

    def explored(det: int, st: Any, ind: int) -> bool:
        masks = seen.get((det, st))
        return masks is not None and any((m & ~ind) == 0 for m in masks)

    step = model.step
    state: Any = model.init()
    lin_det = 0  # bitmask of linearized determinate operations
    lin_ind = 0  # bitmask of linearized indeterminate operations
    path: tuple[int, Any, Any] | None = None
    # Undo records: (op index, state before it, path before it, taken without branching).
    stack: list[tuple[int, Any, tuple[int, Any, Any] | None, bool]] = []
    # Only operations with a known completion must be linearized; indeterminate ones may not.
    remaining = len(ops) - sum(indeterminate)
    best: _Failure | None = None
    best_depth = -1
    steps = 0

    entry = nxt[0]
    fresh = True  # the current configuration has not been scanned yet
    phase = 0  # with indeterminate_last, scanning for 0: determinate ops, 1: indeterminate
    while remaining:
        steps += 1
        if steps % _SLICE_STEPS == 0:
            yield
        chosen = -1
        forced = False
        dead = False
        new_state: Any = None
        if fresh:
            fresh = False
            phase = 0
            entry = nxt[0]
            # A return is always ahead while `remaining` > 0, so the scan stops in the list.
            while not is_ret[entry]:
                i = ev_op[entry]
                if read_only[i]:
                    legal, new_state = step(state, ops[i])
                    if legal:
                        chosen, forced = i, True
                        break
                entry = nxt[entry]
            if not forced:
                entry = nxt[0]
                continue
            if explored(lin_det | (1 << chosen), new_state, lin_ind):
                dead = True  # its only continuation was explored and failed
        elif not is_ret[entry]:
            i = ev_op[entry]
            entry = nxt[entry]
            # Legal read-only candidates were taken on arrival, so these are illegal here.
            if read_only[i] or (indeterminate_last and indeterminate[i] != (phase == 1)):
                continue
            legal, new_state = step(state, ops[i])
            if not legal:
                continue
            bit = 1 << i
            if (
                explored(lin_det, new_state, lin_ind | bit)
                if indeterminate[i]
                else explored(lin_det | bit, new_state, lin_ind)
            ):
                continue
            chosen = i
        elif phase == 0 and indeterminate_last:
            phase = 1
            entry = nxt[0]
            continue
        else:
            # Operation ev_op[entry] returned but could not be placed: a dead end.
            dead = True
            if len(stack) > best_depth:
                best_depth = len(stack)
                best = _Failure(path=path, state=state, blocker=ev_op[entry])

        if dead:
            while True:
                if not stack:
                    assert best is not None
                    return best
                i, state, path, was_forced = stack.pop()
                # Undo in the reverse order of unlinking (dancing links).
                if indeterminate[i]:
                    lin_ind ^= 1 << i
                else:
                    lin_det ^= 1 << i
                    relink(ret_slot[i])
                    remaining += 1
                relink(call_slot[i])
                # Where a choice was forced, nothing else is left to try.
                if not was_forced:
                    break
            phase = 1 if indeterminate[i] else 0
            entry = nxt[call_slot[i]]
            continue

        if indeterminate[chosen]:
            lin_ind |= 1 << chosen
        else:
            lin_det |= 1 << chosen
        seen.setdefault((lin_det, new_state), []).append(lin_ind)
        stack.append((chosen, state, path, forced))
        path = (chosen, new_state, path)
        state = new_state
        unlink(call_slot[chosen])
        if not indeterminate[chosen]:
            unlink(ret_slot[chosen])
            remaining -= 1
        fresh = True
    return None


def _explain(
    key: str | None, ops: Sequence[Operation], model: Model[Any], failure: _Failure
) -> str:
    prefix: list[tuple[int, Any]] = []
    node = failure.path
    while node is not None:
        prefix.append((node[0], node[1]))
        node = node[2]
    prefix.reverse()
    done = {i for i, _ in prefix}
    blocker = ops[failure.blocker]
    assert blocker.ret is not None
    determinate = sum(1 for op in ops if op.ret is not None)

    where = f"key {key!r}" if key is not None else "the history"
    lines = [
        f"{where} is not linearizable "
        f"({len(ops)} operation(s), {determinate} with a known result).",
        f"Longest linearizable prefix found ({len(prefix)} operation(s)), each with the "
        "state after it:",
    ]
    if len(prefix) > _EXPLAIN_TAIL:
        lines.append(f"  ... {len(prefix) - _EXPLAIN_TAIL} earlier operation(s) omitted")
    lines.extend(f"  {ops[i].describe()}  => {s!r}" for i, s in prefix[-_EXPLAIN_TAIL:])
    if not prefix:
        lines.append("  (empty)")
    lines.append(f"State after the prefix: {failure.state!r}")
    lines.append(f"First operation that could not be linearized: {blocker.describe()}")
    lines.append(
        "It returned before it could be placed: every order of the operations concurrent with "
        "it was tried. Candidates after the prefix:"
    )
    # Everything invoked no later than the blocker's completion was a candidate there.
    candidates = [i for i, op in enumerate(ops) if i not in done and op.call <= blocker.ret]
    candidates.sort(key=lambda i: ops[i].call)
    for i in candidates[:_EXPLAIN_TAIL]:
        legal, _ = model.step(failure.state, ops[i])
        verdict = "legal here, but no continuation worked" if legal else "illegal in this state"
        lines.append(f"  {ops[i].describe()}  -- {verdict}")
    if len(candidates) > _EXPLAIN_TAIL:
        lines.append(f"  ... {len(candidates) - _EXPLAIN_TAIL} more candidate(s) omitted")
    return "\n".join(lines)


class HistoryRecorder:
    """Append-only JSON-lines log of the operations of one process.

    Every line is flushed and fsynced before the call returns, so a log survives a crash of
    the process (at worst its last line is torn, which :func:`load_history` tolerates).
    Protocol per operation: :meth:`invoke` just before the call, then exactly one of
    :meth:`ok` (completed, with its result), :meth:`fail` (definitely had no effect) or
    :meth:`info` (outcome unknown, e.g. a timeout). A missing completion means the same as
    ``info``. Safe to share between threads of one process; use one file per process.
    """

    def __init__(self, path: str | os.PathLike[str], process: str | None = None) -> None:
        self.process = process if process is not None else f"pid{os.getpid()}"
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def invoke(self, op: str, key: str, arg: Any = None) -> str:
        """Record the invocation of ``op`` on ``key``; returns the new operation's id."""
        op_id = uuid.uuid4().hex
        self._write(
            {
                "type": "invoke",
                "id": op_id,
                "process": self.process,
                "op": op,
                "key": key,
                "arg": arg,
            }
        )
        return op_id

    def ok(self, op_id: str, result: Any = None) -> None:
        """Record that the operation completed with ``result``."""
        self._write({"type": "ok", "id": op_id, "result": result})

    def fail(self, op_id: str, error: str | None = None) -> None:
        """Record that the operation definitely did not take effect."""
        self._write({"type": "fail", "id": op_id, "error": error})

    def info(self, op_id: str, error: str | None = None) -> None:
        """Record that the outcome of the operation is unknown."""
        self._write({"type": "info", "id": op_id, "error": error})

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> HistoryRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            # CLOCK_MONOTONIC (time.monotonic_ns on Linux) is one system-wide clock, so times
            # from different processes on one machine are comparable; not across machines or
            # reboots. Stamps widen intervals, which is safe: an invoke stamp precedes the call,
            # a completion stamp follows it. Taken under the lock, so lines are in time order.
            record["time"] = time.monotonic_ns()
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())


def load_history(paths: Iterable[str | os.PathLike[str]]) -> list[Operation]:
    """Read the logs written by :class:`HistoryRecorder` and pair up their lines.

    ``ok`` gives a completed operation; ``info`` or no completion at all gives an
    indeterminate one (``ret=None``); ``fail`` drops the operation, since it had no effect.
    JSON lists become tuples and objects become frozensets of items, so values stay hashable
    (a recorded tuple, e.g. a cas argument, comes back as a tuple). A torn last line of a
    file is ignored; any other malformed input raises ``ValueError``. The result is sorted by
    invocation time.
    """
    invokes: dict[str, dict[str, Any]] = {}
    completions: dict[str, dict[str, Any]] = {}
    for path in paths:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if lineno == len(lines):
                    continue  # torn write of a process that crashed mid-line
                raise ValueError(f"{path}:{lineno}: malformed line {line!r}") from None
            kind, op_id = record.get("type"), record.get("id")
            if kind == "invoke":
                target = invokes
            elif kind in ("ok", "fail", "info"):
                target = completions
            else:
                raise ValueError(f"{path}:{lineno}: unknown record type {kind!r}")
            if op_id in target:
                raise ValueError(f"{path}:{lineno}: duplicate {kind} for operation {op_id!r}")
            target[op_id] = record

    orphans = completions.keys() - invokes.keys()
    if orphans:
        raise ValueError(f"completions without an invocation: {sorted(orphans)[:5]}")

    history: list[Operation] = []
    for op_id, inv in invokes.items():
        done = completions.get(op_id, {"type": "info"})
        if done["type"] == "fail":
            continue
        completed = done["type"] == "ok"
        history.append(
            Operation(
                process=inv["process"],
                op=inv["op"],
                key=inv["key"],
                arg=_freeze(inv.get("arg")),
                result=_freeze(done.get("result")) if completed else None,
                call=inv["time"],
                ret=done["time"] if completed else None,
                op_id=op_id,
            )
        )
    history.sort(key=lambda op: op.call)
    return history


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return frozenset((k, _freeze(v)) for k, v in value.items())
    return value
