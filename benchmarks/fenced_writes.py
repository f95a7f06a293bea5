"""Fenced writes per second against a raw asyncpg upsert of the same rows.

Every contender writes the same JSON documents to the same entities, through
the same pool (same size), with as many writes in flight as connections, on
the same embedded PostgreSQL, in the same run:

* baseline — a plain ``INSERT … ON CONFLICT … DO UPDATE`` on a table of the
  same shape, with the document encoded the same way (no epoch check);
* ``PostgresFencedRepository.apply_fenced`` — every write carries the current
  epoch, so every write is accepted (a rejected write would not be measuring
  the same work, and aborts the run);
* ``FencedWriter`` minted by a Loop — what a reconciler does: a leading Loop
  (in-memory elector, as many workers as connections, otherwise its
  defaults: metrics off, as in ``dispatch.py``, which measures their cost)
  gets one request per write and its reconciler writes once through
  ``kr.fenced_writer()``; the writer checks the lease, then calls the same
  kind of repository. This adds the Loop's per-request work (intake, queue,
  dispatch, writer) to every write.

Writes go out in batches that name every entity once, so the Loop never
coalesces two requests for one entity and every contender makes exactly the
same writes. Rounds alternate between the contenders after a warm-up, and the
best round of each is reported, so no side profits from running later. The
goal is a ratio of at least 0.8x the baseline. Client CPU per write is
printed too: it isolates this library's own overhead from the database's,
and is steadier than wall-clock rates on a busy machine.

Run: ``.venv/bin/python benchmarks/fenced_writes.py [--writes N] [--pool-size P]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg

import kopf_reconcile as kr
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.testing import EmbeddedPostgres
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore
from results import result

TARGET_RATIO = 0.8
EPOCH = 1
RAW, REPOSITORY, WRITER = (
    "raw asyncpg upsert",
    "PostgresFencedRepository",
    "FencedWriter via a Loop",
)

Write = Callable[[str, dict[str, Any]], Awaitable[None]]
# Makes one batch of writes: ``{entity_id: document}``, with ``concurrency`` in flight.
WriteBatch = Callable[[dict[str, dict[str, Any]], int], Awaitable[None]]

RAW_TABLE = "raw_upsert"
RAW_SCHEMA = f"""
    CREATE TABLE {RAW_TABLE} (
        scope      text        NOT NULL,
        entity_id  text        NOT NULL,
        tenant     text        NOT NULL,
        last_epoch bigint      NOT NULL,
        state      jsonb,
        updated_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (scope, entity_id)
    )
"""
RAW_UPSERT = f"""
    INSERT INTO {RAW_TABLE} (scope, entity_id, tenant, last_epoch, state, updated_at)
    VALUES ($1, $2, $3, $4, $5::jsonb, now())
    ON CONFLICT (scope, entity_id) DO UPDATE
       SET last_epoch = EXCLUDED.last_epoch, state = EXCLUDED.state,
           updated_at = EXCLUDED.updated_at
"""


def raw_upsert(pool: asyncpg.Pool) -> Write:
    async def write(entity_id: str, document: dict[str, Any]) -> None:
        await pool.execute(
            RAW_UPSERT, "default", entity_id, "_notenant", EPOCH, json.dumps(document)
        )

    return write


def fenced(repo: PostgresFencedRepository) -> Write:
    async def write(entity_id: str, document: dict[str, Any]) -> None:
        if not await repo.apply_fenced(entity_id, EPOCH, document):
            raise RuntimeError(f"fenced write to {entity_id} rejected: the benchmark is broken")

    return write


def concurrent_writers(write: Write) -> WriteBatch:
    """A batch made by ``concurrency`` tasks, each taking the next write as it frees up."""

    async def write_batch(batch: dict[str, dict[str, Any]], concurrency: int) -> None:
        items = iter(batch.items())

        async def writer() -> None:
            for entity_id, document in items:  # shared iterator
                await write(entity_id, document)

        await asyncio.gather(*(writer() for _ in range(concurrency)))

    return write_batch


@contextlib.asynccontextmanager
async def loop_writer(
    repo: PostgresFencedRepository, concurrency: int
) -> AsyncIterator[WriteBatch]:
    """A batch made by a leading Loop: one request per write, the reconciler writes it."""
    documents: dict[str, dict[str, Any]] = {}
    outstanding = 0
    drained = asyncio.Event()
    failures: list[BaseException] = []

    async def reconcile(request: kr.Request) -> None:
        nonlocal outstanding
        if not request.entity_id:
            return  # the resync-all of a new leader
        writer = kr.fenced_writer()
        assert writer is not None
        try:
            await writer.write(request.entity_id, documents.pop(request.entity_id))
        except BaseException as exc:
            failures.append(exc)  # a retry is not the same work: abort the run
            drained.set()
            raise
        outstanding -= 1
        if not outstanding:
            drained.set()

    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(MemoryLeaseElector(MemoryLeaseStore(), kr.LeaseTTL(60)))
        .with_fenced_repo(repo)
        .with_reconciler_id("bench")
        .with_concurrency(concurrency)
        .without_default_requeue()
        .build()
    )

    async def write_batch(batch: dict[str, dict[str, Any]], _: int) -> None:
        nonlocal outstanding
        documents.update(batch)
        outstanding = len(batch)
        drained.clear()
        for entity_id in batch:
            await loop.enqueue(kr.Request(entity_id))
        await drained.wait()
        if failures:
            raise RuntimeError(f"a write through the Loop failed: {failures[0]!r}")

    async with loop:  # requests before it leads wait in its queue: the warm-up absorbs that
        yield write_batch


async def one_round(
    write_batch: WriteBatch, writes: int, entities: int, concurrency: int
) -> tuple[float, float]:
    """Writes per second, and client CPU microseconds per write, for one round."""
    started, cpu_started = time.perf_counter(), time.process_time()
    for first in range(0, writes, entities):  # each batch names every entity once
        batch = {
            f"entity-{n % entities}": {"n": n, "payload": "x" * 64}
            for n in range(first, min(first + entities, writes))
        }
        await write_batch(batch, concurrency)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return writes / elapsed, cpu / writes * 1e6


async def main(arguments: argparse.Namespace) -> None:
    settings = {"fsync": "on", "synchronous_commit": "on"} if arguments.durable else {}
    async with EmbeddedPostgres(settings=settings) as server:
        dsn = await server.create_database()
        size = arguments.pool_size
        async with asyncpg.create_pool(dsn, min_size=size, max_size=size) as pool:
            await pool.execute(RAW_SCHEMA)
            repo = PostgresFencedRepository(pool)
            await repo.migrate()
            version = await pool.fetchval("SHOW server_version")
            print(
                f"fenced writes: {arguments.writes} writes over {arguments.entities} entities, "
                f"pool size {size}, {size} writes in flight, PostgreSQL {version}"
                f" ({'durable commits' if arguments.durable else 'fsync off'})"
            )
            # The Loop gets a repository of its own: a Loop binds it to its scope.
            async with loop_writer(PostgresFencedRepository(pool), size) as through_loop:
                contenders = {
                    RAW: concurrent_writers(raw_upsert(pool)),
                    REPOSITORY: concurrent_writers(fenced(repo)),
                    WRITER: through_loop,
                }
                for write_batch in contenders.values():  # warm-up: rows exist, SQL prepared
                    await one_round(write_batch, arguments.entities, arguments.entities, size)
                best_rate = dict.fromkeys(contenders, 0.0)
                all_rates: dict[str, list[float]] = {name: [] for name in contenders}
                best_cpu = dict.fromkeys(contenders, float("inf"))
                rounds = itertools.product(range(arguments.rounds), contenders.items())
                for _, (name, write_batch) in rounds:
                    rate, cpu = await one_round(
                        write_batch, arguments.writes, arguments.entities, size
                    )
                    best_rate[name] = max(best_rate[name], rate)
                    all_rates[name].append(rate)
                    best_cpu[name] = min(best_cpu[name], cpu)

    baseline = best_rate[RAW]
    for name, rate in best_rate.items():
        print(
            f"  {name:<28} {rate:>10,.0f} writes/s  {rate / baseline:5.2f}x"
            f"   client CPU {best_cpu[name]:5.1f} us/write"
        )
    for name in (REPOSITORY, WRITER):
        ratio = best_rate[name] / baseline
        verdict = "meets" if ratio >= TARGET_RATIO else "MISSES"
        print(f"ratio {name} / raw: {ratio:.2f}x ({verdict} the {TARGET_RATIO}x target)")
    for name in (REPOSITORY, WRITER):
        result(
            "fenced_writes",
            f"writes/s, {name} vs a raw asyncpg upsert",
            ours=all_rates[name],
            baseline=all_rates[RAW],
            unit="/s",
            ratio="ours/baseline",
            target=(">=", TARGET_RATIO),
        )


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=20_000, help="writes per round")
    parser.add_argument("--entities", type=int, default=1_000, help="distinct entities")
    parser.add_argument("--pool-size", type=int, default=8, help="pool size = writes in flight")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per contender")
    parser.add_argument("--durable", action="store_true", help="fsync and synchronous commits")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_arguments()))
