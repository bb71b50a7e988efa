"""The lease table's state machine (pure logic, no broker)."""

from __future__ import annotations

import copy
import itertools
import random
from typing import Any

import pytest

from pulsar_state import ConfigurationError
from recipes import UnknownResourceError
from recipes._lease_table import LeaseTable, check_names, check_ttl


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


def test_names_and_ttl_are_checked() -> None:
    assert check_names("a", None) == ("a",)
    assert check_names(["b", "a", "b"], None) == ("a", "b")
    for bad in ([], [""], [1], 3, ["a", None]):
        with pytest.raises(ConfigurationError):
            check_names(bad, None)
    with pytest.raises(UnknownResourceError, match="'z'"):
        check_names(["a", "z"], frozenset({"a", "b"}))
    for ttl in (0, -1, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ConfigurationError):
            check_ttl(ttl)  # type: ignore[arg-type]
    assert check_ttl(2) == 2.0
