"""The reconcile Loop: the worker switch and the leadership callbacks around a queue.

(Over 600 lines on purpose: the worker switch, the leadership callbacks and the
hand-off share the dispatch state (the queue's dispatching flag, the workers and the
reconciles in flight) and read as one unit, as controller-runtime's controller does.
What the end of a reconcile does is :mod:`kopf_reconcile.outcomes`.)

A Loop pulls entity ids from its triggers (each run under
:func:`~kopf_reconcile.triggers.supervise`) into a
:class:`~kopf_reconcile.dispatch_queue.DispatchQueue` (the pure
:class:`~kopf_reconcile.workqueue.WorkQueue` on the event loop: backpressure,
timers, waiting workers), dispatches them to the reconciler over a bounded pool
of worker tasks (one reconcile per entity at a time) and schedules the next look
from the result. Its configuration, defaults and their validation are
:class:`~kopf_reconcile.config.LoopConfig`'s.

Leadership. With a :class:`LeaderElector`, only the holder of a live lease
dispatches: workers exist only while the lease is held. Followers keep
queuing (deduplicated), so nothing is lost at failover, and a new leader also
runs a resync-all (with a durable dead-letter store, only once it has loaded the
store's dead letters, bounded: see :mod:`kopf_reconcile.dead_letters`). The lease
is renewed every ``renew_interval``; when no renewal has succeeded for the renew
deadline (2/3 of the TTL, see :mod:`kopf_reconcile.leader.timing`; measured on the
event loop's monotonic clock from when the last successful renewal was *sent*) or the
elector says
the lease is lost, the Loop steps down at once: in-flight reconciles are
cancelled, dispatch stops, and it goes back to acquiring (the control plane
is :class:`~kopf_reconcile.control.holding.LeaseHolder`;
workers also refuse to start a reconcile once the deadline has passed, e.g.
after an event-loop stall). Without an elector the Loop is always the leader,
with epoch 0, and nothing is fenced.

Fencing. With a :class:`FencedRepository`, each reconcile gets a
:class:`FencedWriter` bound to the lease's epoch. Before it dispatches, a new
leader records its epoch in the repository, which from then on rejects every
write below it in the Loop's scope (writes already in flight are ordered
before the recording). A :class:`StaleEpochError` escaping a reconcile means
a higher epoch has led: this process may be a zombie, so it stops dispatching
immediately, steps down and re-acquires; the entity is re-queued without
backoff growth.

Capabilities. The Loop relies only on declared protocols: the elector must
declare its TTL (:class:`~kopf_reconcile.leader.protocol.ElectorWithTTL`);
with a leader, the repository must record epochs
(:class:`~kopf_reconcile.fencing.protocol.EpochRecordingRepository`);
optional capabilities (epoch floors, release notifications, binding a
repository to the Loop) are used when declared. A combination that would
silently weaken a guarantee is a :class:`ConfigError` when the Loop is built
(:meth:`~kopf_reconcile.config.LoopConfig.validate`).

Guarded work. A lease is never released while a reconcile it guards still
runs: after cancelling them, the Loop waits for them only while the lease is
still live locally, and lets the lease lapse (instead of releasing it) when
one outlives that wait, e.g. a sync reconciler in its thread.

Lifecycle. ``await start()`` returns promptly, everything runs as tasks;
``await stop(timeout)`` stops the triggers, lets in-flight reconciles finish
(renewing the lease meanwhile), cancels what is left after the timeout, and
releases the lease so a peer takes over at once (unless cancelled work still
runs: see above).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import weakref
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Self

from kopf_reconcile.api import (
    RESYNC_ALL,
    ConfigError,
    PermanentError,
    Request,
    as_reconcile_fn,
    seconds,
)
from kopf_reconcile.config import LoopConfig
from kopf_reconcile.control.holding import LeaseHolder
from kopf_reconcile.control.layout_wait import LayoutWait
from kopf_reconcile.dead_letters import DurableDeadLetters
from kopf_reconcile.dispatch_queue import DispatchQueue
from kopf_reconcile.events import EventRecorder, LoopEvents, bind_events
from kopf_reconcile.fencing.protocol import (
    DeadLetterStore,
    EpochRecordingRepository,
    LoopBoundRepository,
    ShardLayoutError,
    StaleEpochError,
)
from kopf_reconcile.fencing.writer import (
    ReconcileLease,
    bind_lease,
    bind_writer,
    mint_writer,
    unbind_writer,
)
from kopf_reconcile.leader.protocol import FloorAwareElector, LeaseToken
from kopf_reconcile.metrics import BoundMetrics
from kopf_reconcile.outcomes import ReconcileOutcomes
from kopf_reconcile.tenancy import MalformedEntityId, Tenancy
from kopf_reconcile.triggers import Emitter, supervise

logger = logging.getLogger("kopf_reconcile.loop")

UNLED_CANCEL_WAIT = 1.0  # without a lease, how long stop() waits for cancelled reconciles
HAND_OFF_POLL = 0.02  # how often a hand-off looks whether the reconciles in flight ended

# The leases Loops of this process hold, by (elector, reconciler id): two Loops on
# one elector and one id would both "hold" the same lease (same holder identity).
_leases_in_use: dict[tuple[int, str], weakref.ref[Loop]] = {}


@dataclasses.dataclass(frozen=True)
class LoopStats:
    """A snapshot of a Loop for probes and tests."""

    queued: int  # entities ready to run, not yet taken by a worker
    in_flight: int  # reconciles running now
    dead_letters: int  # dead-lettered, not re-triggered since (with a store: not yet succeeded)
    is_leader: bool
    epoch: int


class Loop:
    """A running reconcile loop. Build it with :class:`~kopf_reconcile.Builder`."""

    def __init__(
        self, config: LoopConfig, *, may_acquire: Callable[[], bool] | None = None
    ) -> None:
        """``config`` must have passed :meth:`LoopConfig.validate` (``Builder.build()`` does).

        ``may_acquire`` (a shard's balance, see :mod:`kopf_reconcile.sharded_loop`) is asked
        before each attempt to acquire the lease; ``None``: always try.
        """
        self._config = config
        self._may_acquire = may_acquire
        self._aside_until = 0.0  # on the event loop's clock: no acquire attempt before it
        self._aside_reason = ""
        self._name, self._reconciler_id = config.names()
        # An unsharded replica refused for the layout its store records waits, then retries.
        self._layout_wait = LayoutWait(self._name, config.renew_interval, config.rng)
        _, self._reconcile = as_reconcile_fn(config.reconciler)
        self._started = False
        self._stopping = False
        self._stopped = False
        # Leadership: a LeaseHolder with an elector; else always leader, epoch 0.
        self._holder: LeaseHolder | None = None
        self._recorder: EpochRecordingRepository | None = None
        self._floor_elector: FloorAwareElector | None = None
        self._leading_without_elector = False
        # Tasks. Ordered (dicts, not sets): cancellations happen in one order, run after run.
        self._workers: dict[asyncio.Task[None], None] = {}
        self._stragglers: dict[asyncio.Task[None], None] = {}
        self._trigger_tasks: list[asyncio.Task[None]] = []
        self._running: dict[str, asyncio.Task[None]] = {}  # entity -> its worker
        self._queue: DispatchQueue | None = None  # made on the event loop, by start()
        self._added: asyncio.Future[None] | None = None  # what emit returns once it added
        self._metrics = BoundMetrics(None, self._name)
        self._metrics_enabled = False
        self._tenant_scoped = config.tenancy is Tenancy.TENANT_SCOPED
        self._events: LoopEvents | None = None  # with an event sink (see kopf_reconcile.events)
        self._durable: DurableDeadLetters | None = None  # with a DeadLetterStore repository
        # What the end of each reconcile does; made again by start(), with what it binds.
        self._outcomes = ReconcileOutcomes(
            config, self._name, self._metrics, step_down=self._step_down_fenced
        )
        # While a hand-off waits, a term's first dispatch (after its dead letters load)
        # waits too: it runs only if the hand-off gives up (see hand_off).
        self._handing_off = False
        self._dispatch_deferred = False

    # -- public surface --------------------------------------------------------

    @property
    def name(self) -> str:
        """The controller name (logs)."""
        return self._name

    @property
    def reconciler_id(self) -> str:
        """The lease name, fencing scope and metrics' ``controller`` label."""
        return self._reconciler_id

    def stats(self) -> LoopStats:
        queue = self._queue
        return LoopStats(
            queued=queue.ready_count if queue is not None else 0,
            in_flight=len(self._running),
            dead_letters=self._dead_count(),
            is_leader=self._is_leader(),
            epoch=self._epoch(),
        )

    async def start(self) -> None:
        """Start workers, triggers and the lease control plane as tasks."""
        if self._started:
            raise RuntimeError(f"loop {self._name!r} was already started")
        cfg = self._config
        # What may still refuse this Loop comes before it claims its lease: a refused
        # start must leave no claim behind.
        if isinstance(cfg.fenced_repo, LoopBoundRepository):
            cfg.fenced_repo.bind_loop(reconciler_id=self._reconciler_id, tenancy=cfg.tenancy)
        self._claim_lease()
        self._started = True
        queue = self._queue = DispatchQueue(
            backoff_base=cfg.backoff_base,
            backoff_max=cfg.backoff_max,
            rng=cfg.rng,
            capacity=cfg.intake_capacity,
            concurrency=cfg.concurrency,
            on_add=self._count_add if cfg.metrics is not None else None,
        )
        self._added = asyncio.get_running_loop().create_future()
        self._added.set_result(None)
        controller, shard = cfg.metric_labels or (self._reconciler_id, "")
        self._metrics = BoundMetrics(
            cfg.metrics,
            controller,
            shard=shard,
            # A follower dispatches nothing: what it keeps is a backlog for a failover,
            # not work waiting, and must not look like a stuck queue to alerts.
            depth=lambda: queue.ready_count if queue.dispatching else 0,
            backlog=lambda: 0 if queue.dispatching else queue.ready_count,
            in_flight=lambda: len(self._running),
            dead=self._dead_count,
        )
        self._metrics.max_concurrent.set(cfg.concurrency)
        if cfg.events is not None:
            self._events = LoopEvents(EventRecorder(cfg.events), self._is_leader)
        if cfg.leader is not None and isinstance(cfg.fenced_repo, DeadLetterStore):
            self._durable = DurableDeadLetters(
                cfg.fenced_repo,
                name=self._name,
                epoch=self._epoch,
                redrive=queue.add,
                replace_dead=queue.replace_dead,
                interval=cfg.redrive_interval,
            )
        self._metrics_enabled = cfg.metrics is not None
        self._outcomes = ReconcileOutcomes(
            cfg,
            self._name,
            self._metrics,
            events=self._events,
            durable=self._durable,
            step_down=self._step_down_fenced,
        )
        if cfg.leader is not None and isinstance(cfg.fenced_repo, EpochRecordingRepository):
            self._recorder = cfg.fenced_repo
            if isinstance(cfg.leader, FloorAwareElector):
                cfg.leader.use_epoch_floor(self._reconciler_id, self._recorder.highest_epoch)
                self._floor_elector = cfg.leader
        emitter = Emitter(self._emit, self._emit_resync)
        self._trigger_tasks = [
            asyncio.create_task(
                supervise(trigger, emitter, controller=self._name),
                name=f"{self._name}: trigger {trigger!r}",
            )
            for trigger in cfg.triggers
        ]
        if cfg.leader is None:
            self._leading_without_elector = True
            queue.open()
            self._metrics.leader.set(1)
            self._spawn_workers()
        else:
            self._holder = LeaseHolder(
                cfg.leader,
                self._reconciler_id,
                name=f"loop {self._name}",
                timing=cfg.lease_timing(),
                rng=cfg.rng,
                metrics=self._metrics,
                on_lead=self._on_lead,
                on_lose=self._on_lose,
                confirm=self._confirm_epoch if self._recorder is not None else None,
                may_acquire=self._may_acquire_now,
            )
            self._holder.start()
        logger.info(
            "loop %s started (reconciler id %s, %d workers, %s)",
            self._name,
            self._reconciler_id,
            cfg.concurrency,
            "single-process" if cfg.leader is None else "leader election",
            extra={"controller": self._name},
        )

    async def stop(self, timeout: float | None = None) -> None:
        """Drain in-flight reconciles (up to ``timeout``), cancel the rest, release the lease."""
        if not self._started or self._stopped:
            return
        assert self._queue is not None
        limit = self._config.stop_timeout if timeout is None else seconds("timeout", timeout)
        self._stopping = True
        try:
            for task in self._trigger_tasks:
                task.cancel()
            await asyncio.gather(*self._trigger_tasks, return_exceptions=True)
            self._queue.close()
            workers = [*self._workers, *self._stragglers]
            if workers:
                _, pending = await asyncio.wait(workers, timeout=limit)
                if pending:
                    logger.error(
                        "loop %s: reconciles still running %.1fs after stop, cancelling: %s",
                        self._name,
                        limit,
                        sorted(self._running),
                        extra={"controller": self._name},
                    )
                    self._cancel([task for task in workers if task in pending])
            self._queue.dispatching = False
            # While the lease is still held: a dead letter written after the release
            # would be refused (a peer may lead at a higher epoch by then).
            await self._close_side_channels()
            if self._holder is not None:
                # Stops counting as live first; releases only once no guarded work runs.
                await self._holder.stop(set(self._running.values()))
            else:
                if self._running:
                    await asyncio.wait(set(self._running.values()), timeout=UNLED_CANCEL_WAIT)
                self._leading_without_elector = False
                self._metrics.leader.set(0)
        except asyncio.CancelledError:
            self._abandon()
            raise
        self._report_stuck()
        self._release_claims()
        self._stopped = True
        logger.info("loop %s stopped", self._name, extra={"controller": self._name})

    def _abandon(self) -> None:
        """``stop()`` was cancelled: stop everything at once and let the lease lapse.

        Nothing is awaited (the caller wants out); without a release, no peer takes
        over before the TTL, so work still ending in threads is not overlapped early.
        """
        assert self._queue is not None
        self._queue.dispatching = False
        for task in self._trigger_tasks:
            task.cancel()
        self._cancel([*self._workers, *self._stragglers])
        if self._holder is not None:
            self._holder.abandon()
        self._leading_without_elector = False
        self._metrics.leader.set(0)
        if self._durable is not None:
            self._durable.lose()
        if self._events is not None:
            self._events.recorder.drop_pending()
        self._release_claims()
        self._stopped = True
        logger.warning(
            "loop %s: stop() was cancelled; the lease (if held) lapses instead of being released",
            self._name,
            extra={"controller": self._name},
        )

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def enqueue(self, request: Request) -> None:
        """Add a request as a trigger would (with backpressure)."""
        if not self._started or self._stopped:
            raise RuntimeError(f"loop {self._name!r} is not running")
        await self._emit(request)

    def _claim_lease(self) -> None:
        """Refuse a second Loop on the same elector and reconciler id while the first runs.

        A Loop that stopped but whose reconciles still run (threads that outlived their
        cancellation, a lease left to lapse) still counts: a successor would find the
        lease "still ours" under the same holder identity and lead at once, at the
        same epoch, inside the entities those threads are in.
        """
        leader = self._config.leader
        if leader is None:
            return
        key = (id(leader), self._reconciler_id)
        ref = _leases_in_use.get(key)
        other = ref() if ref is not None else None
        if other is not None and other is not self and (not other._stopped or other._running):
            still = "still runs" if not other._stopped else "stopped, but its reconciles still run"
            raise ConfigError(
                f"reconciler id {self._reconciler_id!r} is already led through elector "
                f"{leader!r} by loop {other.name!r}, which {still}: both would hold the "
                "same lease under one holder identity; give each Loop its own reconciler_id, "
                "or start this one when the other has ended"
            )
        _leases_in_use[key] = weakref.ref(self)

    def _release_claims(self) -> None:
        leader = self._config.leader
        # While reconciles still run, the claim stays (see _claim_lease): it names this Loop.
        if leader is not None and not self._running:
            key = (id(leader), self._reconciler_id)
            ref = _leases_in_use.get(key)
            if ref is not None and ref() is self:
                del _leases_in_use[key]
        if self._floor_elector is not None and self._recorder is not None:
            self._floor_elector.drop_epoch_floor(self._reconciler_id, self._recorder.highest_epoch)
            self._floor_elector = None

    # -- intake ----------------------------------------------------------------

    def _emit(self, request: Request, *, resync: bool = False) -> Awaitable[None]:
        """The triggers' ``emit``: done at once when the intake has room, else waiting for it.

        Not a coroutine function: a request that finds room (the common case) is added
        right here and gets an already completed awaitable, with no coroutine to run.
        """
        if type(request) is not Request or type(request.entity_id) is not str:
            raise TypeError(
                f"a trigger of loop {self._name!r} emitted {request!r}; "
                "expected kopf_reconcile.Request(entity_id: str)"
            )
        queue = self._queue
        assert queue is not None and self._added is not None
        if queue.offer(request.entity_id, resync=resync):
            return self._added
        return queue.put(request.entity_id, resync=resync)

    def _emit_resync(self, request: Request) -> Awaitable[None]:
        """A re-observation (the resync lane): fresh requests go first."""
        return self._emit(request, resync=True)

    def _count_add(self) -> None:
        self._metrics.adds.inc()

    # -- workers: the worker switch ----------------------------------------------

    def _spawn_workers(self) -> None:
        """Start workers up to ``concurrency``, counting reconciles that outlive a step-down."""
        workers = self._workers
        for _ in range(self._config.concurrency - len(workers) - len(self._stragglers)):
            task = asyncio.create_task(self._work(), name=f"{self._name}: worker")
            workers[task] = None
            task.add_done_callback(functools.partial(_forget, workers))

    def _straggler_done(self, task: asyncio.Task[None]) -> None:
        self._stragglers.pop(task, None)
        if self._queue is not None and self._queue.dispatching and not self._stopping:
            self._spawn_workers()  # its slot is free again

    async def _work(self) -> None:
        task = asyncio.current_task()
        assert task is not None and self._queue is not None
        queue = self._queue
        bind_events(self._events)  # kr.event() inside this worker's reconciles
        # The lease of this worker's reconciles: workers live within one term (a lost lease
        # cancels them, the next term spawns new ones), so its epoch is theirs.
        holder = self._holder
        bind_lease(
            ReconcileLease(
                self._epoch(),
                self._lease_is_live,
                lease_id=None if holder is None else self._reconciler_id,
                holder=None if holder is None else holder.holder_id,
                count_api_write=self._count_api_write,
            )
        )
        while not self._stopping:
            if not queue.dispatching or not queue.ready_count:
                if not self._running:
                    queue.work_queue.trim()
                await queue.wait_for_work()
                continue
            if self._lease_expired():
                continue  # dispatch closed; the control plane steps down
            entity, since = queue.take()
            await self._process(queue, entity, since, task)

    async def _process(
        self, queue: DispatchQueue, entity: str, since: float, task: asyncio.Task[None]
    ) -> None:
        # The hot path: keep it free of work that is not needed per reconcile.
        clock = queue.now
        started = clock()
        self._running[entity] = task
        writer_token = None
        repo = self._config.fenced_repo
        if repo is not None:
            writer_token = bind_writer(
                mint_writer(repo, self._epoch(), self._lease_is_live, self._count_fenced_write)
            )
        try:
            if self._tenant_scoped and entity != RESYNC_ALL:
                self._config.tenancy.tenant_of(entity)
            outcome = await self._reconcile(Request(entity))
            if task.cancelling():
                raise asyncio.CancelledError  # the reconciler swallowed a cancellation
        except asyncio.CancelledError as exc:
            if not task.cancelling():  # raised by the reconciler itself: a failure
                self._outcomes.failed(queue, entity, exc)
                return
            queue.done_requeue(entity)
            self._metrics.results["canceled"].inc()
            raise
        except BaseException as exc:  # whatever a reconciler raises, the worker lives on
            if task.cancelling():  # cancelled, and its cleanup raised something else
                queue.done_requeue(entity)
                self._metrics.results["canceled"].inc()
                raise asyncio.CancelledError from exc
            if isinstance(exc, MalformedEntityId):
                self._outcomes.dead_letter(queue, entity, f"malformed entity id: {exc}")
            elif isinstance(exc, PermanentError):
                self._outcomes.dead_letter(
                    queue, entity, f"permanent error: {exc!r}", message=str(exc) or repr(exc)
                )
            elif isinstance(exc, StaleEpochError):
                self._outcomes.fenced(queue, entity, exc)
            else:
                self._outcomes.failed(queue, entity, exc)
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise  # the process is meant to end; the entity's state is consistent
        else:
            self._outcomes.succeeded(queue, entity, outcome)
        finally:
            if writer_token is not None:
                unbind_writer(writer_token)
            del self._running[entity]
            if self._metrics_enabled:
                metrics = self._metrics
                elapsed = clock() - started
                metrics.queue_duration.observe(started - since)
                metrics.reconcile_time.observe(elapsed)
                metrics.work_duration.observe(elapsed)

    def _step_down_fenced(self, queue: DispatchQueue) -> None:
        """A fenced write was rejected: a higher epoch has led, so stop leading now."""
        if self._holder is not None and self._holder.leading:
            # Stop dispatch now; the control plane steps down and re-acquires.
            queue.close_dispatch()
            self._holder.step_down_soon("a fenced write was rejected")

    def _count_fenced_write(self, outcome: str) -> None:
        self._metrics.fenced_writes[outcome].inc()

    def _count_api_write(self, outcome: str) -> None:
        self._metrics.api_writes[outcome].inc()

    def _lease_expired(self) -> bool:
        """True (and dispatch closed) once no renewal succeeded within the renew deadline.

        The control plane notices this too, but after an event-loop stall a worker may
        run first: it must not start a reconcile on a lease that may be someone else's.
        """
        if self._holder is None or not self._holder.deadline_passed():
            return False
        assert self._queue is not None
        self._queue.close_dispatch()
        self._holder.step_down_soon("the renew deadline passed (the event loop stalled?)")
        return True

    def _epoch(self) -> int:
        return self._holder.epoch if self._holder is not None else 0

    def _is_leader(self) -> bool:
        return self._holder.leading if self._holder else self._leading_without_elector

    def _dead_count(self) -> int:
        """Dead letters in the queue, and those of the durable store not (yet) in it."""
        queue = self._queue
        if queue is None:
            return 0
        count = queue.dead_count
        if self._durable is not None:
            is_dead = queue.work_queue.is_dead
            count += sum(1 for entity in self._durable.known if not is_dead(entity))
        return count

    async def _close_side_channels(self) -> None:
        """Stop polling for redrives; let pending dead-letter writes and event posts end."""
        if self._durable is not None:
            await self._durable.close()
        if self._events is not None:
            await self._events.recorder.close()

    def _lease_is_live(self, epoch: int) -> bool:
        return self._holder is None or self._holder.is_live(epoch)

    def _cancel(self, tasks: Iterable[asyncio.Task[None]]) -> None:
        """Cancel workers; until they end they are stragglers (holding their worker slots).

        Whoever cancels waits for them as the lease allows (the LeaseHolder, or stop()).
        """
        for task in tasks:
            if task not in self._stragglers:
                self._stragglers[task] = None
                task.add_done_callback(self._straggler_done)
            task.cancel()

    def _report_stuck(self) -> None:
        if self._running:
            logger.error(
                "loop %s: %d reconcile(s) ignore cancellation (sync reconcilers cannot be "
                "interrupted): %s",
                self._name,
                len(self._running),
                sorted(self._running),
                extra={"controller": self._name},
            )

    # -- leadership callbacks (the control plane itself is control.holding.LeaseHolder) --

    async def _confirm_epoch(self, token: LeaseToken) -> None:
        """Make the fenced store know the epoch before it leads.

        From then on the store rejects every write below it in this scope, and its
        ``highest_epoch`` (the floor of a recreated lease record) covers it. The
        LeaseHolder renews once afterwards: that proves the lease was not recreated
        at this very epoch by someone who read the floor before.
        """
        assert self._recorder is not None
        try:
            await self._recorder.record_epoch(token.epoch, token.holder_id)
        except ShardLayoutError as exc:
            raise self._layout_wait.refused(exc) from None
        self._layout_wait.accepted()

    def _may_acquire_now(self) -> bool:
        """Asked before each acquire attempt: not while a layout refusal is waited out, nor
        while standing aside (:meth:`stand_aside`)."""
        if asyncio.get_running_loop().time() < self._aside_until:
            return False
        return self._layout_wait.open() and (self._may_acquire is None or self._may_acquire())

    def _on_lead(self, token: LeaseToken) -> None:
        holder = self._holder
        if holder is not None and asyncio.get_running_loop().time() < self._aside_until:
            # Asked to stand aside while this lease was being taken (the acquire had passed
            # the gate already): dispatch nothing, give it back at once.
            holder.step_down_soon(self._aside_reason)
            return
        if self._durable is not None:
            # The store's dead letters first (bounded: see kopf_reconcile.dead_letters), so
            # neither the resync-all nor a worker runs one before it is known dead; then
            # dispatch, then the store's redrive requests.
            self._durable.lead(self._dispatch)
        else:
            self._dispatch()

    def _dispatch(self) -> None:
        """Start dispatching as the leader: open, resync-all, workers."""
        assert self._queue is not None
        if self._stopping or not self._is_leader():
            return
        if self._handing_off:
            self._dispatch_deferred = True
            return
        self._queue.open()
        self._queue.add(RESYNC_ALL)  # a new leader re-observes everything
        self._spawn_workers()

    def _on_lose(self) -> set[asyncio.Task[None]]:
        """Stop dispatching and cancel every reconcile; the ones still running are returned."""
        assert self._queue is not None
        self._queue.close_dispatch()  # a follower's triggers never wait for room
        self._dispatch_deferred = False
        if self._durable is not None:
            self._durable.lose()
        if self._events is not None:
            self._events.recorder.drop_pending()  # only the leader posts
        workers, self._workers = self._workers, {}
        self._cancel(workers)
        return {task for task in self._running.values() if not task.done()}

    async def hand_off(self, grace: float) -> None:
        """Give the lease up without overlap (a shard handed to another replica).

        Dispatch stops first; the reconciles in flight may end within ``grace`` seconds
        (the lease is renewed meanwhile); once none runs, the Loop steps down and the
        control plane goes back to acquiring, as ``may_acquire`` allows. When one still
        runs after the grace the hand-off is abandoned: dispatch reopens and the lease
        is kept. Cancelling it instead would not stop a reconcile running in a thread,
        and the next holder would then reconcile beside it; a hand-off is an
        optimisation (balance), never worth an overlap. Nothing happens when the Loop
        does not lead.
        """
        holder, queue = self._holder, self._queue
        if holder is None or queue is None or not holder.leading or self._stopping:
            return
        # Dispatching already, or not yet (this term's dead letters still load): a hand-off
        # that gives up restores exactly that, never dispatch before the load.
        was_dispatching = queue.dispatching
        queue.close_dispatch()
        self._handing_off = True
        try:
            # The workers live on (idle); what must end is the reconciles they run. Polled:
            # a hand-off is rare, and the hot path stays free of it.
            deadline = queue.now() + grace
            for _ in range(math.ceil(grace / HAND_OFF_POLL)):
                if not self._running or not holder.leading or queue.now() >= deadline:
                    break
                await asyncio.sleep(HAND_OFF_POLL)
        finally:
            self._handing_off = False
        if not holder.leading or self._stopping:
            return
        if self._running:
            logger.info(
                "%s keeps its lease: %d reconcile(s) still run after the %.1fs grace of a "
                "hand-off; dispatch resumes",
                self._name,
                len(self._running),
                grace,
                extra={"controller": self._name},
            )
            if was_dispatching:
                queue.open()
            if self._dispatch_deferred:
                self._dispatch_deferred = False
                self._dispatch()
            return
        holder.step_down_soon("handing the lease off to another replica")

    def stand_aside(self, reason: str, seconds: float) -> None:
        """Lead no more for ``seconds``: step down now when leading, try no acquire until then.

        The step-down is the ordinary one: nothing passes the local lease check from
        now on, the reconciles in flight are cancelled, and the lease is released once
        they ended (or lapses). A Loop without an elector always leads: nothing happens.
        """
        holder = self._holder
        if holder is None or self._stopping:
            return
        self._aside_until = asyncio.get_running_loop().time() + seconds
        self._aside_reason = reason
        if holder.leading:
            holder.step_down_soon(reason)

    def __repr__(self) -> str:
        s = self.stats()
        return f"<Loop {self._name} leader={s.is_leader} epoch={s.epoch} queued={s.queued}>"


def _forget(tasks: dict[asyncio.Task[None], None], task: asyncio.Task[None]) -> None:
    tasks.pop(task, None)
