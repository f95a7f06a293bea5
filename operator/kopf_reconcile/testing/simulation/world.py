"""Replicas, workload and nemesis of one simulated run.

A :class:`World` runs N replicas in one process on virtual time. Each replica
is what an operator process would be: two real :class:`~kopf_reconcile.Loop`
objects sharing one elector (an async reconciler that writes every entity
through its :class:`~kopf_reconcile.FencedWriter`, and a sync one run in
threads), fed by a "watch" that tells every replica of every change.

Every call a replica makes to a store passes through :meth:`Replica.io`, where
the seeded nemesis may delay it, fail it, hang it, lose its reply, send a lease
call twice, or put a write "on the wire": delivered later, even if the caller
has gone (cancelled, stepped down, crashed). Between calls the nemesis
pauses replicas (their calls wait; writes already waiting go out when they
resume, as a frozen process's would), crashes and restarts them (a crashed
replica does nothing more; its lease lapses), and deletes lease records (their
epoch counters are lost).

What the model leaves out, on purpose or by necessity: a paused replica's own
timers still fire (one event loop serves all replicas), so it may step down
during the pause rather than after; clocks are shared (the Loop reads only the
event loop's monotonic clock, so a wall-clock jump changes nothing it does).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Callable

import kopf_reconcile as kr
from kopf_reconcile.testing.simulation.stores import (
    FenceStore,
    LeaseStore,
    StoreElector,
    StoreRepository,
)

__all__ = ["Action", "Settings", "Span", "World"]

WRITER, SIDE = "writer", "side"  # the two reconcilers (and lease ids) of every replica
WRITE_TIMEOUT = 10.0  # a fenced write is bounded, as PostgresFencedRepository's write_timeout


@dataclasses.dataclass(frozen=True)
class Settings:
    replicas: int = 3
    entities: int = 6
    # Step-down after failed renewals leaves TTL/3 (2 s) of lease: more than a stubborn
    # reconcile's cleanup (1.5 s), so the Loop must wait for it, never release under it.
    ttl: float = 6.0
    renew: float = 1.0
    chaos: float = 40.0  # seconds of nemesis and changing desires
    settle: float = 30.0  # then this long healed, for convergence
    fault_rate: float = 0.08  # of store calls during the chaos
    shards: int = 1  # of the writer reconciler (>1: one lease and fencing scope per shard)


@dataclasses.dataclass(frozen=True)
class Action:
    """One thing the nemesis did (the schedule a failure prints)."""

    t: float
    what: str

    def __str__(self) -> str:
        return f"t={self.t:7.3f} {self.what}"


@dataclasses.dataclass
class Span:
    """A reconcile of ``entity`` by ``replica``'s ``reconciler``, from ``start`` to ``end``."""

    replica: str
    reconciler: str
    entity: str
    start: float
    end: float | None = None
    # The replica was paused meanwhile, or its lease record deleted under it: outside what
    # leases promise (docs/safety.md A1, "who must not edit what"); fencing still applies.
    exempt: bool = False


class Replica:
    """One simulated operator process."""

    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.name = name
        self.dead = False
        self.paused = False
        # Until then, its spans are exempt from the overlap check (see Span.exempt).
        self.exempt_until: dict[str, float] = {WRITER: 0.0, SIDE: 0.0}
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.spans: list[Span] = []
        self.queues: dict[str, asyncio.Queue[kr.Request]] = {
            WRITER: asyncio.Queue(),
            SIDE: asyncio.Queue(),
        }
        settings = world.settings
        self.elector = StoreElector(world.leases, name, settings.ttl, self.io)
        self.loops = {
            WRITER: self._loop(WRITER, self._write, self._repository()),
            SIDE: self._loop(SIDE, self._side, self._repository()),
        }

    def _repository(self) -> StoreRepository:
        return StoreRepository(self.world.fence, self.name, self.io, WRITE_TIMEOUT)

    def _loop(self, reconciler_id: str, reconcile: object, repo: StoreRepository) -> kr.Loop:
        builder = kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)  # type: ignore[arg-type]
        if reconciler_id == WRITER and self.world.settings.shards > 1:
            builder.with_shards(self.world.settings.shards)
        return (
            builder.with_trigger(kr.ChannelTrigger(self.queues[reconciler_id]))
            .with_reconciler_id(reconciler_id)
            .with_leader(self.elector)
            .with_fenced_repo(repo)
            .with_renew_interval(self.world.settings.renew)
            .with_backoff(0.05, 2.0)
            .with_stop_timeout(2.0)
            .with_name(f"{self.name}/{reconciler_id}")
            .with_random(random.Random(self.world.rng.random()))
            .build()
        )

    async def start(self) -> None:
        for reconciler_id, loop in self.loops.items():
            await loop.start()
            for entity in self.world.entities:  # the watch's initial listing
                self.queues[reconciler_id].put_nowait(kr.Request(entity))

    async def stop(self) -> None:
        await asyncio.gather(*(loop.stop() for loop in self.loops.values()))

    async def crash(self) -> None:
        """Die at once: nothing more runs, nothing is released (the leases lapse)."""
        self.dead = True
        now = self.world.clock()
        for span in self.spans:
            if span.end is None:
                span.end = now  # a dead process is inside nothing
        for loop in self.loops.values():
            stopping = asyncio.ensure_future(loop.stop())
            await asyncio.sleep(0)
            stopping.cancel()  # a cancelled stop abandons everything without releasing
            await asyncio.gather(stopping, return_exceptions=True)

    def pause(self) -> None:
        self.paused = True
        self._resumed.clear()
        for span in self.spans:
            if span.end is None:
                span.exempt = True

    def resume(self) -> None:
        """Go on; until its lease control plane notices, it acts on what it believed."""
        self.paused = False
        self._resumed.set()
        until = self.world.clock() + self.world.settings.ttl
        self.exempt_until = dict.fromkeys(self.exempt_until, until)

    def lost_record(self, reconciler_id: str) -> None:
        """Its lease record was deleted under it: another may lead before it can know."""
        reconciler_id = reconciler_id.partition("-shard-")[0]  # a shard's: its reconciler's
        for span in self.spans:
            if span.end is None and span.reconciler == reconciler_id:
                span.exempt = True
        self.exempt_until[reconciler_id] = self.world.clock() + self.world.settings.ttl

    # -- the I/O boundary: every store call --------------------------------------------------

    async def io(self, operation: str, effect: Callable[[], object]) -> object:
        nemesis = self.world.nemesis
        if self.dead:
            await asyncio.Event().wait()  # a dead process sends nothing
        if self.paused:
            if operation == "write":  # frozen mid-write: it goes out on resume, whatever
                return await asyncio.shield(self._deliver_on_resume(effect))
            await self._resumed.wait()
        fault = nemesis.fault(operation)
        if fault == "fail":
            raise ConnectionError(f"{operation} failed (nemesis)")
        if fault == "hang":
            await asyncio.Event().wait()
        if fault == "delay":
            await asyncio.sleep(nemesis.delay())
        if fault == "in flight":
            delivery = asyncio.ensure_future(self._deliver_later(effect, nemesis.delay()))
            self.world.deliveries.add(delivery)
            delivery.add_done_callback(self.world.deliveries.discard)
            return await asyncio.shield(delivery)
        if fault == "duplicate":
            with contextlib.suppress(Exception):  # the first copy's answer is lost
                effect()
        result = effect()
        if fault == "lost reply":
            raise ConnectionError(f"the reply to {operation} was lost (nemesis)")
        return result

    async def _deliver_on_resume(self, effect: Callable[[], object]) -> object:
        await self._resumed.wait()
        return effect()

    @staticmethod
    async def _deliver_later(effect: Callable[[], object], delay: float) -> object:
        await asyncio.sleep(delay)
        return effect()

    # -- the workload ----------------------------------------------------------------------------

    async def _write(self, req: kr.Request) -> None:
        world = self.world
        if req.entity_id == "":  # a new leader's resync: the watch's cache, again
            for entity in world.entities:
                await self.queues[WRITER].put(kr.Request(entity))
            return
        span = self._enter(WRITER, req.entity_id)
        try:
            version, value = world.desired[req.entity_id]
            await world.behave(req.entity_id)
            writer = kr.fenced_writer()
            assert writer is not None
            await writer.write(req.entity_id, {"version": version, "value": value})
        finally:
            span.end = world.clock() if span.end is None else span.end

    def _side(self, req: kr.Request) -> None:
        """A sync reconciler (in a thread): only its spans matter."""
        if req.entity_id == "":
            return
        span = self._enter(SIDE, req.entity_id)
        span.end = span.start  # a thread's work is instant on virtual time

    def _enter(self, reconciler: str, entity: str) -> Span:
        now = self.world.clock()
        exempt = self.paused or now < self.exempt_until[reconciler]
        span = Span(self.name, reconciler, entity, now, exempt=exempt)
        self.spans.append(span)
        return span


class Nemesis:
    """Seeded choices of faults at the I/O boundary, and the schedule of replica events."""

    def __init__(self, rng: random.Random, rate: float) -> None:
        self.rng = rng
        self.rate = rate
        self.active = True

    def fault(self, operation: str) -> str | None:
        if not self.active or self.rng.random() >= self.rate:
            return None
        kinds = ["delay", "fail", "lost reply", "hang"]
        if operation == "write":
            # Delivered late, even if its caller has gone. Never twice: PostgreSQL does
            # not run one statement twice (lease calls are duplicated instead).
            kinds += ["in flight", "in flight"]
        else:
            kinds.append("duplicate")
        return self.rng.choice(kinds)

    def delay(self) -> float:
        return self.rng.choice([0.01, 0.1, 0.5, 1.0, 2.5, 5.0])


class World:
    """The stores, the replicas, the desired state, and the run's schedule."""

    def __init__(self, seed: int, settings: Settings) -> None:
        self.seed = seed
        self.settings = settings
        self.rng = random.Random(seed)
        loop = asyncio.get_running_loop()
        self.clock = loop.time
        self.leases = LeaseStore(self.clock)
        self.fence = FenceStore(self.clock)
        self.nemesis = Nemesis(random.Random(self.rng.random()), settings.fault_rate)
        self.entities = [f"e{i}" for i in range(settings.entities)]
        self.desired: dict[str, tuple[int, int]] = {e: (0, 0) for e in self.entities}
        profiles = ["fast", "slow", "failing", "stubborn"]
        self.profiles = {e: self.rng.choice(profiles) for e in self.entities}
        self.deliveries: set[asyncio.Future[object]] = set()  # writes still on the wire
        self.replicas: list[Replica] = []
        self.retired: list[Replica] = []
        self.schedule: list[Action] = []
        self._generation = 0

    def note(self, what: str) -> None:
        self.schedule.append(Action(self.clock(), what))

    async def behave(self, entity: str) -> None:
        """What reconciling ``entity`` costs: slow, failing, or slow to honour cancellation."""
        profile = self.profiles[entity]
        if profile == "slow":
            await asyncio.sleep(self.rng.choice([0.1, 0.5, 1.5]))
        elif profile == "failing" and self.rng.random() < 0.3:
            if self.rng.random() < 0.5:
                raise RuntimeError(f"reconciling {entity} failed (workload)")
            # What a task group in user code raises: not an Exception.
            raise BaseExceptionGroup(f"reconciling {entity} failed", [GeneratorExit()])
        elif profile == "stubborn":
            try:
                await asyncio.sleep(self.rng.choice([0.2, 1.0]))
            except asyncio.CancelledError:
                end = self.clock() + 1.5  # its cleanup ignores cancellation for a while
                while self.clock() < end:
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.sleep(end - self.clock())
                raise

    def spawn(self) -> Replica:
        self._generation += 1
        replica = Replica(self, f"r{self._generation}")
        self.replicas.append(replica)
        return replica

    def change(self, entity: str) -> None:
        version, _ = self.desired[entity]
        self.desired[entity] = (version + 1, self.rng.randrange(1000))
        for replica in self.replicas:
            if not replica.dead:
                for queue in replica.queues.values():
                    queue.put_nowait(kr.Request(entity))

    async def run(self) -> None:
        for _ in range(self.settings.replicas):
            await self.spawn().start()
        try:
            await self._chaos()
            await self._heal()
            await asyncio.sleep(self.settings.settle)
        finally:
            await asyncio.gather(*(replica.stop() for replica in self.replicas if not replica.dead))

    async def _chaos(self) -> None:
        rng = self.rng
        end = self.clock() + self.settings.chaos
        while self.clock() < end:
            await asyncio.sleep(rng.expovariate(2.0))
            roll = rng.random()
            live = [r for r in self.replicas if not r.dead]
            if roll < 0.55:
                self.change(rng.choice(self.entities))
            elif roll < 0.70 and live:
                replica = rng.choice(live)
                duration = rng.choice([0.5, 2.0, 4.0, 8.0])
                self.note(f"pause {replica.name} for {duration}s")
                replica.pause()
                asyncio.get_running_loop().call_later(duration, self._resume, replica)
            elif roll < 0.80 and live:
                replica = rng.choice(live)
                self.note(f"crash {replica.name}")
                self.replicas.remove(replica)
                self.retired.append(replica)
                await replica.crash()
                if len(self.replicas) < self.settings.replicas:
                    successor = self.spawn()
                    self.note(f"start {successor.name}")
                    await successor.start()
            elif roll < 0.85:
                reconciler_id = rng.choice([WRITER, SIDE])
                if reconciler_id == WRITER and self.settings.shards > 1:
                    reconciler_id = f"{WRITER}-shard-{rng.randrange(self.settings.shards)}"
                self.note(f"delete the lease record of {reconciler_id}")
                record = self.leases.records.get(reconciler_id)
                for replica in self.replicas:
                    if record is not None and replica.name == record.holder:
                        replica.lost_record(reconciler_id)
                self.leases.delete(reconciler_id)
            elif roll < 0.95 and live:
                replica = rng.choice(live)
                self.note(f"stop {replica.name} gracefully")
                self.replicas.remove(replica)
                self.retired.append(replica)
                await replica.stop()
                successor = self.spawn()
                self.note(f"start {successor.name}")
                await successor.start()

    def _resume(self, replica: Replica) -> None:
        if replica.paused:
            self.note(f"resume {replica.name}")
            replica.resume()

    async def _heal(self) -> None:
        self.note("heal: no more faults, pauses or changes")
        self.nemesis.active = False
        for replica in self.replicas:
            replica.resume()
