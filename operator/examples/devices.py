"""Example operator: Devices whose desired power state is written to PostgreSQL, fenced.

A ``Device`` (``crds/devices.yaml``) says in ``spec.desired`` which power state
it should be in (``on``, ``off`` or ``standby``). The reconciler

1. reads the latest body the watch delivered (``kr.cached``); ``None`` means the
   Device was deleted;
2. writes the desired state through the fenced writer (``kr.fenced_writer``) into
   PostgreSQL: a leader that lost its lease, or a paused old leader, is rejected
   by the database;
3. patches ``status.observed`` (and ``status.epoch``, the leadership epoch that
   wrote it) through the status subresource, with the reconcile's fenced client
   (``kr.fenced_client``): a paused old leader's late patch is refused by the API
   server itself;
4. raises ``PermanentError`` for a state outside the vocabulary: retrying cannot
   help, so the Device is dead-lettered until its spec changes.

A Device whose status already reports its current spec is left alone. The
reconciler is registered with ``generation_changed=True``: the watch event of its
own status patch (which leaves ``metadata.generation`` as it was) is cached but
triggers no second reconcile; a spec change, a creation, a deletion and the
resyncs do. A status edited by hand is therefore corrected at the next resync.
A deleted Device gets a tombstone ``{"deleted": true}`` in the store.

Run it:

* ``kopf run operator/examples/devices.py --namespace=default`` — with no
  database configured this is single-process mode: no leader election, no
  fencing, and the reconciler only patches the status (with epoch 0);
* ``KOPF_RECONCILE_DATABASE_URL=postgresql://... kopf-reconcile run
  operator/examples/devices.py --namespace=default`` — any number of replicas;
  the lease holder reconciles and every write is fenced (see the README's
  Configuration section for the leader elector that is chosen).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

import kopf_reconcile as kr

GROUP, VERSION, PLURAL = "example.com", "v1", "devices"
DEVICES = kr.Resource(GROUP, VERSION, PLURAL)
POWER_STATES = ("on", "off", "standby")
HTTP_NOT_FOUND = 404


def _work_delay() -> float:
    raw = os.environ.get("DEVICES_WORK_DELAY", "0")
    try:
        delay = float(raw)
    except ValueError:
        delay = -1.0
    if not 0 <= delay < 60:
        raise kr.ConfigError(f"DEVICES_WORK_DELAY must be seconds in [0, 60), got {raw!r}")
    return delay


# Simulated device I/O before each write (seconds; 0 by default). The demo sets it so
# that a leader is paused or killed in the middle of its work.
WORK_DELAY = _work_delay()


def _shards() -> int:
    raw = os.environ.get("DEVICES_SHARDS", "1")
    try:
        return int(raw)
    except ValueError:
        raise kr.ConfigError(f"DEVICES_SHARDS must be a whole number, got {raw!r}") from None


# Shards of the Devices (1 by default: one leader). With N > 1 each shard is led under a
# lease of its own, so the replicas share the work (``kopf-reconcile demo --shards 8``).
SHARDS = _shards()
# With DEVICES_SHARD_BY_NAMESPACE=1 a namespace's Devices share a shard, and each replica
# watches only the namespaces of the shards it leads.
SHARD_BY_NAMESPACE = SHARDS > 1 and os.environ.get("DEVICES_SHARD_BY_NAMESPACE") == "1"


@kr.reconciler(
    GROUP,
    VERSION,
    PLURAL,
    tenancy=kr.Tenancy.TENANT_SCOPED,
    concurrency=8,
    generation_changed=True,  # our own status patches do not trigger us again
    shards=SHARDS,
    shard_by_namespace=SHARD_BY_NAMESPACE,
)
async def reconcile_device(req: kr.Request) -> kr.Result | None:
    body = kr.cached(req)
    writer = kr.fenced_writer()  # None in single-process mode
    if body is None:
        if writer is not None:
            await writer.write(req.entity_id, {"deleted": True})
        return None

    desired = (body.get("spec") or {}).get("desired")
    if desired not in POWER_STATES:
        raise kr.PermanentError(
            f"Device {req.entity_id}: spec.desired must be one of {', '.join(POWER_STATES)}, "
            f"got {desired!r}"
        )
    generation = body["metadata"].get("generation")
    status = body.get("status") or {}
    if status.get("observed") == desired and status.get("observedGeneration") == generation:
        return None  # already converged (this is also the echo of our own status patch)

    if WORK_DELAY:
        await asyncio.sleep(WORK_DELAY)
    epoch = 0
    if writer is not None:
        await writer.write(req.entity_id, {"desired": desired, "generation": generation})
        epoch = writer.epoch
    await _patch_status(
        req.entity_id, {"observed": desired, "epoch": epoch, "observedGeneration": generation}
    )
    return None


async def _patch_status(entity_id: str, status: dict[str, Any]) -> None:
    namespace, name = entity_id.split("/", 1)
    try:
        await kr.fenced_client().patch_status(DEVICES, name, status, namespace=namespace)
    except ApiException as exc:
        if exc.status != HTTP_NOT_FOUND:
            raise
        # Deleted meanwhile: its DELETED event triggers another reconcile.
