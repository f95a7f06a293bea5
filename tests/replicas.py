"""For layout tests: a replica of a reconciler (a Loop, sharded or not, on PostgreSQL leases
and a PostgreSQL fenced store, writing each entity it reconciles, fed every entity often),
and where each entity's rows are."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import asyncpg

import kopf_reconcile as kr
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.sharded_loop import ShardedLoop


class Replica:
    """``shards`` > 1: a ShardedLoop; 1: an unsharded Loop. Its writes refused are counted."""

    def __init__(self, dsn: str, rid: str, name: str, shards: int, entities: Sequence[str]) -> None:
        self.name = name
        self.entities = list(entities)
        self.elector = PostgresLeaseElector(dsn, ttl=1.0, holder_id=name)
        self.repo = PostgresFencedRepository(dsn)
        self.feed: asyncio.Queue[kr.Request] = asyncio.Queue()
        self.rejected = 0
        self.feeding: asyncio.Task[None] | None = None
        self.stopped = False

        async def reconcile(req: kr.Request) -> kr.Result:
            writer = kr.fenced_writer()
            if req.entity_id and writer is not None:
                try:
                    await writer.write(req.entity_id, {"by": name, "epoch": writer.epoch})
                except kr.StaleEpochError:
                    self.rejected += 1
                    raise
            return kr.Result()

        builder = (
            kr.Builder(reconcile, kr.Tenancy.TENANT_SCOPED)
            .with_trigger(kr.ChannelTrigger(self.feed))
            .with_leader(self.elector)
            .with_fenced_repo(self.repo)
            .with_reconciler_id(rid)
            .with_renew_interval(0.1)
            .with_stop_timeout(2)
        )
        self.loop: Any = builder.with_shards(shards).build() if shards > 1 else builder.build()
        assert isinstance(self.loop, ShardedLoop) == (shards > 1)

    async def feed_forever(self) -> None:
        while True:
            for entity in self.entities:
                self.feed.put_nowait(kr.Request(entity))
            await asyncio.sleep(0.05)

    def leads_all(self, above: int) -> bool:
        """Leads every shard (or, unsharded, the reconciler) at epochs above ``above``."""
        loop = self.loop
        if isinstance(loop, ShardedLoop):
            stats = loop.shard_stats()
            return loop.held_shards() == list(range(loop.shards)) and all(
                s.epoch > above for s in stats.values()
            )
        stats = loop.stats()
        return bool(stats.is_leader and stats.epoch > above)

    def refused_for_its_layout(self) -> bool:
        return bool(self.loop._layout_wait.backoff > 0)

    async def start(self) -> None:
        """Start the loop and feed it; nothing if it runs already."""
        if self.feeding is None:
            await self.loop.start()
            self.feeding = asyncio.create_task(self.feed_forever())

    async def stop(self) -> None:
        """Stop feeding and the loop (its leases released), close; idempotent."""
        if self.stopped:
            return
        self.stopped = True
        if self.feeding is not None:
            self.feeding.cancel()
            await asyncio.gather(self.feeding, return_exceptions=True)
        await self.close()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.loop.stop(timeout=2)
        await self.repo.close()
        await self.elector.close()


TABLE = "kopf_reconcile_fence"


async def rows(dsn: str, table: str, rid: str) -> dict[str, list[tuple[str, int]]]:
    """entity -> [(scope, epoch)] of ``table``'s rows in ``rid``'s scope and shard scopes."""
    epoch = {TABLE: "last_epoch", f"{TABLE}_redrives": "0"}.get(table, "epoch")
    connection = await asyncpg.connect(dsn)
    try:
        found = await connection.fetch(
            f"SELECT scope, entity_id, {epoch} AS epoch FROM {table} "
            "WHERE scope = $1 OR starts_with(scope, $2)",
            rid,
            f"{rid}-shard-",
        )
    finally:
        await connection.close()
    placed: dict[str, list[tuple[str, int]]] = {}
    for row in found:
        placed.setdefault(row["entity_id"], []).append((row["scope"], int(row["epoch"])))
    return placed
