"""Durable dead letters on a real PostgreSQL: fenced, cleared on success, redriven, kept
across a failover."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest_asyncio

import kopf_reconcile as kr
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from support import eventually

RID = "devices"


@pytest_asyncio.fixture
async def repo(dsn: str) -> AsyncIterator[PostgresFencedRepository]:
    repository = PostgresFencedRepository(dsn, scope=RID)
    yield repository
    await repository.close()


async def test_a_dead_letter_is_counted_fenced_and_cleared(repo: PostgresFencedRepository) -> None:
    await repo.record_epoch(1, "a")
    assert await repo.record_dead_letter("ns/bad", 1, "spec.desired is 'sideways'")
    assert await repo.record_dead_letter("ns/bad", 1, "spec.desired is 'upside-down'")
    [letter] = await repo.dead_letters()
    assert (letter.entity_id, letter.attempts, letter.epoch) == ("ns/bad", 2, 1)
    assert letter.reason == "spec.desired is 'upside-down'"
    assert letter.first_at <= letter.last_at
    # A new leader recorded epoch 2: the deposed one can neither write nor clear.
    await repo.record_epoch(2, "b")
    assert not await repo.record_dead_letter("ns/other", 1, "late")
    assert not await repo.clear_dead_letter("ns/bad", 1)
    assert [d.entity_id for d in await repo.dead_letters()] == ["ns/bad"]
    assert await repo.clear_dead_letter("ns/bad", 2)
    assert await repo.dead_letters() == []


async def test_redrive_requests_go_to_the_current_leader_only(
    repo: PostgresFencedRepository, dsn: str
) -> None:
    await repo.record_epoch(3, "a")
    for entity in ("ns/a", "ns/b", "other/c"):
        assert await repo.record_dead_letter(entity, 3, "broken")
    tool = PostgresFencedRepository(dsn)  # what the command line uses: every scope
    try:
        assert await tool.request_redrive("ns/a") == ["ns/a"]
        assert await tool.request_redrive("ns/missing") == []
        assert [d.entity_id for d in await tool.list_dead_letters(namespace="ns")] == [
            "ns/a",
            "ns/b",
        ]
        assert await repo.take_redrives(2) == []  # a deposed leader gets nothing...
        assert await repo.take_redrives(3) == ["ns/a"]  # ... and leaves it to the leader
        assert await repo.take_redrives(3) == []  # handed out once
        assert await tool.request_redrive(scope=RID) == ["ns/a", "ns/b", "other/c"]
        assert await tool.request_redrive(scope="another") == []
        assert await repo.take_redrives(3) == ["ns/a", "ns/b", "other/c"]
        assert (await tool.leadership_changes()).get(RID) is None  # a first leader only
        await repo.record_epoch(4, "b")
        assert (await tool.leadership_changes()).get(RID) == 1  # then a failover
    finally:
        await tool.close()


def build(
    reconcile: object, dsn: str, holder: str
) -> tuple[kr.Loop, PostgresLeaseElector, PostgresFencedRepository]:
    elector = PostgresLeaseElector(dsn, ttl=kr.LeaseTTL(3), holder_id=holder)
    repository = PostgresFencedRepository(dsn)
    loop = (
        kr.Builder(reconcile, kr.Tenancy.TENANT_SCOPED)  # type: ignore[arg-type]
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(elector)
        .with_fenced_repo(repository)
        .with_reconciler_id(RID)
        .with_renew_interval(0.2)
        .with_redrive_interval(0.1)
        .build()
    )
    return loop, elector, repository


async def test_a_new_leader_knows_the_dead_letters_and_redrives_them(dsn: str) -> None:
    broken = {"ns/bad"}
    runs: list[tuple[str, str]] = []

    async def reconcile(req: kr.Request) -> None:
        writer = kr.fenced_writer()
        assert writer is not None
        runs.append((req.entity_id, f"epoch {writer.epoch}"))
        if req.entity_id in broken:
            raise kr.PermanentError(f"{req.entity_id}: spec.desired is 'sideways'")

    tool = PostgresFencedRepository(dsn)
    first, first_elector, first_repo = build(reconcile, dsn, "replica-a")
    second, second_elector, second_repo = build(reconcile, dsn, "replica-b")
    try:
        await first.start()
        await eventually(lambda: first.stats().is_leader, message="the first leader")
        await first.enqueue(kr.Request("ns/bad"))
        await first.enqueue(kr.Request("ns/good"))

        async def stored() -> bool:
            return [d.entity_id for d in await tool.list_dead_letters()] == ["ns/bad"]

        await eventually(stored, message="the dead letter in PostgreSQL")
        [letter] = await tool.list_dead_letters()
        assert letter.reconciler_id == RID and letter.epoch == first.stats().epoch
        assert "sideways" in letter.reason
        # The second replica follows: it must not take the redrive request.
        await second.start()
        assert await tool.request_redrive("ns/bad") == ["ns/bad"]
        await eventually(lambda: runs.count(("ns/bad", f"epoch {first.stats().epoch}")) == 2)
        assert not second.stats().is_leader
        old_epoch = first.stats().epoch
        await first.stop()  # releases the lease: the second takes over

        await eventually(lambda: second.stats().is_leader, message="the second leader")
        assert second.stats().epoch > old_epoch
        assert (await tool.leadership_changes())[RID] == 1
        await eventually(lambda: second.stats().dead_letters == 1, message="loaded")
        broken.clear()  # the fix: a redrive now succeeds, and clears the dead letter
        assert await tool.request_redrive(scope=RID) == ["ns/bad"]

        async def cleared() -> bool:
            return await tool.list_dead_letters() == []

        await eventually(cleared, message="the dead letter cleared after the redrive")
        assert ("ns/bad", f"epoch {second.stats().epoch}") in runs
        assert second.stats().dead_letters == 0
        # The deposed leader's epoch cannot write a dead letter any more.
        assert not await first_repo.record_dead_letter("ns/late", old_epoch, "late")
    finally:
        for loop in (first, second):
            await loop.stop()
        for adapter in (first_elector, second_elector, first_repo, second_repo, tool):
            await adapter.close()
