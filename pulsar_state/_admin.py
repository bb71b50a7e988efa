"""The few Pulsar admin REST calls the manager needs: topic policies, side-topic tails, backlog.

The state topic's tail is captured over the binary protocol (``_tail``); the admin API's
``lastMessageId`` and ledger list remain for the snapshot side topics, for the rare tail the
binary answer leaves open (an empty current ledger), and for the CLI. The same API tells
whether a topic is partitioned or would lose history.
The standard library's HTTP client runs in a worker thread so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

from tenacity import Retrying, retry_if_exception, stop_after_attempt

from ._errors import (
    BrokerError,
    BrokerUnavailableError,
    ConfigurationError,
    OperationTimeoutError,
    PartitionedTopicError,
    UnsafeTopicPolicyError,
)
from ._pulsar import TAIL_SUBSCRIPTION, LogPosition, http_cause, is_transient_cause

__all__ = ["AdminClient", "TopicName", "default_admin_url", "resolve_admin_url"]


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


class AdminClient:
    """A minimal asynchronous client for Pulsar's admin REST API."""

    def __init__(
        self, admin_url: str, *, timeout_s: float = 10.0, headers: dict[str, str] | None = None
    ) -> None:
        self.admin_url = admin_url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Accept": "application/json", **(headers or {})}
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def _connection(self) -> http.client.HTTPConnection:
        # One kept-alive connection: a new one per call costs about 10 ms, and the tail
        # position is fetched on every linearizable read.
        if self._conn is None:
            parts = urllib.parse.urlsplit(self.admin_url)
            factory = (
                http.client.HTTPSConnection
                if parts.scheme == "https"
                else http.client.HTTPConnection
            )
            self._conn = factory(parts.netloc, timeout=self.timeout_s)
        return self._conn

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
        base = urllib.parse.urlsplit(self.admin_url).path.rstrip("/")
        try:
            conn = self._connection()
            conn.request("GET", base + path, headers=self._headers)
            response = conn.getresponse()
            return response.status, response.read()
        except (http.client.HTTPException, OSError):
            self._drop()
            raise

    async def close(self) -> None:
        """Close the kept-alive connection (a later call opens a new one)."""
        await asyncio.to_thread(self._close_blocking)

    def _close_blocking(self) -> None:
        with self._lock:  # not under a request running in another thread
            self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def get(self, path: str) -> tuple[int, Any]:
        return await asyncio.to_thread(self._get_blocking, path)

    async def get_ok(self, path: str) -> Any:
        status, body = await self.get(path)
        if status != 200:
            error = BrokerError(f"admin GET {path} answered {status}: {body}", result=str(status))
            error.retriable = is_transient_cause(http_cause(status))
            raise error
        return body

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

    async def _check_trim_point(self, topic: TopicName) -> None:
        """Under a finite retention, only the library's durable subscription keeps the history
        that replicas still need: it must exist, and nothing may move or delete it."""
        subscriptions = await self.get_ok(topic.rest_path + "/subscriptions") or []
        if TAIL_SUBSCRIPTION not in subscriptions:
            raise UnsafeTopicPolicyError(
                f"{topic} has no subscription {TAIL_SUBSCRIPTION!r}, which holds its history "
                "when trim_history is on",
                topic=str(topic),
            )
        ttl = await self.get_ok(topic.rest_path + "/messageTTL?applied=true")
        if ttl not in (None, 0):
            raise UnsafeTopicPolicyError(
                f"{topic} has a message TTL of {ttl}s: it would acknowledge (and so delete) "
                "history that replicas still need. Remove the TTL on the topic and namespace",
                topic=str(topic),
            )
        quotas = await self.get_ok(topic.rest_path + "/backlogQuotaMap?applied=true") or {}
        for kind, quota in quotas.items():
            evicts = str(quota.get("policy", "")).lower() == "consumer_backlog_eviction"
            limited = int(quota.get("limitSize", -1)) >= 0 or int(quota.get("limitTime", -1)) >= 0
            if evicts and limited:
                raise UnsafeTopicPolicyError(
                    f"{topic} has a {kind} backlog quota with consumer_backlog_eviction: it "
                    "would move the trim point past history that replicas still need",
                    topic=str(topic),
                )
        namespace = f"/admin/v2/namespaces/{topic.tenant}/{topic.namespace}"
        expiry = await self.get_ok(namespace + "/subscriptionExpirationTime")
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

    async def check_topic(self, topic: TopicName, *, trimmed: bool = False) -> None:
        """Refuse a partitioned topic and one whose policies would lose history.

        ``trimmed``: the library trims the topic itself (``trim_history``) by moving its
        durable subscription :data:`~._pulsar.TAIL_SUBSCRIPTION`, which must exist. A finite
        retention is then accepted, as it deletes only what that subscription has passed;
        what would move or drop the subscription is refused instead.
        """
        status, body = await self.get(topic.rest_path + "/partitions")
        if status == 200 and int((body or {}).get("partitions", 0)) > 0:
            raise PartitionedTopicError(
                f"{topic} is partitioned ({body['partitions']} partitions): replicated state "
                "needs a non-partitioned topic, the only kind with one total order",
                topic=str(topic),
            )
        retention = await self.get_ok(topic.rest_path + "/retention?applied=true") or {}
        minutes = int(retention.get("retentionTimeInMinutes", 0))
        size_mb = int(retention.get("retentionSizeInMB", 0))
        if trimmed:
            await self._check_trim_point(topic)
        elif minutes != -1 or size_mb != -1:
            raise UnsafeTopicPolicyError(
                f"{topic} has retention time={minutes} min, size={size_mb} MB: readers hold no "
                "data, so history would be trimmed. Set infinite retention, e.g. "
                f"`pulsar-admin namespaces set-retention {topic.tenant}/{topic.namespace} "
                "--time -1 --size -1`",
                topic=str(topic),
            )
        threshold = await self.get_ok(topic.rest_path + "/compactionThreshold?applied=true")
        if threshold not in (None, 0):
            raise UnsafeTopicPolicyError(
                f"{topic} has automatic compaction on (threshold {threshold} bytes): compaction "
                "keeps one message per key and would drop history. Remove the compaction "
                "threshold on the topic and its namespace",
                topic=str(topic),
            )
        inactive = await self.get_ok(topic.rest_path + "/inactiveTopicPolicies?applied=true") or {}
        if inactive.get("deleteWhileInactive"):
            raise UnsafeTopicPolicyError(
                f"{topic} is deleted when inactive ({inactive}): its history would be lost. Set "
                "brokerDeleteInactiveTopicsEnabled=false or an inactive-topic policy that keeps it",
                topic=str(topic),
            )
