"""Locks side by side: Ownership (this library) against ZooKeeper and etcd, in one run.

    python -m benchmarks.locks              full run (a few minutes)
    python -m benchmarks.locks --quick      fewer rounds
    python -m benchmarks.locks --only library zookeeper

Two figures per system, each from separate OS processes on this machine:

* **acquire + release, uncontended**: one process takes one lock and gives it back, in a loop.
* **handover**: process A holds the lock and process B waits in ``acquire`` (A first sees B's
  request registered: a waiting lease, a kazoo contender, an etcd lock key), for
  ``QUEUED_S`` (50 ms) more, as a holder goes on working while others queue; then A
  releases. The figure is the time from A's ``release`` call to B's ``acquire`` returning,
  both read from the system-wide monotonic clock.
* **handover at once**: the same, but A releases as soon as it sees B's request: the
  release races B's own registration still settling, a harder case than a lock that was
  waited for (for the library without the write relay: B giving the topic's writer back).
* **acquire + release after idle** (``--after-idle`` rounds): as the first figure, one round
  at a time, each after 0.5-1.5 s (``IDLE_S``, drawn uniformly, seeded) in which nothing
  runs: a lock taken now and then, as most are (caches cold, the library's writer given up
  or not). Drawn, not fixed, so that no system's own timers line up with the rounds.

The systems:

* ``library``: :class:`recipes.Ownership` (one table topic, one resource), ``acquire`` with
  its default keep-alive, then ``release``; its workers on asyncio's own event loop.
* ``library on uvloop``: the same, its workers on uvloop's event loop (skipped with a message
  when uvloop is not installed; the ``bench`` extra brings it).
* ``zookeeper``: ZooKeeper 3.8 (Debian package ``zookeeper``) with kazoo's ``Lock`` (the
  ``bench`` extra). Started here on a free port with ``forceSync=no``: the Pulsar standalone
  broker does not fsync either.
* ``etcd``: etcd 3.4 (Debian package ``etcd-server``), its v3 lock API over the HTTP/JSON
  gateway (``/v3/lock/lock`` and ``/v3/lock/unlock``, holding a lease granted once per process
  as a session does). etcd 3.4 has no switch to skip fsync, so its writes are synced.

All servers and worker processes are up together and the systems take turns, ten blocks of
a tenth of each figure's rounds (``--blocks``), their order rotating: a slower spell of the
machine weighs on every system alike. ``--blocks 1`` measures one system after the other.

A peer whose package (or kazoo) is missing is skipped with a message saying what to install.
Prints a table and adds a ``locks`` section to ``benchmarks/results.json`` (or ``--out``),
keeping the rest of that file. The target (issue 14): the library <= the faster peer.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.client
import json
import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.run import Metric, environment, percentile, table  # noqa: E402
from pulsar_state.testing import provide_broker  # noqa: E402

SYSTEMS = ("library", "zookeeper", "etcd")
# The library's workers run on asyncio's own event loop, and again on uvloop's when it is
# installed (the uvloop extra), under this label.
UVLOOP_LABEL = "library on uvloop"
LOCK_NAME = "bench"
ZOOKEEPER_JAR = Path(os.environ.get("ZOOKEEPER_JAR", "/usr/share/java/zookeeper.jar"))
# Every wait on a worker is bounded: a stuck peer fails the run instead of hanging it.
_REPLY_TIMEOUT_S = 120.0
_START_TIMEOUT_S = 60.0
# How long the waiter has queued before the holder releases, in the handover figure.
QUEUED_S = 0.05
# How long nothing runs before each round of the after-idle figure: drawn from this range.
IDLE_S = (0.5, 1.5)


def now() -> float:
    """CLOCK_MONOTONIC: one clock for every process on this machine (perf_counter may not be)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# ---------------------------------------------------------------- lock clients (in workers)


class LockClient(Protocol):
    """One process's handle on the lock. Async so that the library's event loop keeps running
    (renewals, handing its writer over when idle) while the worker waits for commands; the
    peers' clients block inside these methods, which is fine in a worker doing nothing else."""

    async def acquire(self) -> None: ...
    async def release(self) -> None: ...
    async def contenders(self) -> int:
        """Processes holding or waiting for the lock, as this client sees them now."""
        ...

    async def close(self) -> None: ...


class LibraryLock:
    """Ownership awaited directly on the worker's event loop (no sync facade, no thread hop)."""

    def __init__(
        self, service_url: str, admin_url: str, topic: str, options: dict[str, Any]
    ) -> None:
        from recipes import Ownership

        self._owners = Ownership(
            service_url,
            topic,
            admin_url=admin_url,
            write_timeout_s=_REPLY_TIMEOUT_S,
            read_timeout_s=_REPLY_TIMEOUT_S,
            open_timeout_s=_REPLY_TIMEOUT_S,
            **options,
        )
        self._lease: Any = None

    async def open(self) -> None:
        await self._owners.open()

    async def acquire(self) -> None:
        self._lease = await self._owners.acquire(LOCK_NAME, ttl=30.0)

    async def release(self) -> None:
        await self._owners.release(self._lease)
        self._lease = None

    async def contenders(self) -> int:
        # The local replica (no I/O): the waiter's request shows once its record is read.
        return int(
            self._owners.read_local(
                lambda table: sum(LOCK_NAME in lease.names for lease in table.leases.values())
            )
        )

    async def close(self) -> None:
        await self._owners.aclose()


class ZooKeeperLock:
    def __init__(self, hosts: str, path: str) -> None:
        from kazoo.client import KazooClient

        self._zk = KazooClient(hosts=hosts, timeout=30.0)
        self._zk.start(timeout=_START_TIMEOUT_S)
        self._lock = self._zk.Lock(path, f"pid-{os.getpid()}")

    async def acquire(self) -> None:
        if not self._lock.acquire(timeout=_REPLY_TIMEOUT_S):
            raise TimeoutError("kazoo Lock.acquire timed out")

    async def release(self) -> None:
        self._lock.release()

    async def contenders(self) -> int:
        return len(self._lock.contenders())

    async def close(self) -> None:
        self._zk.stop()
        self._zk.close()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class EtcdLock:
    """etcd's v3 lock service through its HTTP/JSON gateway, on one kept-alive connection."""

    def __init__(self, host: str, port: int) -> None:
        self._http = http.client.HTTPConnection(host, port, timeout=_REPLY_TIMEOUT_S)
        # One lease per process for all its locks, as etcd's concurrency.Session keeps one;
        # long enough for the run, so no keepalive stream is needed here.
        self._lease_id = int(self._post("/v3/lease/grant", {"TTL": 900})["ID"])
        self._key: str | None = None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self._http.request(
            "POST", path, json.dumps(body), headers={"Content-Type": "application/json"}
        )
        response = self._http.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"etcd {path}: HTTP {response.status} {data[:300]!r}")
        reply: dict[str, Any] = json.loads(data)
        return reply

    async def acquire(self) -> None:
        reply = self._post("/v3/lock/lock", {"name": _b64(LOCK_NAME), "lease": self._lease_id})
        self._key = reply["key"]

    async def release(self) -> None:
        self._post("/v3/lock/unlock", {"key": self._key})
        self._key = None

    async def contenders(self) -> int:
        # The lock service keeps one key per contender under "<name>/".
        prefix, end = f"{LOCK_NAME}/", f"{LOCK_NAME}0"  # "0" is the byte after "/"
        reply = self._post(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end), "count_only": True}
        )
        return int(reply.get("count", 0))

    async def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            self._post("/v3/lease/revoke", {"ID": self._lease_id})
        self._http.close()


async def make_client(system: str, target: dict[str, Any]) -> LockClient:
    if system == "library":
        library = LibraryLock(
            target["service_url"], target["admin_url"], target["topic"], target["options"]
        )
        await library.open()
        return library
    if system == "zookeeper":
        return ZooKeeperLock(target["hosts"], target["path"])
    if system == "etcd":
        return EtcdLock(target["host"], target["port"])
    raise ValueError(f"unknown system {system!r}")


async def serve(client: LockClient, conn: Connection) -> None:
    """Run the coordinator's commands until "stop"."""
    while True:
        # Off the loop: the library's background work goes on while this waits.
        command, argument = await asyncio.to_thread(conn.recv)
        if command == "stop":
            return
        if command == "uncontended":
            durations = []
            for _ in range(argument):
                started = now()
                await client.acquire()
                await client.release()
                durations.append(now() - started)
            conn.send(("ok", durations))
        elif command == "hold":
            await client.acquire()
            conn.send(("ok", None))
        elif command == "release-when-contended":
            deadline = now() + _REPLY_TIMEOUT_S
            while await client.contenders() < 2:
                if now() > deadline:
                    raise TimeoutError("the waiter's request never showed up")
                await asyncio.sleep(0.001)
            if argument:
                await asyncio.sleep(argument)  # the holder works on while the waiter queues
            released_at = now()
            await client.release()
            conn.send(("ok", released_at))
        elif command == "wait":
            await client.acquire()
            acquired_at = now()
            await client.release()
            conn.send(("ok", acquired_at))
        else:
            raise ValueError(f"unknown command {command!r}")


async def _work(system: str, target: dict[str, Any], conn: Connection) -> None:
    client = await make_client(system, target)
    conn.send(("ready", None))
    try:
        await serve(client, conn)
    finally:
        await client.close()


def worker(system: str, target: dict[str, Any], conn: Connection) -> None:
    """One process's side of the protocol: commands in, results (or the error) out."""
    try:
        with asyncio.Runner(loop_factory=_loop_factory(target.get("loop", "asyncio"))) as runner:
            runner.run(_work(system, target, conn))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None  # asyncio's own


def uvloop_missing() -> str | None:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "uvloop is not installed (pip install -e '.[uvloop]')"
    return None


class Worker:
    """A worker process and the coordinator's end of its pipe."""

    def __init__(self, system: str, target: dict[str, Any]) -> None:
        self.system = system
        context = multiprocessing.get_context("spawn")  # no fork of pulsar-client's threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=worker, args=(system, target, child), daemon=True)
        self._process.start()
        child.close()
        self.reply()

    def send(self, command: str, argument: Any = None) -> None:
        self._conn.send((command, argument))

    def reply(self) -> Any:
        if not self._conn.poll(_REPLY_TIMEOUT_S):
            raise TimeoutError(f"{self.system} worker: no reply in {_REPLY_TIMEOUT_S}s")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.system} worker failed:\n{value}")
        return value

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(("stop", None))
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


# ---------------------------------------------------------------- measuring


@dataclass
class SystemResult:
    system: str
    uncontended_p50_ms: float
    uncontended_p99_ms: float
    handover_p50_ms: float
    handover_p99_ms: float
    uncontended_rounds: int
    handover_rounds: int
    handover_at_once_p50_ms: float = 0.0
    handover_at_once_p99_ms: float = 0.0
    after_idle_p50_ms: float = 0.0
    after_idle_rounds: int = 0


@dataclass(frozen=True)
class Rounds:
    """How many rounds of each figure a system makes: ``uncontended`` acquire+release,
    ``handovers`` of each kind, ``after_idle`` acquire+release each after 0.5-1.5 s of
    nothing; ``warmup`` acquire+release rounds (and a hundredth as many handovers of each
    kind) before any is measured."""

    uncontended: int
    handovers: int
    after_idle: int = 0
    warmup: int = 0

    def share(self, blocks: int, block: int) -> Rounds:
        """Block ``block``'s share (of ``blocks``) of each figure's rounds."""

        def part(total: int) -> int:
            return total // blocks + (1 if block < total % blocks else 0)

        return Rounds(part(self.uncontended), part(self.handovers), part(self.after_idle))


class Pair:
    """One system's holder and waiter processes, and the times they measured so far."""

    def __init__(self, system: str, target: dict[str, Any], label: str = "") -> None:
        self.label = label or system
        self.holder = Worker(system, target)
        try:
            self.waiter = Worker(system, target)
        except BaseException:
            self.holder.stop()
            raise
        self.alone: list[float] = []
        self.gaps: dict[float, list[float]] = {QUEUED_S: [], 0: []}
        self.after_idle: list[float] = []
        # Seeded by the system: the library's variants (its loops, its settings) wait out the
        # same pauses, so their after-idle figures differ by the variant alone.
        self._idle_draws = random.Random(f"after-idle {system}")

    def warm(self, warmup: int) -> None:
        # The same warm-up for every system (connections, caches, a JVM's compiled paths):
        # servers run for long in production, and each is measured warm.
        self.holder.send("uncontended", max(3, warmup))
        self.holder.reply()
        for queued in (QUEUED_S, 0):
            handover_gaps(self.holder, self.waiter, max(1, warmup // 100), queued)

    def measure(self, rounds: Rounds) -> None:
        self.holder.send("uncontended", rounds.uncontended)
        self.alone += self.holder.reply()
        for queued in (QUEUED_S, 0):
            self.gaps[queued] += handover_gaps(self.holder, self.waiter, rounds.handovers, queued)
        for _ in range(rounds.after_idle):
            # Nothing else runs meanwhile: the coordinator waits here.
            time.sleep(self._idle_draws.uniform(*IDLE_S))
            self.holder.send("uncontended", 1)
            self.after_idle += self.holder.reply()

    def stop(self) -> None:
        self.holder.stop()
        self.waiter.stop()

    def result(self) -> SystemResult:
        ms = 1000.0
        alone, gaps, after_idle = self.alone, self.gaps, self.after_idle
        return SystemResult(
            self.label,
            percentile(alone, 0.5) * ms,
            percentile(alone, 0.99) * ms,
            percentile(gaps[QUEUED_S], 0.5) * ms,
            percentile(gaps[QUEUED_S], 0.99) * ms,
            len(alone),
            len(gaps[QUEUED_S]),
            percentile(gaps[0], 0.5) * ms,
            percentile(gaps[0], 0.99) * ms,
            percentile(after_idle, 0.5) * ms if after_idle else 0.0,
            len(after_idle),
        )


def measure(system: str, target: dict[str, Any], rounds: Rounds, label: str = "") -> SystemResult:
    """One system alone: warmed up, then measured in one go."""
    pair = Pair(system, target, label)
    try:
        pair.warm(rounds.warmup)
        pair.measure(rounds)
    finally:
        pair.stop()
    return pair.result()


def measure_interleaved(
    pairs: Sequence[Pair], rounds: Rounds, blocks: int, say: Callable[[str], None]
) -> None:
    """Every system warmed up, then measured in ``blocks`` rounds, a share of each figure's
    rounds per block, the systems' order rotating: a machine that is slower for a while
    (another VM, the broker's JIT, a page-cache flush) weighs on all of them alike, not on
    whichever was measured then."""
    for pair in pairs:
        say(f"... {pair.label}: warming up")
        pair.warm(rounds.warmup)
    for block in range(blocks):
        turn = block % len(pairs)
        for pair in [*pairs[turn:], *pairs[:turn]]:
            pair.measure(rounds.share(blocks, block))
        say(f"... block {block + 1}/{blocks} measured")


def handover_gaps(holder: Worker, waiter: Worker, rounds: int, queued: float) -> list[float]:
    """Seconds from the holder's release to the waiter's grant, ``rounds`` times; the holder
    releases ``queued`` seconds after it sees the waiter's request."""
    gaps = []
    for _ in range(rounds):
        holder.send("hold")
        holder.reply()
        waiter.send("wait")
        holder.send("release-when-contended", queued)
        released_at = holder.reply()
        acquired_at = waiter.reply()
        gaps.append(acquired_at - released_at)
    return gaps


def two_sends_p50_ms(service_url: str, rounds: int) -> float:
    """The floor under the library's acquire+release: two sequential sends of a raw
    pulsar-client producer (the library's acquire and release are one record each)."""
    import pulsar

    client = pulsar.Client(
        service_url,
        operation_timeout_seconds=60,
        logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn),  # not its INFO lines
    )
    try:
        producer = client.create_producer(
            f"persistent://public/default/lockbench-raw-{uuid.uuid4().hex[:8]}",
            batching_enabled=False,
        )
        payload = b"x" * 200  # about the size of an acquire record
        for _ in range(10):
            producer.send(payload)
        durations = []
        for _ in range(rounds):
            started = now()
            producer.send(payload)
            producer.send(payload)
            durations.append(now() - started)
        return percentile(durations, 0.5) * 1000.0
    finally:
        client.close()


def _floor_reader(service_url: str, topic: str, rounds: int, conn: Connection) -> None:
    """The receiving side of :func:`handover_floor_p50_ms`: when each message reaches this
    process's event loop, on the system-wide monotonic clock."""
    import pulsar
    import pulsar.asyncio

    async def read() -> list[float]:
        client = pulsar.asyncio.Client(
            service_url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn)
        )
        reader = await client.create_reader(topic, pulsar.MessageId.latest)
        conn.send("ready")
        arrived = []
        for _ in range(rounds):
            await reader.read_next()
            arrived.append(now())
        return arrived

    arrived = asyncio.run(read())
    conn.send(arrived)
    os._exit(0)  # no client close at exit: see pulsar_state._pulsar (exit crashes)


def handover_floor_p50_ms(service_url: str, rounds: int, queued: float) -> float:
    """The floor under the library's handover: a raw pulsar-client producer sends one message
    after ``queued`` seconds idle (as the holder's release comes after its waiting), and a raw
    reader in another process has it in its event loop; the time between, p50. ZooKeeper's
    whole handover is one write, one notification and one read, so this shows how much of
    the gap between the two is Pulsar's own path (append, then dispatch to readers)."""
    import pulsar

    topic = f"persistent://public/default/lockbench-floor-{uuid.uuid4().hex[:8]}"
    client = pulsar.Client(
        service_url,
        operation_timeout_seconds=60,
        logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn),
    )
    context = multiprocessing.get_context("spawn")  # no fork of pulsar-client's threads
    conn, child = context.Pipe()
    reader = context.Process(
        target=_floor_reader, args=(service_url, topic, rounds, child), daemon=True
    )
    try:
        producer = client.create_producer(topic, batching_enabled=False)
        reader.start()
        if not conn.poll(_REPLY_TIMEOUT_S):
            raise TimeoutError("the floor's reader did not start")
        conn.recv()
        sent = []
        for _ in range(rounds):
            time.sleep(queued)
            sent.append(now())
            producer.send(b"x" * 200)
        if not conn.poll(_REPLY_TIMEOUT_S):
            raise TimeoutError("the floor's reader did not get every message")
        arrived: list[float] = conn.recv()
        return percentile([a - s for s, a in zip(sent, arrived, strict=True)], 0.5) * 1000.0
    finally:
        reader.join(_REPLY_TIMEOUT_S)
        if reader.is_alive():
            reader.kill()
        client.close()


def python_after_idle_us(rounds: int, idle: float) -> tuple[float, float]:
    """How long a fixed bit of Python (a lease op's JSON round trip and a CRC, as a replica
    does per record) takes back to back and right after ``idle`` seconds of sleep, p50 in
    microseconds. On a machine whose caches are cold after a short idle (a small VM shared
    with others), the second is many times the first, and every process on a handover's path
    (the holder, the broker, the waiter) pays it: it scales what the library's own Python
    adds to the raw floor."""
    import zlib

    op = json.dumps({"op": "release", "id": uuid.uuid4().hex, "now": time.time()})

    def work() -> float:
        started = now()
        data = json.dumps(json.loads(op), separators=(",", ":"), sort_keys=True).encode()
        zlib.crc32(data)
        return now() - started

    hot = [work() for _ in range(rounds)]
    cold = []
    for _ in range(rounds):
        time.sleep(idle)
        cold.append(work())
    return percentile(hot, 0.5) * 1e6, percentile(cold, 0.5) * 1e6


# ---------------------------------------------------------------- peers (servers started here)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_until(check: Callable[[], bool], what: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} while starting")
        with contextlib.suppress(OSError):
            if check():
                return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not start within {_START_TIMEOUT_S}s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def zookeeper_missing() -> str | None:
    if shutil.which("java") is None or not ZOOKEEPER_JAR.exists():
        return f"no ZooKeeper ({ZOOKEEPER_JAR} or java missing): apt-get install zookeeper"
    try:
        import kazoo  # noqa: F401
    except ImportError:
        return "kazoo is not installed: pip install 'pulsar-state[bench]'"
    return None


def etcd_missing() -> str | None:
    if shutil.which("etcd") is None:
        return "no etcd binary: apt-get install etcd-server"
    return None


@contextlib.contextmanager
def zookeeper_server() -> Iterator[dict[str, Any]]:
    """A standalone ZooKeeper on a free port, in a temp dir removed afterwards."""
    home = Path(tempfile.mkdtemp(prefix="lockbench-zk-"))
    port = free_port()
    config = home / "zoo.cfg"
    config.write_text(
        f"tickTime=2000\ndataDir={home / 'data'}\nclientPort={port}\n"
        "clientPortAddress=127.0.0.1\nadmin.enableServer=false\nmaxClientCnxns=0\n"
        # The Pulsar standalone broker does not fsync: compare like with like.
        "forceSync=no\n"
    )
    with (home / "server.log").open("wb") as log:
        process = subprocess.Popen(
            [
                "java",
                "-Xmx256m",
                "-cp",
                str(ZOOKEEPER_JAR),
                "org.apache.zookeeper.server.ZooKeeperServerMain",
                str(config),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=home,
        )
    try:

        def serving() -> bool:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
                conn.sendall(b"srvr")
                return b"Mode" in conn.recv(4096)

        _wait_until(serving, "ZooKeeper", process)
        yield {"hosts": f"127.0.0.1:{port}", "path": f"/lockbench/{uuid.uuid4().hex[:8]}"}
    finally:
        _stop(process)
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def etcd_server() -> Iterator[dict[str, Any]]:
    """A one-member etcd on free ports, in a temp dir removed afterwards."""
    home = Path(tempfile.mkdtemp(prefix="lockbench-etcd-"))
    client, peer = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    with (home / "server.log").open("wb") as log:
        process = subprocess.Popen(
            [
                "etcd",
                "--name=lockbench",
                f"--data-dir={home / 'data'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=lockbench={peer_url}",
                "--initial-cluster-state=new",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=home,
        )
    try:

        def healthy() -> bool:
            conn = http.client.HTTPConnection("127.0.0.1", client, timeout=2)
            try:
                conn.request("GET", "/health")
                return b"true" in conn.getresponse().read()
            finally:
                conn.close()

        _wait_until(healthy, "etcd", process)
        yield {"host": "127.0.0.1", "port": client}
    finally:
        _stop(process)
        shutil.rmtree(home, ignore_errors=True)


# ---------------------------------------------------------------- runner


def run(
    systems: list[str],
    *,
    service_url: str | None,
    admin_url: str | None,
    rounds: Rounds,
    say: Callable[[str], None],
    idle_release_s: Sequence[float] = (),
    without_relay: bool = False,
    floor: dict[str, float] | None = None,
    blocks: int = 1,
) -> tuple[list[SystemResult], dict[str, str]]:
    """Measure the systems; returns the results and, for each system or library variant
    skipped (a peer or uvloop not installed), the reason.

    ``blocks`` > 1: every system's server and worker processes are up together and the
    systems take turns, ``blocks`` times (see :func:`measure_interleaved`); 1: each system
    is started, measured and stopped in turn.

    With the library, ``floor`` gets :func:`two_sends_p50_ms` (``pulsar_two_sends_p50_ms``),
    :func:`handover_floor_p50_ms` (``pulsar_handover_p50_ms``) and
    :func:`python_after_idle_us` (``python_op_us``, ``python_op_after_idle_us``).

    Each ``idle_release_s`` adds a run of the library with that manager setting (how long a
    process keeps the topic's writer after its last write), labelled with it;
    ``without_relay`` one with ``relay_writes=False`` (every write takes the writer itself).
    """
    skipped: dict[str, str] = {}
    blocks = max(1, min(blocks, rounds.uncontended, rounds.handovers))
    with contextlib.ExitStack() as servers:
        # (system, target, label) of every system to measure, its server started.
        entries: list[tuple[str, dict[str, Any], str]] = []
        broker = None
        for system in systems:
            if system == "library":
                broker = provide_broker(service_url, admin_url)
                servers.callback(broker.stop)
                if (missing := uvloop_missing()) is not None:
                    say(f"... {UVLOOP_LABEL}: SKIPPED: {missing}")
                    skipped[UVLOOP_LABEL] = missing
                variants = _library_variants(idle_release_s, without_relay, missing is None)
                for label, options in variants:
                    loop = options.pop("loop", "asyncio")
                    target = {
                        "service_url": broker.service_url,
                        "admin_url": broker.admin_url,
                        "topic": f"persistent://public/default/lockbench-{uuid.uuid4().hex[:8]}",
                        "options": options,
                        "loop": loop,
                    }
                    entries.append((system, target, label))
                continue
            missing = zookeeper_missing() if system == "zookeeper" else etcd_missing()
            if missing:
                say(f"... {system}: SKIPPED: {missing}")
                skipped[system] = missing
                continue
            if blocks > 1:  # else started when its turn comes, and stopped after
                entries.append((system, servers.enter_context(peer_server(system)), system))
            else:
                entries.append((system, {}, system))
        if blocks > 1:
            results = _interleaved(entries, rounds, blocks, say)
        else:
            results = []
            for system, target, label in entries:
                say(f"... {label}{' (Ownership)' if system == 'library' else ''}")
                if system == "library":
                    results.append(measure(system, target, rounds, label))
                    continue
                with peer_server(system) as peer:
                    results.append(measure(system, peer, rounds))
        if floor is not None and broker is not None:
            _measure_floors(broker.service_url, rounds, floor, say)
    return results, skipped


def peer_server(system: str) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """The peer's server, started on entry (its target for the workers), stopped on exit."""
    return zookeeper_server() if system == "zookeeper" else etcd_server()


def _library_variants(
    idle_release_s: Sequence[float], without_relay: bool, on_uvloop: bool
) -> list[tuple[str, dict[str, Any]]]:
    variants: list[tuple[str, dict[str, Any]]] = [("library", {})]
    if on_uvloop:
        variants.append((UVLOOP_LABEL, {"loop": "uvloop"}))
    variants += [
        (f"library idle_release_s={idle:g}", {"idle_release_s": idle}) for idle in idle_release_s
    ]
    if without_relay:
        variants.append(("library relay_writes=False", {"relay_writes": False}))
    return variants


def _interleaved(
    entries: list[tuple[str, dict[str, Any], str]],
    rounds: Rounds,
    blocks: int,
    say: Callable[[str], None],
) -> list[SystemResult]:
    pairs: list[Pair] = []
    try:
        for system, target, label in entries:
            say(f"... {label}: starting its two worker processes")
            pairs.append(Pair(system, target, label))
        measure_interleaved(pairs, rounds, blocks, say)
    finally:
        for pair in pairs:
            pair.stop()
    return [pair.result() for pair in pairs]


def _measure_floors(
    service_url: str, rounds: Rounds, floor: dict[str, float], say: Callable[[str], None]
) -> None:
    say("... raw pulsar-client: two sequential sends (the floor)")
    floor["pulsar_two_sends_p50_ms"] = two_sends_p50_ms(service_url, rounds.uncontended)
    say(
        f"... raw pulsar-client: a send after {QUEUED_S * 1000:g} ms idle, "
        "read by another process (the handover's floor)"
    )
    floor["pulsar_handover_p50_ms"] = handover_floor_p50_ms(service_url, rounds.handovers, QUEUED_S)
    hot, after_idle = python_after_idle_us(rounds.handovers, QUEUED_S)
    floor["python_op_us"], floor["python_op_after_idle_us"] = hot, after_idle


def metrics(results: list[SystemResult], skipped: dict[str, str]) -> list[Metric]:
    """The library (and the library on uvloop, when measured) against the faster peer, one
    Metric per figure."""
    by_system = {r.system: r for r in results}
    peers = [r for r in results if not r.system.startswith("library")]
    out = []
    figures = [
        ("uncontended_p50_ms", "lock acquire+release uncontended p50"),
        ("uncontended_p99_ms", "lock acquire+release uncontended p99"),
        ("handover_p50_ms", "lock handover to a waiting process p50"),
        ("handover_p99_ms", "lock handover to a waiting process p99"),
        ("handover_at_once_p50_ms", "lock handover, released as the waiter queues, p50"),
        ("handover_at_once_p99_ms", "lock handover, released as the waiter queues, p99"),
    ]
    for name, suffix in (("library", ""), (UVLOOP_LABEL, " (uvloop)")):
        library = by_system.get(name)
        if library is None:
            continue
        shown = list(figures)
        if library.after_idle_rounds:
            shown.append(("after_idle_p50_ms", "lock acquire+release after 0.5-1.5 s idle p50"))
        for field_name, label in shown:
            out.append(_against_peers(library, peers, results, skipped, field_name, label + suffix))
    return out


def _against_peers(
    library: SystemResult,
    peers: list[SystemResult],
    results: list[SystemResult],
    skipped: dict[str, str],
    field_name: str,
    label: str,
) -> Metric:
    mine = float(getattr(library, field_name))
    details: dict[str, Any] = {r.system: getattr(r, field_name) for r in results}
    details["load average"] = os.getloadavg()[0]
    details.update({f"{name} skipped": why for name, why in skipped.items()})
    if peers:
        best = min(peers, key=lambda r: float(getattr(r, field_name)))
        baseline = float(getattr(best, field_name))
        note = f"baseline: the faster peer ({best.system})"
    else:
        baseline, note = 0.0, "no peer measured"
    return Metric(
        label,
        "ms",
        mine,
        baseline,
        "<= the faster peer",
        bool(peers) and mine <= baseline,
        ratio=mine / baseline if baseline else 0.0,
        note=note,
        details=details,
    )


def side_by_side(results: list[SystemResult]) -> str:
    width = max([12, *(len(r.system) for r in results)])
    lines = [
        f"{'system':<{width}} {'acq+rel p50':>12} {'acq+rel p99':>12} "
        f"{'handover p50':>13} {'handover p99':>13} {'at once p50':>12} {'at once p99':>12}"
        f" {'after idle p50':>14}  rounds (alone/handover/after idle)"
    ]
    for r in results:
        lines.append(
            f"{r.system:<{width}} {r.uncontended_p50_ms:>9.2f} ms {r.uncontended_p99_ms:>9.2f} ms "
            f"{r.handover_p50_ms:>10.2f} ms {r.handover_p99_ms:>10.2f} ms "
            f"{r.handover_at_once_p50_ms:>9.2f} ms {r.handover_at_once_p99_ms:>9.2f} ms "
            f"{r.after_idle_p50_ms:>11.2f} ms  "
            f"{r.uncontended_rounds}/{r.handover_rounds}/{r.after_idle_rounds}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--only", nargs="*", choices=SYSTEMS)
    parser.add_argument("--uncontended", type=int, help="acquire+release rounds per system")
    parser.add_argument("--handovers", type=int, help="handover rounds per system")
    parser.add_argument(
        "--after-idle",
        type=int,
        help="acquire+release rounds per system, each after 0.5-1.5 s idle (default 20; "
        "--quick: 4)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        help="acquire+release rounds each system makes before it is measured (default: 4 "
        "times --uncontended; a hundredth as many handovers of each kind)",
    )
    parser.add_argument(
        "--idle-release-s",
        type=float,
        nargs="*",
        default=[],
        help="also run the library with these idle_release_s settings",
    )
    parser.add_argument(
        "--without-relay",
        action="store_true",
        help="also run the library with relay_writes=False",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=10,
        help="measure the systems in turns, this many (all servers up together, the order "
        "rotating), so that a slower spell of the machine weighs on all alike; 1: one "
        "system after the other (default: 10)",
    )
    parser.add_argument("--pulsar-url", default=os.environ.get("PULSAR_SERVICE_URL"))
    parser.add_argument("--pulsar-admin-url", default=os.environ.get("PULSAR_ADMIN_URL"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results.json"))
    args = parser.parse_args(argv)
    uncontended = args.uncontended or (100 if args.quick else 500)
    handovers = args.handovers or (30 if args.quick else 200)
    after_idle = (4 if args.quick else 20) if args.after_idle is None else args.after_idle
    warmup = 4 * uncontended if args.warmup is None else args.warmup
    systems = args.only or list(SYSTEMS)
    floor: dict[str, float] = {}
    results, skipped = run(
        systems,
        service_url=args.pulsar_url,
        admin_url=args.pulsar_admin_url,
        rounds=Rounds(uncontended, handovers, after_idle, warmup),
        say=lambda line: print(line, file=sys.stderr, flush=True),
        idle_release_s=args.idle_release_s,
        without_relay=args.without_relay,
        floor=floor,
        blocks=args.blocks,
    )
    print(side_by_side(results))
    for name, value in floor.items():
        print(f"{name}: {value:.2f} {'us' if name.endswith('_us') else 'ms'}")
    found = metrics(results, skipped)
    if found:
        print()
        print(table(found))
    for system, why in skipped.items():
        print(f"skipped {system}: {why}")
    out = Path(args.out)
    document: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    document["locks"] = {
        "mode": "quick" if args.quick else "full",
        "warmup_rounds": warmup,
        "blocks": max(1, min(args.blocks, uncontended, handovers)),
        # Other work on this machine's 2 cores shows in the tails: record how busy it was.
        "environment": {**environment(), "load_average_1m": os.getloadavg()[0]},
        "systems": [asdict(r) for r in results],
        "skipped": skipped,
        "floor": floor,
        "metrics": [asdict(m) for m in found],
    }
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote the locks section of {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
