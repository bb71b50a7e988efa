"""Processes using the library exit cleanly (issue 11a), and what the client logs still shows.

A crash at interpreter exit (SIGABRT, ``terminate called without an active exception``, or
SIGSEGV) happened in a few percent of processes; ``scripts/exit-loop`` measures it over 200.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks.exit_crashes import MODES, run_many
from pulsar_state import ClosedError
from pulsar_state._pulsar import PulsarConnection
from tests.support.broker import Broker

PROCESSES = 60

# A program's tail: a blocking manager opened, written to and left open for the exit hooks.
LEFT_OPEN = textwrap.dedent(
    """
    from pulsar_state import SyncSharedStateManager

    def apply(state, op):
        state.update(op)

    manager = SyncSharedStateManager(
        sys.argv[1], sys.argv[2], initial_state=dict, apply=apply, admin_url=sys.argv[3]
    )
    manager.open()
    manager.write(lambda s: [{"k": 1}])
    """
)


def run_leaving_a_manager_open(
    program: str, broker: Broker, topic: str
) -> subprocess.CompletedProcess[str]:
    """Run ``program`` (which imports sys) followed by :data:`LEFT_OPEN`, in a new process."""
    return subprocess.run(
        [sys.executable, "-c", program + LEFT_OPEN, broker.service_url, topic, broker.admin_url],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_short_lived_processes_exit_cleanly(broker: Broker) -> None:
    # Each process opens a manager and a map, writes, reads, then closes them or leaves them
    # open for the atexit hooks (see benchmarks/exit_crashes.py for the modes), and exits.
    results = run_many(PROCESSES, broker.service_url, broker.admin_url, parallel=4)
    failed = [(mode, code, err) for mode, code, err in results if code != 0]
    assert {mode for mode, _, _ in results} == set(MODES)
    summary = "\n".join(f"--- {mode} exited {code}:\n{err[-600:]}" for mode, code, err in failed)
    assert not failed, f"{len(failed)}/{PROCESSES} processes failed:\n{summary}"


def test_blocking_facades_left_open_are_closed_and_their_portals_stopped_at_exit(
    broker: Broker, topic: str
) -> None:
    # A portal's daemon thread still running when the interpreter finalizes can be inside the
    # Pulsar client then, and the process aborts (1 in 400 processes, scripts/exit-loop
    # --modes sync-unclosed). At exit the facades left open must be closed and the portal
    # threads stopped before the interpreter finalizes. The hook registered first runs last.
    program = textwrap.dedent(
        """
        import atexit, sys, threading

        def last_hook():
            alive = [t.name for t in threading.enumerate() if "portal" in t.name]
            sys.stderr.write(f"PORTALS {alive} CLOSED {manager.manager.closed}\\n")

        atexit.register(last_hook)
        """
    )
    done = run_leaving_a_manager_open(program, broker, topic)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PORTALS [] CLOSED True" in done.stderr, done.stderr[-2000:]


def test_a_manager_closed_by_the_exit_hooks_closes_everything(broker: Broker, topic: str) -> None:
    # At exit the default executor refuses work; the admin client's close used it, raised,
    # and the rest of the manager's close (its Pulsar client) was skipped, with a warning for
    # a map or membership cached by recipes.spark (closed by its own exit hook).
    program = textwrap.dedent(
        """
        import logging, sys
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
        logging.getLogger("pulsar_state.client").setLevel(logging.WARNING)
        """
    )
    done = run_leaving_a_manager_open(program, broker, topic)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left open at exit" not in done.stderr, done.stderr[-2000:]
    assert "after shutdown" not in done.stderr, done.stderr[-2000:]


def test_completion_after_the_event_loop_closed_does_not_abort(broker: Broker) -> None:
    # asyncio.run returned while a pulsar.asyncio operation was in flight (in the library: the
    # idle release of a manager left open); the operation completes when the client closes, and
    # its callback finds the loop closed. Without the guard: SIGABRT (pybind11 error_already_set).
    program = textwrap.dedent(
        """
        import asyncio, sys
        import pulsar, pulsar.asyncio
        import pulsar_state

        async def main():
            client = pulsar.asyncio.Client(
                sys.argv[1], logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)
            )
            reader = await client.create_reader(sys.argv[2], pulsar.MessageId.latest)
            asyncio.ensure_future(reader.read_next())  # nothing to read: stays pending
            await asyncio.sleep(0.2)
            return client, reader

        client, reader = asyncio.run(main())
        client._client.close()  # fails the pending read
        print("survived")
        """
    )
    topic = f"persistent://public/default/test-closed-loop-{os.urandom(4).hex()}"
    done = subprocess.run(
        [sys.executable, "-c", program, broker.service_url, topic],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "survived" in done.stdout


def test_a_manager_left_open_after_its_loop_is_collected_without_abort(broker: Broker) -> None:
    # A manager opened in asyncio.run and dropped unclosed after it: collecting it destroys
    # its client's consumers. The write relay's consumer once had an async receive pending
    # then, and the garbage collector aborted the process (std::bad_weak_ptr).
    program = textwrap.dedent(
        """
        import asyncio, gc, sys
        import pulsar_state

        async def main():
            manager = pulsar_state.SharedStateManager(
                sys.argv[1], sys.argv[2], initial_state=dict, apply=lambda s, op: None,
                check_topic=False,
            )
            await manager.open()
            await manager.write(lambda s: [{"k": 1}])
            await asyncio.sleep(0.3)  # the relay is open
            return manager

        manager = asyncio.run(main())
        del manager
        gc.collect()
        asyncio.run(asyncio.sleep(0.5))
        gc.collect()
        print("survived")
        """
    )
    topic = f"persistent://public/default/test-left-open-{os.urandom(4).hex()}"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", program, broker.service_url, topic],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "survived" in done.stdout


def test_client_log_reaches_python_logging_not_stdout(broker: Broker, topic: str) -> None:
    # In a process of its own: the C++ client keeps the logger of the process's first client.
    program = textwrap.dedent(
        """
        import asyncio, logging, sys, time
        from pulsar_state._pulsar import PulsarConnection

        records = []
        handler = logging.Handler()
        handler.emit = records.append
        client_log = logging.getLogger("pulsar_state.client")
        client_log.addHandler(handler)
        client_log.setLevel(logging.INFO)

        async def main():
            conn = PulsarConnection(sys.argv[1])
            reader = await conn.create_reader(sys.argv[2])
            await reader.close()
            await conn.close()

        asyncio.run(main())
        deadline = time.monotonic() + 10  # the pipe is read by a thread of its own
        while time.monotonic() < deadline and not any(
            "Connected to broker" in r.getMessage() for r in records
        ):
            time.sleep(0.05)
        found = [r for r in records if "Connected to broker" in r.getMessage()]
        sys.stderr.write(f"FORWARDED {len(found)} {found[0].levelname if found else None}\\n")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program, broker.service_url, topic],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FORWARDED 1 INFO" in done.stderr, done.stderr[-2000:]
    assert done.stdout == ""


def test_client_used_across_fork_fails_clearly(broker: Broker, topic: str) -> None:
    async def open_in_parent() -> PulsarConnection:
        return PulsarConnection(broker.service_url)

    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(open_in_parent())
    try:
        pid = os.fork()
        if pid == 0:  # the child: a clear error, at once, rather than a hang or a crash
            code = 3
            try:
                asyncio.run(asyncio.wait_for(conn.create_reader(topic), 10))
            except ClosedError as exc:
                code = 0 if "fork" in str(exc) else 4
            except BaseException:
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        loop.run_until_complete(conn.close())
        loop.close()
