"""A shard's repository keeps dead letters of its own shard's entities only.

- Recording or clearing the dead letter of another shard's entity is refused (a
  PermanentError), as a write of it is; the store is not called.
- A redrive request or a dead letter of another shard's entity, found in the shard's
  scope, is dropped with a warning; the shard's own pass through.
- A repository without dead letters stays one: the shard's wrapper adds no capability.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any

import pytest

import kopf_reconcile as kr
from kopf_reconcile.fencing.protocol import DeadLetter, DeadLetterStore
from kopf_reconcile.sharded_loop import ShardedLoop
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore

SHARDS = 3


class Fences:
    """A shardable repository; ``Letters`` adds dead letters."""

    def __init__(self, shard: int | None = None) -> None:
        self.shard = shard
        self.calls: list[tuple[Any, ...]] = []
        self.stored: list[str] = []

    def for_shard(self, shard: int) -> Fences:
        return type(self)(shard)

    async def record_shard_count(self, shards: int, *, by_namespace: bool = False) -> None:
        pass

    def bind_loop(self, *, reconciler_id: str, tenancy: kr.Tenancy) -> None:
        pass

    async def apply_fenced(self, entity_id: str, epoch: int, mutation: object) -> bool:
        return True

    async def record_epoch(self, epoch: int, holder: str) -> None:
        pass

    async def highest_epoch(self) -> int:
        return 0


class Letters(Fences):
    async def record_dead_letter(self, entity_id: str, epoch: int, reason: str) -> bool:
        self.calls.append(("record", entity_id))
        return True

    async def clear_dead_letter(self, entity_id: str, epoch: int) -> bool:
        self.calls.append(("clear", entity_id))
        return True

    async def dead_letters(self) -> list[DeadLetter]:
        now = datetime.datetime.now(datetime.UTC)
        return [DeadLetter("devices", e, "boom", now, now, 1, 1) for e in self.stored]

    async def take_redrives(self, epoch: int) -> list[str]:
        return list(self.stored)


def shard_repository(repo: Fences, shard: int) -> tuple[ShardedLoop, Any]:
    loop = (
        kr.Builder(lambda req: None, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_reconciler_id("devices")
        .with_leader(MemoryLeaseElector(MemoryLeaseStore()))
        .with_fenced_repo(repo)  # type: ignore[arg-type]
        .with_shards(SHARDS)
        .build()
    )
    assert isinstance(loop, ShardedLoop)
    return loop, loop._shard_loops[shard]._config.fenced_repo


def split(loop: ShardedLoop, shard: int) -> tuple[list[str], list[str]]:
    entities = [f"ns/dev-{i}" for i in range(30)]
    mine = [e for e in entities if loop.shard_of(e) == shard]
    others = [e for e in entities if loop.shard_of(e) != shard]
    assert mine and others
    return mine, others


async def test_another_shards_dead_letter_is_refused_and_never_stored() -> None:
    loop, fence = shard_repository(Letters(), 1)
    mine, others = split(loop, 1)
    assert isinstance(fence, DeadLetterStore)
    assert await fence.record_dead_letter(mine[0], 1, "boom")
    assert await fence.clear_dead_letter(mine[0], 1)
    with pytest.raises(kr.PermanentError, match="shard 1"):
        await fence.record_dead_letter(others[0], 1, "boom")
    with pytest.raises(kr.PermanentError, match="shard 1"):
        await fence.clear_dead_letter(others[0], 1)
    assert fence._repo.calls == [("record", mine[0]), ("clear", mine[0])]


async def test_another_shards_redrive_requests_and_dead_letters_are_dropped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop, fence = shard_repository(Letters(), 2)
    mine, others = split(loop, 2)
    fence._repo.stored = [mine[0], others[0], mine[1]]
    with caplog.at_level(logging.WARNING, logger="kopf_reconcile.loop"):
        assert await fence.take_redrives(1) == [mine[0], mine[1]]
        assert [d.entity_id for d in await fence.dead_letters()] == [mine[0], mine[1]]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert all(repr(others[0]) in w and "dropped" in w for w in warnings)


def test_a_repository_without_dead_letters_gains_none() -> None:
    _, fence = shard_repository(Fences(), 0)
    assert not isinstance(fence, DeadLetterStore)
    assert not hasattr(fence, "take_redrives")
