"""The pulsar-state command, run as users run it (the installed console script, in a
subprocess) against the real broker: exit codes, stdout JSON, one-line errors on stderr."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import http.server
import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from pulsar_state import JsonCodec, PulsarStateError
from pulsar_state._envelope import Record, Write, encode_manifest, encode_record
from pulsar_state.testing import Broker, admin_request
from tests.core.helpers import counter_manager, incr, raw_producer

COMMAND = Path(sys.executable).with_name("pulsar-state")


def pulsar_state(
    broker: Broker, topic: str | None, *args: str, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = cli_env(broker)
    env.pop("PULSAR_STATE_TOPIC", None)
    topic_args = ["-t", topic] if topic else []
    return subprocess.run(
        [str(COMMAND), *topic_args, *args],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_env(broker: Broker, **more: str) -> dict[str, str]:
    """The environment the command runs in."""
    env = {**os.environ, "PULSAR_SERVICE_URL": broker.service_url}
    env["PULSAR_ADMIN_URL"] = broker.admin_url
    return {**env, **more}


def started(broker: Broker, topic: str, *args: str) -> subprocess.Popen[str]:
    """The command running on ``topic``, its stdout and stderr pipes to read."""
    return subprocess.Popen(
        [str(COMMAND), "-t", topic, *args],
        env=cli_env(broker),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    return result.stdout


def one_error_line(result: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The command failed with ``code`` and said why in one line, with no traceback."""
    assert result.returncode == code, f"exit {result.returncode}: {result.stdout}{result.stderr}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pulsar-state: "), lines
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def log_records(broker: Broker, topic: str) -> list[dict[str, Any]]:
    out = ok(pulsar_state(broker, topic, "-o", "json", "log", "--ops", "map"))
    return [json.loads(line) for line in out.splitlines()]


def test_put_get_ls_del(broker: Broker, topic: str) -> None:
    put = json.loads(ok(pulsar_state(broker, topic, "-o", "json", "put", "a", '{"x": 1}')))
    assert put["key"] == "a"
    assert put["position"] == 1
    version = put["version"]  # a MapVersion: what replace_version takes
    assert ok(pulsar_state(broker, topic, "put", "ab", "[1, 2]")).endswith("(position 2)\n")
    ok(pulsar_state(broker, topic, "put", "b", '"text"'))

    got = json.loads(ok(pulsar_state(broker, topic, "-w", "json", "get", "a")))
    assert got == {"key": "a", "value": {"x": 1}, "version": version, "position": 1}
    assert ok(pulsar_state(broker, topic, "get", "b")) == "text\n"
    assert ok(pulsar_state(broker, topic, "get", "ab")) == "[1, 2]\n"

    assert ok(pulsar_state(broker, topic, "ls")) == "a\nab\nb\n"
    assert json.loads(ok(pulsar_state(broker, topic, "-o", "json", "ls", "--prefix", "a"))) == [
        "a",
        "ab",
    ]

    deleted = json.loads(ok(pulsar_state(broker, topic, "-o", "json", "del", "a")))
    assert deleted["deleted"] is True
    one_error_line(pulsar_state(broker, topic, "get", "a"), 1, "absent")
    one_error_line(pulsar_state(broker, topic, "del", "a"), 1, "absent")
    assert json.loads(ok(pulsar_state(broker, topic, "-o", "json", "ls"))) == ["ab", "b"]


def test_bad_input_exits_2_and_writes_nothing(broker: Broker, topic: str) -> None:
    ok(pulsar_state(broker, topic, "put", "k", "1"))
    one_error_line(pulsar_state(broker, topic, "put", "k", "not json"), 2, "not JSON")
    one_error_line(
        pulsar_state(broker, topic, "--value-codec", "bytes", "put", "k", "%%%"), 2, "base64"
    )
    one_error_line(pulsar_state(broker, None, "get", "k"), 2, "no topic")
    assert pulsar_state(broker, topic, "-o", "yaml", "ls").returncode == 2  # click's usage error
    assert len(log_records(broker, topic)) == 1


def test_codecs_by_flags(broker: Broker, topic: str) -> None:
    raw = bytes(range(256))
    encoded = base64.b64encode(raw).decode()
    key = base64.b64encode(b"\x00key").decode()
    codecs = ["--key-codec", "bytes", "--value-codec", "bytes"]
    ok(pulsar_state(broker, topic, *codecs, "put", key, encoded))
    assert ok(pulsar_state(broker, topic, *codecs, "get", key)) == encoded + "\n"
    got = json.loads(ok(pulsar_state(broker, topic, *codecs, "-o", "json", "get", key)))
    assert got["key"] == key
    assert got["value"] == encoded


def test_str_codec_takes_text_as_is(broker: Broker, topic: str) -> None:
    ok(pulsar_state(broker, topic, "--value-codec", "str", "put", "greeting", "hello world"))
    assert ok(pulsar_state(broker, topic, "--value-codec", "str", "get", "greeting")) == (
        "hello world\n"
    )
    # Read with the wrong codec: the library's own error, one line, exit 3.
    one_error_line(
        pulsar_state(broker, topic, "get", "greeting"), 3, "ReplicaHaltedError", "cannot decode"
    )


def test_dump_and_load_restore_atomically(broker: Broker, topic: str) -> None:
    for key, value in [("a", "1"), ("b", '{"deep": [1]}'), ("c", '"x"')]:
        ok(pulsar_state(broker, topic, "put", key, value))
    dumped = ok(pulsar_state(broker, topic, "dump"))
    lines = [json.loads(line) for line in dumped.splitlines()]
    assert [(d["key"], d["value"]) for d in lines] == [("a", 1), ("b", {"deep": [1]}), ("c", "x")]

    restored = topic + "-restored"
    ok(pulsar_state(broker, restored, "put", "stale", "0"))
    result = json.loads(
        ok(pulsar_state(broker, restored, "-o", "json", "load", "--replace", stdin=dumped))
    )
    assert result["loaded"] == 3
    again = [json.loads(line) for line in ok(pulsar_state(broker, restored, "dump")).splitlines()]
    assert [(d["key"], d["value"]) for d in again] == [(d["key"], d["value"]) for d in lines]
    # One record for the whole restore: the stale key's delete and the three puts together.
    records = log_records(broker, restored)
    assert len(records) == 2
    assert sorted(op["op"] for op in records[1]["writes"][0]) == ["DELETE", "PUT", "PUT", "PUT"]


def test_load_in_chunks_and_refuses_bad_files(broker: Broker, topic: str, tmp_path: Path) -> None:
    entries = [{"key": f"k{i}", "value": i} for i in range(5)]
    source = tmp_path / "entries.jsonl"
    source.write_text("".join(json.dumps(e) + "\n" for e in entries))
    result = pulsar_state(broker, topic, "load", "--chunk", "2", str(source))
    assert ok(result) == "OK loaded 5 entries, position 3\n"
    assert "loaded 5/5 entries" in result.stderr
    assert [len(r["writes"][0]) for r in log_records(broker, topic)] == [2, 2, 1]

    # A bad line anywhere: nothing is written, and the line is named.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "x", "value": 1}\n{"key": "y"}\n')
    one_error_line(pulsar_state(broker, topic, "load", str(bad)), 2, "line 2")
    bad.write_text('{"key": "x", "value": 1}\n{"key": "x", "value": 2}\n')
    one_error_line(pulsar_state(broker, topic, "load", str(bad)), 2, "twice")
    assert len(log_records(broker, topic)) == 3


def test_load_too_large_for_one_record_fails_whole_then_chunks(broker: Broker, topic: str) -> None:
    value = "v" * 1000
    lines = "".join(json.dumps({"key": f"k{i:05d}", "value": value}) + "\n" for i in range(1500))
    one_error_line(pulsar_state(broker, topic, "load", stdin=lines), 3, "RecordTooLargeError")
    assert log_records(broker, topic) == []  # never half-applied
    ok(pulsar_state(broker, topic, "load", "--chunk", "500", stdin=lines))
    assert len(json.loads(ok(pulsar_state(broker, topic, "-o", "json", "ls")))) == 1500


def test_log_shows_writer_time_and_ops(broker: Broker, topic: str) -> None:
    ok(pulsar_state(broker, topic, "put", "a", "1"))
    ok(pulsar_state(broker, topic, "del", "a"))
    records = log_records(broker, topic)
    assert [r["position"] for r in records] == [1, 2]
    assert records[0]["writes"] == [[{"op": "PUT", "key": "a", "value": 1}]]
    assert records[1]["writes"] == [[{"op": "DELETE", "key": "a"}]]
    assert all(r["writer"].startswith("pulsar-state-cli-") for r in records)
    assert all(r["time"].endswith("+00:00") for r in records)
    # Raw: the op bytes, base64, for any manager's topic.
    raw = [
        json.loads(line)
        for line in ok(pulsar_state(broker, topic, "-o", "json", "log")).splitlines()
    ]
    assert all(isinstance(op, str) for r in raw for write in r["writes"] for op in write)
    text = ok(pulsar_state(broker, topic, "log", "--limit", "1")).splitlines()
    assert len(text) == 1
    assert text[0].startswith("1\t")


async def test_status_and_snapshot_list(broker: Broker, topic: str) -> None:
    # The writer stays held while idle (idle_release_s), so status can name its holder.
    async with counter_manager(
        broker.service_url,
        topic,
        broker.admin_url,
        snapshot_codec=JsonCodec(),
        idle_release_s=120.0,
        max_hold_s=120.0,
    ) as manager:
        for _ in range(3):
            await manager.write(lambda state: [incr()])
        manifest = await manager.snapshot()
        status = json.loads(ok(pulsar_state(broker, topic, "-o", "json", "status")))
    assert status["position"] == 3
    assert status["records"] == 3
    assert status["records_rejected"] == 0
    assert status["policies"] == "ok"
    assert status["tail"] is not None
    [writer] = status["writer"]
    assert writer["address"]
    assert writer["connectedSince"]
    snapshots = json.loads(ok(pulsar_state(broker, topic, "-o", "json", "snapshot", "list")))
    assert [s["snapshot_id"] for s in snapshots] == [manifest.snapshot_id]
    assert snapshots[0]["position"] == 3

    verified = json.loads(ok(pulsar_state(broker, topic, "-o", "json", "snapshot", "verify")))
    assert verified["snapshot_id"] == manifest.snapshot_id
    assert verified["ok"] is True
    one_error_line(pulsar_state(broker, topic, "snapshot", "verify", "0" * 32), 2, "no snapshot")

    one_error_line(pulsar_state(broker, topic + "-nothing", "status"), 2, "does not exist")
    assert (
        json.loads(ok(pulsar_state(broker, topic + "-x", "-o", "json", "snapshot", "list"))) == []
    )


def test_doctor_passes_then_names_the_fix(broker: Broker, topic: str) -> None:
    checks = ok(pulsar_state(broker, None, "-o", "json", "doctor")).splitlines()
    assert checks
    assert all(json.loads(c)["ok"] for c in checks)

    ok(pulsar_state(broker, topic, "put", "k", "1"))
    local = topic.split("/")[-1]
    policy = {"retentionTimeInMinutes": 60, "retentionSizeInMB": 100}
    path = f"/admin/v2/persistent/public/default/{local}/retention"
    admin_request(broker.admin_url, "POST", path, policy)
    for _ in range(100):  # topic policies apply through a system topic, a moment later
        if admin_request(broker.admin_url, "GET", path + "?applied=true") == policy:
            break
        time.sleep(0.1)
    result = pulsar_state(broker, topic, "doctor")
    assert result.returncode == 4, result.stdout + result.stderr
    failing = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failing) == 1
    assert "set-retention" in failing[0]
    assert pulsar_state(broker, topic, "status").returncode == 4


def test_unreachable_broker_is_one_line_exit_3(broker: Broker, topic: str) -> None:
    result = subprocess.run(
        [
            str(COMMAND),
            "--service-url",
            "pulsar://127.0.0.1:9",
            "--admin-url",
            "http://127.0.0.1:9",
            "--timeout",
            "3",
            "-t",
            topic,
            "get",
            "k",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_error_line(result, 3)


def test_watch_prints_json_lines_and_ends_on_ctrl_c(broker: Broker, topic: str) -> None:
    ok(pulsar_state(broker, topic, "put", "a", "1"))
    watcher = started(broker, topic, "watch")
    try:
        assert watcher.stdout is not None
        first = json.loads(watcher.stdout.readline())
        assert first == {"kind": "put", "key": "a", "value": 1, "position": 1, "initial": True}
        ok(pulsar_state(broker, topic, "put", "b", "2"))
        second = json.loads(watcher.stdout.readline())
        assert second == {"kind": "put", "key": "b", "value": 2, "position": 2, "initial": False}
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=60) == 0
        assert watcher.stderr is not None
        assert "Traceback" not in watcher.stderr.read()
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()


def test_watch_resumes_from_a_position(broker: Broker, topic: str) -> None:
    for args in (("put", "a", "1"), ("put", "b", "2"), ("del", "a"), ("put", "c", "3")):
        ok(pulsar_state(broker, topic, *args))  # positions 1 to 4
    watcher = started(broker, topic, "watch", "--from", "2")
    try:
        assert watcher.stdout is not None
        got = [json.loads(watcher.stdout.readline()) for _ in range(2)]
        assert got == [
            {"kind": "delete", "key": "a", "value": None, "position": 3, "initial": False},
            {"kind": "put", "key": "c", "value": 3, "position": 4, "initial": False},
        ]
        ok(pulsar_state(broker, topic, "put", "d", "4"))  # then live changes
        assert json.loads(watcher.stdout.readline())["position"] == 5
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=60) == 0
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    refused = pulsar_state(broker, topic, "watch", "--from", "-1")
    assert refused.returncode == 2
    assert "--from" in refused.stderr


def test_snapshot_take_of_a_map(broker: Broker, topic: str) -> None:
    ok(pulsar_state(broker, topic, "put", "a", "1"))
    ok(pulsar_state(broker, topic, "put", "b", "2"))
    taken = json.loads(ok(pulsar_state(broker, topic, "-o", "json", "snapshot", "take")))
    assert taken == {"position": 2}
    [listed] = json.loads(ok(pulsar_state(broker, topic, "-o", "json", "snapshot", "list")))
    assert listed["position"] == 2
    assert json.loads(ok(pulsar_state(broker, topic, "-o", "json", "snapshot", "verify")))["ok"]
    # A map opened from the snapshot still reads every entry.
    assert json.loads(ok(pulsar_state(broker, topic, "-o", "json", "ls"))) == ["a", "b"]


@pytest.mark.parametrize("command", ["get", "put", "del", "ls", "dump", "load", "log", "status",
                                     "doctor", "watch", "snapshot"])  # fmt: skip
def test_every_command_has_help(command: str) -> None:
    result = subprocess.run(
        [str(COMMAND), command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert "Usage: pulsar-state" in result.stdout


def test_avro_values_by_schema_file(broker: Broker, topic: str, tmp_path: Path) -> None:
    schema = tmp_path / "job.avsc"
    schema.write_text(
        json.dumps(
            {
                "type": "record",
                "name": "Job",
                "fields": [{"name": "name", "type": "string"}, {"name": "tries", "type": "int"}],
            }
        )
    )
    avro = ["--value-schema", str(schema)]
    ok(pulsar_state(broker, topic, *avro, "put", "j1", '{"name": "build", "tries": 2}'))
    got = json.loads(ok(pulsar_state(broker, topic, *avro, "-o", "json", "get", "j1")))
    assert got["value"] == {"name": "build", "tries": 2}
    # A value the schema refuses: the library's CodecError, exit 2, nothing written.
    bad = pulsar_state(broker, topic, *avro, "put", "j2", '{"name": 1}')
    one_error_line(bad, 2, "Error")
    raw = ok(pulsar_state(broker, topic, "log")).splitlines()
    assert len(raw) == 1
    # The map's ops with the wrong codec: exit 3 and a hint, not a traceback.
    one_error_line(pulsar_state(broker, topic, "log", "--ops", "map"), 3, "--value-codec")
    logged = ok(pulsar_state(broker, topic, *avro, "-o", "json", "log", "--ops", "map"))
    assert json.loads(logged)["writes"] == [
        [{"op": "PUT", "key": "j1", "value": {"name": "build", "tries": 2}}]
    ]


def test_a_replay_shows_progress_on_a_terminal_only(
    broker: Broker, topic: str, tmp_path: Path
) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"key": f"k{i}", "value": i}) + "\n" for i in range(30)))
    ok(pulsar_state(broker, topic, "load", "--chunk", "1", str(source)))  # 30 records
    piped = pulsar_state(broker, topic, "ls")
    assert "replay" not in ok(piped) + piped.stderr  # a script's stderr stays clean
    # stderr on a terminal: the bar (rich) while replaying, then one line.
    primary, secondary = pty.openpty()
    env = cli_env(broker)
    try:
        done = subprocess.run(
            [str(COMMAND), "-t", topic, "ls"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=secondary,
            text=True,
            timeout=120,
        )
        os.close(secondary)
        shown = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(primary)
    assert done.returncode == 0
    assert len(done.stdout.splitlines()) == 30
    assert "replayed 30 records" in shown.decode(errors="replace")


def test_every_kind_of_bad_input_is_one_line_exit_2_and_writes_nothing(
    broker: Broker, topic: str, tmp_path: Path
) -> None:
    # Before: each of these was a traceback with exit 1 ("absent"), or (a value the codec
    # refuses in a later chunk) exit 2 after the first chunks were written.
    ok(pulsar_state(broker, topic, "put", "seed", "1"))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"key": "caf\u00e9", "value": 1}\n'.encode("latin-1"))
    one_error_line(pulsar_state(broker, topic, "load", str(latin)), 2, "not UTF-8")
    schema = tmp_path / "schema.avsc"
    schema.write_bytes(b'{"type": "string", "doc": "\xe9"}')
    one_error_line(
        pulsar_state(broker, topic, "--value-schema", str(schema), "get", "k"), 2, "not JSON"
    )
    json_keys = ["--key-codec", "json"]
    one_error_line(
        pulsar_state(broker, topic, *json_keys, "load", stdin='{"key": [1], "value": 1}\n'),
        2,
        "not a string or an integer",
    )
    one_error_line(pulsar_state(broker, topic, *json_keys, "get", "[1]"), 2, "not a string")
    one_error_line(pulsar_state(broker, topic, *json_keys, "put", "true", "1"), 2, "not a string")
    late = '{"key": "a", "value": 1}\n{"key": "b", "value": NaN}\n'
    one_error_line(pulsar_state(broker, topic, "load", "--chunk", "1", stdin=late), 2, "CodecError")
    for seconds in ("0", "-1", "nan"):
        result = pulsar_state(broker, topic, "--timeout", seconds, "get", "seed")
        assert result.returncode == 2, (seconds, result.stderr)
        assert "Traceback" not in result.stderr
    assert len(log_records(broker, topic)) == 1


def test_a_chunked_load_that_fails_names_what_it_loaded_and_deletes_nothing(
    broker: Broker, topic: str
) -> None:
    ok(pulsar_state(broker, topic, "put", "stale", "0"))
    lines = "".join(
        json.dumps({"key": key, "value": value}) + "\n"
        for key, value in [("a", 1), ("b", 2), ("huge", "v" * (2 * 1024 * 1024))]
    )
    # Before: a traceback (the error was re-raised as its own type without the fields its
    # constructor needs), and --replace had deleted "stale" before the first chunk.
    result = pulsar_state(broker, topic, "load", "--chunk", "2", "--replace", stdin=lines)
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    *progress, line = result.stderr.splitlines()
    assert progress == ["loaded 2/3 entries"]
    for words in ["RecordTooLargeError", "chunk 2 failed", "entries 1-2 were loaded"]:
        assert words in line, line
    assert "no key was deleted" in line
    listed = json.loads(ok(pulsar_state(broker, topic, "-o", "json", "ls")))
    assert sorted(listed) == ["a", "b", "stale"]


def test_a_lone_surrogate_is_shown_as_its_escape(broker: Broker, topic: str) -> None:
    # JSON can carry one (another program may write it): before, printing it raised
    # UnicodeEncodeError (a traceback, and a dump that stopped half-way).
    ok(pulsar_state(broker, topic, "put", "k", '"a\\ud800"'))
    assert ok(pulsar_state(broker, topic, "get", "k")) == "a\\ud800\n"
    dumped = ok(pulsar_state(broker, topic, "dump"))
    assert json.loads(dumped)["value"] == "a\ud800"


def test_a_chunked_replace_deletes_many_keys_a_chunk_at_a_time(broker: Broker, topic: str) -> None:
    # Before: every other key was deleted in one write, over max_record_bytes past about
    # 35,000 keys, after every chunk had been loaded.
    many = "".join(json.dumps({"key": f"k{i:05d}", "value": 0}) + "\n" for i in range(40_000))
    ok(pulsar_state(broker, topic, "load", "--chunk", "10000", stdin=many))
    keep = json.dumps({"key": "kept", "value": 1}) + "\n"
    result = pulsar_state(broker, topic, "load", "--chunk", "10000", "--replace", stdin=keep)
    assert ok(result).startswith("OK loaded 1 entries")
    assert "deleted 40000/40000 other keys" in result.stderr
    assert json.loads(ok(pulsar_state(broker, topic, "-o", "json", "ls"))) == ["kept"]


def test_output_the_terminal_cannot_encode_is_escaped(broker: Broker, topic: str) -> None:
    ok(pulsar_state(broker, topic, "put", "price", '"10 \u20ac \U0001f600"'))
    env = {
        **os.environ,
        "PULSAR_SERVICE_URL": broker.service_url,
        "PULSAR_ADMIN_URL": broker.admin_url,
        "PYTHONIOENCODING": "latin-1",
    }
    result = subprocess.run(
        [str(COMMAND), "-t", topic, "get", "price"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"10 \\u20ac \\U0001f600\n"
    as_json = subprocess.run(
        [str(COMMAND), "-t", topic, "-o", "json", "get", "price"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert as_json.returncode == 0, as_json.stderr
    # Still JSON (a non-BMP character's backslash escape is not): JSON's own escapes.
    assert json.loads(as_json.stdout)["value"] == "10 \u20ac \U0001f600"


async def test_log_says_what_replicas_do_with_each_record(
    broker: Broker, topic: str, tmp_path: Path
) -> None:
    # Before: every record not accepted was "rejected" (harmless), though replicas halt on
    # a forked one, and a stale writer's pipelined chain showed as a fork-free rejection
    # only by chance; a log whose beginning was trimmed showed every record rejected.
    ok(pulsar_state(broker, topic, "put", "a", "1"))
    first_id = log_records(broker, topic)[0]["record_id"]
    op = JsonCodec().encode({"op": "incr"})
    async with raw_producer(broker.service_url, topic) as producer:
        for record in [
            Record("late", 1, 0, "", [Write(1, [op])]),  # stale: base 0, the log is at 1
            Record("late", 2, 1, "late/1", [Write(2, [op])]),  # its chain: stale too
            Record("late", 3, 2, "late/2", [Write(3, [op])]),  # ahead of the log: stale
            Record("other", 1, 1, first_id, [Write(1, [op])]),  # accepted at 2
            Record("late", 4, 3, "late/3", [Write(4, [op])]),  # the chain goes on: stale
            Record("elsewhere", 9, 7, "elsewhere/8", [Write(1, [op])]),  # forked
        ]:
            await producer.send(encode_record(record), partition_key=record.record_id)
    raw = [
        json.loads(line)
        for line in ok(pulsar_state(broker, topic, "-o", "json", "log")).splitlines()
    ]
    assert [(r["verdict"], r["position"]) for r in raw] == [
        ("accepted", 1),
        ("stale", None),
        ("stale", None),
        ("stale", None),
        ("accepted", 2),
        ("stale", None),
        ("forked", None),
    ]
    text = ok(pulsar_state(broker, topic, "log")).splitlines()
    verdicts = ["1", "stale", "stale", "stale", "2", "stale", "forked"]
    assert [line.split("\t")[0] for line in text] == verdicts


async def test_log_of_a_topic_whose_beginning_was_trimmed(broker: Broker, topic: str) -> None:
    from tests.core.test_trimming import trimmed_topic

    await trimmed_topic(broker.service_url, broker.admin_url, topic)
    raw = [
        json.loads(line)
        for line in ok(pulsar_state(broker, topic, "-o", "json", "log")).splitlines()
    ]
    assert raw
    assert {r["verdict"] for r in raw} == {"accepted"}  # before: none was
    positions = [r["position"] for r in raw]
    assert positions == list(range(positions[0], positions[0] + len(raw)))
    assert positions[-1] == 40
    told = pulsar_state(broker, topic, "log")
    assert f"trimmed (its first record is built on position {positions[0] - 1})" in told.stderr


async def test_snapshot_verify_tells_a_trimmed_snapshot_from_a_damaged_one(
    broker: Broker, topic: str
) -> None:
    from tests.core.test_trimming import trimming_manager, write_and_snapshot
    from tests.support.trimming import NO_RETENTION, TRIM_WAIT_S, ledgers, rest_path, set_policy

    chunks = f"{topic}-snapshots"
    await set_policy(broker.admin_url, topic, "retention", NO_RETENTION)
    await set_policy(broker.admin_url, chunks, "retention", NO_RETENTION)
    async with trimming_manager(broker.service_url, topic, broker.admin_url) as writer:
        await write_and_snapshot(writer, 3)
        first_ledger = ledgers(broker.admin_url, chunks)[0]
        admin_request(broker.admin_url, "PUT", rest_path(chunks) + "/unload")  # a new ledger
        await write_and_snapshot(writer, 3)
        newest = await writer.snapshot()  # keep 1: its chunk is not its ledger's first
        deadline = time.monotonic() + TRIM_WAIT_S
        while first_ledger in ledgers(broker.admin_url, chunks) and time.monotonic() < deadline:
            with contextlib.suppress(PulsarStateError):
                await writer._snapshots.trim()  # again: the unload may have raced the first
            with contextlib.suppress(OSError):
                admin_request(broker.admin_url, "POST", rest_path(chunks) + "/trim")
            await asyncio.sleep(0.2)
        assert first_ledger not in ledgers(broker.admin_url, chunks)
    results = [
        json.loads(line)
        for line in ok(pulsar_state(broker, topic, "-o", "json", "snapshot", "verify")).splitlines()
    ]
    assert [r["status"] for r in results] == ["trimmed", "ok", "ok"]
    assert results[-1]["snapshot_id"] == newest.snapshot_id
    text = ok(pulsar_state(broker, topic, "snapshot", "verify"))
    assert "trimmed" in text.splitlines()[0]
    alone = ok(
        pulsar_state(broker, topic, "-o", "json", "snapshot", "verify", results[0]["snapshot_id"])
    )
    assert json.loads(alone)["status"] == "trimmed"  # the newer ones are checked, not shown
    # Damaged ones still fail: a manifest whose chunks are not where it says, and the newest
    # one whose first chunk is gone (no newer snapshot checks out: not trimmed on purpose).
    misplaced = dataclasses.replace(newest, snapshot_id="e" * 32)
    gone = dataclasses.replace(
        newest,
        snapshot_id="d" * 32,
        position=newest.position + 100,
        first_chunk_ledger=first_ledger,
        first_chunk_entry=0,
    )
    async with raw_producer(broker.service_url, f"{topic}-snapshot-index") as producer:
        await producer.send(encode_manifest(misplaced))
        await producer.send(encode_manifest(gone))
    result = pulsar_state(broker, topic, "-o", "json", "snapshot", "verify")
    assert result.returncode == 3, result.stdout + result.stderr
    statuses = [json.loads(line)["status"] for line in result.stdout.splitlines()]
    assert statuses == ["trimmed", "ok", "ok", "failed", "failed"]
    assert "2 of 5 snapshots failed" in result.stderr


@pytest.mark.parametrize("chunk", [[], ["--chunk", "1"]], ids=["atomic", "chunked"])
def test_a_restore_never_lowers_a_fence_nor_deletes_protected_keys(
    broker: Broker, topic: str, chunk: list[str]
) -> None:
    for key, value in [("__fence__/db", "7"), ("__fence__/up", "2"), ("__sink__/job", "3")]:
        # (Protected keys: only with --force. Before, put and del changed them freely, and
        # a merge of an old dump put an older sink marker back: its later batches applied
        # again, counted twice in mode add; review 45f F9.)
        one_error_line(pulsar_state(broker, topic, "put", key, value), 2, "--force")
        ok(pulsar_state(broker, topic, "put", "--force", key, value))
    one_error_line(pulsar_state(broker, topic, "del", "__fence__/db"), 2, "protected key")
    ok(pulsar_state(broker, topic, "put", "stale", "0"))
    source = "".join(
        json.dumps({"key": key, "value": value}) + "\n"
        for key, value in [
            ("__fence__/db", 5),
            ("__fence__/up", 4),
            ("__sink__/job", {"batch": 1, "query": "q"}),  # an older marker: not put back
            ("b", 2),
        ]
    )
    ok(pulsar_state(broker, topic, "load", "--replace", *chunk, stdin=source))
    dumped = ok(pulsar_state(broker, topic, "dump"))
    # Before: the fence of "db" went back to 5 (a holder fenced out at 6 or 7 could write
    # again), and the sink's marker was deleted (the sink would apply its batches again).
    assert {d["key"]: d["value"] for d in map(json.loads, dumped.splitlines())} == {
        "__fence__/db": 7,
        "__fence__/up": 4,
        "__sink__/job": 3,
        "b": 2,
    }


def test_a_token_with_a_line_break_is_refused_without_being_shown(
    broker: Broker, topic: str
) -> None:
    # A token file of two lines: before, http.client's error quoted the whole header, so
    # the token went to stderr, as an "internal error" (exit 3).
    secret = "eyJhbGciOiJIUzI1NiJ9.SECRET"
    env = {**os.environ, "PULSAR_STATE_AUTH_TOKEN": f"{secret}\nPAYLOAD.sig"}
    urls = ["--service-url", broker.service_url, "--admin-url", broker.admin_url]
    result = subprocess.run(
        [COMMAND, *urls, "-t", topic, "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_error_line(result, 2, "line break")
    assert "SECRET" not in result.stderr + result.stdout


def test_a_reader_that_goes_away_is_exit_141(broker: Broker, topic: str) -> None:
    # `dump | head`: click's own handler exited 1, which means "key absent".
    many = "".join(json.dumps({"key": f"k{i:05d}", "value": i}) + "\n" for i in range(20_000))
    ok(pulsar_state(broker, topic, "load", stdin=many))
    dump = started(broker, topic, "dump")
    assert dump.stdout is not None
    assert dump.stderr is not None
    assert json.loads(dump.stdout.readline())["key"] == "k00000"
    dump.stdout.close()
    assert dump.wait(timeout=120) == 141, dump.stderr.read()


def test_a_replace_from_a_file_without_entries_is_refused(broker: Broker, topic: str) -> None:
    # A dump that failed leaves an empty file: before, restoring it emptied the map (exit 0).
    ok(pulsar_state(broker, topic, "put", "k", "1"))
    one_error_line(pulsar_state(broker, topic, "load", "--replace", stdin=""), 2, "no entry")
    assert ok(pulsar_state(broker, topic, "get", "k")) == "1\n"
    ok(pulsar_state(broker, topic, "load", "--replace", "--allow-empty", stdin=""))
    assert pulsar_state(broker, topic, "get", "k").returncode == 1


@pytest.mark.parametrize("locale", ["C", "C.UTF-8"])
def test_a_dump_under_a_c_locale_loads_back_whole(broker: Broker, topic: str, locale: str) -> None:
    # Before: under C (ASCII) click wrote "?" for what ASCII lacks; under C.UTF-8 stdout's
    # errors handler is surrogateescape, so a lone surrogate went out as a raw byte, not
    # UTF-8, and `load` refused the dump.
    ok(pulsar_state(broker, topic, "put", "k", '"caf\\udce9"'))
    ok(pulsar_state(broker, topic, "put", "l", '"caf\u00e9 \u20ac"'))
    env = cli_env(broker, LC_ALL=locale, PYTHONUTF8="0")
    env.pop("PYTHONIOENCODING", None)
    dumped = subprocess.run(
        [str(COMMAND), "-t", topic, "dump"], env=env, capture_output=True, timeout=120
    )
    assert dumped.returncode == 0, dumped.stderr
    ok(pulsar_state(broker, f"{topic}-copy", "load", stdin=dumped.stdout.decode("utf-8")))
    copied = ok(pulsar_state(broker, f"{topic}-copy", "-o", "json", "dump"))
    assert [json.loads(line)["value"] for line in copied.splitlines()] == [
        "caf\udce9",
        "caf\u00e9 \u20ac",
    ]


class _FlakyAdmin(http.server.BaseHTTPRequestHandler):
    """An admin API whose policy reads answer 503 (a broker's passing trouble)."""

    def do_GET(self) -> None:
        if "retention" in self.path:
            code, body = 503, {"reason": "ZooKeeper session expired, try again"}
        elif self.path.endswith("/partitions"):
            code, body = 200, {"partitions": 0}
        elif "/lastMessageId" in self.path:
            code, body = 200, {"ledgerId": 1, "entryId": 0}
        else:
            code, body = 200, {"publishers": [], "subscriptions": {}}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_status_fails_on_a_broker_error_rather_than_calling_the_topic_unsafe(
    broker: Broker, topic: str
) -> None:
    # Exit 4 means a setting that loses history (fix the topic now); before, any admin
    # error while checking the policies (a 503, a timeout, a 401) was reported so.
    ok(pulsar_state(broker, topic, "put", "k", "1"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlakyAdmin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = cli_env(broker, PULSAR_ADMIN_URL=f"http://127.0.0.1:{server.server_address[1]}")
        result = subprocess.run(
            [COMMAND, "-t", topic, "status"], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        server.shutdown()
        server.server_close()
    one_error_line(result, 3, "503")


class _SlowAdmin(http.server.BaseHTTPRequestHandler):
    """An admin API that answers 404 after 11 s (a broker under load)."""

    def do_GET(self) -> None:
        time.sleep(11)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_the_timeout_option_bounds_admin_requests_too(broker: Broker, topic: str) -> None:
    # Before: admin requests had their own fixed 10 s, so --timeout 30 gave up on an answer
    # coming after 11 s (and --timeout 2 still waited 10 s).
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowAdmin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = cli_env(broker, PULSAR_ADMIN_URL=f"http://127.0.0.1:{server.server_address[1]}")
        result = subprocess.run(
            [COMMAND, "-t", topic, "--timeout", "30", "-o", "json", "snapshot", "list"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert json.loads(ok(result)) == []  # no index topic: no snapshot


async def test_map_commands_read_a_topic_whose_history_was_trimmed(
    broker: Broker, topic: str
) -> None:
    # Before: every map command replayed from the log's first message, built on records the
    # broker had deleted: ForkedHistoryError, exit 3 (review 45f F1). They open from the
    # newest snapshot now.
    from tests.recipes.test_map_disk import trimmed_map_topic

    answers, _position = await trimmed_map_topic(broker.service_url, broker.admin_url, topic)
    content = dict(answers["all"])
    assert json.loads(ok(pulsar_state(broker, topic, "-o", "json", "ls"))) == sorted(content)
    for key in ("k00", "t2"):
        got = json.loads(ok(pulsar_state(broker, topic, "-o", "json", "get", key)))
        assert got["value"] == content[key]
    ok(pulsar_state(broker, topic, "put", "added", "1"))
    assert ok(pulsar_state(broker, topic, "get", "added")) == "1\n"


async def test_map_commands_accept_a_message_ttl_on_a_topic_kept_whole(
    broker: Broker, topic: str
) -> None:
    # A TTL only moves subscriptions; with infinite retention it loses nothing, and the
    # library accepts it without trim_history (refused with it: it would move the trim point).
    from tests.support.trimming import set_policy

    await set_policy(broker.admin_url, topic, "messageTTL", 60)
    ok(pulsar_state(broker, topic, "put", "k", "1"))
    assert ok(pulsar_state(broker, topic, "get", "k")) == "1\n"


def test_read_commands_do_not_create_a_topic(broker: Broker, topic: str) -> None:
    # A typo in -t: before, get/ls/dump/del/watch created the topic (with the library's
    # durable subscription, never acknowledged) and exited 1, "key absent" (review 45f F3).
    for command in (["get", "k"], ["ls"], ["dump"], ["del", "k"]):
        one_error_line(pulsar_state(broker, topic, *command), 2, "does not exist")
    name = topic.split("/")[-1]
    with pytest.raises(urllib.error.HTTPError) as missing:
        admin_request(broker.admin_url, "GET", f"/admin/v2/persistent/public/default/{name}/stats")
    assert missing.value.code == 404
    ok(pulsar_state(broker, topic, "put", "k", "1"))  # writes create it
    assert ok(pulsar_state(broker, topic, "get", "k")) == "1\n"
