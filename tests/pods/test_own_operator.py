"""Operators of the user's own, on a real node with pods: a scaffold, and a lifecycle.

- **A scaffolded operator.** ``kopf-reconcile init greeters`` in an empty folder, then
  installed as its README says (the project's image with ``--set-file
  handlers.inline=handlers.py``, ``-f chart-values.yaml``, ``--set-file
  crds.manifests=crds/greeters.yaml``): a Greeter converges, written at a leadership epoch.
- **Children and finalizers** (``operator/examples/websites.py``, installed with its CRD,
  ``related`` and ``watch[].finalizer`` values): a Website gets its ConfigMap and its row in
  PostgreSQL; the ConfigMap deleted by hand comes back; a Website deleted while every
  replica is stopped waits, held by the finalizer, and is cleaned up (row and object) once
  replicas run again. Through all of it the database accepted no stale write.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
import yaml
from node import PodNode
from release import Release, assert_no_stale_write, audited_database, built_image, pods_dsn

from kopf_reconcile.testing import audit
from kopf_reconcile.testing.postgres import EmbeddedPostgres
from support import eventually

pytestmark = [
    pytest.mark.pods,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="session"),
]

#: Where the node serves this module's database to the pods (test_deploy.py uses 5432).
DATABASE_PORT = 5433
#: The image the chart names by default, as README's `ctr images import` names it.
IMAGE_BASE_NAME = "docker.io/library/kopf-reconcile"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def database(
    pod_node: PodNode, embedded_postgres_server: EmbeddedPostgres
) -> AsyncIterator[str]:
    """A database of this module's own, audited and exposed to the pods; the image loaded."""
    await pod_node.import_image(built_image(), IMAGE_BASE_NAME)
    yield await audited_database(embedded_postgres_server, pod_node, DATABASE_PORT)


async def prepare_namespace(release: Release, dsn: str) -> None:
    """The release's namespace, and the Secret with the database URL the chart is given."""
    await release.kubectl("create", "namespace", release.namespace)
    url = pods_dsn(dsn, DATABASE_PORT)
    await release.kubectl(
        "create", "secret", "generic", f"{release.name}-db", f"--from-literal=database-url={url}"
    )


#: The reconcilers' ids: their fenced scopes in the shared database.
GREETERS = "greeters.example.com-reconcile-greeter"
WEBSITES = "websites.example.com-reconcile-website"


async def assert_audited_without_a_stale_write(dsn: str, scope: str) -> None:
    history = await audit.history(dsn, scope)
    assert any(isinstance(event, audit.Applied) for event in history), f"{scope}: no write audited"
    await assert_no_stale_write(dsn, scope)


# --- a scaffolded operator -------------------------------------------------------------------


async def test_a_scaffolded_operator_installs_and_converges(
    pod_node: PodNode, database: str, tmp_path: Path
) -> None:
    release = Release(pod_node, "greeters", "greeters")
    await release.shell([str(Path(sys.executable).parent / "kopf-reconcile"), "init", "greeters"],
                        cwd=tmp_path)  # fmt: skip
    await prepare_namespace(release, database)
    await release.helm_install(
        "-f", "chart-values.yaml", "--set-file=crds.manifests=crds/greeters.yaml",
        "--set-file=handlers.inline=handlers.py",
        f"--set=image.repository={IMAGE_BASE_NAME.rsplit('/', 1)[-1]}", "--set=image.tag=",
        cwd=tmp_path,
    )  # fmt: skip
    greeter = {
        "apiVersion": "example.com/v1", "kind": "Greeter",
        "metadata": {"name": "hello"}, "spec": {"greeting": "hello, pods"},
    }  # fmt: skip
    await release.kubectl("create", "-f", "-", stdin=yaml.safe_dump(greeter))

    async def greeted() -> bool:
        found = await release.get("greeters", "hello")
        status = (found or {}).get("status") or {}
        return status.get("greeting") == "hello, pods" and status.get("epoch", 0) >= 1

    await eventually(greeted, timeout=90, message="the Greeter converges at an epoch")
    await assert_audited_without_a_stale_write(database, GREETERS)
    await release.helm_uninstall()


# --- children and finalizers -----------------------------------------------------------------

WEBSITES_VALUES = {
    "replicaCount": 2,
    "database": {"existingSecret": "websites-db"},
    "watch": [{"apiGroup": "example.com", "resources": ["websites"], "finalizer": True}],
    "related": [{"apiGroup": "", "resources": ["configmaps"], "write": True}],
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def websites(pod_node: PodNode, database: str) -> AsyncIterator[Release]:
    release = Release(pod_node, "websites", "websites")
    await prepare_namespace(release, database)
    values = pod_node.log_dir / "websites-values.yaml"
    values.write_text(yaml.safe_dump(WEBSITES_VALUES))
    await release.helm_install(
        "-f", str(values), "--set-file=crds.manifests=crds/websites.yaml",
        "--set-file=handlers.inline=operator/examples/websites.py",
    )  # fmt: skip
    yield release
    await release.helm_uninstall()


async def website_row(dsn: str, entity: str) -> str | None:
    connection = await asyncpg.connect(dsn)
    try:
        exists = await connection.fetchval("SELECT to_regclass('websites') IS NOT NULL")
        if not exists:
            return None
        content: str | None = await connection.fetchval(
            "SELECT content FROM websites WHERE entity = $1", entity
        )
        return content
    finally:
        await connection.close()


async def test_a_childs_deletion_brings_it_back(websites: Release, database: str) -> None:
    site = {
        "apiVersion": "example.com/v1", "kind": "Website",
        "metadata": {"name": "home"}, "spec": {"content": "<h1>home</h1>"},
    }  # fmt: skip
    await websites.kubectl("create", "-f", "-", stdin=yaml.safe_dump(site))

    async def page() -> dict[str, Any] | None:
        found: dict[str, Any] | None = await websites.get("configmap", "home-page")
        return found

    async def served() -> bool:
        found = await page()
        return found is not None and await website_row(database, "websites/home") is not None

    await eventually(served, timeout=90, message="the Website's ConfigMap and row")
    first = await page()
    assert first is not None
    await websites.kubectl("delete", "configmap", "home-page")

    async def back() -> bool:
        found = await page()
        return found is not None and found["metadata"]["uid"] != first["metadata"]["uid"]

    await eventually(back, timeout=30, message="the ConfigMap comes back")
    await assert_audited_without_a_stale_write(database, WEBSITES)


async def test_a_deletion_while_no_replica_runs_is_cleaned_up_after_a_start(
    websites: Release, database: str
) -> None:
    site = {
        "apiVersion": "example.com/v1", "kind": "Website",
        "metadata": {"name": "gone"}, "spec": {"content": "bye"},
    }  # fmt: skip
    await websites.kubectl("create", "-f", "-", stdin=yaml.safe_dump(site))

    async def recorded() -> bool:
        return await website_row(database, "websites/gone") == "bye"

    await eventually(recorded, timeout=90, message="the Website is recorded")
    await websites.kubectl("scale", "deployment", websites.name, "--replicas=0")

    async def stopped() -> bool:
        return not [
            p for p in await websites.get("pods") if p["metadata"]["name"].startswith("websites")
        ]

    await eventually(stopped, timeout=120, message="every replica stopped")
    await websites.kubectl("delete", "website", "gone", "--wait=false")
    held = await websites.get("website", "gone")
    assert held is not None and held["metadata"].get("deletionTimestamp"), held
    assert held["metadata"]["finalizers"] == [f"example.com/{WEBSITES}"]
    assert await website_row(database, "websites/gone") == "bye"  # nobody cleaned up yet

    await websites.kubectl("scale", "deployment", websites.name, "--replicas=2")

    async def cleaned() -> bool:
        gone = await websites.get("website", "gone") is None
        return gone and await website_row(database, "websites/gone") is None

    await eventually(cleaned, timeout=120, message="cleaned up once replicas run")
    await assert_audited_without_a_stale_write(database, WEBSITES)
