"""`kubectl reconcile dead-letters`, `redrive` and `status` against a leading Loop: Kubernetes
Leases (both tiers), dead letters in a real PostgreSQL, queue figures from the leader's
endpoint."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

import kopf_reconcile as kr
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.integration.endpoints import Endpoints
from support import eventually, run_cli

BIN = Path(sys.executable).parent
RID = "devices"

pytestmark = pytest.mark.skipif(
    not (BIN / "kubectl").exists(), reason="kubectl comes from `make tools`"
)


async def kubectl(*args: str, dsn: str) -> tuple[int, str, str]:
    return await run_cli(*args, dsn=dsn, via_kubectl=True)


def row_of(out: str, *words: str) -> str:
    return next(line for line in out.splitlines() if all(f" {w} " in f" {line} " for w in words))


async def test_dead_letters_redrive_and_status(kube: Any, kube_namespace: str, dsn: str) -> None:
    ns = kube_namespace
    broken = {f"{ns}/bad"}

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id in broken:
            raise kr.PermanentError("spec.desired must be on, off or standby, got 'sideways'")

    elector = kr.KubernetesLeaseElector(
        namespace=ns, kubeconfig=kube.kubeconfig, holder_id="replica-a"
    )
    repository = PostgresFencedRepository(dsn)
    loop = (
        kr.Builder(reconcile, kr.Tenancy.TENANT_SCOPED)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(elector)
        .with_fenced_repo(repository)
        .with_reconciler_id(RID)
        .with_renew_interval(0.5)
        .with_redrive_interval(0.1)
        .build()
    )
    endpoints = Endpoints(
        "127.0.0.1",
        0,
        ready=lambda: True,
        report=lambda: {
            RID: {**dataclasses.asdict(loop.stats()), "leader": loop.stats().is_leader}
        },
    )
    url = await endpoints.start()
    try:
        async with loop:
            await eventually(lambda: loop.stats().is_leader, timeout=20, message="leading")
            await loop.enqueue(kr.Request(f"{ns}/bad"))
            await loop.enqueue(kr.Request(f"{ns}/good"))

            async def listed() -> bool:
                code, out, _ = await kubectl("dead-letters", "-n", ns, dsn=dsn)
                return code == 0 and f"{ns}/bad" in out

            await eventually(listed, timeout=20, message="the dead letter listed")
            code, out, err = await kubectl("dead-letters", "-n", ns, "--reconciler", RID, dsn=dsn)
            assert code == 0, err
            row = row_of(out, RID, f"{ns}/bad")
            assert "sideways" in row and f" {loop.stats().epoch} " in row
            assert f"{ns}/good" not in out
            code, out, _ = await kubectl("dead-letters", "-n", "elsewhere", dsn=dsn)
            assert code == 0 and "no dead letters" in out

            code, out, err = await kubectl(
                "status", f"--kubeconfig={kube.kubeconfig}", "-n", ns, "--endpoint", url, dsn=dsn
            )
            assert code == 0, err
            header = out.splitlines()[0]
            assert "FAILOVERS(1H)" in header and "DEAD LETTERS" in header, out
            row = row_of(out, RID, "replica-a")
            # namespace, id, holder, epoch, since, failovers, dead letters, queued, in flight
            cells = row.split()
            assert cells[3] == str(loop.stats().epoch)
            assert cells[5:] == ["0", "1", "0", "0"], out  # the first leader: no failover
            # Without a database and endpoints: the Lease alone (taken within the hour).
            code, out, err = await kubectl(
                "status", f"--kubeconfig={kube.kubeconfig}", "-n", ns, dsn=""
            )
            assert code == 0, err
            assert row_of(out, RID, "replica-a").split()[5:] == [">=1", "-", "-", "-"], out

            broken.clear()
            code, out, err = await kubectl("redrive", f"{ns}/bad", dsn=dsn)
            assert code == 0, err
            assert "asked the leader to retry 1 entity" in out

            async def cleared() -> bool:
                return await repository.list_dead_letters() == []

            await eventually(cleared, timeout=20, message="redriven and cleared")
            code, _, err = await kubectl("redrive", "--all", dsn=dsn)
            assert code == 1 and "no dead letter to redrive" in err
    finally:
        await endpoints.stop()
        await elector.close()
        await repository.close()


async def test_the_commands_need_a_database_and_an_entity_or_all(tmp_path: Path) -> None:
    code, _, err = await kubectl("dead-letters", dsn="")
    assert code == 2 and "KOPF_RECONCILE_DATABASE_URL" in err
    code, _, err = await kubectl("redrive", dsn="postgresql://127.0.0.1:1/x")
    assert code == 2 and "ENTITY" in err


async def test_status_drops_the_record_of_a_lease_store_left_behind(
    kube: Any, kube_namespace: str, dsn: str
) -> None:
    """Switched from PostgreSQL leases to Kubernetes Leases: the released row stays in the
    database, and status shows the reconciler once, as its Lease has it."""
    rows = kr.PostgresLeaseElector(dsn, holder_id="replica-before")
    leases = kr.KubernetesLeaseElector(
        namespace=kube_namespace, kubeconfig=kube.kubeconfig, holder_id="replica-after"
    )
    try:
        await rows.release_lease(await rows.acquire_lease(RID))
        status = ("status", f"--kubeconfig={kube.kubeconfig}", "-n", kube_namespace)
        code, out, err = await kubectl(*status, dsn=dsn)
        assert code == 0, err
        assert row_of(out, "(postgresql)", RID)  # the only record: still shown
        token = await leases.acquire_lease(RID)
        code, out, err = await kubectl(*status, dsn=dsn)
        assert code == 0, err
        assert [line for line in out.splitlines()[1:] if RID in line] == [
            row_of(out, kube_namespace, RID, "replica-after")
        ], out
        assert str(token.epoch) in row_of(out, RID).split()
    finally:
        await rows.close()
        await leases.close()
