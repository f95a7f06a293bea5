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
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from kopf_reconcile.testing.emulated_apiserver import errors
from kopf_reconcile.testing.emulated_apiserver.audit import AUDIT_CONTEXT
from kopf_reconcile.testing.emulated_apiserver.identity import ADMINISTRATOR, UserInfo
from kopf_reconcile.testing.emulated_apiserver.rbac import Authorizer
from kopf_reconcile.testing.emulated_apiserver.registry import ResourceAPI
from kopf_reconcile.testing.emulated_apiserver.request_options import read_body
from kopf_reconcile.testing.emulated_apiserver.responses import json_response
from kopf_reconcile.testing.emulated_apiserver.validation import format_time

Object = dict[str, Any]

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
SELF_REVIEWS = "/apis/authentication.k8s.io/v1/selfsubjectreviews"


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
        self.authorizer = Authorizer(api)
        self.tokens: dict[str, TokenUser] = {}
        #: The users the tokens authenticate as (see :mod:`.identity`).
        self.token_users: dict[str, UserInfo] = {}

    def add_token(self, token: str, user: TokenUser) -> None:
        self.tokens[token] = user
        self.token_users[token] = UserInfo(user.username, user.uid, user.groups)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post(TOKEN_REVIEWS, self._token_review)
        router.add_post(ACCESS_REVIEWS, self._access_review)
        router.add_post(SELF_REVIEWS, self._self_review)

    async def _self_review(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        review = _review(body, "authentication.k8s.io/v1", "SelfSubjectReview")
        context = request[AUDIT_CONTEXT]
        user = context.impersonated or context.user or ADMINISTRATOR
        review.pop("spec")
        review["metadata"]["creationTimestamp"] = format_time(datetime.now(UTC))
        review["status"] = {"userInfo": user.as_json()}
        return json_response(review, status=201)

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
        allowed = self.authorizer.allowed(user, groups, resource, non_resource)
        review["status"] = {"allowed": allowed}
        return json_response(review, status=201)


def _review(body: Any, api_version: str, kind: str) -> Object:
    if not isinstance(body, dict):
        raise errors.bad_request(f"the body of a {kind} must be an object")
    return {
        "kind": kind,
        "apiVersion": api_version,
        "metadata": {"creationTimestamp": None},
        "spec": body.get("spec") or {},
    }
