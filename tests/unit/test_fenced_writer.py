"""The sealed FencedWriter and how the Loop reacts to stale epochs."""

from __future__ import annotations

import asyncio

import pytest

import kopf_reconcile as kr
from kopf_reconcile.fencing.writer import ReconcileLease, reconcile_lease
from kopf_reconcile.testing.memory import (
    MemoryFencedRepository,
    MemoryLeaseElector,
    MemoryLeaseStore,
)
from support import eventually


def test_direct_construction_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot be constructed directly"):
        kr.FencedWriter()
    with pytest.raises(TypeError):
        kr.FencedWriter(repository=MemoryFencedRepository(), epoch=999)  # type: ignore[call-arg]


def test_no_writer_outside_a_reconcile() -> None:
    assert kr.fenced_writer() is None


async def test_no_writer_in_single_process_mode() -> None:
    seen: list[object] = []

    async def reconcile(req: kr.Request) -> None:
        seen.append(kr.fenced_writer())

    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .build()
    )
    async with loop:
        await loop.enqueue(kr.Request("a"))
        await eventually(lambda: len(seen) == 1)
    assert seen == [None]


def fenced_loop(
    reconcile: object, store: MemoryLeaseStore, repo: MemoryFencedRepository
) -> kr.Loop:
    return (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)  # type: ignore[arg-type]
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(MemoryLeaseElector(store, kr.LeaseTTL(5)))
        .with_fenced_repo(repo)
        .with_reconciler_id("devices")
        .with_renew_interval(0.05)
        .build()
    )


async def test_writer_carries_the_lease_epoch_and_writes() -> None:
    store, repo = MemoryLeaseStore(), MemoryFencedRepository()
    epochs: list[int] = []

    async def reconcile(req: kr.Request) -> None:
        writer = kr.fenced_writer()
        assert writer is not None
        epochs.append(writer.epoch)
        if req.entity_id:
            await writer.write(req.entity_id, {"desired": 1})

    loop = fenced_loop(reconcile, store, repo)
    async with loop:
        await loop.enqueue(kr.Request("dev-1"))
        await eventually(lambda: "dev-1" in repo.states)
        assert set(epochs) == {loop.stats().epoch}
    assert repo.applied == [("dev-1", epochs[0], {"desired": 1})]


async def test_writer_fails_fast_after_the_lease_is_lost() -> None:
    store, repo = MemoryLeaseStore(), MemoryFencedRepository()
    captured: list[kr.FencedWriter] = []

    async def reconcile(req: kr.Request) -> None:
        writer = kr.fenced_writer()
        assert writer is not None
        captured.append(writer)

    loop = fenced_loop(reconcile, store, repo)
    async with loop:
        await loop.enqueue(kr.Request("dev-1"))
        await eventually(lambda: bool(captured))
        store.expire("devices")
        await MemoryLeaseElector(store).acquire_lease("devices")
        await eventually(lambda: not loop.stats().is_leader)
        with pytest.raises(kr.StaleEpochError, match="no longer held"):
            await captured[0].write("dev-1", {"late": True})
    assert repo.applied == []  # refused before reaching the repository


async def test_stale_epoch_is_fenced_steps_down_and_converges_without_backoff() -> None:
    store, repo = MemoryLeaseStore(), MemoryFencedRepository()
    repo.last_epochs["dev-1"] = 3  # a newer leader has written with epoch 3
    outcomes: list[tuple[int, str]] = []
    registry = __import__("prometheus_client").CollectorRegistry()
    metrics = kr.register_metrics(registry)

    async def reconcile(req: kr.Request) -> None:
        writer = kr.fenced_writer()
        assert writer is not None
        if not req.entity_id:
            return
        try:
            await writer.write(req.entity_id, {"epoch": writer.epoch})
        except kr.StaleEpochError:
            outcomes.append((writer.epoch, "stale"))
            raise
        outcomes.append((writer.epoch, "accepted"))

    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(MemoryLeaseElector(store, kr.LeaseTTL(5)))
        .with_fenced_repo(repo)
        .with_reconciler_id("devices")
        .with_renew_interval(0.05)
        .with_metrics(metrics)
        .with_name("devices")
        .build()
    )
    async with loop:
        await loop.enqueue(kr.Request("dev-1"))
        await eventually(lambda: "accepted" in {o for _, o in outcomes}, timeout=10)
        assert loop._queue.work_queue.failures_of("dev-1") == 0  # no backoff growth
    stale_epochs = [e for e, o in outcomes if o == "stale"]
    accepted = [e for e, o in outcomes if o == "accepted"]
    assert stale_epochs == [1, 2] and accepted == [3]  # each fence made it step down
    assert repo.applied == [("dev-1", 3, {"epoch": 3})]
    fenced = registry.get_sample_value(
        "kopf_reconcile_reconcile_total", {"controller": "devices", "shard": "", "result": "fenced"}
    )
    writes = registry.get_sample_value(
        "kopf_reconcile_fenced_writes_total",
        {"controller": "devices", "shard": "", "outcome": "stale"},
    )
    assert fenced == 2 and writes == 2


async def test_every_reconcile_knows_the_lease_it_runs_under_term_after_term() -> None:
    """The lease a write outside the repository checks (a finalizer's removal)."""
    store, repo = MemoryLeaseStore(), MemoryFencedRepository()
    seen: list[tuple[str, ReconcileLease | None, bool]] = []

    async def reconcile(req: kr.Request) -> None:
        lease = reconcile_lease()
        seen.append((req.entity_id, lease, lease is not None and lease.is_live()))

    loop = fenced_loop(reconcile, store, repo)
    async with loop:
        await loop.enqueue(kr.Request("dev-1"))
        await eventually(lambda: any(e == "dev-1" for e, _, _ in seen))
        first = loop.stats().epoch
        store.expire("devices")
        other = MemoryLeaseElector(store)
        token = await other.acquire_lease("devices")
        await eventually(lambda: not loop.stats().is_leader)
        await other.release_lease(token)
        await eventually(lambda: loop.stats().is_leader)
        await loop.enqueue(kr.Request("dev-2"))
        await eventually(lambda: any(e == "dev-2" for e, _, _ in seen))
        second = loop.stats().epoch
    assert second > first
    leases = {entity: lease for entity, lease, _ in seen if entity}
    assert [lease.epoch for lease in leases.values() if lease] == [first, second]
    assert all(live for _, _, live in seen)  # live while each ran...
    assert not any(lease.is_live() for lease in leases.values() if lease)  # ...not after
    assert reconcile_lease() is None  # nor outside a reconcile
