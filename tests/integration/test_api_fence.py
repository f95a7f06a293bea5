"""The API server's fence: a deposed leader's late writes are refused by the API server itself.

A reconcile's fenced client (``kr.fenced_client()``) sends each write as the operator's own
identity with its Lease, holder and epoch as user extras; the admission policy of
``kopf_reconcile.integration.fence_policy``, bound to the Leases of the namespace, admits a
write only while that Lease still names its holder at its epoch. Here a "zombie" client
whose local check still passes (a process paused between its check and the network) writes
after another holder took its Lease over: its status patch, child creation, update,
server-side apply and deletion are each refused with ``StaleEpochError`` and change nothing.
With the binding removed the same write is admitted: the API server is the guard.
The same for the PostgreSQL elector's mirrored Lease. On both API tiers.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio.client.exceptions import ApiException

import kopf_reconcile as kr
from kopf_reconcile.fencing.writer import ReconcileLease
from kopf_reconcile.integration import fence_policy
from kopf_reconcile.integration.api_client import LazyApiClient, request
from kopf_reconcile.integration.fence_lease import LeaseFence
from kopf_reconcile.integration.fenced_client import ClientContext, FencedClient
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore
from support import CRDS, eventually, gadget_crd, install_crd

CONFIGMAPS = kr.Resource("", "v1", "configmaps")
ADMISSION = "/apis/admissionregistration.k8s.io/v1"


def counted() -> tuple[dict[str, int], Any]:
    outcomes: dict[str, int] = {}

    def count(outcome: str) -> None:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    return outcomes, count


@pytest_asyncio.fixture
async def gadgets(kube: Any) -> AsyncIterator[kr.Resource]:
    """A kind of its own with a status subresource."""
    group = f"g{uuid.uuid4().hex[:8]}.example.com"
    crd = gadget_crd(group)
    crd["spec"]["versions"][0]["subresources"] = {"status": {}}
    async with kube.http_session() as http:
        await install_crd(http, crd)
        yield kr.Resource(group, "v1", "gadgets")
        await http.delete(f"{CRDS}/gadgets.{group}")


@pytest_asyncio.fixture
async def fence(kube: Any, kube_namespace: str) -> AsyncIterator[str]:
    """The fence's policy and binding over the Leases of the test's namespace."""
    name = f"fence-{kube_namespace}"
    async with kube.http_session() as http:
        policy, binding = (
            fence_policy.policy(name),
            fence_policy.binding(name, name, kube_namespace),
        )
        for kind, body in (
            ("validatingadmissionpolicies", policy),
            ("validatingadmissionpolicybindings", binding),
        ):
            async with http.post(f"{ADMISSION}/{kind}", json=body) as response:
                assert response.status == 201, await response.text()
        yield name
        for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
            await http.delete(f"{ADMISSION}/{kind}/{name}")


async def remove_binding(kube: Any, name: str) -> None:
    path = f"{ADMISSION}/validatingadmissionpolicybindings/{name}"
    async with kube.http_session() as http, http.delete(path) as response:
        assert response.status == 200, await response.text()


async def take_over(kube: Any, namespace: str, lease_id: str) -> kr.LeaseToken:
    """Another holder takes the Lease over once it expired (a real takeover)."""
    async with kube.api_client() as api:
        elector = kr.KubernetesLeaseElector(namespace, ttl=kr.LeaseTTL(1), api=api, holder_id="b")
        taken: list[kr.LeaseToken] = []

        async def took() -> bool:
            try:
                taken.append(await elector.acquire_lease(lease_id))
            except kr.LeaseContended:
                return False
            return True

        await eventually(took, timeout=30, interval=0.2, message="b takes the Lease over")
        return taken[0]


def client_of(
    kube: Any, lazy: LazyApiClient, fence: LeaseFence, lease: ReconcileLease
) -> FencedClient:
    return FencedClient(ClientContext(lazy, field_manager="fence-test", fence=fence), lease)


async def test_a_deposed_leaders_status_patch_child_creation_update_apply_and_delete_are_refused(
    kube: Any, kube_namespace: str, gadgets: kr.Resource, fence: str
) -> None:
    ns = kube_namespace
    async with kube.api_client() as api:
        elector = kr.KubernetesLeaseElector(ns, ttl=kr.LeaseTTL(1), api=api, holder_id="a")
        token = await elector.acquire_lease("zombie")
        lazy = LazyApiClient(api)
        lease_fence = LeaseFence(lazy, elector.lease_namespace)
        outcomes, count = counted()
        # The zombie: its local check passes (paused after it), its epoch is the old one.
        lease = ReconcileLease(
            token.epoch, lambda epoch: True, lease_id="zombie", holder="a", count_api_write=count
        )
        a = client_of(kube, lazy, lease_fence, lease)
        owner = await a.create(
            gadgets,
            {
                "apiVersion": f"{gadgets.group}/v1",
                "kind": "Gadget",
                "metadata": {"name": "owner", "namespace": ns},
            },
        )
        await a.patch_status(gadgets, "owner", {"phase": "one"}, namespace=ns)
        child = await a.create(
            CONFIGMAPS, {"metadata": {"name": "child"}, "data": {"n": "1"}}, owner=owner
        )
        assert child["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
        await a.create(CONFIGMAPS, {"metadata": {"name": "doomed", "namespace": ns}})
        assert outcomes == {"accepted": 4}

        taken = await take_over(kube, ns, "zombie")
        assert taken.epoch == token.epoch + 1
        b_lease = ReconcileLease(taken.epoch, lambda epoch: True, lease_id="zombie", holder="b")
        b = client_of(kube, lazy, lease_fence, b_lease)
        # The new leader's first write is admitted: the API server knows the new epoch.
        await b.patch_status(gadgets, "owner", {"phase": "two"}, namespace=ns)

        refusals = [
            a.patch_status(gadgets, "owner", {"phase": "late"}, namespace=ns),
            a.create(CONFIGMAPS, {"metadata": {"name": "late-child"}}, owner=owner),
            a.patch(CONFIGMAPS, "child", {"data": {"n": "late"}}, namespace=ns),
            a.apply(
                CONFIGMAPS,
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": "child", "namespace": ns},
                    "data": {"n": "applied"},
                },
            ),
            a.delete(CONFIGMAPS, "doomed", namespace=ns),
        ]
        for write in refusals:
            with pytest.raises(
                kr.StaleEpochError, match=r"stale write refused .* epoch 2 held by b"
            ):
                await write
        assert outcomes["refused_by_server"] == len(refusals)

        assert (await b.get(gadgets, "owner", namespace=ns) or {})["status"] == {"phase": "two"}
        assert (await b.get(CONFIGMAPS, "child", namespace=ns) or {})["data"] == {"n": "1"}
        assert await b.get(CONFIGMAPS, "late-child", namespace=ns) is None
        assert await b.get(CONFIGMAPS, "doomed", namespace=ns) is not None

        # Without the fence's binding the same late write goes through: the server guards.
        await remove_binding(kube, fence)

        async def admitted() -> bool:
            try:
                await a.patch_status(gadgets, "owner", {"phase": "late"}, namespace=ns)
            except kr.StaleEpochError:
                return False
            return True

        await eventually(admitted, timeout=10, message="admitted once the binding is gone")
        assert (await b.get(gadgets, "owner", namespace=ns) or {})["status"] == {"phase": "late"}
        await elector.close()


async def test_the_local_check_refuses_before_sending(
    kube: Any, kube_namespace: str, fence: str
) -> None:
    async with kube.api_client() as api:
        lazy = LazyApiClient(api)
        outcomes, count = counted()

        async def namespace() -> str:
            return kube_namespace

        lease = ReconcileLease(
            3, lambda epoch: False, lease_id="x", holder="a", count_api_write=count
        )
        client = client_of(kube, lazy, LeaseFence(lazy, namespace), lease)
        with pytest.raises(kr.StaleEpochError, match="refused locally"):
            await client.create(
                CONFIGMAPS, {"metadata": {"name": "never", "namespace": kube_namespace}}
            )
        assert outcomes == {"refused_locally": 1}
        assert await client.get(CONFIGMAPS, "never", namespace=kube_namespace) is None


async def test_a_mirrored_epoch_fences_a_postgresql_leaders_writes(
    kube: Any, kube_namespace: str, fence: str
) -> None:
    """Epochs of a store that is no Lease are mirrored into one, only ever forwards."""
    ns = kube_namespace

    async def namespace() -> str:
        return ns

    async with kube.api_client() as api:
        lazy = LazyApiClient(api)
        a_fence = LeaseFence(lazy, namespace, mirror_ttl_seconds=15)
        b_fence = LeaseFence(lazy, namespace, mirror_ttl_seconds=15)
        a = client_of(
            kube, lazy, a_fence, ReconcileLease(41, lambda e: True, lease_id="pg", holder="a")
        )
        b = client_of(
            kube, lazy, b_fence, ReconcileLease(42, lambda e: True, lease_id="pg", holder="b")
        )
        await a.create(CONFIGMAPS, {"metadata": {"name": "first", "namespace": ns}})
        # The API server reads its parameters from an informer: a Lease it has not seen yet
        # fences nothing (no parameter: admitted). Wait until it refuses a wrong epoch.
        wrong = client_of(
            kube,
            lazy,
            LeaseFence(lazy, namespace),  # sends what it is given, mirrors nothing
            ReconcileLease(41, lambda e: True, lease_id="pg", holder="x"),
        )

        plain = FencedClient(ClientContext(lazy, field_manager="fence-test"), None)

        async def refused() -> bool:
            try:
                await wrong.create(CONFIGMAPS, {"metadata": {"name": "x", "namespace": ns}})
            except kr.StaleEpochError:
                return True
            # Admitted before the API server knew the Lease: taken back by a client without
            # the lease (the API server may know it by now, and refuse the wrong one).
            await plain.delete(CONFIGMAPS, "x", namespace=ns)
            return False

        await eventually(refused, message="the API server knows the mirrored Lease")
        await b.create(CONFIGMAPS, {"metadata": {"name": "second", "namespace": ns}})
        # a mirrored 41 before b mirrored 42: its late write carries 41, the server refuses it.
        with pytest.raises(kr.StaleEpochError, match="epoch 42 held by b"):
            await a.delete(CONFIGMAPS, "second", namespace=ns)
        # A process that has not mirrored yet reads the mirror and refuses before sending.
        late = client_of(
            kube,
            lazy,
            LeaseFence(lazy, namespace, mirror_ttl_seconds=15),
            ReconcileLease(41, lambda e: True, lease_id="pg", holder="a"),
        )
        with pytest.raises(kr.StaleEpochError, match="shows epoch 42 held by b"):
            await late.delete(CONFIGMAPS, "second", namespace=ns)
        assert await b.get(CONFIGMAPS, "second", namespace=ns) is not None


async def test_a_write_with_part_of_the_lease_is_refused_and_one_without_is_not_checked(
    kube: Any, kube_namespace: str, fence: str
) -> None:
    """Any of the three extras makes a write a fenced one; without all three it is refused
    (it fails closed), and a write without any is none of the fence's business."""
    ns = kube_namespace
    async with kube.api_client() as api:
        elector = kr.KubernetesLeaseElector(ns, ttl=kr.LeaseTTL(5), api=api, holder_id="a")
        token = await elector.acquire_lease("part")
        lazy = LazyApiClient(api)
        identity = await LeaseFence(lazy, elector.lease_namespace).identity()
        path = f"/api/v1/namespaces/{ns}/configmaps"
        partial = identity.headers(
            {fence_policy.LEASE_EXTRA: f"{ns}/part", fence_policy.HOLDER_EXTRA: "a"}
        )
        with pytest.raises(ApiException) as refused:
            await request(
                lazy, "POST", path, body={"metadata": {"name": "partial"}}, headers=partial
            )
        assert refused.value.status == 403
        assert "carries all of" in str(refused.value.body)
        unrelated = identity.headers({"example.com/team": "ops"})
        await request(lazy, "POST", path, body={"metadata": {"name": "other"}}, headers=unrelated)
        whole = identity.headers(
            {
                fence_policy.LEASE_EXTRA: f"{ns}/part",
                fence_policy.HOLDER_EXTRA: "a",
                fence_policy.EPOCH_EXTRA: str(token.epoch),
            }
        )
        await request(lazy, "POST", path, body={"metadata": {"name": "whole"}}, headers=whole)
        await elector.close()


@pytest.mark.parametrize("installed", [True, False], ids=["fence-installed", "no-fence"])
async def test_a_new_term_is_mirrored_at_once_and_a_lease_the_fence_misses_is_reported(
    kube: Any, kube_namespace: str, installed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """When a process starts leading, its epoch is mirrored before any write (a new leader
    that writes nothing still closes the old one's window), and a dry-run write under a
    holder that does not hold the Lease must be refused: when it is not, an error says the
    fence does not cover it."""
    ns = kube_namespace
    policy_name = f"fence-{ns}"
    async with kube.http_session() as http:
        if installed:
            for kind, body in (
                ("validatingadmissionpolicies", fence_policy.policy(policy_name)),
                (
                    "validatingadmissionpolicybindings",
                    fence_policy.binding(policy_name, policy_name, ns),
                ),
            ):
                async with http.post(f"{ADMISSION}/{kind}", json=body) as response:
                    assert response.status == 201, await response.text()

        async def namespace() -> str:
            return ns

        async with kube.api_client() as api:
            lazy = LazyApiClient(api)
            fence = LeaseFence(lazy, namespace, mirror_ttl_seconds=15)
            watch = fence.watch_leadership({"quiet"}.__contains__)

            async def nothing(req: kr.Request) -> None:
                pass

            loop = (
                kr.Builder(nothing, kr.Tenancy.SINGLE_TENANT)
                .with_trigger(kr.TickerTrigger(3600))
                .with_leader(MemoryLeaseElector(MemoryLeaseStore()))
                .with_reconciler_id("quiet")
                .build()
            )
            await loop.start()
            try:
                lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/quiet"

                async def mirrored() -> bool:
                    async with http.get(lease_path) as response:
                        if response.status != 200:
                            return False
                        spec = (await response.json())["spec"]
                    return bool(spec["leaseTransitions"] == loop.stats().epoch >= 1)

                await eventually(mirrored, message="the epoch mirrored with no write at all")
                await eventually(lambda: not watch._tasks, timeout=10, message="probed")
            finally:
                await loop.stop()
                await watch.close()
        if installed:
            for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
                await http.delete(f"{ADMISSION}/{kind}/{policy_name}")
    reported = [r for r in caplog.records if "does not cover lease" in r.getMessage()]
    assert bool(reported) is not installed, [r.getMessage() for r in caplog.records]
    if reported:
        assert f"namespace {ns}" in reported[0].getMessage()
