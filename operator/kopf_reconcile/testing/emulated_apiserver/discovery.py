"""Discovery documents: ``/version``, ``/api``, ``/apis``, groups and their resource lists.

Clients find out what a cluster serves from these before anything else: kopf scans
``/api`` and ``/apis`` for its resources (and for CRDs and namespaces to watch), kubectl
maps kinds and short names through them. They are built on demand from the registry, so a
CRD's resources show up in the very next discovery call after it is applied.
"""

from __future__ import annotations

import re
from typing import Any

from kopf_reconcile.testing.emulated_apiserver.resources import ResourceRegistry

#: The kube-apiserver release whose behaviour the embedded cluster emulates.
EMULATED_VERSION = "v1.37.2"

#: Built-in groups in kube-apiserver's order; CRD groups follow alphabetically.
_BUILTIN_GROUP_ORDER = ("coordination.k8s.io", "apiextensions.k8s.io")

_KUBE_VERSION = re.compile(r"v(\d+)(?:(alpha|beta)(\d+))?")


def version_priority(version: str) -> tuple[int, int, int, str]:
    """Sort key of Kubernetes version names: GA > beta > alpha, higher numbers first."""
    match = _KUBE_VERSION.fullmatch(version)
    if match is None:
        return (3, 0, 0, version)  # non-Kubernetes-style names last, alphabetically
    major, stage, minor = match.groups()
    rank = {None: 0, "beta": 1, "alpha": 2}[stage]
    return (rank, -int(major), -int(minor or 0), "")


def version_info() -> dict[str, str]:
    major, minor, _ = EMULATED_VERSION.lstrip("v").split(".")
    return {
        "major": major,
        "minor": minor,
        "emulationMajor": major,
        "emulationMinor": minor,
        "minCompatibilityMajor": major,
        "minCompatibilityMinor": str(int(minor) - 1),
        "gitVersion": f"{EMULATED_VERSION}-embedded",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-10-01T00:00:00Z",
        "goVersion": "go1.26.8",
        "compiler": "gc",
        "platform": "linux/amd64",
    }


def core_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}
        ],
    }


def _group_document(group: str, versions: list[str]) -> dict[str, Any]:
    ordered = sorted(versions, key=version_priority)
    entries = [{"groupVersion": f"{group}/{version}", "version": version} for version in ordered]
    return {"name": group, "versions": entries, "preferredVersion": entries[0]}


def group_list(registry: ResourceRegistry) -> dict[str, Any]:
    groups = {g: v for g, v in registry.group_versions().items() if g}
    builtin = [g for g in _BUILTIN_GROUP_ORDER if g in groups]
    custom = sorted(g for g in groups if g not in _BUILTIN_GROUP_ORDER)
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [_group_document(g, groups[g]) for g in builtin + custom],
    }


def group(registry: ResourceRegistry, name: str) -> dict[str, Any] | None:
    versions = registry.group_versions().get(name)
    if not name or not versions:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group_document(name, versions)}


def resource_list(registry: ResourceRegistry, group: str, version: str) -> dict[str, Any] | None:
    resources = registry.in_group_version(group, version)
    if not resources:
        return None
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": [entry for r in resources for entry in r.discovery_entries()],
    }
