"""The security options of a manager: bad values refused at construction, TLS of https admin
URLs (against a local https server with a certificate made here; no broker involved)."""

from __future__ import annotations

import http.server
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pulsar_state import ConfigurationError, SharedStateManager
from pulsar_state._admin import AdminClient


def _manager(**options: Any) -> SharedStateManager[dict[str, Any], Any]:
    return SharedStateManager(
        "pulsar://127.0.0.1:6650",
        "options-test",
        initial_state=dict,
        apply=lambda s, op: s,
        **options,
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"authentication": 42}, "authentication= takes a token"),
        ({"authentication": "  "}, "empty token"),
        ({"authentication": b"token"}, "authentication= takes a token"),
        (
            {"authentication": "t", "client_options": {"authentication": object()}},
            "authentication given twice",
        ),
        ({"tls_trust_certs_file_path": "/no/such/ca.pem"}, "not a readable file"),
        ({"tls_validate_hostname": "yes"}, "True or False"),
        (
            {"tls_validate_hostname": True, "client_options": {"tls_validate_hostname": False}},
            "given twice",
        ),
        ({"admin_headers": ["Authorization: x"]}, "admin_headers="),
        ({"admin_url": "ftp://host:21"}, "not an http"),
    ],
)
def test_bad_security_options_are_refused_at_construction(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        _manager(**options)


def test_a_token_function_returning_nothing_is_refused_at_the_request() -> None:
    admin = AdminClient("http://127.0.0.1:1", token=lambda: "")
    with pytest.raises(ConfigurationError, match="non-empty string"):
        admin._request_headers()


def test_token_and_headers_make_the_request_headers() -> None:
    admin = AdminClient(
        "http://127.0.0.1:1", token=lambda: "abc", headers_source=lambda: {"X-Tenant": "t"}
    )
    headers = admin._request_headers()
    assert headers["Authorization"] == "Bearer abc"
    assert headers["X-Tenant"] == "t"
    assert not AdminClient("http://127.0.0.1:1").authenticated


def test_client_options_keep_working_and_gain_the_new_settings(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("placeholder")  # only its existence is checked for a pulsar:// URL
    manager = _manager(
        authentication="tok",
        tls_trust_certs_file_path=str(ca),
        client_options={"io_threads": 2},
    )
    options = manager._client_options
    assert options is not None
    assert options["io_threads"] == 2
    assert options["tls_trust_certs_file_path"] == str(ca)
    assert type(options["authentication"]).__name__ == "AuthenticationToken"
    assert manager._admin.authenticated


# ---------------------------------------------------------------------- https admin URLs


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (and a key), made with the openssl command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the openssl command is needed to make a test certificate")
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    command = "req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=127.0.0.1 -addext "
    command += f"subjectAltName=IP:127.0.0.1 -keyout {key} -out {cert}"
    subprocess.run(
        [openssl, *command.split()],
        check=True,
        capture_output=True,
    )
    return cert, key


class _Json(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"ledgerId": 1, "entryId": 2}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def https_url(certificate: tuple[Path, Path]) -> Iterator[str]:
    cert, key = certificate
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Json)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_https_admin_url_trusts_the_given_certificates(
    https_url: str, certificate: tuple[Path, Path]
) -> None:
    manager = _manager(
        admin_url=https_url,
        tls_trust_certs_file_path=str(certificate[0]),
        tls_validate_hostname=True,
    )
    try:
        assert await manager._admin.get("/x") == (200, {"ledgerId": 1, "entryId": 2})
    finally:
        await manager._admin.close()


async def test_https_admin_url_refuses_an_untrusted_certificate_clearly(https_url: str) -> None:
    manager = _manager(admin_url=https_url)
    try:
        with pytest.raises(ConfigurationError, match="tls_trust_certs_file_path"):
            await manager._admin.get("/x")
    finally:
        await manager._admin.close()


def test_a_trust_file_that_is_not_pem_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ConfigurationError, match="cannot be loaded"):
        _manager(admin_url="https://127.0.0.1:8443", tls_trust_certs_file_path=str(bad))


@pytest.mark.parametrize(
    "options",
    [
        {"relay_idle_release_s": -1.0},
        {"relay_idle_release_s": float("nan")},
        {"relay_idle_release_s": "5"},
        {"relay_idle_release_s": True},
        {"idle_release_s": float("inf")},
        {"idle_release_s": None},
    ],
)
def test_idle_holds_that_are_not_seconds_are_refused(options: dict[str, Any]) -> None:
    [name] = options
    with pytest.raises(ConfigurationError, match=f"{name} must be a finite number of seconds"):
        _manager(**options)


def test_idle_holds_accept_zero_and_none_for_the_relayed_one() -> None:
    _manager(idle_release_s=0, relay_idle_release_s=None)
    _manager(idle_release_s=0.1, relay_idle_release_s=5)
