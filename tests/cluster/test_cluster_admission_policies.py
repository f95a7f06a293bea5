"""ValidatingAdmissionPolicies: the lease-epoch fence and the generic subset, on both tiers.

Policies take effect on a real server a moment after they are created (its informers), so
each test waits for the first denial it expects before checking the rest.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

POLICIES = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
BINDINGS = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
MANAGED = {"app.kubernetes.io/managed-by": "kopf-reconcile"}
MERGE = {"Content-Type": "application/merge-patch+json"}
FENCE = (
    "variables.lease != params.metadata.namespace + '/' + params.metadata.name || "
    "(has(params.spec.holderIdentity) && params.spec.holderIdentity == "
    "request.userInfo.extra['kopf-reconcile.io/holder'][0] && "
    "string(has(params.spec.leaseTransitions) ? params.spec.leaseTransitions : 0) == "
    "request.userInfo.extra['kopf-reconcile.io/epoch'][0])"
)


def fence_policy(name: str, *, match_condition: str) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "paramKind": {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"},
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": ["*"],
                        "apiVersions": ["*"],
                        "resources": ["*/*"],
                        "operations": ["CREATE", "UPDATE", "DELETE"],
                    }
                ]
            },
            "matchConditions": [{"name": "fenced-write", "expression": match_condition}],
            "variables": [
                {
                    "name": "lease",
                    "expression": "request.userInfo.extra['kopf-reconcile.io/lease'][0]",
                }
            ],
            "validations": [
                {
                    "expression": FENCE,
                    "messageExpression": "'stale write for lease ' + variables.lease",
                    "reason": "Forbidden",
                }
            ],
        },
    }


def binding(name: str, policy: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": policy, "validationActions": ["Deny"], **spec},
    }


def fenced(namespace: str, lease: str, holder: str, epoch: int) -> list[tuple[str, str]]:
    return [
        ("Impersonate-User", "admin"),
        ("Impersonate-Group", "system:masters"),
        ("Impersonate-Extra-Kopf-Reconcile.io%2fLease", f"{namespace}/{lease}"),
        ("Impersonate-Extra-Kopf-Reconcile.io%2fHolder", holder),
        ("Impersonate-Extra-Kopf-Reconcile.io%2fEpoch", str(epoch)),
    ]


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Wait (up to 30 s) for a condition: the real server applies policies a moment late."""
    for _ in range(300):
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the condition never held")


async def created(http: aiohttp.ClientSession, path: str, body: Any) -> Any:
    async with http.post(path, json=body) as response:
        assert response.status == 201, await response.text()
        return await response.json()


@pytest.fixture
async def cleanup(http: aiohttp.ClientSession) -> Any:
    paths: list[str] = []
    yield paths
    for path in reversed(paths):
        await http.delete(path)


def configmap(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"a": "b"}}


@pytest.mark.v1_37_wording
async def test_the_lease_fence(
    http: aiohttp.ClientSession,
    kube_namespace: str,
    unique: Callable[[str], str],
    cleanup: list[str],
) -> None:
    ns = kube_namespace
    name = unique("fence")
    guarded = "has(request.userInfo.extra) && 'kopf-reconcile.io/lease' in request.userInfo.extra"
    await created(http, POLICIES, fence_policy(name, match_condition=guarded))
    cleanup.append(f"{POLICIES}/{name}")
    selector = {"matchLabels": MANAGED}
    # Only this test's namespace: the real tier is shared.
    match = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
    paramref = {"selector": selector, "namespace": ns, "parameterNotFoundAction": "Allow"}
    await created(http, BINDINGS, binding(name, name, paramRef=paramref, matchResources=match))
    cleanup.append(f"{BINDINGS}/{name}")
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "leader", "labels": MANAGED},
        "spec": {"holderIdentity": "a", "leaseTransitions": 2},
    }
    await created(http, leases, lease)
    configmaps = f"/api/v1/namespaces/{ns}/configmaps"
    stale = fenced(ns, "leader", "a", 1)

    async def denied() -> bool:
        async with http.post(configmaps, json=configmap("cm"), headers=stale) as response:
            if response.status == 201:
                await http.delete(f"{configmaps}/cm")
            return response.status == 403

    await until(denied)
    async with http.post(configmaps, json=configmap("cm"), headers=stale) as response:
        assert response.status == 403
        message = (
            f"ValidatingAdmissionPolicy '{name}' with binding '{name}' denied request: "
            f"stale write for lease {ns}/leader"
        )
        assert await response.json() == {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f'configmaps "cm" is forbidden: {message}',
            "reason": "Forbidden",
            "details": {"name": "cm", "kind": "configmaps", "causes": [{"message": message}]},
            "code": 403,
        }
    current = fenced(ns, "leader", "a", 2)
    async with http.post(configmaps, json=configmap("cm"), headers=current) as response:
        assert response.status == 201, await response.text()
    # Unfenced writes (no extras) pass; so do writes fenced by another lease.
    async with http.post(configmaps, json=configmap("plain")) as response:
        assert response.status == 201, await response.text()
    other = fenced(ns, "other", "z", 9)
    async with http.post(configmaps, json=configmap("other"), headers=other) as response:
        assert response.status == 201, await response.text()
    # Every write verb, dry runs and subresources too.
    patch = json.dumps({"data": {"x": "y"}})
    for path in (f"{configmaps}/cm", f"{configmaps}/cm?dryRun=All"):
        async with http.patch(path, data=patch, headers=[*stale, *MERGE.items()]) as response:
            assert response.status == 403, await response.text()
    async with http.get(f"{configmaps}/cm") as response:
        assert (await response.json())["data"] == {"a": "b"}
    apply = {**configmap("cm"), "data": {"c": "d"}}
    apply_headers = [*stale, ("Content-Type", "application/apply-patch+yaml")]
    async with http.patch(
        f"{configmaps}/cm?fieldManager=t", data=json.dumps(apply), headers=apply_headers
    ) as response:
        assert response.status == 403, await response.text()
    async with http.delete(f"{configmaps}/cm", headers=stale) as response:
        assert response.status == 403, await response.text()
    renewed = {"metadata": {"labels": {**MANAGED, "x": "y"}}}
    async with http.patch(
        f"{leases}/leader", data=json.dumps(renewed), headers=[*stale, *MERGE.items()]
    ) as response:
        assert response.status == 403, await response.text()
    # A new epoch fences the old one at once (params are read as they are now).
    async with http.patch(
        f"{leases}/leader", data=json.dumps({"spec": {"leaseTransitions": 3}}), headers=MERGE
    ) as response:
        assert response.status == 200, await response.text()

    async def epoch_two_denied() -> bool:
        async with http.delete(f"{configmaps}/plain?dryRun=All", headers=current) as response:
            return response.status == 403

    await until(epoch_two_denied)
    async with http.delete(f"{configmaps}/cm", headers=fenced(ns, "leader", "a", 3)) as response:
        assert response.status == 200, await response.text()


@pytest.mark.v1_37_wording
async def test_an_unguarded_extra_lookup_fails_every_write_without_extras(
    http: aiohttp.ClientSession,
    kube_namespace: str,
    unique: Callable[[str], str],
    cleanup: list[str],
) -> None:
    """``request.userInfo.extra`` is absent when a user has none: ``in`` on it is an error,
    which ``failurePolicy: Fail`` turns into a denial (422) of every such write."""
    ns = kube_namespace
    name = unique("unguarded")
    condition = "'kopf-reconcile.io/lease' in request.userInfo.extra"
    await created(http, POLICIES, fence_policy(name, match_condition=condition))
    cleanup.append(f"{POLICIES}/{name}")
    match = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
    paramref = {"selector": {"matchLabels": MANAGED}, "parameterNotFoundAction": "Allow"}
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "leader", "labels": MANAGED},
        "spec": {"holderIdentity": "a"},
    }
    await created(http, f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases", lease)
    await created(http, BINDINGS, binding(name, name, paramRef=paramref, matchResources=match))
    cleanup.append(f"{BINDINGS}/{name}")
    configmaps = f"/api/v1/namespaces/{ns}/configmaps"
    statuses: list[Any] = []

    async def denied() -> bool:
        async with http.post(configmaps, json=configmap("cm")) as response:
            if response.status == 201:
                await http.delete(f"{configmaps}/cm")
            statuses[:] = [await response.json()]
            return response.status == 422

    await until(denied)
    message = (
        f"ValidatingAdmissionPolicy '{name}' with binding '{name}' denied request: "
        f"expression '{condition}' resulted in error: no such key: extra"
    )
    assert statuses[0]["message"] == f'configmaps "cm" is forbidden: {message}'
    assert statuses[0]["reason"] == "Invalid"
    assert statuses[0]["details"]["causes"] == [{"message": message}]


@pytest.mark.v1_37_wording
async def test_missing_params_deny_before_match_conditions_and_warn_actions(
    http: aiohttp.ClientSession,
    kube_namespace: str,
    unique: Callable[[str], str],
    cleanup: list[str],
) -> None:
    ns = kube_namespace
    name = unique("params")
    policy = fence_policy(name, match_condition="false")  # skips every request...
    await created(http, POLICIES, policy)
    cleanup.append(f"{POLICIES}/{name}")
    match = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
    paramref = {"name": "absent", "parameterNotFoundAction": "Deny"}  # ...but params come first
    await created(http, BINDINGS, binding(name, name, paramRef=paramref, matchResources=match))
    cleanup.append(f"{BINDINGS}/{name}")
    configmaps = f"/api/v1/namespaces/{ns}/configmaps"
    bodies: list[Any] = []

    async def denied() -> bool:
        async with http.post(configmaps, json=configmap("cm")) as response:
            if response.status == 201:
                await http.delete(f"{configmaps}/cm")
            bodies[:] = [await response.json()]
            return response.status == 422

    await until(denied)
    assert bodies[0]["message"] == (
        f"configmaps \"cm\" is forbidden: ValidatingAdmissionPolicy '{name}' with binding "
        f"'{name}' denied request: failed to configure binding: no params found for policy "
        "binding with `Deny` parameterNotFoundAction"
    )
    # Warn: the request goes through with a Warning header.
    async with http.delete(f"{BINDINGS}/{name}") as response:
        assert response.status == 200
    warned = unique("warn")
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": warned},
        "spec": {
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["secrets"],
                        "operations": ["CREATE"],
                    }
                ]
            },
            "validations": [{"expression": "object.data.nope == 'x'"}, {"expression": "false"}],
        },
    }
    await created(http, POLICIES, policy)
    cleanup.append(f"{POLICIES}/{warned}")
    spec = {"validationActions": ["Warn"], "matchResources": match}
    await created(http, BINDINGS, binding(warned, warned, **spec))
    cleanup.append(f"{BINDINGS}/{warned}")
    secrets = f"/api/v1/namespaces/{ns}/secrets"
    warnings: list[str] = []

    async def warns() -> bool:
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s"},
            "data": {"k": "dg=="},
        }
        async with http.post(secrets, json=body) as response:
            if response.status != 201:  # the deleted binding may still apply for a moment
                return False
            warnings[:] = response.headers.getall("Warning", [])
        await http.delete(f"{secrets}/s")
        return bool(warnings)

    await until(warns)
    prefix = (
        f"299 - \"Validation failed for ValidatingAdmissionPolicy '{warned}' "
        f"with binding '{warned}': "
    )
    assert warnings == [
        prefix + "expression 'object.data.nope == 'x'' resulted in error: no such key: nope\"",
        prefix + 'failed expression: false"',
    ]


@pytest.mark.v1_37_wording
async def test_policy_and_binding_validation(http: aiohttp.ClientSession) -> None:
    bad = binding("bad", "")
    async with http.post(BINDINGS, json=bad) as response:
        assert response.status == 422
        assert (await response.json())["message"] == (
            'ValidatingAdmissionPolicyBinding.admissionregistration.k8s.io "bad" is invalid: '
            "spec.policyName: Required value"
        )
    both = binding("bad", "p", paramRef={"name": "x", "selector": {}})
    async with http.post(BINDINGS, json=both) as response:
        assert response.status == 422
        causes = (await response.json())["details"]["causes"]
        assert [c["field"] for c in causes] == [
            "spec.paramRef.name",
            "spec.paramRef.selector",
            "spec.paramRef.parameterNotFoundAction",
        ]
        assert causes[0]["message"] == "Forbidden: name and selector are mutually exclusive"
    policy = fence_policy("bad", match_condition="true")
    rule = policy["spec"]["matchConstraints"]["resourceRules"][0]
    rule["resources"] = ["*", "*/*"]
    async with http.post(POLICIES, json=policy) as response:
        assert response.status == 422
        assert (await response.json())["details"]["causes"] == [
            {
                "reason": "FieldValueInvalid",
                "message": 'Invalid value: ["*","*/*"]: if \'*/*\' is present, must not '
                "specify other resources",
                "field": "spec.matchConstraints.resourceRules[0].resources",
            }
        ]


async def test_self_subject_review_and_impersonation(kube: Any) -> None:
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    path = "/apis/authentication.k8s.io/v1/selfsubjectreviews"
    async with kube.http_session() as http:
        async with http.post(path, json=review) as response:
            assert response.status == 201
            assert (await response.json())["status"]["userInfo"] == {
                "username": "admin",
                "uid": "admin",
                "groups": ["system:masters", "system:authenticated"],
            }
        headers = [
            ("Impersonate-User", "alice"),
            ("Impersonate-Group", "g1"),
            ("Impersonate-Group", "g2"),
            ("Impersonate-Uid", "u-1"),
            ("Impersonate-Extra-Kopf-Reconcile.io%2fLease", "default/l"),
            ("Impersonate-Extra-Scopes", "a"),
            ("Impersonate-Extra-Scopes", "b"),
        ]
        async with http.post(path, json=review, headers=headers) as response:
            assert response.status == 201
            assert (await response.json())["status"]["userInfo"] == {
                "username": "alice",
                "uid": "u-1",
                "groups": ["g1", "g2", "system:authenticated"],
                "extra": {"kopf-reconcile.io/lease": ["default/l"], "scopes": ["a", "b"]},
            }
        account = {"Impersonate-User": "system:serviceaccount:ns1:sa1"}
        async with http.post(path, json=review, headers=account) as response:
            assert (await response.json())["status"]["userInfo"] == {
                "username": "system:serviceaccount:ns1:sa1",
                "groups": [
                    "system:serviceaccounts",
                    "system:serviceaccounts:ns1",
                    "system:authenticated",
                ],
            }
        async with http.post(path, json=review, headers={"Impersonate-Group": "x"}) as response:
            assert response.status == 400
    async with kube.http_session(unprivileged=True) as http:
        async with http.post(path, json=review) as response:
            assert (await response.json())["status"]["userInfo"]["username"] == "nobody"
        async with http.post(path, json=review, headers={"Impersonate-User": "alice"}) as response:
            assert response.status == 403
            assert (await response.json())["message"] == (
                'selfsubjectreviews.authentication.k8s.io is forbidden: User "nobody" cannot '
                'impersonate-on:user-info:create resource "selfsubjectreviews" in API group '
                '"authentication.k8s.io" at the cluster scope'
            )
        cm = "/api/v1/namespaces/default/configmaps"
        async with http.get(cm, headers={"Impersonate-User": "alice"}) as response:
            assert response.status == 403
            assert (await response.json())["message"] == (
                'configmaps is forbidden: User "nobody" cannot impersonate-on:user-info:list '
                'resource "configmaps" in API group "" in the namespace "default"'
            )
