"""The lease table's state machine (pure logic, no broker)."""

from __future__ import annotations

import copy
import itertools
import random
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from pulsar_state import CodecError, ConfigurationError
from recipes import UnknownResourceError
from recipes._lease_table import (
    Lease,
    LeaseEvent,
    LeaseTable,
    LeaseTableCodec,
    check_names,
    check_ttl,
)


class Table:
    """A LeaseTable driven record by record, as a replica would."""

    def __init__(self) -> None:
        self.state = LeaseTable()
        self.position = 0

    def record(self, *ops: dict[str, Any]) -> LeaseTable:
        self.position += 1
        LeaseTable.begin(self.state, self.position)
        for op in ops:
            LeaseTable.apply(self.state, op)
        return self.state

    def acquire(self, lease_id: str, names: list[str], mode: str, now: float, ttl: float = 10):
        op = {"op": "acquire", "id": lease_id, "owner": lease_id, "names": names}
        return self.record({**op, "mode": mode, "ttl": ttl, "now": now})

    def holders(self, name: str) -> list[str]:
        return [lease.id for lease in self.state.holding(name)]


def test_readers_share_writers_exclude_and_tokens_increase() -> None:
    t = Table()
    t.acquire("r1", ["a"], "read", 1)
    t.acquire("r2", ["a"], "read", 2)
    assert t.holders("a") == ["r1", "r2"]
    t.acquire("w1", ["a", "b"], "write", 3)
    assert t.holders("b") == []  # all or nothing: b is free, but a is not
    assert not t.state.leases["w1"].held
    t.record({"op": "release", "id": "r1", "now": 4})
    t.record({"op": "release", "id": "r2", "now": 5})
    assert t.holders("a") == t.holders("b") == ["w1"]
    tokens = [t.state.leases[i].token for i in ("w1",)]
    assert tokens == [3]  # r1=1, r2=2, w1=3: one counter, strictly increasing
    assert t.state.leases["w1"].position == t.position


def test_fifo_a_waiting_writer_is_not_overtaken_by_later_readers() -> None:
    t = Table()
    t.acquire("r1", ["a"], "read", 1)
    t.acquire("w", ["a"], "write", 2)
    t.acquire("r2", ["a"], "read", 3)  # compatible with r1, but w asked first
    assert t.holders("a") == ["r1"]
    t.record({"op": "release", "id": "r1", "now": 4})
    assert t.holders("a") == ["w"]
    t.record({"op": "release", "id": "w", "now": 5})
    assert t.holders("a") == ["r2"]
    assert [e.kind for e in t.state.events] == ["released", "granted"]


def test_expiry_is_decided_by_the_ops_clock_only() -> None:
    t = Table()
    t.acquire("w1", ["a"], "write", 100, ttl=5)
    t.acquire("w2", ["a"], "write", 101, ttl=50)
    assert t.state.leases["w1"].expires_at == 105
    t.record({"op": "tick", "now": 104.9})
    assert t.holders("a") == ["w1"]
    t.record({"op": "renew", "id": "w1", "ttl": 5, "now": 104.95})
    assert t.state.leases["w1"].expires_at == 109.95
    # A clock behind the log clock does not move it back.
    t.record({"op": "tick", "now": 50})
    assert t.state.clock == 104.95
    assert t.holders("a") == ["w1"]
    t.record({"op": "tick", "now": 110})
    assert t.holders("a") == ["w2"]
    assert [e.kind for e in t.state.events] == ["expired", "granted"]
    assert t.state.leases["w2"].token > 1
    assert t.state.leases["w2"].expires_at == 160  # granted at log clock 110, ttl 50
    # Renewing an expired lease does nothing: it is gone before the op takes effect.
    t.record({"op": "renew", "id": "w2", "ttl": 50, "now": 161})
    assert t.state.leases == {}
    assert t.holders("a") == []


def test_a_waiting_request_that_is_not_renewed_expires_and_unblocks_the_queue() -> None:
    t = Table()
    t.acquire("w1", ["a"], "write", 0, ttl=100)
    t.acquire("dead", ["a", "b"], "write", 1, ttl=5)
    t.acquire("r", ["b"], "read", 2, ttl=100)
    assert t.holders("b") == []  # dead waits for a, and wants b first
    t.record({"op": "tick", "now": 6})
    assert t.holders("b") == ["r"]


def test_same_ops_same_table_on_every_replica() -> None:
    rng = random.Random(7)
    ops: list[dict[str, Any]] = []
    now = 0.0
    ids = [f"l{i}" for i in range(40)]
    for lease_id in ids:
        now += rng.random()
        names = rng.sample(["a", "b", "c", "d"], rng.randint(1, 3))
        mode = rng.choice(["read", "write"])
        ops.append({"op": "acquire", "id": lease_id, "owner": "o", "names": names, "mode": mode})
        ops[-1].update(ttl=rng.uniform(1, 5), now=now)
        if rng.random() < 0.5:
            ops.append({"op": "release", "id": rng.choice(ids), "now": now})
    replicas = [Table(), Table()]
    last_token: dict[str, int] = {}
    for op in ops:
        for replica in replicas:
            replica.record(op)
        a, b = (r.state for r in replicas)
        assert a == b
        for name in "abcd":
            holding = a.holding(name)
            writers = [x for x in holding if x.mode == "write"]
            assert not writers or len(holding) == 1, (name, holding)
        for event in a.events:
            if event.kind == "granted":
                for name in event.lease.names:
                    assert event.lease.token > last_token.get(name, 0)
                    last_token[name] = event.lease.token
    assert sum(1 for _ in itertools.chain(last_token)) == 4


def test_a_copy_shares_nothing_that_applying_ops_changes() -> None:
    """The writer's trial state and snapshots are ``LeaseTable.copy`` (not a deep copy):
    applying any ops to a copy must leave the original exactly as it was."""
    rng = random.Random(11)
    table = Table()
    for i in range(30):
        names = rng.sample(["a", "b", "c"], rng.randint(1, 2))
        table.acquire(f"l{i}", names, rng.choice(["read", "write"]), now=i, ttl=50)
        if rng.random() < 0.4:
            table.record({"op": "release", "id": f"l{rng.randrange(i + 1)}", "now": i})
    before = copy.deepcopy(table.state)
    trial = table.state.copy()
    assert trial == table.state
    LeaseTable.begin(trial, table.position + 1)
    for i in range(30):
        LeaseTable.apply(trial, {"op": "release", "id": f"l{i}", "now": 40})
    LeaseTable.apply(trial, {"op": "tick", "now": 1000})
    assert not trial.leases
    assert not trial.holders
    assert table.state == before
    assert table.state.simulate({"op": "tick", "now": 1000}).leases == {}
    assert table.state == before


@pytest.mark.parametrize(
    "op",
    [
        None,
        {"op": "nope", "now": 1},
        {"op": "tick"},
        {"op": "tick", "now": float("nan")},
        {"op": "renew", "id": "x", "now": 1},
        {
            "op": "acquire",
            "id": "x",
            "owner": "o",
            "names": [],
            "mode": "write",
            "ttl": 1,
            "now": 1,
        },
        {"op": "acquire", "id": "x", "owner": "o", "names": ["a"], "mode": "x", "ttl": 1, "now": 1},
        {
            "op": "acquire",
            "id": "x",
            "owner": "o",
            "names": ["a"],
            "mode": "read",
            "ttl": 0,
            "now": 1,
        },
    ],
)
def test_malformed_ops_are_refused(op: Any) -> None:
    with pytest.raises(ValueError, match=r"op|ttl|now"):
        LeaseTable.apply(LeaseTable(), op)


def _acquire(**fields: Any) -> dict[str, Any]:
    op = {"op": "acquire", "id": "x", "owner": "o", "names": ["a"], "mode": "write"}
    return {**op, "ttl": 1, "now": 5, **fields}


@pytest.mark.parametrize(
    ("op", "field"),
    [
        (_acquire(names="db"), "names"),  # was taken as the names "b" and "d"
        (_acquire(names=[""]), "names"),  # was accepted
        (_acquire(names=5), "names"),  # was a TypeError
        (_acquire(names=["a", "a"]), "a name twice"),  # was held twice, released once
        (_acquire(owner=None), "owner"),  # was KeyError, or the owner "None"
        ({k: v for k, v in _acquire().items() if k != "owner"}, "owner"),
        (_acquire(id=7), "id"),  # was the id "7"
        (_acquire(ttl=1e308, now=1e308), "never expire"),  # expired at infinity
        ({"op": "renew", "ttl": 1, "now": 5}, "id"),  # was KeyError
        ({"op": "renew", "id": "x", "ttl": 1e308, "now": 1e308}, "never expire"),
        ({"op": "release", "now": 5}, "id"),  # was KeyError
    ],
)
def test_a_malformed_op_is_refused_before_it_changes_anything(op: Any, field: str) -> None:
    # A foreign or broken writer's op: each replica refuses it alike (ValueError: apply
    # raised, so the replica halts), and the table is as before it, its clock included.
    table = LeaseTable()
    LeaseTable.begin(table, 1)
    LeaseTable.apply(table, _acquire(id="held", ttl=3, now=1))
    before = table.copy()
    with pytest.raises(ValueError, match=field):
        LeaseTable.apply(table, op)
    assert table == before
    assert table.clock == 1


def test_names_and_ttl_are_checked() -> None:
    assert check_names("a", None) == ("a",)
    assert check_names(["b", "a", "b"], None) == ("a", "b")
    for bad in ([], [""], [1], 3, ["a", None]):
        with pytest.raises(ConfigurationError):
            check_names(bad, None)
    with pytest.raises(UnknownResourceError, match="'z'"):
        check_names(["a", "z"], frozenset({"a", "b"}))
    for ttl in (0, -1, float("inf"), float("nan"), True, "5", 1e-300, 0.0009, 1e308):
        with pytest.raises(ConfigurationError):
            check_ttl(ttl)  # type: ignore[arg-type]
    assert check_ttl(2) == 2.0
    assert check_ttl(0.001) == 0.001
    assert check_ttl(10 * 365 * 86400) == 10 * 365 * 86400.0


class ScanningTable:
    """The lease table's rules as plain scans over every lease (O(n) an op): the oracle the
    indexed LeaseTable (expiry heap, waiting index, copy-on-write trials) must match."""

    def __init__(self) -> None:
        self.clock, self.last_token, self.position = 0.0, 0, 0
        self.leases: dict[str, Lease] = {}
        self.holders: dict[str, list[str]] = {}
        self.events: list[LeaseEvent] = []

    def apply(self, op: dict[str, Any]) -> None:
        self.clock = max(self.clock, float(op["now"]))
        for lease in [x for x in self.leases.values() if x.expires_at <= self.clock]:
            self._drop(lease, "expired")
        lease = self.leases.get(op.get("id", ""))
        if op["op"] == "acquire" and lease is None:
            names, ttl = tuple(op["names"]), float(op["ttl"])
            new = Lease(op["id"], op["owner"], names, op["mode"], ttl, self.clock + ttl)
            self.leases[new.id] = new
            self.events.append(LeaseEvent("requested", new, self.position))
        elif op["op"] == "renew" and lease is not None:
            renewed = replace(lease, ttl=float(op["ttl"]), expires_at=self.clock + op["ttl"])
            self.leases[lease.id] = renewed
            self.events.append(LeaseEvent("renewed", renewed, self.position))
        elif op["op"] == "release" and lease is not None:
            self._drop(lease, "released")
        wanted: dict[str, set[str]] = {"read": set(), "write": set()}
        for lease in list(self.leases.values()):
            if lease.held:
                continue
            blocked = any(
                name in wanted["write"]
                or (lease.mode == "write" and name in wanted["read"])
                or any(
                    lease.mode == "write" or self.leases[h].mode == "write"
                    for h in self.holders.get(name, ())
                )
                for name in lease.names
            )
            if blocked:
                wanted[lease.mode].update(lease.names)
                continue
            self.last_token += 1
            fields = (lease.id, lease.owner, lease.names, lease.mode, lease.ttl)
            granted = Lease(*fields, self.clock + lease.ttl, self.last_token, self.position)
            self.leases[lease.id] = granted
            self.events.append(LeaseEvent("granted", granted, self.position))
            for name in lease.names:
                self.holders[name] = [*self.holders.get(name, []), lease.id]

    def _drop(self, lease: Lease, kind: str) -> None:
        del self.leases[lease.id]
        for name in lease.names if lease.held else ():
            self.holders[name].remove(lease.id)
            if not self.holders[name]:
                del self.holders[name]
        self.events.append(LeaseEvent(kind, lease, self.position))  # type: ignore[arg-type]


def _random_op(rng: random.Random, now: float) -> dict[str, Any]:
    lease_id = f"l{rng.randrange(30)}"
    roll = rng.random()
    if roll < 0.45:
        names = rng.sample(["a", "b", "c", "d", "e"], rng.randint(1, 3))
        mode = rng.choice(["read", "write"])
        ttl = rng.choice([0.5, 1.0, 2.0, 5.0])
        return {
            "op": "acquire",
            "id": lease_id,
            "owner": "o",
            "names": names,
            "mode": mode,
            "ttl": ttl,
            "now": now,
        }
    if roll < 0.65:
        return {"op": "renew", "id": lease_id, "ttl": rng.choice([0.5, 1.0, 3.0]), "now": now}
    if roll < 0.9:
        return {"op": "release", "id": lease_id, "now": now}
    return {"op": "tick", "now": now}


def _random_records(
    rng: random.Random, count: int
) -> Iterator[tuple[int, float, list[dict[str, Any]]]]:
    """(position, clock, ops) of ``count`` records of one to three random ops each; clocks
    may go back (the max counts)."""
    now = 0.0
    for position in range(1, count + 1):
        now += rng.choice([0.0, 0.05, 0.3, 1.0, -0.5])
        ops = [_random_op(rng, now + rng.random() * 0.1) for _ in range(rng.randint(1, 3))]
        yield position, now, ops


def _same(table: LeaseTable, oracle: ScanningTable) -> None:
    assert list(table.leases.items()) == list(oracle.leases.items())
    assert dict(table.holders) == oracle.holders
    assert (table.clock, table.last_token, table.position) == (
        oracle.clock,
        oracle.last_token,
        oracle.position,
    )
    assert table.events == oracle.events
    assert table.waiting() == [x for x in oracle.leases.values() if not x.held]
    expiries = [x.expires_at for x in oracle.leases.values()]
    assert table.next_expiry() == min(expiries, default=None)


def _record_both(
    table: LeaseTable, oracle: ScanningTable, position: int, ops: list[dict[str, Any]]
) -> None:
    LeaseTable.begin(table, position)
    oracle.position, oracle.events = position, []
    for op in ops:
        LeaseTable.apply(table, op)
        oracle.apply(op)
    _same(table, oracle)


@pytest.mark.parametrize("seed", range(12))
def test_the_indexed_table_decides_as_a_scan_of_every_lease_would(seed: int) -> None:
    """Expiry by heap, grants over the waiting index, trial views and copies: every record's
    leases, holders, tokens and events (in their order) as the O(n) scans decide them; a trial
    view (and a view of a view) changes nothing below it."""
    rng = random.Random(seed)
    table, oracle = LeaseTable(), ScanningTable()
    for position, now, ops in _random_records(rng, 399):
        if rng.random() < 0.3:
            before = table.copy()
            view = table.trial()
            shadow = copy.deepcopy(oracle)
            _record_both(view, shadow, position, ops)
            due = view.next_expiry()  # a tick exactly at an expiry: the boundary counts
            tick = {"op": "tick", "now": now + 3 if due is None else due}
            deeper = view.simulate(tick)
            shadow.events = []
            shadow.apply(tick)
            _same(deeper, shadow)
            assert table == before  # the views changed nothing below them
        _record_both(table, oracle, position, ops)
        if rng.random() < 0.05:
            # A table made from its fields (a snapshot's codec) rebuilds its indexes.
            table = LeaseTable(
                table.clock,
                table.last_token,
                table.position,
                dict(table.leases),
                {k: list(v) for k, v in table.holders.items()},
                list(table.events),
            )
    assert oracle.last_token > 30  # the run granted, expired and released a lot


@pytest.mark.parametrize("seed", range(12))
def test_adopting_a_trial_view_gives_the_table_its_ops_give(seed: int) -> None:
    """The writer applies its own one-write records by adopting the trial view they were
    built on (``LeaseTable.adopt``, Ownership's ``adopt_trial``) while every other replica
    applies the ops: both must give the same table, record after record (leases and the
    waiting queue in request order, holders, tokens, events, every lease's expiry entry)."""
    rng = random.Random(seed)
    table, oracle = LeaseTable(), ScanningTable()
    adopted = 0
    for position, _now, ops in _random_records(rng, 399):
        if rng.random() < 0.6:
            view = table.trial()
            LeaseTable.begin(view, position)
            for op in ops:
                LeaseTable.apply(view, op)
            assert LeaseTable.adopt(table, view) is table
            oracle.position, oracle.events = position, []
            for op in ops:
                oracle.apply(op)
            _same(table, oracle)
            adopted += 1
        else:
            _record_both(table, oracle, position, ops)
        assert list(table._seq) == list(table.leases)
        assert list(table._waiting) == [i for i, x in table.leases.items() if not x.held]
        entries = set(table._expiry)
        for lease_id, lease in table.leases.items():
            assert (lease.expires_at, table._seq[lease_id], lease_id) in entries
    assert adopted > 150
    assert oracle.last_token > 30


def test_only_a_trial_view_of_the_table_is_adopted() -> None:
    table, other = LeaseTable(), LeaseTable()
    with pytest.raises(ValueError, match="not a trial view"):
        LeaseTable.adopt(table, other.trial())
    with pytest.raises(ValueError, match="not a trial view"):
        LeaseTable.adopt(table, table.copy())


def test_stale_expiry_entries_do_not_pile_up() -> None:
    """Released leases leave heap entries behind; the heap is rebuilt when those outnumber
    the leases, so a busy lock with a long TTL keeps a small heap."""
    table = Table()
    table.acquire("long", ["x"], "write", now=0, ttl=10_000)
    for i in range(5_000):
        table.acquire(f"l{i}", ["y"], "write", now=i * 0.001, ttl=600)
        table.record({"op": "release", "id": f"l{i}", "now": i * 0.001})
    assert len(table.state._expiry) <= 2 * len(table.state.leases) + 64
    assert table.state.next_expiry() == 10_000


@pytest.mark.parametrize("seed", range(8))
def test_a_table_loaded_from_its_snapshot_decides_as_the_table_it_was_taken_of(seed: int) -> None:
    """``LeaseTableCodec`` (Ownership's snapshots): the bytes give back the table exactly
    (encoding what was decoded gives the same bytes), and every record after decides as on
    the table that never went through them."""
    codec = LeaseTableCodec()
    rng = random.Random(seed)
    table, oracle = LeaseTable(), ScanningTable()
    loaded = 0
    for position, _now, ops in _random_records(rng, 299):
        _record_both(table, oracle, position, ops)
        if rng.random() < 0.1:
            data = codec.encode(table)
            decoded = codec.decode(data)
            assert decoded == table  # leases and holders in their order, events too
            assert list(decoded.leases) == list(table.leases)
            assert codec.encode(decoded) == data
            table = decoded
            loaded += 1
    assert loaded > 10
    assert oracle.last_token > 30


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[]",
        b'{"format":2,"clock":0,"last_token":0,"position":0,"leases":[],"holders":{}}',
        b'{"format":1,"clock":0,"last_token":0,"position":0,"leases":[["x"]],"holders":{}}',
        b'{"format":1,"clock":0,"last_token":0,"position":0,"leases":[],"holders":{"a":["x"]}}',
        b'{"format":1,"clock":0,"last_token":1,"position":1,"holders":{"a":["x"]},"events":[],'
        b'"leases":[["x","o",["a"],"both",1.0,2.0,1,1]]}',
        b'{"format":1,"clock":0,"last_token":0,"position":0,"leases":[],"holders":{},'
        b'"events":[["stolen",["x","o",["a"],"read",1.0,2.0,1,1],1]]}',
        b'{"format":1,"clock":0,"last_token":0,"position":0,"leases":[],"holders":[],"events":[]}',
        # A token above the counter: the next grant (token 4) would undercut it. Before:
        # decoded, and tokens no longer increased on "a".
        b'{"format":1,"clock":0,"last_token":3,"position":1,"holders":{"a":["x"]},"events":[],'
        b'"leases":[["x","o",["a"],"write",1.0,2.0,10,1]]}',
        # A clock that is not a number (NaN: no lease would ever expire), a name twice, a
        # waiting request with a grant's position, a TTL of 0, a bool for a token.
        b'{"format":1,"clock":NaN,"last_token":0,"position":0,"leases":[],"holders":{},'
        b'"events":[]}',
        b'{"format":1,"clock":0,"last_token":0,"position":1,"holders":{},"events":[],'
        b'"leases":[["x","o",["a","a"],"read",1.0,2.0,0,0]]}',
        b'{"format":1,"clock":0,"last_token":0,"position":1,"holders":{},"events":[],'
        b'"leases":[["x","o",["a"],"read",1.0,2.0,0,7]]}',
        b'{"format":1,"clock":0,"last_token":0,"position":1,"holders":{},"events":[],'
        b'"leases":[["x","o",["a"],"read",0,2.0,0,0]]}',
        b'{"format":1,"clock":0,"last_token":1,"position":1,"holders":{"a":["x"]},"events":[],'
        b'"leases":[["x","o",["a"],"read",1.0,2.0,true,1]]}',
        # A held writer missing from the holders: a later grant would give "a" to another.
        b'{"format":1,"clock":0,"last_token":1,"position":1,"holders":{},"events":[],'
        b'"leases":[["x","o",["a"],"write",1.0,2.0,1,1]]}',
        b'{"format":1,"clock":0,"last_token":1,"position":1,"holders":{},"events":[],'
        b'"leases":[["x","o","ab","read",1.0,2.0,0,0]]}',
        b'{"format":1,"clock":0,"last_token":0,"position":1,"holders":{},"events":[],'
        b'"leases":[["x","o",["a"],"read",1.0,2.0,0,0],["x","o",["b"],"read",1.0,2.0,0,0]]}',
    ],
)
def test_a_damaged_table_snapshot_is_a_codec_error(data: bytes) -> None:
    with pytest.raises(CodecError, match="not a lease-table snapshot"):
        LeaseTableCodec().decode(data)


def test_a_grant_long_after_its_request_still_expires_at_a_number() -> None:
    # A request with a TTL that fit its own clock, granted when the clock had moved far on
    # (only a foreign or old writer's ops reach such numbers). Before: it expired at inf,
    # never, and the table's next expiry was inf.
    t = Table()
    t.acquire("h", ["r"], "write", now=0, ttl=1)
    t.acquire("w", ["r"], "write", now=0, ttl=1e308)
    t.record({"op": "tick", "now": 9e307})
    granted = t.state.leases["w"]
    assert granted.held
    assert granted.expires_at == sys.float_info.max
    t.record({"op": "tick", "now": sys.float_info.max})
    assert "w" not in t.state.leases


@pytest.mark.parametrize("field", ["now", "ttl"])
def test_an_op_with_an_int_too_large_for_a_float_is_a_value_error(field: str) -> None:
    # Before: OverflowError (from math.isfinite), not the ValueError apply documents.
    op = {"op": "acquire", "id": "x", "owner": "x", "names": ["a"], "mode": "read"}
    op.update({"now": 1.0, "ttl": 1.0, field: 2**1024})
    with pytest.raises(ValueError, match=field):
        Table().record(op)
