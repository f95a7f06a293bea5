"""RBAC over the stored ClusterRoles and ClusterRoleBindings: who may do what.

The SubjectAccessReview endpoint (:mod:`.reviews`) and the authorization of impersonation
(:mod:`.identity`) ask :class:`Authorizer`. Allowed: the group ``system:masters``, and
whoever a ClusterRoleBinding binds (by name, group or ServiceAccount) to a ClusterRole with
a rule that covers the request (non-resource URLs with ``*`` globs at the end, or groups,
resources, subresources, names and verbs). Namespaced Roles and the ClusterRoles
kube-apiserver bootstraps are not emulated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kopf_reconcile.testing.emulated_apiserver.registry import ResourceAPI
from kopf_reconcile.testing.emulated_apiserver.resources import ResourceType

Object = dict[str, Any]

RBAC = "rbac.authorization.k8s.io"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
MASTERS = "system:masters"


class Authorizer:
    """Decides from one ResourceAPI's ClusterRoles and ClusterRoleBindings."""

    def __init__(self, api: ResourceAPI) -> None:
        self._api = api

    def allowed(
        self,
        user: str,
        groups: Iterable[str],
        resource: Object | None,
        non_resource: Object | None = None,
    ) -> bool:
        """Whether ``user`` in ``groups`` may do what the attributes (as a
        SubjectAccessReview's ``resourceAttributes`` or ``nonResourceAttributes``) say."""
        groups = list(groups)
        return MASTERS in groups or any(
            _covers(rule, resource, non_resource) for rule in self._rules_of(user, groups)
        )

    def _rules_of(self, user: str, groups: list[str]) -> list[Object]:
        bindings = self._api.store.items(self._rbac("clusterrolebindings").storage_key)
        roles = self._rbac("clusterroles")
        rules: list[Object] = []
        for binding in bindings:
            if not any(_names(subject, user, groups) for subject in binding.get("subjects") or ()):
                continue
            role_ref = binding.get("roleRef") or {}
            role = self._api.store.get(roles.storage_key, "", str(role_ref.get("name", "")))
            if role_ref.get("kind") == "ClusterRole" and role is not None:
                rules.extend(role.get("rules") or ())
        return rules

    def _rbac(self, plural: str) -> ResourceType:
        resource = self._api.registry.get(RBAC, "v1", plural)
        assert resource is not None  # a built-in type
        return resource


def _names(subject: Object, user: str, groups: list[str]) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "User":
        return bool(name == user)
    if kind == "Group":
        return name in groups
    if kind == "ServiceAccount":
        return user == f"{SERVICE_ACCOUNT_PREFIX}{subject.get('namespace', '')}:{name}"
    return False


def _covers(rule: Object, resource: Object | None, non_resource: Object | None) -> bool:
    verbs = rule.get("verbs") or ()
    attributes = resource if resource is not None else non_resource or {}
    if not ("*" in verbs or attributes.get("verb") in verbs):
        return False
    if non_resource is not None:
        path = str(non_resource.get("path") or "")
        return any(
            url == path or (url.endswith("*") and path.startswith(url[:-1]))
            for url in rule.get("nonResourceURLs") or ()
        )
    assert resource is not None
    wanted = str(resource.get("resource") or "")
    if resource.get("subresource"):
        wanted += f"/{resource['subresource']}"
    names = rule.get("resourceNames") or ()
    return (
        _any_or(rule.get("apiGroups"), str(resource.get("group") or ""))
        and _any_or(rule.get("resources"), wanted)
        and (not names or resource.get("name") in names)
    )


def _any_or(allowed: Any, value: str) -> bool:
    return "*" in (allowed or ()) or value in (allowed or ())
