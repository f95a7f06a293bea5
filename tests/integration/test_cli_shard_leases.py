"""``kopf-reconcile leases`` groups a sharded reconciler's leases: its shards in order
(``-shard-10`` after ``-shard-2``), then one line naming which holder leads which shards
at which epochs, and how many replicas are members."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_commands import BIN, command

from kopf_reconcile.leader.postgres import PostgresLeaseElector

pytestmark = pytest.mark.skipif(
    not (BIN / "kopf-reconcile").exists(), reason="the package's script"
)


async def test_leases_group_the_shards_of_a_reconciler(
    embedded_postgres_dsn: str, tmp_path: Path
) -> None:
    secret = tmp_path / "database-url"
    secret.write_text(embedded_postgres_dsn + "\n")
    async with (
        PostgresLeaseElector(embedded_postgres_dsn, holder_id="replica-a") as a,
        PostgresLeaseElector(embedded_postgres_dsn, holder_id="replica-b") as b,
    ):
        for elector, shards in ((a, (2, 10)), (b, (0, 1))):
            for k in shards:
                await elector.acquire_lease(f"devices-shard-{k}")
        await a.acquire_lease("devices-member-0")
        await b.acquire_lease("devices-member-1")
        status, out, err = await command(
            "leases", f"--kubeconfig={tmp_path / 'absent'}", f"--database-url-file={secret}"
        )
    assert status == 1, err  # no cluster here; the database's leases are shown all the same
    table = out.split("PostgreSQL leases", 1)[1].splitlines()
    names = [line.split()[1] for line in table if "devices-" in line and "shards" not in line]
    assert names == [
        "devices-shard-0",
        "devices-shard-1",
        "devices-shard-2",
        "devices-shard-10",
        "devices-member-0",
        "devices-member-1",
    ]
    [summary] = [line.strip() for line in table if "shards (shard@epoch)" in line]
    assert summary == (
        "devices: 4 shards (shard@epoch) — replica-b: 0@1, 1@1; replica-a: 2@1, 10@1 — 2 member(s)"
    )
