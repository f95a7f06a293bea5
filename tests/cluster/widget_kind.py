"""The custom resource kind the cluster tests use: a Widget CRD with a schema and status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from support import eventually

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def widget_crd(group: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["size"],
                "properties": {
                    "size": {"type": "integer", "minimum": 1, "maximum": 10},
                    "color": {"type": "string", "enum": ["red", "blue"], "default": "red"},
                    "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
            },
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {
                "plural": "widgets",
                "singular": "widget",
                "kind": "Widget",
                "shortNames": ["wdg"],
            },
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


@dataclass
class Widgets:
    group: str
    crd: dict[str, Any]

    @property
    def url(self) -> str:
        return self.url_in("default")

    def url_in(self, namespace: str) -> str:
        return f"/apis/{self.group}/v1/namespaces/{namespace}/widgets"

    def body(self, name: str, **spec: Any) -> dict[str, Any]:
        return {
            "apiVersion": f"{self.group}/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": spec,
        }


async def established(http: aiohttp.ClientSession, group: str) -> None:
    """Wait until the CRD is established and its resource is discoverable."""

    async def discoverable() -> bool:
        return (await http.get(f"/apis/{group}/v1")).status == 200

    await eventually(discoverable, timeout=30, message=f"{group}/v1 served")
