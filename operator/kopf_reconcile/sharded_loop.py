"""A sharded reconciler: one Loop per shard, each leading its shard under a lease of its own.

``Builder(...).with_shards(N).build()`` (N > 1) returns a :class:`ShardedLoop`. Its
entities fall into N shards (:mod:`kopf_reconcile.sharding`); shard ``k`` is an
ordinary :class:`~kopf_reconcile.loop.Loop` whose reconciler id is
``<reconciler id>-shard-<k>``: its own lease (and epoch), its own fencing scope
(the repository's :meth:`~kopf_reconcile.fencing.protocol.ShardableRepository.for_shard`),
its own queue and workers. Everything the Loop guarantees for one reconciler — one
dispatching holder, step-down before the lease can expire elsewhere, a lease never
released while a reconcile it guards runs, the scope-wide fence recorded before
leading, the resync-all of a new holder — therefore holds per shard, unchanged.

What this module adds:

* **routing**: the triggers belong to the ShardedLoop; each request goes to the
  Loop of its entity's shard (a resync-all request to every shard). Followers of a
  shard keep queuing its ids, as a follower Loop does.
* **a writer fenced per shard**: a reconcile's writer writes only entities of its
  shard (anything else is a :class:`~kopf_reconcile.PermanentError`): an entity is
  fenced in its own shard's scope only, never in two
  (:class:`~kopf_reconcile.shard_fence.ShardFence`, each shard Loop's repository).
* **one shard layout per scope**: before a shard first leads, the base scope records
  the layout (``record_shard_count``); an unsharded leader of the scope, or one
  with another count, is refused (a :class:`~kopf_reconcile.ConfigError`), and so is
  this one when the scope says otherwise. Every shard's epoch recording verifies the
  layout again, atomically (the repository's ``record_epoch``), so once
  ``kopf-reconcile reshard`` changes it, a replica of the old layout never starts
  leading a shard again. A replica refused for its layout (a
  :class:`~kopf_reconcile.fencing.protocol.ShardLayoutError`) logs the error, leads
  nothing, and tries again with capped exponential backoff (from the retry period up
  to a minute): a replica of the new layout started before the reshard leads once it
  commits; one of the old layout keeps being refused, without thrashing.
* **balance** (:mod:`kopf_reconcile.control.balance`): each replica holds one
  membership lease and aims at ``ceil(N / live replicas)`` shards; it acquires a
  shard only below that, and hands one off when another replica is short: that
  shard's dispatch stops, its reconciles in flight end (up to a grace, then they are
  cancelled), then its lease is released, never before; the next holder resyncs the
  shard. One hand-off per balance period, and a shard handed off is not taken back
  by the same replica for a cooldown. Without a store that lists its leases
  (:class:`~kopf_reconcile.leader.protocol.LeaseLister`), a replica takes every
  shard it can (no balance, same safety).

``concurrency`` is per shard: a replica leading ``m`` shards runs up to ``m *
concurrency`` reconciles at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import logging

from kopf_reconcile.api import ConfigError, Request, seconds
from kopf_reconcile.config import LoopConfig
from kopf_reconcile.control.balance import balance, member_id, view_from_records
from kopf_reconcile.control.layout_wait import LayoutRefused
from kopf_reconcile.fencing.protocol import (
    LoopBoundRepository,
    ShardableRepository,
    ShardLayoutError,
)
from kopf_reconcile.leader.protocol import LeaseContended, LeaseLister, LeaseLost, LeaseToken
from kopf_reconcile.loop import Loop, LoopStats
from kopf_reconcile.shard_fence import ShardFence
from kopf_reconcile.sharding import ShardAssignment, shard_id
from kopf_reconcile.triggers import Emitter, supervise

__all__ = ["ShardedLoop"]

logger = logging.getLogger("kopf_reconcile.loop")

HANDOFF_COOLDOWN_TTLS = 2.0  # a shard handed off is not taken back by the same replica for this
HANDOFF_SPACING_TTLS = 1.0  # at most one hand-off per this many TTLs (the view catches up)
LIST_FAILURES_BEFORE_GREEDY = 3  # listings failed in a row, never one seen: take what is free


class ShardedLoop(Loop):
    """N shard Loops behind the surface of one Loop. Build it with ``Builder.with_shards``."""

    def __init__(self, config: LoopConfig, *, shards: int, by_namespace: bool = False) -> None:
        super().__init__(config)
        self._assignment = ShardAssignment(shards, by_namespace)
        if shards < 2:
            raise ConfigError(f"a ShardedLoop needs shards >= 2, got {shards!r}")
        if config.leader is None:
            raise ConfigError(
                f"shards={shards} requires with_leader(): each shard is led under a lease of "
                "its own; without a leader one process reconciles everything"
            )
        repo = config.fenced_repo
        if repo is not None and not isinstance(repo, ShardableRepository):
            raise ConfigError(
                f"fenced repo {repo!r} cannot fence shards (for_shard, record_shard_count: "
                "the ShardableRepository protocol): each shard's epochs need a fencing "
                "scope of their own"
            )
        self._timing = config.lease_timing()
        self._claimed = False
        self._claim_lock = asyncio.Lock()
        self._target = 0
        self._view_known = False
        self._cooldown: dict[int, float] = {}
        self._reserved: dict[int, float] = {}
        self._next_handoff = 0.0
        self._list_failures = 0
        self._member: LeaseToken | None = None
        self._me = "\0this replica"  # this replica's holder id, once a lease tells it
        self._holders: dict[int, str] = {}  # shard -> its holder, as last listed
        self._member_ok = 0.0
        self._balance_task: asyncio.Task[None] | None = None
        self._handoffs: set[asyncio.Task[None]] = set()
        self._shard_loops: list[Loop] = []
        for k in range(shards):
            sub = dataclasses.replace(
                config,
                triggers=[],
                name=f"{self.name}-shard-{k}",
                reconciler_id=shard_id(self.reconciler_id, k),
                shard_of=self.reconciler_id,
                metric_labels=(self.reconciler_id, str(k)),
                fenced_repo=None if repo is None else ShardFence(self, repo, k),
            )
            sub.validate()
            self._shard_loops.append(Loop(sub, may_acquire=functools.partial(self._may_lead, k)))

    # -- public surface --------------------------------------------------------

    @property
    def shards(self) -> int:
        return self._assignment.shards

    @property
    def assignment(self) -> ShardAssignment:
        return self._assignment

    def shard_of(self, entity_id: str) -> int:
        return self._assignment.shard_of(entity_id)

    def held_shards(self) -> list[int]:
        """The shards this replica leads now."""
        return [
            k
            for k, loop in enumerate(self._shard_loops)
            if loop._holder is not None and loop._holder.leading
        ]

    def shard_stats(self) -> dict[int, LoopStats]:
        return {k: loop.stats() for k, loop in enumerate(self._shard_loops)}

    def stats(self) -> LoopStats:
        """Sums over the shards; ``is_leader`` when any is led, ``epoch`` the highest led."""
        each = [loop.stats() for loop in self._shard_loops]
        led = [s.epoch for s in each if s.is_leader]
        return LoopStats(
            queued=sum(s.queued for s in each),
            in_flight=sum(s.in_flight for s in each),
            dead_letters=sum(s.dead_letters for s in each),
            is_leader=bool(led),
            epoch=max(led, default=0),
        )

    async def start(self) -> None:
        if self._started:
            raise RuntimeError(f"loop {self.name!r} was already started")
        cfg = self._config
        if isinstance(cfg.fenced_repo, LoopBoundRepository):
            cfg.fenced_repo.bind_loop(reconciler_id=self.reconciler_id, tenancy=cfg.tenancy)
        started: list[Loop] = []
        try:
            for loop in self._shard_loops:
                await loop.start()
                started.append(loop)
        except BaseException:
            await asyncio.gather(*(loop.stop(timeout=0) for loop in started))
            raise
        self._started = True
        self._balance_task = asyncio.create_task(
            self._balance(), name=f"{self.name}: shard balance"
        )
        emitter = Emitter(self._route, self._route_resync)
        self._trigger_tasks = [
            asyncio.create_task(
                supervise(trigger, emitter, controller=self.name),
                name=f"{self.name}: trigger {trigger!r}",
            )
            for trigger in cfg.triggers
        ]
        logger.info(
            "loop %s started with %d shards (reconciler id %s)",
            self.name,
            self.shards,
            self.reconciler_id,
            extra={"controller": self.name},
        )

    async def stop(self, timeout: float | None = None) -> None:
        if not self._started or self._stopped:
            return
        limit = self._config.stop_timeout if timeout is None else seconds("timeout", timeout)
        self._stopping = True
        try:
            for task in self._trigger_tasks:
                task.cancel()
            await asyncio.gather(*self._trigger_tasks, return_exceptions=True)
            if self._balance_task is not None:
                self._balance_task.cancel()
                await asyncio.gather(self._balance_task, return_exceptions=True)
            # A hand-off in progress ends in its shard Loop's own stop (which waits as it must).
            for task in self._handoffs:
                task.cancel()
            await asyncio.gather(*self._handoffs, return_exceptions=True)
            await asyncio.gather(*(loop.stop(limit) for loop in self._shard_loops))
        except asyncio.CancelledError:
            # As a Loop whose stop() is cancelled: everything stops at once, and the leases
            # (shards and membership) lapse after their TTL instead of being released.
            for task in [*self._trigger_tasks, *self._handoffs]:
                task.cancel()
            if self._balance_task is not None:
                self._balance_task.cancel()
            for loop in self._shard_loops:
                if not loop._stopped:
                    loop._abandon()
            self._member = None
            self._stopped = True
            raise
        await self._leave()
        self._stopped = True
        logger.info("loop %s stopped", self.name, extra={"controller": self.name})

    async def enqueue(self, request: Request) -> None:
        if not self._started or self._stopped:
            raise RuntimeError(f"loop {self.name!r} is not running")
        await self._route(request)

    # -- routing ---------------------------------------------------------------

    async def _route(self, request: Request) -> None:
        await self._deliver(request, resync=False)

    async def _route_resync(self, request: Request) -> None:
        await self._deliver(request, resync=True)

    async def _deliver(self, request: Request, *, resync: bool) -> None:
        if type(request) is not Request or type(request.entity_id) is not str:
            raise TypeError(
                f"a trigger of loop {self.name!r} emitted {request!r}; "
                "expected kopf_reconcile.Request(entity_id: str)"
            )
        targets = (
            self._shard_loops
            if not request.entity_id  # a resync-all: every shard re-observes its own
            else [self._shard_loops[self._assignment.shard_of(request.entity_id)]]
        )
        for loop in targets:
            await (loop._emit_resync if resync else loop._emit)(request)

    # -- the shard count, recorded once per scope ---------------------------------

    async def _claim_shard_count(self) -> None:
        """Record the layout in the base scope, once (a :class:`ShardLayoutError` when it is
        refused: the caller turns it into :meth:`_layout_refused`)."""
        if self._claimed:
            return
        repo = self._config.fenced_repo
        assert isinstance(repo, ShardableRepository)
        async with self._claim_lock:
            if self._claimed:
                return
            if not self._layout_wait.open():
                raise LayoutRefused("the shard layout was refused; waiting to try again")
            await repo.record_shard_count(self.shards, by_namespace=self._assignment.by_namespace)
            self._claimed = True

    def _layout_refused(self, exc: ShardLayoutError) -> LayoutRefused:
        """Lead no shard for a while (backoff), log why once per wait; what to raise."""
        self._claimed = False  # the layout is claimed (and checked) again next time
        return self._layout_wait.refused(exc)

    def _layout_accepted(self) -> None:
        self._layout_wait.accepted()

    @property
    def _layout_backoff(self) -> float:
        """Seconds waited between attempts refused for the layout; 0 when not refused."""
        return self._layout_wait.backoff

    # -- balance -----------------------------------------------------------------

    def _may_lead(self, shard: int) -> bool:
        """Asked by shard ``shard``'s control plane before each acquire attempt."""
        if self._stopping or not self._view_known:
            return False
        now = asyncio.get_running_loop().time()
        if self._cooldown.get(shard, 0.0) > now or not self._layout_wait.open():
            return False
        holder = self._holders.get(shard)
        if holder is not None and holder != self._me:
            return False  # held elsewhere (as last listed): try the free ones first
        self._reserved.pop(shard, None)
        busy = set(self.held_shards())
        busy.update(k for k, until in self._reserved.items() if until > now)
        if len(busy) >= self._target:
            return False
        # Counted until this attempt ends (bounded by the renew deadline).
        self._reserved[shard] = now + self._timing.renew_deadline
        return True

    async def _balance(self) -> None:
        period = self._timing.retry_period
        while True:
            try:
                if self._layout_backoff > 0:
                    # Refused for its layout: this replica takes no share of the shards
                    # away from the others (its membership would count as live).
                    await self._leave()
                else:
                    await self._keep_membership()
                await self._rebalance()
            except Exception as exc:  # balance is best effort; safety is the shards' leases
                logger.warning(
                    "loop %s: shard balance failed: %r",
                    self.name,
                    exc,
                    extra={"controller": self.name},
                )
            await asyncio.sleep(period * self._config.rng.uniform(1.0, 1.2))

    async def _keep_membership(self) -> None:
        elector = self._config.leader
        assert elector is not None
        clock = asyncio.get_running_loop().time
        deadline = self._timing.renew_deadline
        if self._member is not None:
            sent = clock()
            try:
                async with asyncio.timeout(deadline):
                    await elector.renew_lease(self._member)
            except LeaseLost:
                self._member = None
            except Exception as exc:
                logger.debug("loop %s: renewing membership failed: %r", self.name, exc)
                if clock() - self._member_ok > deadline:
                    self._member = None  # it lapses by itself
            else:
                self._member_ok = sent
            if self._member is not None:
                return
        for slot in range(self.shards):
            sent = clock()
            try:
                async with asyncio.timeout(deadline):
                    token = await elector.acquire_lease(member_id(self.reconciler_id, slot))
            except LeaseContended:
                continue
            except Exception as exc:
                logger.debug("loop %s: joining as a member failed: %r", self.name, exc)
                return
            self._member, self._member_ok = token, sent
            return

    async def _rebalance(self) -> None:
        elector = self._config.leader
        if not isinstance(elector, LeaseLister):
            self._target, self._view_known = self.shards, True  # no view: take what is free
            return
        try:
            async with asyncio.timeout(self._timing.renew_deadline):
                records = await elector.list_leases()
        except Exception:
            self._list_failures += 1
            if not self._view_known and self._list_failures >= LIST_FAILURES_BEFORE_GREEDY:
                # Never seen the store's leases: lead what is free rather than nothing
                # (balance is lost, safety is not: it is each shard lease's own).
                self._target, self._view_known = self.shards, True
            raise
        self._list_failures = 0
        if self._member is not None:
            self._me = self._member.holder_id
        view = view_from_records(
            records,
            reconciler_id=self.reconciler_id,
            shards=self.shards,
            me=self._me,
            now=datetime.datetime.now(datetime.UTC),
            shard_ids={loop.reconciler_id: k for k, loop in enumerate(self._shard_loops)},
            member_stale_after=self._timing.renew_deadline,
        )
        decision = balance(view, self.held_shards())
        self._holders = dict(view.holders)
        self._target, self._view_known = decision.target, True
        now = asyncio.get_running_loop().time()
        shard = decision.give_up
        if shard is None or now < self._next_handoff or self._stopping:
            return
        ttl = self._timing.ttl
        self._next_handoff = now + HANDOFF_SPACING_TTLS * ttl
        self._cooldown[shard] = now + HANDOFF_COOLDOWN_TTLS * ttl
        logger.info(
            "loop %s hands shard %d off (holds %d, aims at %d of %d shards, %d live replicas)",
            self.name,
            shard,
            len(self.held_shards()),
            decision.target,
            self.shards,
            view.live(),
            extra={"controller": self.name},
        )
        task = asyncio.create_task(
            self._shard_loops[shard].hand_off(grace=ttl),
            name=f"{self.name}: hand shard {shard} off",
        )
        self._handoffs.add(task)
        task.add_done_callback(self._handoffs.discard)

    async def _leave(self) -> None:
        token, self._member = self._member, None
        elector = self._config.leader
        if token is None or elector is None:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._timing.renew_deadline):
                await elector.release_lease(token)

    def stand_aside(self, reason: str, seconds: float) -> None:
        """Every shard's Loop stands aside (see :meth:`Loop.stand_aside`)."""
        for loop in self._shard_loops:
            loop.stand_aside(reason, seconds)

    def __repr__(self) -> str:
        return (
            f"<ShardedLoop {self.name} shards={self.shards} held={self.held_shards()} "
            f"target={self._target}>"
        )
