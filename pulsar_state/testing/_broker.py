"""Getting a real Apache Pulsar broker for a test session.

In order of preference:
1. a broker the user names (``--pulsar-url`` / ``PULSAR_SERVICE_URL``, admin URL alongside);
2. a Docker engine, if one answers: the official image, started through the Docker SDK
   (the ``docker`` extra);
3. the official broker from Maven Central, through the ``scripts/pulsar-standalone`` script of
   a pulsar-state checkout (found beside this package in a checkout, or named by
   ``--pulsar-standalone`` / ``PULSAR_STANDALONE_SCRIPT``).

No fake, mock or in-memory broker exists here: if none of these works the session fails.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._admin import default_admin_url

__all__ = [
    "DOCKER_IMAGE",
    "REGISTRATION_LINES_MAX",
    "SETTINGS",
    "Broker",
    "BrokerUnavailable",
    "admin_request",
    "broker_settings",
    "http_ok",
    "is_ready",
    "provide_broker",
    "standalone_script",
    "wait_ready",
]

logger = logging.getLogger(__name__)

# The checkout this package sits in, when it does (an editable install or a source tree).
_CHECKOUT = Path(__file__).resolve().parents[2]
# More log lines naming the bookie registration since a start than this means it flaps (the
# restart livelock of BookKeeper 4.17.2); scripts/pulsar-standalone uses the same default.
REGISTRATION_LINES_MAX = 100
SETTINGS = Path(__file__).resolve().with_name("broker-settings.env")
DOCKER_IMAGE = "apachepulsar/pulsar:4.0.7"


class BrokerUnavailable(RuntimeError):
    """No broker could be had; the message says what was tried and how to fix it."""


def standalone_script(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The ``scripts/pulsar-standalone`` to run: ``explicit``, else ``PULSAR_STANDALONE_SCRIPT``,
    else the one of the checkout this package sits in. An installed package has no checkout:
    then the error says how to name one."""
    named = explicit or os.environ.get("PULSAR_STANDALONE_SCRIPT")
    script = Path(named) if named else _CHECKOUT / "scripts" / "pulsar-standalone"
    if not os.access(script, os.X_OK):
        where = f"{script} (from {'the option' if explicit else 'PULSAR_STANDALONE_SCRIPT'})"
        raise BrokerUnavailable(
            f"no executable pulsar-standalone script at {where if named else script}: an "
            "installed pulsar-state has none. Give a broker with --pulsar-url (or "
            "PULSAR_SERVICE_URL), run Docker, or point --pulsar-standalone (or "
            "PULSAR_STANDALONE_SCRIPT) at scripts/pulsar-standalone in a pulsar-state checkout"
        )
    return script


def http_ok(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def is_ready(admin_url: str) -> bool:
    return http_ok(f"{admin_url}/admin/v2/brokers/ready") and http_ok(
        f"{admin_url}/admin/v2/namespaces/public/default"
    )


def wait_ready(admin_url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not is_ready(admin_url):
        if time.monotonic() > deadline:
            raise BrokerUnavailable(f"broker at {admin_url} not ready after {timeout}s")
        time.sleep(0.5)


def broker_settings() -> dict[str, str]:
    settings = {}
    for line in SETTINGS.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            settings[key] = value
    return settings


@dataclass
class Broker:
    """A running broker. ``controllable`` brokers can be killed and restarted by fault tests."""

    service_url: str
    admin_url: str
    kind: str  # "external" | "docker" | "standalone"
    started_here: bool = False
    env: dict[str, str] = field(default_factory=dict)
    container: Any = None
    started_at: float = field(default_factory=time.time)
    script: Path | None = None  # scripts/pulsar-standalone, for a standalone broker

    @property
    def controllable(self) -> bool:
        return self.kind in ("docker", "standalone")

    def _script(self, *args: str, timeout: float = 300.0) -> str:
        script = self.script or standalone_script()
        result = subprocess.run(
            [str(script), *args],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise BrokerUnavailable(
                f"scripts/pulsar-standalone {' '.join(args)} failed:\n{result.stderr[-3000:]}"
            )
        return result.stdout

    def kill(self) -> None:
        """SIGKILL the broker (data stays on disk)."""
        if self.kind == "standalone":
            self._script("kill")
        elif self.kind == "docker":
            self.container.kill(signal="SIGKILL")
        else:
            raise BrokerUnavailable(
                "fault tests need a broker started by this test session; an external broker "
                "was given (--pulsar-url). Deselect them with -m 'not fault'."
            )

    def start(self) -> None:
        if self.kind == "standalone":
            # The script's start returns only after a real write and read-back on a fresh topic
            # and fails when the bookie registration flaps; /ready alone passes on a broker whose
            # bookie is unusable.
            self._script("start")
        elif self.kind == "docker":
            self.started_at = time.time()
            self.container.start()
            wait_ready(self.admin_url)
        else:
            wait_ready(self.admin_url)

    def wait_ready(self) -> None:
        """Wait until the broker serves; for a standalone broker, a real write and read-back."""
        if self.kind == "standalone":
            self._script("start")  # on a running broker: only its readiness check
        else:
            wait_ready(self.admin_url)

    def registration_lines(self) -> int:
        """Broker log lines naming the bookie registration (``/ledgers/available/``) since the
        last start: a handful when healthy, thousands when the registration flaps."""
        if self.kind == "standalone":
            return int(self._script("registrations").strip())
        if self.kind == "docker":
            # Untested here (no Docker engine): the image's standalone logs to the console.
            logs = self.container.logs(since=int(self.started_at)).decode(errors="replace")
            return sum("/ledgers/available/" in line for line in logs.splitlines())
        raise BrokerUnavailable("the log of an external broker (--pulsar-url) is not readable")

    def classpath_jar(self, prefix: str) -> Path:
        """The jar whose file name starts with ``prefix`` on the running standalone broker's
        classpath (read from the process itself, not from the script's settings)."""
        if self.kind != "standalone":
            raise BrokerUnavailable("only a standalone broker's classpath is readable")
        pid = (Path(self.env["PULSAR_HOME"]) / "broker.pid").read_text().strip()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        classpath = argv[argv.index("-cp") + 1]
        jars = [
            jar
            for entry in classpath.split(":")
            for jar in sorted(Path(entry).parent.glob(Path(entry).name))
            if jar.name.startswith(prefix)
        ]
        if len(jars) != 1:
            raise AssertionError(f"expected one {prefix}* jar on {classpath}, found {jars}")
        return jars[0]

    def warm_up(self, budget_s: float = 90.0) -> float:
        """Exercise a broker just started until it answers at its usual speed; returns the
        seconds spent (at most about ``budget_s``).

        A broker's first topics and messages are slow while its JVM warms up (measured on
        the bundled standalone within a minute of its start: a producer created in 5 s, a
        send acknowledged in 2.5 s, then milliseconds): long enough to expire the short
        leases and timeouts tests use. Rounds of a fresh topic opened and written 20 times,
        until one opens within a second with no write slower than 100 ms.
        """
        import asyncio

        spent = asyncio.run(_warm_up(self.service_url, self.admin_url, budget_s))
        logger.info("warmed the broker at %s up in %.1fs", self.service_url, spent)
        return spent

    def restart_after_kill(self) -> float:
        """Kill -9 and start again on the same data; returns seconds until ready."""
        self.kill()
        started = time.monotonic()
        self.start()
        return time.monotonic() - started

    def stop(self) -> None:
        if not self.started_here:
            return
        if self.kind == "standalone":
            self._script("stop")
        elif self.kind == "docker" and self.container is not None:
            self.container.remove(force=True)


def _add(state: dict[str, int], op: int) -> None:
    state["n"] = state.get("n", 0) + op


async def _warm_up(service_url: str, admin_url: str, budget_s: float) -> float:
    import uuid

    from .._manager import SharedStateManager

    started = time.monotonic()
    while time.monotonic() - started < budget_s:
        name = f"pulsar-state-warm-up-{uuid.uuid4().hex[:8]}"
        opening = time.monotonic()
        manager = SharedStateManager(
            service_url,
            f"persistent://public/default/{name}",
            initial_state=dict,
            apply=_add,
            admin_url=admin_url,
        )
        async with manager:
            opened_in, slowest = time.monotonic() - opening, 0.0
            for _ in range(20):
                writing = time.monotonic()
                await manager.write(lambda _state: [1])
                slowest = max(slowest, time.monotonic() - writing)
        with contextlib.suppress(OSError):  # (under infinite retention they would pile up)
            admin_request(admin_url, "DELETE", f"/admin/v2/persistent/public/default/{name}")
        if opened_in < 1.0 and slowest < 0.1:
            break
    return time.monotonic() - started


def _from_docker() -> Broker | None:
    try:
        import docker  # the Python Docker SDK, extra "docker"
    except ImportError:
        return None
    try:
        client = docker.from_env(timeout=5)
        client.ping()
    except Exception:
        return None  # no engine answers: fall through to the standalone broker
    environment = dict(broker_settings())
    container = client.containers.run(
        DOCKER_IMAGE,
        command=[
            "bash",
            "-c",
            "bin/apply-config-from-env.py conf/standalone.conf && "
            "exec bin/pulsar standalone --no-functions-worker --no-stream-storage",
        ],
        environment=environment,
        ports={"6650/tcp": ("127.0.0.1", None), "8080/tcp": ("127.0.0.1", None)},
        detach=True,
        labels={"pulsar-state": "test-broker"},
    )
    container.reload()
    ports = container.attrs["NetworkSettings"]["Ports"]
    service_port = ports["6650/tcp"][0]["HostPort"]
    web_port = ports["8080/tcp"][0]["HostPort"]
    broker = Broker(
        f"pulsar://127.0.0.1:{service_port}",
        f"http://127.0.0.1:{web_port}",
        "docker",
        started_here=True,
        container=container,
    )
    wait_ready(broker.admin_url)
    return broker


def _from_standalone(script_path: str | os.PathLike[str] | None) -> Broker:
    script = standalone_script(script_path)
    # The script's own default run directory is <checkout>/.pulsar.
    env = {"PULSAR_HOME": os.environ.get("PULSAR_HOME", str(script.parents[1] / ".pulsar"))}
    broker = Broker("", "", "standalone", env=env, script=script)
    already = subprocess.run(
        [str(script), "status"], env={**os.environ, **env}, capture_output=True, text=True
    )
    # On a running broker `start` only checks it, with a real write and read-back.
    output = broker._script("start")
    urls = dict(line.split("=", 1) for line in output.splitlines() if line.startswith("PULSAR_"))
    broker.service_url = urls["PULSAR_SERVICE_URL"]
    broker.admin_url = urls["PULSAR_ADMIN_URL"]
    broker.started_here = already.returncode != 0
    return broker


def provide_broker(
    service_url: str | None,
    admin_url: str | None,
    *,
    standalone: str | os.PathLike[str] | None = None,
) -> Broker:
    """Find or start a broker, or raise :class:`BrokerUnavailable` saying what failed.

    ``standalone``: the ``scripts/pulsar-standalone`` to fall back on (see
    :func:`standalone_script` for the default).
    """
    if service_url:
        admin = admin_url or default_admin_url(service_url)
        wait_ready(admin, timeout=60)
        return Broker(service_url, admin, "external")
    errors = []
    try:
        docker_broker = _from_docker()
        if docker_broker is not None:
            docker_broker.warm_up()
            return docker_broker
    except Exception as exc:
        errors.append(f"Docker: {exc}")
    try:
        broker = _from_standalone(standalone)
    except Exception as exc:
        errors.append(f"standalone from Maven jars: {exc}")
    else:
        if broker.started_here:
            broker.warm_up()
        return broker
    raise BrokerUnavailable(
        "no Apache Pulsar broker could be had for the tests.\n"
        + "\n".join(errors)
        + "\nFix one of: pass --pulsar-url pulsar://HOST:6650 (and --pulsar-admin-url), "
        "start Docker (with the docker extra), or install a JDK 17+ and Maven so "
        "scripts/pulsar-standalone can run (--pulsar-standalone names it outside a checkout)."
    )


def admin_request(
    admin_url: str, method: str, path: str, body: Any = None, *, token: str | None = None
) -> Any:
    """A raw admin REST call for tests that change broker policies (``token``: a secured
    broker's superuser token, sent as ``Authorization: Bearer``)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(admin_url + path, data=data, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read()
        return json.loads(text) if text.strip() else None
