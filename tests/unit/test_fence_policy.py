"""The fence's objects and the headers of a fenced write."""

from __future__ import annotations

import kopf_reconcile as kr
from kopf_reconcile.integration import fence_policy
from kopf_reconcile.integration.fence_lease import Identity


def test_the_manifests_are_a_policy_its_binding_and_rbac_for_the_account_itself() -> None:
    objects = fence_policy.manifests("op", "ops", "op-sa")
    kinds = [o["kind"] for o in objects]
    assert kinds == [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ]
    policy, binding, cluster_role, _, role, role_binding = objects
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] == "op-ops-fence"
    assert binding["spec"]["paramRef"]["namespace"] == "ops"
    assert binding["spec"]["paramRef"]["parameterNotFoundAction"] == "Allow"
    assert policy["spec"]["paramKind"] == {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}
    # Impersonating itself only, in its own namespace: never an account named alike elsewhere.
    assert role["metadata"]["namespace"] == "ops"
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["serviceaccounts"],
            "resourceNames": ["op-sa"],
            "verbs": ["impersonate"],
        }
    ]
    assert role_binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "op-sa", "namespace": "ops"}
    ]
    assert cluster_role["rules"][0]["resources"] == [
        "userextras/kopf-reconcile.io/lease",
        "userextras/kopf-reconcile.io/holder",
        "userextras/kopf-reconcile.io/epoch",
    ]


def test_a_requests_without_extras_is_not_matched_before_extra_is_read() -> None:
    [condition] = fence_policy.policy("p")["spec"]["matchConditions"]
    assert condition["expression"].startswith("has(request.userInfo.extra) && ")


def test_a_service_account_is_impersonated_by_name_alone_and_the_extras_are_escaped() -> None:
    account = Identity("system:serviceaccount:ops:op", ("system:serviceaccounts", "x"))
    headers = account.headers({"kopf-reconcile.io/epoch": "7"})
    assert headers.getall("Impersonate-User") == ["system:serviceaccount:ops:op"]
    assert "Impersonate-Group" not in headers
    assert headers.getall("Impersonate-Extra-kopf-reconcile.io%2Fepoch") == ["7"]
    user = Identity("admin", ("system:masters", "ops", "system:authenticated"))
    assert user.headers({}).getall("Impersonate-Group") == ["system:masters", "ops"]


def test_resources_are_checked_when_made() -> None:
    assert repr(kr.Resource("", "v1", "configmaps")) == "Resource('', 'v1', 'configmaps')"
    for bad in (("", "", "configmaps"), ("", "v1", ""), (None, "v1", "x")):
        try:
            kr.Resource(*bad)  # type: ignore[arg-type]
        except kr.ConfigError as exc:
            assert "Resource" in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")
