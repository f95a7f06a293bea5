"""Who a request is: its bearer token's user, then whom it impersonates.

Authentication: a static token (``--token-auth-file``'s, :attr:`Identities.tokens`)
authenticates as its user with ``system:authenticated`` added. A request with no token, or
one the cluster does not know, is served as the administrator (``admin``, group
``system:masters``): the embedded cluster's kubeconfig carries no credentials, and every
request was always served (a real server answers 401 to an unknown token and serves a
request without one as ``system:anonymous``).

Impersonation, read as kube-apiserver's filter reads it: ``Impersonate-User``,
``Impersonate-Group`` (repeated), ``Impersonate-Uid``, ``Impersonate-Extra-<key>`` (the key
lowercased and percent-decoded; repeated headers are several values). Without a user name
any of the others is 400. A service account's user name without groups gets
``system:serviceaccounts`` and ``system:serviceaccounts:<namespace>``; every user but
``system:anonymous`` gets ``system:authenticated`` unless ``system:authenticated`` or
``system:unauthenticated`` is given (``system:anonymous`` gets ``system:unauthenticated``).
The requester must be allowed the verb ``impersonate`` on ``users``, ``serviceaccounts``
(named, in its namespace), ``groups``, ``uids`` and ``userextras/<key>`` (legacy
impersonation, see :mod:`.rbac`); else 403 worded as v1.37 words the first constrained
impersonation mode it tried (``impersonate-on:<mode>:<verb>``). Granting the constrained
modes' verbs is not emulated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from multidict import CIMultiDictProxy

from kopf_reconcile.testing.emulated_apiserver import errors
from kopf_reconcile.testing.emulated_apiserver.rbac import (
    MASTERS,
    SERVICE_ACCOUNT_PREFIX,
    Authorizer,
)

AUTHENTICATED = "system:authenticated"
UNAUTHENTICATED = "system:unauthenticated"
ANONYMOUS = "system:anonymous"
NODE_PREFIX = "system:node:"
IMPERSONATE_USER = "Impersonate-User"
IMPERSONATE_GROUP = "Impersonate-Group"
IMPERSONATE_UID = "Impersonate-Uid"
IMPERSONATE_EXTRA = "impersonate-extra-"


@dataclass(frozen=True)
class UserInfo:
    """An authenticated (or impersonated) user, as ``authentication.k8s.io/v1`` has it."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """``UserInfo`` as the API serialises it: empty fields left out."""
        document: dict[str, Any] = {"username": self.username}
        if self.uid:
            document["uid"] = self.uid
        if self.groups:
            document["groups"] = list(self.groups)
        if self.extra:
            document["extra"] = {key: list(values) for key, values in self.extra.items()}
        return document


#: Whom a request without a known token is served as.
ADMINISTRATOR = UserInfo("admin", "admin", (MASTERS, AUTHENTICATED))


@dataclass(frozen=True)
class RequestAttributes:
    """What a resource request does, as authorization sees it (for impersonation's 403)."""

    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    #: The path of a request for no resource (``resource`` is empty then).
    path: str = ""


def authenticate(authorization: str, tokens: Mapping[str, UserInfo]) -> UserInfo:
    """The user of an ``Authorization`` header's bearer token (see the module's words)."""
    scheme, _, token = authorization.partition(" ")
    user = tokens.get(token.strip()) if scheme.lower() == "bearer" else None
    if user is None:
        return ADMINISTRATOR
    groups = user.groups if AUTHENTICATED in user.groups else (*user.groups, AUTHENTICATED)
    return UserInfo(user.username, user.uid, groups, user.extra)


def wants_impersonation(headers: CIMultiDictProxy[str]) -> bool:
    return any(key.lower().startswith("impersonate-") for key in headers)


def impersonate(
    headers: CIMultiDictProxy[str],
    requester: UserInfo,
    authorizer: Authorizer,
    attributes: RequestAttributes,
) -> UserInfo | None:
    """Whom the request impersonates (None: nobody), after authorizing the requester."""
    username = headers.get(IMPERSONATE_USER, "")
    uid = headers.get(IMPERSONATE_UID, "")
    groups = list(headers.getall(IMPERSONATE_GROUP, []))
    extra: dict[str, list[str]] = {}
    for header, value in headers.items():
        if header.lower().startswith(IMPERSONATE_EXTRA):
            key = unquote(header[len(IMPERSONATE_EXTRA) :].lower())
            extra.setdefault(key, []).append(value)
    if not username:
        if uid or groups or extra:
            raise errors.bad_request(
                f"requested {_go_user(username, uid, groups, extra)} "
                "without impersonating a user name"
            )
        return None
    sa_namespace, _, sa_name = username.removeprefix(SERVICE_ACCOUNT_PREFIX).partition(":")
    is_service_account = username.startswith(SERVICE_ACCOUNT_PREFIX) and sa_name != ""
    checks: list[dict[str, str]] = []
    if is_service_account:
        checks.append(_check("serviceaccounts", sa_name, namespace=sa_namespace))
    else:
        checks.append(_check("users", username))
    checks.extend(_check("uids", uid, group="authentication.k8s.io") for _ in [uid] if uid)
    checks.extend(_check("groups", group) for group in groups)
    for key, values in extra.items():
        checks.extend(
            _check("userextras", value, group="authentication.k8s.io", subresource=key)
            for value in values
        )
    who = requester.username
    if not all(authorizer.allowed(who, requester.groups, check) for check in checks):
        raise _forbidden(requester, username, is_service_account, attributes)
    if is_service_account and not groups:
        groups = ["system:serviceaccounts", f"system:serviceaccounts:{sa_namespace}"]
    if username == ANONYMOUS:
        if UNAUTHENTICATED not in groups:
            groups.append(UNAUTHENTICATED)
    elif AUTHENTICATED not in groups and UNAUTHENTICATED not in groups:
        groups.append(AUTHENTICATED)
    frozen_extra = {key: tuple(values) for key, values in extra.items()}
    return UserInfo(username, uid, tuple(groups), frozen_extra)


def _check(
    resource: str, name: str, *, group: str = "", namespace: str = "", subresource: str = ""
) -> dict[str, str]:
    return {
        "verb": "impersonate",
        "group": group,
        "resource": resource,
        "subresource": subresource,
        "namespace": namespace,
        "name": name,
    }


def _forbidden(
    requester: UserInfo,
    username: str,
    is_service_account: bool,
    attributes: RequestAttributes,
) -> errors.ApiError:
    if is_service_account:
        mode = "serviceaccount"
    elif username.startswith(NODE_PREFIX):
        mode = "arbitrary-node"
    else:
        mode = "user-info"
    verb = f"impersonate-on:{mode}:{attributes.verb}"
    if not attributes.resource:
        message = f'forbidden: User "{requester.username}" cannot {verb} path "{attributes.path}"'
        return errors.ApiError(403, message, "Forbidden", {})
    resource = attributes.resource
    if attributes.subresource:
        resource += f"/{attributes.subresource}"
    scope = (
        f'in the namespace "{attributes.namespace}"'
        if attributes.namespace
        else "at the cluster scope"
    )
    detail = (
        f'User "{requester.username}" cannot {verb} resource "{resource}" '
        f'in API group "{attributes.group}" {scope}'
    )
    target = errors.Target(attributes.group, attributes.resource, "", attributes.name)
    prefix = f'{target.group_resource} "{target.name}"' if target.name else target.group_resource
    details: dict[str, Any] = {"name": target.name} if target.name else {}
    if target.group:
        details["group"] = target.group
    details["kind"] = target.plural
    return errors.ApiError(403, f"{prefix} is forbidden: {detail}", "Forbidden", details)


def _go_user(username: str, uid: str, groups: list[str], extra: dict[str, list[str]]) -> str:
    """The wanted user as Go's ``%#v`` prints a ``*user.DefaultInfo``."""
    rendered_groups = (
        "[]string{" + ", ".join(f'"{g}"' for g in groups) + "}" if groups else "[]string(nil)"
    )
    if extra:
        items = ", ".join(
            f'"{k}":[]string{{' + ", ".join(f'"{v}"' for v in vs) + "}"
            for k, vs in sorted(extra.items())
        )
        rendered_extra = f"map[string][]string{{{items}}}"
    else:
        rendered_extra = "map[string][]string(nil)"
    return (
        f'&user.DefaultInfo{{Name:"{username}", UID:"{uid}", '
        f"Groups:{rendered_groups}, Extra:{rendered_extra}}}"
    )
