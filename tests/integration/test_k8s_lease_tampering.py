"""A Lease that names this elector is kept only at the epoch this elector holds.

Anyone allowed to update Leases can restore an old one from a backup (an
older epoch) or patch ``spec.leaseTransitions`` (up to 2**31 - 1, the most an
int32 holds). Neither may be adopted as "still ours": the epoch would go
backwards, or to the bound, after which no takeover fits in a Lease. Epochs
are bounded by what a Lease carries, with an error that says how to repair,
and one value seen at the bound does not block every later takeover. Every
test runs on both API tiers (the ``kube`` fixture).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

import kopf_reconcile as kr
from kopf_reconcile.leader import kubernetes as k8s
from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector
from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
from kopf_reconcile.testing.memory import MemoryFencedRepository
from support import eventually

RID = "devices"
INT32_MAX = 2**31 - 1

ElectorFactory = Callable[..., KubernetesLeaseElector]


def lease_path(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{RID}"


@pytest.fixture
def elector(api: Any, kube_namespace: str) -> ElectorFactory:
    def make(ttl: float = 15) -> KubernetesLeaseElector:
        return KubernetesLeaseElector(namespace=kube_namespace, ttl=ttl, api=api)

    return make


async def patch_transitions(kube: Any, namespace: str, transitions: int) -> None:
    """What ``kubectl patch lease --type merge -p '{"spec":{"leaseTransitions":N}}'`` does."""
    patch = {"spec": {"leaseTransitions": transitions}}
    headers = {"Content-Type": "application/merge-patch+json"}
    async with (
        kube.http_session() as http,
        http.patch(lease_path(namespace), json=patch, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()


async def read_spec(kube: Any, namespace: str) -> dict[str, Any] | None:
    async with kube.http_session() as http, http.get(lease_path(namespace)) as r:
        if r.status == 404:
            return None
        assert r.status == 200, await r.text()
        spec: dict[str, Any] = (await r.json())["spec"]
        return spec


async def delete_lease(kube: Any, namespace: str) -> None:
    async with kube.http_session() as http, http.delete(lease_path(namespace)) as r:
        assert r.status == 200, await r.text()


async def test_a_lease_restored_from_a_backup_is_taken_over_above_the_epoch_held(
    kube: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    a, b = elector(), elector()
    await a.release_lease(await a.acquire_lease(RID))
    await b.release_lease(await b.acquire_lease(RID))
    held = await a.acquire_lease(RID)
    assert held.epoch == 3
    # The Lease as a backup taken at epoch 1 shows it: still naming a.
    await patch_transitions(kube, kube_namespace, 1)
    token = await a.acquire_lease(RID)
    assert token.epoch == 4  # never 1: a change of holder above every epoch known
    spec = await read_spec(kube, kube_namespace)
    assert spec is not None
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == (a.holder_id, 4)
    with pytest.raises(kr.LeaseLost):
        await a.renew_lease(held)
    await a.renew_lease(token)
    assert (await a.acquire_lease(RID)).epoch == 4  # still ours at the epoch held: kept


async def test_a_lease_edited_to_the_int32_bound_is_refused_and_deleting_it_repairs(
    kube: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    a, b = elector(), elector()
    held = await a.acquire_lease(RID)
    with pytest.raises(kr.LeaseContended):
        await b.acquire_lease(RID)
    await patch_transitions(kube, kube_namespace, INT32_MAX)
    with pytest.raises(kr.LeaseLost):
        await a.renew_lease(held)  # the leader steps down
    with pytest.raises(kr.LeaseError) as refused:
        await a.acquire_lease(RID)  # and does not adopt the edited epoch
    assert isinstance(refused.value, k8s.LeaseEpochExhausted)
    message = str(refused.value)
    assert str(INT32_MAX) in message
    assert f"kubectl delete lease -n {kube_namespace} {RID}" in message
    spec = await read_spec(kube, kube_namespace)
    assert spec is not None and spec["leaseTransitions"] == INT32_MAX  # nothing written
    with pytest.raises(kr.LeaseContended):
        await b.acquire_lease(RID)  # b sees the edited value too (held by a, not expired)

    # The repair the error names: delete the Lease. The fenced store's floor is the
    # epoch a led at; nobody is kept from leading by the value once seen.
    fenced = MemoryFencedRepository()
    assert await fenced.apply_fenced("device-1", held.epoch, {"on": True})
    a.use_epoch_floor(RID, fenced.highest_epoch)
    await delete_lease(kube, kube_namespace)
    token = await a.acquire_lease(RID)
    assert token.epoch == held.epoch + 1
    await a.release_lease(token)
    assert (await b.acquire_lease(RID)).epoch == token.epoch + 1


async def test_a_floor_at_the_int32_bound_is_refused_naming_the_fenced_store(
    kube: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    async def at_the_bound() -> int:
        return INT32_MAX

    a = elector()
    a.use_epoch_floor(RID, at_the_bound)
    for _ in range(2):  # the same clear error every time, not a 400 from the server
        with pytest.raises(kr.LeaseError, match="fenced store") as refused:
            await a.acquire_lease(RID)
        assert isinstance(refused.value, k8s.LeaseEpochExhausted)
        assert f"kubectl delete lease -n {kube_namespace} {RID}" in str(refused.value)
    assert await read_spec(kube, kube_namespace) is None


async def test_a_loop_never_leads_at_an_edited_epoch_and_leads_again_once_repaired(
    kube: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    async def quiet(req: kr.Request) -> None:
        return None

    fenced = MemoryFencedRepository()
    loop = (
        kr.Builder(quiet, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(elector(ttl=5))
        .with_fenced_repo(fenced)
        .with_reconciler_id(RID)
        .with_renew_interval(0.2)
        .build()
    )
    epochs: set[int] = set()

    def leading() -> bool:
        stats = loop.stats()
        if stats.is_leader:
            epochs.add(stats.epoch)
        return stats.is_leader

    async with loop:
        await eventually(leading)
        first = loop.stats().epoch
        await patch_transitions(kube, kube_namespace, INT32_MAX)
        await eventually(lambda: not leading())
        await asyncio.sleep(1.0)  # several retries: none of them adopts the edited epoch
        assert not leading()
        await delete_lease(kube, kube_namespace)
        await eventually(leading)
    assert epochs == {first, first + 1}


async def test_a_takeover_whose_answer_was_lost_is_still_ours_at_its_epoch(
    embedded_cluster: EmbeddedCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with embedded_cluster.api_client() as api, embedded_cluster.api_client() as lossy:
        a = KubernetesLeaseElector("default", ttl=15, api=api)
        b = KubernetesLeaseElector("default", ttl=15, api=lossy)
        await a.release_lease(await a.acquire_lease(RID))
        # b's takeover is written, but its answer never arrives.
        sent = lossy.call_api

        async def answer_lost(path: str, method: str, *args: Any, **kwargs: Any) -> Any:
            result = await sent(path, method, *args, **kwargs)
            if method == "PUT":
                raise aiohttp.ServerDisconnectedError()
            return result

        monkeypatch.setattr(lossy, "call_api", answer_lost)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await b.acquire_lease(RID)
        monkeypatch.setattr(lossy, "call_api", sent)
        spec = await read_spec(embedded_cluster, "default")
        assert spec is not None
        assert (spec["holderIdentity"], spec["leaseTransitions"]) == (b.holder_id, 2)
        token = await b.acquire_lease(RID)
        assert token.epoch == 2  # the epoch it wrote: kept, not taken over again
