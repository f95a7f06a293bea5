"""Example operator: Websites, each with a ConfigMap it owns and a row in PostgreSQL.

A ``Website`` (``crds/websites.yaml``) says in ``spec.content`` which page it serves.
The reconciler

1. keeps a ConfigMap ``<name>-page`` holding the page, owned by the Website (a
   controller owner reference), applied through the reconcile's fenced client
   (``kr.fenced_client()``: a deposed leader's late write is refused by the API
   server); ``owns=`` makes every change to that ConfigMap, its deletion by hand
   included, reconcile the Website, so it comes back at once;
   ``kr.owned(req)`` returns the Website's cached children;
2. records the Website in the table ``websites`` through the fenced writer (a leader
   that lost its lease is rejected by the database);
3. with ``finalizer=True`` the Website cannot disappear before the reconciler has
   removed its row: a Website deleted while no replica runs waits (with its
   ``deletionTimestamp``) until the operator starts again and cleans up. The
   ConfigMap goes with its owner (Kubernetes' garbage collector).

Run it like the Devices example: ``kubectl apply -f crds/websites.yaml``, then
``KOPF_RECONCILE_DATABASE_URL=postgresql://... kopf-reconcile run
operator/examples/websites.py --namespace=default``.
"""

from __future__ import annotations

from typing import Any

import asyncpg

import kopf_reconcile as kr

GROUP, VERSION, PLURAL = "example.com", "v1", "websites"
CONFIGMAPS = kr.Resource("", "v1", "configmaps")
MANAGED_BY = {"app.kubernetes.io/managed-by": "websites-example"}


@kr.reconciler(
    GROUP,
    VERSION,
    PLURAL,
    tenancy=kr.Tenancy.TENANT_SCOPED,
    owns=[kr.Owns("", "v1", "configmaps", labels=MANAGED_BY)],  # only ours are cached
    finalizer=True,
)
async def reconcile_website(req: kr.Request) -> None:
    body = kr.cached(req)
    writer = kr.fenced_writer()  # None in single-process mode
    if kr.is_deleting(body):  # being deleted (finalizer held), or gone
        if writer is not None:
            await writer.write(req.entity_id, _delete_row(req.entity_id))
        return None  # the finalizer is removed now; the ConfigMap goes with its owner

    assert body is not None
    content = str((body.get("spec") or {}).get("content", ""))
    page = f"{body['metadata']['name']}-page"
    if not any(
        c["metadata"]["name"] == page and (c.get("data") or {}).get("index.html") == content
        for c in kr.owned(req)
    ):
        await _apply_page(body, page, content)
    if writer is not None:
        await writer.write(req.entity_id, _upsert_row(req.entity_id, content))
    return None


def _upsert_row(entity_id: str, content: str) -> Any:
    async def upsert(connection: asyncpg.Connection) -> None:
        await connection.execute(
            "CREATE TABLE IF NOT EXISTS websites (entity text PRIMARY KEY, content text)"
        )
        await connection.execute(
            "INSERT INTO websites VALUES ($1, $2) "
            "ON CONFLICT (entity) DO UPDATE SET content = EXCLUDED.content",
            entity_id,
            content,
        )

    return upsert


def _delete_row(entity_id: str) -> Any:
    async def delete(connection: asyncpg.Connection) -> None:
        await connection.execute(
            "CREATE TABLE IF NOT EXISTS websites (entity text PRIMARY KEY, content text)"
        )
        await connection.execute("DELETE FROM websites WHERE entity = $1", entity_id)

    return delete


async def _apply_page(website: dict[str, Any], page: str, content: str) -> None:
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": page, "labels": MANAGED_BY},
        "data": {"index.html": content},
    }
    # Server-side apply, owned by the Website (a controller reference), fenced by the lease.
    await kr.fenced_client().apply(CONFIGMAPS, configmap, owner=website)
