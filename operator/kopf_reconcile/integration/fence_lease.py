"""What a fenced API write carries: who the operator is, and the Lease it leads under.

:class:`LeaseFence` turns a reconcile's :class:`~kopf_reconcile.fencing.writer.ReconcileLease`
into the headers of a fenced write (:mod:`.fence_policy` explains the policy that reads
them): the operator impersonates its own identity, as a ``SelfSubjectReview`` reports it
once per process, and adds the Lease (``<namespace>/<lease id>``), the holder and the epoch
as user extras. A ServiceAccount is impersonated by its username alone (the API server
adds its groups itself, and the account needs no right to impersonate groups); any other
user with its groups.

Which Lease. With the Kubernetes elector it is the elector's own Lease, which a takeover
moves to the next epoch atomically. With the PostgreSQL elector no Lease elects anyone,
so the leader *mirrors* its epoch into a Lease of the same name (labelled like the
elector's, so the policy's binding selects it) before its first write of a term: read it,
refuse (:class:`~kopf_reconcile.StaleEpochError`) when it shows a higher epoch or the same
epoch for another holder, else replace it conditionally on the version read (a racing
writer makes it read again). Epochs from the database only grow, and the mirror only
moves forward: from the moment the new leader mirrored its epoch the API server refuses
the old leader's writes. :meth:`LeaseFence.watch_leadership` mirrors as soon as a lease
holder of this process starts leading, not at its first write (which may never come: an
object already converged, a reconciler that writes only to PostgreSQL).

Is the Lease covered? The policy's binding selects the Leases of one namespace: an elector
given another namespace, or a cluster without the policy, leaves every write unchecked,
silently. So once per Lease, when this process starts leading it, a dry-run write of the
Lease itself is sent with a holder that does not hold it: the API server must refuse it; if
it admits it, an error says the fence does not cover the Lease and how to install it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException
from multidict import CIMultiDict

from kopf_reconcile.control.holding import LeadershipChange, LeaseHolder
from kopf_reconcile.fencing.protocol import StaleEpochError
from kopf_reconcile.fencing.writer import ReconcileLease
from kopf_reconcile.integration.api_client import ApiClientSource, request
from kopf_reconcile.integration.fence_policy import (
    EPOCH_EXTRA,
    FENCE_MARKER,
    HOLDER_EXTRA,
    LEASE_EXTRA,
    MANAGED_BY_SELECTOR,
)
from kopf_reconcile.leader.kubernetes import MAX_EPOCH, format_micro_time

__all__ = ["Identity", "LeadershipWatch", "LeaseFence"]

logger = logging.getLogger("kopf_reconcile.fence")

SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
_AUTHENTICATED = "system:authenticated"
HTTP_FORBIDDEN, HTTP_NOT_FOUND, HTTP_CONFLICT = 403, 404, 409
_MIRROR_ATTEMPTS = 5
#: The holder a coverage probe names: never a real one (holder ids end in a random suffix).
PROBE_HOLDER = "kopf-reconcile-fence-probe"
# A Lease just created reaches the API server's parameters after its informer's lag:
# the probe asks again for this long before it concludes that nothing covers the Lease.
_PROBE_ATTEMPTS, _PROBE_DELAY = 8, 0.25


class Identity:
    """Who the operator is to the API server, and the headers that act as that user."""

    __slots__ = ("groups", "username")

    def __init__(self, username: str, groups: tuple[str, ...]) -> None:
        self.username = username
        self.groups = groups

    def headers(self, extras: dict[str, str]) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict({"Impersonate-User": self.username})
        if not self.username.startswith(SERVICE_ACCOUNT_PREFIX):
            for group in self.groups:
                if group != _AUTHENTICATED:  # added by the API server itself
                    headers.add("Impersonate-Group", group)
        for key, value in extras.items():
            headers.add(f"Impersonate-Extra-{urllib.parse.quote(key, safe='')}", value)
        return headers

    def __repr__(self) -> str:
        return f"<Identity {self.username} groups={list(self.groups)}>"


class LeaseFence:
    """The headers of fenced writes under the Leases of one namespace."""

    def __init__(
        self,
        client: ApiClientSource,
        namespace: Callable[[], Awaitable[str]],
        *,
        mirror_ttl_seconds: int | None = None,
    ) -> None:
        """``mirror_ttl_seconds`` set: the electing store is not a Lease; mirror epochs."""
        self._client = client
        self._namespace = namespace
        self._mirror_ttl = mirror_ttl_seconds
        self._identity: Identity | None = None
        self._mirrored: dict[str, tuple[int, str]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._probed: set[str] = set()

    async def identity(self) -> Identity:
        if self._identity is None:
            review = await request(
                self._client,
                "POST",
                "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
            )
            info = (review.get("status") or {}).get("userInfo") or {}
            self._identity = Identity(str(info.get("username", "")), tuple(info.get("groups", ())))
        return self._identity

    async def headers(self, lease: ReconcileLease) -> CIMultiDict[str]:
        """Impersonation headers naming ``lease``, its holder and epoch (mirrored first)."""
        assert lease.lease_id is not None and lease.holder is not None
        namespace = await self._namespace()
        if self._mirror_ttl is not None:
            await self._mirror(namespace, lease.lease_id, lease.holder, lease.epoch)
        identity = await self.identity()
        return identity.headers(
            {
                LEASE_EXTRA: f"{namespace}/{lease.lease_id}",
                HOLDER_EXTRA: lease.holder,
                EPOCH_EXTRA: str(lease.epoch),
            }
        )

    def watch_leadership(self, leases: Callable[[str], bool]) -> LeadershipWatch:
        """From now on, whenever a lease holder of this process starts leading one of
        ``leases`` (by lease id): mirror its epoch at once, and check (once per Lease) that
        the API server's fence covers it. Close the watch to stop."""
        return LeadershipWatch(self, leases)

    async def on_lead(self, name: str, holder: str, epoch: int) -> None:
        """What :class:`LeadershipWatch` does when this process starts leading ``name``."""
        try:
            namespace = await self._namespace()
            if self._mirror_ttl is not None:
                await self._mirror(namespace, name, holder, epoch)
            if name not in self._probed and await self._probe(namespace, name, epoch):
                self._probed.add(name)  # a verdict; an inconclusive probe runs again next term
        except (StaleEpochError, ApiException, OSError, aiohttp.ClientError) as exc:
            logger.warning("lease %s: the fence's check at a new term failed: %s", name, exc)

    async def _probe(self, namespace: str, name: str, epoch: int) -> bool:
        """Refused: the fence covers the Lease. Admitted again and again: an error says so.
        Whether it reached a verdict (False: the Lease kept changing under it)."""
        path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        identity = await self.identity()
        extras = {LEASE_EXTRA: f"{namespace}/{name}", HOLDER_EXTRA: PROBE_HOLDER}
        headers = identity.headers({**extras, EPOCH_EXTRA: str(epoch)})
        admitted = 0
        for _ in range(_PROBE_ATTEMPTS):
            lease = await request(self._client, "GET", path)
            try:
                dry_run = [("dryRun", "All")]
                await request(self._client, "PUT", path, body=lease, query=dry_run, headers=headers)
            except ApiException as exc:
                if exc.status == HTTP_FORBIDDEN and FENCE_MARKER in str(exc.body or ""):
                    return True  # covered
                if exc.status != HTTP_CONFLICT:
                    raise
                continue  # renewed meanwhile: read it again
            admitted += 1
            await asyncio.sleep(_PROBE_DELAY)
        if admitted < _PROBE_ATTEMPTS // 2:
            return False  # mostly conflicts: no verdict
        logger.error(
            "the API server's fence does not cover lease %s/%s: a write under it that another "
            "holder has taken over is admitted, so a paused former leader's late API writes "
            "would land. Install the fence for namespace %s (the chart's fence.enabled, or "
            "`kopf-reconcile fence-policy --namespace %s --service-account <account> | kubectl "
            "apply -f -`), or set KOPF_RECONCILE_API_FENCE=off to say it is not wanted",
            namespace,
            name,
            namespace,
            namespace,
        )
        return True

    # -- the mirror of a PostgreSQL lease ----------------------------------------------

    async def _mirror(self, namespace: str, name: str, holder: str, epoch: int) -> None:
        if self._mirrored.get(name) == (epoch, holder):
            return
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if self._mirrored.get(name) == (epoch, holder):
                return
            if epoch > MAX_EPOCH:
                raise StaleEpochError(
                    f"epoch {epoch} of {name!r} does not fit in a Lease's spec.leaseTransitions "
                    f"(at most {MAX_EPOCH}): the API server's fence cannot record it"
                )
            await self._advance(namespace, name, holder, epoch)
            self._mirrored[name] = (epoch, holder)

    async def _advance(self, namespace: str, name: str, holder: str, epoch: int) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        for _ in range(_MIRROR_ATTEMPTS):
            try:
                lease = await request(self._client, "GET", f"{path}/{name}")
            except ApiException as exc:
                if exc.status != HTTP_NOT_FOUND:
                    raise
                lease = None
            record = self._record(namespace, name, holder, epoch, lease)
            if record is None:
                return  # it shows this holder at this epoch already
            try:
                if lease is None:
                    await request(self._client, "POST", path, body=record)
                else:
                    await request(self._client, "PUT", f"{path}/{name}", body=record)
            except ApiException as exc:
                if exc.status in (HTTP_CONFLICT, HTTP_NOT_FOUND):
                    continue  # someone wrote it meanwhile: read it again
                raise
            return
        raise StaleEpochError(
            f"lease {namespace}/{name}: its epoch could not be mirrored after "
            f"{_MIRROR_ATTEMPTS} conflicting writes; the API write was not sent"
        )

    def _record(
        self, namespace: str, name: str, holder: str, epoch: int, lease: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """The Lease to write, None when it is current; StaleEpochError when it is ahead."""
        if lease is not None:
            spec = lease.get("spec") or {}
            shown = int(spec.get("leaseTransitions") or 0)
            shown_holder = spec.get("holderIdentity") or ""
            if shown > epoch or (shown == epoch and shown_holder != holder):
                raise StaleEpochError(
                    f"lease {namespace}/{name} shows epoch {shown} held by "
                    f"{shown_holder or 'nobody'}: epoch {epoch} of {holder} is no longer current"
                )
            if shown == epoch:
                return None
        now = format_micro_time(datetime.datetime.now(datetime.UTC))
        metadata: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "labels": {**MANAGED_BY_SELECTOR, "kopf-reconcile/fence-mirror": "true"},
        }
        if lease is not None:
            metadata["resourceVersion"] = lease["metadata"]["resourceVersion"]
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": holder,
                "leaseTransitions": epoch,
                "leaseDurationSeconds": self._mirror_ttl,
                "acquireTime": now,
                "renewTime": now,
            },
        }


class LeadershipWatch:
    """Runs :meth:`LeaseFence.on_lead` as lease holders of this process start leading."""

    def __init__(self, fence: LeaseFence, leases: Callable[[str], bool]) -> None:
        self._fence = fence
        self._leases = leases
        self._tasks: set[asyncio.Task[None]] = set()
        self._forget = LeaseHolder.observe(self._observe)

    def _observe(self, change: LeadershipChange) -> None:
        if not change.leading or change.holder_id is None:
            return
        if not self._leases(change.reconciler_id):
            return
        task = asyncio.get_running_loop().create_task(
            self._fence.on_lead(change.reconciler_id, change.holder_id, change.epoch),
            name=f"fence of {change.reconciler_id} at epoch {change.epoch}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._forget()
        tasks, self._tasks = set(self._tasks), set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
