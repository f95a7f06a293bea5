"""Changing a sharded reconciler's layout (``kopf-reconcile reshard``) on a real PostgreSQL.

- A shard scope's epoch is valid only under the layout its base scope records: after a
  reshard, a repository of the old layout is refused at ``record_epoch``, even one whose
  replica had recorded the old layout before.
- The reshard moves each entity's row, dead letter and redrive request to the shard scope
  the new layout assigns, state and ``last_epoch`` kept; every shard scope, old and new,
  is fenced at one epoch above all it had seen, so a write of the old layout is refused in
  each, and the next leader of a shard starts above that epoch.
- It refuses a scope never led and the layout already recorded.
- The command prints what it did; the kubectl plugin forwards it.
- Liveness: a sharded Loop of the new count started before the reshard leads once it
  commits; a replica of the old count that led before it never starts leading again.
- Redrive requests serialize with a reshard: one made while it is in progress waits, then
  lands once in the entity's new shard scope; requests (one entity, all), takes, old-layout
  writes and back-and-forth reshards run together without a deadlock or a lost request.
- A replica of the previous release (plain lease equality, no layout check) records epochs
  as before until a reshard, and is refused by the server in every shard scope after it.
- An entity with rows in two shard scopes is refused (nothing changes); duplicate redrive
  requests are merged and counted. The command refuses shard counts outside 2..1024 alike,
  and creates no table in a database without them.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kopf_reconcile as kr
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.fencing.protocol import ShardLayoutError
from kopf_reconcile.leader.kubernetes import elector as kubernetes_leases
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.sharding import ShardAssignment, shard_id
from replicas import Replica, rows
from support import eventually, run_cli

BIN = Path(sys.executable).parent
TABLE = "kopf_reconcile_fence"
ENTITIES = [f"ns-{i % 4}/dev-{i}" for i in range(40)]
PAUSE_KEY = 0x6B726573  # the advisory lock a paused reshard waits for


def fresh_id() -> str:
    return f"devices-{secrets.token_hex(3)}"


async def sharded_repositories(
    dsn: str, rid: str, shards: int
) -> tuple[PostgresFencedRepository, list[PostgresFencedRepository]]:
    """The base repository of a replica running ``shards`` shards, and its shards' ones."""
    base = PostgresFencedRepository(dsn)
    base.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.TENANT_SCOPED)
    parts = []
    for k in range(shards):
        part = base.for_shard(k)
        part.bind_loop(reconciler_id=shard_id(rid, k), tenancy=kr.Tenancy.TENANT_SCOPED)
        parts.append(part)
    await base.record_shard_count(shards)
    return base, parts


async def stored_states(dsn: str, rid: str) -> dict[tuple[str, str], Any]:
    """(scope, entity) -> the state document fenced in ``rid``'s shard scopes."""
    connection = await asyncpg.connect(dsn)
    try:
        found = await connection.fetch(
            f"SELECT scope, entity_id, state::text FROM {TABLE} WHERE starts_with(scope, $1)",
            f"{rid}-shard-",
        )
    finally:
        await connection.close()
    return {(row["scope"], row["entity_id"]): json.loads(row["state"]) for row in found}


async def test_an_old_layout_shard_is_refused_after_a_reshard_even_after_claiming(
    dsn: str,
) -> None:
    rid = fresh_id()
    base, old = await sharded_repositories(dsn, rid, 4)
    try:
        await old[1].record_epoch(3, "old-replica")
        async with PostgresFencedRepository(dsn, scope=rid) as admin:
            report = await admin.reshard(2)
        fence = report.fence_epoch
        assert fence > 3
        # The old replica claimed its layout before: its next epoch is refused all the same,
        # above the fence too, naming both layouts.
        for part in old:
            with pytest.raises(ShardLayoutError, match=rf"{rid}/shards=2.*{rid}/shards=4"):
                await part.record_epoch(fence + 5, "old-replica")
        # And its claim is refused now.
        with pytest.raises(ShardLayoutError, match="kopf-reconcile reshard"):
            await base.record_shard_count(4)
        # A replica of the new layout leads above the fence, not at it.
        new_base, new = await sharded_repositories(dsn, rid, 2)
        try:
            with pytest.raises(kr.StaleEpochError):
                await new[0].record_epoch(fence, "new-replica")
            await new[0].record_epoch(fence + 1, "new-replica")
            await new[1].record_epoch(fence + 1, "new-replica")
        finally:
            await new_base.close()
    finally:
        await base.close()


async def test_a_shard_repository_needs_its_layout_recorded_first(dsn: str) -> None:
    async with PostgresFencedRepository(dsn) as base:
        base.bind_loop(reconciler_id="unclaimed", tenancy=kr.Tenancy.SINGLE_TENANT)
        part = base.for_shard(0)
        part.bind_loop(reconciler_id="unclaimed-shard-0", tenancy=kr.Tenancy.SINGLE_TENANT)
        with pytest.raises(ShardLayoutError, match="record_shard_count"):
            await part.record_epoch(1, "a")


async def test_reshard_moves_every_row_to_its_new_scope_and_fences_the_old_layout(
    dsn: str,
) -> None:
    rid = fresh_id()
    old_layout = ShardAssignment(4)
    base, old = await sharded_repositories(dsn, rid, 4)
    before: dict[str, tuple[int, dict[str, Any]]] = {}
    try:
        for k, part in enumerate(old):
            await part.record_epoch(10 + k, f"holder-{k}")
        for i, entity in enumerate(ENTITIES):
            k = old_layout.shard_of(entity)
            epoch = 10 + k
            state = {"i": i, "by": k}
            assert await old[k].apply_fenced(entity, epoch, state)
            before[entity] = (epoch, state)
        dead = ENTITIES[:3]
        for entity in dead:
            k = old_layout.shard_of(entity)
            assert await old[k].record_dead_letter(entity, 10 + k, "spec.desired is 'sideways'")
        async with PostgresFencedRepository(dsn, scope=rid) as admin:
            assert sorted(await admin.request_redrive(dead[0])) == [dead[0]]
            report = await admin.reshard(3)
        new_layout = ShardAssignment(3)
        assert report.fence_epoch == 14  # one above the highest epoch of any shard scope
        assert (report.old_layout, report.new_layout) == (f"{rid}/shards=4", f"{rid}/shards=3")
        assert sum(report.entities.values()) == len(ENTITIES)
        # Each entity in exactly one scope, its new shard's, with its state and epoch.
        placed = await rows(dsn, TABLE, rid)
        assert set(placed) == set(ENTITIES)
        states = await stored_states(dsn, rid)
        moved = 0
        for entity, where in placed.items():
            home = shard_id(rid, new_layout.shard_of(entity))
            epoch, state = before[entity]
            assert where == [(home, epoch)], entity
            assert states[home, entity] == state, entity
            moved += home != shard_id(rid, old_layout.shard_of(entity))
        assert sum(report.moved.values()) == moved
        letters = await rows(dsn, f"{TABLE}_dead_letters", rid)
        assert {e: [s for s, _ in w] for e, w in letters.items()} == {
            e: [shard_id(rid, new_layout.shard_of(e))] for e in dead
        }
        requests = await rows(dsn, f"{TABLE}_redrives", rid)
        assert [s for s, _ in requests[dead[0]]] == [shard_id(rid, new_layout.shard_of(dead[0]))]
        # The old layout's writers are refused in every old shard scope, for moved, kept
        # and new entities alike; so are their dead letters.
        for k, part in enumerate(old):
            for entity in [*ENTITIES[:8], f"ns-9/never-{k}"]:
                assert await part.apply_fenced(entity, 10 + k, {"zombie": True}) is False
                assert await part.record_dead_letter(entity, 10 + k, "zombie") is False
        # Each new shard's epoch floor is the fence: its next leader starts above it.
        for k in range(3):
            async with PostgresFencedRepository(dsn, scope=shard_id(rid, k)) as reader:
                assert await reader.highest_epoch() == report.fence_epoch
        assert placed == await rows(dsn, TABLE, rid)  # nothing written by the zombies
    finally:
        await base.close()


async def test_reshard_refuses_a_scope_never_led_and_the_same_layout(dsn: str) -> None:
    # (A scope led unsharded can be sharded: test_resharding_unsharded.py.)
    async with PostgresFencedRepository(dsn, scope="never-led") as admin:
        await admin.migrate()
        with pytest.raises(kr.ConfigError, match="never led nor sharded"):
            await admin.reshard(2)
    sharded = fresh_id()
    base, _ = await sharded_repositories(dsn, sharded, 3)
    try:
        async with PostgresFencedRepository(dsn, scope=sharded) as admin:
            with pytest.raises(kr.ConfigError, match="already sharded"):
                await admin.reshard(3)
            # Another assignment of the same count is another layout.
            report = await admin.reshard(3, by_namespace=True)
            assert report.new_layout == f"{sharded}/shards=3/namespace-ranges"
    finally:
        await base.close()


async def test_an_earlier_releases_by_namespace_layout_is_refused_then_resharded(
    dsn: str,
) -> None:
    # Earlier releases assigned by namespace modulo N and recorded `/by-namespace`; this
    # release assigns by namespace ranges. A replica of it is refused there (the same
    # entity would be fenced in two scopes), and the reshard its hint names moves the
    # entities to their range shards.
    rid = fresh_id()
    modulo = ShardAssignment(3, by_namespace=True, namespace_modulo=True)
    ranges = ShardAssignment(3, by_namespace=True)
    entities = [f"team-{i}/dev" for i in range(30)]
    assert any(modulo.shard_of(e) != ranges.shard_of(e) for e in entities)
    base, parts = await sharded_repositories(dsn, rid, 3)
    try:
        for part in parts:
            await part.record_epoch(2, "old")
        connection = await asyncpg.connect(dsn)
        try:  # what an earlier release's record_shard_count(3, by_namespace=True) wrote
            await connection.execute(
                f"UPDATE {TABLE}_epochs SET lease = $2 WHERE scope = $1",
                rid,
                f"{rid}/shards=3/by-namespace",
            )
        finally:
            await connection.close()
        for entity in entities:
            k = modulo.shard_of(entity)
            assert await parts[k].apply_fenced(entity, 2, {"id": entity})
    finally:
        await base.close()
    async with PostgresFencedRepository(dsn) as replica:
        replica.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.TENANT_SCOPED)
        with pytest.raises(ShardLayoutError, match="--shards 3 --by-namespace") as refused:
            await replica.record_shard_count(3, by_namespace=True)
        assert f"{rid}/shards=3/by-namespace" in str(refused.value)
    async with PostgresFencedRepository(dsn, scope=rid) as admin:
        report = await admin.reshard(3, by_namespace=True)
    assert report.new_layout == f"{rid}/shards=3/namespace-ranges"
    placed = await rows(dsn, TABLE, rid)
    assert {e: where[0][0] for e, where in placed.items()} == {
        e: shard_id(rid, ranges.shard_of(e)) for e in entities
    }
    async with PostgresFencedRepository(dsn) as replica:
        replica.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.TENANT_SCOPED)
        await replica.record_shard_count(3, by_namespace=True)  # accepted now


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    ids=st.sets(
        st.builds(
            "{}/{}".format,
            st.sampled_from(["default", "team-a", "team-b", "ünï", "x"]),
            st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1),
        ),
        max_size=30,
    ),
    old=st.integers(2, 9),
    new=st.integers(2, 9),
    by_namespace=st.booleans(),
)
def test_every_entity_ends_in_exactly_the_scope_sharding_assigns(
    dsn: str, ids: set[str], old: int, new: int, by_namespace: bool
) -> None:
    if old == new:
        by_namespace = True  # another layout all the same (the old one is by id)

    async def check() -> None:
        rid = fresh_id()
        before = ShardAssignment(old)
        after = ShardAssignment(new, by_namespace)
        base, parts = await sharded_repositories(dsn, rid, old)
        try:
            for k, part in enumerate(parts):
                await part.record_epoch(1 + k, "h")
            for entity in ids:
                k = before.shard_of(entity)
                assert await parts[k].apply_fenced(entity, 1 + k, {"id": entity})
            async with PostgresFencedRepository(dsn, scope=rid) as admin:
                report = await admin.reshard(new, by_namespace=by_namespace)
            placed = await rows(dsn, TABLE, rid)
            assert set(placed) == ids
            for entity, where in placed.items():
                assert where == [
                    (shard_id(rid, after.shard_of(entity)), 1 + before.shard_of(entity))
                ]
            assert report.fence_epoch == old + 1
        finally:
            await base.close()

    asyncio.run(check())


# -- the command ---------------------------------------------------------------------------


async def leases_left(dsn: str, rid: str, shards: int) -> None:
    """The shard leases a stopped replica leaves in PostgreSQL: recorded, released."""
    async with PostgresLeaseElector(dsn, holder_id="stopped-replica") as elector:
        for k in range(shards):
            await elector.release_lease(await elector.acquire_lease(shard_id(rid, k)))


async def test_the_reshard_command(dsn: str) -> None:
    rid = fresh_id()
    base, parts = await sharded_repositories(dsn, rid, 4)
    try:
        code, _, err = await run_cli(
            "reshard", "--reconciler", rid, "--shards", "2", "--leases", "postgres", dsn=dsn
        )
        # No lease record of its shards there: they are elsewhere, nothing is checked blind.
        assert code == 2 and f"no shard lease of {rid} among the postgres leases" in err, err
        await leases_left(dsn, rid, 4)
        for part in parts:
            await part.record_epoch(7, "a")
        for entity in ENTITIES:
            k = ShardAssignment(4).shard_of(entity)
            assert await parts[k].apply_fenced(entity, 7, {"on": True})
    finally:
        await base.close()
    code, out, err = await run_cli(
        "reshard", "--reconciler", rid, "--shards", "2", "--leases", "postgres", dsn=dsn
    )
    assert code == 0, err
    assert f"{rid}/shards=4 -> {rid}/shards=2, fence epoch 8" in out
    counts = {k: ShardAssignment(2).shard_of(e) for k, e in enumerate(ENTITIES)}
    for k in range(2):
        assert f"shard {k}: {sum(1 for s in counts.values() if s == k)} entities" in out
    assert f"never uses: {rid}-shard-2, {rid}-shard-3, {rid}-member-2, {rid}-member-3" in out
    # The same layout again: a configuration error, nothing changed.
    code, _, err = await run_cli(
        "reshard", "--reconciler", rid, "--shards", "2", "--leases", "postgres", dsn=dsn
    )
    assert code == 2 and "already sharded" in err
    code, _, err = await run_cli(
        "reshard", "--reconciler", "nothing-here", "--shards", "2", "--leases", "postgres", dsn=dsn
    )
    assert code == 2 and "never led nor sharded" in err
    code, _, err = await run_cli("reshard", "--shards", "2", dsn=dsn)
    assert code == 2 and "--reconciler" in err
    if (BIN / "kubectl").exists():  # the kubectl plugin forwards every subcommand
        code, out, err = await run_cli(
            "reshard",
            "--reconciler",
            rid,
            "--shards",
            "3",
            "--leases",
            "postgres",
            dsn=dsn,
            via_kubectl=True,
        )
        assert code == 0, err
        assert f"{rid}/shards=2 -> {rid}/shards=3" in out


# -- liveness after a refusal --------------------------------------------------------------


async def scope_lease(dsn: str, scope: str) -> str | None:
    """The lease a scope's epochs row names: a base scope's names its layout (``<id>/shards=N``)."""
    connection = await asyncpg.connect(dsn)
    try:
        lease: str | None = await connection.fetchval(
            f"SELECT lease FROM {TABLE}_epochs WHERE scope = $1", scope
        )
        return lease
    finally:
        await connection.close()


async def test_the_reshard_command_refuses_while_a_replica_of_the_old_layout_leads(
    dsn: str,
) -> None:
    # A replica of the old layout that leads but writes nothing is never refused by the
    # fence: it would go on dispatching its shards' entities beside their new holders.
    # The command refuses while any shard lease is held, and changes nothing.
    rid = fresh_id()
    old = Replica(dsn, rid, "old", 3, ENTITIES)
    feeding: asyncio.Task[None] | None = None
    try:
        await old.loop.start()
        feeding = asyncio.create_task(old.feed_forever())
        await eventually(
            lambda: old.loop.held_shards() == [0, 1, 2], timeout=20, message="old leads all"
        )
        reshard = ("reshard", "--reconciler", rid, "--shards", "2")
        code, _, err = await run_cli(*reshard, "--leases", "postgres", dsn=dsn)
        assert code == 2, err
        assert "watching" in err, err  # held leases are watched for renewals first
        assert f"3 shard lease(s) of {rid} are held (postgres leases)" in err, err
        assert f"{rid}-shard-0 by {old.elector.holder_id} until " in err, err
        assert "stop the old layout's replicas" in err and "nothing changed" in err, err
        assert await scope_lease(dsn, rid) == f"{rid}/shards=3"
        assert old.loop.held_shards() == [0, 1, 2]
        # Where the leases are is never guessed outside a pod.
        code, _, err = await run_cli(*reshard, dsn=dsn)
        assert code == 2 and "--leases kubernetes" in err and "--leases postgres" in err, err
        # Stopped (its leases released), the old layout lets the reshard through.
        feeding.cancel()
        await old.loop.stop(timeout=5)
        code, out, err = await run_cli(*reshard, "--leases", "postgres", dsn=dsn)
        assert code == 0, err
        assert f"no shard lease of {rid} was held (postgres leases)" in out, out
        assert await scope_lease(dsn, rid) == f"{rid}/shards=2"
    finally:
        if feeding is not None:
            feeding.cancel()
            await asyncio.gather(feeding, return_exceptions=True)
        await old.close()


async def test_the_reshard_command_checks_the_kubernetes_leases_without_comparing_clocks(
    kube: Any, kube_namespace: str, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The holder's clock lags a minute: every renewTime it writes says its lease expired
    # long ago. Still renewing, it leads, and the command sees the renewals, not the times.
    lagging = kubernetes_leases._wall_clock() - datetime.timedelta(minutes=1)
    started = time.monotonic()
    monkeypatch.setattr(
        kubernetes_leases,
        "_wall_clock",
        lambda: lagging + datetime.timedelta(seconds=time.monotonic() - started),
    )
    rid = fresh_id()
    base, _ = await sharded_repositories(dsn, rid, 3)
    await base.close()
    elector = kr.KubernetesLeaseElector(
        namespace=kube_namespace, kubeconfig=kube.kubeconfig, holder_id="old-replica", ttl=2
    )

    async def renew_forever(token: Any) -> None:
        while True:
            await asyncio.sleep(0.3)
            await elector.renew_lease(token)

    async with elector:
        token = await elector.acquire_lease(f"{rid}-shard-1")
        renewing = asyncio.create_task(renew_forever(token))
        try:
            reshard = ("reshard", "--reconciler", rid, "--shards", "2", "--leases", "kubernetes")
            where = ("--kubeconfig", kube.kubeconfig, "-n", kube_namespace)
            code, _, err = await run_cli(*reshard, *where, dsn=dsn)
            assert code == 2, err
            assert "watching" in err, err
            assert f"1 shard lease(s) of {rid} are held (kubernetes leases)" in err, err
            assert f"{rid}-shard-1 by old-replica until " in err, err
            assert await scope_lease(dsn, rid) == f"{rid}/shards=3"
            code, _, err = await run_cli(*reshard, "--kubeconfig", kube.kubeconfig, dsn=dsn)
            assert code == 2, err  # the context's namespace has none of its leases
            assert f"no shard lease of {rid} among the kubernetes leases in the context's" in err
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
        # Its holder gone without releasing it (a crash): unrenewed for its whole duration,
        # the lease no longer counts, and the reshard goes through.
        code, out, err = await run_cli(*reshard, *where, dsn=dsn)
    assert code == 0, err
    assert "watching" in err, err
    assert f"no shard lease of {rid} was held (kubernetes leases)" in out, out
    assert await scope_lease(dsn, rid) == f"{rid}/shards=2"


async def test_a_new_layout_replica_leads_once_the_reshard_commits_and_an_old_one_never_again(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    rid = fresh_id()
    old = Replica(dsn, rid, "old", 3, ENTITIES)
    new = Replica(dsn, rid, "new", 2, ENTITIES)
    late = Replica(dsn, rid, "late-old", 3, ENTITIES)
    feeding: list[asyncio.Task[None]] = []
    try:
        await old.loop.start()
        feeding.append(asyncio.create_task(old.feed_forever()))
        await eventually(
            lambda: old.loop.held_shards() == [0, 1, 2], timeout=20, message="old leads all"
        )
        await new.loop.start()
        feeding.append(asyncio.create_task(new.feed_forever()))
        # Refused for its layout: it leads nothing, and backs off.
        await eventually(lambda: new.loop._layout_backoff > 0, timeout=20, message="refused")
        assert new.loop.held_shards() == []
        refusals = [r.message for r in caplog.records if r.levelname == "ERROR"]
        assert any(f"kopf-reconcile reshard --reconciler {rid} --shards 2" in m for m in refusals)
        async with PostgresFencedRepository(dsn, scope=rid) as admin:
            report = await admin.reshard(2)
        fence = report.fence_epoch
        await late.loop.start()
        feeding.append(asyncio.create_task(late.feed_forever()))

        def new_leads_all() -> bool:
            stats = new.loop.shard_stats()
            return new.loop.held_shards() == [0, 1] and all(
                stats[k].epoch > fence for k in range(2)
            )

        await eventually(new_leads_all, timeout=60, message=f"new leads: {new.loop!r}")
        assert old.rejected > 0, "the old leader's writes were refused by the fence"
        await eventually(lambda: old.loop._layout_backoff > 0, timeout=20, message="old refused")
        assert old.loop.held_shards() == [] and late.loop.held_shards() == []
        # From the commit on, no old-layout replica ever started leading a shard: every
        # epoch that led a scope is recorded (record_epoch), and none of theirs is above
        # the fence (a lease taken before the reshard is below it, and its writes are
        # refused until it steps down).
        connection = await asyncpg.connect(dsn)
        try:
            led_after = await connection.fetch(
                f"SELECT scope, epoch, holder FROM {TABLE}_leaders "
                "WHERE starts_with(scope, $1) AND epoch > $2 ORDER BY scope, epoch",
                f"{rid}-shard-",
                fence,
            )
        finally:
            await connection.close()
        old_holders = {old.elector.holder_id, late.elector.holder_id}
        assert [tuple(row) for row in led_after if row["holder"] in old_holders] == []
        # (The record is the one the new replica's leading is in.)
        assert {row["scope"] for row in led_after if row["holder"] == new.elector.holder_id} == {
            shard_id(rid, k) for k in range(2)
        }

        # Every entity is written in its new shard's scope by the new replica.
        async def written() -> bool:
            placed = await rows(dsn, TABLE, rid)
            return set(placed) == set(ENTITIES) and all(
                where == [(shard_id(rid, ShardAssignment(2).shard_of(e)), where[0][1])]
                and where[0][1] > fence
                for e, where in placed.items()
            )

        await eventually(written, timeout=20, message="written by the new layout")
    finally:
        for task in feeding:
            task.cancel()
        await asyncio.gather(*feeding, return_exceptions=True)
        for replica in (late, new, old):
            await replica.close()


# -- redrive requests and a reshard ------------------------------------------------------------


def moving_entities(old: ShardAssignment, new: ShardAssignment, count: int) -> list[str]:
    """``count`` entities of old shard 0 that another shard takes in ``new``."""
    found = [
        entity
        for entity in (f"ns/dev-{i}" for i in range(10_000))
        if old.shard_of(entity) == 0 and new.shard_of(entity) != 0
    ]
    return found[:count]


async def test_a_redrive_request_during_a_reshard_lands_once_in_the_new_scope(
    dsn: str,
) -> None:
    rid = fresh_id()
    old_layout, new_layout = ShardAssignment(4), ShardAssignment(3)
    requested_before, requested_during = moving_entities(old_layout, new_layout, 2)
    base, parts = await sharded_repositories(dsn, rid, 4)
    paused = await asyncpg.connect(dsn)
    tool = PostgresFencedRepository(dsn, lock_timeout=20)  # `kopf-reconcile redrive`'s
    try:
        await parts[0].record_epoch(5, "old")
        for entity in (requested_before, requested_during):
            assert await parts[0].apply_fenced(entity, 5, {"v": 1})
            assert await parts[0].record_dead_letter(entity, 5, "boom")
        assert await tool.request_redrive(requested_before) == [requested_before]
        # The reshard pauses in its transaction right after it moved the redrive requests,
        # until the test lets it go (it waits for an advisory lock the test holds).
        await paused.execute("SELECT pg_advisory_lock($1)", PAUSE_KEY)
        await paused.execute(f"""
            CREATE FUNCTION pause_reshard() RETURNS trigger AS $$
            BEGIN
                PERFORM pg_advisory_lock({PAUSE_KEY});
                PERFORM pg_advisory_unlock({PAUSE_KEY});
                RETURN NULL;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER pause_reshard AFTER UPDATE ON {TABLE}_redrives
              FOR EACH STATEMENT EXECUTE FUNCTION pause_reshard();""")

        async def reshard() -> Any:
            async with PostgresFencedRepository(dsn, scope=rid) as admin:
                return await admin.reshard(3)

        resharding = asyncio.create_task(reshard())

        async def blocked_by(pid: int, wait_event: str | None = None) -> list[int]:
            """The backends of this database waiting for a lock ``pid`` holds."""
            found = await paused.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND ($2::text IS NULL OR wait_event = $2) "
                "AND $1 = ANY(pg_blocking_pids(pid))",
                pid,
                wait_event,
            )
            return [int(row["pid"]) for row in found]

        reshard_pid: list[int] = []

        async def pausing() -> bool:
            reshard_pid[:] = await blocked_by(paused.get_server_pid(), "advisory")
            return len(reshard_pid) == 1

        await eventually(pausing, message="the reshard pauses in its transaction")
        during = asyncio.gather(
            tool.request_redrive(requested_during), tool.request_redrive(requested_before)
        )

        async def waiting() -> bool:
            return len(await blocked_by(reshard_pid[0])) == 2

        await eventually(waiting, message="both redrive requests wait for the reshard's locks")
        assert not during.done(), "a redrive request waits for the reshard in progress"
        await paused.execute("SELECT pg_advisory_unlock($1)", PAUSE_KEY)
        assert await during == [[requested_during], [requested_before]]
        report = await resharding
        assert report.redrives_moved == 1 and report.duplicates_dropped == 0
        await paused.execute(f"DROP TRIGGER pause_reshard ON {TABLE}_redrives")
        homes = {
            e: shard_id(rid, new_layout.shard_of(e)) for e in (requested_before, requested_during)
        }
        requests = await rows(dsn, f"{TABLE}_redrives", rid)
        assert {e: [s for s, _ in where] for e, where in requests.items()} == {
            e: [home] for e, home in homes.items()
        }
        letters = await rows(dsn, f"{TABLE}_dead_letters", rid)
        assert {e: [s for s, _ in where] for e, where in letters.items()} == {
            e: [home] for e, home in homes.items()
        }
        # Each new shard's leader takes the requests of its own entities only.
        new_base, new = await sharded_repositories(dsn, rid, 3)
        try:
            taken: dict[str, int] = {}
            for k, part in enumerate(new):
                await part.record_epoch(report.fence_epoch + 1, "new")
                for entity in await part.take_redrives(report.fence_epoch + 1):
                    taken[entity] = k
            assert taken == {e: new_layout.shard_of(e) for e in homes}
        finally:
            await new_base.close()
    finally:
        await paused.close()
        await tool.close()
        await base.close()


async def test_redrive_requests_takes_and_reshards_together_never_deadlock(dsn: str) -> None:
    rid = fresh_id()
    layouts = [3, 5, 2, 4]
    entities = [f"ns-{i % 3}/dev-{i}" for i in range(30)]
    base, parts = await sharded_repositories(dsn, rid, 4)
    initial = ShardAssignment(4)
    for k, part in enumerate(parts):
        await part.record_epoch(1, f"old-{k}")
    for entity in entities:
        k = initial.shard_of(entity)
        assert await parts[k].apply_fenced(entity, 1, {"v": 1})
        assert await parts[k].record_dead_letter(entity, 1, "boom")
    errors: list[BaseException] = []
    requested: set[str] = set()
    taken: set[str] = set()
    epochs = iter(range(1_000, 10**9, 1_000))  # each take above any fence before it
    stop = asyncio.Event()
    scopes = [PostgresFencedRepository(dsn, scope=shard_id(rid, k)) for k in range(max(layouts))]
    tool = PostgresFencedRepository(dsn)

    async def guarded(step: Any) -> None:
        while not stop.is_set():
            try:
                await step()
            except Exception as exc:
                errors.append(exc)
                return
            await asyncio.sleep(0)

    async def request_all() -> None:
        requested.update(await tool.request_redrive(scope=None))

    async def request_one() -> None:
        requested.update(await tool.request_redrive(secrets.choice(entities)))

    def take(repository: PostgresFencedRepository) -> Any:
        async def step() -> None:
            taken.update(await repository.take_redrives(next(epochs)))

        return step

    async def write_old() -> None:  # the old layout's writers, refused once resharded
        entity = secrets.choice(entities)
        k = initial.shard_of(entity)
        await parts[k].apply_fenced(entity, 1, {"v": 2})
        await parts[k].record_dead_letter(entity, 1, "again")

    workers = [
        asyncio.create_task(guarded(step))
        for step in (request_all, request_all, request_one, write_old)
    ] + [asyncio.create_task(guarded(take(repository))) for repository in scopes]
    try:
        async with PostgresFencedRepository(dsn, scope=rid) as admin:
            for shards in layouts * 3:
                if errors:
                    break
                await admin.reshard(shards)
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.gather(*workers)
        for repository in [*scopes, tool]:
            await repository.close()
        await base.close()
    assert errors == []
    final = ShardAssignment(layouts[-1])
    requests = await rows(dsn, f"{TABLE}_redrives", rid)
    for entity, where in requests.items():
        assert [s for s, _ in where] == [shard_id(rid, final.shard_of(entity))], entity
    letters = await rows(dsn, f"{TABLE}_dead_letters", rid)
    assert set(letters) == set(entities)
    for entity, where in letters.items():
        assert [s for s, _ in where] == [shard_id(rid, final.shard_of(entity))], entity
    assert requested and requested <= taken | set(requests), "no redrive request lost"


# -- a replica of the previous release (rolling upgrade) -----------------------------------


def previous_release_record_sql() -> str:
    """How a release without the layout check records an epoch: plain lease equality."""
    return f"""
        INSERT INTO {TABLE}_epochs AS led (scope, epoch, lease, holder)
        VALUES ($1, $2, $3, $4)
        ON CONFLICT (scope) DO UPDATE
           SET epoch = GREATEST(led.epoch, EXCLUDED.epoch),
               lease = EXCLUDED.lease,
               holder = CASE WHEN EXCLUDED.epoch > led.epoch OR led.holder IS NULL
                             THEN EXCLUDED.holder ELSE led.holder END
         WHERE led.lease IS NULL OR led.lease = EXCLUDED.lease
        RETURNING epoch, holder
    """


async def test_no_epoch_of_either_release_is_recorded_while_the_reshard_checks(dsn: str) -> None:
    # The check sees every lease that led until the commit: while it runs, a replica of the
    # previous release (which locks only its shard's row) cannot record an epoch either.
    rid = fresh_id()
    base, parts = await sharded_repositories(dsn, rid, 3)
    await base.close()
    outcomes: dict[str, str] = {}

    async def check(reconciler_id: str, old_leases: tuple[str, ...]) -> None:
        assert old_leases == tuple(shard_id(reconciler_id, k) for k in range(3))
        connection = await asyncpg.connect(dsn)
        try:
            await connection.execute("SET lock_timeout = '300ms'")
            for release, record in (
                ("previous", previous_release_record_sql()),
                ("this", "SELECT 1 FROM " + TABLE + "_epochs WHERE scope = $1 FOR SHARE"),
            ):
                scope = shard_id(reconciler_id, 0) if release == "previous" else reconciler_id
                args = (scope, 9, scope, "late") if release == "previous" else (scope,)
                try:
                    await connection.fetchrow(record, *args)
                    outcomes[release] = "recorded"
                except asyncpg.LockNotAvailableError:
                    outcomes[release] = "waited"
        finally:
            await connection.close()

    try:
        async with PostgresFencedRepository(dsn, scope=rid) as admin:
            report = await admin.reshard(2, check=check)
        assert outcomes == {"previous": "waited", "this": "waited"}
        assert report.fence_epoch == 1
    finally:
        for part in parts:
            await part.close()


async def test_a_previous_release_replica_never_leads_a_resharded_shard(dsn: str) -> None:
    rid = fresh_id()
    base, old = await sharded_repositories(dsn, rid, 4)
    connection = await asyncpg.connect(dsn)
    try:
        await old[0].record_epoch(3, "old-release")
        # Without a reshard, the previous release records epochs as before (rolling
        # upgrades and rollbacks keep working).
        recorded = await connection.fetchrow(
            previous_release_record_sql(), shard_id(rid, 1), 4, shard_id(rid, 1), "previous"
        )
        assert recorded is not None and int(recorded["epoch"]) == 4
        await old[1].record_epoch(5, "this-release")
        async with PostgresFencedRepository(dsn, scope=rid) as admin:
            report = await admin.reshard(3)
        fence = report.fence_epoch
        # Each shard scope names its lease qualified by the new layout...
        leases = dict(
            await connection.fetch(
                f"SELECT scope, lease FROM {TABLE}_epochs WHERE starts_with(scope, $1)",
                f"{rid}-shard-",
            )
        )
        assert leases == {shard_id(rid, k): f"{shard_id(rid, k)}@shards=3" for k in range(4)}
        # ... so a previous-release replica (above the fence: its epoch floor) is refused
        # by the server in every shard scope, old and new.
        for k in range(4):
            refused = await connection.fetchrow(
                previous_release_record_sql(), shard_id(rid, k), fence + 7, shard_id(rid, k), "p"
            )
            assert refused is None, k
        # So are this release's replicas of the old layout, by their layout check.
        with pytest.raises(ShardLayoutError):
            await old[0].record_epoch(fence + 7, "old-layout")
        # A replica of the new layout leads every shard, and the qualified lease stays.
        new_base, new = await sharded_repositories(dsn, rid, 3)
        try:
            for part in new:
                await part.record_epoch(fence + 1, "new-layout")
            entity = ENTITIES[0]
            home = ShardAssignment(3).shard_of(entity)
            assert await new[home].apply_fenced(entity, fence + 1, {"by": "new"})
        finally:
            await new_base.close()
        assert await scope_lease(dsn, shard_id(rid, 0)) == f"{shard_id(rid, 0)}@shards=3"
        epochs = dict(
            await connection.fetch(
                f"SELECT scope, epoch FROM {TABLE}_epochs WHERE starts_with(scope, $1)",
                f"{rid}-shard-",
            )
        )
        assert epochs == {shard_id(rid, k): fence + (k < 3) for k in range(4)}
        placed = await rows(dsn, TABLE, rid)
        assert placed == {ENTITIES[0]: [(shard_id(rid, home), fence + 1)]}
    finally:
        await connection.close()
        await base.close()


# -- refusals --------------------------------------------------------------------------------


async def test_an_entity_fenced_in_two_shard_scopes_is_refused_and_nothing_changes(
    dsn: str,
) -> None:
    rid = fresh_id()
    base, parts = await sharded_repositories(dsn, rid, 2)
    layout = ShardAssignment(2)
    entity = ENTITIES[0]
    k = layout.shard_of(entity)
    try:
        for part in parts:
            await part.record_epoch(4, "h")
        assert await parts[k].apply_fenced(entity, 4, {"v": 1})
        # A row of the same entity in the other shard's scope (a layout once changed by hand).
        async with PostgresFencedRepository(dsn, scope=shard_id(rid, 1 - k)) as stray:
            stray.bind_loop(reconciler_id=shard_id(rid, 1 - k), tenancy=kr.Tenancy.TENANT_SCOPED)
            assert await stray.apply_fenced(entity, 9, {"v": "stray"})
        before = await rows(dsn, TABLE, rid)
        async with PostgresFencedRepository(dsn, scope=rid) as admin:
            with pytest.raises(kr.ConfigError) as refused:
                await admin.reshard(3)
        message = str(refused.value)
        assert repr(entity) in message and "two shard scopes" in message
        assert repr(shard_id(rid, 0)) in message and repr(shard_id(rid, 1)) in message
        assert "DELETE FROM" in message and "Nothing changed" in message
        assert await rows(dsn, TABLE, rid) == before
        await parts[0].record_epoch(5, "h")  # still the layout, and not fenced
        # Duplicate redrive requests (no epoch to compare) are merged, and counted.
        connection = await asyncpg.connect(dsn)
        try:
            await connection.execute(
                f"DELETE FROM {TABLE} WHERE scope = $1 AND entity_id = $2",
                shard_id(rid, 1 - k),
                entity,
            )
            await connection.execute(
                f"INSERT INTO {TABLE}_redrives (scope, entity_id) VALUES ($1, $3), ($2, $3)",
                shard_id(rid, 0),
                shard_id(rid, 1),
                entity,
            )
        finally:
            await connection.close()
        async with PostgresFencedRepository(dsn, scope=rid) as admin:
            report = await admin.reshard(3)
        assert report.duplicates_dropped == 1
        requests = await rows(dsn, f"{TABLE}_redrives", rid)
        assert [s for s, _ in requests[entity]] == [
            shard_id(rid, ShardAssignment(3).shard_of(entity))
        ]
    finally:
        await base.close()


async def test_the_reshard_command_refuses_bad_counts_alike_and_creates_no_table(
    dsn: str,
) -> None:
    # An empty database (a wrong URL): nothing is created, and the message says why.
    code, _, err = await run_cli(
        "reshard", "--reconciler", "devices", "--shards", "3", "--leases", "postgres", dsn=dsn
    )
    assert code == 2 and "missing" in err and "changed nothing" in err, err
    connection = await asyncpg.connect(dsn)
    try:
        assert await connection.fetchval("SELECT to_regclass($1)", TABLE) is None
        assert await connection.fetchval("SELECT to_regclass($1)", f"{TABLE}_epochs") is None
    finally:
        await connection.close()
    for shards in ("0", "5000"):
        code, _, err = await run_cli(
            "reshard",
            "--reconciler",
            "devices",
            "--shards",
            shards,
            "--leases",
            "postgres",
            dsn=dsn,
        )
        assert code == 2 and f"from 1 to 1024, got {shards}" in err, err
    async with PostgresFencedRepository(dsn) as repository:
        await repository.migrate()
    code, _, err = await run_cli(
        "reshard", "--reconciler", "never", "--shards", "3", "--leases", "postgres", dsn=dsn
    )
    assert code == 2 and "was never led nor sharded" in err and "None" not in err, err
    code, out, _ = await run_cli("reshard", "--help", dsn=dsn)
    assert "explicit scope" in out
