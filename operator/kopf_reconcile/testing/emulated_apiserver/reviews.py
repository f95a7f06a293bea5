"""TokenReview and SubjectAccessReview, as kube-apiserver answers them with static tokens
and RBAC.

The embedded API serves every request it gets, whoever sends it; what it emulates
here is the API a component uses to authenticate and authorize *its own* callers
(an operator guarding ``/metrics``):

* ``POST /apis/authentication.k8s.io/v1/tokenreviews``: a token of :attr:`Reviews.tokens`
  (as ``--token-auth-file`` holds them) is authenticated as its user, with the group
  ``system:authenticated`` added; any other token is not (``status.user`` empty and an
  ``error``, ``authenticated`` left out, as kube-apiserver omits a false value);
* ``POST /apis/authorization.k8s.io/v1/subjectaccessreviews``: allowed for the group
  ``system:masters``, else when a ClusterRoleBinding binds the user (by name, group or
  ServiceAccount) to a ClusterRole with a rule that covers the attributes (non-resource
  URLs with ``*`` globs at the end, or groups, resources, names and verbs). Exactly one of
  ``resourceAttributes`` and ``nonResourceAttributes`` must be given (else 422).

Namespaced Roles and the default ClusterRoles kube-apiserver bootstraps (such as
``system:public-info-viewer``) are not emulated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kopf_reconcile.testing.emulated_apiserver import errors
from kopf_reconcile.testing.emulated_apiserver.registry import ResourceAPI
from kopf_reconcile.testing.emulated_apiserver.request_options import read_body
from kopf_reconcile.testing.emulated_apiserver.resources import ResourceType
from kopf_reconcile.testing.emulated_apiserver.responses import json_response

Object = dict[str, Any]

RBAC = "rbac.authorization.k8s.io"
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"


@dataclass(frozen=True)
class TokenUser:
    """Who a static token authenticates as."""

    username: str
    uid: str
    groups: tuple[str, ...] = ()


class Reviews:
    """The two review endpoints over one ResourceAPI's ClusterRoles and ClusterRoleBindings."""

    def __init__(self, api: ResourceAPI) -> None:
        self._api = api
        self.tokens: dict[str, TokenUser] = {}

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post(TOKEN_REVIEWS, self._token_review)
        router.add_post(ACCESS_REVIEWS, self._access_review)

    async def _token_review(self, request: web.Request) -> web.Response:
        review = _review(await read_body(request), "authentication.k8s.io/v1", "TokenReview")
        user = self.tokens.get(str((review.get("spec") or {}).get("token") or ""))
        if user is None:
            review["status"] = {"user": {}, "error": "invalid bearer token"}
        else:
            groups = [*user.groups, "system:authenticated"]
            review["status"] = {
                "authenticated": True,
                "user": {"username": user.username, "uid": user.uid, "groups": groups},
            }
        return json_response(review, status=201)

    async def _access_review(self, request: web.Request) -> web.Response:
        review = _review(await read_body(request), "authorization.k8s.io/v1", "SubjectAccessReview")
        spec = review.get("spec") or {}
        resource, non_resource = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        if (resource is None) == (non_resource is None):
            target = errors.Target(
                "authorization.k8s.io", "subjectaccessreviews", "SubjectAccessReview", ""
            )
            detail = "exactly one of nonResourceAttributes or resourceAttributes must be specified"
            raise errors.invalid(
                target,
                [errors.FieldError.invalid("spec.resourceAttributes", resource, detail)],
            )
        user = str(spec.get("user") or "")
        groups = [str(group) for group in spec.get("groups") or ()]
        allowed = "system:masters" in groups or any(
            _covers(rule, resource, non_resource) for rule in self._rules_of(user, groups)
        )
        review["status"] = {"allowed": allowed}
        return json_response(review, status=201)

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


def _review(body: Any, api_version: str, kind: str) -> Object:
    if not isinstance(body, dict):
        raise errors.bad_request(f"the body of a {kind} must be an object")
    return {
        "kind": kind,
        "apiVersion": api_version,
        "metadata": {"creationTimestamp": None},
        "spec": body.get("spec") or {},
    }


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
