"""The API server's fence on a test cluster, as the chart installs it (``fence.enabled``).

:func:`install_fence` creates the ValidatingAdmissionPolicy and its binding to the
kopf-reconcile Leases of ``namespace`` (:mod:`kopf_reconcile.integration.fence_policy`)
through ``http``, a session whose base URL is the cluster's (``cluster.http_session()``):
on the embedded API and on a real one alike. Install it before the operator starts, as the
chart does: an operator that leads a Lease the fence does not cover says so in its log.
"""

from __future__ import annotations

import aiohttp

from kopf_reconcile.integration import fence_policy

__all__ = ["install_fence"]

HTTP_CONFLICT = 409
_ADMISSION = "/apis/admissionregistration.k8s.io/v1"


async def install_fence(
    http: aiohttp.ClientSession, namespace: str = "default", *, name: str = "kopf-reconcile"
) -> str:
    """Create the fence for the Leases of ``namespace`` (kept if there); its objects' name."""
    fence = f"{name}-{namespace}-fence"
    for kind, body in (
        ("validatingadmissionpolicies", fence_policy.policy(fence)),
        ("validatingadmissionpolicybindings", fence_policy.binding(fence, fence, namespace)),
    ):
        async with http.post(f"{_ADMISSION}/{kind}", json=body) as response:
            if response.status not in (201, HTTP_CONFLICT):
                raise RuntimeError(
                    f"the fence's {kind} could not be created: {response.status} "
                    f"{await response.text()}"
                )
    return fence
