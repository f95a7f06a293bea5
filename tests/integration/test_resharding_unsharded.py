"""From unsharded to sharded and back, and the commands that see a reconciler's shards.

On a real PostgreSQL:

- ``reshard`` of a scope led unsharded moves its rows, dead letters and redrive requests
  to the shard scopes of the new layout and fences the old scope (an unsharded leader's
  next epoch and late writes are refused); ``reshard --shards 1`` moves them back.
- The hint a replica refused for its layout logs is a command that succeeds, both ways.
- A rolling change from 1 to N shards, and back from N to 1, with replicas of both
  layouts running: the new layout leads once the old replicas are gone and the command
  ran, above the fence, and writes every entity in its new scope.
- ``dead-letters``, ``redrive --all`` and ``status`` given ``--reconciler <id>`` include
  its shard scopes ``<id>-shard-<k>``, never another scope that starts the same way.
- ``reshard`` to fewer shards names the leases it retired and the command deleting them.
"""

from __future__ import annotations

import re
import secrets

import asyncpg
import pytest

import kopf_reconcile as kr
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.fencing.protocol import ShardLayoutError
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.sharding import ShardAssignment, shard_id
from replicas import Replica, rows
from support import eventually, run_cli

TABLE = "kopf_reconcile_fence"
ENTITIES = [f"ns-{i % 4}/dev-{i}" for i in range(40)]


def fresh_id() -> str:
    return f"devices-{secrets.token_hex(3)}"


async def scoped_rows(dsn: str, table: str, rid: str) -> dict[str, list[str]]:
    """entity -> the scopes of ``table`` holding it, among ``rid`` and its shard scopes."""
    return {e: [scope for scope, _ in where] for e, where in (await rows(dsn, table, rid)).items()}


async def released_lease(dsn: str, name: str) -> None:
    """The lease record a stopped replica leaves in PostgreSQL: recorded, released."""
    async with PostgresLeaseElector(dsn, holder_id="stopped-replica") as elector:
        await elector.release_lease(await elector.acquire_lease(name))


async def test_reshard_shards_an_unsharded_scope_and_fences_it(dsn: str) -> None:
    rid = fresh_id()
    unsharded = PostgresFencedRepository(dsn)
    unsharded.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.TENANT_SCOPED)
    try:
        await unsharded.record_epoch(3, "unsharded-leader")
        for entity in ENTITIES:
            assert await unsharded.apply_fenced(entity, 3, {"id": entity})
        letters = ENTITIES[:5]
        for entity in letters:
            assert await unsharded.record_dead_letter(entity, 3, "boom")
        assert await unsharded.request_redrive(letters[0]) == [letters[0]]
        async with PostgresFencedRepository(dsn, scope=rid) as admin:
            report = await admin.reshard(4)
        assert (report.old_layout, report.new_layout) == (rid, f"{rid}/shards=4")
        assert (report.old_shards, report.fence_epoch) == (1, 4)
        assert report.dead_letters_moved == 5 and report.redrives_moved == 1
        layout = ShardAssignment(4)
        for table, expected in (
            (TABLE, ENTITIES),
            (f"{TABLE}_dead_letters", letters),
            (f"{TABLE}_redrives", letters[:1]),
        ):
            placed = await scoped_rows(dsn, table, rid)
            assert placed == {e: [shard_id(rid, layout.shard_of(e))] for e in expected}, table
        # The old scope is fenced: the unsharded leader's late writes and its next epoch
        # are refused, the latter as a layout refusal that names a command that works.
        assert not await unsharded.apply_fenced(ENTITIES[0], 3, {"late": True})
        assert not await unsharded.record_dead_letter(ENTITIES[9], 3, "late")
        with pytest.raises(ShardLayoutError, match=rf"--reconciler {rid} --shards 1 "):
            await unsharded.record_epoch(9, "unsharded-leader")
        # The new layout's shards lead above the fence, and find each entity's state.
        base = PostgresFencedRepository(dsn)
        base.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.TENANT_SCOPED)
        try:
            await base.record_shard_count(4)
            for k in range(4):
                part = base.for_shard(k)
                part.bind_loop(reconciler_id=shard_id(rid, k), tenancy=kr.Tenancy.TENANT_SCOPED)
                with pytest.raises(kr.StaleEpochError):
                    await part.record_epoch(report.fence_epoch, "new")
                await part.record_epoch(report.fence_epoch + 1, "new")
                mine = [e for e in ENTITIES if layout.shard_of(e) == k]
                assert [await part.get_state(e) for e in mine] == [{"id": e} for e in mine]
                assert {d.entity_id for d in await part.dead_letters()} == {
                    e for e in letters if layout.shard_of(e) == k
                }
        finally:
            await base.close()
    finally:
        await unsharded.close()


async def test_reshard_to_one_shard_makes_a_sharded_scope_unsharded_again(dsn: str) -> None:
    rid = fresh_id()
    base = PostgresFencedRepository(dsn)
    base.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.TENANT_SCOPED)
    try:
        await base.record_shard_count(3)
        parts = []
        for k in range(3):
            part = base.for_shard(k)
            part.bind_loop(reconciler_id=shard_id(rid, k), tenancy=kr.Tenancy.TENANT_SCOPED)
            await part.record_epoch(5 + k, "sharded")
            parts.append(part)
        layout = ShardAssignment(3)
        for entity in ENTITIES:
            k = layout.shard_of(entity)
            assert await parts[k].apply_fenced(entity, 5 + k, {"id": entity})
        async with PostgresFencedRepository(dsn, scope=rid) as admin:
            with pytest.raises(kr.ConfigError, match="needs shards >= 2"):
                await admin.reshard(1, by_namespace=True)
            report = await admin.reshard(1)
            assert (report.new_layout, report.fence_epoch) == (rid, 8)
            with pytest.raises(kr.ConfigError, match="already unsharded"):
                await admin.reshard(1)
        assert await scoped_rows(dsn, TABLE, rid) == {e: [rid] for e in ENTITIES}
        for k, part in enumerate(parts):  # the old layout is fenced in every shard scope
            assert not await part.apply_fenced(ENTITIES[0], 5 + k, {"late": True})
            with pytest.raises(ShardLayoutError):
                await part.record_epoch(20, "sharded")
        async with PostgresFencedRepository(dsn) as unsharded:
            unsharded.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.TENANT_SCOPED)
            assert await unsharded.highest_epoch() == 8  # a new lease's floor
            await unsharded.record_epoch(9, "unsharded")
            assert await unsharded.get_state(ENTITIES[3]) == {"id": ENTITIES[3]}
            assert await unsharded.apply_fenced(ENTITIES[3], 9, {"id": "again"})
        # A shard's own scope is not a reconciler's base scope.
        async with PostgresFencedRepository(dsn, scope=shard_id(rid, 0)) as admin:
            with pytest.raises(kr.ConfigError, match="is a shard's"):
                await admin.reshard(2)
    finally:
        await base.close()


def advised(message: str) -> list[str]:
    """The arguments of the ``kopf-reconcile reshard`` command a refusal advises."""
    found = re.search(r"`kopf-reconcile (reshard [^`]*)`", message)
    assert found is not None, message
    return found[1].replace("kubernetes|postgres", "postgres").split()


async def test_the_layout_refusal_hint_is_a_command_that_works(dsn: str) -> None:
    # Sharded replica, scope led unsharded: the hint shards it.
    rid = fresh_id()
    async with PostgresFencedRepository(dsn) as unsharded:
        unsharded.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.SINGLE_TENANT)
        await unsharded.record_epoch(2, "unsharded-leader")
    await released_lease(dsn, rid)
    async with PostgresFencedRepository(dsn) as base:
        base.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.SINGLE_TENANT)
        with pytest.raises(ShardLayoutError) as refused:
            await base.record_shard_count(4)
        code, out, err = await run_cli(*advised(str(refused.value)), dsn=dsn)
        assert code == 0, err
        assert f"{rid} -> {rid}/shards=4" in out
        await base.record_shard_count(4)
    # Unsharded replica, scope sharded: the hint unshards it.
    for k in range(4):
        await released_lease(dsn, shard_id(rid, k))
    async with PostgresFencedRepository(dsn) as unsharded:
        unsharded.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.SINGLE_TENANT)
        with pytest.raises(ShardLayoutError) as refused:
            await unsharded.record_epoch(50, "unsharded-leader")
        code, out, err = await run_cli(*advised(str(refused.value)), dsn=dsn)
        assert code == 0, err
        assert f"{rid}/shards=4 -> {rid}," in out
        await unsharded.record_epoch(50, "unsharded-leader")


# -- rolling changes of the layout, replicas of both layouts running ------------------------


async def written_by(dsn: str, rid: str, layout: ShardAssignment, above: int) -> bool:
    """Every entity has one row, in its scope under ``layout``, written above ``above``."""
    placed = await rows(dsn, TABLE, rid)

    def home(entity: str) -> str:
        return rid if layout.shards == 1 else shard_id(rid, layout.shard_of(entity))

    return set(placed) == set(ENTITIES) and all(
        len(where) == 1 and where[0][0] == home(e) and where[0][1] > above
        for e, where in placed.items()
    )


async def rolling_change(dsn: str, rid: str, old: Replica, new: Replica, shards: int) -> int:
    """Old replica leading, new one refused; the old one stops, the command runs, the new
    one leads above the fence and writes every entity in its new scope. The fence."""
    await old.start()
    await eventually(lambda: old.leads_all(0), timeout=30, message=f"old leads: {old.loop!r}")
    await new.start()
    # Refused for its layout (logged with a command): it leads nothing, and waits.
    await eventually(new.refused_for_its_layout, timeout=30, message="new layout refused")
    assert not new.loop.stats().is_leader
    await old.stop()  # the rollout is done: no replica of the old layout runs
    code, out, err = await run_cli(
        "reshard", "--reconciler", rid, "--shards", str(shards), "--leases", "postgres", dsn=dsn
    )
    assert code == 0, err
    fence = int(re.search(r"fence epoch (\d+)", out)[1])  # type: ignore[index]
    await eventually(lambda: new.leads_all(fence), timeout=90, message=f"new: {new.loop!r}")
    layout = ShardAssignment(shards)

    async def all_written() -> bool:
        return await written_by(dsn, rid, layout, fence)

    await eventually(all_written, timeout=30, message="every entity in its new scope")
    return fence


async def test_a_rolling_change_from_unsharded_to_sharded_and_back(dsn: str) -> None:
    rid = fresh_id()
    replicas = [
        Replica(dsn, rid, "unsharded-old", 1, ENTITIES),
        Replica(dsn, rid, "sharded", 3, ENTITIES),
        Replica(dsn, rid, "unsharded-new", 1, ENTITIES),
    ]
    try:
        first = await rolling_change(dsn, rid, replicas[0], replicas[1], 3)
        second = await rolling_change(dsn, rid, replicas[1], replicas[2], 1)
        assert second > first
    finally:
        for replica in reversed(replicas):
            await replica.stop()


# -- commands that see a reconciler's shards -------------------------------------------------


async def test_dead_letters_redrive_and_status_by_reconciler_include_its_shards(
    dsn: str,
) -> None:
    rid = fresh_id()
    layout = ShardAssignment(3)
    base = PostgresFencedRepository(dsn)
    base.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.TENANT_SCOPED)
    # Scopes that merely start like the reconciler's shard scopes belong to others.
    strangers = [f"{rid}-shard-1-extra", f"{rid}-shard-", f"{rid}x"]
    try:
        await base.record_shard_count(3)
        letters: list[str] = []
        async with PostgresLeaseElector(dsn, holder_id="leader") as elector:
            for k in range(3):
                token = await elector.acquire_lease(shard_id(rid, k))
                part = base.for_shard(k)
                part.bind_loop(reconciler_id=shard_id(rid, k), tenancy=kr.Tenancy.TENANT_SCOPED)
                await part.record_epoch(token.epoch, "leader")
                entity = next(e for e in ENTITIES if layout.shard_of(e) == k)
                assert await part.record_dead_letter(entity, token.epoch, f"boom {k}")
                letters.append(entity)
            for stranger in strangers:
                async with PostgresFencedRepository(dsn, scope=stranger) as other:
                    other.bind_loop(reconciler_id=stranger, tenancy=kr.Tenancy.TENANT_SCOPED)
                    await other.record_epoch(1, "other")
                    assert await other.record_dead_letter("ns/stranger", 1, "theirs")
                await elector.acquire_lease(stranger)
            code, out, err = await run_cli("dead-letters", "--reconciler", rid, dsn=dsn)
            assert code == 0, err
            for k, entity in enumerate(letters):
                assert f"{shard_id(rid, k)}" in out and entity in out, out
            assert "ns/stranger" not in out, out
            code, out, err = await run_cli("redrive", "--all", "--reconciler", rid, dsn=dsn)
            assert code == 0, err
            assert f"retry {len(letters)} entities: {', '.join(sorted(letters))}" in out, out
            connection = await asyncpg.connect(dsn)
            try:
                requested = await connection.fetch(
                    f"SELECT scope FROM {TABLE}_redrives WHERE entity_id = 'ns/stranger'"
                )
            finally:
                await connection.close()
            assert requested == []
            code, out, err = await run_cli(
                "status", "--reconciler", rid, "--kubeconfig", "/nonexistent", dsn=dsn
            )
            shown = [line.split()[1] for line in out.splitlines()[1:] if line.strip()]
            assert sorted(shown) == sorted(shard_id(rid, k) for k in range(3)), out
            for line in out.splitlines()[1:]:
                assert line.split()[6] == "1", out  # each shard's own dead letter
    finally:
        await base.close()


async def test_reshard_to_fewer_shards_names_the_retired_leases_and_how_to_delete_them(
    dsn: str,
) -> None:
    rid = fresh_id()
    base = PostgresFencedRepository(dsn)
    base.bind_loop(reconciler_id=rid, tenancy=kr.Tenancy.TENANT_SCOPED)
    try:
        await base.record_shard_count(4)
    finally:
        await base.close()
    async with PostgresLeaseElector(dsn, holder_id="stopped-replica") as elector:
        for name in [*(shard_id(rid, k) for k in range(4)), f"{rid}-member-0", f"{rid}-member-3"]:
            await elector.release_lease(await elector.acquire_lease(name))
    code, out, err = await run_cli(
        "reshard", "--reconciler", rid, "--shards", "2", "--leases", "postgres", dsn=dsn
    )
    assert code == 0, err
    retired = [f"{rid}-shard-2", f"{rid}-shard-3", f"{rid}-member-2", f"{rid}-member-3"]
    assert f"leases the new layout never uses: {', '.join(retired)}" in out, out
    statement = re.search(r"(DELETE FROM .*\))", out)
    assert statement is not None, out
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(statement[1])
        left = await connection.fetch(
            "SELECT reconciler_id FROM kopf_reconcile_lease WHERE starts_with(reconciler_id, $1)",
            rid,
        )
    finally:
        await connection.close()
    assert sorted(r["reconciler_id"] for r in left) == [
        f"{rid}-member-0",
        f"{rid}-shard-0",
        f"{rid}-shard-1",
    ]


async def test_another_reconcilers_scope_is_a_configuration_error_not_a_layout_to_reshard(
    dsn: str,
) -> None:
    # A layout refusal advises a reshard of the scope; another reconciler's scope must not
    # get that advice (resharding it would take the other reconciler's rows): it is refused
    # for good, as any scope numbered by another lease.
    scope, mine, other = fresh_id(), fresh_id(), fresh_id()
    async with PostgresFencedRepository(dsn, scope=scope) as unsharded:
        unsharded.bind_loop(reconciler_id=other, tenancy=kr.Tenancy.SINGLE_TENANT)
        await unsharded.record_epoch(2, "other")
    async with PostgresFencedRepository(dsn, scope=scope) as base:
        base.bind_loop(reconciler_id=mine, tenancy=kr.Tenancy.SINGLE_TENANT)
        with pytest.raises(kr.ConfigError, match="not one of reconciler") as refused:
            await base.record_shard_count(3)
        assert not isinstance(refused.value, ShardLayoutError)
    sharded_scope = fresh_id()
    async with PostgresFencedRepository(dsn, scope=sharded_scope) as base:
        base.bind_loop(reconciler_id=other, tenancy=kr.Tenancy.SINGLE_TENANT)
        await base.record_shard_count(3)
    async with PostgresFencedRepository(dsn, scope=sharded_scope) as unsharded:
        unsharded.bind_loop(reconciler_id=mine, tenancy=kr.Tenancy.SINGLE_TENANT)
        with pytest.raises(kr.ConfigError, match="give this reconciler its own scope") as refused:
            await unsharded.record_epoch(1, "mine")
        assert not isinstance(refused.value, ShardLayoutError)
