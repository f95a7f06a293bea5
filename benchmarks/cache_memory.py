"""Cache memory: bytes per cached object, with the default cache transform and without it.

The kopf shim's object cache keeps the latest body of every watched object. Objects
written by ``kubectl apply`` on a real cluster carry ``metadata.managedFields`` (one
entry per field manager) and a ``kubectl.kubernetes.io/last-applied-configuration``
annotation (a JSON copy of the object); no reconciler reads them. This fills an
``ObjectCache`` with 10,000 such Devices, each decoded from its own JSON text as a watch
would, and measures the Python heap the cache holds (tracemalloc): with the default
transform (``strip_managed_fields``) and with ``transform=None`` (the baseline, what the
cache kept before). The embedded cluster writes managedFields only for server-side
applies, so ``kopf_e2e.py``'s Devices have none: this is where the transform shows. No
target is set (issue 16: no more memory per object than plain kopf). A final ``RESULT``
line is read by ``scripts/bench.py``.

    python benchmarks/cache_memory.py [--objects N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import tracemalloc

from kopf_reconcile.cache import LAST_APPLIED, ObjectCache, Transform, strip_managed_fields
from results import result


def device_json(i: int) -> str:
    """A Device as a real API server returns it after ``kubectl apply`` and a status patch."""
    name = f"device-{i:05d}"
    spec = {"desired": "on", "location": f"rack-{i % 40}", "firmware": "1.4.2"}
    applied = {
        "apiVersion": "example.com/v1",
        "kind": "Device",
        "metadata": {"annotations": {}, "name": name, "namespace": "default"},
        "spec": spec,
    }
    body = {
        "apiVersion": "example.com/v1",
        "kind": "Device",
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": f"6f1c2a9e-0000-4000-8000-{i:012d}",
            "resourceVersion": str(100_000 + i),
            "generation": 1,
            "creationTimestamp": "2026-12-01T04:00:00Z",
            "annotations": {LAST_APPLIED: json.dumps(applied, separators=(",", ":")) + "\n"},
            "managedFields": [
                {
                    "manager": "kubectl-client-side-apply",
                    "operation": "Update",
                    "apiVersion": "example.com/v1",
                    "time": "2026-12-01T04:00:00Z",
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {
                        "f:metadata": {
                            "f:annotations": {".": {}, f"f:{LAST_APPLIED}": {}},
                        },
                        "f:spec": {".": {}, **{f"f:{key}": {} for key in spec}},
                    },
                },
                {
                    "manager": "kopf-reconcile",
                    "operation": "Update",
                    "apiVersion": "example.com/v1",
                    "time": "2026-12-01T04:00:01Z",
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {
                        "f:status": {
                            ".": {},
                            "f:epoch": {},
                            "f:observed": {},
                            "f:observedGeneration": {},
                        }
                    },
                    "subresource": "status",
                },
            ],
        },
        "spec": spec,
        "status": {"observed": "on", "epoch": 3, "observedGeneration": 1},
    }
    return json.dumps(body)


async def fill(objects: int, transform: Transform | None) -> int:
    """Heap bytes the cache holds for ``objects`` Devices."""
    texts = [device_json(i) for i in range(objects)]
    cache = ObjectCache(transform=transform)
    cache.close()  # no Loop: requests are dropped, bodies are still stored
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    for i, text in enumerate(texts):
        await cache.update(f"default/device-{i:05d}", json.loads(text))
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    assert len(cache) == objects
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=10_000)
    args = parser.parse_args()
    n = args.objects
    tracemalloc.start()
    whole = asyncio.run(fill(n, None)) / n
    stripped = asyncio.run(fill(n, strip_managed_fields)) / n
    print(
        f"cache memory: {n:,} Devices as kubectl apply leaves them "
        f"({len(device_json(0)):,} bytes of JSON each)"
    )
    print(f"  transform=None (whole bodies)           {whole:>8,.0f} B/object")
    print(f"  default transform (strip_managed_fields) {stripped:>7,.0f} B/object")
    print(f"summary: the default transform keeps {stripped / whole:.2f}x the bytes per object")
    result(
        "cache_memory",
        f"heap per cached object, default transform vs whole bodies ({n:,} Devices "
        "as kubectl apply leaves them)",
        ours=[stripped],
        baseline=[whole],
        unit="B",
        ratio="ours/baseline",
        target=None,
    )


if __name__ == "__main__":
    main()
