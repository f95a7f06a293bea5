"""The reconcile Loop: workers, triggers and timers around a work queue.

A Loop pulls entity ids from its triggers into a :class:`WorkQueue`,
dispatches them to the reconciler over a bounded pool of worker tasks (one
reconcile per entity at a time) and schedules the next look from the result.

Leadership. With a :class:`LeaderElector`, only the holder of a live lease
dispatches: workers exist only while the lease is held. Followers keep
queuing (deduplicated), so nothing is lost at failover, and a new leader also
runs a resync-all. The lease is renewed every ``renew_interval``; when no
renewal has succeeded for the renew deadline (2/3 of the TTL, measured on
this process's monotonic clock from when the last successful renewal was
*sent*) or the elector says the lease is lost, the Loop steps down at once:
in-flight reconciles are cancelled, dispatch stops, and it goes back to
acquiring (the control plane is :class:`~kopf_reconcile.leader.holding.LeaseHolder`;
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
silently weaken a guarantee is a :class:`ConfigError` at start.

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
import random
import re
import weakref
from collections import deque
from collections.abc import Iterable
from types import TracebackType
from typing import Self

from kopf_reconcile.api import RESYNC_ALL, PermanentError, Request, Result, as_reconcile_fn
from kopf_reconcile.backoff import requeue_jitter
from kopf_reconcile.config import ConfigError, seconds
from kopf_reconcile.fencing.protocol import (
    EpochRecordingRepository,
    FencedRepository,
    LoopBoundRepository,
    StaleEpochError,
)
from kopf_reconcile.fencing.writer import bind_writer, mint_writer, unbind_writer
from kopf_reconcile.leader.holding import LeaseHolder
from kopf_reconcile.leader.protocol import (
    ElectorWithTTL,
    FloorAwareElector,
    LeaderElector,
    LeaseToken,
    LeaseTTL,
)
from kopf_reconcile.metrics import BoundMetrics, Metrics
from kopf_reconcile.tenancy import MalformedEntityId, Tenancy
from kopf_reconcile.triggers import Trigger
from kopf_reconcile.workqueue import WorkQueue

logger = logging.getLogger("kopf_reconcile.loop")

# Defaults (controller-runtime / client-go parity).
DEFAULT_CONCURRENCY = 1  # controller-runtime MaxConcurrentReconciles
DEFAULT_INTERVAL = 10 * 3600.0  # controller-runtime SyncPeriod: 10 h
DEFAULT_BACKOFF_BASE = 0.005  # client-go DefaultControllerRateLimiter: 5 ms
DEFAULT_BACKOFF_MAX = 1000.0  # ... capped at 1000 s
DEFAULT_RENEW_INTERVAL = 2.0  # client-go RetryPeriod
DEFAULT_STOP_TIMEOUT = 30.0  # controller-runtime GracefulShutdownTimeout
DEFAULT_INTAKE_CAPACITY = 100_000  # ready entities before emit() blocks
RENEW_DEADLINE_FRACTION = 2 / 3  # client-go: RenewDeadline 10 s of LeaseDuration 15 s
TRIGGER_RESTART_MAX = 30.0
UNLED_CANCEL_WAIT = 1.0  # without a lease, how long stop() waits for cancelled reconciles

# The leases Loops of this process hold, by (elector, reconciler id): two Loops on
# one elector and one id would both "hold" the same lease (same holder identity).
_leases_in_use: dict[tuple[int, str], weakref.ref[Loop]] = {}

_RFC1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)


@dataclasses.dataclass(frozen=True)
class LoopStats:
    """A snapshot of a Loop for probes and tests."""

    queued: int  # entities ready to run, not yet taken by a worker
    in_flight: int  # reconciles running now
    dead_letters: int  # entities dead-lettered and not re-triggered since
    is_leader: bool
    epoch: int


@dataclasses.dataclass
class LoopConfig:
    """Everything a Builder collected; validated by :meth:`Loop.start`."""

    reconciler: object
    tenancy: Tenancy
    triggers: list[Trigger]
    concurrency: int = DEFAULT_CONCURRENCY
    interval: float = DEFAULT_INTERVAL
    backoff_base: float = DEFAULT_BACKOFF_BASE
    backoff_max: float = DEFAULT_BACKOFF_MAX
    leader: LeaderElector | None = None
    fenced_repo: FencedRepository | None = None
    metrics: Metrics | None = None
    name: str | None = None
    reconciler_id: str | None = None
    renew_interval: float = DEFAULT_RENEW_INTERVAL
    default_requeue: bool = True
    intake_capacity: int = DEFAULT_INTAKE_CAPACITY
    stop_timeout: float = DEFAULT_STOP_TIMEOUT
    rng: random.Random = dataclasses.field(default_factory=random.Random)


def default_reconciler_id(name: str) -> str:
    """A lease-name-safe id derived from a reconciler's name (``reconcile_x`` → ``reconcile-x``)."""
    return re.sub(r"[^a-z0-9.-]+", "-", name.lower()).strip("-.") or "reconciler"


def validate_reconciler_id(value: object) -> str:
    if not isinstance(value, str) or len(value) > 253 or not _RFC1123_SUBDOMAIN.match(value):
        raise ConfigError(
            f"reconciler_id must be a valid Kubernetes object name (RFC 1123 subdomain: "
            f"lowercase alphanumerics, '-' and '.', at most 253 characters), got {value!r}"
        )
    return value


class Loop:
    """A running reconcile loop. Build it with :class:`~kopf_reconcile.Builder`."""

    def __init__(self, config: LoopConfig) -> None:
        self._config = config
        self._name, self._reconcile = as_reconcile_fn(config.reconciler)
        if config.name is not None:
            self._name = config.name
        self._reconciler_id = (
            default_reconciler_id(self._name)
            if config.reconciler_id is None
            else config.reconciler_id
        )
        self._started = False
        self._stopping = False
        self._stopped = False
        # Leadership: a LeaseHolder with an elector; else always leader, epoch 0.
        self._holder: LeaseHolder | None = None
        self._recorder: EpochRecordingRepository | None = None
        self._floor_elector: FloorAwareElector | None = None
        self._single_leading = False
        self._dispatch_open = False
        self._renew_deadline = 0.0
        self._ttl = 0.0
        # Tasks and waiters.
        # Ordered (dicts, not sets): cancellations happen in one order, run after run.
        self._workers: dict[asyncio.Task[None], None] = {}
        self._stragglers: dict[asyncio.Task[None], None] = {}
        self._trigger_tasks: list[asyncio.Task[None]] = []
        self._idle: deque[asyncio.Future[None]] = deque()
        self._space: deque[asyncio.Future[None]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0
        self._running: dict[str, asyncio.Task[None]] = {}  # entity -> its worker
        self._queue = WorkQueue(
            backoff_base=config.backoff_base, backoff_max=config.backoff_max, rng=config.rng
        )
        self._m = BoundMetrics(None, self._name)
        self._metered = False
        self._tenant_scoped = config.tenancy is Tenancy.TENANT_SCOPED

    # -- public surface --------------------------------------------------------

    @property
    def name(self) -> str:
        """The controller name (metrics label, logs)."""
        return self._name

    @property
    def reconciler_id(self) -> str:
        """The lease name and fencing scope."""
        return self._reconciler_id

    def stats(self) -> LoopStats:
        return LoopStats(
            queued=self._queue.ready_count,
            in_flight=len(self._running),
            dead_letters=self._queue.dead_count,
            is_leader=self._holder.leading if self._holder else self._single_leading,
            epoch=self._epoch(),
        )

    async def start(self) -> None:
        """Validate, then start workers, triggers and the lease control plane as tasks."""
        if self._started:
            raise RuntimeError(f"loop {self._name!r} was already started")
        self._validate()
        cfg = self._config
        # What may still refuse this Loop comes before it claims its lease: a refused
        # start must leave no claim behind.
        if isinstance(cfg.fenced_repo, LoopBoundRepository):
            cfg.fenced_repo.bind_loop(reconciler_id=self._reconciler_id, tenancy=cfg.tenancy)
        self._claim_lease()
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._queue = WorkQueue(
            backoff_base=cfg.backoff_base, backoff_max=cfg.backoff_max, rng=cfg.rng
        )
        self._m = BoundMetrics(
            cfg.metrics,
            self._name,
            # A follower dispatches nothing: what it keeps is a backlog for a failover,
            # not work waiting, and must not look like a stuck queue to alerts.
            depth=lambda: self._queue.ready_count if self._dispatch_open else 0,
            backlog=lambda: 0 if self._dispatch_open else self._queue.ready_count,
            in_flight=lambda: len(self._running),
            dead=lambda: self._queue.dead_count,
        )
        self._m.max_concurrent.set(cfg.concurrency)
        self._metered = cfg.metrics is not None
        if self._recorder is not None and isinstance(cfg.leader, FloorAwareElector):
            cfg.leader.use_epoch_floor(self._reconciler_id, self._recorder.highest_epoch)
            self._floor_elector = cfg.leader
        self._trigger_tasks = [
            asyncio.create_task(self._supervise(t), name=f"{self._name}: trigger {t!r}")
            for t in cfg.triggers
        ]
        if cfg.leader is None:
            self._single_leading = True
            self._dispatch_open = True
            self._m.leader.set(1)
            self._spawn_workers()
        else:
            self._holder = LeaseHolder(
                cfg.leader,
                self._reconciler_id,
                name=f"loop {self._name}",
                ttl=self._ttl,
                renew_interval=cfg.renew_interval,
                renew_deadline=self._renew_deadline,
                rng=cfg.rng,
                metrics=self._m,
                on_lead=self._on_lead,
                on_lose=self._on_lose,
                confirm=self._confirm_epoch if self._recorder is not None else None,
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
        limit = self._config.stop_timeout if timeout is None else seconds("timeout", timeout)
        self._stopping = True
        try:
            for task in self._trigger_tasks:
                task.cancel()
            await asyncio.gather(*self._trigger_tasks, return_exceptions=True)
            if self._timer is not None:
                self._timer.cancel()
            self._wake_all(self._idle)
            self._wake_all(self._space)
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
            self._dispatch_open = False
            if self._holder is not None:
                # Stops counting as live first; releases only once no guarded work runs.
                await self._holder.stop(set(self._running.values()))
            else:
                if self._running:
                    await asyncio.wait(set(self._running.values()), timeout=UNLED_CANCEL_WAIT)
                self._single_leading = False
                self._m.leader.set(0)
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
        self._dispatch_open = False
        for task in self._trigger_tasks:
            task.cancel()
        self._cancel([*self._workers, *self._stragglers])
        if self._holder is not None:
            self._holder.abandon()
        self._single_leading = False
        self._m.leader.set(0)
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

    # -- validation ------------------------------------------------------------

    def _validate(self) -> None:
        cfg = self._config
        if isinstance(cfg.concurrency, bool) or not isinstance(cfg.concurrency, int):
            raise ConfigError(f"concurrency must be an integer >= 1, got {cfg.concurrency!r}")
        if cfg.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {cfg.concurrency!r}")
        if cfg.interval <= 0:
            raise ConfigError(f"interval must be > 0 seconds, got {cfg.interval!r}")
        if cfg.backoff_base <= 0:
            raise ConfigError(f"backoff base must be > 0 seconds, got {cfg.backoff_base!r}")
        if cfg.backoff_base > cfg.backoff_max:
            raise ConfigError(
                f"backoff base ({cfg.backoff_base!r} s) must not exceed backoff max "
                f"({cfg.backoff_max!r} s)"
            )
        if isinstance(cfg.intake_capacity, bool) or not isinstance(cfg.intake_capacity, int):
            raise ConfigError(f"intake capacity must be an integer, got {cfg.intake_capacity!r}")
        if cfg.intake_capacity < 1:
            raise ConfigError(f"intake capacity must be >= 1, got {cfg.intake_capacity!r}")
        if cfg.stop_timeout < 0:
            raise ConfigError(f"stop timeout must be >= 0 seconds, got {cfg.stop_timeout!r}")
        validate_reconciler_id(self._reconciler_id)
        repo = cfg.fenced_repo
        if repo is not None and not isinstance(repo, FencedRepository):
            raise ConfigError(f"fenced repo {repo!r} is not a FencedRepository (apply_fenced)")
        if cfg.leader is None:
            return
        leader = cfg.leader
        if not isinstance(leader, LeaderElector):
            raise ConfigError(
                f"leader {leader!r} is not a LeaderElector "
                "(acquire_lease, renew_lease, release_lease)"
            )
        if cfg.renew_interval <= 0:
            raise ConfigError(f"renew_interval must be > 0 seconds, got {cfg.renew_interval!r}")
        ttl = _declared_ttl(leader)
        self._ttl = ttl.seconds
        self._renew_deadline = ttl.seconds * RENEW_DEADLINE_FRACTION
        if cfg.renew_interval >= self._renew_deadline:
            raise ConfigError(
                f"renew_interval ({cfg.renew_interval!r} s) must be shorter than the "
                f"renew deadline ({self._renew_deadline:.3g} s = 2/3 of the lease ttl "
                f"{ttl.seconds!r} s), so a leader steps down before its lease can expire"
            )
        if repo is not None:
            if not isinstance(repo, EpochRecordingRepository):
                raise ConfigError(
                    f"fenced repo {repo!r} cannot record the epoch a leader leads at "
                    "(record_epoch, highest_epoch: the EpochRecordingRepository protocol), so "
                    "a paused old leader could still write to entities the new leader has not "
                    "written; implement it, or run without a leader"
                )
            self._recorder = repo

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

    async def _emit(self, request: Request) -> None:
        if type(request) is not Request or type(request.entity_id) is not str:
            raise TypeError(
                f"a trigger of loop {self._name!r} emitted {request!r}; "
                "expected kopf_reconcile.Request(entity_id: str)"
            )
        entity = request.entity_id
        queue = self._queue
        capacity = self._config.intake_capacity
        # Only a dispatching Loop drains its queue: a follower keeps each id once
        # (deduplicated, bounded by the ids it sees) and never blocks its triggers.
        while (
            self._dispatch_open
            and queue.ready_count >= capacity
            and not queue.is_ready(entity)
            and not queue.is_processing(entity)
            and not self._stopping
        ):
            space = self._loop.create_future()
            self._space.append(space)
            await space
        self._enqueue(entity)

    def _enqueue(self, entity: str) -> None:
        if self._metered:
            self._m.adds.inc()
        if self._queue.add(entity, self._loop.time()) and self._dispatch_open and self._idle:
            self._wake_one(self._idle)

    # -- timers ----------------------------------------------------------------

    def _arm_timer(self) -> None:
        due = self._queue.next_due()
        if due is None or self._stopping:
            return
        if self._timer is not None and self._timer_due <= due:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = self._loop.call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        became_ready = self._queue.pop_due(self._loop.time())
        if self._dispatch_open:
            for _ in range(min(became_ready, self._config.concurrency)):
                self._wake_one(self._idle)
        self._arm_timer()

    # -- workers ---------------------------------------------------------------

    def _spawn_workers(self) -> None:
        """Start workers up to ``concurrency``, counting reconciles that outlive a step-down."""
        workers = self._workers
        for _ in range(self._config.concurrency - len(workers) - len(self._stragglers)):
            task = asyncio.create_task(self._work(), name=f"{self._name}: worker")
            workers[task] = None
            task.add_done_callback(functools.partial(_forget, workers))

    def _straggler_done(self, task: asyncio.Task[None]) -> None:
        self._stragglers.pop(task, None)
        if self._dispatch_open and not self._stopping:
            self._spawn_workers()  # its slot is free again

    async def _work(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        queue = self._queue
        while not self._stopping:
            if not self._dispatch_open or not queue.ready_count:
                if not self._running:
                    queue.trim()
                idle = self._loop.create_future()
                self._idle.append(idle)
                await idle
                continue
            if self._lease_expired():
                continue  # dispatch closed; the control plane steps down
            entity, since = queue.get()
            if self._space:
                self._wake_one(self._space)
            await self._process(entity, since, task)

    async def _process(self, entity: str, since: float, task: asyncio.Task[None]) -> None:
        # The hot path: keep it free of work that is not needed per reconcile.
        clock = self._loop.time
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
                self._failed(entity, exc)
                return
            self._queue.done_requeue(entity, clock())
            self._m.results["canceled"].inc()
            raise
        except BaseException as exc:  # whatever a reconciler raises, the worker lives on
            if task.cancelling():  # cancelled, and its cleanup raised something else
                self._queue.done_requeue(entity, clock())
                self._m.results["canceled"].inc()
                raise asyncio.CancelledError from exc
            if isinstance(exc, MalformedEntityId):
                self._dead_letter(entity, f"malformed entity id: {exc}")
            elif isinstance(exc, PermanentError):
                self._dead_letter(entity, f"permanent error: {exc!r}")
            elif isinstance(exc, StaleEpochError):
                self._fenced(entity, exc)
            else:
                self._failed(entity, exc)
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise  # the process is meant to end; the entity's state is consistent
        else:
            self._succeeded(entity, outcome)
        finally:
            if writer_token is not None:
                unbind_writer(writer_token)
            del self._running[entity]
            if self._metered:
                m = self._m
                elapsed = clock() - started
                m.queue_duration.observe(started - since)
                m.reconcile_time.observe(elapsed)
                m.work_duration.observe(elapsed)

    def _succeeded(self, entity: str, outcome: object) -> None:
        requeue_after: float | None
        if outcome is None:
            requeue_after = 0.0
        elif isinstance(outcome, Result):
            requeue_after = outcome.requeue_after
        else:
            self._dead_letter(
                entity,
                f"reconciler returned {outcome!r}; it must return kopf_reconcile.Result or None "
                "(a programmer error)",
            )
            return
        cfg = self._config
        if requeue_after:
            self._m.results["requeue_after"].inc()
        else:
            self._m.results["success"].inc()
            requeue_after = requeue_jitter(cfg.rng, cfg.interval) if cfg.default_requeue else None
        due = self._queue.done_success(entity, self._loop.time(), requeue_after)
        if due is not None and (self._timer is None or due < self._timer_due):
            self._arm_timer()

    def _failed(self, entity: str, exc: BaseException) -> None:
        delay = self._queue.done_error(entity, self._loop.time())
        self._arm_timer()
        m = self._m
        m.results["error"].inc()
        m.errors.inc()
        m.retries.inc()
        logger.error(
            "reconcile of %r by %s failed; retrying in %.3fs: %r",
            entity,
            self._name,
            delay,
            exc,
            exc_info=exc,
            extra={"controller": self._name, "entity": entity},
        )

    def _dead_letter(self, entity: str, reason: str) -> None:
        self._queue.done_permanent(entity, self._loop.time())
        self._m.results["permanent"].inc()
        logger.error(
            "entity %r of %s dead-lettered (no retry until a fresh trigger): %s",
            entity,
            self._name,
            reason,
            extra={"controller": self._name, "entity": entity},
        )

    def _fenced(self, entity: str, exc: StaleEpochError) -> None:
        self._queue.done_requeue(entity, self._loop.time())
        self._m.results["fenced"].inc()
        logger.warning(
            "reconcile of %r by %s was fenced (%s); stepping down: a higher epoch has written",
            entity,
            self._name,
            exc,
            extra={"controller": self._name, "entity": entity},
        )
        if self._holder is not None and self._holder.leading:
            # Stop dispatch now; the control plane steps down and re-acquires.
            self._dispatch_open = False
            self._holder.step_down_soon("a fenced write was rejected")

    def _count_fenced_write(self, outcome: str) -> None:
        self._m.fenced_writes[outcome].inc()

    def _lease_expired(self) -> bool:
        """True (and dispatch closed) once no renewal succeeded within the renew deadline.

        The control plane notices this too, but after an event-loop stall a worker may
        run first: it must not start a reconcile on a lease that may be someone else's.
        """
        if self._holder is None or not self._holder.deadline_passed():
            return False
        self._dispatch_open = False
        self._holder.step_down_soon("the renew deadline passed (the event loop stalled?)")
        return True

    def _epoch(self) -> int:
        return self._holder.epoch if self._holder is not None else 0

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

    # -- triggers ----------------------------------------------------------------

    async def _supervise(self, trigger: Trigger) -> None:
        delay = 0.1
        while True:
            started = self._loop.time()
            try:
                await trigger.run(self._emit)
            except Exception:
                logger.exception(
                    "trigger %r of %s crashed; restarting in %.1fs",
                    trigger,
                    self._name,
                    delay,
                    extra={"controller": self._name},
                )
            else:
                logger.info("trigger %r of %s is exhausted", trigger, self._name)
                return
            if self._loop.time() - started > TRIGGER_RESTART_MAX:
                delay = 0.1
            await asyncio.sleep(delay)
            delay = min(delay * 2, TRIGGER_RESTART_MAX)

    # -- leadership (the control plane itself is leader.holding.LeaseHolder) -----

    async def _confirm_epoch(self, token: LeaseToken) -> None:
        """Make the fenced store know the epoch before it leads.

        From then on the store rejects every write below it in this scope, and its
        ``highest_epoch`` (the floor of a recreated lease record) covers it. The
        LeaseHolder renews once afterwards: that proves the lease was not recreated
        at this very epoch by someone who read the floor before.
        """
        assert self._recorder is not None
        await self._recorder.record_epoch(token.epoch, token.holder_id)

    def _on_lead(self, token: LeaseToken) -> None:
        self._dispatch_open = True
        self._enqueue(RESYNC_ALL)  # a new leader re-observes everything
        self._spawn_workers()

    def _on_lose(self) -> set[asyncio.Task[None]]:
        """Stop dispatching and cancel every reconcile; the ones still running are returned."""
        self._dispatch_open = False
        self._wake_all(self._space)  # a follower's triggers never wait for room
        workers, self._workers = self._workers, {}
        self._cancel(workers)
        return {task for task in self._running.values() if not task.done()}

    # -- small helpers -----------------------------------------------------------

    @staticmethod
    def _wake_one(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    @staticmethod
    def _wake_all(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def __repr__(self) -> str:
        s = self.stats()
        return f"<Loop {self._name} leader={s.is_leader} epoch={s.epoch} queued={s.queued}>"


def _forget(tasks: dict[asyncio.Task[None], None], task: asyncio.Task[None]) -> None:
    tasks.pop(task, None)


def _declared_ttl(elector: object) -> LeaseTTL:
    """The elector's declared lease TTL, coerced to :class:`LeaseTTL`, or a ConfigError."""
    if not isinstance(elector, ElectorWithTTL):
        raise ConfigError(
            f"leader {elector!r} does not declare its lease ttl (a `ttl` property: the "
            "ElectorWithTTL protocol); without it the Loop cannot step down before the lease "
            "expires for the other replicas"
        )
    ttl = elector.ttl
    if isinstance(ttl, LeaseTTL):
        return ttl
    try:
        return LeaseTTL(ttl)
    except ConfigError as exc:
        raise ConfigError(f"leader {elector!r} declares an invalid ttl: {exc}") from None
