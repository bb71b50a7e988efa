"""Every feature works for a least-privileged role on a token-secured broker (issue 12c).

The broker (conftest) has token authentication and authorization on; the role ``app`` may only
produce and consume on ``public/default``: it cannot read topic policies (403). Everything
below runs as ``app`` unless it says otherwise.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pulsar_state import AccessDeniedError, BrokerError, ConfigurationError, SharedStateManager
from pulsar_state._admin import AdminClient, TopicName
from pulsar_state.testing import admin_request
from recipes import Ownership, PulsarMap
from recipes.spark import MapSpec, close_maps, get_map
from tests.secured.conftest import SecuredBroker, make_certificate

pytestmark = pytest.mark.slow

WAIT_S = 60.0


def _apply(state: dict[str, Any], op: dict[str, Any]) -> None:
    state[op["key"]] = op["value"]


def _manager(
    broker: SecuredBroker, topic: str, authentication: Any, **options: Any
) -> SharedStateManager[dict[str, Any], dict[str, Any]]:
    settings: dict[str, Any] = {
        "admin_url": broker.admin_url,
        "open_timeout_s": WAIT_S,
        "write_timeout_s": WAIT_S,
        "read_timeout_s": WAIT_S,
    }
    settings.update(options)
    return SharedStateManager(
        broker.service_url,
        topic,
        initial_state=dict,
        apply=_apply,
        authentication=authentication,
        **settings,
    )


def _policy_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "could not check" in r.getMessage()
    ]


async def test_manager_write_read_and_latest_read_as_least_privileged_role(
    secured_broker: SecuredBroker, secured_topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pulsar_state")
    hold = {"idle_release_s": 3600.0, "max_hold_s": 3600.0}  # the writer keeps the writer
    async with (
        _manager(secured_broker, secured_topic, secured_broker.app_token, **hold) as writer,
        _manager(secured_broker, secured_topic, secured_broker.app_token) as reader,
    ):
        result = await writer.write(lambda s: [{"key": "a", "value": 1}])
        assert result.position == 1
        assert await writer.read(lambda s: dict(s)) == {"a": 1}
        # The other replica's linearizable read captures the tail as this role too.
        assert await reader.read(lambda s: dict(s), latest=True) == {"a": 1}
        # The write relay opens for this role too: the other replica's write goes through
        # the process holding the writer.
        for _ in range(int(WAIT_S * 10)):
            if reader._parts.relay is not None and reader._parts.relay.ready:
                break
            await asyncio.sleep(0.1)
        await writer.write(lambda s: [{"key": "a", "value": 2}])
        # (Caught up first: a record built on the older state would be relayed again.)
        assert await reader.read(lambda s: dict(s), latest=True) == {"a": 2}
        await reader.write(lambda s: [{"key": "b", "value": 3}])
        assert await writer.read(lambda s: dict(s), latest=True) == {"a": 2, "b": 3}
        assert reader.stats.records_relayed == 1
        assert reader.stats.writer_acquisitions == 0
        assert writer.stats.relayed_appended == 1
    # The policies this role may not read are named, with how an operator checks them.
    warnings = _policy_warnings(caplog)
    assert len(warnings) == 2, warnings  # one per open
    assert "retention" in warnings[0]
    assert "inactive-topic policy" in warnings[0]
    assert "403" in warnings[0]
    assert "doctor" in warnings[0]


async def test_the_superuser_reads_the_policies_without_a_warning(
    secured_broker: SecuredBroker, secured_topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pulsar_state")
    async with _manager(secured_broker, secured_topic, secured_broker.admin_token) as manager:
        await manager.write(lambda s: [{"key": "k", "value": "v"}])
    assert _policy_warnings(caplog) == []


async def test_a_token_function_is_asked_again_for_each_admin_request(
    secured_broker: SecuredBroker, secured_topic: str
) -> None:
    calls = 0

    def current_token() -> str:
        nonlocal calls
        calls += 1
        return secured_broker.app_token

    async with _manager(secured_broker, secured_topic, current_token) as manager:
        await manager.write(lambda s: [{"key": "a", "value": 1}])
        assert await manager.read(lambda s: dict(s), latest=True) == {"a": 1}
        before = calls
        stats = TopicName.parse(secured_topic).rest_path + "/stats"
        for _ in range(3):
            await manager._admin.get_ok(stats)  # test-only peek: the manager's REST client
        # The binary client may call it too; each admin request calls it once at least.
        assert calls >= before + 3


async def test_tls_on_both_paths_with_the_given_trust_store(
    secured_broker: SecuredBroker, secured_topic: str
) -> None:
    # pulsar+ssl:// and https:// with a certificate only the given CA file vouches for, and
    # hostname validation on: both the binary client and the admin REST client trust it.
    broker = secured_broker
    tls_manager = SharedStateManager(
        broker.tls_service_url,
        secured_topic,
        initial_state=dict,
        apply=_apply,
        admin_url=broker.tls_admin_url,
        authentication=broker.app_token,
        tls_trust_certs_file_path=str(broker.ca_file),
        tls_validate_hostname=True,
        open_timeout_s=WAIT_S,
        write_timeout_s=WAIT_S,
        read_timeout_s=WAIT_S,
    )
    async with tls_manager, _manager(broker, secured_topic, broker.app_token) as plain:
        await tls_manager.write(lambda s: [{"key": "tls", "value": True}])
        assert await plain.read(lambda s: dict(s), latest=True) == {"tls": True}
        await plain.write(lambda s: [{"key": "plain", "value": True}])
        assert await tls_manager.read(lambda s: dict(s), latest=True) == {
            "tls": True,
            "plain": True,
        }
    # Without the trust store the admin URL's certificate is refused, clearly and at once.
    untrusting = _manager(broker, secured_topic, broker.app_token, admin_url=broker.tls_admin_url)
    with pytest.raises(ConfigurationError, match="tls_trust_certs_file_path"):
        await untrusting.open()


async def test_no_token_is_a_clear_error_at_once(
    secured_broker: SecuredBroker, secured_topic: str
) -> None:
    started = time.monotonic()
    denied = pytest.raises(AccessDeniedError, match="401 Unauthorized: no credentials were sent")
    with denied as caught:
        async with _manager(secured_broker, secured_topic, None):
            pass
    assert "authentication=" in str(caught.value)
    assert not caught.value.retriable
    # Not the open's time-out: the binary client alone only times out on a refused login.
    assert time.monotonic() - started < 10


async def test_an_invalid_token_is_a_clear_error(
    secured_broker: SecuredBroker, secured_topic: str
) -> None:
    forged = secured_broker.token("app")[:-6] + "AAAAAA"
    with pytest.raises(AccessDeniedError, match="401 Unauthorized: the credentials sent were"):
        async with _manager(secured_broker, secured_topic, forged):
            pass


async def test_a_role_without_permission_is_a_clear_error(
    secured_broker: SecuredBroker, secured_topic: str
) -> None:
    # Pulsar answers 401 here, with a reason that tells it from a refused token.
    with pytest.raises(AccessDeniedError, match="the role lacks permission"):
        async with _manager(secured_broker, secured_topic, secured_broker.token("nobody")):
            pass


async def test_pulsar_map_put_get_and_watch(
    secured_broker: SecuredBroker, secured_topic: str
) -> None:
    def new_map() -> PulsarMap[str, Any]:
        return PulsarMap(
            secured_broker.service_url,
            secured_topic,
            admin_url=secured_broker.admin_url,
            authentication=secured_broker.app_token,
            open_timeout_s=WAIT_S,
            write_timeout_s=WAIT_S,
            read_timeout_s=WAIT_S,
        )

    async with new_map() as writer, new_map() as watcher:
        await writer.put("a", 1)
        assert await watcher.get("a", latest=True) == 1
        async with watcher.changes() as watch:
            await writer.put("b", 2)
            events = [await watch.next(timeout=WAIT_S) for _ in range(2)]
        assert [(e.kind, e.key, e.value) for e in events if e is not None] == [
            ("put", "a", 1),
            ("put", "b", 2),
        ]


async def test_ownership_acquire_and_release(
    secured_broker: SecuredBroker, secured_topic: str
) -> None:
    async with Ownership(
        secured_broker.service_url,
        secured_topic,
        owner="worker-1",
        admin_url=secured_broker.admin_url,
        authentication=secured_broker.app_token,
        open_timeout_s=WAIT_S,
        write_timeout_s=WAIT_S,
        read_timeout_s=WAIT_S,
    ) as ownership:
        lease = await ownership.acquire("resource-1", timeout=WAIT_S)
        assert [held.id for held in await ownership.holders("resource-1", latest=True)] == [
            lease.id
        ]
        await ownership.release(lease)
        assert await ownership.holders("resource-1", latest=True) == []


def test_spark_map_spec_get_map_round_trip(
    secured_broker: SecuredBroker, secured_topic: str
) -> None:
    # The token travels in the spec's options (it pickles) to every executor.
    spec = MapSpec(
        secured_broker.service_url,
        secured_topic,
        admin_url=secured_broker.admin_url,
        options={"authentication": secured_broker.app_token, "open_timeout_s": WAIT_S},
    )
    try:
        state_map = get_map(spec)
        state_map.put("k", {"n": 1})
        assert get_map(spec) is state_map
        assert state_map.get("k", latest=True) == {"n": 1}
    finally:
        close_maps()


def test_doctor_with_the_superuser_token_checks_the_policies(
    secured_broker: SecuredBroker, secured_topic: str
) -> None:

    def doctor(token: str) -> subprocess.CompletedProcess[str]:
        return pulsar_state_as(secured_broker, token, "-t", secured_topic, "doctor")

    # The topic must exist for its policies to be read.
    admin_request(
        secured_broker.admin_url,
        "PUT",
        TopicName.parse(secured_topic).rest_path,
        token=secured_broker.admin_token,
    )
    checked = doctor(secured_broker.admin_token)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"ok   topic {secured_topic}" in checked.stdout, checked.stdout
    # The application's role cannot read the broker's settings nor policies: the doctor
    # says so in one line and fails.
    refused = doctor(secured_broker.app_token)
    assert refused.returncode != 0
    assert "AccessDeniedError" in refused.stderr, refused.stderr
    assert "lacks permission" in refused.stderr, refused.stderr


def test_status_as_the_application_role_says_the_policies_were_not_checked(
    secured_broker: SecuredBroker, secured_topic: str
) -> None:
    # That role may read the topic's stats but not its policies (HTTP 403): status reports
    # them unchecked, and exits 0 (4 means a setting that loses history was found).
    admin_request(
        secured_broker.admin_url,
        "PUT",
        TopicName.parse(secured_topic).rest_path,
        token=secured_broker.admin_token,
    )
    status = pulsar_state_as(
        secured_broker, secured_broker.app_token, "-t", secured_topic, "-o", "json", "status"
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["policies"].startswith("not checked (HTTP 403)")
    assert "pulsar-state doctor" in status.stderr


def pulsar_state_as(
    secured_broker: SecuredBroker, token: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """The ``pulsar-state`` command on the secured broker, with ``token``."""
    env = {
        **os.environ,
        "PULSAR_SERVICE_URL": secured_broker.service_url,
        "PULSAR_ADMIN_URL": secured_broker.admin_url,
        "PULSAR_STATE_AUTH_TOKEN": token,
    }
    return subprocess.run(
        [str(Path(sys.executable).with_name("pulsar-state")), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ------------------------------------------------------------------------------ redirects


class _Redirector(http.server.BaseHTTPRequestHandler):
    """Answers every GET with a 307, as a broker that does not own the topic does: first to
    itself (so that the followed request is seen here), then to the real broker."""

    target: ClassVar[str] = ""
    url: ClassVar[str] = ""
    seen: ClassVar[list[tuple[str, str | None]]] = []
    loop_forever: ClassVar[bool] = False

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        query = urllib.parse.urlsplit(self.path).query
        if self.loop_forever or "authoritative" not in query:
            location = self.path  # relative: this server again
        else:
            location = self.target + self.path
        self.send_response(307)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def redirector(secured_broker: SecuredBroker) -> Iterator[type[_Redirector]]:
    handler = type("Redirector", (_Redirector,), {"target": secured_broker.admin_url, "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


async def test_admin_redirects_are_followed_with_credentials_and_authoritative(
    secured_broker: SecuredBroker, secured_topic: str, redirector: type[_Redirector]
) -> None:
    admin_url = redirector.url
    async with (
        _manager(secured_broker, secured_topic, secured_broker.app_token) as writer,
        _manager(
            secured_broker, secured_topic, secured_broker.app_token, admin_url=admin_url
        ) as reader,
    ):
        await writer.write(lambda s: [{"key": "a", "value": 1}])
        assert await reader.read(lambda s: dict(s), latest=True) == {"a": 1}
    assert redirector.seen, "no admin request reached the redirecting server"
    # Every request kept its credentials; each second hop asked with authoritative=true.
    assert all(auth == f"Bearer {secured_broker.app_token}" for _, auth in redirector.seen)
    followed = [path for path, _ in redirector.seen if "authoritative=true" in path]
    assert followed
    assert len(followed) * 2 == len(redirector.seen)


async def test_redirects_are_bounded(
    secured_broker: SecuredBroker, redirector: type[_Redirector]
) -> None:
    redirector.loop_forever = True
    admin = AdminClient(redirector.url, token=secured_broker.app_token)
    topic = TopicName.parse("redirect-loop")
    try:
        with pytest.raises(BrokerError, match="answered 307") as caught:
            await asyncio.wait_for(admin.get_ok(topic.rest_path + "/lastMessageId"), WAIT_S)
    finally:
        await admin.close()
    assert caught.value.retriable  # ownership moving: a later call may land
    assert len(redirector.seen) == 6  # the request and five hops


async def test_a_redirect_from_https_to_plain_http_is_not_followed_with_credentials(
    secured_broker: SecuredBroker, redirector: type[_Redirector], tmp_path: Path
) -> None:
    # Before: the token asked for over TLS went to whatever a Location named, plain HTTP
    # included (a broker advertising its http web service; review 45d).
    cert, key = make_certificate(tmp_path)
    plain = redirector.url

    class Downgrade(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(307)
            self.send_header("Location", plain + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Downgrade)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    admin = AdminClient(
        f"https://127.0.0.1:{server.server_address[1]}",
        token=secured_broker.app_token,
        ssl_context=ssl.create_default_context(cafile=str(cert)),
    )
    try:
        with pytest.raises(ConfigurationError, match="without TLS; the credentials are not"):
            await admin.get("/admin/v2/persistent/public/default/t/lastMessageId")
    finally:
        await admin.close()
        server.shutdown()
        server.server_close()
    assert redirector.seen == []  # nothing reached the plain server
