"""The fence's objects and the headers of a fenced write."""

from __future__ import annotations

import pytest

import kopf_reconcile as kr
from kopf_reconcile.integration import fence_policy
from kopf_reconcile.integration.fence_lease import Identity
from kopf_reconcile.leader.identity import checked_holder_id


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


def test_proxies_are_fenced_too() -> None:
    """A proxy (exec, attach, port-forward) request is a CONNECT, whatever its HTTP method."""
    [rule] = fence_policy.policy("p")["spec"]["matchConstraints"]["resourceRules"]
    assert rule["operations"] == ["CREATE", "UPDATE", "DELETE", "CONNECT"]
    assert rule["resources"] == ["*/*"]


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


@pytest.mark.parametrize("holder", ["trail ", " lead", "tab\tinside", "new\nline", ""])
def test_a_holder_id_that_http_headers_cannot_carry_as_it_is_is_refused(holder: str) -> None:
    """The fenced client sends the holder in a header: trimmed or refused there, it would
    never match the Lease, and the current holder's own writes would be refused."""
    for make in (
        lambda: kr.KubernetesLeaseElector("ops", holder_id=holder),
        lambda: kr.PostgresLeaseElector("postgresql://u@127.0.0.1/db", holder_id=holder),
    ):
        with pytest.raises(kr.ConfigError, match="holder_id must"):
            make()


def test_a_holder_id_with_inner_spaces_commas_and_other_scripts_is_kept() -> None:
    assert checked_holder_id("café, a b") == "café, a b"
    assert checked_holder_id(None) != checked_holder_id(None)
