"""Process chaos in short: real replicas, a real API server and PostgreSQL, a seeded nemesis.

For each elector (Kubernetes Leases, PostgreSQL lease rows) three replicas of the
example operator run as OS processes on the embedded cluster and an embedded
PostgreSQL while 60 Devices keep changing, and for 12 seconds the nemesis of
seed ``SEED`` SIGKILLs, pauses and restarts replicas, injects API faults, pauses
the API server, stops PostgreSQL and kills its connections, partitions a replica
from the API and sends writes below the scope's epoch straight to the database
(:mod:`kopf_reconcile.testing.chaos`). Then everything heals and the run fails
if a stale write was accepted, if two replicas led at once beyond what a pause
explains, if two were inside a reconcile of one Device at once, if an epoch led
for two holders, or if a Device did not converge to its last spec (a lost
update). ``make chaos`` runs the long version.

The same again with the Devices in 8 shards: each shard led under a lease of
its own and fenced in a scope of its own, the replicas balancing the shards,
and a fourth replica joining and leaving, which moves shards by hand-off while
the nemesis strikes, at the giver or the joiner among others. Every invariant
then holds per shard: one holder per shard's entity at a time, no stale write
in any shard's scope, no lost update, epochs per shard never decreasing. With
Kubernetes Leases the Devices are sharded by namespace (one namespace per
shard): each replica watches only the shards it leads, so every takeover and
hand-off starts again with a list of the shards then led; with PostgreSQL
leases they are sharded by id (every replica watches everything).
"""

from __future__ import annotations

import pytest

from kopf_reconcile.testing.chaos import ELECTORS, Options, Report, run

pytestmark = pytest.mark.slow

SEED = 14
DURATION = 12.0
NEMESIS = ("kill", "pause", "restart", "partition", "api_500", "api_slow", "watch_cut",
           "api_pause", "db_stop", "db_kill", "zombie")  # fmt: skip


async def chaos(elector: str, shards: int = 1, by_namespace: bool = False) -> tuple[Report, str]:
    """The report of one chaos run at this file's settings, and its text for a failure;
    every invariant held (or the test fails with that text)."""
    lines: list[str] = []
    options = Options(
        seed=SEED,
        duration=DURATION,
        replicas=3,
        elector=elector,
        devices=60,
        changes_per_second=8.0,
        converge_timeout=120.0,
        shards=shards,
        by_namespace=by_namespace,
    )
    report = await run(options, out=lines.append)
    shown = report.table() + "\n\nprogress:\n" + "\n".join(lines)
    assert report.ok(), shown
    # The run did what it says: faults happened.
    assert sum(report.counts[kind] for kind in NEMESIS) >= 5, shown
    return report, shown


@pytest.mark.timeout(300)
@pytest.mark.parametrize("elector", ELECTORS)
async def test_every_invariant_holds_under_process_chaos(elector: str) -> None:
    report, shown = await chaos(elector)
    # Replicas led and wrote, and the Devices kept changing.
    assert report.writes_accepted > 0, shown
    assert report.counts["spec_change"] > 0, shown


SHARDS = 8  # three replicas hold 3, 3 and 2: one that joins takes a shard from two of them


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("elector", "by_namespace"), [("kubernetes", True), ("postgres", False)])
async def test_every_invariant_holds_per_shard_under_process_chaos(
    elector: str, by_namespace: bool
) -> None:
    report, shown = await chaos(elector, shards=SHARDS, by_namespace=by_namespace)
    # Replicas joined and shards were handed off, every shard led.
    assert report.counts["join"] >= 1 and report.handoffs >= 1, shown
    assert len(report.highest_led) == SHARDS and min(report.highest_led.values()) > 0, shown
    assert report.writes_accepted > 0 and report.reconciles > 0, shown
    if by_namespace:  # the watches followed the shards led, beyond each replica's first start
        assert report.narrowed_watches > report.counts["join"] + 3, shown
