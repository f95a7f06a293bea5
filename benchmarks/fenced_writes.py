"""Fenced writes per second against a raw asyncpg upsert of the same rows.

Both sides write the same JSON documents to the same entities, through the
same pool (same size), on the same embedded PostgreSQL, in the same run:

* baseline — a plain ``INSERT … ON CONFLICT … DO UPDATE`` on a table of the
  same shape, with the document encoded the same way (no epoch check);
* ``PostgresFencedRepository.apply_fenced`` — every write carries the current
  epoch, so every write is accepted (a rejected write would not be measuring
  the same work, and aborts the run).

Rounds alternate between the contenders after a warm-up, and the best round
of each is reported, so neither side profits from running second. The goal
is a ratio of at least 0.8x the baseline. Client CPU per write is printed too:
it isolates this library's own overhead from the database's, and is steadier
than wall-clock rates on a busy machine.

Run: ``.venv/bin/python benchmarks/fenced_writes.py [--writes N] [--pool-size P]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.testing import EmbeddedPostgres

TARGET_RATIO = 0.8
EPOCH = 1

Write = Callable[[str, dict[str, Any]], Awaitable[None]]

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


async def one_round(
    write: Write, writes: int, entities: int, concurrency: int
) -> tuple[float, float]:
    """Writes per second, and client CPU microseconds per write, for one round."""
    numbers = iter(range(writes))

    async def worker() -> None:
        for n in numbers:  # shared iterator: workers take the next write as they free up
            await write(f"entity-{n % entities}", {"n": n, "payload": "x" * 64})

    started, cpu_started = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
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
            contenders = {
                "raw asyncpg upsert": raw_upsert(pool),
                "PostgresFencedRepository": fenced(repo),
            }
            version = await pool.fetchval("SHOW server_version")
            print(
                f"fenced writes: {arguments.writes} writes over {arguments.entities} entities, "
                f"pool size {size}, {size} concurrent writers, PostgreSQL {version}"
                f" ({'durable commits' if arguments.durable else 'fsync off'})"
            )

            for write in contenders.values():  # warm-up: rows exist, statements prepared
                await one_round(write, arguments.entities, arguments.entities, size)
            best_rate = dict.fromkeys(contenders, 0.0)
            best_cpu = dict.fromkeys(contenders, float("inf"))
            for _, (name, write) in itertools.product(range(arguments.rounds), contenders.items()):
                rate, cpu = await one_round(write, arguments.writes, arguments.entities, size)
                best_rate[name] = max(best_rate[name], rate)
                best_cpu[name] = min(best_cpu[name], cpu)

    baseline = best_rate["raw asyncpg upsert"]
    for name, rate in best_rate.items():
        print(
            f"  {name:<28} {rate:>10,.0f} writes/s  {rate / baseline:5.2f}x"
            f"   client CPU {best_cpu[name]:5.1f} us/write"
        )
    ratio = best_rate["PostgresFencedRepository"] / baseline
    verdict = "meets" if ratio >= TARGET_RATIO else "MISSES"
    print(f"ratio fenced/raw: {ratio:.2f}x ({verdict} the {TARGET_RATIO}x target)")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=20_000, help="writes per round")
    parser.add_argument("--entities", type=int, default=1_000, help="distinct entities")
    parser.add_argument("--pool-size", type=int, default=8, help="pool size = writers")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per contender")
    parser.add_argument("--durable", action="store_true", help="fsync and synchronous commits")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_arguments()))
