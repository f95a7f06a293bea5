"""Finalizers of an object being deleted: none may be added, and the deletion that removing
the last one causes is reported with the object as last stored (finalizers still listed),
on a built-in kind and on a custom resource."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from widget_kind import Widgets

MERGE = {"Content-Type": "application/merge-patch+json"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}
FORBIDDEN = "Forbidden: no new finalizers can be added if the object is being deleted"


@dataclasses.dataclass
class Kind:
    collection: str
    name: str  # as the API server names it in messages
    body: Callable[[str], dict[str, Any]]


@pytest.fixture(params=["configmap", "widget"])
def kind(request: pytest.FixtureRequest) -> Kind:
    if request.param == "configmap":
        return Kind(
            "/api/v1/namespaces/default/configmaps",
            "ConfigMap",
            lambda n: {"metadata": {"name": n}},
        )
    widgets: Widgets = request.getfixturevalue("widgets")
    return Kind(widgets.url, f"Widget.{widgets.group}", lambda n: widgets.body(n, size=1))


async def terminating(
    http: aiohttp.ClientSession, kind: Kind, name: str
) -> tuple[str, dict[str, Any]]:
    """An object with one finalizer, deleted: its URL and its last state."""
    collection = kind.collection
    body = kind.body(name)
    body["metadata"]["finalizers"] = ["example.com/a"]
    async with http.post(collection, json=body) as response:
        assert response.status == 201, await response.text()
    url = f"{collection}/{name}"
    async with http.delete(url) as response:
        assert response.status == 200
        deleting: dict[str, Any] = await response.json()
    assert deleting["metadata"]["deletionTimestamp"]
    return url, deleting


async def test_no_finalizer_may_be_added_once_deleting(
    http: aiohttp.ClientSession, kind: Kind, unique: Callable[[str], str]
) -> None:
    name = unique("fin")
    url, _ = await terminating(http, kind, name)
    added = {"metadata": {"finalizers": ["example.com/b", "example.com/a", "example.com/0"]}}
    async with http.patch(url, json=added, headers=MERGE) as response:
        assert response.status == 422
        status = await response.json()
    assert status["reason"] == "Invalid"
    assert status["message"] == (
        f'{kind.name} "{name}" is invalid: metadata.finalizers: {FORBIDDEN}, found new '
        'finalizers []string{"example.com/0", "example.com/b"}'
    )
    causes = status["details"]["causes"]
    assert causes and all(
        cause == {"reason": "FieldValueForbidden", "field": "metadata.finalizers",
                  "message": status["message"].split("metadata.finalizers: ", 1)[1]}
        for cause in causes
    )  # fmt: skip

    # Swapping one for another adds one too; a JSON patch is refused alike.
    async with http.patch(
        url, json={"metadata": {"finalizers": ["example.com/z"]}}, headers=MERGE
    ) as response:
        assert response.status == 422
    add = [{"op": "add", "path": "/metadata/finalizers/-", "value": "example.com/c"}]
    async with http.patch(url, json=add, headers=JSON_PATCH) as response:
        assert response.status == 422
    async with http.get(url) as response:
        assert (await response.json())["metadata"]["finalizers"] == ["example.com/a"]
    async with http.patch(url, json={"metadata": {"finalizers": None}}, headers=MERGE) as response:
        assert response.status == 200  # removing is what a deleting object is for


async def test_deleted_event_carries_the_object_as_last_stored(
    http: aiohttp.ClientSession, kind: Kind, unique: Callable[[str], str]
) -> None:
    url, deleting = await terminating(http, kind, unique("fin"))
    collection, name = url.rsplit("/", 1)
    last_version = deleting["metadata"]["resourceVersion"]
    query = {
        "watch": "1",
        "resourceVersion": last_version,
        "fieldSelector": f"metadata.name={name}",
        "timeoutSeconds": "30",
    }
    async with http.get(collection, params=query) as watch:
        patch = {"metadata": {"finalizers": None}}
        async with http.patch(url, json=patch, headers=MERGE) as response:
            assert response.status == 200
            answered = await response.json()
        async for line in watch.content:
            event = json.loads(line)
            if event["type"] == "DELETED":
                break
        else:
            pytest.fail("the watch ended without a DELETED event")
    gone = event["object"]["metadata"]
    assert gone["finalizers"] == ["example.com/a"]  # the last stored state
    assert int(gone["resourceVersion"]) > int(last_version)
    # The writer is answered the state it asked for, at the last stored version.
    assert "finalizers" not in answered["metadata"]
    assert answered["metadata"]["resourceVersion"] == last_version
    async with http.get(url) as response:
        assert response.status == 404
