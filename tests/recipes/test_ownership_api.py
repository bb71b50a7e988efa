"""Ownership, fenced writes, Counter, LeaderElection and Membership in one process, against
the real broker (several replicas of one topic in one process)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pulsar_state import ConfigurationError, OperationTimeoutError, PulsarStateError
from recipes import (
    Counter,
    Leader,
    LeaderElection,
    Membership,
    NotHeldError,
    Ownership,
    StaleTokenError,
    SyncCounter,
    SyncLeaderElection,
    SyncMembership,
    SyncOwnership,
    UnknownResourceError,
    claim,
    fence_key,
    fenced_transact,
)
from tests.recipes.helpers import new_map, owners, recipe_options
from tests.support.waiting import until


async def test_acquire_release_modes_and_tokens(service_url: str, admin_url: str, topic: str):
    async with (
        owners(service_url, topic, admin_url, owner="a") as a,
        owners(service_url, topic, admin_url, owner="b") as b,
    ):
        r1 = await a.acquire("x", mode="read")
        r2 = await b.acquire(["x"], mode="read")  # readers share
        assert r1.held
        assert r2.token > r1.token
        assert [lease.owner for lease in await b.holders("x", latest=True)] == ["a", "b"]
        # A writer on {x, y} waits for both readers and takes nothing meanwhile (all or
        # nothing); later requests for y queue behind it (FIFO).
        writer = asyncio.ensure_future(a.acquire(["y", "x"], mode="write"))
        await asyncio.sleep(0.5)
        assert not writer.done()
        assert await b.try_acquire("y") is None
        await a.release(r1)
        assert not writer.done()
        await b.release(r2)
        w = await asyncio.wait_for(writer, 30)
        assert w.names == ("x", "y")
        assert w.mode == "write"
        assert w.token > r2.token
        assert a.is_held(w)
        assert [lease.id for lease in await b.holders("y", latest=True)] == [w.id]
        await a.release(w)
        assert await b.holders("x", latest=True) == []


async def test_hold_and_try_acquire(service_url: str, admin_url: str, topic: str) -> None:
    async with (
        owners(service_url, topic, admin_url) as a,
        owners(service_url, topic, admin_url) as b,
    ):
        async with a.hold(["p", "q"]) as lease:
            assert await b.try_acquire("q") is None
            assert await b.try_acquire("q", mode="read") is None
            assert await b.leases(latest=True) == [lease]  # a refused try changes nothing
            other = await b.try_acquire("r")
            assert other is not None
            assert other.token > lease.token
        assert await a.leases(latest=True) == [other]


async def test_acquire_timeout_withdraws_the_request(service_url: str, admin_url: str, topic: str):
    async with (
        owners(service_url, topic, admin_url) as a,
        owners(service_url, topic, admin_url) as b,
    ):
        held = await a.acquire("x")
        started = time.monotonic()
        with pytest.raises(OperationTimeoutError, match="not granted"):
            await b.acquire("x", timeout=1.0)
        assert time.monotonic() - started < 10
        assert await a.leases(latest=True) == [held]  # the waiting request is gone
        await a.release(held)


async def test_an_unrenewed_lease_expires_and_the_waiter_gets_a_larger_token(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        owners(service_url, topic, admin_url) as a,
        owners(service_url, topic, admin_url) as b,
        new_map(service_url, topic + "-data", admin_url) as data,
    ):
        old = await a.acquire("account", ttl=1.0, keep_alive=False)
        await claim(data, old)
        assert await fenced_transact(data, old, lambda view: {"balance": 10}) is not None
        started = time.monotonic()
        new = await b.acquire("account", ttl=30, timeout=30)
        waited = time.monotonic() - started
        assert 0.5 < waited < 1.0 + 5.0, waited  # freed by an expiry tick after its lease
        assert new.token > old.token
        await fenced_transact(data, new, lambda view: {"balance": view["balance"] + 1})
        # The old holder's token is refused, and nothing it tried is applied anywhere.
        with pytest.raises(StaleTokenError, match="stale") as stale:
            await fenced_transact(data, old, lambda view: {"balance": 0})
        assert stale.value.seen == new.token
        assert await data.get("balance", latest=True) == 11
        assert await data.get(fence_key("account")) == new.token
        with pytest.raises(NotHeldError, match="expired or was already released"):
            await a.release(old)
        with pytest.raises(NotHeldError):
            await a.renew(old)
        await b.release(new)


async def test_bad_input_is_refused_before_anything_is_written(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        owners(service_url, topic, admin_url, resources=["a", "b"]) as a,
        owners(service_url, topic, admin_url) as b,
        new_map(service_url, topic + "-data", admin_url) as data,
    ):
        position = await a.manager.sync()
        with pytest.raises(UnknownResourceError, match=r"unknown resource name\(s\) \['c'\]"):
            await a.acquire(["a", "c"])
        for ttl in (0, -1, float("nan"), float("inf")):
            with pytest.raises(ConfigurationError, match="ttl"):
                await a.acquire("a", ttl=ttl)
        with pytest.raises(ConfigurationError, match="at least one"):
            await a.acquire([])
        with pytest.raises(ConfigurationError, match="non-empty str"):
            await a.acquire(["a", ""])
        with pytest.raises(ConfigurationError, match="mode"):
            await a.acquire("a", mode="exclusive")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="owner"):
            Ownership(service_url, topic, owner="")
        with pytest.raises(ConfigurationError, match="sets apply"):
            Ownership(service_url, topic, apply=lambda s, o: None)
        with pytest.raises(ConfigurationError, match=r"snapshot_codec itself \(snapshots=True"):
            Ownership(service_url, topic, snapshot_codec=object())
        with pytest.raises(ConfigurationError, match="ten years"):
            await a.acquire("a", ttl=0.0001)
        assert await a.manager.sync() == position  # nothing was written

        lease = await a.acquire("a")
        with pytest.raises(NotHeldError, match="belongs to"):
            await b.release(lease)
        with pytest.raises(ConfigurationError, match="Lease"):
            await a.release("a")  # type: ignore[arg-type]
        reader = await b.acquire("r", mode="read")
        with pytest.raises(ConfigurationError, match="write mode"):
            await fenced_transact(data, reader, lambda view: {"k": 1})
        with pytest.raises(ConfigurationError, match="fence keys"):
            await fenced_transact(data, lease, lambda view: {fence_key("a"): 10**9})
        await a.release(lease)
        with pytest.raises(NotHeldError, match="already released"):
            await a.release(lease)
        assert await data.list_keys(latest=True) == []


async def test_counter(service_url: str, admin_url: str, topic: str) -> None:
    async with (
        Counter(service_url, topic, **recipe_options(admin_url)) as one,
        Counter(service_url, topic, **recipe_options(admin_url)) as two,
    ):
        results = await asyncio.gather(*(c.add(1) for c in (one, two) for _ in range(50)))
        assert sorted(results) == list(range(1, 101))  # each add saw its own op applied
        assert await two.value(latest=True) == 100
        assert await one.add(-10) == 90
        assert await one.compare_and_set(90, 5) is True
        assert await two.compare_and_set(90, 6) is False
        assert await two.value(latest=True) == 5
        with pytest.raises(ConfigurationError, match="int"):
            await one.add(1.5)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="int"):
            await one.add(True)
    with SyncCounter(service_url, topic, **recipe_options(admin_url)) as blocking:
        assert blocking.value(latest=True) == 5
        assert blocking.add(2) == 7


async def test_sync_ownership(service_url: str, admin_url: str, topic: str) -> None:
    def run() -> list[int]:
        with (
            SyncOwnership(service_url, topic, **recipe_options(admin_url)) as a,
            SyncOwnership(service_url, topic, **recipe_options(admin_url)) as b,
        ):
            with a.hold(["m", "n"]) as lease:
                assert b.try_acquire("n") is None
                assert [x.id for x in b.holders("m", latest=True)] == [lease.id]
            second = b.acquire("n", timeout=30)
            b.release(second)
            with pytest.raises(NotHeldError):
                b.release(second)
            return [lease.token, second.token]

    first, second = await asyncio.to_thread(run)
    assert second > first


async def test_election_and_leaders_stream(service_url: str, admin_url: str, topic: str) -> None:
    options = recipe_options(admin_url)
    async with (
        LeaderElection(service_url, topic, name="one", ttl=5, **options) as one,
        LeaderElection(service_url, topic, name="two", ttl=5, **options) as two,
        LeaderElection(service_url, topic, name="watcher", ttl=5, **options) as watcher,
    ):
        seen: list[Leader | None] = []
        async with watcher.leaders() as leaders:
            first = await one.campaign()
            assert one.is_leader()
            assert await one.campaign() == first  # already leading
            second_task = asyncio.ensure_future(two.campaign())
            await asyncio.sleep(0.3)
            assert not second_task.done()
            await one.resign()
            second = await asyncio.wait_for(second_task, 30)
            assert second.token > first.token
            assert not one.is_leader()
            await two.resign()
            while len(seen) < 4:
                seen.append(await leaders.next(timeout=30))
        assert seen == [None, first, second, None]
        assert await watcher.current_leader() is None
        with pytest.raises(NotHeldError):
            await two.resign()


async def test_an_election_lease_is_none_once_it_ended(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Before: ``lease`` went on returning the lease won last, after it expired (its holder
    # stopped renewing), though its docstring says None once the candidate no longer leads.
    options = recipe_options(admin_url)
    async with LeaderElection(service_url, topic, name="one", ttl=1.0, **options) as one:
        await one.campaign()
        lease = one.lease
        assert lease is not None
        one._ownership._stop_keeping(lease.id)  # test-only: as a holder frozen past its TTL
        await until(lambda: one.lease is None, "the lease ended")
        assert not one.is_leader()
    assert one.lease is None  # closed


async def test_a_table_opens_from_its_snapshot(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Every renewal is a record: without snapshots a table's open replays its whole history.
    async with (
        owners(service_url, topic, admin_url, owner="a", snapshots=True) as a,
        owners(service_url, topic, admin_url, owner="b") as b,
    ):
        held = await a.acquire(["x", "y"])
        reader = await b.acquire("z", mode="read")
        waiting = asyncio.ensure_future(b.acquire("x"))
        await until(lambda: len(a.read_local(lambda t: t.waiting())) == 1, "b waits for x")
        manifest = await a.manager.snapshot()
        async with owners(service_url, topic, admin_url, owner="c", snapshots=True) as c:
            assert c.manager.stats.snapshot_loaded_position == manifest.position
            assert await c.leases(latest=True) == await a.leases(latest=True)
            assert [x.id for x in c.read_local(lambda t: t.waiting())] != []
            await a.release(held)
            granted = await asyncio.wait_for(waiting, 30)
            assert granted.token > max(held.token, reader.token)
            assert await c.holders("x", latest=True) == [granted]
            await b.release(granted)
            await b.release(reader)
            assert await c.leases(latest=True) == []


async def test_membership_events(service_url: str, admin_url: str, topic: str) -> None:
    options = recipe_options(admin_url)
    async with (
        Membership(service_url, topic, name="m1", ttl=5, **options) as m1,
        Membership(service_url, topic, name="m2", ttl=5, **options) as m2,
    ):
        await m1.join()
        with pytest.raises(ConfigurationError, match="already joined"):
            await m1.join()
        assert await m2.members() == ["m1"]  # latest: m2's replica has m1's join now
        async with m2.events() as events:
            await m2.join()
            await m1.leave()
            got = [await events.next(timeout=30) for _ in range(3)]
        assert [(e.kind, e.member, e.reason, e.initial) for e in got] == [
            ("join", "m1", "joined", True),
            ("join", "m2", "joined", False),
            ("leave", "m1", "left", False),
        ]
        assert await m1.members() == ["m2"]
        with pytest.raises(NotHeldError, match="not a member"):
            await m1.leave()


async def test_sync_election_and_membership(service_url: str, admin_url: str, topic: str) -> None:
    options = recipe_options(admin_url)

    def run() -> None:
        with (
            SyncLeaderElection(service_url, f"{topic}-e", name="one", ttl=5, **options) as one,
            SyncLeaderElection(service_url, f"{topic}-e", name="two", ttl=5, **options) as two,
        ):
            with two.leaders() as leaders:
                assert leaders.next(timeout=30) is None
                first = one.campaign(timeout=30)
                assert leaders.next(timeout=30) == first
                assert one.is_leader()
                assert two.current_leader() == first
                one.resign()
                second = two.campaign(timeout=30)
                assert second.token > first.token
                assert leaders.next(timeout=30) is None  # resigned before two campaigned
                assert leaders.next(timeout=30) == second
            with pytest.raises(StopIteration):
                next(iter(leaders))  # closed by leaving the with block
        with (
            SyncMembership(service_url, f"{topic}-m", name="m1", ttl=5, **options) as m1,
            SyncMembership(service_url, f"{topic}-m", name="m2", ttl=5, **options) as m2,
        ):
            m1.join(timeout=30)
            assert m2.members() == ["m1"]
            with m2.events() as events:
                m2.join(timeout=30)
                m1.leave()
                got = [events.next(timeout=30) for _ in range(3)]
            assert [(e.kind, e.member) for e in got] == [
                ("join", "m1"),
                ("join", "m2"),
                ("leave", "m1"),
            ]
            assert m1.members_local() in (["m2"], ["m1", "m2"])  # local: may lag
            assert m1.members() == ["m2"]
            with pytest.raises(NotHeldError):
                m1.leave()

    await asyncio.to_thread(run)


async def test_a_waiting_request_lets_the_holder_release_at_once(
    service_url: str, admin_url: str, topic: str
) -> None:
    # The waiter's process wrote last; it would keep the topic's writer for a minute after its
    # request (idle_release_s), and the holder does not fence it (no takeover), so its release
    # could not be written in its 10 s. A request that waits gives the writer up at once (the
    # holder writes next).
    async with (
        owners(service_url, topic, admin_url, owner="a", takeover_after_s=None) as a,
        owners(service_url, topic, admin_url, owner="b", idle_release_s=60.0) as b,
    ):
        held = await a.acquire("x")
        # Not renewed (b writes nothing more that would make it hand the writer over).
        waiting = asyncio.ensure_future(b.acquire("x", ttl=60, timeout=30, keep_alive=False))
        for _ in range(600):  # until a sees b's request waiting
            if [lease for lease in await a.leases(latest=True) if lease.owner == "b"]:
                break
            await asyncio.sleep(0.05)
        await a.release(held, timeout=10)
        granted = await asyncio.wait_for(waiting, 30)
        assert granted.token > held.token


async def test_a_candidate_whose_request_expired_while_waiting_campaigns_again(
    service_url: str, admin_url: str, topic: str
) -> None:
    # A stall in which nobody can write (the leader killed while holding the topic's writer,
    # a machine at load 9) can outlast a waiting candidate's TTL: its request expires along
    # with the leader's lease. campaign() used to raise NotHeldError then (the candidate
    # dropped out); it campaigns again. The stall is made certain by a tick whose clock is
    # past every lease (ticks are how any process makes expiry happen).
    ttl = 3.0
    options = recipe_options(admin_url)
    async with (
        LeaderElection(service_url, topic, name="one", ttl=ttl, **options) as one,
        LeaderElection(service_url, topic, name="two", ttl=ttl, **options) as two,
    ):
        first = await one.campaign()
        waiting = asyncio.ensure_future(two.campaign(timeout=60))
        for _ in range(600):  # until two's request is in the table
            if len(await one.ownership.leases(latest=True)) == 2:
                break
            await asyncio.sleep(0.05)
        stall = {"op": "tick", "now": time.time() + ttl + 0.5}
        await one.ownership.manager.write(lambda _table: [stall])
        second = await asyncio.wait_for(waiting, 60)
        assert second.name == "two"
        assert second.token > first.token


async def test_a_holder_takes_the_writer_when_a_request_queues_behind_it(
    service_url: str, admin_url: str, topic: str
) -> None:
    # Its release comes next: the writer (an exclusive producer, slow to create) is taken
    # while the waiter queues, so the release itself is only a send. (Without the write
    # relay: with it, a request comes through the holder of the writer, never taking it.)
    async with (
        owners(
            service_url, topic, admin_url, owner="a", idle_release_s=2.0, relay_writes=False
        ) as a,
        owners(service_url, topic, admin_url, owner="b", relay_writes=False) as b,
        owners(service_url, topic, admin_url, owner="c", relay_writes=False) as c,
    ):
        held = await a.acquire("x", ttl=60)  # no renewal (a write) during the test
        await until(lambda: a.manager.stats.writer_releases == 1, "a's writer released")
        other = await c.acquire("y", ttl=60)  # a request for another name is no reason
        await asyncio.sleep(0.3)
        assert a.manager.stats.writer_acquisitions == 1
        waiting = asyncio.ensure_future(b.acquire("x", ttl=60, timeout=30))
        await until(lambda: a.manager.stats.writer_acquisitions == 2, "a takes the writer", 5.0)
        await a.release(held, timeout=10)
        assert a.manager.stats.writer_acquisitions == 2  # the release found it held
        granted = await asyncio.wait_for(waiting, 30)
        assert granted.token > held.token
        await b.release(granted)
        await c.release(other)


async def test_an_idle_replica_reaps_a_short_lease_on_time(
    service_url: str, admin_url: str, topic: str
) -> None:
    # a has no lease, so its reaper sleeps its 5 s backstop; a record bringing an earlier
    # expiry wakes it, and the lease b stopped renewing ends about its TTL later.
    async with (
        owners(service_url, topic, admin_url) as a,
        owners(service_url, topic, admin_url, reap=False) as b,
    ):
        await asyncio.sleep(0.5)
        started = time.monotonic()
        await b.acquire("x", ttl=0.5, keep_alive=False)
        await until(lambda: not a.holders_local("x") and a.position > 1, "x freed", 10.0)
        assert time.monotonic() - started < 2.5


async def test_keep_alive_renews_until_release_and_not_after(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with owners(service_url, topic, admin_url) as a:
        renewals: list[int] = []
        a.subscribe(
            lambda events, table: renewals.extend(e.position for e in events if e.kind == "renewed")
        )
        lease = await a.acquire("x", ttl=1.5)
        await asyncio.sleep(3.5)  # over two TTLs: renewed every 0.5 s
        assert len(renewals) >= 3
        assert a.is_held(lease)
        await a.release(lease)
        count = len(renewals)
        await asyncio.sleep(1.0)
        assert len(renewals) == count  # the renewal timer went with the lease
        assert a._keepers == {}


async def test_only_a_release_that_frees_a_waiter_is_prepared_for(
    service_url: str, admin_url: str, topic: str
) -> None:
    # (Without the write relay, as above.)
    async with (
        owners(
            service_url, topic, admin_url, owner="a", idle_release_s=0.3, relay_writes=False
        ) as a,
        owners(service_url, topic, admin_url, owner="b", relay_writes=False) as b,
        owners(
            service_url, topic, admin_url, owner="c", idle_release_s=0.3, relay_writes=False
        ) as c,
    ):
        held = await a.acquire("x", ttl=60)
        waiting = asyncio.ensure_future(b.acquire("x", ttl=60, timeout=30))
        await until(lambda: a.manager.stats.writer_acquisitions == 2, "a takes the writer")
        await until(lambda: a.manager.stats.writer_releases == 2, "a's idle writer released")
        # A request for a name a does not hold, while b still waits for x: no reason.
        other = await c.acquire("y", ttl=60)
        # Shared readers: b's write request waits for both; neither release alone frees it.
        read_a = await a.acquire("r", mode="read", ttl=60)
        read_c = await c.acquire("r", mode="read", ttl=60)
        await until(lambda: a.manager.stats.writer_releases == 3, "a's idle writer released")
        await until(lambda: c.manager.stats.writer_releases == 2, "c's idle writer released")
        counts = (a.manager.stats.writer_acquisitions, c.manager.stats.writer_acquisitions)
        writer_wants_r = asyncio.ensure_future(b.acquire("r", ttl=60, timeout=30))
        await until(lambda: len(a.read_local(lambda t: t.waiting())) == 2, "b's second request")
        await asyncio.sleep(0.5)
        assert (a.manager.stats.writer_acquisitions, c.manager.stats.writer_acquisitions) == counts
        await a.release(held)
        await b.release(await asyncio.wait_for(waiting, 30))
        await c.release(other)
        await a.release(read_a)
        await c.release(read_c)
        await b.release(await asyncio.wait_for(writer_wants_r, 30))


async def test_a_lock_taken_again_after_an_idle_spell_keeps_the_topic_writer(
    service_url: str, admin_url: str, topic: str
) -> None:
    # With the write relay, an idle process keeps the writer for seconds (not the core's
    # 0.1 s), so a lock taken now and then is one send, not a new producer epoch each time.
    # Without the relay (others could only poll), or when set, the setting is the caller's.
    async with (
        owners(service_url, topic, admin_url, owner="a") as a,
        owners(service_url, f"{topic}-norelay", admin_url, relay_writes=False) as polled,
        owners(service_url, f"{topic}-set", admin_url, idle_release_s=0.1) as chosen,
    ):
        for table in (a, polled, chosen):
            await table.release(await table.acquire("x", keep_alive=False))
        await asyncio.sleep(0.5)
        for table in (a, polled, chosen):
            await table.release(await table.acquire("x", keep_alive=False))
        assert a.manager.stats.writer_acquisitions == 1
        assert a.manager.stats.writer_releases == 0
        assert polled.manager.stats.writer_acquisitions == 2
        assert chosen.manager.stats.writer_acquisitions == 2


async def test_a_release_that_returns_released_the_lease(
    service_url: str, admin_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The release's check used the clock read when release() was called, its op the clock
    # read later, when the write was built: a lease expiring in between was expired by the
    # release's own op, and release() returned as if it had released it (so hold() did not
    # raise NotHeldError). Here the clock jumps past the expiry after its first read.
    import recipes.ownership as ownership_module

    async with owners(service_url, topic, admin_url, reap=False) as a:
        lease = await a.acquire("x", ttl=5, keep_alive=False)
        kinds: list[str] = []
        a.subscribe(lambda events, table: kinds.extend(e.kind for e in events))
        reads = iter([time.time()])

        class Clock:
            def __getattr__(self, name: str) -> object:
                return getattr(time, name)

            def time(self) -> float:
                return next(reads, time.time() + 60)  # the first read, then past the expiry

        monkeypatch.setattr(ownership_module, "time", Clock())
        await a.release(lease)  # returned: so the lease was released, not expired
        await a.manager.sync()
        assert kinds == ["released"]


async def test_a_table_that_falls_forward_before_any_record_tells_what_changed(
    service_url: str, admin_url: str, topic: str
) -> None:
    async with (
        owners(service_url, topic, admin_url, owner="a", snapshots=True, trim_history=True) as a,
        owners(service_url, topic, admin_url, owner="b", snapshots=True) as b,
    ):
        changes: list[tuple[str, str]] = []
        a.subscribe(lambda events, table: changes.extend((e.kind, e.lease.owner) for e in events))
        replica = a.manager._replica  # test-only: a's replica skips b's records
        on_message = replica.on_message
        replica.on_message = lambda *args, **kwargs: None  # type: ignore[method-assign]
        held = await b.acquire("x", ttl=30, keep_alive=False)
        manifest = await b.manager.snapshot()
        replica.on_message = on_message  # type: ignore[method-assign]
        await replica._fall_forward_to(
            manifest.position, lambda: PulsarStateError("no snapshot to fall forward to")
        )
        # Before: a table that had applied no record since it opened told nothing.
        assert changes == [("granted", "b")]
        assert [lease.owner for lease in a.holders_local("x")] == ["b"]
        await b.release(held)


async def test_a_table_that_falls_forward_tells_what_changed(
    service_url: str, admin_url: str, topic: str
) -> None:
    # trim_history: a replica behind the trimmed history falls forward to a snapshot; the
    # records it skipped are not known. Before, its waiting acquire, granted in them, waited
    # for ever (and its keep-alive kept the lease held for everyone); subscribers missed the
    # changes. Injected: a's replica takes no more records, b releases (granting a's
    # request) and snapshots, then a's replica falls forward to that snapshot by its own
    # path (loads it, tells its listeners, releases what waited on the records it skipped,
    # reopens its reader). Loading and telling alone left a's writer, when it held the topic's
    # writer, waiting 30 s for b's release it had appended (1 run in 25 under load).
    async with (
        owners(service_url, topic, admin_url, owner="a", snapshots=True, trim_history=True) as a,
        owners(service_url, topic, admin_url, owner="b", snapshots=True) as b,
    ):
        held = await b.acquire("x", ttl=30, keep_alive=False)
        changes: list[tuple[str, str]] = []
        a.subscribe(lambda events, table: changes.extend((e.kind, e.lease.owner) for e in events))
        waiting = asyncio.ensure_future(a.acquire("x", ttl=30))
        await until(lambda: len(b.read_local(lambda t: t.waiting())) == 1, "a's request")
        await until(lambda: len(a.read_local(lambda t: t.waiting())) == 1, "a sees it")
        changes.clear()
        replica = a.manager._replica  # test-only: what falling forward does
        on_message = replica.on_message
        replica.on_message = lambda *args, **kwargs: None  # type: ignore[method-assign]
        await b.release(held)
        manifest = await b.manager.snapshot()
        replica.on_message = on_message  # type: ignore[method-assign]
        await replica._fall_forward_to(
            manifest.position, lambda: PulsarStateError("no snapshot to fall forward to")
        )
        assert replica.halt is None
        assert replica.version >= manifest.position
        lease = await asyncio.wait_for(waiting, 10)
        assert lease.held
        assert lease.owner == "a"
        assert changes == [("released", "b"), ("granted", "a")]
        await a.release(lease)
        assert await b.holders("x", latest=True) == []
