"""The few Pulsar admin REST calls the manager needs: topic policies, side-topic tails, backlog.

The state topic's tail is captured over the binary protocol (``_tail``); the admin API's
``lastMessageId`` and ledger list remain for the snapshot side topics, for the rare tail the
binary answer leaves open (an empty current ledger), and for the CLI. The same API tells
whether a topic is partitioned or would lose history.
The standard library's HTTP client runs in a worker thread so the event loop never blocks.

Secured clusters: every request carries the manager's credentials (a bearer token, evaluated
per request so a refreshed one is used, or the caller's headers), https URLs use the same trust
store and hostname rule as the binary client, and a 307 from a broker that does not own the
topic is followed to the owner (http.client follows no redirect by itself).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import ssl
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tenacity import Retrying, retry_if_exception, stop_after_attempt

from ._errors import (
    AccessDeniedError,
    BrokerError,
    BrokerUnavailableError,
    ConfigurationError,
    OperationTimeoutError,
    PartitionedTopicError,
    UnsafeTopicPolicyError,
)
from ._pulsar import TAIL_SUBSCRIPTION, LogPosition, http_cause, is_transient_cause

__all__ = [
    "AdminClient",
    "HeaderSource",
    "TokenSource",
    "TopicName",
    "admin_ssl_context",
    "default_admin_url",
    "resolve_admin_url",
]

logger = logging.getLogger("pulsar_state")

# A bearer token, or a function returning the current one (called per request).
TokenSource = str | Callable[[], str]
# Extra request headers (e.g. an OAuth2 bearer header), or a function returning them per request.
HeaderSource = Mapping[str, str] | Callable[[], Mapping[str, str]]

# Hops followed from one broker to the next before giving up: ownership that keeps moving.
_MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True, slots=True)
class TopicName:
    """A fully qualified topic name, ``persistent://tenant/namespace/local``."""

    domain: str
    tenant: str
    namespace: str
    local: str

    @classmethod
    def parse(cls, topic: str) -> TopicName:
        if "://" in topic:
            domain, _, rest = topic.partition("://")
        else:
            domain, rest = "persistent", topic
        parts = rest.split("/")
        if len(parts) == 1:
            parts = ["public", "default", parts[0]]
        if len(parts) != 3 or not all(parts):
            raise ConfigurationError(
                f"invalid topic name {topic!r}: use 'name' or 'persistent://tenant/namespace/name'"
            )
        if domain != "persistent":
            raise ConfigurationError(
                f"topic {topic!r} is {domain}: replicated state needs a persistent topic"
            )
        return cls(domain, parts[0], parts[1], parts[2])

    def __str__(self) -> str:
        return f"{self.domain}://{self.tenant}/{self.namespace}/{self.local}"

    @property
    def rest_path(self) -> str:
        local = urllib.parse.quote(self.local, safe="")
        return f"/admin/v2/{self.domain}/{self.tenant}/{self.namespace}/{local}"


def default_admin_url(service_url: str) -> str:
    """The admin URL of a standalone broker or the compose file, derived from its service URL."""
    parsed = urllib.parse.urlsplit(service_url.split(",")[0])
    host = parsed.hostname or "127.0.0.1"
    if parsed.scheme == "pulsar+ssl":
        return f"https://{host}:8443"
    return f"http://{host}:8080"


def _stale_connection(exc: BaseException) -> bool:
    # TimeoutError is an OSError too, but a slow server is not helped by asking again.
    return isinstance(exc, (http.client.HTTPException, OSError)) and not isinstance(
        exc, TimeoutError
    )


def resolve_admin_url(pulsar: Any, admin_url: str | None) -> str:
    """The admin URL for a manager given a service URL or a borrowed client."""
    if admin_url is not None:
        return admin_url
    if isinstance(pulsar, str):
        return default_admin_url(pulsar)
    # A client does not tell its service URL: guessing would talk to another broker.
    raise ConfigurationError(
        "a borrowed pulsar.asyncio.Client needs admin_url= (the broker's admin REST URL, "
        "e.g. http://host:8080) for the topic checks and snapshots; without them "
        "(check_topic=False, no snapshot codec) it needs none"
    )


def admin_ssl_context(trust_certs_file_path: str | None, validate_hostname: bool) -> ssl.SSLContext:
    """The TLS settings of https admin URLs: the binary client's trust store and hostname rule
    (``tls_trust_certs_file_path``, ``tls_validate_hostname``), so both paths trust alike."""
    try:
        context = ssl.create_default_context(cafile=trust_certs_file_path)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(
            f"tls_trust_certs_file_path={trust_certs_file_path!r} cannot be loaded as PEM "
            f"certificates: {exc}"
        ) from exc
    context.check_hostname = validate_hostname
    return context


def _token_header(token: TokenSource) -> dict[str, str]:
    value = token() if callable(token) else token
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(
            f"the authentication token must be a non-empty string, got {type(value).__name__}"
        )
    value = value.strip()
    if any(char.isspace() or not char.isprintable() for char in value):
        # (Not quoted: http.client's own error quoted the whole header, the token with it.)
        raise ConfigurationError(
            "the authentication token holds a line break, a space or a control character "
            "(a token file of two lines?)"
        )
    return {"Authorization": f"Bearer {value}"}


def _with_authoritative(location: str) -> str:
    """A redirect target asking the broker to serve, not redirect again (as lookups do)."""
    parts = urllib.parse.urlsplit(location)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if not any(name == "authoritative" for name, _ in query):
        query.append(("authoritative", "true"))
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


class AdminClient:
    """A minimal asynchronous client for Pulsar's admin REST API.

    ``token`` (or ``headers_source``) authenticates every request; ``ssl_context`` is used for
    https URLs; redirects to another broker are followed (at most a few hops), credentials kept.
    """

    def __init__(
        self,
        admin_url: str,
        *,
        timeout_s: float = 10.0,
        headers: dict[str, str] | None = None,
        token: TokenSource | None = None,
        headers_source: HeaderSource | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.admin_url = admin_url.rstrip("/")
        parts = urllib.parse.urlsplit(self.admin_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigurationError(
                f"admin_url {admin_url!r} is not an http(s) URL (e.g. http://host:8080)"
            )
        if token is not None and not (isinstance(token, str) or callable(token)):
            raise ConfigurationError(
                f"token must be a str or a function returning one, not {type(token).__name__}"
            )
        if isinstance(token, str):
            _token_header(token)  # refuse an empty token now, not at the first request
        self.timeout_s = timeout_s
        self._headers = {"Accept": "application/json", **(headers or {})}
        self._token = token
        self._headers_source = headers_source
        self._ssl_context = ssl_context
        # Kept-alive connections, one per (scheme, host:port): the configured broker and
        # those redirects lead to.
        self._conns: dict[tuple[str, str], http.client.HTTPConnection] = {}
        self._lock = threading.Lock()

    @property
    def authenticated(self) -> bool:
        """Whether requests carry credentials."""
        return self._token is not None or self._headers_source is not None

    def _request_headers(self) -> dict[str, str]:
        headers = dict(self._headers)
        if self._headers_source is not None:
            source = self._headers_source
            headers.update(source() if callable(source) else source)
        if self._token is not None:
            headers.update(_token_header(self._token))
        return headers

    def _connection(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        # Kept alive: a new connection per call costs about 10 ms, and the tail position is
        # fetched on every linearizable read.
        conn = self._conns.get((scheme, netloc))
        if conn is None:
            if scheme == "https":
                conn = http.client.HTTPSConnection(
                    netloc, timeout=self.timeout_s, context=self._ssl_context
                )
            else:
                conn = http.client.HTTPConnection(netloc, timeout=self.timeout_s)
            self._conns[(scheme, netloc)] = conn
        return conn

    def _get_blocking(self, path: str) -> tuple[int, Any]:
        with self._lock:
            try:
                # A kept-alive connection the server closed fails once: retry on a new one.
                for attempt in Retrying(
                    retry=retry_if_exception(_stale_connection),
                    stop=stop_after_attempt(2),
                    reraise=True,
                ):
                    with attempt:
                        status, body = self._request(path)
            except TimeoutError as exc:
                timed_out = OperationTimeoutError(f"admin GET {path} timed out")
                timed_out.retriable = is_transient_cause("http timeout")
                raise timed_out from exc
            except ssl.SSLError as exc:
                # A certificate that is not trusted will not become trusted by asking again.
                raise ConfigurationError(
                    f"TLS to the admin API at {self.admin_url} failed ({exc}): check "
                    "tls_trust_certs_file_path and tls_validate_hostname"
                ) from exc
            except (http.client.HTTPException, OSError) as exc:
                unreachable = BrokerUnavailableError(
                    f"admin API at {self.admin_url} unreachable ({exc}); pass "
                    "admin_url= if the broker's web service is elsewhere"
                )
                unreachable.retriable = is_transient_cause("http connection")
                raise unreachable from exc
        try:
            detail = json.loads(body) if body.strip() else None
        except ValueError:
            detail = body.decode(errors="replace")
        return status, detail

    def _request(self, path: str) -> tuple[int, bytes]:
        parts = urllib.parse.urlsplit(self.admin_url)
        scheme, netloc = parts.scheme, parts.netloc
        target = parts.path.rstrip("/") + path
        headers = self._request_headers()
        for _hop in range(_MAX_REDIRECTS + 1):
            status, body, location = self._request_once(scheme, netloc, target, headers)
            if status not in _REDIRECTS or not location:
                return status, body
            # A broker that does not own the topic names the one that does: ask it, with the
            # same credentials (brokers of one cluster share them).
            moved = urllib.parse.urlsplit(
                urllib.parse.urljoin(f"{scheme}://{netloc}{target}", location)
            )
            if scheme == "https" and moved.scheme != "https" and set(headers) - {"Accept"}:
                # Credentials asked for over TLS are never sent in the clear.
                raise ConfigurationError(
                    f"admin GET {path}: the broker at {self.admin_url} redirected to "
                    f"{moved.scheme}://{moved.netloc}, without TLS; the credentials are not "
                    "sent there. Have the brokers advertise their https web service "
                    "(webServicePortTls) to each other"
                )
            scheme, netloc = moved.scheme, moved.netloc
            target = _with_authoritative(
                urllib.parse.urlunsplit(("", "", moved.path, moved.query, ""))
            )
            logger.debug("admin GET %s: %d to %s://%s%s", path, status, scheme, netloc, target)
        return status, body  # still a redirect after the last hop: the caller reports it

    def _request_once(
        self, scheme: str, netloc: str, target: str, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        try:
            conn = self._connection(scheme, netloc)
            conn.request("GET", target, headers=headers)
            response = conn.getresponse()
            return response.status, response.read(), response.getheader("Location")
        except (http.client.HTTPException, OSError):
            self._drop(scheme, netloc)
            raise

    async def close(self) -> None:
        """Close the kept-alive connection (a later call opens a new one)."""
        try:
            await asyncio.to_thread(self._close_blocking)
        except RuntimeError:
            # At interpreter exit the default executor takes no more work ("cannot schedule
            # new futures after shutdown"), and a close left for the atexit hooks lands here:
            # closing sockets is quick, so on the loop it is (the close's later steps, the
            # Pulsar client's, must still run).
            self._close_blocking()

    def _close_blocking(self) -> None:
        with self._lock:  # not under a request running in another thread
            self._drop()

    def _drop(self, scheme: str | None = None, netloc: str | None = None) -> None:
        """Close the connection to one broker, or all of them."""
        for key in list(self._conns):
            if scheme is None or key == (scheme, netloc):
                self._conns.pop(key).close()

    async def get(self, path: str) -> tuple[int, Any]:
        return await asyncio.to_thread(self._get_blocking, path)

    async def get_ok(self, path: str) -> Any:
        status, body = await self.get(path)
        if status in (401, 403):
            raise self.access_denied(path, status, body)
        if status != 200:
            error = BrokerError(f"admin GET {path} answered {status}: {body}", result=str(status))
            error.retriable = is_transient_cause(http_cause(status))
            raise error
        return body

    def access_denied(self, path: str, status: int, body: Any) -> AccessDeniedError:
        """The error of a 401 (no or bad credentials) or 403 (no permission) answer."""
        reason = body.get("reason") if isinstance(body, dict) else None  # not Jetty's HTML
        # Pulsar answers 401 also to a valid role without permission ("Unauthorized to
        # validateTopicOperation ..."): that needs a grant, not other credentials.
        if status == 403 or (reason and str(reason).startswith("Unauthorized to")):
            message = (
                f"admin GET {path} at {self.admin_url} answered {status}: the role lacks "
                "permission; grant it produce and consume on the topic's namespace"
            )
        elif self.authenticated:
            message = (
                f"admin GET {path} at {self.admin_url} answered 401 Unauthorized: the "
                "credentials sent were refused (an invalid or expired token?)"
            )
        else:
            message = (
                f"admin GET {path} at {self.admin_url} answered 401 Unauthorized: no "
                "credentials were sent: pass authentication= (a token) or, with a "
                "pulsar.Authentication object, admin_headers="
            )
        if reason:
            message += f" ({reason})"
        return AccessDeniedError(message, result=str(status))

    async def last_position(self, topic: TopicName) -> LogPosition | None:
        """The position of the topic's last message, or None when the topic holds none."""
        body = await self.get_ok(topic.rest_path + "/lastMessageId")
        position = LogPosition(int(body["ledgerId"]), int(body["entryId"]))
        if position.entry >= 0:
            return position
        # entryId -1: the current ledger is empty. The last message, if any, is the last entry
        # of the newest earlier ledger that holds entries.
        stats = await self.get_ok(topic.rest_path + "/internalStats")
        earlier = [
            ledger
            for ledger in stats.get("ledgers", [])
            if int(ledger.get("entries", 0)) > 0 and int(ledger["ledgerId"]) < position.ledger
        ]
        if not earlier:
            return None
        last = max(earlier, key=lambda ledger: int(ledger["ledgerId"]))
        return LogPosition(int(last["ledgerId"]), int(last["entries"]) - 1)

    async def _backlog_quotas(
        self, topic: TopicName, policy: Callable[[str, str], Awaitable[Any]]
    ) -> list[tuple[str, str, dict[str, Any]]]:
        """The topic's limited backlog quotas: (kind, policy, quota) each."""
        quotas = (
            await policy("backlog quotas", topic.rest_path + "/backlogQuotaMap?applied=true") or {}
        )
        return [
            (kind, str(quota.get("policy", "")).lower(), quota)
            for kind, quota in quotas.items()
            # ("limit": the size's older name)
            if int(quota.get("limitSize", quota.get("limit", -1))) >= 0
            or int(quota.get("limitTime", -1)) >= 0
        ]

    async def _check_backlog_quotas(
        self, topic: TopicName, policy: Callable[[str, str], Awaitable[Any]]
    ) -> None:
        """Without trimming, the library's durable subscription never moves from the topic's
        first message: the whole history is its backlog, which grows for ever. A quota that
        holds or refuses producers stops every write once the history passes it (measured:
        the writer's producer refused with ProducerBlockedQuotaExceededException): a WARNING
        at open, not a refusal (a namespace's quota may be far above what the topic will
        ever hold). One that evicts the backlog only moves that subscription, which holds
        nothing here."""
        for kind, action, quota in await self._backlog_quotas(topic, policy):
            if action in ("producer_request_hold", "producer_exception"):
                logger.warning(
                    "%s has a %s backlog quota with %s (%s): the library's subscription %r "
                    "keeps the whole history as its backlog (it moves only with trim_history), "
                    "so every write will fail once the history passes the quota. Remove the "
                    "quota for this topic (pulsar-admin topics remove-backlog-quota) or use "
                    "trim_history",
                    topic,
                    kind,
                    action,
                    quota,
                    TAIL_SUBSCRIPTION,
                )

    async def _check_trim_point(
        self, topic: TopicName, policy: Callable[[str, str], Awaitable[Any]]
    ) -> None:
        """Under a finite retention, only the library's durable subscription keeps the history
        that replicas still need: it must exist, and nothing may move or delete it.
        ``policy(name, path)`` reads one setting (None when this role may not read it)."""
        subscriptions = await policy("subscriptions", topic.rest_path + "/subscriptions")
        if subscriptions is not None and TAIL_SUBSCRIPTION not in subscriptions:
            raise UnsafeTopicPolicyError(
                f"{topic} has no subscription {TAIL_SUBSCRIPTION!r}, which holds its history "
                "when trim_history is on",
                topic=str(topic),
            )
        ttl = await policy("message TTL", topic.rest_path + "/messageTTL?applied=true")
        if ttl not in (None, 0):
            raise UnsafeTopicPolicyError(
                f"{topic} has a message TTL of {ttl}s: it would acknowledge (and so delete) "
                "history that replicas still need. Remove the TTL on the topic and namespace",
                topic=str(topic),
            )
        for kind, action, _quota in await self._backlog_quotas(topic, policy):
            if action == "consumer_backlog_eviction":
                raise UnsafeTopicPolicyError(
                    f"{topic} has a {kind} backlog quota with consumer_backlog_eviction: it "
                    "would move the trim point past history that replicas still need",
                    topic=str(topic),
                )
        namespace = f"/admin/v2/namespaces/{topic.tenant}/{topic.namespace}"
        expiry = await policy("subscription expiry", namespace + "/subscriptionExpirationTime")
        if expiry is None:  # the broker's default, if this user may read it
            status, runtime = await self.get("/admin/v2/brokers/configuration/runtime")
            if status == 200 and isinstance(runtime, dict):
                expiry = int(runtime.get("subscriptionExpirationTimeMinutes", 0))
        if expiry not in (None, 0):
            raise UnsafeTopicPolicyError(
                f"{topic}: subscriptions expire after {expiry} min without consumers; the trim "
                "point's subscription would go, and with it the history it holds. Set "
                "subscriptionExpirationTimeMinutes to 0",
                topic=str(topic),
            )

    async def backlog(
        self, topic: TopicName, *, after: LogPosition | None = None
    ) -> tuple[int, int]:
        """(messages, bytes) stored in the topic after ``after`` (all when None): for progress
        reports on long replays. Bytes are estimated within a partly read ledger."""
        stats = await self.get_ok(topic.rest_path + "/internalStats")
        if after is None:
            return int(stats.get("numberOfEntries", 0)), int(stats.get("totalSize", 0))
        ledgers = stats.get("ledgers", [])
        messages = size = 0
        for index, ledger in enumerate(ledgers):
            entries, ledger_size = int(ledger.get("entries", 0)), int(ledger.get("size", 0))
            if index == len(ledgers) - 1 and entries == 0:  # the open ledger
                entries = int(stats.get("currentLedgerEntries", 0))
                ledger_size = int(stats.get("currentLedgerSize", 0))
            ledger_id = int(ledger["ledgerId"])
            if ledger_id > after.ledger:
                messages, size = messages + entries, size + ledger_size
            elif ledger_id == after.ledger and entries > after.entry + 1:
                left = entries - after.entry - 1
                messages += left
                size += ledger_size * left // entries
        return messages, size

    async def check_access(self, topic: TopicName, *, refuse_partitioned: bool = True) -> None:
        """Fail fast on credentials the broker refuses (the binary client only times out on
        them: the broker drops its connection), and on a partitioned topic."""
        status, body = await self.get(topic.rest_path + "/partitions")
        if status in (401, 403):
            raise self.access_denied(topic.rest_path + "/partitions", status, body)
        if refuse_partitioned and status == 200 and int((body or {}).get("partitions", 0)) > 0:
            raise PartitionedTopicError(
                f"{topic} is partitioned ({body['partitions']} partitions): replicated state "
                "needs a non-partitioned topic, the only kind with one total order",
                topic=str(topic),
            )

    async def check_topic(
        self, topic: TopicName, *, trimmed: bool = False, require_policies: bool = False
    ) -> list[str]:
        """Refuse a partitioned topic and one whose policies would lose history.

        ``trimmed``: the library trims the topic itself (``trim_history``) by moving its
        durable subscription :data:`~._pulsar.TAIL_SUBSCRIPTION`, which must exist. A finite
        retention is then accepted, as it deletes only what that subscription has passed;
        what would move or drop the subscription is refused instead.

        A role with only produce and consume permission may not read policies (the broker
        answers 403). Then, unless ``require_policies``, the policies it could not read are
        logged in one WARNING and returned, and the check goes on: such a role must still be
        able to use the topic, and an operator checks them with ``pulsar-state doctor``.
        """
        await self.check_access(topic)
        return await self.check_policies(topic, trimmed=trimmed, require_policies=require_policies)

    async def check_policies(
        self, topic: TopicName, *, trimmed: bool = False, require_policies: bool = False
    ) -> list[str]:
        """The policy half of :meth:`check_topic`; returns the policies it could not read."""
        unchecked: list[str] = []

        async def policy(name: str, path: str) -> Any:
            status, body = await self.get(path)
            if status == 403 and not require_policies:
                unchecked.append(name)
                return None
            if status != 200:
                return await self.get_ok(path)  # raises the clear error
            return body

        retention = await policy("retention", topic.rest_path + "/retention?applied=true")
        if trimmed:
            await self._check_trim_point(topic, policy)
        else:
            await self._check_backlog_quotas(topic, policy)
        if not trimmed and "retention" not in unchecked:
            retention = retention or {}
            minutes = int(retention.get("retentionTimeInMinutes", 0))
            size_mb = int(retention.get("retentionSizeInMB", 0))
            if minutes != -1 or size_mb != -1:
                raise UnsafeTopicPolicyError(
                    f"{topic} has retention time={minutes} min, size={size_mb} MB: readers hold "
                    "no data, so history would be trimmed. Set infinite retention, e.g. "
                    f"`pulsar-admin namespaces set-retention {topic.tenant}/{topic.namespace} "
                    "--time -1 --size -1`",
                    topic=str(topic),
                )
        threshold = await policy(
            "compaction threshold", topic.rest_path + "/compactionThreshold?applied=true"
        )
        if threshold not in (None, 0):
            raise UnsafeTopicPolicyError(
                f"{topic} has automatic compaction on (threshold {threshold} bytes): compaction "
                "keeps one message per key and would drop history. Remove the compaction "
                "threshold on the topic and its namespace",
                topic=str(topic),
            )
        inactive = await policy(
            "inactive-topic policy", topic.rest_path + "/inactiveTopicPolicies?applied=true"
        )
        if (inactive or {}).get("deleteWhileInactive"):
            raise UnsafeTopicPolicyError(
                f"{topic} is deleted when inactive ({inactive}): its history would be lost. Set "
                "brokerDeleteInactiveTopicsEnabled=false or an inactive-topic policy that keeps it",
                topic=str(topic),
            )
        if unchecked:
            logger.warning(
                "could not check the %s of %s: this role may not read topic policies (HTTP "
                "403). If one of them trims or deletes the topic, history is lost. An operator "
                "with an admin role checks them with `pulsar-state --admin-url %s --topic %s "
                "doctor` (with its token in PULSAR_STATE_AUTH_TOKEN)",
                ", ".join(unchecked),
                topic,
                self.admin_url,
                topic,
            )
        return unchecked
