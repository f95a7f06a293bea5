"""Sharded leadership on a real PostgreSQL: several replicas in one process, real leases.

Each replica is a ShardedLoop with its own PostgresLeaseElector (its own holder id)
and its own PostgresFencedRepository on one database; every replica's trigger sees
every entity (as every replica's watch sees every object). The reconciler is
instrumented: it records which replica is inside which entity, and fails the test
if two replicas are ever inside one entity at once; it writes through its fenced
writer.

- The shards split between the replicas, each led under its own lease
  (``<id>-shard-<k>``) and fenced in its own scope; every entity is reconciled by the
  holder of its shard only.
- A replica that joins gets its share: the others hand shards off (stop, drain,
  release), with no entity inside two replicas at once.
- A replica that dies (its stop cancelled: leases lapse) loses only its shards; the
  others take them after the TTL at higher epochs, and a write at the dead holder's
  epoch is rejected by the shard's scope, for an entity the new holder never wrote too.
- A reconcile writes only entities of its own shard.
- A shard count is recorded in the base scope: another count, or an unsharded leader,
  is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

import kopf_reconcile as kr
from conftest import LeaseBackend
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.sharded_loop import ShardedLoop
from kopf_reconcile.sharding import ShardAssignment
from support import eventually

RID = "devices"
TTL = 1.0
ENTITIES = [f"ns-{i % 5}/dev-{i}" for i in range(60)]


@dataclasses.dataclass
class Replica:
    name: str
    loop: ShardedLoop
    elector: Any
    repo: PostgresFencedRepository
    feed: asyncio.Queue[kr.Request]


class Fleet:
    """Replicas of one sharded reconciler, and the instrumented reconciler they share."""

    def __init__(self, dsn: str, shards: int, backend: LeaseBackend | None = None) -> None:
        self.dsn = dsn
        self.shards = shards
        self.backend = backend  # None: PostgreSQL lease rows made (and closed) here
        self.replicas: list[Replica] = []
        self.inside: dict[str, str] = {}  # entity -> replica inside it now
        self.overlaps: list[tuple[str, str, str]] = []
        self.reconciled: dict[str, set[str]] = {}  # replica -> entities it reconciled
        self.writers: dict[str, kr.FencedWriter] = {}  # replica -> last writer it used
        self.foreign: str | None = None  # an entity to write besides the one reconciled

    def reconciler(self, name: str) -> object:
        async def reconcile(req: kr.Request) -> kr.Result:
            entity = req.entity_id
            if not entity:
                return kr.Result()
            other = self.inside.get(entity)
            if other is not None:
                self.overlaps.append((entity, other, name))
            self.inside[entity] = name
            try:
                await asyncio.sleep(0.005)
                writer = kr.fenced_writer()
                assert writer is not None
                self.writers[name] = writer
                await writer.write(entity, {"by": name, "epoch": writer.epoch})
                if self.foreign is not None:
                    await writer.write(self.foreign, {"by": name, "epoch": writer.epoch})
                self.reconciled.setdefault(name, set()).add(entity)
            finally:
                if self.inside.get(entity) == name:
                    del self.inside[entity]
            return kr.Result()

        return reconcile

    async def add(self, name: str) -> Replica:
        elector: Any = (
            PostgresLeaseElector(self.dsn, ttl=TTL, holder_id=name)
            if self.backend is None
            else self.backend.make(ttl=TTL, holder_id=name)
        )
        repo = PostgresFencedRepository(self.dsn)
        feed: asyncio.Queue[kr.Request] = asyncio.Queue()
        loop = (
            kr.Builder(self.reconciler(name), kr.Tenancy.TENANT_SCOPED)  # type: ignore[arg-type]
            .with_trigger(kr.ChannelTrigger(feed))
            .with_leader(elector)
            .with_fenced_repo(repo)
            .with_reconciler_id(RID)
            .with_renew_interval(0.1)
            .with_concurrency(4)
            .with_stop_timeout(2)
            .with_shards(self.shards)
            .build()
        )
        assert isinstance(loop, ShardedLoop)
        replica = Replica(name, loop, elector, repo, feed)
        self.replicas.append(replica)
        await loop.start()
        for entity in ENTITIES:
            feed.put_nowait(kr.Request(entity))
        return replica

    def trigger_all(self) -> None:
        for replica in self.replicas:
            for entity in ENTITIES:
                replica.feed.put_nowait(kr.Request(entity))

    def held(self) -> dict[str, list[int]]:
        return {r.name: r.loop.held_shards() for r in self.replicas if not r.loop._stopped}

    def all_shards_held_once(self) -> bool:
        taken = [k for shards in self.held().values() for k in shards]
        return sorted(taken) == list(range(self.shards))

    async def close(self) -> None:
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                await replica.loop.stop(timeout=1)
            await replica.repo.close()
            if self.backend is None:  # the backend closes the electors it made
                await replica.elector.close()


@pytest_asyncio.fixture
async def fleet(dsn: str) -> AsyncIterator[Fleet]:
    """Replicas on PostgreSQL lease rows."""
    made = Fleet(dsn, shards=6)
    try:
        yield made
    finally:
        await made.close()


@pytest_asyncio.fixture
async def any_fleet(dsn: str, lease_backend: LeaseBackend) -> AsyncIterator[Fleet]:
    """Replicas on every lease backend: PostgreSQL rows, Kubernetes Leases on both tiers."""
    made = Fleet(dsn, shards=6, backend=lease_backend)
    try:
        yield made
    finally:
        await made.close()


def shard_of(entity: str, shards: int = 6) -> int:
    return ShardAssignment(shards).shard_of(entity)


async def written_by(dsn: str, shards: int) -> dict[str, tuple[str, int]]:
    """entity -> (replica, epoch) of its last accepted write, read from each shard's scope."""
    found: dict[str, tuple[str, int]] = {}
    for k in range(shards):
        async with PostgresFencedRepository(dsn, scope=f"{RID}-shard-{k}") as repo:
            for entity in ENTITIES:
                state = await repo.get_state(entity)
                if state is not None:
                    assert shard_of(entity, shards) == k, (entity, k)  # in its own scope only
                    found[entity] = (state["by"], state["epoch"])
    return found


async def test_shards_split_between_replicas_and_each_entity_is_reconciled_by_its_holder(
    any_fleet: Fleet,
) -> None:
    fleet = any_fleet
    for name in ("a", "b", "c"):
        await fleet.add(name)
    await eventually(
        lambda: (
            fleet.all_shards_held_once()
            and all(len(shards) == 2 for shards in fleet.held().values())
        ),
        timeout=30,
        message=f"fair shares: {fleet.held()}",
    )
    fleet.trigger_all()
    held = fleet.held()
    owner = {k: name for name, shards in held.items() for k in shards}

    async def all_written() -> bool:
        found = await written_by(fleet.dsn, 6)
        return all(
            entity in found and found[entity][0] == owner[shard_of(entity)] for entity in ENTITIES
        )

    await eventually(all_written, timeout=20, message="every entity written by its shard's holder")
    assert fleet.overlaps == []
    # Each replica reconciled entities of its shards only, since the shares settled.
    for replica in fleet.replicas:
        stats = replica.loop.shard_stats()
        for k in held[replica.name]:
            assert stats[k].is_leader and stats[k].epoch >= 1


async def test_a_joining_replica_gets_its_share_without_overlap(fleet: Fleet) -> None:
    await fleet.add("a")
    await eventually(lambda: len(fleet.held()["a"]) == 6, timeout=20, message="a leads all")
    await fleet.add("b")
    feeding = asyncio.create_task(feed_forever(fleet))
    try:
        await eventually(
            lambda: (
                fleet.all_shards_held_once()
                and sorted(len(s) for s in fleet.held().values()) == [3, 3]
            ),
            timeout=30,
            message=f"shares after b joined: {fleet.held()}",
        )
        await asyncio.sleep(1.0)  # and it stays put: no thrashing
        assert sorted(len(s) for s in fleet.held().values()) == [3, 3]
    finally:
        feeding.cancel()
    assert fleet.overlaps == []
    assert fleet.reconciled.get("b"), "b reconciled the shards it took over"


async def feed_forever(fleet: Fleet) -> None:
    while True:
        fleet.trigger_all()
        await asyncio.sleep(0.05)


async def test_a_dead_replica_loses_only_its_shards_and_its_writes_are_fenced(
    any_fleet: Fleet,
) -> None:
    fleet = any_fleet
    for name in ("a", "b", "c"):
        await fleet.add(name)
    await eventually(
        lambda: (
            fleet.all_shards_held_once()
            and all(len(shards) == 2 for shards in fleet.held().values())
        ),
        timeout=30,
        message=f"fair shares: {fleet.held()}",
    )
    fleet.trigger_all()
    dead = fleet.replicas[2]
    await eventually(lambda: dead.name in fleet.writers, timeout=10, message="c wrote")
    before = {r.name: set(r.loop.held_shards()) for r in fleet.replicas}
    epochs = {k: s.epoch for k, s in dead.loop.shard_stats().items() if s.is_leader}
    # c dies: its stop is cancelled at once, its leases lapse after their TTL.
    stopping = asyncio.create_task(dead.loop.stop())
    await asyncio.sleep(0)
    stopping.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await stopping
    feeding = asyncio.create_task(feed_forever(fleet))
    try:
        await eventually(
            fleet.all_shards_held_once, timeout=30, message=f"takeover: {fleet.held()}"
        )
    finally:
        feeding.cancel()
    after = fleet.held()
    for name in ("a", "b"):
        assert before[name] <= set(after[name]), "survivors kept their own shards"
    for k, old in epochs.items():
        holder = next(r for r in fleet.replicas[:2] if k in r.loop.held_shards())
        assert holder.loop.shard_stats()[k].epoch > old
        # The dead holder's epoch is rejected in the shard's scope, even for an entity
        # the new holder has not written.
        async with PostgresFencedRepository(fleet.dsn, scope=f"{RID}-shard-{k}") as repo:
            entity = next(e for e in ENTITIES if shard_of(e) == k)
            assert await repo.apply_fenced(entity, old, {"by": "zombie"}) is False
            assert await repo.apply_fenced(f"ns-0/never-{k}", old, {"by": "zombie"}) is False
    # Its writer is refused too (locally first: its lease is gone).
    with pytest.raises(kr.StaleEpochError):
        await fleet.writers[dead.name].write(ENTITIES[0], {"by": "zombie"})
    assert fleet.overlaps == []


async def test_a_reconcile_writes_only_entities_of_its_own_shard(fleet: Fleet) -> None:
    foreign = ENTITIES[0]
    fleet.foreign = foreign
    replica = await fleet.add("a")
    await eventually(lambda: len(fleet.held()["a"]) == 6, timeout=20, message="a leads all")
    other = next(e for e in ENTITIES if shard_of(e) != shard_of(foreign))
    await eventually(
        lambda: replica.loop.stats().dead_letters > 0, timeout=10, message="dead-lettered"
    )
    found = await written_by(fleet.dsn, 6)
    assert found[other] == ("a", found[other][1])  # its own entity was written first
    assert all(state[0] == "a" for state in found.values())  # never {"by": "a"} in a foreign scope


async def test_another_shard_count_or_an_unsharded_leader_is_refused(dsn: str) -> None:
    async with PostgresFencedRepository(dsn) as repo:
        repo.bind_loop(reconciler_id=RID, tenancy=kr.Tenancy.SINGLE_TENANT)
        await repo.record_shard_count(4)
        await repo.record_shard_count(4)  # the same count again: fine
        with pytest.raises(kr.ConfigError, match="shards=4"):
            await repo.record_shard_count(8)
        with pytest.raises(kr.ConfigError, match="shards=4"):
            await repo.record_shard_count(4, by_namespace=True)  # another assignment
        with pytest.raises(kr.ConfigError, match="shards=4"):
            await repo.record_epoch(1, "unsharded-leader")
    async with PostgresFencedRepository(dsn) as repo:
        repo.bind_loop(reconciler_id="led-unsharded", tenancy=kr.Tenancy.SINGLE_TENANT)
        await repo.record_epoch(3, "old-leader")
        with pytest.raises(kr.ConfigError, match="led-unsharded"):
            await repo.record_shard_count(2)


async def test_a_sharded_replica_never_leads_a_scope_led_unsharded(fleet: Fleet) -> None:
    async with PostgresFencedRepository(fleet.dsn) as repo:
        repo.bind_loop(reconciler_id=RID, tenancy=kr.Tenancy.TENANT_SCOPED)
        await repo.record_epoch(5, "an-unsharded-leader")
    replica = await fleet.add("a")
    await asyncio.sleep(2.0)
    assert replica.loop.held_shards() == []
    assert fleet.reconciled == {}
