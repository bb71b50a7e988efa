"""``pulsar-state``: inspect and repair replicated state from a shell (the ``cli`` extra).

Like ``etcdctl`` for etcd: map commands (get, put, del, ls, dump, load, watch) work on a
:class:`~recipes.PulsarMap` topic; ``log``, ``status``, ``snapshot list|verify`` and ``doctor``
work on any state topic. Data goes to stdout, logs to stderr. Exit codes, for scripts:

* 0: done;
* 1: the key is absent (``get``, ``del``);
* 2: bad usage or bad input (nothing was written);
* 3: the operation failed (the library's error, one line on stderr);
* 4: ``doctor`` or ``status`` found a setting that would lose history;
* 130: interrupted (Ctrl-C).

A layer above the map recipe: it imports ``recipes`` and reads a few of the core's private
modules (the record wire format, the admin REST client) to show what no public API shows.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import datetime
import io
import json
import logging
import math
import os
import re
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, TypeVar

try:
    import click
    import rich.console
    import rich.progress
except ImportError as exc:  # pragma: no cover - depends on the install
    raise SystemExit(
        f"pulsar-state: the command needs {exc.name}: pip install 'pulsar-state[cli]'"
    ) from exc

from pulsar_state import (
    AvroCodec,
    BytesCodec,
    Codec,
    CodecError,
    ConfigurationError,
    JsonCodec,
    PartitionedTopicError,
    PulsarStateError,
    ReplayProgress,
    SharedStateManager,
    StrCodec,
    UnsafeTopicPolicyError,
)
from pulsar_state._admin import AdminClient, TopicName, default_admin_url
from pulsar_state._credentials import secured_client_options
from pulsar_state._envelope import decode_record
from pulsar_state._pulsar import LogMessage, read_log

from ._map_ops import MapVersion
from ._map_watch import MapWatch
from .map import PROTECTED_PREFIXES, PulsarMap

__all__ = ["main"]

EXIT_OK = 0
EXIT_ABSENT = 1
EXIT_USAGE = 2
EXIT_FAILED = 3
EXIT_UNSAFE = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

T = TypeVar("T")

logger = logging.getLogger("pulsar_state.cli")

# ---------------------------------------------------------------- codecs and JSON forms

# Each codec with how its values look on the command line and in JSON output: bytes travel as
# base64 so that no byte is lost in a shell or a JSON line.
CODECS = ("str", "json", "bytes")


def _codec(name: str) -> Codec[Any]:
    if name == "str":
        return StrCodec()
    if name == "json":
        return JsonCodec()
    return BytesCodec()


def _parse(text: str, codec: str, what: str) -> Any:
    """A key or value given on the command line, in the codec's form."""
    if codec == "str":
        return text
    if codec == "bytes":  # "json" and "avro" values are JSON
        try:
            return base64.b64decode(text, validate=True)
        except binascii.Error as exc:
            raise BadInput(f"{what} {text!r} is not base64 (bytes codec): {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(
            f"{what} {text!r} is not JSON ({exc}); quote strings ('\"text\"') "
            "or choose another codec (--value-codec str)"
        ) from exc


def _key(item: Any, codec: str, what: str) -> Any:
    """``item`` if a map may hold it as a key: JSON keys are a string or an integer."""
    if codec == "json" and (isinstance(item, bool) or not isinstance(item, str | int)):
        raise BadInput(f"{what} {json.dumps(item)[:80]} is not a string or an integer (json keys)")
    return item


def _parse_key(text: str, codec: str) -> Any:
    return _key(_parse(text, codec, "key"), codec, "key")


def _from_json(item: Any, codec: str, what: str) -> Any:
    """A key or value read from a JSON line (``load``): the form ``_to_json`` wrote."""
    if codec == "bytes":
        if not isinstance(item, str):
            raise BadInput(f"{what} must be a base64 string (bytes codec), not {item!r}")
        return _parse(item, "bytes", what)
    if codec == "str" and not isinstance(item, str):
        raise BadInput(f"{what} must be a string (str codec), not {item!r}")
    return item


def _to_json(item: Any) -> Any:
    return base64.b64encode(item).decode("ascii") if isinstance(item, bytes) else item


def _text(item: Any) -> str:
    """How a key or value prints in text output: strings bare, bytes base64, the rest JSON."""
    if isinstance(item, str):
        return item
    if isinstance(item, bytes):
        return base64.b64encode(item).decode("ascii")
    return json.dumps(item, ensure_ascii=False, sort_keys=True)


def _version(version: MapVersion) -> dict[str, int]:
    """A key's version (what replace_version takes) and the position of the write behind it."""
    return {"version": int(version), "position": version.position}


def _dumps(document: Any) -> str:
    # ASCII, with JSON's escapes: valid whatever the locale (under C/POSIX, click wrote "?"
    # for what ASCII lacks, and a lone surrogate went out as a raw byte), so a dump loads.
    return json.dumps(document, ensure_ascii=True, sort_keys=True)


def _not_nan(seconds: float) -> float:
    if math.isnan(seconds):  # a range lets NaN through (every comparison is false)
        raise click.BadParameter("must be a number of seconds, not nan")
    return seconds


class BadInput(Exception):
    """Input the command refuses before writing anything (exit 2)."""


def _deleting(keys: list[Any]) -> Callable[[Mapping[Any, Any]], dict[Any, None]]:
    """A transact function deleting those of ``keys`` still bound."""
    return lambda view: {key: None for key in keys if key in view}


def _is_protected(key: Any) -> bool:
    # The Spark sinks' markers and the fences are not data: a restore leaves them alone, and
    # never lowers one.
    return isinstance(key, str) and key.startswith(PROTECTED_PREFIXES)


_FORCE = click.option(
    "--force",
    is_flag=True,
    help="Also change a protected key (a Spark sink's marker, a fence), which the map keeps "
    "for exactly-once writes and fencing.",
)


def _refuse_protected(key: Any, force: bool) -> None:
    if _is_protected(key) and not force:
        raise BadInput(
            f"{key!r} is a protected key (a Spark sink's marker or a fence): changing it may "
            "make a sink apply batches again or let a holder that lost its lease write; "
            "pass --force to change it anyway"
        )


def _loading(
    entries: list[tuple[Any, Any]], replace: bool
) -> Callable[[Mapping[Any, Any]], dict[Any, Any]]:
    """A transact function putting ``entries`` (and with ``replace``, deleting the other
    keys but the protected ones), where a protected key in SOURCE lower than the map's is not
    put: a fence that went down would let a holder that lost its lease write again, and a
    sink's marker that went down would make the sink apply its later batches again."""

    def changes(view: Mapping[Any, Any]) -> dict[Any, Any]:
        wanted = {
            key: value
            for key, value in entries
            if not (_is_protected(key) and _lowers(view.get(key), value))
        }
        if replace:
            kept = {key for key, _ in entries}
            wanted.update({k: None for k in view if k not in kept and not _is_protected(k)})
        return wanted

    return changes


def _rank(value: Any) -> int | None:
    """A fence's token, or a sink marker's batch id (an int, or ``{"batch": id, ...}``)."""
    if isinstance(value, Mapping):
        value = value.get("batch")
    return value if type(value) is int else None


def _lowers(current: Any, new: Any) -> bool:
    now = _rank(current)
    if now is None:
        return False
    then = _rank(new)
    return then is None or then < now


class PartialLoad(PulsarStateError):
    """A chunked load failed after some chunks were written (exit 3, the chunks named)."""


# ---------------------------------------------------------------- options shared by commands


@dataclass
class Settings:
    service_url: str
    admin_url: str
    topic: str | None
    output: str
    key_codec: str
    value_codec: str  # one of CODECS, or "avro" with value_schema
    timeout: float
    value_schema: dict[str, Any] | None = None
    auth_token: str | None = None

    def admin(self) -> AdminClient:
        return AdminClient(self.admin_url, token=self.auth_token, timeout_s=self.timeout)

    def values(self) -> Codec[Any]:
        if self.value_schema is not None:
            return AvroCodec(self.value_schema)
        return _codec(self.value_codec)

    def need_topic(self) -> str:
        if not self.topic:
            raise BadInput("no topic: pass -t/--topic TOPIC or set PULSAR_STATE_TOPIC")
        return self.topic

    def open_map(self, *, snapshots: bool = False, trimmed: bool = False) -> PulsarMap[Any, Any]:
        """The map, opened from its newest snapshot with ``snapshots``; ``trimmed``: the
        topic's writers trim its history (see :func:`_trimmed`), and so does this map after
        a snapshot it takes (``snapshot take``), as they do; a finite retention is then
        accepted, and a replica behind the trimmed history falls forward."""
        return PulsarMap(
            self.service_url,
            self.need_topic(),
            key_codec=_codec(self.key_codec),
            value_codec=self.values(),
            snapshots=snapshots,
            trim_history=snapshots and trimmed,
            admin_url=self.admin_url,
            authentication=self.auth_token,
            on_progress=_ReplayBar(),
            name="pulsar-state-cli",
            open_timeout_s=self.timeout,
            write_timeout_s=self.timeout,
            read_timeout_s=self.timeout,
        )

    @property
    def json(self) -> bool:
        return self.output == "json"


class _ReplayBar:
    """A long open's progress bar on stderr (rich), only for a person watching (a TTY):
    the snapshot's megabytes loaded, then the records read of the records to read (from a
    snapshot: of the log after it), and the time left."""

    # Bars on screen: main() stops them, so that an open that failed leaves no bar behind
    # (a hidden cursor, output still routed through rich).
    showing: ClassVar[set[_ReplayBar]] = set()

    def __init__(self) -> None:
        self._bar: rich.progress.Progress | None = None
        self._task: rich.progress.TaskID | None = None
        self._phase = ""

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        self._phase = ""
        _ReplayBar.showing.discard(self)

    def _start(self, phase: str, unit: str, total: int | None) -> None:
        if self._bar is not None:
            self._bar.stop()
        self._phase = phase
        self._bar = rich.progress.Progress(
            rich.progress.TextColumn(phase),
            rich.progress.BarColumn(),
            rich.progress.MofNCompleteColumn(),
            rich.progress.TextColumn(unit),
            rich.progress.TimeRemainingColumn(),
            console=rich.console.Console(stderr=True),
            transient=True,
        )
        self._bar.start()
        _ReplayBar.showing.add(self)
        self._task = self._bar.add_task(phase, total=total)

    def __call__(self, progress: ReplayProgress) -> None:
        if not sys.stderr.isatty():
            return
        if progress.loading_snapshot:
            total_mb = progress.snapshot_bytes // 1_000_000
            if self._phase != "loading snapshot":
                self._start("loading snapshot", "MB", total_mb)
            completed = progress.snapshot_bytes_loaded // 1_000_000
            assert self._bar is not None
            assert self._task is not None
            self._bar.update(self._task, completed=completed, total=total_mb)
            return
        if self._phase != "replaying":
            self._start("replaying", "records", progress.records_total)
        assert self._bar is not None
        assert self._task is not None
        self._bar.update(self._task, completed=progress.records_read, total=progress.records_total)
        if progress.done:
            self.stop()
            click.echo(f"replayed {progress.records_read} records", err=True)


def _echo(line: str, *, err: bool = False) -> None:
    try:
        click.echo(line, err=err)
    except UnicodeEncodeError:
        # A lone surrogate in a key or value (JSON can carry one), or a character the
        # terminal's encoding lacks: shown as its escape (a surrogate's is JSON's own).
        encoding = getattr(sys.stderr if err else sys.stdout, "encoding", None) or "utf-8"
        try:  # a JSON line stays JSON: its own escapes
            line = json.dumps(json.loads(line), ensure_ascii=True, sort_keys=True)
        except ValueError:
            line = line.encode(encoding, "backslashreplace").decode(encoding)
        click.echo(line, err=err)


def _emit(line: str) -> None:
    try:
        _echo(line)
    except BrokenPipeError:
        # The reader went away (| head): as a shell reports SIGPIPE. (Click's own handler
        # would exit 1, which means "key absent".)
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(EXIT_BROKEN_PIPE) from None


def _fail(message: str, code: int) -> NoReturn:
    # One line, whatever the message holds (some library errors quote multi-line details).
    _echo(f"pulsar-state: {' '.join(message.split())}", err=True)
    sys.exit(code)


def _guard(work: Callable[[], T], timeout: float) -> T:
    """Run one command's work; the library's errors become one line and an exit code."""
    try:
        return work()
    except BadInput as exc:
        _fail(str(exc), EXIT_USAGE)
    except (ConfigurationError, CodecError) as exc:  # input refused before any write
        _fail(f"{type(exc).__name__}: {exc}", EXIT_USAGE)
    except PulsarStateError as exc:
        _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    except TimeoutError:
        _fail(f"timed out (--timeout {timeout:g}s per step)", EXIT_FAILED)
    except KeyboardInterrupt:
        _fail("interrupted", EXIT_INTERRUPTED)


def _run(settings: Settings, work: Callable[[], Awaitable[T]], *, steps: int | None = 0) -> T:
    """Run a coroutine under :func:`_guard`, bounded by a few steps' time (and ``steps``
    more; None: not bounded as a whole, each of its steps is)."""
    bound = None if steps is None else settings.timeout * (4 + steps)
    return _guard(lambda: asyncio.run(_bounded(work(), bound)), settings.timeout)


def _checked(settings: Settings, work: Callable[[], T]) -> T:
    """Input checks before any broker call: bad input exits 2."""
    return _guard(work, settings.timeout)


async def _bounded(work: Awaitable[T], timeout: float | None) -> T:
    async with asyncio.timeout(timeout):
        return await work


async def _trimmed(settings: Settings, *, create: bool) -> bool:
    """Whether the topic's writers trim its history: its retention is finite (the library
    accepts one only with trim_history). False when that cannot be read (a new topic, a
    role that may not read policies). Without ``create``, a topic that does not exist is
    bad input: opening a map creates its topic, and the library's subscription on it."""
    admin = settings.admin()
    try:
        topic = TopicName.parse(settings.need_topic())
        if not create and (await admin.get(topic.rest_path + "/stats"))[0] == 404:
            raise BadInput(f"{topic} does not exist (check -t; only writes create a topic)")
        status, retention = await admin.get(topic.rest_path + "/retention?applied=true")
    finally:
        await admin.close()
    if status != 200 or not isinstance(retention, dict):
        return False
    return -1 not in (retention.get("retentionTimeInMinutes"), retention.get("retentionSizeInMB"))


async def _open_map(settings: Settings, *, create: bool = True) -> PulsarMap[Any, Any]:
    """The map, unopened, to open from its newest snapshot: a topic whose writers trim its
    history has no beginning to replay (its first record is built on a deleted one: a forked
    history to a replica that does not fall forward), and a long one opens sooner."""
    return settings.open_map(snapshots=True, trimmed=await _trimmed(settings, create=create))


async def _with_map(
    settings: Settings,
    use: Callable[[PulsarMap[Any, Any]], Awaitable[T]],
    *,
    create: bool = True,
) -> T:
    async with await _open_map(settings, create=create) as state_map:
        return await use(state_map)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--service-url",
    envvar="PULSAR_SERVICE_URL",
    default="pulsar://127.0.0.1:6650",
    show_default=True,
    help="The broker (env PULSAR_SERVICE_URL).",
)
@click.option(
    "--admin-url",
    envvar="PULSAR_ADMIN_URL",
    help="Its admin REST URL (env PULSAR_ADMIN_URL; default derived from the service URL).",
)
@click.option(
    "--auth-token",
    envvar="PULSAR_STATE_AUTH_TOKEN",
    help="A token for a secured cluster, sent on every connection (env PULSAR_STATE_AUTH_TOKEN; "
    "doctor needs an admin role's).",
)
@click.option(
    "-t", "--topic", envvar="PULSAR_STATE_TOPIC", help="The state topic (env PULSAR_STATE_TOPIC)."
)
@click.option(
    "-o",
    "-w",
    "--output",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Output format (-w as in etcdctl).",
)
@click.option(
    "--key-codec", type=click.Choice(CODECS), default="str", show_default=True, help="Map keys."
)
@click.option(
    "--value-codec",
    type=click.Choice(CODECS),
    default="json",
    show_default=True,
    help="Map values (bytes: base64 on the command line and in JSON).",
)
@click.option(
    "--value-schema",
    type=click.File("r", encoding="utf-8"),
    help="An Avro schema file (.avsc): values are Avro records, given and shown as JSON.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True, max=1e9),
    callback=lambda _ctx, _param, value: _not_nan(value),
    default=30.0,
    show_default=True,
    help="Seconds per broker step.",
)
@click.option(
    "-v", "--verbose", count=True, help="Show the library's logs on stderr (-v info, -vv debug)."
)
@click.pass_context
def cli(
    ctx: click.Context,
    service_url: str,
    admin_url: str | None,
    auth_token: str | None,
    topic: str | None,
    output: str,
    key_codec: str,
    value_codec: str,
    value_schema: Any,
    timeout: float,
    verbose: int,
) -> None:
    """Inspect and change pulsar-state topics and PulsarMaps."""
    # Without -v only the final error line speaks: it carries the library's message, which the
    # library also logs (a halt, say) and would otherwise be said twice.
    level = {0: logging.CRITICAL, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(
        stream=sys.stderr, level=level, format="%(levelname)s %(name)s: %(message)s"
    )
    ctx.obj = Settings(
        service_url=service_url,
        admin_url=admin_url or default_admin_url(service_url),
        topic=topic,
        output=output,
        key_codec=key_codec,
        value_codec=value_codec,
        timeout=timeout,
        auth_token=auth_token or None,
    )
    if value_schema is not None:
        try:
            ctx.obj.value_schema = json.load(value_schema)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            _fail(f"--value-schema {value_schema.name}: not JSON ({exc})", EXIT_USAGE)
        ctx.obj.value_codec = "avro"


pass_settings = click.make_pass_decorator(Settings)


# ---------------------------------------------------------------- map commands


@cli.command()
@click.argument("key")
@pass_settings
def get(settings: Settings, key: str) -> None:
    """Print KEY's value (latest, linearizable). Exit 1 when absent."""
    wanted = _checked(settings, lambda: _parse_key(key, settings.key_codec))

    async def work(state_map: PulsarMap[Any, Any]) -> Any:
        return await state_map.entry(wanted, latest=True)

    entry = _run(settings, lambda: _with_map(settings, work, create=False))
    if entry is None:
        _fail(f"key {key!r} is absent", EXIT_ABSENT)
    if settings.json:
        _emit(
            _dumps(
                {"key": _to_json(wanted), "value": _to_json(entry.value), **_version(entry.version)}
            )
        )
    else:
        _emit(_text(entry.value))


@cli.command()
@click.argument("key")
@click.argument("value")
@_FORCE
@pass_settings
def put(settings: Settings, key: str, value: str, force: bool) -> None:
    """Bind KEY to VALUE (in the value codec's form: JSON by default)."""

    new_key, new_value = _checked(
        settings,
        lambda: (
            _parse_key(key, settings.key_codec),
            _parse(value, settings.value_codec, "value"),
        ),
    )
    _checked(settings, lambda: _refuse_protected(new_key, force))

    async def work(state_map: PulsarMap[Any, Any]) -> MapVersion:
        return await state_map.put(new_key, new_value, timeout=settings.timeout)

    version = _run(settings, lambda: _with_map(settings, work))
    if settings.json:
        _emit(_dumps({"key": _to_json(new_key), **_version(version)}))
    else:
        _emit(f"OK version {int(version)} (position {version.position})")


@cli.command(name="del")
@click.argument("key")
@_FORCE
@pass_settings
def delete(settings: Settings, key: str, force: bool) -> None:
    """Remove KEY. Exit 1 when it was absent (nothing written)."""
    wanted = _checked(settings, lambda: _parse_key(key, settings.key_codec))
    _checked(settings, lambda: _refuse_protected(wanted, force))

    async def work(state_map: PulsarMap[Any, Any]) -> tuple[bool, int]:
        deleted = await state_map.delete(wanted, timeout=settings.timeout)
        return deleted, state_map.position

    deleted, position = _run(settings, lambda: _with_map(settings, work, create=False))
    if settings.json:
        _emit(_dumps({"key": _to_json(wanted), "deleted": deleted, "position": position}))
    elif deleted:
        _emit("OK deleted")
    if not deleted:
        _fail(f"key {key!r} is absent", EXIT_ABSENT)


def _matches(key: Any, prefix: Any) -> bool:
    return prefix is None or (isinstance(key, type(prefix)) and key.startswith(prefix))


def _prefix(settings: Settings, prefix: str | None) -> Any:
    if prefix is None:
        return None
    if settings.key_codec == "bytes":
        return _parse(prefix, "bytes", "prefix")
    return prefix  # str keys, and the str keys of a JSON-keyed map


@cli.command(name="ls")
@click.option("--prefix", help="Only keys starting with this (str keys; base64 for bytes).")
@pass_settings
def list_keys(settings: Settings, prefix: str | None) -> None:
    """List the keys (latest), in key order."""
    start = _checked(settings, lambda: _prefix(settings, prefix))

    async def work(state_map: PulsarMap[Any, Any]) -> list[Any]:
        return [k for k in await state_map.list_keys(latest=True) if _matches(k, start)]

    keys = _run(settings, lambda: _with_map(settings, work, create=False))
    if settings.json:
        _emit(_dumps([_to_json(k) for k in keys]))
    else:
        for k in keys:
            _emit(_text(k))


@cli.command()
@click.option("--prefix", help="Only keys starting with this.")
@pass_settings
def dump(settings: Settings, prefix: str | None) -> None:
    """Write every entry (latest, one consistent state) as JSON lines: key, value, version.

    The map's position goes to stderr. ``load`` reads this format back.
    """
    start = _checked(settings, lambda: _prefix(settings, prefix))

    async def work(state_map: PulsarMap[Any, Any]) -> tuple[list[Any], int]:
        entries = await state_map.entries(latest=True)
        return [e for e in entries if _matches(e[0], start)], state_map.position

    entries, position = _run(settings, lambda: _with_map(settings, work, create=False))
    for key, entry in entries:
        _emit(
            _dumps(
                {"key": _to_json(key), "value": _to_json(entry.value), **_version(entry.version)}
            )
        )
    click.echo(f"dumped {len(entries)} entries at position {position}", err=True)


def _read_entries(settings: Settings, source: Iterator[str]) -> list[tuple[Any, Any]]:
    try:
        return _entries_of(settings, source)
    except UnicodeDecodeError as exc:
        raise BadInput(f"SOURCE is not UTF-8 text: {exc}") from exc


def _entries_of(settings: Settings, source: Iterator[str]) -> list[tuple[Any, Any]]:
    entries: list[tuple[Any, Any]] = []
    for number, line in enumerate(source, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"line {number}: not JSON ({exc})") from exc
        if not isinstance(item, dict) or "key" not in item or "value" not in item:
            raise BadInput(
                f'line {number}: expected {{"key": ..., "value": ...}}, got {line.strip()[:80]}'
            )
        if item["value"] is None:
            raise BadInput(f"line {number}: value null means absent; leave the line out")
        key = _from_json(item["key"], settings.key_codec, f"line {number}: key")
        entries.append(
            (
                _key(key, settings.key_codec, f"line {number}: key"),
                _from_json(item["value"], settings.value_codec, f"line {number}: value"),
            )
        )
    return entries


@cli.command()
@click.argument("source", type=click.File("r", encoding="utf-8"), default="-")
@click.option(
    "--chunk",
    type=click.IntRange(min=1),
    help="Write N entries per atomic write (each chunk all or nothing) instead of one write.",
)
@click.option(
    "--replace",
    is_flag=True,
    help=(
        "Also delete the keys not in SOURCE but the protected ones (a restore); atomic with "
        "the load unless --chunk."
    ),
)
@click.option(
    "--allow-empty",
    is_flag=True,
    help="With --replace, accept a SOURCE without entries (it empties the map).",
)
@pass_settings
def load(
    settings: Settings, source: Any, chunk: int | None, replace: bool, allow_empty: bool
) -> None:
    """Put the entries of SOURCE (JSON lines as ``dump`` writes; default stdin).

    Every line, key and value is checked (by the map's codecs too) before anything is
    written. Without --chunk all entries go in one atomic write; with it, each chunk is
    atomic, a failure names the entries loaded (exit 3), and --replace deletes the other keys
    after the last chunk. --replace keeps the protected keys (the Spark sinks' markers, the
    fences of fenced writes), and a fence in SOURCE lower than the map's is not loaded.
    """

    entries = _checked(settings, lambda: _read_entries(settings, iter(source)))
    if replace and not entries and not allow_empty:
        # A dump that failed leaves an empty file: restoring it would empty the map.
        _fail(
            "SOURCE holds no entry: --replace would delete every key; pass --allow-empty "
            "to empty the map",
            EXIT_USAGE,
        )
    keys = {k for k, _ in entries}
    if len(keys) != len(entries):
        _fail("SOURCE names a key twice: refusing an ambiguous load", EXIT_USAGE)

    fences = [(k, v) for k, v in entries if _is_protected(k)]  # (and sink markers)
    data = [(k, v) for k, v in entries if not _is_protected(k)]

    async def work(state_map: PulsarMap[Any, Any]) -> int:
        for key, value in entries:  # CodecError (exit 2) before any write
            state_map.check_entry(key, value)
        if chunk is None:
            if replace or fences:
                await state_map.transact(_loading(entries, replace), timeout=settings.timeout)
            elif entries:
                await state_map.put_all(entries, timeout=settings.timeout)
            return state_map.position
        done = 0
        if fences:  # first, in one write: never lower than the map's (see _loading)
            await state_map.transact(_loading(fences, False), timeout=settings.timeout)
            done = len(fences)
            click.echo(f"loaded {done}/{len(entries)} entries (the fences)", err=True)
        for begin in range(0, len(data), chunk):
            part = data[begin : begin + chunk]
            try:
                await state_map.put_all(part, timeout=settings.timeout)
            except PulsarStateError as exc:
                if fences:  # (loaded first: SOURCE's numbering no longer says which)
                    loaded = f"{done} of the {len(entries)} entries, the fences first, were loaded"
                    left = "the others were not"
                else:
                    loaded = f"entries 1-{done} were loaded" if done else "no entry was loaded"
                    left = f"entries {done + 1}-{len(entries)} were not"
                raise PartialLoad(
                    f"{type(exc).__name__}: {exc} (chunk {begin // chunk + 1} failed; {loaded}, "
                    f"{left}{'; no key was deleted' if replace else ''})"
                ) from exc
            done += len(part)
            click.echo(f"loaded {done}/{len(entries)} entries", err=True)
        if replace:  # after the puts, a chunk at a time: a failed load never empties the map
            stale = [
                k
                for k in await state_map.list_keys(latest=True)
                if k not in keys and not _is_protected(k)
            ]
            deleted = 0
            for begin in range(0, len(stale), chunk):
                part_keys = stale[begin : begin + chunk]
                try:
                    await state_map.transact(_deleting(part_keys), timeout=settings.timeout)
                except PulsarStateError as exc:
                    raise PartialLoad(
                        f"{type(exc).__name__}: {exc} (all {len(entries)} entries were loaded; "
                        f"{deleted} of the {len(stale)} other keys were deleted)"
                    ) from exc
                deleted += len(part_keys)
                click.echo(f"deleted {deleted}/{len(stale)} other keys", err=True)
        return state_map.position

    # A chunked load takes a step per chunk (each bounded by --timeout): no bound on the whole.
    position = _run(settings, lambda: _with_map(settings, work), steps=None if chunk else 0)
    if settings.json:
        _emit(_dumps({"loaded": len(entries), "position": position}))
    else:
        _emit(f"OK loaded {len(entries)} entries, position {position}")


@cli.command()
@click.option("--prefix", help="Only keys starting with this.")
@click.option("--key", "one_key", help="Only this key.")
@click.option("--no-initial", is_flag=True, help="Only changes, not the current entries first.")
@click.option(
    "--from",
    "from_position",
    type=click.IntRange(min=0),
    help="Resume: only the changes after this position (a previous event's), from the log.",
)
@pass_settings
def watch(
    settings: Settings,
    prefix: str | None,
    one_key: str | None,
    no_initial: bool,
    from_position: int | None,
) -> None:
    """Print each change as a JSON line (the current entries first) until Ctrl-C.

    With --from P: the changes after position P (read from the topic's log), then live ones.
    """

    async def work() -> None:
        key = None if one_key is None else _parse_key(one_key, settings.key_codec)
        # --from reads the history (a watch before open); else from the newest snapshot.
        state_map = (
            settings.open_map()
            if from_position is not None
            else await _open_map(settings, create=False)
        )
        try:
            if from_position is not None:
                # Before open: from the first record its opening replay applies.
                changes = state_map.changes(
                    key=key, prefix=_prefix(settings, prefix), from_position=from_position
                )
                await state_map.open()
            else:
                await state_map.open()
                changes = state_map.changes(
                    key=key, prefix=_prefix(settings, prefix), snapshot=not no_initial
                )
            async with changes:
                await emit_all(changes)
        finally:
            await state_map.aclose()

    async def emit_all(changes: MapWatch[Any, Any]) -> None:
        async for event in changes:
            document = {
                "kind": event.kind,
                "key": _to_json(event.key),
                "value": _to_json(event.value),
                "position": event.position,
                "initial": event.initial,
            }
            _emit(_dumps(document))
            sys.stdout.flush()

    try:
        asyncio.run(work())
    except KeyboardInterrupt:
        sys.exit(EXIT_OK)  # Ctrl-C is how a watch ends
    except BadInput as exc:
        _fail(str(exc), EXIT_USAGE)
    except PulsarStateError as exc:
        _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILED)


# ---------------------------------------------------------------- any state topic


def _read_all(settings: Settings, topic: str, limit: int | None = None) -> Iterator[LogMessage]:
    """The topic's messages from the first, up to its tail as of now."""
    return read_log(
        settings.service_url,
        topic,
        limit=limit,
        timeout_s=settings.timeout,
        client_options=secured_client_options(None, settings.auth_token, None, None),
    )


class UndecodableOpError(PulsarStateError):
    """``log --ops map`` met an op that the chosen codecs cannot decode."""


def _map_op_decoder(settings: Settings) -> Callable[[bytes], dict[str, Any]]:
    from ._map_ops import MapCodecs, MapOpCodec

    codec = MapOpCodec(MapCodecs(_codec(settings.key_codec), settings.values()))

    def decode(data: bytes) -> dict[str, Any]:
        try:
            op = codec.decode(data)
        except CodecError as exc:  # stored data, not the user's input: not an exit 2
            raise UndecodableOpError(
                f"an op on the topic does not decode with these codecs ({exc}); "
                "choose the map's --key-codec/--value-codec, or --ops raw"
            ) from exc
        shown: dict[str, Any] = {"op": op.kind}
        if op.kind != "CLEAR":
            shown["key"] = _to_json(op.key)
        if op.kind == "PUT":
            shown["value"] = _to_json(op.value)
        return shown

    return decode


@cli.command()
@click.option(
    "--ops",
    type=click.Choice(["raw", "map"]),
    default="raw",
    show_default=True,
    help="Show ops as base64 bytes, or decoded as PulsarMap ops with the map codecs.",
)
@click.option("--limit", type=click.IntRange(min=1), help="At most N records.")
@pass_settings
def log(settings: Settings, ops: str, limit: int | None) -> None:
    """Decode the records of a state topic, oldest first: position, writer, time, ops.

    ``position`` is the version the record made (null for a record not accepted) and
    ``verdict`` what a replica does with it: ``accepted``; ``stale`` (ignored by every
    replica: a stale or fenced writer's, or a copy of a record, harmless); ``forked`` (built
    on a history this log does not hold: every replica halts on it). A log whose beginning
    was trimmed is read from its first record, taken as accepted.
    """

    def records() -> Iterator[dict[str, Any]]:
        show: Callable[[bytes], Any] = _map_op_decoder(settings) if ops == "map" else _to_json
        accepted, last_id = 0, ""
        stale: dict[str, int] = {}  # as a replica keeps them (pulsar_state._replica)
        first = True
        for message in _read_all(settings, settings.need_topic(), limit):
            published = datetime.datetime.fromtimestamp(
                message.publish_time_ms / 1000, tz=datetime.UTC
            )
            record = decode_record(message.payload, message_id=message.message_id)
            if first and record.base_position > 0:
                accepted, last_id = record.base_position, record.base_record_id  # trimmed
                _echo(
                    f"pulsar-state: the log's beginning was trimmed (its first record is built "
                    f"on position {accepted}): that record is taken as accepted, and the "
                    "verdicts follow from it",
                    err=True,
                )
            first = False
            # The same rules every replica applies (see pulsar_state._replica).
            if record.base_position < accepted:
                verdict = "stale"
            elif record.base_position == accepted and record.base_record_id == last_id:
                verdict = "accepted"
                accepted, last_id = accepted + 1, record.record_id
                stale = {k: p for k, p in stale.items() if p >= accepted}
            elif stale.get(record.base_record_id) == record.base_position:
                verdict = "stale"
            else:
                verdict = "forked"
            if verdict == "stale":
                stale[record.record_id] = record.base_position + 1
            yield {
                "position": accepted if verdict == "accepted" else None,
                "verdict": verdict,
                "log_position": f"{message.position.ledger}:{message.position.entry}",
                "record_id": record.record_id,
                "writer": record.writer_id,
                "time": published.isoformat(timespec="milliseconds"),
                "writes": [[show(op) for op in write.ops] for write in record.writes],
            }

    def collect() -> None:
        for document in records():
            if settings.json:
                _emit(_dumps(document))
            else:
                position, verdict = document["position"], document["verdict"]
                state = position if position is not None else verdict
                ops_text = " | ".join(
                    ", ".join(_text(op) for op in write) for write in document["writes"]
                )
                _emit(
                    f"{state}\t{document['log_position']}\t{document['time']}\t"
                    f"{document['writer']}\t{ops_text}"
                )

    _guard(collect, settings.timeout)


@cli.command()
@pass_settings
def status(settings: Settings) -> None:
    """The topic's replicated state: position, records, tail, writer, readers, policies."""

    async def work() -> dict[str, Any]:
        topic = TopicName.parse(settings.need_topic())
        admin = settings.admin()
        try:
            code, _ = await admin.get(topic.rest_path + "/stats")
            if code == 404:
                raise BadInput(f"{topic} does not exist")
            stats = await admin.get_ok(topic.rest_path + "/stats")
            tail = await admin.last_position(topic)
            try:
                unchecked = await admin.check_topic(topic)
                policies = f"not checked (HTTP 403): {', '.join(unchecked)}" if unchecked else "ok"
            except (UnsafeTopicPolicyError, PartitionedTopicError) as exc:
                # Only a setting that loses history is exit 4; a broker's error (a 503, a
                # timeout) fails the command as any other (exit 3).
                policies = str(exc)
        finally:
            await admin.close()
        # The version: a replica counts the accepted records (a replay with raw ops).
        manager: SharedStateManager[None, bytes] = SharedStateManager(
            settings.service_url,
            str(topic),
            initial_state=lambda: None,
            apply=lambda state, op: state,
            codec=BytesCodec(),
            admin_url=settings.admin_url,
            authentication=settings.auth_token,
            copy_state=None,
            check_topic=False,
            open_timeout_s=settings.timeout,
            on_progress=_ReplayBar(),
        )
        async with manager:
            position, counters = manager.position, manager.stats
        publishers = stats.get("publishers", [])
        return {
            "topic": str(topic),
            "position": position,
            "records": counters.records_read,
            "records_rejected": counters.records_rejected,
            "bytes": counters.bytes_read,
            "tail": None if tail is None else f"{tail.ledger}:{tail.entry}",
            # The exclusive producer, if a writer holds it now: which client, since when.
            "writer": [
                {k: p.get(k) for k in ("producerName", "address", "connectedSince")}
                for p in publishers
            ]
            or None,
            "readers": sum(
                len(sub.get("consumers", [])) for sub in stats.get("subscriptions", {}).values()
            ),
            "storage_bytes": stats.get("storageSize"),
            "policies": policies,
        }

    report = _run(settings, work)
    if settings.json:
        _emit(_dumps(report))
    else:
        for name, value in report.items():
            _emit(f"{name}: {value if value is not None else '-'}")
    policies = report["policies"]
    if policies.startswith("not checked"):
        # A produce+consume role may not read policies (HTTP 403): nothing was found unsafe.
        _echo(
            f"pulsar-state: policies {policies}; `pulsar-state doctor` as an admin checks them",
            err=True,
        )
    elif policies != "ok":
        sys.exit(EXIT_UNSAFE)


# What the library needs of the broker, with why; compared with the broker's runtime settings.
REQUIRED_BROKER_SETTINGS: dict[str, tuple[str, str]] = {
    "defaultRetentionTimeInMinutes": ("-1", "readers hold no data: history would be trimmed"),
    "defaultRetentionSizeInMB": ("-1", "readers hold no data: history would be trimmed"),
    "brokerDeleteInactiveTopicsEnabled": ("false", "an idle state topic would be deleted"),
    "allowAutoTopicCreationType": ("non-partitioned", "state needs one log, one order"),
    "brokerServiceCompactionThresholdInBytes": ("0", "compaction would drop history"),
}


@cli.command()
@pass_settings
def doctor(settings: Settings) -> None:
    """Check the broker (and --topic's policies) against what the library needs.

    Prints each check and, for each failure, what to change. Exit 4 when one fails.
    """

    async def work() -> list[dict[str, Any]]:
        admin = settings.admin()
        checks: list[dict[str, Any]] = []
        try:
            runtime = await admin.get_ok("/admin/v2/brokers/configuration/runtime")
            for name, (wanted, why) in REQUIRED_BROKER_SETTINGS.items():
                actual = runtime.get(name)
                fine = actual is not None and str(actual).lower() == wanted
                checks.append(
                    {
                        "check": f"broker {name}",
                        "ok": fine,
                        "actual": actual,
                        "fix": None if fine else f"set {name}={wanted} in broker.conf ({why})",
                    }
                )
            if settings.topic:
                topic = TopicName.parse(settings.topic)
                try:
                    # Unlike an application's open, the doctor must read every policy.
                    await admin.check_topic(topic, require_policies=True)
                    checks.append(
                        {"check": f"topic {topic}", "ok": True, "actual": None, "fix": None}
                    )
                except PulsarStateError as exc:
                    checks.append(
                        {"check": f"topic {topic}", "ok": False, "actual": None, "fix": str(exc)}
                    )
        finally:
            await admin.close()
        return checks

    checks = _run(settings, work)
    for check in checks:
        if settings.json:
            _emit(_dumps(check))
        else:
            mark = "ok  " if check["ok"] else "FAIL"
            _emit(f"{mark} {check['check']}" + ("" if check["ok"] else f": {check['fix']}"))
    if not all(check["ok"] for check in checks):
        sys.exit(EXIT_UNSAFE)


@cli.group()
def snapshot() -> None:
    """The snapshots of a state topic (written by managers with a snapshot_codec)."""


async def _with_snapshots(settings: Settings, use: Callable[[Any], Awaitable[T]]) -> T:
    from pulsar_state._pulsar import PulsarConnection
    from pulsar_state._snapshots import SnapshotStore

    conn = PulsarConnection(
        settings.service_url,
        operation_timeout_s=settings.timeout,
        client_options=secured_client_options(None, settings.auth_token, None, None),
    )
    admin = settings.admin()
    try:
        store = SnapshotStore(
            conn,
            admin,
            TopicName.parse(settings.need_topic()),
            chunk_bytes=1024 * 1024,
            timeout_s=settings.timeout,
        )
        return await use(store)
    finally:
        await admin.close()
        await conn.close()


def _manifest_json(manifest: Any) -> dict[str, Any]:
    return {
        "snapshot_id": manifest.snapshot_id,
        "position": manifest.position,
        "size": manifest.size,
        "chunks": manifest.chunks,
        "digest": manifest.digest,
        "created_at": datetime.datetime.fromtimestamp(
            manifest.created_at, tz=datetime.UTC
        ).isoformat(timespec="seconds"),
        "writer": manifest.writer_id,
    }


@snapshot.command(name="list")
@pass_settings
def snapshot_list(settings: Settings) -> None:
    """The complete snapshots, oldest first (from ``<topic>-snapshot-index``)."""

    async def work(store: Any) -> list[dict[str, Any]]:
        return [_manifest_json(m) for m in await store.manifests()]

    manifests = _run(settings, lambda: _with_snapshots(settings, work))
    if settings.json:
        _emit(_dumps(manifests))
    else:
        for m in manifests:
            _emit(
                f"{m['snapshot_id']}\tposition {m['position']}\t{m['size']} bytes\t"
                f"{m['created_at']}"
            )


@snapshot.command(name="take")
@pass_settings
def snapshot_take(settings: Settings) -> None:
    """Write a snapshot of a PulsarMap now (with the map's codecs); prints its position."""

    async def work() -> int:
        async with await _open_map(settings) as state_map:
            return await state_map.snapshot(timeout=settings.timeout)

    position = _run(settings, work)
    if settings.json:
        _emit(_dumps({"position": position}))
    else:
        _emit(f"OK snapshot at position {position}")


@snapshot.command(name="verify")
@click.argument("snapshot_id", required=False)
@pass_settings
def snapshot_verify(settings: Settings, snapshot_id: str | None) -> None:
    """Read every snapshot (or SNAPSHOT_ID) and check its chunks and digest. Exit 3 if one fails.

    A snapshot whose chunks were deleted behind newer ones (``trim_history``) is "trimmed",
    not failed, when a newer one checks out: the index keeps its manifest until the index's
    own ledger is trimmed."""

    async def work(store: Any) -> list[dict[str, Any]]:
        everything = await store.manifests()
        manifests = everything
        if snapshot_id is not None:
            manifests = [m for m in everything if m.snapshot_id == snapshot_id]
            if not manifests:
                raise BadInput(f"no snapshot {snapshot_id} on {settings.need_topic()}")
        problems: dict[Any, str | None] = {}  # by manifest: None when it checked out

        async def problem_of(manifest: Any) -> str | None:
            if manifest not in problems:
                try:
                    await store.load(manifest)
                    problems[manifest] = None
                except PulsarStateError as exc:
                    problems[manifest] = f"{type(exc).__name__}: {exc}"
            return problems[manifest]

        async def trimmed(manifest: Any) -> bool:
            """Its first chunk is gone because the chunk topic now begins after it, and a
            newer snapshot of the same history checks out (trim_history keeps the newest)."""
            newer = [
                other
                for other in reversed(everything)
                # (the history's first record: it outlives trimming, unlike log_first_*)
                if other.position > manifest.position and other.log_origin == manifest.log_origin
            ]
            for other in newer:
                if await problem_of(other) is None:
                    with contextlib.suppress(PulsarStateError):
                        return bool(await store.chunks_trimmed(manifest))
                    return False
            return False

        results = []
        for manifest in manifests:
            problem = await problem_of(manifest)
            status = "ok" if problem is None else "failed"
            if problem is not None and await trimmed(manifest):
                status = "trimmed"
            results.append(
                {
                    **_manifest_json(manifest),
                    "ok": problem is None,
                    "status": status,
                    "error": problem,
                }
            )
        return results

    results = _run(settings, lambda: _with_snapshots(settings, work))
    for result in results:
        if settings.json:
            _emit(_dumps(result))
        else:
            verdict = {
                "ok": "ok",
                "trimmed": "trimmed (its chunks were deleted behind newer snapshots)",
            }.get(result["status"], f"FAIL {result['error']}")
            _emit(f"{result['snapshot_id']}\tposition {result['position']}\t{verdict}")
    failed = sum(result["status"] == "failed" for result in results)
    if failed:
        _fail(f"{failed} of {len(results)} snapshots failed verification", EXIT_FAILED)


def main() -> NoReturn:
    """The console script's entry point."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        # Under C/POSIX locales stdout's errors handler is surrogateescape: a lone surrogate
        # (JSON can carry one) went out as a raw byte, not UTF-8, and `load` refused the dump.
        # Strict, _echo writes its escape instead.
        sys.stdout.reconfigure(errors="strict")
    try:
        cli.main(prog_name="pulsar-state")
        code = EXIT_OK
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or EXIT_OK
        else:
            click.echo(exc.code, err=True)
            code = EXIT_FAILED
    except BrokenPipeError:  # the reader went away (| head): as a shell reports SIGPIPE
        code = EXIT_BROKEN_PIPE
    except Exception as exc:  # a bug of ours: still one line and an exit code, no traceback
        # Never a credential, whatever the error quotes (http.client quotes a bad header).
        detail = re.sub(r"Bearer\s+\S+", "Bearer <redacted>", str(exc))
        _echo(f"pulsar-state: internal error: {type(exc).__name__}: {detail}", err=True)
        code = EXIT_FAILED
    for bar in list(_ReplayBar.showing):
        bar.stop()
    # Everything is closed by now. The Pulsar C++ client can still abort (SIGABRT,
    # "terminate called without an active exception") while the interpreter tears its threads
    # down, about once in 30 runs here: that would replace the exit code scripts test. So
    # flush and leave without the teardown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
