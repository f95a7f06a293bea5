"""Server-side apply (``PATCH`` with ``application/apply-patch+yaml``): creation, merging,
field ownership in ``managedFields``, removal of fields a manager stops applying, conflicts
between managers, ``force``, and the checks of the request itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import yaml
from widget_kind import Widgets

APPLY = {"Content-Type": "application/apply-patch+yaml"}
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture
def lease_url(kube_namespace: str, unique: Callable[[str], str]) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{kube_namespace}/leases/{unique('lease')}"


def lease_config(url: str, *, labels: dict[str, str] | None = None, **spec: Any) -> str:
    """A Lease apply configuration as YAML (timestamps unquoted, as people write them)."""
    metadata: dict[str, Any] = {"name": url.rsplit("/", 1)[-1]}
    if labels:
        metadata["labels"] = labels
    document = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": spec,
    }
    return yaml.safe_dump(document).replace("'", "")


async def apply(
    http: aiohttp.ClientSession, url: str, config: str, manager: str, **params: str
) -> aiohttp.ClientResponse:
    return await http.patch(
        url, params={"fieldManager": manager, **params}, data=config, headers=APPLY
    )


def applied_by(obj: dict[str, Any], manager: str) -> dict[str, Any] | None:
    """The fields ``manager`` owns by apply, as FieldsV1 (None: it owns none)."""
    for entry in obj["metadata"].get("managedFields") or []:
        if entry["manager"] == manager and entry["operation"] == "Apply":
            fields: dict[str, Any] = entry["fieldsV1"]
            return fields
    return None


async def test_apply_creates_then_merges(http: aiohttp.ClientSession, lease_url: str) -> None:
    config = lease_config(
        lease_url,
        labels={"app": "tests"},
        holderIdentity="a",
        leaseDurationSeconds=15,
        renewTime="2024-01-02T03:04:05.000006Z",
    )
    response = await apply(http, lease_url, config, "tests")
    assert response.status == 201, await response.text()
    created = await response.json()
    assert created["metadata"]["labels"] == {"app": "tests"}
    assert created["spec"] == {
        "holderIdentity": "a",
        "leaseDurationSeconds": 15,
        "renewTime": "2024-01-02T03:04:05.000006Z",
    }
    entry = next(e for e in created["metadata"]["managedFields"] if e["manager"] == "tests")
    assert entry["operation"] == "Apply"
    assert entry["apiVersion"] == "coordination.k8s.io/v1"
    assert entry["fieldsType"] == "FieldsV1"
    assert entry["fieldsV1"] == {
        "f:metadata": {"f:labels": {"f:app": {}}},
        "f:spec": {"f:holderIdentity": {}, "f:leaseDurationSeconds": {}, "f:renewTime": {}},
    }

    # Another client sets a field of its own; the manager's next apply leaves it alone but
    # drops what the manager no longer applies.
    await http.patch(lease_url, json={"spec": {"leaseTransitions": 3}}, headers=MERGE)
    response = await apply(http, lease_url, lease_config(lease_url, holderIdentity="b"), "tests")
    assert response.status == 200
    merged = await response.json()
    assert "labels" not in merged["metadata"]
    assert merged["spec"] == {"holderIdentity": "b", "leaseTransitions": 3}
    assert applied_by(merged, "tests") == {"f:spec": {"f:holderIdentity": {}}}
    assert int(merged["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])


async def test_apply_without_changes_keeps_the_resource_version(
    http: aiohttp.ClientSession, lease_url: str
) -> None:
    config = lease_config(lease_url, holderIdentity="a")
    first = await (await apply(http, lease_url, config, "tests")).json()
    again = await (await apply(http, lease_url, config, "tests")).json()
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]


async def test_apply_conflicts_with_the_owner_of_a_field(
    http: aiohttp.ClientSession, lease_url: str
) -> None:
    assert (await apply(http, lease_url, lease_config(lease_url, holderIdentity="a"), "a")).ok
    response = await apply(http, lease_url, lease_config(lease_url, holderIdentity="b"), "b")
    assert response.status == 409
    assert await response.json() == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'Apply failed with 1 conflict: conflict with "a": .spec.holderIdentity',
        "reason": "Conflict",
        "details": {
            "causes": [
                {
                    "reason": "FieldManagerConflict",
                    "message": 'conflict with "a"',
                    "field": ".spec.holderIdentity",
                }
            ]
        },
        "code": 409,
    }

    # The same value makes a co-owner; force takes the field over.
    same = await apply(http, lease_url, lease_config(lease_url, holderIdentity="a"), "b")
    assert same.status == 200
    config = lease_config(lease_url, holderIdentity="b")
    response = await apply(http, lease_url, config, "b", force="true")
    assert response.status == 200
    taken = await response.json()
    assert taken["spec"]["holderIdentity"] == "b"
    assert applied_by(taken, "b") == {"f:spec": {"f:holderIdentity": {}}}
    assert applied_by(taken, "a") is None


async def test_other_writes_take_over_the_fields_they_change(
    http: aiohttp.ClientSession, lease_url: str
) -> None:
    config = lease_config(lease_url, labels={"app": "tests"}, holderIdentity="a")
    applied = await (await apply(http, lease_url, config, "tests")).json()
    replaced = {**applied, "spec": {"holderIdentity": "b"}}
    del replaced["metadata"]["managedFields"]  # a client that does not know them keeps them
    written = await (await http.put(lease_url, json=replaced)).json()
    assert applied_by(written, "tests") == {"f:metadata": {"f:labels": {"f:app": {}}}}

    # The manager stops applying the holder: it no longer owns it, so the holder stays.
    response = await apply(http, lease_url, lease_config(lease_url, labels={"app": "x"}), "tests")
    assert (await response.json())["spec"] == {"holderIdentity": "b"}


async def test_managed_fields_are_reset_by_an_empty_entry(
    http: aiohttp.ClientSession, lease_url: str
) -> None:
    await apply(http, lease_url, lease_config(lease_url, holderIdentity="a"), "tests")
    patch: dict[str, Any] = {"metadata": {"managedFields": [{}]}}
    response = await http.patch(lease_url, json=patch, headers=MERGE)
    assert "managedFields" not in (await response.json())["metadata"]


@pytest.mark.v1_37_wording
async def test_apply_checks_the_request(http: aiohttp.ClientSession, lease_url: str) -> None:
    config = lease_config(lease_url, holderIdentity="a")
    response = await http.patch(lease_url, data=config, headers=APPLY)
    assert response.status == 422
    status = await response.json()
    assert status["message"] == (
        'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: '
        "is required for apply patch"
    )
    assert status["details"] == {
        "group": "meta.k8s.io",
        "kind": "PatchOptions",
        "causes": [
            {
                "reason": "FieldValueRequired",
                "message": "Required value: is required for apply patch",
                "field": "fieldManager",
            }
        ],
    }

    response = await http.patch(
        lease_url, params={"force": "true"}, json={"spec": {}}, headers=MERGE
    )
    assert response.status == 422
    assert (await response.json())["details"]["causes"][0]["field"] == "force"

    wrong_version = config.replace("coordination.k8s.io/v1", "coordination.k8s.io/v2")
    response = await apply(http, lease_url, wrong_version, "tests")
    assert response.status == 400
    assert (await response.json())["message"] == (
        "invalid object type: coordination.k8s.io/v2, Kind=Lease"
    )

    name = lease_url.rsplit("/", 1)[-1]
    response = await apply(http, lease_url, config.replace(name, f"{name}-other"), "tests")
    assert response.status == 400
    assert (await response.json())["message"] == (
        f"the name of the object ({name}-other) does not match the name on the URL ({name})"
    )

    response = await apply(http, lease_url, "a: [", "tests")
    assert response.status == 400
    assert (await response.json())["message"].startswith("error encoding patch: yaml: ")
    response = await apply(http, lease_url, "- 1", "tests")
    assert response.status == 400
    assert (await response.json())["message"] == (
        "error decoding patch: error unmarshaling JSON: while decoding JSON: json: "
        "cannot unmarshal array into Go value of type map[string]interface {}"
    )
    wrong_kind = config.replace("kind: Lease", "kind: Foo")
    response = await apply(http, lease_url, wrong_kind, "tests")
    assert response.status == 400
    assert (await response.json())["message"] == (
        "invalid object type: coordination.k8s.io/v1, Kind=Foo"
    )

    invalid = lease_config(lease_url, leaseDurationSeconds=0)
    response = await apply(http, lease_url, invalid, "tests")
    assert response.status == 422
    assert (await response.json())["details"]["causes"][0]["field"] == "spec.leaseDurationSeconds"


async def test_apply_a_custom_resource(http: aiohttp.ClientSession, widgets: Widgets) -> None:
    url = f"{widgets.url}/w1"
    config = yaml.safe_dump(widgets.body("w1", size=2, extra={"a": 1}))
    response = await apply(http, url, config, "tests")
    assert response.status == 201, await response.text()
    created = await response.json()
    assert created["spec"] == {"size": 2, "color": "red", "extra": {"a": 1}}  # defaulted
    assert applied_by(created, "tests") == {"f:spec": {"f:extra": {"f:a": {}}, "f:size": {}}}

    config = yaml.safe_dump(widgets.body("w1", size=3, extra={"a": 1}))
    updated = await (await apply(http, url, config, "tests")).json()
    assert updated["spec"] == {"size": 3, "color": "red", "extra": {"a": 1}}
    assert updated["metadata"]["generation"] == 2

    status = {**widgets.body("w1"), "status": {"phase": "Ready"}}
    del status["spec"]
    response = await apply(http, f"{url}/status", yaml.safe_dump(status), "status-writer")
    assert response.status == 200
    assert (await response.json())["status"] == {"phase": "Ready"}
