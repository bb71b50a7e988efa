"""The replicated lease table behind Ownership, LeaderElection and Membership (pure logic).

Every replica applies the same ops in log order to a :class:`LeaseTable`; nothing here reads a
clock or does I/O, so every replica agrees on who holds what at every position of the log.

**Time.** Each op carries ``now``: the wall clock (Unix seconds) of the process that wrote
it, read when its generator ran. The table's *log clock* is the largest ``now`` seen so far
(it never goes back). Before an op takes effect, every lease (held or waiting) whose
``expires_at`` is at or before the log clock is removed, then the op is applied, then waiting
requests are granted. Expiry is thus decided by data in the log only; a process whose clock
says a lease is past due appends a ``tick`` op (carrying its ``now``) to make it happen.

**Grants.** Requests wait in log order (FIFO). A request is granted, all names at once,
when none of its names is held in a conflicting mode (read/read is the only compatible pair)
and no earlier waiting request wants one of them in a conflicting mode (so later readers
never overtake a waiting writer: no starvation). Each grant takes the next fencing token
from one counter, so tokens strictly increase per resource (and overall).

**Cost.** An op costs O(log n + what it changes) in a table of n leases, not O(n): expiry
goes by a heap of expiry times, grants look at the waiting requests only, and the writer's
trial copy (:meth:`LeaseTable.trial`) is a copy-on-write view. A table of 10,000 held
leases made every acquire+release 14 times slower before (22.6 ms against 1.6 ms).
"""

from __future__ import annotations

import heapq
import json
import math
import sys
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard, cast

from pulsar_state import CodecError, ConfigurationError, DictOverlay, PulsarStateError

__all__ = [
    "Lease",
    "LeaseEvent",
    "LeaseTable",
    "LeaseTableCodec",
    "Mode",
    "NotHeldError",
    "StaleTokenError",
    "UnknownResourceError",
    "WaitCancelledError",
    "check_names",
    "check_ttl",
]

Mode = Literal["read", "write"]
EventKind = Literal["requested", "granted", "renewed", "released", "expired"]
_OPS = frozenset({"acquire", "renew", "release", "tick"})


class NotHeldError(PulsarStateError):
    """The lease is not held (never was, was released, or expired): nothing was written."""


class WaitCancelledError(PulsarStateError):
    """A ``campaign()`` or ``join()`` waiting in this process was called off by ``cancel()``
    (kazoo's ``Election.cancel``): its request was withdrawn (or, if that write failed, is
    withdrawn whenever it shows up), and nothing is held by it."""


class StaleTokenError(PulsarStateError):
    """A fenced write carried a token older than one the protected state has already seen.

    The lease it came from was lost (a newer holder has written since): nothing was written.
    """

    def __init__(self, message: str, *, token: int, seen: int) -> None:
        super().__init__(message)
        self.token = token
        self.seen = seen


class UnknownResourceError(ConfigurationError):
    """A name outside the resources this Ownership was created with."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A request for, or a grant of, a set of named resources (the same on every replica).

    ``token`` is the fencing token (0 while the request waits): strictly larger than every
    token granted before on the topic, so on each of its names. ``expires_at`` is in log-clock
    seconds (Unix time): the lease ends at the first op whose ``now`` reaches it, unless
    renewed. ``position`` is the log position of the record that granted it (0 while waiting).
    """

    id: str
    owner: str
    names: tuple[str, ...]
    mode: Mode
    ttl: float
    expires_at: float
    token: int = 0
    position: int = 0

    @property
    def held(self) -> bool:
        """True once granted (a waiting request is not held)."""
        return self.token > 0

    def _with(
        self,
        *,
        ttl: float | None = None,
        expires_at: float | None = None,
        token: int | None = None,
        position: int | None = None,
    ) -> Lease:
        """This lease with the fields given changed: ``dataclasses.replace``, at half its
        cost (it is on every grant and renewal, in the writer's trial run and every replica)."""
        return Lease(
            self.id,
            self.owner,
            self.names,
            self.mode,
            self.ttl if ttl is None else ttl,
            self.expires_at if expires_at is None else expires_at,
            self.token if token is None else token,
            self.position if position is None else position,
        )


@dataclass(frozen=True, slots=True)
class LeaseEvent:
    """One change of the table, as applied at ``position`` (same on every replica)."""

    kind: EventKind
    lease: Lease
    position: int


# A heap entry: (expires_at, seq, lease id). It stands for the lease while the lease has that
# expiry and that seq (its place in request order); otherwise it is stale and skipped.
_Entry = tuple[float, int, str]


@dataclass(slots=True)
class LeaseTable:
    """The replicated state: leases held and waiting, in request order, and the log clock."""

    clock: float = 0.0
    last_token: int = 0
    position: int = 0
    # Insertion order is request order: the FIFO of waiting requests.
    leases: MutableMapping[str, Lease] = field(default_factory=dict)
    # name -> ids of the leases holding it
    holders: MutableMapping[str, list[str]] = field(default_factory=dict)
    # The changes made by the record being applied (cleared by begin()).
    events: list[LeaseEvent] = field(default_factory=list)
    # Indexes derived from ``leases`` (built again when a table is made from the fields above):
    # ids of the waiting requests in request order, each lease's place in request order, and
    # a heap of expiry times; ``_below``: the heaps of the tables a trial view sits on.
    _waiting: MutableMapping[str, None] = field(init=False, repr=False, compare=False)
    _seq: MutableMapping[str, int] = field(init=False, repr=False, compare=False)
    _next_seq: int = field(init=False, repr=False, compare=False)
    _expiry: list[_Entry] = field(init=False, repr=False, compare=False)
    _below: tuple[list[_Entry], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._waiting = {i: None for i, lease in self.leases.items() if not lease.held}
        self._seq = {lease_id: seq for seq, lease_id in enumerate(self.leases)}
        self._next_seq = len(self._seq)
        self._expiry = [(x.expires_at, self._seq[i], i) for i, x in self.leases.items()]
        heapq.heapify(self._expiry)
        self._below = ()

    # ------------------------------------------------------------------ replication hooks

    @staticmethod
    def begin(state: LeaseTable, position: int) -> None:
        state.position = position
        state.events = []

    @staticmethod
    def apply(state: LeaseTable, op: Any) -> None:
        """Apply one op (a JSON object); raises ValueError on a malformed one."""
        kind, now = _parse(op, state.clock)
        state.clock = max(state.clock, now)
        state._expire()
        if kind == "acquire":
            state._request(op)
        elif kind == "renew":
            state._renew(op["id"], _ttl_of(op))
        elif kind == "release":
            lease = state.leases.get(op["id"])
            if lease is not None:
                state._drop(lease, "released")
        state._grant()
        if not state._below:
            state._tidy()

    # ------------------------------------------------------------------ queries

    def holding(self, name: str) -> list[Lease]:
        """The leases holding ``name`` now, oldest grant first."""
        return [self.leases[i] for i in self.holders.get(name, ())]

    def waiting(self) -> list[Lease]:
        """The waiting requests, in the order they will be considered."""
        return [self.leases[i] for i in self._waiting]

    def next_expiry(self) -> float | None:
        """The earliest ``expires_at`` of any lease (held or waiting), or None."""
        best: float | None = None
        for heap in (self._expiry, *self._below):
            # Smallest entry first, skipping stale ones (at most the top one in a live table).
            candidates: list[tuple[_Entry, int]] = [(heap[0], 0)] if heap else []
            while candidates:
                entry, index = heapq.heappop(candidates)
                if best is not None and entry[0] >= best:
                    break
                if self._current(entry):
                    best = entry[0]
                    break
                for child in (2 * index + 1, 2 * index + 2):
                    if child < len(heap):
                        heapq.heappush(candidates, (heap[child], child))
        return best

    def copy(self) -> LeaseTable:
        """An independent copy (a snapshot's). Leases and events are immutable, so only the
        containers are copied (a deep copy cost ~0.2 ms a write)."""
        return LeaseTable(
            self.clock,
            self.last_token,
            self.position,
            dict(self.leases),
            {name: list(ids) for name, ids in self.holders.items()},
            list(self.events),
        )

    def trial(self) -> LeaseTable:
        """A copy-on-write view of this table, in O(1): the writer's trial state. It records
        what changes in it apart; this table must not change while the view is in use."""
        view = object.__new__(LeaseTable)
        view.clock, view.last_token, view.position = self.clock, self.last_token, self.position
        view.leases = DictOverlay(self.leases)
        view.holders = DictOverlay(self.holders, copy_value=list)  # lists change in place
        view.events = list(self.events)
        view._waiting = DictOverlay(self._waiting)
        view._seq = DictOverlay(self._seq)
        view._next_seq = self._next_seq
        view._expiry = []
        view._below = (*self._below, self._expiry)
        return view

    @staticmethod
    def adopt(table: LeaseTable, view: LeaseTable) -> LeaseTable:
        """``table`` changed as ``view`` (its :meth:`trial` view, ops applied) shows it, in
        O(what the view changed): the same table as applying those ops to ``table`` gives
        (its ``adopt_trial``: the writer's own records are applied without decoding them
        again). The view is spent."""
        overlays = (view.leases, view.holders, view._waiting, view._seq)
        bases = (table.leases, table.holders, table._waiting, table._seq)
        below = view._below
        if (
            len(below) != len(table._below) + 1
            or below[-1] is not table._expiry
            or not all(
                isinstance(o, DictOverlay) and o.base is b
                for o, b in zip(overlays, bases, strict=True)
            )
        ):
            raise ValueError("not a trial view of this table")
        for overlay in overlays:
            cast(DictOverlay[Any, Any], overlay).commit()
        table.clock, table.last_token, table.position = view.clock, view.last_token, view.position
        table.events = view.events
        table._next_seq = view._next_seq
        for entry in view._expiry:  # entries for leases the view requested, renewed, granted
            heapq.heappush(table._expiry, entry)
        if not table._below:
            table._tidy()
        return table

    def simulate(self, op: dict[str, Any]) -> LeaseTable:
        """A view of this table with ``op`` applied (how a generator predicts an outcome).
        Read it at once: it sits on this table, so this table's later changes show through."""
        trial = self.trial()
        trial.events = []
        LeaseTable.apply(trial, op)
        return trial

    # ------------------------------------------------------------------ transitions

    def _request(self, op: dict[str, Any]) -> None:
        lease_id = op["id"]  # every field checked by _parse
        if lease_id in self.leases:
            return
        ttl = _ttl_of(op)
        lease = Lease(lease_id, op["owner"], tuple(op["names"]), op["mode"], ttl, self.clock + ttl)
        self._seq[lease_id] = self._next_seq
        self._next_seq += 1
        self.leases[lease_id] = lease
        self._waiting[lease_id] = None
        self._index(lease)
        self.events.append(LeaseEvent("requested", lease, self.position))

    def _renew(self, lease_id: str, ttl: float) -> None:
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        renewed = lease._with(ttl=ttl, expires_at=self.clock + ttl)
        self.leases[lease_id] = renewed  # keeps its place in the FIFO
        self._index(renewed)
        self.events.append(LeaseEvent("renewed", renewed, self.position))

    def _drop(self, lease: Lease, kind: EventKind) -> None:
        del self.leases[lease.id]
        del self._seq[lease.id]  # its heap entries are stale from now on
        if lease.held:
            for name in lease.names:
                ids = self.holders[name]
                ids.remove(lease.id)
                if not ids:
                    del self.holders[name]
        else:
            del self._waiting[lease.id]
        self.events.append(LeaseEvent(kind, lease, self.position))

    def _expire(self) -> None:
        # In request order, as a scan of ``leases`` would find them.
        due = sorted({entry for entry in self._due() if self._current(entry)}, key=_seq_of)
        for _, _, lease_id in due:
            self._drop(self.leases[lease_id], "expired")

    def _grant(self) -> None:
        wanted_write: set[str] = set()  # names earlier waiting requests want to write
        wanted_read: set[str] = set()
        for lease_id in list(self._waiting):
            lease = self.leases[lease_id]
            if self._grantable(lease, wanted_write, wanted_read):
                self.last_token += 1
                # (Bounded: the clock has moved on since the request's TTL was checked.)
                expires_at = min(self.clock + lease.ttl, _LATEST)
                granted = lease._with(
                    token=self.last_token, position=self.position, expires_at=expires_at
                )
                self.leases[lease.id] = granted
                del self._waiting[lease.id]
                self._index(granted)
                for name in lease.names:
                    self.holders.setdefault(name, []).append(lease.id)
                self.events.append(LeaseEvent("granted", granted, self.position))
            else:
                (wanted_write if lease.mode == "write" else wanted_read).update(lease.names)

    def _grantable(self, lease: Lease, wanted_write: set[str], wanted_read: set[str]) -> bool:
        for name in lease.names:
            if name in wanted_write or (lease.mode == "write" and name in wanted_read):
                return False
            for holder_id in self.holders.get(name, ()):
                if lease.mode == "write" or self.leases[holder_id].mode == "write":
                    return False
        return True

    # ------------------------------------------------------------------ the expiry heap

    def _index(self, lease: Lease) -> None:
        heapq.heappush(self._expiry, (lease.expires_at, self._seq[lease.id], lease.id))

    def _current(self, entry: _Entry) -> bool:
        expires_at, seq, lease_id = entry
        lease = self.leases.get(lease_id)
        return lease is not None and lease.expires_at == expires_at and self._seq[lease_id] == seq

    def _due(self) -> Iterator[_Entry]:
        """The heap entries due at the log clock (stale ones too)."""
        clock, heap = self.clock, self._expiry
        if not self._below:
            while heap and heap[0][0] <= clock:
                yield heapq.heappop(heap)
            return
        # A trial view: its own heap and those below it are read, never changed. The live
        # table's holds nothing at or before its clock, so this reads the few entries between
        # that clock and this one (and a view's own entries, already dropped in it, again).
        for layer in (heap, *self._below):
            stack = [0] if layer else []
            while stack:
                index = stack.pop()
                if index < len(layer) and layer[index][0] <= clock:
                    yield layer[index]
                    stack.extend((2 * index + 1, 2 * index + 2))

    def _tidy(self) -> None:
        """Drop stale entries from the top of the heap (next_expiry reads the top), and
        rebuild it when stale entries outnumber the leases (released ones stay otherwise)."""
        heap = self._expiry
        while heap and not self._current(heap[0]):
            heapq.heappop(heap)
        if len(heap) > 2 * len(self.leases) + 64:
            self._expiry = [(x.expires_at, self._seq[i], i) for i, x in self.leases.items()]
            heapq.heapify(self._expiry)


def _seq_of(entry: _Entry) -> int:
    return entry[1]


def _parse(op: Any, clock: float) -> tuple[str, float]:
    """The op's kind and time, once every field its kind uses is checked (on a table at
    ``clock``): a malformed op, which only a foreign or broken writer appends, raises
    ValueError before it changes anything, on every replica alike."""
    if not isinstance(op, dict) or op.get("op") not in _OPS:
        raise ValueError(f"not a lease-table op: {op!r}")
    now = op.get("now")
    if not _is_number(now):
        raise ValueError(f"lease-table op without a valid 'now': {op!r}")
    kind = cast(str, op["op"])
    if kind != "tick" and not _is_name(op.get("id")):
        raise ValueError(f"lease-table op without a valid 'id': {op!r}")
    if kind == "acquire":
        names = op.get("names")
        if not _is_name(op.get("owner")):
            raise ValueError(f"lease-table op without a valid 'owner': {op!r}")
        # Distinct: a name twice in one lease would be held twice and released once.
        if not isinstance(names, list) or not names or not all(map(_is_name, names)):
            raise ValueError(f"lease-table op without valid 'names': {op!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"lease-table op with a name twice in 'names': {op!r}")
        if op.get("mode") not in ("read", "write"):
            raise ValueError(f"lease-table op without a valid 'mode': {op!r}")
    if kind in ("acquire", "renew") and not _is_number(max(clock, now) + _ttl_of(op)):
        raise ValueError(f"lease-table op whose lease would never expire: {op!r}")
    return kind, float(now)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _is_number(value: Any) -> TypeGuard[float]:
    """A finite int or float (not a bool; not an int too large for a float, which
    ``math.isfinite`` would raise OverflowError on)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ttl_of(op: dict[str, Any]) -> float:
    # What a record may carry: any finite TTL > 0. Never narrowed (a replica of a later
    # version must decide a log written before as the replicas that wrote it did); the API
    # refuses more (check_ttl).
    ttl = op.get("ttl")
    if not _is_number(ttl) or ttl <= 0:
        raise ValueError(f"lease-table op without a valid 'ttl': {op!r}")
    return float(ttl)


# A TTL the API accepts, in seconds. Below 1 ms a lease is as good as expired when granted
# (Unix-time clocks resolve about 0.2 us, and renewals come every ttl / 3); above ten years
# it outlives any holder, and its expiry could overflow once the log clock has moved on.
MIN_TTL_S = 0.001
MAX_TTL_S = 10 * 365 * 86400.0
# The latest expiry a grant gives (a request's TTL is checked against the clock when it is
# made; the clock may have moved on by its grant).
_LATEST = sys.float_info.max


def check_ttl(ttl: float) -> float:
    """``ttl`` if it is a number of seconds from :data:`MIN_TTL_S` (1 ms) to
    :data:`MAX_TTL_S` (ten years), else ConfigurationError."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise ConfigurationError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if not math.isfinite(ttl) or ttl <= 0:
        raise ConfigurationError(f"ttl must be a finite number of seconds > 0, not {ttl!r}")
    if not MIN_TTL_S <= ttl <= MAX_TTL_S:
        raise ConfigurationError(
            f"ttl must be from {MIN_TTL_S} s to {MAX_TTL_S:.0f} s (ten years), not {ttl!r}"
        )
    return float(ttl)


def check_names(names: str | Any, resources: frozenset[str] | None) -> tuple[str, ...]:
    """The names to acquire, sorted and without duplicates; ConfigurationError if bad."""
    if isinstance(names, str):
        names = [names]
    try:
        items = list(names)
    except TypeError:
        raise ConfigurationError(
            f"names must be a str or an iterable of str, not {type(names).__name__}"
        ) from None
    for name in items:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"resource names are non-empty str, not {name!r}")
    if not items:
        raise ConfigurationError("acquire needs at least one resource name")
    if resources is not None:
        unknown = sorted(set(items) - resources)
        if unknown:
            raise UnknownResourceError(
                f"unknown resource name(s) {unknown}: this Ownership manages {sorted(resources)}"
            )
    return tuple(sorted(set(items)))


class LeaseTableCodec:
    """A :class:`LeaseTable` to bytes and back, exactly, for snapshots (``Ownership(...,
    snapshots=True)``): JSON of the clock, the token counter, the position, every lease in
    request order (held and waiting), each name's holders in grant order and the changes
    the last record made (its events). Deterministic: the same table gives the same bytes
    on every replica."""

    _FORMAT = 1

    def encode(self, value: LeaseTable, /) -> bytes:
        leases = [_lease_fields(x) for x in value.leases.values()]
        events = [[e.kind, _lease_fields(e.lease), e.position] for e in value.events]
        document = {
            "format": self._FORMAT,
            "clock": value.clock,
            "last_token": value.last_token,
            "position": value.position,
            "leases": leases,
            "holders": {name: list(ids) for name, ids in value.holders.items()},
            "events": events,
        }
        return json.dumps(document, separators=(",", ":")).encode()

    def decode(self, data: bytes, /) -> LeaseTable:
        try:
            document = json.loads(data)
            if document["format"] != self._FORMAT:
                raise ValueError(f"format {document['format']!r}, this version reads 1")
            listed = [_lease_of(fields) for fields in document["leases"]]
            leases = {x.id: x for x in listed}
            if len(leases) != len(listed):
                raise ValueError("a lease id twice")
            events = []
            for kind, fields, position in document["events"]:
                if kind not in ("requested", "granted", "renewed", "released", "expired"):
                    raise ValueError(f"event {kind!r}")
                events.append(LeaseEvent(kind, _lease_of(fields), int(position)))
            if not isinstance(document["holders"], dict):
                raise ValueError("holders is not an object")
            holders = {name: list(ids) for name, ids in document["holders"].items()}
            # Exactly the held leases on each of their names: a held lease missing there
            # would let a later grant give its names to another writer.
            held = sorted((name, x.id) for x in leases.values() if x.held for name in x.names)
            if sorted((name, i) for name, ids in holders.items() for i in ids) != held:
                raise ValueError("the holders are not the held leases' names")
            clock, last_token = document["clock"], document["last_token"]
            if not _is_number(clock) or not _is_count(last_token):
                raise ValueError(f"clock {clock!r}, last_token {last_token!r}")
            # A token above the counter: the next grant would repeat or undercut it.
            if any(x.token > last_token for x in leases.values()):
                raise ValueError(f"a lease's token is above last_token {last_token}")
            table = LeaseTable(
                float(clock),
                last_token,
                int(document["position"]),
                leases,
                holders,
                events,
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise CodecError(f"not a lease-table snapshot: {exc}") from exc
        return table


def _lease_fields(lease: Lease) -> list[Any]:
    return [
        lease.id,
        lease.owner,
        list(lease.names),
        lease.mode,
        lease.ttl,
        lease.expires_at,
        lease.token,
        lease.position,
    ]


def _lease_of(fields: list[Any]) -> Lease:
    lease_id, owner, names, mode, ttl, expires_at, token, position = fields
    if mode not in ("read", "write"):
        raise ValueError(f"mode {mode!r}")
    if not isinstance(names, list) or not names or not all(map(_is_name, names)):
        raise ValueError(f"names {names!r}")
    if not _is_name(lease_id) or not _is_name(owner):
        raise ValueError(f"lease {lease_id!r} of {owner!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"lease {lease_id!r} names a resource twice: {names!r}")
    if not (_is_number(ttl) and ttl > 0 and _is_number(expires_at)):
        raise ValueError(f"lease {lease_id!r}: ttl {ttl!r}, expires_at {expires_at!r}")
    if not (_is_count(token) and _is_count(position)) or (token == 0 and position != 0):
        raise ValueError(f"lease {lease_id!r}: token {token!r}, position {position!r}")
    return Lease(lease_id, owner, tuple(names), mode, ttl, expires_at, token, position)
