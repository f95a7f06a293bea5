"""Lease CRUD as a leader elector does it: optimistic concurrency, MicroTime, validation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
MICRO = "2024-05-06T07:08:09.123456Z"


def lease_body(name: str, **spec: Any) -> Any:
    """A Lease as a plain document (the client sends it as it is, MicroTimes as written)."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name},
        "spec": spec,
    }


@pytest.fixture
def coordination(api_client: Any) -> client.CoordinationV1Api:
    return client.CoordinationV1Api(api_client)


async def test_create_assigns_server_metadata(
    coordination: client.CoordinationV1Api, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    body = lease_body(name, holderIdentity="a", leaseDurationSeconds=15, acquireTime=MICRO)
    created = await coordination.create_namespaced_lease("default", body)
    assert created.metadata.name == name
    assert created.metadata.namespace == "default"
    assert created.metadata.uid
    assert created.metadata.creation_timestamp is not None
    assert int(created.metadata.resource_version) > 0
    assert created.spec.holder_identity == "a"
    assert created.spec.lease_duration_seconds == 15

    read = await coordination.read_namespaced_lease(name, "default")
    assert read.metadata.resource_version == created.metadata.resource_version
    assert read.metadata.uid == created.metadata.uid


async def test_every_write_bumps_the_resource_version(
    coordination: client.CoordinationV1Api, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    first = await coordination.create_namespaced_lease(
        "default", lease_body(name, holderIdentity="a")
    )
    first.spec.holder_identity = "b"
    second = await coordination.replace_namespaced_lease(name, "default", first)
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    third = await coordination.patch_namespaced_lease(
        name, "default", {"spec": {"leaseTransitions": 1}}
    )
    assert int(third.metadata.resource_version) > int(second.metadata.resource_version)
    assert third.spec.holder_identity == "b"
    assert third.spec.lease_transitions == 1


async def test_stale_resource_version_conflicts(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    created = await (await http.post(LEASES, json=lease_body(name, holderIdentity="a"))).json()
    stale = created["metadata"]["resourceVersion"]
    renewed = {**created, "spec": {"holderIdentity": "a", "renewTime": MICRO}}
    assert (await http.put(f"{LEASES}/{name}", json=renewed)).status == 200

    taken = {**created, "spec": {"holderIdentity": "b"}}  # still carries the stale version
    response = await http.put(f"{LEASES}/{name}", json=taken)
    assert response.status == 409
    status = await response.json()
    assert status == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": '
        "the object has been modified; please apply your changes to the latest version and "
        "try again",
        "reason": "Conflict",
        "details": {"name": name, "group": "coordination.k8s.io", "kind": "leases"},
        "code": 409,
    }

    patch = {"metadata": {"resourceVersion": stale}, "spec": {"holderIdentity": "c"}}
    headers = {"Content-Type": "application/merge-patch+json"}
    response = await http.patch(f"{LEASES}/{name}", json=patch, headers=headers)
    assert response.status == 409
    assert (await response.json())["reason"] == "Conflict"


@pytest.mark.parametrize("version", [None, ""])
async def test_put_without_resource_version_is_invalid(
    http: aiohttp.ClientSession, unique: Callable[[str], str], version: str | None
) -> None:
    # Leases forbid unconditional updates (ConfigMaps allow them, see below).
    name = unique("lease")
    created = await (await http.post(LEASES, json=lease_body(name, holderIdentity="a"))).json()
    metadata = {k: v for k, v in created["metadata"].items() if k != "resourceVersion"}
    if version is not None:
        metadata["resourceVersion"] = version
    response = await http.put(
        f"{LEASES}/{name}", json={**created, "metadata": metadata, "spec": {"holderIdentity": "b"}}
    )
    assert response.status == 422
    assert await response.json() == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'leases.coordination.k8s.io "{name}" is invalid: metadata.resourceVersion: '
        "Invalid value: 0: must be specified for an update",
        "reason": "Invalid",
        "details": {
            "name": name,
            "group": "coordination.k8s.io",
            "kind": "leases",
            "causes": [
                {
                    "reason": "FieldValueInvalid",
                    "message": "Invalid value: 0: must be specified for an update",
                    "field": "metadata.resourceVersion",
                }
            ],
        },
        "code": 422,
    }
    assert (await (await http.get(f"{LEASES}/{name}")).json())["spec"]["holderIdentity"] == "a"


async def test_config_maps_allow_unconditional_put(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    url = "/api/v1/namespaces/default/configmaps"
    name = unique("cm")
    await http.post(url, json={"metadata": {"name": name}, "data": {"a": "1"}})
    response = await http.put(
        f"{url}/{name}", json={"metadata": {"name": name}, "data": {"a": "2"}}
    )
    assert response.status == 200
    assert (await response.json())["data"] == {"a": "2"}
    await http.delete(f"{url}/{name}")


async def test_noop_write_keeps_the_resource_version(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    created = await (await http.post(LEASES, json=lease_body(name, holderIdentity="a"))).json()
    replaced = await (await http.put(f"{LEASES}/{name}", json=created)).json()
    assert replaced["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    headers = {"Content-Type": "application/merge-patch+json"}
    patch = {"spec": {"holderIdentity": "a"}}
    patched = await (await http.patch(f"{LEASES}/{name}", json=patch, headers=headers)).json()
    assert patched["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]


async def test_already_exists(http: aiohttp.ClientSession, unique: Callable[[str], str]) -> None:
    name = unique("lease")
    assert (await http.post(LEASES, json=lease_body(name))).status == 201
    response = await http.post(LEASES, json=lease_body(name))
    assert response.status == 409
    status = await response.json()
    assert status["reason"] == "AlreadyExists"
    assert status["message"] == f'leases.coordination.k8s.io "{name}" already exists'
    assert status["details"] == {"name": name, "group": "coordination.k8s.io", "kind": "leases"}


async def test_not_found(http: aiohttp.ClientSession, unique: Callable[[str], str]) -> None:
    name = unique("missing")
    response = await http.get(f"{LEASES}/{name}")
    assert response.status == 404
    assert await response.json() == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'leases.coordination.k8s.io "{name}" not found',
        "reason": "NotFound",
        "details": {"name": name, "group": "coordination.k8s.io", "kind": "leases"},
        "code": 404,
    }


async def test_create_in_a_missing_namespace_is_not_found(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    namespace = unique("absent")
    url = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    # The namespace is checked before the object is (even an invalid one).
    for body in (lease_body(unique("lease")), lease_body("Not_A_Name", leaseDurationSeconds=0)):
        response = await http.post(url, json=body)
        assert response.status == 404
        status = await response.json()
        assert status["reason"] == "NotFound"
        assert status["details"] == {"name": namespace, "kind": "namespaces"}


@pytest.mark.parametrize(
    "micro_time",
    [
        "2024-05-06T07:08:09Z",
        "2024-05-06T07:08:09.123Z",
        "2024-05-06T07:08:09.123456789Z",
        "yesterday",
    ],
)
async def test_micro_time_needs_six_fractional_digits(
    http: aiohttp.ClientSession, unique: Callable[[str], str], micro_time: str
) -> None:
    for field in ("acquireTime", "renewTime"):
        response = await http.post(LEASES, json=lease_body(unique("lease"), **{field: micro_time}))
        assert response.status == 400
        status = await response.json()
        assert status["reason"] == "BadRequest"
        assert status["kind"] == "Status"


async def test_micro_time_is_normalised_to_utc(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    body = lease_body(unique("lease"), renewTime="2024-05-06T09:08:09.000000+02:00")
    created = await (await http.post(LEASES, json=body)).json()
    assert created["spec"]["renewTime"] == "2024-05-06T07:08:09.000000Z"


@pytest.mark.parametrize("field", ["leaseDurationSeconds", "leaseTransitions"])
@pytest.mark.parametrize("value", ["15", 1.5, True])
async def test_integer_fields_must_be_integers(
    http: aiohttp.ClientSession, unique: Callable[[str], str], field: str, value: object
) -> None:
    response = await http.post(LEASES, json=lease_body(unique("lease"), **{field: value}))
    assert response.status == 400
    assert (await response.json())["reason"] == "BadRequest"


async def test_lease_rules_are_invalid(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    response = await http.post(LEASES, json=lease_body(name, leaseDurationSeconds=0))
    assert response.status == 422
    status = await response.json()
    assert status["reason"] == "Invalid"
    assert status["details"]["kind"] == "Lease"
    assert status["details"]["group"] == "coordination.k8s.io"
    assert status["details"]["causes"][0]["field"] == "spec.leaseDurationSeconds"

    response = await http.post(LEASES, json=lease_body(unique("lease"), leaseTransitions=-1))
    assert response.status == 422


async def test_invalid_name(http: aiohttp.ClientSession) -> None:
    response = await http.post(LEASES, json=lease_body("Not_A_Name"))
    assert response.status == 422
    status = await response.json()
    assert status["reason"] == "Invalid"
    assert status["details"]["causes"][0]["field"] == "metadata.name"


async def test_delete_then_gone(
    coordination: client.CoordinationV1Api, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    await coordination.create_namespaced_lease("default", lease_body(name))
    status = await coordination.delete_namespaced_lease(name, "default")
    assert status.status == "Success"
    with pytest.raises(ApiException) as info:
        await coordination.read_namespaced_lease(name, "default")
    assert info.value.status == 404
    with pytest.raises(ApiException) as info:
        await coordination.delete_namespaced_lease(name, "default")
    assert info.value.status == 404


async def test_list_across_namespaces(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    assert (await http.post(LEASES, json=lease_body(name))).status == 201
    document = await (await http.get("/apis/coordination.k8s.io/v1/leases")).json()
    assert document["kind"] == "LeaseList"
    assert document["apiVersion"] == "coordination.k8s.io/v1"
    assert int(document["metadata"]["resourceVersion"]) > 0
    assert name in {item["metadata"]["name"] for item in document["items"]}


async def test_uid_in_a_put_is_a_precondition(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    created = await (await http.post(LEASES, json=lease_body(name, holderIdentity="a"))).json()
    assert (await http.delete(f"{LEASES}/{name}")).status == 200
    # A renewal meant for the deleted Lease must not recreate it.
    response = await http.put(f"{LEASES}/{name}", json=created)
    assert response.status == 409
    status = await response.json()
    assert status["reason"] == "Conflict"
    assert "Precondition failed: UID in precondition" in status["message"]
    assert (await http.get(f"{LEASES}/{name}")).status == 404

    recreated = await (await http.post(LEASES, json=lease_body(name))).json()
    stale = {**recreated, "metadata": {**recreated["metadata"], "uid": created["metadata"]["uid"]}}
    assert (await http.put(f"{LEASES}/{name}", json=stale)).status == 409


async def test_uid_cannot_be_patched(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    await http.post(LEASES, json=lease_body(name))
    headers = {"Content-Type": "application/merge-patch+json"}
    patch = {"metadata": {"uid": "00000000-0000-0000-0000-000000000000"}}
    response = await http.patch(f"{LEASES}/{name}", json=patch, headers=headers)
    assert response.status == 422
    assert (await response.json())["details"]["causes"][0]["field"] == "metadata.uid"
