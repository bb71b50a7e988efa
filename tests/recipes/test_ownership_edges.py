"""Ownership off its happy path, against the real broker: its replica halting under waiters
and streams, a subscriber that raises, a renewal that changes the TTL, options it owns."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from fractions import Fraction
from typing import Any

import pytest

from pulsar_state import (
    ClosedError,
    ConfigurationError,
    OperationTimeoutError,
    PulsarStateError,
    ReplicaHaltedError,
    SharedStateManager,
    WriteOutcomeUnknownError,
    WriterBusyError,
)
from pulsar_state._relay import TURN_REQUEST, is_release_notice
from pulsar_state._writer import Writer
from recipes import (
    LeaderElection,
    Membership,
    Ownership,
    SyncLeaderElection,
    SyncMembership,
    WaitCancelledError,
)
from recipes._lease_table import LeaseEvent, LeaseTable, NotHeldError
from tests.core.helpers import raw_producer
from tests.recipes.helpers import WAIT_S, owners, recipe_options
from tests.support.waiting import until


async def append_an_op_the_table_refuses(service_url: str, topic: str, admin_url: str) -> None:
    """Append, from a replica whose apply accepts anything (as another version's might), an
    op the lease table's apply refuses: every Ownership replica of the topic halts on it."""
    async with SharedStateManager(
        service_url,
        topic,
        initial_state=dict,
        apply=lambda state, op: state,
        **recipe_options(admin_url),
    ) as foreign:
        await foreign.write_ops([{"op": "from-the-future", "now": time.time()}])


async def test_a_halt_fails_waiting_acquires_and_ends_streams_and_renewals(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        owners(service_url, topic, admin_url, owner="holder") as holder,
        LeaderElection(
            service_url, topic, name="watcher", ttl=6.0, **recipe_options(admin_url)
        ) as watcher,
    ):
        # Kept alive every 2 s. (With 3 s, a broker started a minute before once took longer
        # to store a renewal: the lease expired, and the request below was granted at once.)
        lease = await holder.acquire("leader", ttl=6.0)
        await until(lambda: watcher.leader() is not None, "the watcher sees the holder lead")
        waiting = asyncio.ensure_future(watcher.ownership.acquire("leader", ttl=6.0))
        leaders = watcher.leaders()
        first = await leaders.next(timeout=WAIT_S)
        assert first is not None
        assert first.name == "holder"
        await until(lambda: len(holder.read_local(lambda t: t.waiting())) == 1, "the request")
        assert not waiting.done()

        await append_an_op_the_table_refuses(service_url, topic, admin_url)

        # Before: the acquire waited forever, the stream never ended, and the renewals and
        # the reaper failed and retried (warning each time) until closed.
        with pytest.raises(ReplicaHaltedError):
            await asyncio.wait_for(waiting, WAIT_S)
        with pytest.raises(ReplicaHaltedError):
            await leaders.next(timeout=WAIT_S)
        await until(lambda: holder.manager.halted is not None, "the holder's halt")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="recipes.ownership"):
            await asyncio.sleep(4.5)  # over two keep-alive periods, several reaper wake-ups
        # (Its own records: the halted holder closes its producer, which the client logs.)
        assert [r.getMessage() for r in caplog.records if r.name == "recipes.ownership"] == []
        with pytest.raises(ReplicaHaltedError):
            await holder.renew(lease)


async def test_a_subscriber_that_raises_costs_the_others_nothing(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[list[str]] = []

    def broken(events: list[LeaseEvent], table: LeaseTable) -> None:
        raise RuntimeError("a subscriber's bug")

    def recording(events: list[LeaseEvent], table: LeaseTable) -> None:
        seen.append([event.kind for event in events])

    async with LeaderElection(
        service_url, topic, name="a", ttl=10.0, **recipe_options(admin_url)
    ) as election:
        election.ownership.subscribe(broken)  # ahead of the others
        election.ownership.subscribe(recording)
        leaders = election.leaders()
        assert await leaders.next(timeout=WAIT_S) is None  # nobody leads yet
        with caplog.at_level(logging.ERROR, logger="recipes.ownership"):
            await election.campaign()
            # Before: the first subscriber's exception ended the loop over subscribers, so
            # the stream and the recording subscriber missed the grant.
            leader = await leaders.next(timeout=WAIT_S)
        assert leader is not None
        assert leader.name == "a"
        assert any("granted" in kinds for kinds in seen)
        assert any("subscriber raised" in r.getMessage() for r in caplog.records)
        assert election.ownership.manager.halted is None


async def test_renewing_with_a_new_ttl_moves_the_keep_alive_to_it(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with owners(service_url, topic, admin_url) as a, owners(service_url, topic, admin_url):
        # Shorter: the keep-alive must renew within the new TTL, not a third of the old one.
        short = await a.acquire("short", ttl=9.0)  # its keep-alive: every 3 s
        await a.renew(short, ttl=2.4)
        # Longer: the keep-alive must not put the old TTL back.
        long = await a.acquire("long", ttl=3.0)  # every second
        await a.renew(long, ttl=60.0)
        # Before: "short" expired at 2.4 s (the next renewal came at 3 s) and "long" was
        # renewed with 3 s at 1 s.
        await asyncio.sleep(3.6)
        table = await a.manager.read(
            lambda t: {i: (x.ttl, x.held) for i, x in t.leases.items()}, latest=True
        )
        assert table[short.id] == (2.4, True)
        assert table[long.id] == (60.0, True)
        assert a.is_held(short)
        await a.release(short)
        await a.release(long)


def test_options_that_define_the_lease_table_are_refused(service_url: str, topic: str) -> None:
    with pytest.raises(ConfigurationError, match="adopt_trial"):
        Ownership(service_url, topic, adopt_trial=lambda table, view: table)
    with pytest.raises(ConfigurationError, match="trial_state"):
        Ownership(service_url, topic, trial_state=lambda table: table)


def test_resign_and_leave_give_their_timeout_to_the_release(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    given: list[float | None] = []
    release = Ownership.release

    async def spy(self: Ownership, lease: Any, *, timeout: float | None = None) -> None:
        given.append(timeout)
        await release(self, lease, timeout=timeout)

    monkeypatch.setattr(Ownership, "release", spy)
    # Before: the blocking twins' timeout was only their portal's backstop; the release
    # itself waited the manager's write timeout.
    with SyncLeaderElection(service_url, topic, name="a", **recipe_options(admin_url)) as e:
        e.campaign(timeout=WAIT_S)
        e.resign(timeout=7.0)
    with SyncMembership(
        service_url, f"{topic}-members", name="m", **recipe_options(admin_url)
    ) as group:
        group.join(timeout=WAIT_S)
        group.leave(timeout=8.0)
    assert given == [7.0, 8.0]


def test_current_leader_and_members_give_their_timeout_to_the_catch_up(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    given: list[float | None] = []
    sync = SharedStateManager.sync

    async def spy(self: SharedStateManager[Any, Any], *, timeout: float | None = None) -> int:
        given.append(timeout)
        return await sync(self, timeout=timeout)

    monkeypatch.setattr(SharedStateManager, "sync", spy)
    # Before: the blocking twins' timeout was only their portal's backstop; the catch-up
    # itself waited the manager's read timeout (30 s), past the caller's timeout.
    with SyncLeaderElection(service_url, topic, name="a", **recipe_options(admin_url)) as e:
        assert e.current_leader(timeout=6.0) is None
    with SyncMembership(
        service_url, f"{topic}-members", name="m", **recipe_options(admin_url)
    ) as group:
        assert group.members(timeout=9.0) == []
    assert given == [6.0, 9.0]


async def test_after_a_failed_resign_or_leave_campaign_and_join_keep_the_lease_alive(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def failing(self: Ownership, lease: Any, timeout: float | None = None) -> None:
        raise OperationTimeoutError("the release's write did not finish (injected)")

    options = recipe_options(admin_url)
    async with (
        LeaderElection(service_url, topic, name="a", ttl=2.0, **options) as election,
        Membership(service_url, f"{topic}-members", name="m", ttl=2.0, **options) as group,
    ):
        term = await election.campaign(timeout=WAIT_S)
        lease = await group.join(timeout=WAIT_S)
        with monkeypatch.context() as patch:
            patch.setattr(Ownership, "_write_release", failing)
            with pytest.raises(OperationTimeoutError):
                await election.resign()
            with pytest.raises(OperationTimeoutError):
                await group.leave()
        assert election.lease is not None
        assert not election.ownership.is_kept_alive(election.lease)
        # Before: campaign() said "already leads" and join() "already joined" while nothing
        # renewed the leases any more: both ended at their TTL.
        assert await election.campaign(timeout=WAIT_S) == term
        assert (await group.join(timeout=WAIT_S)).id == lease.id
        assert election.ownership.is_kept_alive(election.lease)
        await asyncio.sleep(3.0)  # past the 2 s TTL
        assert election.is_leader()
        assert await group.members() == ["m"]
        with pytest.raises(ConfigurationError, match="already joined"):
            await group.join(timeout=WAIT_S)
        await election.resign()
        await group.leave()
        assert await election.current_leader() is None


async def test_a_campaign_whose_renewal_returns_after_the_election_closed_ends_closed(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def failing(self: Ownership, lease: Any, timeout: float | None = None) -> None:
        raise OperationTimeoutError("the release's write did not finish (injected)")

    gate = asyncio.Event()
    election = LeaderElection(service_url, topic, name="a", ttl=10, **recipe_options(admin_url))
    await election.open()
    try:
        await election.campaign(timeout=WAIT_S)
        lease = election.lease
        assert lease is not None
        with monkeypatch.context() as patch:
            patch.setattr(Ownership, "_write_release", failing)
            with pytest.raises(OperationTimeoutError):
                await election.resign()  # the renewals stop; campaign() renews it again

        async def held_back(self: Ownership, lease_id: str, ttl: Any, timeout: Any = None) -> Any:
            await gate.wait()  # the renewal's write, in flight while the election closes
            return lease

        monkeypatch.setattr(Ownership, "_renew", held_back)
        again = asyncio.ensure_future(election.campaign(timeout=WAIT_S))
        await asyncio.sleep(0.1)
        closing = asyncio.ensure_future(election.aclose())
        await asyncio.sleep(0.1)
        gate.set()
        # Before: campaign() returned the term of an election already closing.
        with pytest.raises(ClosedError):
            await again
        await closing
    finally:
        await election.aclose()


async def test_a_second_open_is_refused_before_it_changes_anything(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with owners(service_url, topic, admin_url) as table:
        seen: list[str] = []
        table.subscribe(lambda events, t: seen.extend(e.kind for e in events))
        with pytest.raises(ConfigurationError, match="already open"):
            await table.open()
        lease = await table.acquire("x", ttl=10)
        await table.release(lease)
        # Before: the second open added the table's record listener again before the
        # manager refused it, so every record was handled (and told) twice.
        assert seen == ["requested", "granted", "released"]


async def test_a_table_whose_open_failed_says_it_is_closed(admin_url: str, topic: str) -> None:
    table = Ownership("pulsar://127.0.0.1:1", topic, **recipe_options(admin_url))  # no broker
    with pytest.raises(PulsarStateError):
        await table.open(timeout=1.0)
    # Before: "already open" (from the manager, which had closed itself).
    with pytest.raises(ClosedError, match="open failed"):
        await table.open(timeout=1.0)
    await table.aclose()


async def test_bad_margins_and_options_of_the_lease_recipes_are_refused(
    service_url: str, admin_url: str, topic: str
) -> None:
    with pytest.raises(ConfigurationError, match="name="):
        LeaderElection(service_url, topic, owner="x", **recipe_options(admin_url))
    with pytest.raises(ConfigurationError, match="name="):
        Membership(service_url, topic, owner="x", **recipe_options(admin_url))
    async with owners(service_url, topic, admin_url) as table:
        lease = await table.acquire("x", ttl=10)
        assert table.is_held(lease, margin=Fraction(1, 2))  # any real number of seconds
        for margin in (-5, "1", None, True, float("nan")):
            # Before: -5 called the lease held 5 s past its expiry; the others raised
            # TypeError or answered False.
            with pytest.raises(ConfigurationError, match="margin"):
                table.is_held(lease, margin=margin)  # type: ignore[arg-type]
        assert table.is_held(lease, margin=1)
        await table.release(lease)


async def test_a_candidacy_that_keeps_expiring_campaigns_again_after_a_pause(
    service_url: str, admin_url: str, topic: str
) -> None:
    options = recipe_options(admin_url)
    async with (
        LeaderElection(service_url, topic, name="a", ttl=30, **options) as leader,
        LeaderElection(service_url, topic, name="b", ttl=0.001, **options) as hopeless,
    ):
        await leader.campaign(timeout=WAIT_S)
        before = leader.ownership.position
        with pytest.raises(OperationTimeoutError):
            await hopeless.campaign(timeout=1.0)  # each request expires at once
        await leader.ownership.manager.sync()
        # Before: a loop of writes with no pause (22 records in that second, here).
        written = leader.ownership.position - before
        assert written <= 12, written
        assert leader.is_leader()


async def test_renewals_that_keep_failing_are_warned_about_once_in_a_while(
    service_url: str,
    admin_url: str,
    topic: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def failing(self: Ownership, lease_id: str, ttl: Any, timeout: Any = None) -> Any:
        raise WriterBusyError("renewal refused (injected)")

    async with owners(service_url, topic, admin_url) as table:
        lease = await table.acquire("x", ttl=2.0)  # renewed every 0.67 s
        with caplog.at_level(logging.DEBUG, logger="recipes.ownership"):
            with monkeypatch.context() as patch:
                patch.setattr(Ownership, "_renew", failing)
                await asyncio.sleep(1.2)  # tries at 0.67, 1.0 and 1.17 s fail
            # The next try, within 0.2 s, renews it (0.8 s before it would expire).
            await until(
                lambda: any(f"renewed lease {lease.id}" in r.getMessage() for r in caplog.records),
                "a renewal after the failures",
            )
        # (This lease's only: a table of another test still closing may log too.)
        failed = [r for r in caplog.records if f"renewing lease {lease.id}" in r.getMessage()]
        warned = [r for r in failed if r.levelno == logging.WARNING]
        # Before: one warning per try (10 in one second of 50 ms tries, measured).
        assert len(failed) >= 3
        assert len(warned) == 1
        assert table.is_held(lease)
        await table.release(lease)


async def test_a_member_with_two_leases_joins_once_and_leaves_with_its_last(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Two leases under one name: a rejoin before the lost lease was reaped, or (here) two
    # processes given the same name. The stream must agree with members() at every step.
    options = recipe_options(admin_url)
    async with (
        Membership(service_url, topic, name="w", ttl=10, **options) as first,
        Membership(service_url, topic, name="w", ttl=10, **options) as second,
        Membership(service_url, topic, name="watcher", ttl=10, **options) as watcher,
    ):
        events = watcher.events()
        await first.join()
        await second.join()
        await first.leave()
        assert await watcher.members() == ["w"]
        await second.leave()
        got = [await events.next(timeout=WAIT_S) for _ in range(2)]
        # Before: join, join, leave (w still a member), leave.
        assert [(e.kind, e.member, e.reason) for e in got] == [
            ("join", "w", "joined"),
            ("leave", "w", "left"),
        ]
        assert got[1].position == watcher.ownership.position
        assert await watcher.members() == []


async def test_a_lease_whose_release_failed_is_released_when_the_table_closes(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with owners(service_url, topic, admin_url, owner="watcher") as watcher:
        # Never fencing (Ownership's default fences a stalled holder after 1 s).
        holder = owners(service_url, topic, admin_url, owner="holder", takeover_after_s=None)
        await holder.open()
        lease = await holder.acquire("disk", ttl=600.0, keep_alive=False)
        # A producer outside the library holds the topic: the release cannot write within
        # its timeout, and writes nothing.
        async with raw_producer(service_url, holder.topic):
            with pytest.raises(PulsarStateError) as failed:
                await holder.release(lease, timeout=1.0)
            assert not isinstance(failed.value, NotHeldError)
        await holder.manager.sync(timeout=WAIT_S)
        assert [held.id for held in holder.holders_local("disk")] == [lease.id]  # still held
        # Before: the failed release had forgotten the lease, so closing left it held for
        # its whole TTL (ten minutes); now closing releases it.
        await holder.aclose()
        assert await watcher.holders("disk", latest=True) == []


async def test_a_request_whose_withdrawal_failed_is_released_when_the_table_closes(
    service_url: str, admin_url: str, topic: str
) -> None:
    holder = owners(service_url, topic, admin_url, owner="holder")
    await holder.open()
    await holder.acquire("disk", ttl=600.0, keep_alive=False)
    requester = owners(
        service_url,
        topic,
        admin_url,
        owner="requester",
        write_timeout_s=2.0,
        takeover_after_s=None,  # never fencing (Ownership's default fences after 1 s)
    )
    await requester.open()
    try:
        waiting = asyncio.ensure_future(requester.acquire("disk", ttl=600.0, timeout=8.0))
        await until(lambda: len(holder.read_local(lambda t: t.waiting())) == 1, "queued")
        await holder.aclose(release=False)  # gone, its lease left to expire
        # The acquire times out while a producer outside the library holds the topic:
        # withdrawing the request cannot be written either.
        async with raw_producer(service_url, requester.topic):
            with pytest.raises(OperationTimeoutError):
                await waiting
        assert len(requester.read_local(lambda t: t.waiting())) == 1  # still queued
    finally:
        # Before: the request was forgotten, so closing left it queued for its whole TTL
        # (ten minutes), first in line; now closing withdraws it.
        await requester.aclose()
    async with owners(service_url, topic, admin_url, owner="watcher") as watcher:
        leases = await watcher.leases(latest=True)
        assert [(lease.owner, lease.held) for lease in leases] == [("holder", True)]


@pytest.mark.parametrize("recipe", ["membership", "election"])
async def test_a_leave_or_resign_that_failed_can_be_called_again(
    service_url: str, admin_url: str, topic: str, recipe: str
) -> None:
    options = recipe_options(admin_url, write_timeout_s=2.0, takeover_after_s=None)
    one: Membership | LeaderElection = (
        Membership(service_url, topic, name="me", ttl=600.0, **options)
        if recipe == "membership"
        else LeaderElection(service_url, topic, name="me", ttl=600.0, **options)
    )
    async with one:
        if isinstance(one, Membership):
            await one.join()
        else:
            await one.campaign()
        give_up = one.leave if isinstance(one, Membership) else one.resign
        async with raw_producer(service_url, one.ownership.topic):
            with pytest.raises(PulsarStateError) as failed:
                await give_up(timeout=1.0)
            assert not isinstance(failed.value, NotHeldError)
        # Before: the lease was forgotten at the first call, so this raised NotHeldError
        # while the table still held it.
        await give_up(timeout=WAIT_S)
        assert await one.ownership.leases(latest=True) == []


class LateRelay:
    """Every process's write relay delivers the records it receives ``hold_s`` after the
    first, then in order (a holder's notice that it let the writer go at once), as on a
    holder slow to read its relay. Requests for a turn at the writer are dropped: the
    holder keeps it, and appends the records."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold_s: float) -> None:
        self.held: list[tuple[Writer, bytes]] = []
        self.delivered = False
        accept = Writer.accept_foreign

        def deliver() -> None:
            self.delivered = True
            for writer, payload in self.held:
                accept(writer, payload)

        def late(writer: Writer, payload: bytes) -> None:
            if payload == TURN_REQUEST:
                return
            if self.delivered or is_release_notice(payload):
                accept(writer, payload)
                return
            if not self.held:
                asyncio.get_running_loop().call_later(hold_s, deliver)
            self.held.append((writer, payload))

        monkeypatch.setattr(Writer, "accept_foreign", late)


@pytest.mark.parametrize("disk", ["free", "held"])
async def test_a_request_that_lands_after_its_acquire_gave_up_is_withdrawn(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch, disk: str
) -> None:
    relay = LateRelay(monkeypatch, hold_s=1.0)
    async with (
        owners(service_url, topic, admin_url, owner="holder") as holder,
        # Never fencing the holder (Ownership's default takes the writer over after 1 s).
        owners(service_url, topic, admin_url, owner="requester", takeover_after_s=None) as req,
    ):
        seen: list[tuple[str, str]] = []
        holder.subscribe(lambda events, _: seen.extend((e.kind, e.lease.owner) for e in events))
        # Takes the topic's writer and keeps it: the requester's writes are relayed to it.
        held = await holder.acquire("disk" if disk == "held" else "elsewhere", ttl=600.0)
        await req.manager.sync(timeout=WAIT_S)
        # The request lands after the acquire timed out (its outcome unknown then), and
        # before the withdrawal the acquire appends on its way out.
        with pytest.raises(WriteOutcomeUnknownError):
            await req.acquire("disk", ttl=600.0, timeout=0.3)
        await until(lambda: relay.delivered, "the relayed records delivered")
        landed = ("granted" if disk == "free" else "requested", "requester")
        # Before: nothing was withdrawn (the request was not in the table yet), so the
        # request held "disk" (or waited for it, first in line) for its whole TTL, ten
        # minutes, with nobody to release it.
        await until(lambda: ("released", "requester") in seen, "the request withdrawn")
        assert seen.index(landed) < seen.index(("released", "requester"))
        assert req._abandoned == {}  # the withdrawal was appended: nothing left to watch
        if disk == "held":
            await holder.release(held)
        lease = await holder.acquire("disk", ttl=600.0, timeout=10.0)
        assert [h.id for h in holder.holders_local("disk")] == [lease.id]


async def test_a_request_that_lands_as_its_table_closes_is_released(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    relay = LateRelay(monkeypatch, hold_s=1.5)
    async with owners(service_url, topic, admin_url, owner="holder") as holder:
        seen: list[tuple[str, str]] = []
        holder.subscribe(lambda events, _: seen.extend((e.kind, e.lease.owner) for e in events))
        await holder.acquire("elsewhere", ttl=600.0)  # takes the topic's writer, keeps it
        requester = owners(
            service_url,
            topic,
            admin_url,
            owner="requester",
            takeover_after_s=None,
            write_timeout_s=1.0,  # the withdrawal times out too, before the request lands
        )
        async with requester:
            await requester.manager.sync(timeout=WAIT_S)
            with pytest.raises(WriteOutcomeUnknownError):
                await requester.acquire("disk", ttl=600.0, timeout=0.3)
            assert not relay.delivered
        # Closed while the request was on its way (it landed during the close). Before: the
        # close released nothing (the request was not this process's yet), and it held
        # "disk" for its whole TTL.
        await until(lambda: relay.delivered, "the relayed records delivered")
        await until(lambda: ("released", "requester") in seen, "the request released")
        assert ("granted", "requester") in seen
        lease = await holder.acquire("disk", ttl=600.0, timeout=10.0)
        assert [h.id for h in holder.holders_local("disk")] == [lease.id]


async def test_a_join_in_flight_when_the_group_closes_leaves_no_member(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    LateRelay(monkeypatch, hold_s=1.0)
    async with owners(service_url, topic, admin_url, owner="holder") as holder:
        seen: list[tuple[str, str]] = []
        holder.subscribe(lambda events, _: seen.extend((e.kind, e.lease.owner) for e in events))
        await holder.acquire("elsewhere", ttl=600.0)  # takes the topic's writer, keeps it
        group = Membership(
            service_url,
            topic,
            name="member",
            ttl=600.0,
            takeover_after_s=None,
            **recipe_options(admin_url),
        )
        await group.open()
        await group.ownership.manager.sync(timeout=WAIT_S)
        joining = asyncio.ensure_future(group.join())
        await until(lambda: group.ownership.manager.stats.records_relayed >= 1, "relayed")
        await group.aclose()  # while the request is on its way
        # Before: the join returned a lease after the close, and the member stayed in the
        # group for its whole TTL (nobody renewing, nobody releasing).
        with pytest.raises(ClosedError):
            await asyncio.wait_for(joining, WAIT_S)
        await holder.manager.sync(timeout=WAIT_S)
        await until(
            lambda: not holder.read_local(lambda t: t.holding("members") + t.waiting()),
            "no member left",
        )
        if ("granted", "member") in seen:
            assert ("released", "member") in seen


async def test_two_campaigns_at_once_lead_once_and_resign_once(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with LeaderElection(
        service_url, topic, name="one", ttl=600.0, **recipe_options(admin_url)
    ) as election:
        first, second = await asyncio.gather(election.campaign(), election.campaign())
        assert first == second
        await election.resign()
        # Before: the second campaign's request waited behind the first's lease, so the
        # resignation handed the lead straight back to this process.
        assert await election.current_leader() is None
        with pytest.raises(ConfigurationError, match="max_queue"):
            election.leaders(max_queue=0)
    async with Membership(
        service_url, topic + "-group", name="m", ttl=600.0, **recipe_options(admin_url)
    ) as group:
        joined = await asyncio.gather(group.join(), group.join(), return_exceptions=True)
        assert sum(isinstance(j, ConfigurationError) for j in joined) == 1
        await group.leave()
        assert await group.members() == []


async def test_a_raising_close_callback_neither_stops_the_close_nor_other_streams(
    service_url: str, admin_url: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    election = LeaderElection(service_url, topic, name="one", ttl=60.0, **recipe_options(admin_url))
    await election.open()

    def buggy(error: PulsarStateError) -> None:
        raise RuntimeError("a bug in a close callback")

    election.ownership.on_close(buggy)
    leaders = election.leaders()
    dropped = election.leaders()
    dropped.close()
    # A stream closed early leaves nothing behind (before: kept until the table closed).
    assert len(election.ownership._on_close) == 2
    with caplog.at_level(logging.ERROR, logger="recipes.ownership"):
        await election.aclose()  # before: ZeroDivisionError, and the table left open
    assert election.ownership.manager.closed
    assert await leaders.next(timeout=WAIT_S) is None  # the leader when it opened
    with pytest.raises(ClosedError):
        await leaders.next(timeout=WAIT_S)
    assert "on_close callback raised" in caplog.text


def _waiting_owners(table: LeaseTable) -> list[str]:
    return [lease.owner for lease in table.waiting()]


async def _until_in_line(observer: LeaderElection, owners: list[str]) -> None:
    """Wait until ``observer``'s replica shows exactly ``owners`` waiting, in that order."""
    await until(
        lambda: observer.ownership.read_local(_waiting_owners) == owners, f"in line: {owners}"
    )


def _until_in_line_blocking(observer: SyncLeaderElection, owners: list[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while observer.async_election.ownership.read_local(_waiting_owners) != owners:
        assert time.monotonic() < deadline, f"never in line: {owners}"
        time.sleep(0.01)


def _campaign_in_thread(
    candidate: SyncLeaderElection,
) -> tuple[threading.Thread, list[BaseException | None]]:
    """``candidate.campaign()`` (no timeout) blocking in a thread of its own; the list gets
    what ended it (None: it won)."""
    outcome: list[BaseException | None] = []

    def campaign() -> None:
        try:
            candidate.campaign()
            outcome.append(None)
        except BaseException as exc:  # the thread reports whatever ended it
            outcome.append(exc)

    thread = threading.Thread(target=campaign)
    thread.start()
    return thread, outcome


async def test_cancel_calls_off_a_waiting_campaign_and_withdraws_its_request(
    service_url: str, admin_url: str, topic: str
) -> None:
    options = recipe_options(admin_url)
    async with (
        LeaderElection(service_url, topic, name="a", ttl=5, **options) as a,
        LeaderElection(service_url, topic, name="b", ttl=5, **options) as b,
    ):
        a.cancel()  # nothing in progress: nothing happens
        term = await a.campaign(timeout=WAIT_S)
        b.cancel()
        waiting = asyncio.create_task(b.campaign())
        await _until_in_line(a, ["b"])
        a.cancel()  # a leads: its term is kept
        b.cancel()  # before: no way to stop b's campaign short of closing the election
        with pytest.raises(WaitCancelledError, match="called off"):
            await asyncio.wait_for(waiting, WAIT_S)
        await _until_in_line(a, [])
        assert [lease.owner for lease in await b.ownership.leases(latest=True)] == ["a"]
        assert a.is_leader()
        # b is still a candidate to be: a campaign after the cancel is not affected.
        again = asyncio.create_task(b.campaign(timeout=WAIT_S))
        await asyncio.sleep(0.2)
        await a.resign()
        won = await asyncio.wait_for(again, WAIT_S)
        assert won.name == "b"
        assert won.token > term.token


async def test_cancel_calls_off_the_campaign_of_a_leader_whose_term_ended(
    service_url: str, admin_url: str, topic: str
) -> None:
    options = recipe_options(admin_url)
    async with (
        LeaderElection(service_url, topic, name="a", ttl=1, **options) as a,
        LeaderElection(service_url, topic, name="b", ttl=5, **options) as b,
    ):
        await a.campaign(timeout=WAIT_S)
        term = a._lease  # (a.lease: None already if winning took longer than the TTL)
        assert term is not None
        a.ownership._stop_keeping(term.id)  # no renewals: as in a stall past the TTL
        await until(lambda: not a.is_leader(), "a's term expired", seconds=WAIT_S)
        await b.campaign(timeout=WAIT_S)
        again = asyncio.create_task(a.campaign())  # the candidate lines up again
        await _until_in_line(b, ["a"])
        # Before: nothing happened (a's ended term counted as one held), and the campaign
        # waited on behind b.
        a.cancel()
        with pytest.raises(WaitCancelledError):
            await asyncio.wait_for(again, WAIT_S)
        await _until_in_line(b, [])
        assert b.is_leader()


async def test_a_task_cancelled_by_its_own_caller_stays_cancelled(
    service_url: str, admin_url: str, topic: str
) -> None:
    options = recipe_options(admin_url)
    async with (
        LeaderElection(service_url, topic, name="a", ttl=5, **options) as a,
        LeaderElection(service_url, topic, name="b", ttl=5, **options) as b,
    ):
        await a.campaign(timeout=WAIT_S)
        waiting = asyncio.create_task(b.campaign())
        await _until_in_line(a, ["b"])
        waiting.cancel()  # the caller's own cancellation is not turned into an error
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await _until_in_line(a, [])


async def test_the_blocking_cancel_calls_off_a_campaign_blocked_in_another_thread(
    service_url: str, admin_url: str, topic: str
) -> None:
    options = recipe_options(admin_url)

    def run() -> None:
        with (
            SyncLeaderElection(service_url, topic, name="a", ttl=5, **options) as a,
            SyncLeaderElection(service_url, topic, name="b", ttl=5, **options) as b,
        ):
            a.campaign(timeout=WAIT_S)
            blocked, outcome = _campaign_in_thread(b)  # until a resigns, or the cancel
            _until_in_line_blocking(a, ["b"])
            b.cancel()
            blocked.join(WAIT_S)
            assert not blocked.is_alive()
            assert isinstance(outcome[0], WaitCancelledError)
            assert a.is_leader()
            _until_in_line_blocking(a, [])  # withdrawn
            a.resign()
            assert b.campaign(timeout=WAIT_S).name == "b"  # still usable
        b.cancel()  # closed: nothing to do, no error

    await asyncio.to_thread(run)


async def test_a_cancel_while_a_failing_campaign_withdraws_leaves_no_cancellation_due(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = recipe_options(admin_url)
    async with (
        LeaderElection(service_url, topic, name="a", ttl=5, **options) as a,
        LeaderElection(service_url, topic, name="b", ttl=5, **options) as b,
    ):
        await a.campaign(timeout=WAIT_S)
        withdraw = Ownership._withdraw

        async def cancelled_while_withdrawing(self: Ownership, *args: Any, **kw: Any) -> bool:
            # The campaign is failing (its timeout) and withdraws: a cancel() comes now.
            asyncio.get_running_loop().call_soon(b.cancel)
            return await withdraw(self, *args, **kw)

        monkeypatch.setattr(Ownership, "_withdraw", cancelled_while_withdrawing)

        async def campaign() -> int:
            with pytest.raises(OperationTimeoutError):  # its own failure, as it came
                await b.campaign(timeout=0.5)
            task = asyncio.current_task()
            assert task is not None
            # Before: 1 for good (the withdraw swallows the cancellation): a timeout the
            # caller entered then raised CancelledError, and its next cancel() a bare one.
            return task.cancelling()

        assert await asyncio.wait_for(asyncio.create_task(campaign()), WAIT_S) == 0
        monkeypatch.undo()
        # (The shielded withdraw went on after the cancel: the request goes.)
        await _until_in_line(a, [])
        # The recipe still campaigns and is called off as documented.
        again = asyncio.create_task(b.campaign())
        await _until_in_line(a, ["b"])
        b.cancel()
        with pytest.raises(WaitCancelledError):
            await asyncio.wait_for(again, WAIT_S)


async def test_the_blocking_cancel_works_from_the_portals_own_thread(
    service_url: str, admin_url: str, topic: str
) -> None:
    options = recipe_options(admin_url)

    def run() -> None:
        with (
            SyncLeaderElection(service_url, topic, name="a", ttl=5, **options) as a,
            SyncLeaderElection(
                service_url, topic, name="b", ttl=5, portal=a.portal, **options
            ) as b,
        ):
            a.campaign(timeout=WAIT_S)
            blocked, outcome = _campaign_in_thread(b)
            _until_in_line_blocking(a, ["b"])
            # From a callback on the portal's loop (a subscriber, say). Before: RuntimeError
            # ("blocking call from the portal's own thread would deadlock"), nothing called off.
            a.portal.call_sync(b.cancel)
            blocked.join(WAIT_S)
            assert isinstance(outcome[0], WaitCancelledError)

    await asyncio.to_thread(run)
