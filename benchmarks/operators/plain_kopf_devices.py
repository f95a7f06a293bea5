"""The baseline of ``benchmarks/kopf_e2e.py``: the Device example written as plain kopf handlers.

``@kopf.on.create`` / ``@kopf.on.update`` do what ``operator/examples/devices.py`` does: the
same validation, the same write to PostgreSQL (the same statement, through the same
repository, at epoch 0: plain kopf has no leader epoch) and the same status fields, which
kopf itself patches through its ``patch`` kwarg. ``@kopf.on.delete`` writes the same
tombstone as the example; that is what makes kopf put its finalizer on every Device (a
deletion it must not miss), as any plain kopf operator that cleans up after its objects
does. Run with ``kopf run`` and ``KOPF_RECONCILE_DATABASE_URL``.
"""

from __future__ import annotations

import os
from typing import Any

import kopf

from kopf_reconcile.fencing.postgres import PostgresFencedRepository

POWER_STATES = ("on", "off", "standby")
REPOSITORY = PostgresFencedRepository(
    os.environ["KOPF_RECONCILE_DATABASE_URL"], scope="devices.example.com-reconcile-device"
)


@kopf.on.create("example.com", "v1", "devices")
@kopf.on.update("example.com", "v1", "devices", field="spec")
async def write_device(
    spec: kopf.Spec, meta: kopf.Meta, namespace: str | None, name: str, patch: kopf.Patch, **_: Any
) -> None:
    desired = spec.get("desired")
    if desired not in POWER_STATES:
        raise kopf.PermanentError(f"spec.desired must be one of {POWER_STATES}, got {desired!r}")
    generation = meta.get("generation")
    await REPOSITORY.apply_fenced(
        f"{namespace}/{name}", 0, {"desired": desired, "generation": generation}
    )
    patch.status["observed"] = desired
    patch.status["epoch"] = 0
    patch.status["observedGeneration"] = generation


@kopf.on.delete("example.com", "v1", "devices")
async def forget_device(namespace: str | None, name: str, **_: Any) -> None:
    await REPOSITORY.apply_fenced(f"{namespace}/{name}", 0, {"deleted": True})


@kopf.on.cleanup()
async def close_repository(**_: Any) -> None:
    await REPOSITORY.close()
