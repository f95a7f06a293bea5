"""Custom resources: CRDs served at once, schema pruning/defaulting/validation, generation,
the status subresource, finalizers, and the patch types kopf and kubectl send."""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
from widget_kind import CRDS, Widgets, widget_crd

from support import eventually

MERGE = {"Content-Type": "application/merge-patch+json"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}


async def test_crd_is_established_and_discoverable(
    http: aiohttp.ClientSession, widgets: Widgets
) -> None:
    crd = await (await http.get(f"{CRDS}/widgets.{widgets.group}")).json()
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    assert crd["status"]["acceptedNames"]["kind"] == "Widget"
    assert crd["status"]["storedVersions"] == ["v1"]

    groups = await (await http.get("/apis")).json()
    assert widgets.group in {g["name"] for g in groups["groups"]}
    resources = await (await http.get(f"/apis/{widgets.group}/v1")).json()
    names = {r["name"]: r for r in resources["resources"]}
    assert names["widgets"]["kind"] == "Widget"
    assert names["widgets"]["shortNames"] == ["wdg"]
    assert names["widgets"]["singularName"] == "widget"
    assert "widgets/status" in names


async def test_create_prunes_defaults_and_sets_metadata(
    http: aiohttp.ClientSession, widgets: Widgets
) -> None:
    body = widgets.body("w1", size=3, unknown=1, extra={"kept": True})
    body["status"] = {"ignored": "on create"}
    response = await http.post(widgets.url, json=body)
    assert response.status == 201, await response.text()
    created = await response.json()
    assert created["spec"] == {"size": 3, "color": "red", "extra": {"kept": True}}
    assert "status" not in created  # the status subresource owns it
    assert created["metadata"]["generation"] == 1
    assert created["metadata"]["uid"]
    assert created["kind"] == "Widget"
    assert created["apiVersion"] == f"{widgets.group}/v1"


async def test_schema_violations_are_invalid(http: aiohttp.ClientSession, widgets: Widgets) -> None:
    response = await http.post(widgets.url, json=widgets.body("bad", size="big", color="green"))
    assert response.status == 422
    status = await response.json()
    assert status["reason"] == "Invalid"
    assert status["details"]["kind"] == "Widget"
    assert status["details"]["group"] == widgets.group
    assert {c["field"] for c in status["details"]["causes"]} == {"spec.size", "spec.color"}

    response = await http.post(widgets.url, json=widgets.body("bad", size=11))
    assert response.status == 422
    response = await http.post(widgets.url, json=widgets.body("bad"))
    assert response.status == 422
    assert (await response.json())["details"]["causes"][0]["field"] == "spec.size"


async def test_generation_follows_the_spec_only(
    http: aiohttp.ClientSession, widgets: Widgets
) -> None:
    await http.post(widgets.url, json=widgets.body("w1", size=1))
    url = f"{widgets.url}/w1"
    labelled = await (
        await http.patch(url, json={"metadata": {"labels": {"a": "b"}}}, headers=MERGE)
    ).json()
    assert labelled["metadata"]["generation"] == 1
    resized = await (await http.patch(url, json={"spec": {"size": 2}}, headers=MERGE)).json()
    assert resized["metadata"]["generation"] == 2
    assert int(resized["metadata"]["resourceVersion"]) > int(
        labelled["metadata"]["resourceVersion"]
    )


async def test_status_subresource(http: aiohttp.ClientSession, widgets: Widgets) -> None:
    await http.post(widgets.url, json=widgets.body("w1", size=1))
    url = f"{widgets.url}/w1"
    ignored = await (
        await http.patch(url, json={"status": {"phase": "main"}}, headers=MERGE)
    ).json()
    assert "status" not in ignored

    patch = {"status": {"phase": "ready"}, "spec": {"size": 9}}
    updated = await (await http.patch(f"{url}/status", json=patch, headers=MERGE)).json()
    assert updated["status"] == {"phase": "ready"}
    assert updated["spec"]["size"] == 1  # the status subresource changes nothing else
    assert updated["metadata"]["generation"] == 1
    read = await (await http.get(f"{url}/status")).json()
    assert read["status"] == {"phase": "ready"}


async def test_json_patch_with_version_test_like_kopf(
    http: aiohttp.ClientSession, widgets: Widgets
) -> None:
    created = await (await http.post(widgets.url, json=widgets.body("w1", size=1))).json()
    version = created["metadata"]["resourceVersion"]
    url = f"{widgets.url}/w1"
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": version},
        {"op": "add", "path": "/metadata/finalizers", "value": ["example.com/cleanup"]},
    ]
    response = await http.patch(url, json=ops, headers=JSON_PATCH)
    assert response.status == 200, await response.text()
    assert (await response.json())["metadata"]["finalizers"] == ["example.com/cleanup"]

    stale = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": version},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]
    response = await http.patch(url, json=stale, headers=JSON_PATCH)
    assert response.status == 422
    assert (await response.json())["reason"] == "Invalid"


async def test_finalizers_delay_deletion(http: aiohttp.ClientSession, widgets: Widgets) -> None:
    body = widgets.body("w1", size=1)
    body["metadata"]["finalizers"] = ["example.com/cleanup"]
    await http.post(widgets.url, json=body)
    url = f"{widgets.url}/w1"
    response = await http.delete(url)
    assert response.status == 200
    terminating = await response.json()
    assert terminating["metadata"]["deletionTimestamp"]
    assert (await http.get(url)).status == 200

    response = await http.patch(url, json={"metadata": {"finalizers": None}}, headers=MERGE)
    assert response.status == 200
    assert (await http.get(url)).status == 404


async def test_strategic_merge_patch_is_unsupported(
    http: aiohttp.ClientSession, widgets: Widgets
) -> None:
    await http.post(widgets.url, json=widgets.body("w1", size=1))
    headers = {"Content-Type": "application/strategic-merge-patch+json"}
    response = await http.patch(f"{widgets.url}/w1", json={"spec": {"size": 2}}, headers=headers)
    assert response.status == 415
    assert (await response.json())["reason"] == "UnsupportedMediaType"


async def test_lists_carry_kind_and_items_their_kind(
    http: aiohttp.ClientSession, widgets: Widgets
) -> None:
    await http.post(widgets.url, json=widgets.body("w1", size=1))
    document = await (await http.get(widgets.url)).json()
    assert document["kind"] == "WidgetList"
    assert document["apiVersion"] == f"{widgets.group}/v1"
    assert document["items"][0]["kind"] == "Widget"
    everywhere = await (await http.get(f"/apis/{widgets.group}/v1/widgets")).json()
    assert [item["metadata"]["name"] for item in everywhere["items"]] == ["w1"]


async def test_deleting_the_crd_deletes_its_objects(
    http: aiohttp.ClientSession, widgets: Widgets
) -> None:
    await http.post(widgets.url, json=widgets.body("w1", size=1))
    response = await http.delete(f"{CRDS}/widgets.{widgets.group}")
    assert response.status == 200

    async def gone(path: str) -> bool:
        return (await http.get(path)).status == 404

    await eventually(lambda: gone(f"{CRDS}/widgets.{widgets.group}"), 30, message="CRD gone")
    await eventually(lambda: gone(f"/apis/{widgets.group}/v1"), 30, message="group unserved")


async def test_crd_validation(http: aiohttp.ClientSession, unique: Callable[[str], str]) -> None:
    crd = widget_crd(f"{unique('g')}.example.com")
    crd["metadata"]["name"] = "wrong.example.com"
    response = await http.post(CRDS, json=crd)
    assert response.status == 422
    status = await response.json()
    assert status["reason"] == "Invalid"
    assert status["details"]["kind"] == "CustomResourceDefinition"
    assert "metadata.name" in {c["field"] for c in status["details"]["causes"]}


async def test_put_without_resource_version_is_invalid(
    http: aiohttp.ClientSession, widgets: Widgets
) -> None:
    created = await (await http.post(widgets.url, json=widgets.body("w1", size=1))).json()
    unconditional = {
        **created,
        "metadata": {k: v for k, v in created["metadata"].items() if k != "resourceVersion"},
    }
    for url in (f"{widgets.url}/w1", f"{widgets.url}/w1/status"):
        response = await http.put(url, json=unconditional)
        assert response.status == 422
        status = await response.json()
        assert status["message"] == (
            f'widgets.{widgets.group} "w1" is invalid: metadata.resourceVersion: '
            "Invalid value: 0: must be specified for an update"
        )
        assert status["details"]["kind"] == "widgets"
        assert status["details"]["causes"][0]["field"] == "metadata.resourceVersion"
    assert (await http.put(f"{widgets.url}/w1", json=created)).status == 200
