"""Resource types: what the API serves (group, version, plural, kind, scope) and where.

A :class:`ResourceType` is one ``group/version/plural`` the server answers for. The
:class:`ResourceRegistry` holds the built-in types and the ones each CustomResourceDefinition
adds; discovery, routing and storage all look types up here. Objects of one resource are
stored once under ``(group, plural)`` whatever version is asked for: the embedded cluster
converts between versions of a CRD the way the ``None`` conversion strategy does (only
``apiVersion`` changes).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kopf_reconcile.testing.emulated_apiserver.errors import Target

if TYPE_CHECKING:
    from kopf_reconcile.testing.emulated_apiserver.schema import StructuralSchema

#: The storage key of a resource: its group and plural, shared by all of its versions.
StorageKey = tuple[str, str]

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class PrinterColumn:
    """A column of ``kubectl get`` output (CRD ``additionalPrinterColumns``)."""

    name: str
    type: str
    json_path: str
    description: str = ""
    priority: int = 0
    format: str = ""


@dataclass(frozen=True)
class ResourceType:
    """One served ``group/version/plural`` and how its objects behave."""

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ALL_VERBS
    #: Served as a ``/status`` subresource: the main resource ignores status changes.
    status_subresource: bool = False
    #: ``metadata.generation`` is set to 1 on create and bumped on every spec change.
    tracks_generation: bool = False
    #: PUT of a missing object creates it (true for Leases and Events in kube-apiserver).
    create_on_update: bool = False
    #: PUT of an existing object may omit ``metadata.resourceVersion`` (kube-apiserver's
    #: ``AllowUnconditionalUpdate``: ConfigMaps, Secrets, Events and Namespaces allow it;
    #: Leases, CRDs and custom resources answer 422 without it).
    unconditional_update: bool = False
    #: Served from a CustomResourceDefinition (unstructured objects, schema-validated).
    custom: bool = False
    schema: StructuralSchema | None = field(default=None, compare=False)
    printer_columns: tuple[PrinterColumn, ...] = ()
    #: The version objects are stored as: it names the ``storageVersionHash`` in discovery.
    storage_version: str = ""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage_key(self) -> StorageKey:
        return (self.group, self.plural)

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    def target(self, name: str) -> Target:
        return Target(group=self.group, plural=self.plural, kind=self.kind, name=name)

    def discovery_entries(self) -> list[dict[str, Any]]:
        """The ``APIResource`` entries of this type in its group-version's resource list."""
        entry: dict[str, Any] = {
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(self.verbs),
        }
        if self.short_names:
            entry["shortNames"] = list(self.short_names)
        if self.categories:
            entry["categories"] = list(self.categories)
        if self.storage_version:
            entry["storageVersionHash"] = _storage_hash(self)
        entries = [entry]
        if self.status_subresource:
            entries.append(
                {
                    "name": f"{self.plural}/status",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": self.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
        return entries


def _storage_hash(resource: ResourceType) -> str:
    # Only its stability matters to clients (they compare it across discovery calls).
    seed = f"{resource.group}/{resource.storage_version}/{resource.kind}".encode()
    return base64.b64encode(hashlib.sha256(seed).digest()[:8]).decode()


def _cluster_rbac(kind: str) -> ResourceType:
    """A cluster-scoped kind of rbac.authorization.k8s.io/v1."""
    return ResourceType(
        group="rbac.authorization.k8s.io",
        version="v1",
        plural=f"{kind.lower()}s",
        singular=kind.lower(),
        kind=kind,
        namespaced=False,
        unconditional_update=True,
        storage_version="v1",
    )


#: The built-in kinds, with their singular names and storage versions (which name the
#: ``storageVersionHash``) as kube-apiserver v1.37 reports them.
BUILTIN_TYPES: tuple[ResourceType, ...] = (
    ResourceType(
        group="",
        version="v1",
        plural="namespaces",
        singular="namespace",
        kind="Namespace",
        namespaced=False,
        short_names=("ns",),
        verbs=("create", "delete", "get", "list", "patch", "update", "watch"),
        status_subresource=True,
        unconditional_update=True,
        storage_version="v1",
    ),
    ResourceType(
        group="",
        version="v1",
        plural="events",
        singular="event",
        kind="Event",
        namespaced=True,
        short_names=("ev",),
        create_on_update=True,
        unconditional_update=True,
        storage_version="v1",
    ),
    ResourceType(
        group="",
        version="v1",
        plural="configmaps",
        singular="configmap",
        kind="ConfigMap",
        namespaced=True,
        short_names=("cm",),
        unconditional_update=True,
        storage_version="v1",
    ),
    ResourceType(
        group="",
        version="v1",
        plural="secrets",
        singular="secret",
        kind="Secret",
        namespaced=True,
        unconditional_update=True,
        storage_version="v1",
    ),
    ResourceType(
        group="coordination.k8s.io",
        version="v1",
        plural="leases",
        singular="lease",
        kind="Lease",
        namespaced=True,
        create_on_update=True,
        storage_version="v1",
    ),
    ResourceType(
        group="apiextensions.k8s.io",
        version="v1",
        plural="customresourcedefinitions",
        singular="customresourcedefinition",
        kind="CustomResourceDefinition",
        namespaced=False,
        short_names=("crd", "crds"),
        categories=("api-extensions",),
        status_subresource=True,
        tracks_generation=True,
        storage_version="v1",
    ),
    # Stored for SubjectAccessReviews (see reviews.py) and the authorization of
    # impersonation (identity.py); no other request of the embedded API is authorized by them.
    *(_cluster_rbac(kind) for kind in ("ClusterRole", "ClusterRoleBinding")),
    # Reviews: only created, never stored (see reviews.py).
    *(
        ResourceType(
            group=group,
            version="v1",
            plural=f"{kind.lower()}s",
            singular=kind.lower(),
            kind=kind,
            namespaced=False,
            verbs=("create",),
        )
        for group, kind in (
            ("authentication.k8s.io", "SelfSubjectReview"),
            ("authentication.k8s.io", "TokenReview"),
            ("authorization.k8s.io", "SubjectAccessReview"),
        )
    ),
    # Enforced on every write (see admission.py).
    *(
        ResourceType(
            group="admissionregistration.k8s.io",
            version="v1",
            plural=plural,
            singular=kind.lower(),
            kind=kind,
            namespaced=False,
            categories=("api-extensions",),
            status_subresource=kind == "ValidatingAdmissionPolicy",
            tracks_generation=True,
            storage_version="v1",
        )
        for kind, plural in (
            ("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
            ("ValidatingAdmissionPolicyBinding", "validatingadmissionpolicybindings"),
        )
    ),
)


class ResourceRegistry:
    """The served resource types: built-ins plus whatever CRDs define right now."""

    def __init__(self) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self._custom: dict[str, tuple[ResourceType, ...]] = {}  # CRD name -> its served versions
        for resource in BUILTIN_TYPES:
            self._types[(resource.group, resource.version, resource.plural)] = resource

    def get(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._types.get((group, version, plural))

    def __iter__(self) -> Iterator[ResourceType]:
        return iter(self._types.values())

    def group_versions(self) -> dict[str, list[str]]:
        """Each group's served versions (discovery orders them by version priority)."""
        versions: dict[str, list[str]] = {}
        for resource in self._types.values():
            known = versions.setdefault(resource.group, [])
            if resource.version not in known:
                known.append(resource.version)
        return versions

    def in_group_version(self, group: str, version: str) -> list[ResourceType]:
        return [r for r in self._types.values() if r.group == group and r.version == version]

    def define(self, crd_name: str, resources: tuple[ResourceType, ...]) -> None:
        """Serve the versions of a CRD (replacing what an earlier revision of it served)."""
        self.undefine(crd_name)
        for resource in resources:
            self._types[(resource.group, resource.version, resource.plural)] = resource
        self._custom[crd_name] = resources

    def undefine(self, crd_name: str) -> tuple[ResourceType, ...]:
        """Stop serving a CRD's resources; returns what was served."""
        resources = self._custom.pop(crd_name, ())
        for resource in resources:
            self._types.pop((resource.group, resource.version, resource.plural), None)
        return resources
