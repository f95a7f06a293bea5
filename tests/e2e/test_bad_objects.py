"""Malformed objects through the kopf shim to a reconciler (rows of the "Bad input and misuse"
table in docs/reliability.md).

A custom resource whose schema keeps any field (``x-kubernetes-preserve-unknown-fields``)
lets anyone store a Gadget with no spec, a spec of the wrong type, a body near 1 MiB,
unicode everywhere a value may hold it, or a name of the maximum length. The shim hands
every one of them to the reconciler as it is (the shim itself reads only the metadata);
a reconciler that trips over a malformed body fails that object only, with its id and
the exception in the error line, and keeps serving every other object; once the object
is corrected, the next event reconciles it. What the API server refuses (a unicode name)
never reaches the operator.

kopf runs in the test's process, the embedded cluster in a process of its own (see
``test_kopf_shim.py`` for why).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kopf
import pytest
import pytest_asyncio
from operator_e2e import kopf_running

import kopf_reconcile as kr
from kopf_reconcile.integration import kopf_shim
from support import eventually, gadget_crd, install_crd

GROUP = "badinput.example.com"
GADGETS = f"/apis/{GROUP}/v1/namespaces/default/gadgets"
MERGE = {"Content-Type": "application/merge-patch+json"}
BLOB = 1_000_000  # characters in one string field: the body is just under 1 MiB
UNICODE = "Grüße, 世界! \U0001f680 \u202eevil\u202c \u0000-free, e\u0301"
LONGEST = "g" * 253  # the longest object name (a DNS subdomain)


@pytest_asyncio.fixture
async def http(cluster_url: str) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=cluster_url) as session:
        await install_crd(session, gadget_crd(GROUP))
        yield session


pytestmark = pytest.mark.usefixtures("no_environment")


async def create(http: aiohttp.ClientSession, name: str, **fields: Any) -> None:
    body = {"apiVersion": f"{GROUP}/v1", "kind": "Gadget", "metadata": {"name": name}, **fields}
    async with http.post(GADGETS, json=body) as response:
        assert response.status == 201, await response.text()


MALFORMED: dict[str, dict[str, Any]] = {
    "no-spec": {},
    "string-spec": {"spec": "on"},
    "list-spec": {"spec": ["on"]},
    "number-desired": {"spec": {"desired": 3}},
    "null-spec": {"spec": None},
}


async def test_malformed_objects_fail_alone_and_every_other_object_is_served(
    cluster_url: str, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    registry = kopf.OperatorRegistry()
    applied: dict[str, dict[str, Any]] = {}

    @kr.reconciler(
        GROUP, "v1", "gadgets",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        concurrency=4,
        backoff=(0.05, 0.5),
        leader=None,
        fenced=None,
        metrics=None,
        registry=registry,
    )  # fmt: skip
    async def reconcile_gadget(req: kr.Request) -> None:
        body = kr.cached(req)
        if body is None:
            return
        # As a reconciler written for well-formed objects would: it trips over the rest.
        desired = body["spec"]["desired"]
        applied[req.entity_id] = {"desired": desired.upper(), "body": body}

    async with kopf_running(registry, cluster_url, namespaces=["default"]):
        await eventually(
            lambda: all(s.get("leader") for s in kopf_shim.status(registry).values()), timeout=10
        )
        for name, fields in MALFORMED.items():
            await create(http, name, **fields)
        await create(http, "big", spec={"desired": "on", "blob": "b" * BLOB})
        await create(
            http,
            "unicode",
            metadata={"name": "unicode", "annotations": {"note": UNICODE}},
            spec={"desired": "on", "note": UNICODE, UNICODE: UNICODE},
        )
        await create(http, LONGEST, spec={"desired": "off"})
        body = {"apiVersion": f"{GROUP}/v1", "kind": "Gadget", "metadata": {"name": "gädget"}}
        async with http.post(GADGETS, json=body) as response:
            assert response.status == 422, await response.text()  # never reaches the operator

        await eventually(
            lambda: {"default/big", "default/unicode", f"default/{LONGEST}"} <= set(applied),
            timeout=20,
            message="well-formed objects served",
        )
        big = applied["default/big"]["body"]
        assert len(big["spec"]["blob"]) == BLOB
        unicode = applied["default/unicode"]["body"]
        assert unicode["spec"]["note"] == UNICODE and unicode["spec"][UNICODE] == UNICODE
        assert unicode["metadata"]["annotations"]["note"] == UNICODE
        assert applied[f"default/{LONGEST}"]["desired"] == "OFF"

        def failed(name: str) -> bool:
            return f"reconcile of 'default/{name}' by reconcile_gadget failed" in caplog.text

        await eventually(lambda: all(failed(name) for name in MALFORMED), timeout=20)
        assert not set(MALFORMED) & {entity.split("/", 1)[1] for entity in applied}
        for name, error in [
            ("no-spec", "KeyError('spec')"),
            ("string-spec", 'TypeError("string indices must be integers'),
            ("number-desired", "AttributeError(\"'int' object has no attribute 'upper'\")"),
            ("null-spec", "TypeError(\"'NoneType' object is not subscriptable\")"),
        ]:
            assert any(
                f"'default/{name}'" in r.getMessage() and error in r.getMessage()
                for r in caplog.records
                if r.levelno >= logging.ERROR
            ), (name, error)

        # Corrected, a malformed object is served: nothing was lost meanwhile.
        patch = {"spec": {"desired": "standby"}}
        async with http.patch(f"{GADGETS}/string-spec", json=patch, headers=MERGE) as response:
            assert response.status == 200, await response.text()
        await eventually(
            lambda: applied.get("default/string-spec", {}).get("desired") == "STANDBY", timeout=20
        )
