"""SharedStateManager: one state object replicated through a Pulsar topic.

How it works, in brief (the README has the long form):

* **Log.** Every change is a *record* on one non-partitioned topic. A replica reads the topic
  from the start with one reader task (the *pump*) and applies records strictly in log order.
  State changes only there, never on the write path, so every op is applied exactly once.
* **Write.** A writer takes the topic's exclusive producer, reads to the tail, runs the
  generators of all waiting writes on a trial copy of the state (group commit), and appends
  the records. The caller's future completes when the pump has applied the record, so the
  local state already shows the write.
* **Safety.** Each record names the count of accepted records and the last accepted record id
  it was computed against. A replica accepts a record only if both match its own; otherwise
  it ignores it, deterministically, everywhere. A fenced, stale or duplicated record can never
  change the state; the writer whose record was ignored re-runs its generator and retries.
* **Reads.** ``latest=False`` reads the local state. ``latest=True`` captures the tail position
  at call time (the broker's last message id, over the binary protocol) and waits until the
  pump has passed it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, overload

from . import _telemetry
from ._admin import AdminClient, HeaderSource, TopicName, resolve_admin_url
from ._assembly import Assembly, OpenOptions, close_budget
from ._codecs import Codec, JsonCodec
from ._context import Context, Settings, Tunables
from ._credentials import admin_client, check_admin_headers, secured_client_options
from ._durable import DurableState
from ._envelope import SnapshotManifest
from ._errors import (
    ClosedError,
    ConfigurationError,
    OperationTimeoutError,
    PulsarStateError,
    ReplicaHaltedError,
)
from ._machine import DEFAULT_COPY, StateMachine
from ._pending import PendingWrites
from ._replica import Replica, subscribe
from ._tail import Tail
from ._types import AppliedRecord, ManagerStats, OnCorrupt, ReplayProgress, WriteResult

__all__ = ["SharedStateManager", "close_budget"]

logger = logging.getLogger(__name__)

S = TypeVar("S")
Op = TypeVar("Op")
T = TypeVar("T")


class SharedStateManager(Tunables, Generic[S, Op]):
    """A state object of type ``S`` kept consistent across processes by a Pulsar topic.

    Use it as an async context manager::

        async with SharedStateManager(
            "pulsar://127.0.0.1:6650", "my-state",
            initial_state=dict, apply=apply_op, codec=JsonCodec(),
        ) as manager:
            await manager.write(lambda s: [{"set": "k", "to": 1}])
            value = await manager.read(lambda s: s.get("k"), latest=True)

    Args:
        pulsar: a service URL (``pulsar://host:6650``; the manager owns its client) or an
            existing ``pulsar.asyncio.Client`` (borrowed, not closed).
        topic: a non-partitioned persistent topic, ``name`` or ``persistent://t/ns/name``.
        initial_state: factory for the empty state.
        apply: ``apply(state, op)`` mutates ``state`` in place (return None) or returns the new
            state. It must be deterministic: every replica runs it on the same ops.
        codec: encodes ops to bytes and back (default JSON).
        copy_state: an independent copy of the state. The writer runs a batch's generators
            and ops on a *trial state* and throws it away (every replica, the writer's own
            included, applies the records it reads back to its live state), so the trial
            state must never change the live one. ``copy_state`` makes it when
            ``trial_state`` is not given, and copies the state for a snapshot (encoded in a
            thread). Default: a trial run on a plain ``dict`` state uses a
            :class:`DictOverlay` over it (it records the keys a batch changes and copies a
            value only when the batch reads it: O(what the batch touches), not O(state));
            any other state, and snapshots, get ``copy.deepcopy``. Pass ``copy.deepcopy``
            to deep-copy for every batch as before, or ``None`` when ``apply`` never mutates
            its input (then neither copy is made).
        trial_state: ``trial_state(state)`` returns a cheap copy-on-write view of ``state``
            for the writer's trial run: reads see ``state``, changes (through ``apply`` and
            ``begin_record``) stay in the view, and ``state`` is never changed (it does not
            change while the view is in use; the view is discarded right after). Applying
            ops to the view must give what applying them to ``state`` gives. For example
            ``DictOverlay`` (for a dict whose values ``apply`` replaces, never changes in
            place), or a state class's own overlay. When given, ``copy_state`` is used for
            snapshots only (and may not be None with a ``snapshot_codec``).
        adopt_trial: ``adopt_trial(state, trial)`` returns the live state after this
            process's own record of one write, from ``trial``: the trial state (a view from
            ``trial_state``, or a ``copy_state`` copy) that write was built and checked on,
            which sits on ``state``. The holder of the writer then makes its live state from
            it instead of applying its record again (every other replica still does; a lock
            round spends about 8% less CPU). The record is still decoded, while its
            acknowledgement is awaited, and adopted only if its ops decode to exactly those
            the trial ran (same values and types); otherwise it is applied as usual. So
            ``apply`` must keep no reference to an op (the trial ran the generator's own
            objects), and generators must never change the state they are given. Not with
            ``durable_state``. ``LeaseTable.adopt`` is one (Ownership's).
        begin_record: ``begin_record(state, position)`` runs before the ops of each accepted
            record, with the position that record gets (1 for the first): for states that
            stamp versions. Runs on the writer's trial state too, with the same position.
        admin_url: the broker's admin REST URL, for the topic checks at open, snapshots and
            replay progress totals (default derived from the service URL). Not needed with
            ``check_topic=False`` and no ``snapshot_codec``: reads and writes use only the
            binary protocol; otherwise required with a borrowed client.
        on_corrupt: ``"halt"`` (default) stops applying at a foreign or damaged message and
            raises :class:`ReplicaHaltedError` from then on; ``"skip"`` logs, counts and skips.
        check_topic: refuse partitioned topics and topics whose policies lose history.
        idle_release_s: release the exclusive writer after this long without writes.
        relay_idle_release_s: instead, while this process's write relay is up, release it
            after this long (None: ``idle_release_s``). Others' writes reach the holder
            through the relay meanwhile, so holding longer costs them nothing, and this
            process's next write within it skips taking the writer again (a new producer
            epoch the broker persists: 4-5 ms here). A process frozen or cut off while it
            holds the writer stalls others' writes until it resumes or ``takeover_after_s``.
        max_hold_s: release the writer after holding it this long while others may wait
            (with the relay: when another process asks; unasked, for processes without it,
            after 10 x max_hold_s at a moment no write is queued, and after 20 x, at most
            two thirds of ``acquire_timeout_s``, however busy).
        acquire_timeout_s: how long a write waits for the exclusive writer.
        takeover_after_s: after waiting this long, take the writer over with fencing
            (``ExclusiveWithFencing``). None (default) never fences another process.
        relay_writes: while another process probably holds the writer, send this process's
            records to it through ``non-persistent://<tenant>/<namespace>/<topic>-relay``
            (one hop, no producer switch), and append the records others relay while this
            process holds it. Records are checked by every replica as any record, so the
            relay changes no guarantee; one not seen within 50 ms is retried as after a
            failed send. False: every write takes the exclusive writer itself.
        write_timeout_s / read_timeout_s / open_timeout_s: default timeouts of those calls.
        max_record_bytes: refuse a write larger than this before sending (default 1 MiB,
            below the broker's 5 MB message limit).
        max_writes_per_record: group-commit at most this many writes into one message.
        max_writes_per_batch: at most this many writes per pipelined batch.
        on_progress: called with :class:`ReplayProgress` while opening: every 2 s of a
            snapshot's load (``loading_snapshot``: ``snapshot_bytes_loaded``; no record
            counts yet), then every 2 s of the replay after it, and once done.
        snapshot_codec: encodes the whole state to bytes and back; enables snapshots
            (``snapshot()``, automatic policies, and opening from the newest good snapshot).
            It must be deterministic (same state, same bytes): digests are compared. A
            :class:`StreamingCodec` (with ``encode_parts``) is written part by part.
        snapshot_every_records / snapshot_every_bytes: the writer takes a snapshot after this
            many records (or bytes of records) since the last one. None: only manual.
        snapshot_chunk_bytes: snapshot chunk size, an int >= 1 (one message each, so at
            most the broker's ``maxMessageSize`` less 28 bytes; no overall size cap).
        load_snapshot: open from the newest good snapshot (default) or replay everything.
        trim_history: after each snapshot this manager writes, let the broker delete the
            history behind the ``keep_snapshots`` newest snapshots (needs ``snapshot_codec``).
            The library's durable subscription on the topic is the trim point; the topic may
            then have a finite retention (see the README). A replica still reading behind
            the trim point falls forward to a snapshot.
        keep_snapshots: how many of the newest snapshots keep their history (at least 1).
        name: a label for logs and the writer id.
        authentication: credentials for every connection the manager makes. A token (str, or
            a function returning the current one, called again when needed) authenticates
            both the binary client (``pulsar.AuthenticationToken``) and the admin REST calls
            (``Authorization: Bearer``). A ``pulsar.Authentication`` object (OAuth2, TLS...)
            goes to the binary client only: give the REST calls ``admin_headers=``.
        admin_headers: extra headers of every admin REST request (a mapping, or a function
            returning one per request), e.g. ``{"Authorization": "Bearer ..."}``.
        tls_trust_certs_file_path: the CA certificates (PEM) that the binary client and https
            admin URLs trust (default: the system's).
        tls_validate_hostname: check that the broker's certificate names its host (both
            paths; default False, as pulsar-client).
        client_options: extra ``pulsar.Client`` options (listener_name, io_threads, ...).
        durable_state: for a state that keeps itself on durable storage with the position
            of the last record it holds (:class:`DurableState`): each accepted record is
            committed to it with its :class:`LogMark`, and opening resumes from the stored
            mark (checked against the topic, as a snapshot's is) and replays only the tail.
            Needs the admin REST API (for that check).
    """

    def __init__(
        self,
        pulsar: Any,
        topic: str,
        *,
        initial_state: Callable[[], S],
        apply: Callable[[S, Op], S | None],
        codec: Codec[Op] | None = None,
        copy_state: Callable[[S], S] | None = DEFAULT_COPY,
        begin_record: Callable[[S, int], S | None] | None = None,
        trial_state: Callable[[S], S] | None = None,
        adopt_trial: Callable[[S, S], S] | None = None,
        durable_state: DurableState[S] | None = None,
        admin_url: str | None = None,
        on_corrupt: OnCorrupt = "halt",
        check_topic: bool = True,
        idle_release_s: float = 0.1,
        relay_idle_release_s: float | None = None,
        max_hold_s: float = 1.0,
        acquire_timeout_s: float = 30.0,
        takeover_after_s: float | None = None,
        relay_writes: bool = True,
        write_timeout_s: float = 30.0,
        read_timeout_s: float = 30.0,
        open_timeout_s: float = 120.0,
        max_record_bytes: int = 1024 * 1024,
        max_writes_per_record: int = 256,
        max_writes_per_batch: int = 1024,
        on_progress: Callable[[ReplayProgress], None] | None = None,
        snapshot_codec: Codec[S] | None = None,
        snapshot_every_records: int | None = None,
        snapshot_every_bytes: int | None = None,
        snapshot_chunk_bytes: int = 1024 * 1024,
        load_snapshot: bool = True,
        trim_history: bool = False,
        keep_snapshots: int = 2,
        name: str | None = None,
        authentication: Any = None,
        admin_headers: HeaderSource | None = None,
        tls_trust_certs_file_path: str | None = None,
        tls_validate_hostname: bool | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        if on_corrupt not in ("halt", "skip"):
            raise ConfigurationError(f"on_corrupt must be 'halt' or 'skip', not {on_corrupt!r}")
        if adopt_trial is not None and not callable(adopt_trial):
            raise ConfigurationError(
                f"adopt_trial must be a function (state, trial) -> state, not {adopt_trial!r}"
            )
        if adopt_trial is not None and durable_state is not None:
            # A durable state may note changes as apply makes them; adopting skips apply.
            raise ConfigurationError("adopt_trial cannot be combined with durable_state")
        if trial_state is not None and copy_state is None and snapshot_codec is not None:
            # copy_state=None promises an apply that never mutates its input, which only the
            # trial run checks, and not on a trial_state view: a snapshot would encode the
            # live state while records change it, its bytes ahead of its position.
            raise ConfigurationError(
                "snapshots with trial_state need copy_state (a full copy of the state, encoded "
                "in a thread while the live state changes), not None"
            )
        self.topic = TopicName.parse(topic)
        client_options = secured_client_options(
            client_options, authentication, tls_trust_certs_file_path, tls_validate_hostname
        )
        options = OpenOptions(
            pulsar=pulsar,
            client_options=client_options,
            check_topic=check_topic,
            trim_history=trim_history,
            keep_snapshots=keep_snapshots,
            snapshot_codec=snapshot_codec,
            snapshot_chunk_bytes=snapshot_chunk_bytes,
            load_snapshot=load_snapshot,
            on_progress=on_progress,
            durable_state=durable_state,
            relay_writes=relay_writes,
        )
        check_admin_headers(admin_headers)
        # The admin REST client only where it is needed: the tail comes over the binary protocol.
        self._admin: AdminClient | None = None
        if admin_url is not None or check_topic or snapshot_codec is not None or durable_state:
            self._admin = admin_client(
                resolve_admin_url(pulsar, admin_url), authentication, admin_headers, client_options
            )
        self._tail = Tail(self.topic, self._admin)
        self._settings = Settings(
            idle_release_s=idle_release_s,
            relay_idle_release_s=relay_idle_release_s,
            max_hold_s=max_hold_s,
            acquire_timeout_s=acquire_timeout_s,
            takeover_after_s=takeover_after_s,
            write_timeout_s=write_timeout_s,
            read_timeout_s=read_timeout_s,
            open_timeout_s=open_timeout_s,
            max_record_bytes=max_record_bytes,
            max_writes_per_record=max_writes_per_record,
            max_writes_per_batch=max_writes_per_batch,
            snapshot_every_records=snapshot_every_records,
            snapshot_every_bytes=snapshot_every_bytes,
        )
        self._client_options = client_options
        self._snapshot_codec = snapshot_codec
        self.writer_id = f"{name + '-' if name else ''}{uuid.uuid4().hex[:12]}"
        self.stats = ManagerStats()
        self._context = Context(self.topic, self.writer_id, self._settings, self.stats)
        self._machine: StateMachine[S, Op] = StateMachine(
            apply,
            codec if codec is not None else JsonCodec(),
            copy_state=copy_state,
            begin_record=begin_record,
            trial_state=trial_state,
            adopt_trial=adopt_trial,
        )
        self._pending = PendingWrites(self._context)
        self._replica: Replica[S, Op] = Replica(
            initial_state(),
            self._machine,
            self._context,
            on_corrupt=on_corrupt,
            owner=self._pending,
        )
        self._replica.on_halt.append(self._pending.fail_queued)
        # In flight too: nothing will settle them now (they would wait for their deadline).
        self._replica.on_halt.append(self._pending.fail_in_flight)
        # A fall-forward skips records: ours among them end with an unknown outcome (first,
        # before any listener of the replaced state).
        # (Not through self: the running parts must not lead back to the manager.)
        pending, replica = self._pending, self._replica
        replica.on_state_replaced.append(lambda: pending.skipped_to(replica.version))
        # And those the writer held (a batch being built or checked): it stops at a halt. A
        # loop turn later: a record being applied as it halted ends its writes first, with
        # what is known of them (in the log, so other replicas apply them).
        self._replica.on_halt.append(self._pending.fail_unfinished_soon)
        parts = (self._context, self._machine, self._replica, self._pending, self._tail)
        self._parts: Assembly[S, Op] = Assembly(options, *parts, self._admin)
        self._opened = False

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> SharedStateManager[S, Op]:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # aiokafka's habit: an open manager that is dropped leaks its tasks and connections.
        if getattr(self, "_opened", False) and not self._context.closed:
            warnings.warn(
                f"unclosed SharedStateManager on {self.topic}: use `async with` or aclose()",
                ResourceWarning,
                source=self,
                stacklevel=1,
            )

    async def open(self, *, timeout: float | None = None) -> None:
        """Connect, check the topic, and replay it up to the tail captured now."""
        if self._opened:
            raise ConfigurationError("the manager is already open")
        self._opened = True
        timeout = self.open_timeout_s if timeout is None else timeout
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            async with asyncio.timeout_at(deadline):
                await self._open(deadline)
        except TimeoutError as exc:
            await self.aclose()
            # The retry's own time-out names the last failure (e.g. the broker unreachable).
            detail = f": {exc}" if isinstance(exc, PulsarStateError) else ""
            raise OperationTimeoutError(
                f"opening {self.topic} did not finish in {timeout}s "
                f"({self.stats.records_read} records replayed){detail}"
            ) from exc
        except BaseException:
            await self.aclose()
            raise

    async def _open(self, deadline: float) -> None:
        await self._parts.open(deadline)
        _telemetry.track(self)
        logger.info(
            "opened %s at position %d (%d records read)",
            self.topic,
            self._replica.version,
            self.stats.records_read,
        )

    async def aclose(self, *, timeout: float = 10.0) -> None:
        """Stop: fail queued writes, release the writer at once, stop the reader.

        Takes at most :func:`close_budget` ``(timeout)``: ``timeout`` for the writes and the
        automatic snapshot under way to finish (at most 5 s of it for the writes), plus at
        least a second for each teardown step.
        """
        if self._context.closed:
            return
        self._context.closed = True
        _telemetry.untrack(self)
        await self._parts.close(timeout)
        logger.debug("closed manager on %s", self.topic)

    def _check_usable(self) -> None:
        self._replica.check_running()  # halted or closed
        if self._parts.conn is None:  # set first thing in open()
            raise ClosedError(f"manager on {self.topic} is not open: use `async with` or open()")

    # ------------------------------------------------------------------ public API

    @property
    def position(self) -> int:
        """How many records this replica has accepted (its state's version)."""
        return self._replica.version

    @property
    def closed(self) -> bool:
        """True once ``aclose()`` has started."""
        return self._context.closed

    @property
    def halted(self) -> PulsarStateError | None:
        """Why this replica stopped applying, or None."""
        return self._replica.halt

    def read_local(self, reader: Callable[[S], T]) -> T:
        """``read(reader)`` without the coroutine: the local state, now, no I/O.

        Call it from the event loop's thread (the pump mutates the state there).
        """
        self._check_usable()
        return reader(self._replica.state)

    def add_listener(self, listener: Callable[[AppliedRecord[Op]], None]) -> Callable[[], None]:
        """Call ``listener`` after each accepted record, in log order; returns an unsubscribe.

        Listeners run on the event loop inside the pump: keep them short and non-blocking.
        Registering and reading the state in the same synchronous step gives a consistent
        snapshot followed by every later change.
        """
        return self._replica.add_listener(listener)

    def add_state_replaced_listener(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` (on the event loop) each time this replica replaces its state
        object: falling forward to a snapshot past history trimmed while it was behind
        (``trim_history``). A view holding the state object must read it again
        (``read_local``); the changes between the old and the new state are not known.
        Returns an unsubscribe."""
        return subscribe(self._replica.on_state_replaced, listener)

    def add_halt_listener(
        self, listener: Callable[[ReplicaHaltedError], None]
    ) -> Callable[[], None]:
        """Call ``listener`` once when this replica halts (on the event loop, with the error
        every later call raises); returns an unsubscribe. For views that serve reads without
        a call into the manager and must stop doing so at a halt."""
        return subscribe(self._replica.on_halt, listener)

    async def read(
        self, reader: Callable[[S], T], *, latest: bool = False, timeout: float | None = None
    ) -> T:
        """Run ``reader`` on the state and return its result.

        ``latest=False`` reads the local state at once (no I/O). ``latest=True`` is
        linearizable: it captures the tail of the log now and returns after applying up to it.
        ``reader`` must not mutate the state or keep references that outlive the call.
        """
        self._check_usable()
        if latest:
            await self.sync(timeout=timeout)
        return reader(self._replica.state)

    async def sync(self, *, timeout: float | None = None) -> int:
        """Catch up with the tail of the log as of now; returns the position reached."""
        self._check_usable()
        timeout = self.read_timeout_s if timeout is None else timeout
        return await self._replica.catch_up(self._tail.position, timeout)

    async def wait_for(self, position: int, *, timeout: float | None = None) -> None:
        """Wait until this replica has accepted ``position`` records (read-your-writes)."""
        self._check_usable()
        timeout = self.read_timeout_s if timeout is None else timeout
        await self._replica.wait_version(position, timeout)

    @overload
    async def write(
        self, generator: Callable[[S], Sequence[Op]], *, timeout: float | None = None
    ) -> WriteResult[None]: ...

    @overload
    async def write(
        self,
        generator: Callable[[S], Sequence[Op]],
        *,
        reader: Callable[[S], T],
        timeout: float | None = None,
    ) -> WriteResult[T]: ...

    async def write(
        self,
        generator: Callable[[S], Sequence[Op]],
        *,
        reader: Callable[[S], Any] | None = None,
        timeout: float | None = None,
    ) -> WriteResult[Any]:
        """Append the ops that ``generator`` computes from the up-to-date state, atomically.

        ``generator(state)`` returns the ops to append; it runs on a trial copy of the state
        at the tail of the log, while this process holds the exclusive writer, and may run
        more than once (if another writer got in first, or it raised on a state not yet
        confirmed the log's latest: the exception is raised to the caller only once it is).
        It runs on the event loop's thread
        but outside the caller's task (in the writer's, or a callback of the loop), so it
        must not depend on the caller's context variables. Each op is validated by applying it
        to that trial copy before anything is sent. The ops of one write are applied together
        by every replica, or not at all.

        ``reader(state)`` runs on the state right after this write's ops were applied, and
        its result is returned in :class:`WriteResult` (from the attempt that committed). A
        reader that raises makes ``write`` raise its exception, but the write stands: its
        ops were applied, by every replica (read the state again to know what it holds).

        A generator that returns no ops appends nothing (a conditional write that decided
        not to change anything): the decision stands once this process has confirmed that
        the state it was made on is the log's latest, and ``position`` is that state's.

        Raises the generator's own exception if it raises (nothing is appended);
        :class:`ApplyError` if an op fails on the trial state; :class:`RecordTooLargeError`;
        :class:`OperationTimeoutError` when nothing was appended in time;
        :class:`WriteOutcomeUnknownError` when a record was sent but not seen in time.
        """
        self._check_usable()
        timeout = self.write_timeout_s if timeout is None else timeout
        # The deadline watchdog fails the future in time: one timer for all writes.
        return await self._pending.submit(generator, reader, timeout)

    async def write_ops(
        self, ops: Sequence[Op], *, timeout: float | None = None
    ) -> WriteResult[None]:
        """Append ``ops`` unconditionally (no generator), atomically."""
        fixed = list(ops)
        return await self.write(lambda _state: fixed, timeout=timeout)

    def release_writer(self) -> None:
        """Give the topic's exclusive writer up as soon as this process has no write queued
        (instead of ``idle_release_s`` after its last write); a later write takes it again.
        Nothing with ``relay_writes``: the other process's write is then relayed here.

        A hint for a process that now waits for another process to write next, e.g. a lock
        request queued behind its holder: the holder's release need not wait for the writer.
        """
        # Only a hint: a closed or halted manager has nothing to give up.
        if self._parts.writer is not None and not self.closed and self.halted is None:
            self._parts.writer.release_soon()

    def take_writer(self) -> None:
        """Take the topic's exclusive writer now, ahead of a write this process expects to
        make soon, so that write skips the writer's acquisition (creating an exclusive
        producer makes the broker persist a new producer epoch: 1.5-5 ms on the bundled
        broker) and the catch-up with the tail. The counterpart of :meth:`release_writer`.

        A hint, done in the background: it never fences another process, gives up after a
        second if another process keeps the writer, and the writer taken is released after
        ``idle_release_s`` if no write comes (as after a write). Ownership calls it when a
        request queues behind a lease this process holds: its release is what comes next.
        """
        if self._parts.writer is not None and not self.closed and self.halted is None:
            self._parts.writer.take_ahead()

    async def snapshot(self, *, timeout: float | None = None) -> SnapshotManifest:
        """Write a snapshot of the state as it is now; returns its manifest.

        Other processes may keep writing meanwhile. Raises :class:`WriterBusyError` if another
        process is writing a snapshot of this topic at the same moment.
        """
        self._check_usable()
        if (snapshots := self._parts.snapshots) is None:
            raise ConfigurationError("snapshots need snapshot_codec= (state <-> bytes)")
        return await snapshots.take(self.write_timeout_s if timeout is None else timeout)

    # ------------------------------------------------------------------ test-only peeks

    @property
    def _state(self) -> S:
        return self._replica.state

    @property
    def _listeners(self) -> list[Callable[[AppliedRecord[Op]], None]]:
        return self._replica.listeners

    @property
    def _deadlines(self) -> list[Any]:
        return self._pending.deadlines

    _snapshots = property(lambda self: self._parts.snapshots)  # SnapshotPolicy[S] | None
    _pump_task = property(lambda self: self._parts.pump_task)  # asyncio.Task[None] | None
