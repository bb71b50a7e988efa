"""A token-secured standalone broker for this package, started once per test session.

Token authentication and authorization on (settings as measured in
shared/reference/secured-broker.md), superuser ``admin``; the role ``app`` gets only produce
and consume on ``public/default``. It also listens with TLS (``pulsar+ssl://``, ``https://``)
with a self-signed certificate for 127.0.0.1 made here. The broker runs from
``scripts/pulsar-standalone`` with the secured settings appended (``PULSAR_EXTRA_SETTINGS``)
on free ports and its own run directory, beside the session's plain broker. If it cannot be
had, the tests fail, never skip.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pulsar_state.testing import Broker, BrokerUnavailable, unique_topic
from pulsar_state.testing._broker import admin_request, standalone_script

SUPERUSER = "admin"
APP_ROLE = "app"


def make_token(secret: bytes, role: str) -> str:
    """An HS256 JWT ``{"sub": role}`` signed with ``secret``: what the broker's token provider
    checks against ``tokenSecretKey`` (no tool needed, a few lines of hmac)."""

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    header = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    payload = b64(json.dumps({"sub": role}).encode())
    signature = hmac.new(secret, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{b64(signature)}"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def make_certificate(where: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (PKCS#8 PEM), with openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the openssl command is needed to make the broker's certificate")
    cert, key = where / "broker-cert.pem", where / "broker-key.pem"
    command = "req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=127.0.0.1 -addext "
    command += f"subjectAltName=IP:127.0.0.1 -keyout {key} -out {cert}"
    subprocess.run([openssl, *command.split()], check=True, capture_output=True)
    return cert, key


@dataclass
class SecuredBroker:
    broker: Broker
    admin_token: str
    app_token: str
    secret: bytes
    # TLS listeners beside the plain ones, with a certificate made for 127.0.0.1.
    tls_service_url: str
    tls_admin_url: str
    ca_file: Path

    @property
    def service_url(self) -> str:
        return self.broker.service_url

    @property
    def admin_url(self) -> str:
        return self.broker.admin_url

    def token(self, role: str) -> str:
        return make_token(self.secret, role)


def secured_settings(
    secret: bytes, admin_token: str, tls: tuple[Path, Path, int, int] | None = None
) -> str:
    key = base64.b64encode(secret).decode()
    tls_lines = []
    if tls is not None:
        cert, tls_key, broker_tls_port, web_tls_port = tls
        tls_lines = [
            f"brokerServicePortTls={broker_tls_port}",
            f"webServicePortTls={web_tls_port}",
            f"tlsCertificateFilePath={cert}",
            f"tlsKeyFilePath={tls_key}",
        ]
    return "\n".join(
        [
            *tls_lines,
            "authenticationEnabled=true",
            "authorizationEnabled=true",
            "authenticationProviders=org.apache.pulsar.broker.authentication."
            "AuthenticationProviderToken",
            f"tokenSecretKey=data:;base64,{key}",
            f"superUserRoles={SUPERUSER}",
            # The broker's own client (standalone's set-up, internal lookups) is the superuser.
            "brokerClientAuthenticationPlugin=org.apache.pulsar.client.impl.auth."
            "AuthenticationToken",
            f"brokerClientAuthenticationParameters=token:{admin_token}",
            "",
        ]
    )


@pytest.fixture(scope="session")
def secured_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredBroker]:
    secret = os.urandom(32)
    admin_token = make_token(secret, SUPERUSER)
    home: Path = tmp_path_factory.mktemp("secured-pulsar")
    cert, tls_key = make_certificate(home)
    broker_port, web_port, bookie_port, broker_tls_port, web_tls_port = _free_ports(5)
    settings = home / "secured.conf"
    settings.write_text(
        secured_settings(secret, admin_token, (cert, tls_key, broker_tls_port, web_tls_port))
    )
    env = {
        "PULSAR_HOME": str(home),
        "PULSAR_BROKER_PORT": str(broker_port),
        "PULSAR_WEB_PORT": str(web_port),
        "PULSAR_BOOKIE_PORT": str(bookie_port),
        "PULSAR_EXTRA_SETTINGS": str(settings),
        "PULSAR_ADMIN_TOKEN": admin_token,
        "PULSAR_HEAP": os.environ.get("PULSAR_SECURED_HEAP", "512m"),
    }
    try:
        script = standalone_script()
        broker = Broker("", "", "standalone", started_here=True, env=env, script=script)
        output = broker._script("start")
    except BrokerUnavailable as exc:
        pytest.fail(f"the token-secured standalone broker did not start: {exc}", pytrace=False)
    urls = dict(line.split("=", 1) for line in output.splitlines() if line.startswith("PULSAR_"))
    broker.service_url, broker.admin_url = urls["PULSAR_SERVICE_URL"], urls["PULSAR_ADMIN_URL"]
    try:
        # The least-privileged role the library must fully work for.
        admin_request(
            broker.admin_url,
            "POST",
            f"/admin/v2/namespaces/public/default/permissions/{APP_ROLE}",
            ["produce", "consume"],
            token=admin_token,
        )
        yield SecuredBroker(
            broker,
            admin_token,
            make_token(secret, APP_ROLE),
            secret,
            tls_service_url=f"pulsar+ssl://127.0.0.1:{broker_tls_port}",
            tls_admin_url=f"https://127.0.0.1:{web_tls_port}",
            ca_file=cert,
        )
    finally:
        broker.stop()


@pytest.fixture
def secured_topic(request: pytest.FixtureRequest) -> str:
    return unique_topic(f"secured-{request.node.name}")
