"""The parts a manager connects at ``open()`` and takes down at ``aclose()``, in order.

Open: the Pulsar connection, the access and policy checks, the replica's reader, the tail
probe, the snapshot store and policy (loading the newest good snapshot), the pump, the replay
to the tail, then the writer and the deadline watchdog. Every step that talks to the broker
is retried on transient failures up to the open's deadline; each is idempotent.

Close: fail queued writes, let writes already sent settle, stop the tasks, release the writer,
then close each connection. Every step is bounded, so a broker that does not answer cannot
hang a close; a close takes at most :func:`close_budget` ``(timeout)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from ._admin import AdminClient
from ._bootstrap import replay_to_tail
from ._codecs import Codec
from ._context import Context, check_count
from ._credentials import warn_if_rest_blind
from ._durable import DurableState, LogMark
from ._envelope import SnapshotManifest
from ._errors import ClosedError, ConfigurationError
from ._machine import StateMachine
from ._pending import PendingWrites
from ._pulsar import PulsarConnection
from ._records import RecordBuilder
from ._relay import Relay
from ._replica import Replica
from ._retry import retry_transient
from ._snapshots import SnapshotPolicy, SnapshotStore
from ._tail import Tail
from ._types import ReplayProgress
from ._writer import Writer

__all__ = ["Assembly", "OpenOptions", "close_budget"]

logger = logging.getLogger(__name__)

# What opening did with a durable state's stored mark: resumed from it; emptied it (refused,
# rebuilt from the log); found it behind the trimmed history (the newest snapshot replaces
# it); or there was none.
_Resume = Literal["resumed", "rebuilt", "behind", "nothing stored"]

S = TypeVar("S")
Op = TypeVar("Op")

# Each teardown step of a close (writer, relay, reader, tail consumer, snapshot store, admin
# client, Pulsar client) gets at least this long even when the close's budget is used up, so that
# nothing is left open for lack of time.
_TEARDOWN_FLOOR_S = 1.0
_TEARDOWN_STEPS = 7


def close_budget(timeout: float) -> float:
    """The longest ``aclose(timeout=timeout)`` can take (a blocking caller's bound)."""
    return timeout + _TEARDOWN_STEPS * _TEARDOWN_FLOOR_S


async def _bounded(step: Awaitable[None], timeout: float) -> None:
    """One step of a close, given up after ``timeout``: a silent broker cannot hang a close."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):  # unlike 3.11's wait_for, never eats a cancel
            await step


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


@dataclass(frozen=True, slots=True)
class OpenOptions(Generic[S]):
    """How to open: the manager's constructor arguments that only ``open()`` uses."""

    pulsar: Any  # a service URL (we own the client) or a pulsar.asyncio.Client (borrowed)
    client_options: dict[str, Any]
    check_topic: bool
    trim_history: bool
    keep_snapshots: int
    snapshot_codec: Codec[S] | None
    snapshot_chunk_bytes: int
    load_snapshot: bool
    on_progress: Callable[[ReplayProgress], None] | None
    durable_state: DurableState[S] | None = None
    relay_writes: bool = False

    def __post_init__(self) -> None:
        if self.trim_history and self.snapshot_codec is None:
            raise ConfigurationError(
                "trim_history needs snapshot_codec= (it trims behind snapshots)"
            )
        check_count("keep_snapshots", self.keep_snapshots, 1)
        # (0 sent empty chunks for ever; a streamed snapshot is cut as it is encoded)
        check_count("snapshot_chunk_bytes", self.snapshot_chunk_bytes, 1)


class Assembly(Generic[S, Op]):
    """Connects a manager's parts and takes them down; holds what only exists while open."""

    def __init__(
        self,
        options: OpenOptions[S],
        context: Context,
        machine: StateMachine[S, Op],
        replica: Replica[S, Op],
        pending: PendingWrites,
        tail: Tail,
        admin: AdminClient | None,
    ) -> None:
        self._options = options
        self._context = context
        self._machine = machine
        self._replica = replica
        self._pending = pending
        self._tail = tail
        self._admin = admin
        self.conn: PulsarConnection | None = None
        self._owns_conn = False
        self.store: SnapshotStore | None = None
        self.snapshots: SnapshotPolicy[S] | None = None
        self.writer: Writer | None = None
        self.relay: Relay | None = None
        self.pump_task: asyncio.Task[None] | None = None
        # writer, deadlines, reader watch, relay (the pump is apart)
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self, deadline: float) -> None:
        options, context, replica, admin = self._options, self._context, self._replica, self._admin
        topic = str(context.topic)
        if isinstance(options.pulsar, str):
            self.conn = PulsarConnection(
                options.pulsar,
                operation_timeout_s=context.settings.write_timeout_s,
                client_options=options.client_options,
            )
            self._owns_conn = True
        else:
            self.conn = PulsarConnection.wrap(options.pulsar)
        conn = self.conn
        if admin is not None:
            rest_blind = warn_if_rest_blind(admin, options.client_options, topic)
            if options.check_topic or not rest_blind:
                # Refused credentials fail here at once; the binary client only times out.
                await retry_transient(
                    lambda: admin.check_access(
                        context.topic, refuse_partitioned=options.check_topic
                    ),
                    deadline=deadline,
                    what=f"checking access to {topic}",
                )
        stored = None
        if options.durable_state is not None:
            replica.durable = options.durable_state
            stored = options.durable_state.stored_mark(replica.state)
            if stored is not None:
                # The reader starts right after the stored mark (checked below, once the
                # topic surely exists): it never prefetches the history before it.
                replica.load(
                    replica.state,
                    stored.position,
                    stored.record_id,
                    stored.log_position,
                    stored.origin,
                    stored.stale,
                )
        # Creating the reader also creates the topic, so its policies exist.
        await retry_transient(
            lambda: replica.attach(conn), deadline=deadline, what=f"opening a reader on {topic}"
        )
        await retry_transient(
            lambda: self._tail.attach(conn, name=context.writer_id),
            deadline=deadline,
            what=f"opening the tail probe on {topic}",
        )
        if options.check_topic:
            assert admin is not None  # required with check_topic (see the manager)
            await retry_transient(
                lambda: admin.check_policies(context.topic, trimmed=options.trim_history),
                deadline=deadline,
                what=f"checking the policies of {topic}",
            )
        resume: _Resume = "nothing stored"
        if options.durable_state is not None and stored is not None:
            resume = await self._resume(options.durable_state, stored, deadline)
        if options.snapshot_codec is not None:
            load = (options.load_snapshot and resume != "resumed") or resume == "behind"
            self.snapshots = await self._start_snapshots(
                options.snapshot_codec, deadline, load=load
            )
            self.snapshots.on_load_progress = None  # opened: a later load is logged only
            if options.trim_history:
                replica.fall_forward = self.snapshots.fall_forward
                replica.holds_message = self.snapshots.holds_message
        if resume == "behind" and (self.snapshots is None or self.snapshots.loaded is None):
            # No snapshot loaded after all: records on top of a trimmed mark are not to be
            # read (the first one left may be a losing write based on it).
            assert options.durable_state is not None
            assert stored is not None
            await self._refuse(
                options.durable_state,
                f"the stored state (position {stored.position}) is behind the trimmed "
                f"history of {topic} and no snapshot could be loaded",
                deadline,
            )
        self.pump_task = asyncio.create_task(replica.pump(), name=f"pulsar-state-pump-{topic}")
        await retry_transient(
            lambda: replay_to_tail(
                replica,
                self._tail,
                admin,
                context.topic,
                context.stats,
                snapshot=self.snapshots.loaded if self.snapshots else None,
                on_progress=options.on_progress,
            ),
            deadline=deadline,
            what=f"replaying {topic} to its tail",
        )
        replica.check_running()  # the replay may have stopped at a bad record: refuse to open
        if options.relay_writes:
            self.relay = Relay(context)
        self.writer = Writer(
            context,
            conn,
            self._tail,
            self._pending,
            replica,
            RecordBuilder(self._machine, context.writer_id, context.settings),
            after_batch=self.snapshots.after_batch if self.snapshots else lambda: None,
            relay=self.relay,
        )
        self._pending.on_submit = self.writer.queued
        replica.on_halt.append(self.writer.on_halt)
        self._tasks = [
            asyncio.create_task(self.writer.run(), name=f"pulsar-state-writer-{topic}"),
            asyncio.create_task(
                self._pending.watch_deadlines(), name=f"pulsar-state-deadlines-{topic}"
            ),
            asyncio.create_task(
                replica.watch_reading(self._tail.position_in_current_ledger),
                name=f"pulsar-state-watch-{topic}",
            ),
        ]
        if self.relay is not None:
            # Opened in the background: until it is, writes take the writer.
            self._tasks.append(
                asyncio.create_task(
                    self._open_relay(self.relay, conn, self.writer),
                    name=f"pulsar-state-relay-{topic}",
                )
            )

    @staticmethod
    async def _open_relay(relay: Relay, conn: PulsarConnection, writer: Writer) -> None:
        await relay.open(conn, writer.accept_foreign)
        writer.relay_changed()

    async def _resume(self, durable: DurableState[S], mark: LogMark, deadline: float) -> _Resume:
        """Start from what a durable state has stored (``mark``, loaded into the replica
        already), as from a snapshot: the mark is checked against the topic (see
        :data:`_Resume` for the outcomes; ``durable.refuse`` raises to refuse it)."""
        context, conn, admin = self._context, self.conn, self._admin
        assert conn is not None
        if admin is None:
            raise ConfigurationError("durable_state needs the admin REST API (admin_url=)")
        topic = str(context.topic)
        log = SnapshotStore(
            conn, admin, context.topic, chunk_bytes=1, timeout_s=context.settings.open_timeout_s
        )
        mismatch = await retry_transient(
            lambda: log.covered_mismatch(
                mark.log_position, mark.record_id, what="the stored state"
            ),
            deadline=deadline,
            what=f"checking the stored state against {topic}",
        )
        if mismatch is not None and await retry_transient(
            lambda: self._behind_trimmed_log(log, mark),
            deadline=deadline,
            what=f"checking the stored state against the snapshots of {topic}",
        ):
            # Not resumed from: the newest snapshot replaces it (the reader is not to read
            # records on top of a trimmed mark).
            logger.warning(
                "the stored state of %s (position %d) is behind the trimmed history; the "
                "newest snapshot replaces it",
                topic,
                mark.position,
            )
            return "behind"
        if mismatch is not None:
            await self._refuse(
                durable,
                f"the stored state (position {mark.position}, record {mark.record_id} at "
                f"{mark.log_position}) is not part of {topic}'s history: {mismatch}",
                deadline,
            )
            return "rebuilt"
        context.stats.resumed_position = mark.position
        logger.info("%s resumes from its stored state at position %d", topic, mark.position)
        return "resumed"

    async def _refuse(self, durable: DurableState[S], reason: str, deadline: float) -> None:
        """``durable.refuse`` raises, or empties the stored state: the replica then starts
        from the beginning."""
        replica, conn = self._replica, self.conn
        assert conn is not None
        emptied = durable.refuse(replica.state, reason)  # raises to refuse
        logger.warning("%s; rebuilt from the log", reason)
        replica.load(emptied, 0, "", None)
        await retry_transient(
            lambda: replica.open_reader(conn),
            deadline=deadline,
            what=f"reopening {self._context.topic}",
        )

    async def _behind_trimmed_log(self, log: SnapshotStore, mark: LogMark) -> bool:
        """Whether a stored ``mark`` whose message is gone is an earlier state of this very
        history, trimmed from the log since (``trim_history``), not one of a topic deleted
        and created again: its message is before the log's first one, and a snapshot of the
        history as it is now names the same origin (the history's first record)."""
        if not self._options.trim_history or mark.origin is None:
            return False
        # Patient: just after an unload the log answers "no message" for a moment.
        first = await log.log_message(None, patient=True)
        if first is None or first[0] <= mark.log_position:
            return False
        for manifest in reversed(await log.manifests()):
            if (
                manifest.log_origin == mark.origin
                and manifest.position >= mark.position
                and await log.incarnation_mismatch(manifest, patient=True) is None
            ):
                return True
        return False

    async def _start_snapshots(
        self, codec: Codec[S], deadline: float, *, load: bool
    ) -> SnapshotPolicy[S]:
        options, context, conn = self._options, self._context, self.conn
        assert self._admin is not None  # required with snapshots
        assert conn is not None
        store = SnapshotStore(
            conn,
            self._admin,
            context.topic,
            chunk_bytes=options.snapshot_chunk_bytes,
            timeout_s=context.settings.open_timeout_s,
        )
        self.store = store
        if options.trim_history:
            await retry_transient(
                lambda: store.hold(name=context.writer_id),
                deadline=deadline,
                what=f"holding the snapshot topics of {context.topic}",
            )
        start = SnapshotPolicy[S].start
        return await retry_transient(
            lambda: start(
                context,
                store,
                codec,
                self._replica,
                self._machine.full_copy,
                load=load,
                trim_log=self._tail.trim_through if options.trim_history else None,
                keep_snapshots=options.keep_snapshots,
                durable=options.durable_state,
                on_load_progress=self._snapshot_progress,
            ),
            deadline=deadline,
            what="loading a snapshot",
        )

    def _snapshot_progress(self, manifest: SnapshotManifest, loaded: int, elapsed: float) -> None:
        """A snapshot being loaded while opening, as ``on_progress`` is told."""
        on_progress = self._options.on_progress
        if on_progress is None:
            return
        on_progress(
            ReplayProgress(
                records_read=0,
                bytes_read=0,
                records_total=None,
                bytes_total=None,
                elapsed_s=elapsed,
                done=False,
                snapshot_position=manifest.position,
                snapshot_bytes=manifest.size,
                loading_snapshot=True,
                snapshot_bytes_loaded=loaded,
            )
        )

    async def close(self, timeout: float) -> None:
        """Take everything down (see the module's doc); ``context.closed`` is already set."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        def left(floor: float = 0.0) -> float:
            return max(floor, deadline - loop.time())

        pending, replica = self._pending, self._replica
        closed = ClosedError(f"manager on {self._context.topic} is closed")
        pending.fail_queued(closed)
        pending.wake.set()  # the writer loop sees closed and ends
        # Give writes already sent a moment to be seen, so their callers learn the outcome.
        await pending.settle_in_flight(min(left(), 5.0))
        if self.snapshots is not None:
            await self.snapshots.settle(left())
        for task in self._tasks:
            await _cancel(task)
        if self.snapshots is not None:
            await self.snapshots.cancel()
        if self.writer is not None:
            self.writer.cancel_background()
            await _bounded(self.writer.release(), left(_TEARDOWN_FLOOR_S))
        if self.relay is not None:
            await _bounded(self.relay.close(), left(_TEARDOWN_FLOOR_S))
        await replica.close_reader(left(_TEARDOWN_FLOOR_S))
        if self.pump_task is not None:
            await _cancel(self.pump_task)
        pending.fail_in_flight()
        pending.fail_queued(closed)  # anything requeued while closing
        pending.fail_unfinished(closed)  # anything the writer held when it was cancelled
        replica.fail_waiters(closed)
        await _bounded(self._tail.close(), left(_TEARDOWN_FLOOR_S))
        if self.store is not None:
            await _bounded(self.store.close(), left(_TEARDOWN_FLOOR_S))
        if self._admin is not None:
            await _bounded(self._admin.close(), left(_TEARDOWN_FLOOR_S))
        if self.conn is not None and self._owns_conn:
            await _bounded(self.conn.close(), left(_TEARDOWN_FLOOR_S))
