"""Processes using the library exit cleanly (issue 11a), and what the client logs still shows.

A crash at interpreter exit (SIGABRT, ``terminate called without an active exception``, or
SIGSEGV) happened in a few percent of processes; ``scripts/exit-loop`` measures it over 200.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks.exit_crashes import MODES, run_many
from pulsar_state import ClosedError
from pulsar_state._pulsar import PulsarConnection
from tests.support.broker import Broker

PROCESSES = 60


@pytest.mark.slow
def test_short_lived_processes_exit_cleanly(broker: Broker) -> None:
    # Each process opens a manager and a map, writes, reads, then closes them or leaves them
    # open for the atexit hooks (see benchmarks/exit_crashes.py for the modes), and exits.
    results = run_many(PROCESSES, broker.service_url, broker.admin_url, parallel=4)
    failed = [(mode, code, err) for mode, code, err in results if code != 0]
    assert {mode for mode, _, _ in results} == set(MODES)
    summary = "\n".join(f"--- {mode} exited {code}:\n{err[-600:]}" for mode, code, err in failed)
    assert not failed, f"{len(failed)}/{PROCESSES} processes failed:\n{summary}"


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


def test_client_log_reaches_python_logging_not_stdout(
    broker: Broker, topic: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    async def connect_and_read() -> None:
        conn = PulsarConnection(broker.service_url)
        reader = await conn.create_reader(topic)
        await reader.close()
        await conn.close()

    with caplog.at_level(logging.INFO, logger="pulsar_state.client"):
        asyncio.run(connect_and_read())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
            "Connected to broker" in r.getMessage() for r in caplog.records
        ):
            time.sleep(0.05)  # the pipe is read by a thread of its own
    assert any(
        r.name == "pulsar_state.client" and "Connected to broker" in r.getMessage()
        for r in caplog.records
    )
    assert "Connected to broker" not in capfd.readouterr().out


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
