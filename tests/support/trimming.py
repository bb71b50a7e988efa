"""Making the broker trim a state topic now (for the trim_history tests of core and recipes).

The broker deletes a ledger once it is closed, wholly behind every durable cursor and outside
retention. The tests close ledgers by unloading the topic and ask for the deletion with the
admin ``trim`` call, instead of waiting for the broker's rollover and retention timers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.error
from typing import Any

from pulsar_state._pulsar import TAIL_SUBSCRIPTION
from tests.support.broker import admin_request

NO_RETENTION = {"retentionTimeInMinutes": 0, "retentionSizeInMB": 0}
# Bounded by time, not by a count of tries: on a loaded machine (a CI run at load 12) each
# unload and trim takes seconds, and 100 tries ran out before the broker did it.
TRIM_WAIT_S = 120.0


def rest_path(topic: str) -> str:
    return "/admin/v2/persistent/public/default/" + topic.split("/")[-1]


async def set_policy(admin_url: str, topic: str, policy: str, value: Any) -> None:
    with contextlib.suppress(urllib.error.HTTPError):  # 409: it exists already
        admin_request(admin_url, "PUT", rest_path(topic))  # exists, so it can have policies
    if policy == "messageTTL":  # a query parameter, not a body
        admin_request(admin_url, "POST", rest_path(topic) + f"/messageTTL?messageTTL={value}")
    else:
        admin_request(admin_url, "POST", rest_path(topic) + "/" + policy, value)
    # Topic policies travel through a system topic: they apply after a short delay.
    for _ in range(100):
        if admin_request(admin_url, "GET", rest_path(topic) + f"/{policy}?applied=true") == value:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"policy {policy} never became {value}")


def ledgers(admin_url: str, topic: str) -> list[int]:
    stats = admin_request(admin_url, "GET", rest_path(topic) + "/internalStats")
    return [int(ledger["ledgerId"]) for ledger in stats["ledgers"]]


def mark_delete(admin_url: str, topic: str) -> tuple[int, int]:
    stats = admin_request(admin_url, "GET", rest_path(topic) + "/internalStats")
    ledger, entry = stats["cursors"][TAIL_SUBSCRIPTION]["markDeletePosition"].split(":")
    return int(ledger), int(entry)


async def close_ledger_and_trim(admin_url: str, topic: str) -> None:
    admin_request(admin_url, "PUT", rest_path(topic) + "/unload")  # closes the current ledger
    for _ in range(100):
        try:
            admin_request(admin_url, "POST", rest_path(topic) + "/trim")
            return
        except OSError:  # the topic is being loaded again
            await asyncio.sleep(0.1)


async def trim_ledger_away(admin_url: str, topic: str, ledger: int) -> None:
    """Once a snapshot past ``ledger`` was written (the trim point then moves past it), make
    the broker delete it; fails if it does not within :data:`TRIM_WAIT_S`."""
    deadline = time.monotonic() + TRIM_WAIT_S
    for _ in range(1_000_000):  # (a for loop: polling the broker, no event to wait on)
        if mark_delete(admin_url, topic)[0] > ledger or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    await close_ledger_and_trim(admin_url, topic)
    while ledger in ledgers(admin_url, topic) and time.monotonic() < deadline:
        await close_ledger_and_trim(admin_url, topic)
        await asyncio.sleep(0.2)
    assert ledger not in ledgers(admin_url, topic), "the broker kept the ledger"
