"""The chaos run's end checks find what they claim to (no broker: made-up histories)."""

from __future__ import annotations

from typing import Any

from benchmarks.chaos import _check_exactly_once, _check_linearizable
from tests.support.linearizability import Operation


def outcome(op: str, result: Any = None, done: str | None = "ok") -> tuple[dict[str, Any], Any]:
    invoke = {"type": "invoke", "process": "w0.0", "op": op, "key": "k0", "arg": None}
    return invoke, (None if done is None else {"type": done, "result": result})


def test_exactly_once_counts_lost_duplicated_and_phantom() -> None:
    outcomes = {
        "acked": outcome("incr", 1),
        "lost": outcome("write"),
        "doubled": outcome("incr", 2),
        "unknown-once": outcome("incr", done="info"),
        "unknown-twice": outcome("incr", done=None),  # its process was killed
        "refused": outcome("write", done="fail"),  # "nothing was appended", yet applied
        "cas-false": outcome("cas", False),  # answered "not swapped", yet applied
        "cas-true": outcome("cas", True),
        "read": outcome("read", 3),
    }
    seen = {
        "acked": 1,
        "doubled": 2,
        "unknown-once": 1,
        "unknown-twice": 2,
        "refused": 1,
        "cas-false": 1,
        "cas-true": 1,
        "stranger": 1,  # nobody invoked it
    }
    lost, duplicated, phantom, notes = _check_exactly_once({"seen": seen}, outcomes, "r")
    assert (lost, duplicated, phantom) == (1, 2, 3), notes
    assert any("lost" in note and "never applied" in note for note in notes)


def test_exactly_once_accepts_unknown_outcomes_applied_or_not() -> None:
    outcomes = {"a": outcome("incr", done="info"), "b": outcome("write", done=None)}
    assert _check_exactly_once({"seen": {"a": 1}}, outcomes, "r")[:3] == (0, 0, 0)
    assert _check_exactly_once({"seen": {"b": 1}}, outcomes, "r")[:3] == (0, 0, 0)


def op(
    process: str,
    name: str,
    key: str,
    arg: Any,
    result: Any,
    call: int,
    ret: int | None,
    op_id: str = "",
) -> Operation:
    return Operation(process, name, key, arg, result, call, ret, op_id)


def test_linearizability_of_counter_and_registers() -> None:
    history = [
        op("a", "incr", "counter", 1, 1, 0, 1, "i1"),
        op("b", "incr", "counter", 1, None, 2, None, "i2"),  # unknown, and never applied
        op("a", "read", "counter", None, 1, 3, 4),
        op("a", "write", "k0", "x", None, 0, 1, "w1"),
        op("b", "read", "k0", None, "x", 2, 3),
    ]
    assert _check_linearizable(history, {"i1": 1, "w1": 1}, 10) == ("yes", [])
    stale = [*history, op("c", "read", "k0", None, None, 5, 6)]
    verdict, problems = _check_linearizable(stale, {"i1": 1, "w1": 1}, 10)
    assert verdict == "yes/NO"
    assert "registers history is not linearizable" in problems[0]
    # An unknown increment that was applied stays in the history: a read may then see it.
    seen = [*history[:2], op("a", "read", "counter", None, 2, 3, 4)]
    assert _check_linearizable(seen, {"i1": 1, "i2": 1}, 10)[0] == "yes"
    # ...but one the final state never applied is dropped, so a read of 2 is impossible.
    assert _check_linearizable(seen, {"i1": 1}, 10)[0] == "NO/yes"
