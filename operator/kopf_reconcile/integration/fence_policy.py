"""The API server's fence: a ValidatingAdmissionPolicy that refuses a deposed leader's writes.

Every write a reconciler makes through :func:`~kopf_reconcile.fenced_client` impersonates
the operator's own identity and adds three user extras: the Lease it was dispatched under
(``<namespace>/<name>``), the holder identity that took it and the epoch (the Lease's
``spec.leaseTransitions`` then). The policy here, bound to the Leases of the operator's
namespace as its parameters, lets such a write through only while that Lease still names
the same holder at the same epoch: after a takeover (a new holder, the next epoch) or a
release (no holder), the API server itself refuses the late writes of the process that
held it, whatever that process believes, with 403 Forbidden and a message that names the
Lease and both epochs. Requests without the extras (users, other controllers, the
garbage collector, the operator's own Lease and Event writes) are not matched.

Why it holds, and what it rests on (docs/safety.md, "The Kubernetes API"):

* Only the operator can send the extras: impersonating them needs ``impersonate`` on
  ``userextras/kopf-reconcile.io/...``, granted to the operator's ServiceAccount alone.
* The Lease's holder and ``leaseTransitions`` change atomically with every change of
  holder (optimistic concurrency on its resourceVersion), and epochs never go back
  (:mod:`kopf_reconcile.leader.kubernetes`, "Deleted Leases"). With the PostgreSQL elector
  no Lease elects anyone: the leader mirrors its epoch into a Lease of the same name before
  its first write of a term (:mod:`.fence_lease`), only ever forwards.
* The binding selects its parameters by label (the Leases kopf-reconcile manages in one
  namespace), so every reconciler and every shard is covered by one binding, and a Lease
  created later (a new shard) needs no new object. ``parameterNotFoundAction: Allow``: the
  API server collects parameters *before* it evaluates match conditions, so ``Deny``
  would refuse every write of everyone to the matched resources while no Lease exists
  (before the first leader, after a Lease is deleted by hand); a write whose Lease is
  absent is admitted, and no one leads without the Lease existing.

The residual window: the API server reads parameters from an informer, so a write it
admits within that informer's lag after a takeover (milliseconds on one API server; per
server with several) still passes; a write admitted just before a takeover is stored just
after it. The client's own gate (the lease checked locally before sending, in-flight
requests cancelled when it is lost) covers all but a process paused between its check and
the network.

:func:`manifests` renders the policy, its binding and the RBAC the operator needs for it;
``kopf-reconcile fence-policy`` prints them, and the chart installs the same objects.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EPOCH_EXTRA",
    "FENCE_MARKER",
    "HOLDER_EXTRA",
    "LEASE_EXTRA",
    "MANAGED_BY_SELECTOR",
    "binding",
    "manifests",
    "policy",
    "rbac",
]

LEASE_EXTRA = "kopf-reconcile.io/lease"
HOLDER_EXTRA = "kopf-reconcile.io/holder"
EPOCH_EXTRA = "kopf-reconcile.io/epoch"
EXTRAS = (LEASE_EXTRA, HOLDER_EXTRA, EPOCH_EXTRA)

#: The words every refusal of the fence starts with (the client tells them apart by these).
FENCE_MARKER = "stale write refused by the kopf-reconcile fence"

#: The Leases of an operator's namespace that are its parameters (as the electors label them).
MANAGED_BY_SELECTOR = {"app.kubernetes.io/managed-by": "kopf-reconcile"}


def _extra(key: str) -> str:
    return f"request.userInfo.extra[{key!r}][0]"


_LEASE = "params.metadata.namespace + '/' + params.metadata.name"
_HOLDER = "(has(params.spec.holderIdentity) ? params.spec.holderIdentity : '')"
_EPOCH = "string(has(params.spec.leaseTransitions) ? params.spec.leaseTransitions : 0)"
# A request without extras has no `extra` field at all: `in` on it would be an error, and
# an error fails the request (failurePolicy Fail), so its presence is tested first.
_KEYS = [f"{key!r} in request.userInfo.extra" for key in EXTRAS]
# Any of the three keys makes a request a fenced write; it is admitted only with all three.
_CARRIES = f"has(request.userInfo.extra) && ({' || '.join(_KEYS)})"
_CARRIES_ALL = " && ".join(_KEYS)


def policy(name: str) -> dict[str, Any]:
    """The ValidatingAdmissionPolicy ``name``: a fenced write must carry its Lease's epoch."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name, "labels": dict(MANAGED_BY_SELECTOR)},
        "spec": {
            "failurePolicy": "Fail",
            "paramKind": {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"},
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": ["*"],
                        "apiVersions": ["*"],
                        "resources": ["*/*"],  # every resource and subresource
                        # CONNECT: a proxy (or exec, attach, port-forward) request is
                        # one, whatever its HTTP method; it reaches a workload.
                        "operations": ["CREATE", "UPDATE", "DELETE", "CONNECT"],
                    }
                ]
            },
            "matchConditions": [{"name": "fenced-write", "expression": _CARRIES}],
            "variables": [
                {"name": "lease", "expression": _extra(LEASE_EXTRA)},
                {"name": "holder", "expression": _extra(HOLDER_EXTRA)},
                {"name": "epoch", "expression": _extra(EPOCH_EXTRA)},
            ],
            "validations": [
                {
                    "expression": _CARRIES_ALL,
                    "message": (
                        f"{FENCE_MARKER}: a fenced write carries all of {', '.join(EXTRAS)}"
                    ),
                    "reason": "Forbidden",
                },
                {
                    "expression": (
                        f"variables.lease != {_LEASE} || "
                        f"({_HOLDER} == variables.holder && {_EPOCH} == variables.epoch)"
                    ),
                    "messageExpression": (
                        f"'{FENCE_MARKER}: the write carries epoch ' + variables.epoch + "
                        "' of lease ' + variables.lease + ' (holder ' + variables.holder + "
                        f"'), which is now at epoch ' + {_EPOCH} + ' held by ' + "
                        f"({_HOLDER} == '' ? 'nobody' : {_HOLDER})"
                    ),
                    "reason": "Forbidden",
                },
            ],
        },
    }


def binding(name: str, policy_name: str, lease_namespace: str) -> dict[str, Any]:
    """The binding of ``policy_name`` to the kopf-reconcile Leases of ``lease_namespace``."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name, "labels": dict(MANAGED_BY_SELECTOR)},
        "spec": {
            "policyName": policy_name,
            "validationActions": ["Deny"],
            "paramRef": {
                "selector": {"matchLabels": dict(MANAGED_BY_SELECTOR)},
                "namespace": lease_namespace,
                "parameterNotFoundAction": "Allow",
            },
        },
    }


def rbac(name: str, service_account: str, namespace: str) -> list[dict[str, Any]]:
    """What the operator's ServiceAccount needs to impersonate itself with the extras.

    The extras are cluster-scoped (a ClusterRole); impersonating a ServiceAccount is asked
    in its namespace, so that rule is a Role there: the account can act as itself only,
    never as an account of the same name elsewhere.
    """
    labels = dict(MANAGED_BY_SELECTOR)
    subjects = [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}]
    rbac_group = "rbac.authorization.k8s.io"
    extras_rule = {
        "apiGroups": ["authentication.k8s.io"],
        "resources": [f"userextras/{key}" for key in EXTRAS],
        "verbs": ["impersonate"],
    }
    itself_rule = {
        "apiGroups": [""],
        "resources": ["serviceaccounts"],
        "resourceNames": [service_account],
        "verbs": ["impersonate"],
    }
    scoped = {"name": name, "namespace": namespace, "labels": labels}
    return [
        {
            "apiVersion": f"{rbac_group}/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name, "labels": labels},
            "rules": [extras_rule],
        },
        {
            "apiVersion": f"{rbac_group}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": labels},
            "roleRef": {"apiGroup": rbac_group, "kind": "ClusterRole", "name": name},
            "subjects": subjects,
        },
        {
            "apiVersion": f"{rbac_group}/v1",
            "kind": "Role",
            "metadata": scoped,
            "rules": [itself_rule],
        },
        {
            "apiVersion": f"{rbac_group}/v1",
            "kind": "RoleBinding",
            "metadata": scoped,
            "roleRef": {"apiGroup": rbac_group, "kind": "Role", "name": name},
            "subjects": subjects,
        },
    ]


def manifests(name: str, namespace: str, service_account: str) -> list[dict[str, Any]]:
    """Everything the fence needs for an operator whose Leases live in ``namespace``."""
    fence = f"{name}-{namespace}-fence"
    return [
        policy(fence),
        binding(fence, fence, namespace),
        *rbac(fence, service_account, namespace),
    ]
