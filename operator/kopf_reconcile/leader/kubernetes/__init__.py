"""Leader election on a Kubernetes ``coordination.k8s.io/v1`` Lease.

:class:`KubernetesLeaseElector` keeps one Lease per reconciler id, named after it,
and follows client-go's ``LeaseLock`` model; its epoch is ``spec.leaseTransitions``,
never reused nor reversed. One module per concept:

=================  ============================================================
``elector``        :class:`KubernetesLeaseElector`: acquire, renew, release,
                   expiry on this process's clock, the epoch and its floor
``release_watch``  how a follower learns at once that a Lease was released
``connection``     the API client (:func:`connect_api`), the Leases' namespace,
                   requests on Leases
``lease_record``   the Lease object: fields, labels, ``MicroTime`` values
=================  ============================================================
"""

from __future__ import annotations

from kopf_reconcile.leader.kubernetes.connection import connect_api, kubeconfig_namespace
from kopf_reconcile.leader.kubernetes.elector import KubernetesLeaseElector
from kopf_reconcile.leader.kubernetes.lease_record import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    MAX_EPOCH,
    RECONCILER_LABEL,
    format_micro_time,
    lease_duration_seconds,
)
from kopf_reconcile.leader.protocol import LeaseEpochExhausted
from kopf_reconcile.leader.timing import DEFAULT_LEASE_TTL

__all__ = [
    "DEFAULT_LEASE_TTL",
    "MANAGED_BY",
    "MANAGED_BY_LABEL",
    "MAX_EPOCH",
    "RECONCILER_LABEL",
    "KubernetesLeaseElector",
    "LeaseEpochExhausted",
    "connect_api",
    "format_micro_time",
    "kubeconfig_namespace",
    "lease_duration_seconds",
]
