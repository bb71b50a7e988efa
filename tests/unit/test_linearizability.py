"""Tests for the linearizability checker and history recorder in tests.support."""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.linearizability import (
    CheckResult,
    CounterModel,
    HistoryRecorder,
    Model,
    Operation,
    RegisterModel,
    check,
    load_history,
)


def op(
    process: str,
    name: str,
    key: str,
    arg: Any,
    result: Any,
    call: float,
    ret: float | None,
) -> Operation:
    return Operation(process=process, op=name, key=key, arg=arg, result=result, call=call, ret=ret)


# --------------------------------------------------------------------------- simulation


def simulate_register_history(
    seed: int,
    n_ops: int,
    n_keys: int,
    n_procs: int,
    *,
    indeterminate_rate: float = 0.0,
) -> list[Operation]:
    """A history of a truly atomic register per key: each op takes effect at a random instant
    inside its interval, so the result is linearizable by construction."""
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(n_keys)]
    # (process, kind, key, call, ret, linearization point or None if it never took effect)
    specs: list[tuple[str, str, str, float, float | None, float | None]] = []
    for p in range(n_procs):
        generation = 0
        t = rng.uniform(0.0, 5.0)
        for _ in range(n_ops // n_procs):
            call = t + rng.expovariate(1.0)
            end = call + rng.expovariate(0.4)  # mean 2.5 > mean gap 1: plenty of overlap
            kind = rng.choices(["read", "write", "cas"], weights=[5, 3, 2])[0]
            key = rng.choice(keys)
            process = f"p{p}.{generation}"
            if rng.random() < indeterminate_rate:
                took_effect = rng.random() < 0.5
                lin = rng.uniform(call, call + 30.0) if took_effect else None
                specs.append((process, kind, key, call, None, lin))
                generation += 1  # a crashed process is replaced by a fresh one
            else:
                specs.append((process, kind, key, call, end, rng.uniform(call, end)))
            t = end

    fresh = itertools.count(1)  # every written value is unique, so stale reads are detectable
    state: dict[str, Any] = dict.fromkeys(keys)
    written: dict[str, list[Any]] = {k: [None] for k in keys}
    order = sorted(range(len(specs)), key=lambda i: (specs[i][5] is None, specs[i][5] or 0.0))
    ops: list[Operation] = []
    for i in order:
        process, kind, key, call, ret, lin = specs[i]
        arg: Any = None
        result: Any = None
        if kind == "write":
            arg = next(fresh)
        elif kind == "cas":
            current = state[key] if lin is not None else None
            expected = current if rng.random() < 0.6 else rng.choice(written[key])
            arg = (expected, next(fresh))
        if lin is not None:
            if kind == "read":
                result = state[key]
            elif kind == "write":
                state[key] = arg
                written[key].append(arg)
            else:
                result = state[key] == arg[0]
                if result:
                    state[key] = arg[1]
                    written[key].append(arg[1])
        if ret is None:
            result = None
        ops.append(op(process, kind, key, arg, result, call, ret))
    ops.sort(key=lambda o: o.call)
    return ops


def inject_stale_read(history: Sequence[Operation]) -> tuple[list[Operation], Operation]:
    """Make one read (from the middle of the history) return a value that two completed
    writes, both finished before the read started, have provably overwritten."""
    ops = list(history)
    for idx in range(len(ops) // 2, len(ops)):
        read = ops[idx]
        if read.op != "read" or read.ret is None:
            continue
        writes = [
            o
            for o in ops
            if o.key == read.key and o.op == "write" and o.ret is not None and o.ret < read.call
        ]
        if not writes:
            continue
        last = max(writes, key=lambda o: o.call)
        older = [
            w for w in writes if w.ret is not None and w.ret < last.call and w.arg != read.result
        ]
        if older:
            ops[idx] = dataclasses.replace(read, result=older[-1].arg)
            return ops, ops[idx]
    raise AssertionError("no place to inject a stale read")


# --------------------------------------------------------------------------- register


def test_sequential_history_passes() -> None:
    history = [
        op("a", "read", "x", None, None, 0, 1),
        op("a", "write", "x", 1, None, 2, 3),
        op("b", "read", "x", None, 1, 4, 5),
        op("b", "cas", "x", (1, 2), True, 6, 7),
        op("a", "cas", "x", (1, 3), False, 8, 9),
        op("a", "read", "x", None, 2, 10, 11),
    ]
    result = check(history, RegisterModel())
    assert result.ok, result.explanation
    assert result.key is None
    assert not result.timed_out


def test_concurrent_linearizable_history_passes() -> None:
    # Only order: b's read (None), d's write of 2, a's write of 1, then the reads of 1.
    # d's write returned (1.5) before c's and b's reads of 1 were called, yet they may see 1
    # because a's write of 1 overlaps all of them.
    history = [
        op("a", "write", "x", 1, None, 0, 10),
        op("d", "write", "x", 2, None, 0.5, 1.5),
        op("b", "read", "x", None, None, 1, 3),
        op("c", "read", "x", None, 1, 2, 4),
        op("b", "read", "x", None, 1, 5, 12),
        op("c", "read", "x", None, 1, 13, 14),
    ]
    result = check(history, RegisterModel())
    assert result.ok, result.explanation
    # Had d's write started after c's read of 1 returned, the last read could not see 1.
    late = [*history[:1], dataclasses.replace(history[1], call=6, ret=8), *history[2:]]
    assert not check(late, RegisterModel()).ok


def test_stale_read_fails_with_key() -> None:
    history = [
        op("a", "write", "y", 7, None, 0, 1),  # an unrelated, fine key
        op("a", "write", "x", 1, None, 0, 1),
        op("a", "write", "x", 2, None, 2, 3),
        op("b", "read", "x", None, 1, 4, 5),  # stale: the write of 2 completed before
        op("b", "read", "y", None, 7, 4, 5),
    ]
    result = check(history, RegisterModel())
    assert not result.ok
    assert not result.timed_out
    assert result.key == "x"
    assert "First operation that could not be linearized: [b] read('x') -> 1" in result.explanation
    assert "write('x', 2)" in result.explanation


def test_indeterminate_write_seen_by_later_read_passes() -> None:
    history = [
        op("a", "write", "x", 1, None, 0, 1),
        op("b", "write", "x", 2, None, 2, None),  # timed out; did it happen?
        op("a", "read", "x", None, 2, 10, 11),  # yes
        op("a", "read", "x", None, 2, 12, 13),
    ]
    assert check(history, RegisterModel()).ok


def test_indeterminate_write_never_seen_passes() -> None:
    history = [
        op("a", "write", "x", 1, None, 0, 1),
        op("b", "write", "x", 2, None, 2, None),  # timed out; apparently it never happened
        op("a", "read", "x", None, 1, 10, 11),
        op("a", "read", "x", None, 1, 12, 13),
    ]
    assert check(history, RegisterModel()).ok


def test_indeterminate_write_cannot_act_before_its_call() -> None:
    history = [
        op("a", "read", "x", None, 2, 0, 1),
        op("b", "write", "x", 2, None, 5, None),
    ]
    result = check(history, RegisterModel())
    assert not result.ok
    assert result.key == "x"


def test_indeterminate_write_seen_then_unseen_fails() -> None:
    history = [
        op("a", "write", "x", 1, None, 0, 1),
        op("b", "write", "x", 2, None, 2, None),
        op("a", "read", "x", None, 2, 10, 11),
        op("a", "read", "x", None, 1, 12, 13),  # nothing could have written 1 again
    ]
    assert not check(history, RegisterModel()).ok


def test_indeterminate_cas_either_way() -> None:
    base = [
        op("a", "write", "x", 1, None, 0, 1),
        op("b", "cas", "x", (1, 5), None, 2, None),
    ]
    seen = [*base, op("a", "read", "x", None, 5, 10, 11)]
    unseen = [*base, op("a", "read", "x", None, 1, 10, 11)]
    impossible = [*base, op("a", "read", "x", None, 6, 10, 11)]
    assert check(seen, RegisterModel()).ok
    assert check(unseen, RegisterModel()).ok
    assert not check(impossible, RegisterModel()).ok


def test_indeterminate_reads_are_ignored() -> None:
    history = [op("a", "read", "x", None, None, i, None) for i in range(200)]
    history.append(op("b", "write", "x", 1, None, 0, 1))
    assert check(history, RegisterModel()).ok


def test_touching_operations_are_concurrent() -> None:
    # ret == call cannot prove an order, so it is not treated as one.
    history = [
        op("a", "write", "x", 1, None, 0, 5),
        op("b", "read", "x", None, None, 5, 6),
    ]
    assert check(history, RegisterModel()).ok


def test_unknown_operation_raises() -> None:
    with pytest.raises(ValueError, match="does not support"):
        check([op("a", "incr", "x", 1, 1, 0, 1)], RegisterModel())


def test_operation_rejects_return_before_call() -> None:
    with pytest.raises(ValueError, match="returns before"):
        op("a", "read", "x", None, None, 5, 4)


# --------------------------------------------------------------------------- counter


def test_counter_sequential_and_concurrent_pass() -> None:
    history = [
        op("a", "incr", "c", 1, 1, 0, 1),
        op("a", "incr", "c", 2, 4, 2, 10),  # concurrent with b's incr, took effect after it
        op("b", "incr", "c", 1, 2, 3, 5),
        op("b", "read", "c", None, 2, 6, 7),  # before a's incr of 2
        op("b", "read", "c", None, 4, 11, 12),
    ]
    assert check(history, CounterModel()).ok


def test_counter_lost_increment_fails() -> None:
    history = [
        op("a", "incr", "c", 1, 1, 0, 2),
        op("b", "incr", "c", 1, 1, 1, 3),  # both saw 0: one increment was lost
        op("a", "read", "c", None, 1, 4, 5),
    ]
    result = check(history, CounterModel())
    assert not result.ok
    assert result.key == "c"


def test_counter_lost_increment_seen_by_read_fails() -> None:
    history = [
        op("a", "incr", "c", 1, 1, 0, 1),
        op("b", "incr", "c", 1, 2, 2, 3),
        op("a", "read", "c", None, 1, 4, 5),
    ]
    assert not check(history, CounterModel()).ok


def test_counter_double_applied_increment_fails() -> None:
    history = [
        op("a", "incr", "c", 1, 1, 0, 1),
        op("b", "read", "c", None, 2, 2, 3),  # the single increment was applied twice
    ]
    result = check(history, CounterModel())
    assert not result.ok
    assert result.key == "c"
    assert "read('c') -> 2" in result.explanation


def test_counter_indeterminate_increment_either_way() -> None:
    base = [op("a", "incr", "c", 1, 1, 0, 1), op("b", "incr", "c", 5, None, 2, None)]
    assert check([*base, op("a", "read", "c", None, 6, 3, 4)], CounterModel()).ok
    assert check([*base, op("a", "read", "c", None, 1, 3, 4)], CounterModel()).ok
    assert not check([*base, op("a", "read", "c", None, 11, 3, 4)], CounterModel()).ok


# --------------------------------------------------------------------------- scale


def test_long_sequential_history_needs_no_recursion() -> None:
    history = [op("a", "incr", "c", 1, i + 1, 2 * i, 2 * i + 1) for i in range(20_000)]
    assert check(history, CounterModel()).ok


def test_random_atomic_register_history_passes_quickly() -> None:
    history = simulate_register_history(7, 5_000, 8, 4, indeterminate_rate=0.005)
    assert len(history) == 5_000
    assert any(o.ret is None for o in history)
    start = time.perf_counter()
    result = check(history, RegisterModel())
    elapsed = time.perf_counter() - start
    assert result.ok, result.explanation
    assert elapsed < 10.0, f"took {elapsed:.2f}s"


def test_random_atomic_register_history_with_stale_read_fails() -> None:
    history = simulate_register_history(7, 5_000, 8, 4, indeterminate_rate=0.005)
    broken, stale = inject_stale_read(history)
    start = time.perf_counter()
    result = check(broken, RegisterModel())
    elapsed = time.perf_counter() - start
    assert not result.ok
    assert not result.timed_out, result.explanation
    assert result.key == stale.key
    assert elapsed < 10.0, f"took {elapsed:.2f}s"


def test_twenty_thousand_ops_over_32_keys() -> None:
    history = simulate_register_history(11, 20_000, 32, 8, indeterminate_rate=0.002)
    start = time.perf_counter()
    result = check(history, RegisterModel())
    elapsed = time.perf_counter() - start
    assert result.ok, result.explanation
    assert elapsed < 15.0, f"took {elapsed:.2f}s"


def test_timeout_reports_unknown() -> None:
    # Many concurrent indeterminate writes, then an impossible read: the search must try
    # every subset of the writes, which cannot finish in 0.2s.
    history = [op(f"p{i}", "write", "x", i, None, 0, None) for i in range(40)]
    history.append(op("r", "read", "x", None, -1, 1, 2))
    result = check(history, RegisterModel(), timeout_s=0.2)
    assert isinstance(result, CheckResult)
    assert not result.ok
    assert result.timed_out
    assert result.key == "x"


# --------------------------------------------------------------------------- brute force


def brute_force_linearizable(history: Sequence[Operation], model: Model[Any]) -> bool:
    """Try every subset of indeterminate ops and every order consistent with real time."""
    determinate = [o for o in history if o.ret is not None]
    indeterminate = [o for o in history if o.ret is None]
    for r in range(len(indeterminate) + 1):
        for extra in itertools.combinations(indeterminate, r):
            for order in itertools.permutations([*determinate, *extra]):
                if any(
                    (b.ret is not None and b.ret < a.call)
                    for i, a in enumerate(order)
                    for b in order[i + 1 :]
                ):
                    continue
                state = model.init()
                for o in order:
                    legal, state = model.step(state, o)
                    if not legal:
                        break
                else:
                    return True
    return False


@st.composite
def small_register_histories(draw: st.DrawFn) -> list[Operation]:
    n = draw(st.integers(min_value=1, max_value=6))
    ops: list[Operation] = []
    value = st.sampled_from([None, 1, 2, 3])
    for i in range(n):
        call = draw(st.integers(0, 8))
        ret: int | None = None if draw(st.integers(0, 5)) == 0 else call + draw(st.integers(0, 4))
        kind = draw(st.sampled_from(["read", "write", "cas"]))
        if kind == "read":
            ops.append(op(f"p{i}", kind, "x", None, draw(value), call, ret))
        elif kind == "write":
            ops.append(op(f"p{i}", kind, "x", draw(value), None, call, ret))
        else:
            arg = (draw(value), draw(value))
            ops.append(op(f"p{i}", kind, "x", arg, draw(st.booleans()), call, ret))
    return ops


@st.composite
def small_counter_histories(draw: st.DrawFn) -> list[Operation]:
    n = draw(st.integers(min_value=1, max_value=6))
    ops: list[Operation] = []
    for i in range(n):
        call = draw(st.integers(0, 8))
        ret: int | None = None if draw(st.integers(0, 4)) == 0 else call + draw(st.integers(0, 4))
        if draw(st.booleans()):
            ops.append(op(f"p{i}", "read", "c", None, draw(st.integers(0, 4)), call, ret))
        else:
            arg = draw(st.integers(1, 2))
            ops.append(op(f"p{i}", "incr", "c", arg, draw(st.integers(1, 5)), call, ret))
    return ops


@settings(max_examples=300, deadline=None, database=None)
@given(small_register_histories())
def test_register_agrees_with_brute_force(history: list[Operation]) -> None:
    model = RegisterModel()
    assert check(history, model).ok == brute_force_linearizable(history, model)


@settings(max_examples=300, deadline=None, database=None)
@given(small_counter_histories())
def test_counter_agrees_with_brute_force(history: list[Operation]) -> None:
    model = CounterModel()
    assert check(history, model).ok == brute_force_linearizable(history, model)


# --------------------------------------------------------------------------- recorder


def test_recorder_round_trip(tmp_path: Path) -> None:
    path_a, path_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with HistoryRecorder(path_a, "a") as a, HistoryRecorder(path_b, "b") as b:
        w1 = a.invoke("write", "x", 1)
        a.ok(w1)
        r1 = b.invoke("read", "x")
        b.ok(r1, 1)
        c1 = a.invoke("cas", "x", (1, 2))
        a.ok(c1, True)
        f1 = b.invoke("write", "x", 99)
        b.fail(f1, "rejected")  # definitely not applied: dropped
        i1 = b.invoke("write", "x", 3)
        b.info(i1, "timeout")  # unknown
        a.invoke("write", "x", 4)  # the process "crashes" before completing
    with path_a.open("a", encoding="utf-8") as f:
        f.write('{"type":"ok","id":"tor')  # torn line of a crashed writer

    history = load_history([path_a, path_b])
    assert [(o.process, o.op, o.arg, o.result, o.ret is None) for o in history] == [
        ("a", "write", 1, None, False),
        ("b", "read", None, 1, False),
        ("a", "cas", (1, 2), True, False),
        ("b", "write", 3, None, True),
        ("a", "write", 4, None, True),
    ]
    assert all(isinstance(o.call, int) for o in history)
    assert all(o.ret is None or o.ret >= o.call for o in history)
    assert check(history, RegisterModel()).ok
    # The crashed write is not allowed to "un-happen" after being observed.
    observed = [*history, op("c", "read", "x", None, 4, history[-1].call + 1, history[-1].call + 2)]
    assert check(observed, RegisterModel()).ok


def test_load_history_rejects_corruption(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('not json\n{"type":"ok","id":"x","result":null,"time":1}\n')
    with pytest.raises(ValueError, match="malformed"):
        load_history([path])
    path.write_text(json.dumps({"type": "ok", "id": "x", "result": None, "time": 1}) + "\n")
    with pytest.raises(ValueError, match="without an invocation"):
        load_history([path])


def _register_worker(path: str, name: str, lock: Any, cell: Any, seed: int, n: int) -> None:
    rng = random.Random(seed)
    with HistoryRecorder(path, name) as rec:
        for i in range(n):
            kind = rng.choice(["read", "write", "cas"])
            if kind == "read":
                op_id = rec.invoke("read", "x")
                with lock:
                    result: Any = cell.value
            elif kind == "write":
                value = seed * 1_000 + i
                op_id = rec.invoke("write", "x", value)
                with lock:
                    cell.value = value
                result = None
            else:
                expected, new = rng.choice([0, cell.value]), seed * 1_000 + i
                op_id = rec.invoke("cas", "x", (expected, new))
                with lock:
                    result = cell.value == expected
                    if result:
                        cell.value = new
            rec.ok(op_id, result)


def test_recorder_across_os_processes(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")  # no fork-with-threads hazards
    lock = ctx.Lock()
    cell = ctx.Value("q", 0, lock=False)
    paths = [str(tmp_path / f"p{i}.jsonl") for i in range(4)]
    procs = [
        ctx.Process(target=_register_worker, args=(path, f"p{i}", lock, cell, i + 1, 40))
        for i, path in enumerate(paths)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    history = load_history(paths)
    assert len(history) == 160
    result = check(history, RegisterModel(initial=0))
    assert result.ok, result.explanation
