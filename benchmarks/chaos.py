"""A chaos run: writer processes under random faults, then exactly-once, digests, linearizability.

    scripts/chaos --minutes N [--writers 4] [--seed S] [--keep]
    python -m benchmarks.chaos --minutes N ...

Several writer processes (each a fresh interpreter started with ``subprocess``: a pulsar-client
cannot cross ``fork``) share one topic and run, in random order, two workloads on its state:

* a non-idempotent counter: ``incr`` (a write whose reader returns the new count) and
  linearizable reads of the count (``read(latest=True)``);
* registers ``k0..k2``: linearizable reads, writes of unique values, and compare-and-sets
  decided by the write's generator.

Every op carries its history id, and ``apply`` counts the ids it applies (``seen``). Each process
records its history (invoke; then ok with the result, fail, or unknown) in its own JSON-lines
file with :class:`tests.support.linearizability.HistoryRecorder`. Meanwhile a fault driver, at
random: SIGKILLs a writer and starts a new one in its place (``writer-kill``); SIGSTOPs one for
longer than ``takeover_after_s``, so that the others fence it, then resumes it
(``writer-pause``); SIGKILLs the broker and starts it again through ``scripts/pulsar-standalone``
(``broker-kill``; it honours PULSAR_HOME and the port variables). The first three faults are
one of each kind, in random order.

At the end the writers stop, every replica (each writer, and two fresh processes replaying the
topic) reports its state at the tail, and the run checks:

* every replica is at the same position with the same state digest;
* on every replica, each acknowledged write was applied exactly once (``lost``: not at all,
  ``duplicated``: more than once), a write with an unknown outcome (``WriteOutcomeUnknownError``,
  a killed process, any error not documented as "nothing was appended") at most once, and
  nothing else at all (``phantom``: a write that failed with "nothing was appended", a
  compare-and-set that answered False, or an id nobody invoked);
* the history is linearizable (WGL checker; the counter and each register on its own model).
  A write of unknown outcome that no replica applied is dropped from the history (the state
  proves it had no effect); one that was applied stays of unknown outcome.

It prints one line (ops acked, faults injected by kind, lost, duplicated, linearizable) and
exits 0 only when every check passed; 1 on a violation (details above the line, the histories
kept), 2 when the run itself could not be done (the broker did not come back, a writer could
not open).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

REPO: Final = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.linearizability import (  # noqa: E402 - needs the checkout on sys.path
    CheckResult,
    CounterModel,
    HistoryRecorder,
    Operation,
    RegisterModel,
    check,
    load_history,
)

FAULT_KINDS: Final = ("writer-kill", "writer-pause", "broker-kill")
# Later faults are drawn with these weights (broker restarts take 20-100 s on a busy machine).
_FAULT_WEIGHTS: Final = (0.45, 0.35, 0.2)
COUNTER: Final = "counter"
REGISTERS: Final = ("k0", "k1", "k2")
# Op mix of a writer, and the weights of its kinds.
_KINDS: Final = ("incr", "read-counter", "read", "write", "cas")
_KIND_WEIGHTS: Final = (3, 2, 3, 2, 2)
# Write errors that the library documents as "nothing was appended".
_NOTHING_APPENDED: Final = ("OperationTimeoutError", "WriterBusyError")
_STANDALONE: Final = REPO / "scripts" / "pulsar-standalone"
_CALL_TIMEOUT_S: Final = 20.0
# A writer started while the broker restarts waits this long to open.
_OPEN_TIMEOUT_S: Final = 600.0
# How long the end of the run waits for writers to stop, report and exit.
_PHASE_TIMEOUT_S: Final = 300.0


# --------------------------------------------------------------------------- the state


def new_state() -> dict[str, Any]:
    return {"count": 0, "seen": {}, "regs": {}}


def apply_op(state: dict[str, Any], op: dict[str, Any]) -> None:
    """Non-idempotent on purpose: applying an op twice shows in ``seen`` (and ``count``)."""
    state["seen"][op["id"]] = state["seen"].get(op["id"], 0) + 1
    if op["op"] == "incr":
        state["count"] += 1
    elif op["op"] == "set":
        state["regs"][op["key"]] = op["value"]
    else:
        raise ValueError(f"unknown op {op['op']!r}")


def digest(state: dict[str, Any]) -> str:
    canonical = json.dumps(state, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# --------------------------------------------------------------------------- worker processes


def _emit(out: TextIO, **event: Any) -> None:
    out.write(json.dumps(event) + "\n")
    out.flush()
    os.fsync(out.fileno())


def _manager(args: argparse.Namespace) -> Any:
    from pulsar_state import SharedStateManager

    return SharedStateManager(
        args.url,
        args.topic,
        initial_state=new_state,
        apply=apply_op,
        admin_url=args.admin,
        takeover_after_s=args.takeover,
        write_timeout_s=_CALL_TIMEOUT_S,
        read_timeout_s=_CALL_TIMEOUT_S,
        open_timeout_s=_OPEN_TIMEOUT_S,
        name=args.name,
    )


class _Writer:
    """One writer process: random ops until told to stop, each recorded in the history."""

    def __init__(self, args: argparse.Namespace, manager: Any, history: HistoryRecorder) -> None:
        self.args, self.manager, self.history = args, manager, history
        self.rng = random.Random(args.seed)
        self.sequence = 0

    async def one_op(self) -> None:
        from pulsar_state import PulsarStateError

        kind = self.rng.choices(_KINDS, _KIND_WEIGHTS)[0]
        key = COUNTER if kind in ("incr", "read-counter") else self.rng.choice(REGISTERS)
        self.sequence += 1
        value = f"{self.args.name}-{self.sequence}"
        manager = self.manager
        op_id: str | None = None
        try:
            if kind == "read-counter" or kind == "read":
                op_id = self.history.invoke("read", key)
                read = (lambda s: s["count"]) if key == COUNTER else (lambda s: s["regs"].get(key))
                self.history.ok(op_id, await manager.read(read, latest=True))
            elif kind == "incr":
                op_id = self.history.invoke("incr", key, 1)
                result = await manager.write(
                    lambda s: [{"op": "incr", "id": op_id}], reader=lambda s: s["count"]
                )
                self.history.ok(op_id, result.value)
            elif kind == "write":
                op_id = self.history.invoke("write", key, value)
                await manager.write(
                    lambda s: [{"op": "set", "id": op_id, "key": key, "value": value}]
                )
                self.history.ok(op_id, None)
            else:
                current = await manager.read(lambda s: s["regs"].get(key))
                # Mostly the value seen locally, so that some succeed; else any earlier value.
                expected = current if self.rng.random() < 0.6 else self.rng.choice([None, current])
                op_id = self.history.invoke("cas", key, [expected, value])
                decision = {"swapped": False}

                def cas(state: dict[str, Any]) -> list[dict[str, Any]]:
                    # Runs again on every attempt: the committed attempt's decision is the last.
                    decision["swapped"] = state["regs"].get(key) == expected
                    if not decision["swapped"]:
                        return []
                    return [{"op": "set", "id": op_id, "key": key, "value": value}]

                await manager.write(cas)
                self.history.ok(op_id, decision["swapped"])
        except PulsarStateError as exc:
            if op_id is None:
                raise  # before anything was invoked: a halted replica, say
            name = type(exc).__name__
            if kind.startswith("read") or name in _NOTHING_APPENDED:
                self.history.fail(op_id, name)  # a read, or a write that appended nothing
            else:
                self.history.info(op_id, name)  # applied once or not at all
            if not exc.retriable and name != "WriteOutcomeUnknownError":
                raise
            await asyncio.sleep(0.5)  # the broker may be restarting: no retry storm


async def _final_report(
    args: argparse.Namespace, manager: Any, history: HistoryRecorder | None
) -> None:
    """Catch up with the tail (retried: a broker restart may still be settling), record the
    reads it makes as linearizable reads, and write this replica's state and digest."""
    from pulsar_state import PulsarStateError

    deadline = time.monotonic() + _PHASE_TIMEOUT_S
    while True:
        reads = (
            [(key, history.invoke("read", key)) for key in (COUNTER, *REGISTERS)] if history else []
        )
        try:
            position = await manager.sync(timeout=_CALL_TIMEOUT_S)
            break
        except PulsarStateError as exc:
            for _, op_id in reads:
                history.fail(op_id, type(exc).__name__)  # type: ignore[union-attr]
            if not exc.retriable or time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)
    state = await manager.read(lambda s: json.loads(json.dumps(s)))
    for key, op_id in reads:
        assert history is not None
        history.ok(op_id, state["count"] if key == COUNTER else state["regs"].get(key))
    report = {
        "name": args.name,
        "position": position,
        "digest": digest(state),
        "state": state,
        "fencings": manager.stats.writer_fencings,
        "relayed": manager.stats.records_relayed,
    }
    target = Path(args.dir) / f"replica-{args.name}.json"
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(target)


async def _writer_main(args: argparse.Namespace) -> None:
    run = Path(args.dir)
    with (
        open(run / f"events-{args.name}.jsonl", "a") as events,  # noqa: ASYNC230
        HistoryRecorder(run / f"history-{args.name}.jsonl", process=args.name) as history,
    ):
        async with _manager(args) as manager:
            _emit(events, event="open", position=manager.position)
            writer = _Writer(args, manager, history)
            while not (run / "stop").exists():
                await writer.one_op()
                await asyncio.sleep(writer.rng.uniform(0, args.think))
            _emit(events, event="stopped", ops=writer.sequence)
            await asyncio.to_thread(_wait_for_path, run / "verify")
            await _final_report(args, manager, history)
            _emit(events, event="reported")


def _wait_for_path(path: Path) -> None:
    while not path.exists():
        time.sleep(0.1)


async def _replica_main(args: argparse.Namespace) -> None:
    async with _manager(args) as manager:
        await _final_report(args, manager, None)


def _child(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.chaos child")
    parser.add_argument("mode", choices=["writer", "replica"])
    for option in ("url", "admin", "topic", "name", "dir"):
        parser.add_argument(f"--{option}", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--takeover", type=float, default=2.0)
    parser.add_argument("--think", type=float, default=0.05)
    args = parser.parse_args(argv)
    asyncio.run(_writer_main(args) if args.mode == "writer" else _replica_main(args))
    # Skip interpreter teardown: pulsar-client can crash while Python shuts down
    # (apache/pulsar-client-python#153); everything is closed and flushed by now.
    sys.stdout.flush()
    os._exit(0)


# --------------------------------------------------------------------------- the driver


class RunError(RuntimeError):
    """The run itself could not be done (not a violation found in the library)."""


@dataclasses.dataclass
class Summary:
    minutes: float
    acked_writes: int = 0
    acked_reads: int = 0
    unknown: int = 0
    failed: int = 0
    faults: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    takeovers: int = 0
    # Records the reporting processes sent through the write relay (not those of killed ones).
    relayed: int = 0
    replicas: int = 0
    position: int = 0
    digests_agree: bool = False
    lost: int = 0
    duplicated: int = 0
    phantom: int = 0
    linearizable: str = "not checked"
    writer_failures: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        faults = " ".join(f"{kind}={self.faults[kind]}" for kind in FAULT_KINDS)
        return (
            f"chaos {self.minutes:g} min: ops acked {self.acked_writes + self.acked_reads} "
            f"(writes {self.acked_writes}, reads {self.acked_reads}), unknown outcome "
            f"{self.unknown}, failed {self.failed}; faults {faults} (takeovers {self.takeovers}, "
            f"relayed {self.relayed}); "
            f"lost {self.lost}, duplicated {self.duplicated}, phantom {self.phantom}; "
            f"replicas {self.replicas} {'agree' if self.digests_agree else 'DISAGREE'} at "
            f"position {self.position}; linearizable {self.linearizable}"
            f"{'' if self.ok else ' -> VIOLATION'}"
        )


class Broker:
    """The bundled broker, through scripts/pulsar-standalone (which honours PULSAR_HOME etc.)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def script(self, *args: str, timeout: float = 600.0) -> str:
        result = subprocess.run(
            [str(_STANDALONE), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RunError(
                f"scripts/pulsar-standalone {' '.join(args)} failed:\n{result.stderr[-2000:]}"
            )
        return result.stdout

    def urls(self) -> tuple[str, str]:
        # `start` on a running broker only checks it (a real write and read-back).
        output = self.script("start")
        urls = dict(
            line.split("=", 1) for line in output.splitlines() if line.startswith("PULSAR_")
        )
        return urls["PULSAR_SERVICE_URL"], urls["PULSAR_ADMIN_URL"]

    def kill_and_start(self) -> float:
        self.script("kill")
        started = time.monotonic()
        try:
            self.script("start")
        except RunError:
            # One more chance (e.g. a start that timed out on a starved machine); then give up.
            self.script("stop")
            self.script("start")
        return time.monotonic() - started


class Writers:
    """The writer slots; a killed writer is replaced by a new process (a new incarnation)."""

    def __init__(self, run: Path, base_argv: list[str], count: int, seed: int) -> None:
        self.run, self.base_argv, self.seed = run, base_argv, seed
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.names: dict[int, str] = {}
        self.incarnations = collections.Counter[int]()
        self.all_names: list[str] = []
        for slot in range(count):
            self.start(slot)

    def start(self, slot: int) -> None:
        name = f"w{slot}.{self.incarnations[slot]}"
        self.incarnations[slot] += 1
        argv = [*self.base_argv, "writer", "--name", name, "--dir", str(self.run)]
        argv += ["--seed", str(self.seed * 1000 + len(self.all_names))]
        log = open(self.run / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        self.procs[slot] = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=log)
        log.close()
        self.names[slot] = name
        self.all_names.append(name)

    def events(self, name: str) -> list[dict[str, Any]]:
        path = self.run / f"events-{name}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def log_tail(self, name: str) -> str:
        return (self.run / f"{name}.log").read_text(errors="replace")[-3000:]

    def check_alive(self) -> list[str]:
        """Writers that exited on their own (a crash, or an error they could not ride out)
        are restarted; returns a description of each."""
        failures = []
        for slot, proc in self.procs.items():
            if proc.poll() is not None:
                name = self.names[slot]
                failures.append(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
                self.start(slot)
        return failures

    def wait_events(self, event: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for slot, proc in self.procs.items():
            name = self.names[slot]
            while not any(e["event"] == event for e in self.events(name)):
                if proc.poll() is not None:
                    raise RunError(f"{name} exited ({proc.returncode}):\n{self.log_tail(name)}")
                if time.monotonic() > deadline:
                    raise RunError(
                        f"{name}: no {event!r} within {timeout:.0f}s:\n{self.log_tail(name)}"
                    )
                time.sleep(0.1)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()


def _inject(
    kind: str, rng: random.Random, writers: Writers, broker: Broker, takeover_s: float
) -> str:
    slot = rng.randrange(len(writers.procs))
    name = writers.names[slot]
    proc = writers.procs[slot]
    if kind == "writer-kill":
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        writers.start(slot)
        return f"SIGKILL {name}, started {writers.names[slot]}"
    if kind == "writer-pause":
        paused = takeover_s + rng.uniform(1.0, 3.0)
        proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(paused)
        finally:
            proc.send_signal(signal.SIGCONT)
        return f"SIGSTOP {name} for {paused:.1f}s (takeover after {takeover_s}s), SIGCONT"
    seconds = broker.kill_and_start()
    return f"SIGKILL broker, back in {seconds:.1f}s"


def _run_replicas(run: Path, base_argv: list[str], count: int) -> None:
    procs = {}
    for i in range(count):
        name = f"fresh{i}"
        log = open(run / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        argv = [*base_argv, "replica", "--name", name, "--dir", str(run)]
        procs[name] = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=log)
        log.close()
    for name, proc in procs.items():
        try:
            code = proc.wait(_PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if code != 0:
            tail = (run / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RunError(f"fresh replica {name} failed ({code}):\n{tail}")


def _raw_outcomes(paths: Sequence[Path]) -> dict[str, tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each recorded operation's invocation and completion (None: none recorded)."""
    invokes: dict[str, dict[str, Any]] = {}
    completions: dict[str, dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line (load_history checks the files strictly)
            (invokes if record["type"] == "invoke" else completions)[record["id"]] = record
    return {op_id: (inv, completions.get(op_id)) for op_id, inv in invokes.items()}


def _check_exactly_once(
    state: dict[str, Any],
    outcomes: dict[str, tuple[dict[str, Any], dict[str, Any] | None]],
    replica: str,
) -> tuple[int, int, int, list[str]]:
    """(lost, duplicated, phantom, explanations) of one replica's state against the history."""
    seen: dict[str, int] = state["seen"]
    lost = duplicated = phantom = 0
    notes = []
    for op_id, (inv, done) in outcomes.items():
        if inv["op"] == "read":
            continue
        times = seen.get(op_id, 0)
        kind = "unknown" if done is None or done["type"] == "info" else done["type"]
        swapped = done is not None and done.get("result") is True
        took_effect = kind == "ok" and (inv["op"] != "cas" or swapped)
        where = f"{replica}: {inv['process']} {inv['op']}({inv['key']}, {inv['arg']!r}) id {op_id}"
        if times > 1:
            duplicated += 1
            notes.append(f"{where}: {kind}, applied {times} times")
        elif took_effect and times == 0:
            lost += 1
            notes.append(f"{where}: acknowledged ({done}), never applied")
        elif kind in ("fail", "ok") and not took_effect and times:
            phantom += 1
            notes.append(f"{where}: answered {done}, yet applied")
    for op_id in seen.keys() - outcomes.keys():
        phantom += 1
        notes.append(f"{replica}: op id {op_id} applied but never invoked")
    return lost, duplicated, phantom, notes


def _check_linearizable(
    history: list[Operation], applied: dict[str, int], timeout_s: float
) -> tuple[str, list[str]]:
    # An unknown-outcome write that the (agreed) final state never applied had no effect.
    resolved = [
        op
        for op in history
        if not (op.ret is None and op.op != "read" and not applied.get(op.op_id))
    ]
    verdicts = []
    problems = []
    parts: list[tuple[str, list[Operation], Any]] = [
        ("counter", [op for op in resolved if op.key == COUNTER], CounterModel()),
        ("registers", [op for op in resolved if op.key != COUNTER], RegisterModel()),
    ]
    for what, ops, model in parts:
        result: CheckResult = check(ops, model, timeout_s=timeout_s)
        if result.ok:
            verdicts.append("yes")
        elif result.timed_out:
            verdicts.append("unknown")
            problems.append(f"linearizability of the {what} unknown: {result.explanation}")
        else:
            verdicts.append("NO")
            problems.append(f"the {what} history is not linearizable:\n{result.explanation}")
    verdict = "yes" if all(v == "yes" for v in verdicts) else "/".join(verdicts)
    return verdict, problems


def run_chaos(
    minutes: float,
    *,
    writers: int = 4,
    seed: int | None = None,
    takeover_s: float = 2.0,
    fault_interval_s: tuple[float, float] = (2.0, 8.0),
    run_dir: Path | None = None,
    env: dict[str, str] | None = None,
    log: Callable[[str], None] = print,
) -> Summary:
    """Run the chaos workload for ``minutes`` and check it; see the module's doc."""
    env = {**os.environ, **(env or {})}
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    broker = Broker(env)
    service_url, admin_url = broker.urls()
    named = env.get("PULSAR_SERVICE_URL")
    if named and named != service_url:
        raise RunError(
            f"PULSAR_SERVICE_URL={named} but scripts/pulsar-standalone (PULSAR_HOME, ports) runs "
            f"{service_url}: the chaos run kills and restarts that one, so it must be the same"
        )
    run = run_dir or Path(tempfile.mkdtemp(prefix="chaos-"))
    run.mkdir(parents=True, exist_ok=True)
    topic = f"persistent://public/default/chaos-{uuid.uuid4().hex[:8]}"
    log(f"chaos: seed {seed}, topic {topic}, {writers} writers, histories in {run}")
    base_argv = [sys.executable, "-m", "benchmarks.chaos", "--child"]
    base_argv += ["--url", service_url, "--admin", admin_url, "--topic", topic]
    base_argv += ["--takeover", str(takeover_s)]
    summary = Summary(minutes=minutes)
    group = Writers(run, base_argv, writers, seed)
    try:
        group.wait_events("open", _OPEN_TIMEOUT_S)
        deadline = time.monotonic() + minutes * 60
        schedule = list(FAULT_KINDS)
        rng.shuffle(schedule)
        next_fault = time.monotonic() + rng.uniform(*fault_interval_s)
        # The first three faults (one of each kind) are injected even past the deadline: a
        # broker restart can take a short run's whole minute.
        while time.monotonic() < deadline or schedule:
            for failure in group.check_alive():
                summary.writer_failures += 1
                summary.problems.append(f"a writer failed: {failure}")
                log(f"chaos: writer failed: {failure}")
            if time.monotonic() >= next_fault:
                kind = schedule.pop(0) if schedule else rng.choices(FAULT_KINDS, _FAULT_WEIGHTS)[0]
                what = _inject(kind, rng, group, broker, takeover_s)
                summary.faults[kind] += 1
                log(f"chaos: {time.monotonic() - deadline + minutes * 60:6.1f}s {kind}: {what}")
                next_fault = time.monotonic() + rng.uniform(*fault_interval_s)
            time.sleep(0.2)
        (run / "stop").touch()
        group.wait_events("stopped", _PHASE_TIMEOUT_S)
        (run / "verify").touch()
        group.wait_events("reported", _PHASE_TIMEOUT_S)
        for proc in group.procs.values():
            proc.wait(60)
        _run_replicas(run, base_argv, 2)
    finally:
        group.kill_all()
    _check(run, group.all_names, summary)
    if summary.ok and run_dir is None:
        shutil.rmtree(run, ignore_errors=True)
    return summary


def _check(run: Path, names: list[str], summary: Summary) -> None:
    reports = [json.loads(path.read_text()) for path in sorted(run.glob("replica-*.json"))]
    summary.replicas = len(reports)
    summary.takeovers = sum(r["fencings"] for r in reports)
    summary.relayed = sum(r.get("relayed", 0) for r in reports)
    positions = {r["position"] for r in reports}
    digests = {r["digest"] for r in reports}
    summary.position = max(positions, default=0)
    summary.digests_agree = len(positions) == 1 and len(digests) == 1
    if not summary.digests_agree:
        listing = ", ".join(f"{r['name']}@{r['position']}:{r['digest'][:12]}" for r in reports)
        summary.problems.append(f"replicas disagree: {listing}")
    paths = [run / f"history-{name}.jsonl" for name in names]
    paths = [path for path in paths if path.exists()]
    outcomes = _raw_outcomes(paths)
    for inv, done in outcomes.values():
        kind = "unknown" if done is None or done["type"] == "info" else done["type"]
        if kind == "ok":
            if inv["op"] == "read":
                summary.acked_reads += 1
            else:
                summary.acked_writes += 1
        elif kind == "unknown" and inv["op"] != "read":
            summary.unknown += 1
        elif kind == "fail":
            summary.failed += 1
    for report in reports:
        lost, duplicated, phantom, notes = _check_exactly_once(
            report["state"], outcomes, report["name"]
        )
        summary.lost = max(summary.lost, lost)
        summary.duplicated = max(summary.duplicated, duplicated)
        summary.phantom = max(summary.phantom, phantom)
        summary.problems.extend(notes[:20])
    history = load_history(paths)
    applied = reports[0]["state"]["seen"] if reports else {}
    # A generous budget: these histories are long but have little concurrency.
    summary.linearizable, problems = _check_linearizable(
        history, applied, timeout_s=max(120.0, 60.0 * summary.minutes)
    )
    summary.problems.extend(problems)


@contextlib.contextmanager
def _interrupt_as_exit() -> Iterator[None]:
    try:
        yield
    except KeyboardInterrupt:
        print("chaos: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "--child":
        _child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        prog="scripts/chaos", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--minutes", type=float, required=True, help="how long to inject faults")
    parser.add_argument("--writers", type=int, default=4, help="writer processes (default 4)")
    parser.add_argument("--seed", type=int, default=None, help="the fault driver's seed")
    parser.add_argument(
        "--takeover", type=float, default=2.0, help="the writers' takeover_after_s (default 2)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="keep the histories here")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.writers < 2:
        parser.error("--minutes must be positive and --writers at least 2")
    with _interrupt_as_exit():
        try:
            summary = run_chaos(
                args.minutes,
                writers=args.writers,
                seed=args.seed,
                takeover_s=args.takeover,
                run_dir=args.dir,
            )
        except RunError as exc:
            print(f"chaos: the run could not be done: {exc}", file=sys.stderr)
            return 2
    for problem in summary.problems:
        print(problem, file=sys.stderr)
    print(summary.line())
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
