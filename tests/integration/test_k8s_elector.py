"""KubernetesLeaseElector over HTTP, on the embedded cluster and on a real kube-apiserver.

Every test that can runs on both backends (the ``kube`` fixture) in a namespace of
its own; fault injection needs the embedded cluster. Nothing here patches the
client: electors talk to a real API server through kubernetes-asyncio.
"""

from __future__ import annotations

import asyncio
import datetime
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

import kopf_reconcile as kr
from kopf_reconcile.leader.kubernetes import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    RECONCILER_LABEL,
    KubernetesLeaseElector,
    format_micro_time,
    lease_duration_seconds,
)
from kopf_reconcile.leader.kubernetes import elector as k8s_elector
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.loop import Loop
from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
from kopf_reconcile.testing.memory import MemoryFencedRepository
from support import eventually, fenced_loop

RID = "devices"
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
KUBECTL = Path(sys.executable).with_name("kubectl")

ElectorFactory = Callable[..., KubernetesLeaseElector]


def leases_path(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


@pytest.fixture
def elector(api: Any, kube_namespace: str) -> ElectorFactory:
    """Electors in the test's namespace, sharing one (borrowed) API client."""

    def make(ttl: float = 15, **options: Any) -> KubernetesLeaseElector:
        return KubernetesLeaseElector(namespace=kube_namespace, ttl=ttl, api=api, **options)

    return make


async def read_lease(kube: Any, namespace: str, name: str = RID) -> dict[str, Any] | None:
    async with kube.http_session() as http, http.get(f"{leases_path(namespace)}/{name}") as r:
        if r.status == 404:
            return None
        assert r.status == 200, await r.text()
        lease: dict[str, Any] = await r.json()
        return lease


async def delete_lease(kube: Any, namespace: str, name: str = RID) -> None:
    async with kube.http_session() as http, http.delete(f"{leases_path(namespace)}/{name}") as r:
        assert r.status == 200, await r.text()


async def acquire_eventually(
    elector: KubernetesLeaseElector, timeout: float = 10.0
) -> tuple[kr.LeaseToken, float]:
    """Poll acquire until it succeeds; the token and when the first attempt was made."""
    first = time.monotonic()
    deadline = first + timeout
    while True:
        try:
            return await elector.acquire_lease(RID), first
        except kr.LeaseContended:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


# -- configuration values ---------------------------------------------------------


def test_it_is_a_leader_elector() -> None:
    assert isinstance(KubernetesLeaseElector(namespace="default"), kr.LeaderElector)


@pytest.mark.parametrize(
    "ttl", [0.5, 1.5, 2.25, datetime.timedelta(milliseconds=1500), 2**31, kr.LeaseTTL(0.001)]
)
def test_a_ttl_that_is_not_whole_seconds_is_refused_not_rounded(ttl: object) -> None:
    with pytest.raises(kr.ConfigError, match="whole number of seconds") as refused:
        KubernetesLeaseElector(namespace="default", ttl=ttl)  # type: ignore[arg-type]
    seconds = ttl.seconds if isinstance(ttl, kr.LeaseTTL) else kr.LeaseTTL(ttl).seconds  # type: ignore[arg-type]
    assert repr(seconds) in str(refused.value)


@pytest.mark.parametrize(
    ("ttl", "seconds"), [(1, 1), (15, 15), (2.0, 2), (datetime.timedelta(minutes=1), 60)]
)
def test_whole_seconds_reach_the_lease_duration(ttl: Any, seconds: int) -> None:
    elector = KubernetesLeaseElector(namespace="default", ttl=ttl)
    assert lease_duration_seconds(elector.ttl) == seconds
    assert elector.ttl.seconds == seconds  # the Loop derives its renew deadline from it


def test_micro_time_has_exactly_six_fractional_digits_even_when_they_are_zero() -> None:
    whole = datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    assert whole.isoformat() == "2024-01-02T03:04:05+00:00"  # what the API server rejects
    assert format_micro_time(whole) == "2024-01-02T03:04:05.000000Z"
    assert format_micro_time(whole.replace(microsecond=7)) == "2024-01-02T03:04:05.000007Z"
    elsewhere = datetime.timezone(datetime.timedelta(hours=2))
    assert format_micro_time(datetime.datetime(2024, 1, 2, 5, 4, 5, 120000, tzinfo=elsewhere)) == (
        "2024-01-02T03:04:05.120000Z"
    )
    with pytest.raises(ValueError, match="naive"):
        format_micro_time(datetime.datetime(2024, 1, 2))


def test_holder_ids_are_unique_per_instance_and_name_the_pod(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("POD_NAME", "devices-7d9f")
    ids = {KubernetesLeaseElector(namespace="default").holder_id for _ in range(50)}
    ids.add(PostgresLeaseElector("postgresql://localhost/db").holder_id)
    assert len(ids) == 51
    assert all(holder.startswith("devices-7d9f-") for holder in ids)


def test_namespace_defaults_to_pod_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "team-a")
    assert KubernetesLeaseElector().namespace == "team-a"
    assert KubernetesLeaseElector(namespace="team-b").namespace == "team-b"


@pytest.mark.parametrize(
    "options",
    [{"namespace": ""}, {"holder_id": ""}, {"api": object(), "kubeconfig": "/some/kubeconfig"}],
)
def test_bad_options_are_config_errors(options: dict[str, Any]) -> None:
    with pytest.raises(kr.ConfigError):
        KubernetesLeaseElector(**options)


# -- the Lease itself ---------------------------------------------------------------


async def test_the_lease_is_named_after_the_reconciler_and_labelled(
    kube: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    a = elector(ttl=15)
    token = await a.acquire_lease(RID)
    assert (token.reconciler_id, token.holder_id, token.epoch) == (RID, a.holder_id, 1)
    assert token.expires_at - token.acquired_at == datetime.timedelta(seconds=15)
    lease = await read_lease(kube, kube_namespace)
    assert lease is not None
    assert lease["metadata"]["labels"] == {MANAGED_BY_LABEL: MANAGED_BY, RECONCILER_LABEL: RID}
    spec = lease["spec"]
    assert (spec["holderIdentity"], spec["leaseDurationSeconds"], spec["leaseTransitions"]) == (
        a.holder_id,
        15,
        1,
    )
    assert MICRO_TIME.match(spec["acquireTime"]) and MICRO_TIME.match(spec["renewTime"])
    selector = f"?labelSelector={MANAGED_BY_LABEL}={MANAGED_BY}"
    async with kube.http_session() as http, http.get(leases_path(kube_namespace) + selector) as r:
        assert [item["metadata"]["name"] for item in (await r.json())["items"]] == [RID]


async def test_zero_microsecond_times_are_written_so_the_api_server_accepts_them(
    kube: Any, kube_namespace: str, elector: ElectorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_the_second = datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.UTC)
    monkeypatch.setattr(k8s_elector, "_wall_clock", lambda: on_the_second)
    a = elector()
    token = await a.acquire_lease(RID)
    await a.renew_lease(token)
    lease = await read_lease(kube, kube_namespace)
    assert lease is not None
    written = "2024-05-06T07:08:09.000000Z"
    assert lease["spec"]["acquireTime"] == lease["spec"]["renewTime"] == written
    await a.release_lease(token)
    assert (await read_lease(kube, kube_namespace) or {})["spec"]["holderIdentity"] == ""


async def test_the_clients_own_datetime_serialisation_would_be_rejected(
    api: Any, kube_namespace: str
) -> None:
    """Why the elector writes Lease bodies itself: kubernetes-asyncio uses isoformat()."""
    on_the_second = datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.UTC)
    typed = client.V1Lease(
        metadata=client.V1ObjectMeta(name="typed"),
        spec=client.V1LeaseSpec(holder_identity="x", renew_time=on_the_second),
    )
    assert api.sanitize_for_serialization(typed)["spec"]["renewTime"] == (
        "2024-05-06T07:08:09+00:00"
    )
    with pytest.raises(ApiException) as rejected:
        await client.CoordinationV1Api(api).create_namespaced_lease(kube_namespace, typed)
    assert rejected.value.status == 400


# -- contention, handover, epochs -----------------------------------------------------


@pytest.mark.parametrize("contenders", [2, 3])
async def test_contenders_get_exactly_one_holder_and_a_new_epoch_per_handover(
    kube: Any, kube_namespace: str, elector: ElectorFactory, contenders: int
) -> None:
    electors = [elector() for _ in range(contenders)]
    epochs = []
    for _ in range(8):
        outcomes = await asyncio.gather(
            *(each.acquire_lease(RID) for each in electors), return_exceptions=True
        )
        tokens = [outcome for outcome in outcomes if isinstance(outcome, kr.LeaseToken)]
        assert len(tokens) == 1, outcomes
        assert all(
            isinstance(outcome, kr.LeaseContended)
            for outcome in outcomes
            if outcome is not tokens[0]
        ), outcomes
        [token] = tokens
        lease = await read_lease(kube, kube_namespace)
        assert lease is not None and lease["spec"]["holderIdentity"] == token.holder_id
        assert lease["spec"]["leaseTransitions"] == token.epoch
        epochs.append(token.epoch)
        await electors[outcomes.index(token)].release_lease(token)
    assert epochs == list(range(1, 9))


async def test_release_hands_over_at_once_and_keeps_the_transitions(
    kube: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    a, b = elector(ttl=60), elector(ttl=60)
    token_a = await a.acquire_lease(RID)
    with pytest.raises(kr.LeaseContended, match=a.holder_id):
        await b.acquire_lease(RID)
    await a.release_lease(token_a)
    released = await read_lease(kube, kube_namespace)
    assert released is not None
    assert released["spec"]["holderIdentity"] == ""
    assert released["spec"]["leaseDurationSeconds"] == 1
    assert released["spec"]["leaseTransitions"] == token_a.epoch
    # The TTL is 60 s: only the release explains that b gets it on its first try.
    token_b = await b.acquire_lease(RID)
    assert token_b.epoch == token_a.epoch + 1
    await a.release_lease(token_a)  # idempotent, and it does not disturb the new holder
    lease = await read_lease(kube, kube_namespace)
    assert lease is not None and lease["spec"]["holderIdentity"] == b.holder_id
    with pytest.raises(kr.LeaseLost):
        await a.renew_lease(token_a)


async def test_a_renewed_lease_is_kept_and_a_lapsed_one_is_taken_over(
    kube: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    a, b = elector(ttl=1), elector(ttl=1)
    token_a = await a.acquire_lease(RID)
    until = time.monotonic() + 1.6  # longer than the lease, renewing every 0.2 s
    while time.monotonic() < until:
        with pytest.raises(kr.LeaseContended):
            await b.acquire_lease(RID)
        await a.renew_lease(token_a)
        await asyncio.sleep(0.2)
    # a stops renewing: b takes over once it has seen the record unchanged for 1 s.
    token_b, _ = await acquire_eventually(b)
    assert token_b.epoch == token_a.epoch + 1
    with pytest.raises(kr.LeaseLost, match=b.holder_id):
        await a.renew_lease(token_a)  # a 409 on its stale version, then the new holder
    await a.release_lease(token_a)
    await b.renew_lease(token_b)
    lease = await read_lease(kube, kube_namespace)
    assert lease is not None
    assert (lease["spec"]["holderIdentity"], lease["spec"]["leaseTransitions"]) == (
        b.holder_id,
        token_b.epoch,
    )


@pytest.mark.parametrize("renewed", ["2000-01-01T00:00:00.000000Z", "2999-01-01T00:00:00.000000Z"])
async def test_expiry_is_judged_by_local_observation_not_by_the_holders_timestamps(
    kube: Any, kube_namespace: str, elector: ElectorFactory, renewed: str
) -> None:
    # A holder whose clock is far behind (or ahead) wrote this lease.
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": RID},
        "spec": {
            "holderIdentity": "elsewhere",
            "leaseDurationSeconds": 1,
            "renewTime": renewed,
            "leaseTransitions": 7,
        },
    }
    async with kube.http_session() as http, http.post(leases_path(kube_namespace), json=body) as r:
        assert r.status == 201, await r.text()
    newcomer = elector(ttl=1)
    token, first_attempt = await acquire_eventually(newcomer)
    # Neither "long expired" nor "valid for centuries": one duration after first seeing it.
    assert time.monotonic() - first_attempt >= 1.0
    assert token.epoch == 8


async def test_a_conflicting_update_is_contention_not_a_crash(
    embedded_cluster: EmbeddedCluster,
) -> None:
    async with embedded_cluster.api_client() as api:
        a, b, c = (KubernetesLeaseElector("default", ttl=60, api=api) for _ in range(3))
        await a.release_lease(await a.acquire_lease(RID))
        # b reads the free lease, then its takeover is held up until c has taken it.
        fault = embedded_cluster.inject_fault("PUT", f"{leases_path('default')}/{RID}", delay=0.5)
        takeover_b = asyncio.create_task(b.acquire_lease(RID))
        await eventually(lambda: fault.fired == 1)
        token_c = await c.acquire_lease(RID)
        with pytest.raises(kr.LeaseContended, match="another process won the race"):
            await takeover_b
        assert token_c.epoch == 2
        with pytest.raises(kr.LeaseContended, match=c.holder_id):
            await b.acquire_lease(RID)
        await c.renew_lease(token_c)


async def test_an_unrelated_edit_does_not_cost_the_lease(
    kube: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    a = elector()
    token = await a.acquire_lease(RID)
    patch = {"metadata": {"labels": {"team": "devices"}}}
    headers = {"Content-Type": "application/merge-patch+json"}
    async with (
        kube.http_session() as http,
        http.patch(f"{leases_path(kube_namespace)}/{RID}", json=patch, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
    await a.renew_lease(token)  # 409 on the version it knew; still ours: renewed anyway
    lease = await read_lease(kube, kube_namespace)
    assert lease is not None
    assert lease["metadata"]["labels"]["team"] == "devices"
    assert lease["spec"]["leaseTransitions"] == token.epoch


async def test_the_epoch_never_goes_back_when_the_lease_is_deleted_and_recreated(
    kube: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    a, b = elector(), elector()
    await a.release_lease(await a.acquire_lease(RID))
    token_b = await b.acquire_lease(RID)
    assert token_b.epoch == 2
    await b.release_lease(token_b)

    # Recreated by a process that saw epoch 2: it continues above it.
    await delete_lease(kube, kube_namespace)
    token_b = await b.acquire_lease(RID)
    assert token_b.epoch == 3
    await b.release_lease(token_b)

    # Recreated by a newcomer: the fenced store's highest epoch is the floor.
    await delete_lease(kube, kube_namespace)
    fenced = MemoryFencedRepository()
    assert await fenced.apply_fenced("device-1", 7, {"on": True})
    newcomer = elector()
    newcomer.use_epoch_floor(RID, fenced.highest_epoch)
    token = await newcomer.acquire_lease(RID)
    assert token.epoch == 8
    lease = await read_lease(kube, kube_namespace)
    assert lease is not None and lease["spec"]["leaseTransitions"] == 8
    await newcomer.release_lease(token)

    # The documented residual risk: nobody remembers, no floor, and it starts again at 1.
    await delete_lease(kube, kube_namespace)
    assert (await elector().acquire_lease(RID)).epoch == 1


async def test_renewing_a_deleted_lease_loses_it(
    kube: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    # The PUT names the deleted Lease's uid: a precondition, so it is not recreated.
    a = elector()
    token = await a.acquire_lease(RID)
    await delete_lease(kube, kube_namespace)
    with pytest.raises(kr.LeaseLost, match="deleted"):
        await a.renew_lease(token)
    assert await read_lease(kube, kube_namespace) is None


# -- client configuration ---------------------------------------------------------------


@pytest.mark.parametrize("given_as", ["argument", "KUBECONFIG"])
async def test_a_kubeconfig_gives_the_cluster_and_the_namespace(
    kube: Any,
    kube_namespace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    given_as: str,
) -> None:
    config = yaml.safe_load(await asyncio.to_thread(Path(kube.kubeconfig).read_text))
    for context in config["contexts"]:
        context["context"]["namespace"] = kube_namespace
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    if given_as == "KUBECONFIG":
        monkeypatch.setenv("KUBECONFIG", str(path))
        own = KubernetesLeaseElector(ttl=15)
    else:
        own = KubernetesLeaseElector(ttl=15, kubeconfig=path)
    async with own:
        token = await own.acquire_lease(RID)
        assert own.namespace == kube_namespace
        lease = await read_lease(kube, kube_namespace)
        assert lease is not None and lease["spec"]["holderIdentity"] == own.holder_id
        await own.release_lease(token)
    with pytest.raises(RuntimeError, match="closed"):
        await own.acquire_lease(RID)


async def test_a_borrowed_client_stays_open(api: Any, kube_namespace: str) -> None:
    async with KubernetesLeaseElector(kube_namespace, api=api) as borrowing:
        await borrowing.acquire_lease(RID)
    # The elector is closed; the client it borrowed still works.
    assert await KubernetesLeaseElector(kube_namespace, api=api).acquire_lease("widgets")


# -- with Loops ------------------------------------------------------------------------------


def leader_loop(
    elector: KubernetesLeaseElector, reconcile: Any, rid: str = RID, **options: Any
) -> Loop:
    builder = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(elector)
        .with_reconciler_id(rid)
        .with_renew_interval(0.2)
    )
    if "fenced" in options:
        builder = builder.with_fenced_repo(options["fenced"])
    return builder.build()


async def quiet(req: kr.Request) -> None:
    return None


async def test_loops_hand_over_on_stop_and_one_leads_at_a_time(
    elector: ElectorFactory,
) -> None:
    loops = [leader_loop(elector(ttl=60), quiet) for _ in range(3)]
    for loop in loops:
        await loop.start()
    try:
        epochs = []
        for _ in range(3):
            await eventually(lambda: any(loop.stats().is_leader for loop in loops))
            for _ in range(10):  # several renew periods: still exactly one
                assert sum(loop.stats().is_leader for loop in loops) == 1
                await asyncio.sleep(0.05)
            leader = next(loop for loop in loops if loop.stats().is_leader)
            epochs.append(leader.stats().epoch)
            loops.remove(leader)
            await leader.stop()  # releases: the TTL is 60 s, so only that explains a takeover
        assert epochs == [1, 2, 3]
    finally:
        for loop in loops:
            await loop.stop()


async def test_a_loop_seeds_a_new_lease_from_its_fenced_store(elector: ElectorFactory) -> None:
    fenced = MemoryFencedRepository()
    assert await fenced.apply_fenced("device-1", 41, {"on": True})
    async with leader_loop(elector(), quiet, fenced=fenced) as loop:
        await eventually(lambda: loop.stats().is_leader)
        assert loop.stats().epoch == 42


async def test_kubectl_shows_the_holder_of_each_running_reconcilers_lease(
    kube: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    electors = {rid: elector() for rid in ("devices", "widgets")}
    loops = [leader_loop(each, quiet, rid) for rid, each in electors.items()]
    for loop in loops:
        await loop.start()
    try:
        await eventually(lambda: all(loop.stats().is_leader for loop in loops))
        process = await asyncio.create_subprocess_exec(
            str(KUBECTL),
            "--kubeconfig",
            kube.kubeconfig,
            "get",
            "leases",
            "-A",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await process.communicate()
        assert process.returncode == 0, err.decode()
    finally:
        for loop in loops:
            await loop.stop()
    rows = [line.split() for line in out.decode().splitlines()]
    assert rows[0][:3] == ["NAMESPACE", "NAME", "HOLDER"], out.decode()
    shown = {(row[0], row[1]): row[2] for row in rows[1:]}
    for rid, each in electors.items():
        assert shown[(kube_namespace, rid)] == each.holder_id


@pytest.mark.parametrize("failure", ["error 500", "timeout"])
async def test_failing_renewals_step_down_before_the_ttl_lets_another_acquire(
    embedded_cluster: EmbeddedCluster, failure: str
) -> None:
    ttl = 2.0
    cancelled_at: list[float] = []
    running = asyncio.Event()

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id != "slow" or running.is_set():
            return  # only the first run of "slow" is in flight for long
        running.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled_at.append(time.monotonic())
            raise

    first_seen: dict[str, float] = {}  # resourceVersion -> when a fast observer first saw it

    async def observe(http: Any) -> None:
        while True:
            async with http.get(f"{leases_path('default')}/{RID}") as response:
                if response.status == 200:
                    version = (await response.json())["metadata"]["resourceVersion"]
                    first_seen.setdefault(version, time.monotonic())
            await asyncio.sleep(0.02)

    async with embedded_cluster.api_client() as api, embedded_cluster.http_session() as http:
        elector = KubernetesLeaseElector("default", ttl=ttl, api=api)
        async with leader_loop(elector, reconcile) as loop:
            await eventually(lambda: loop.stats().is_leader)
            epoch = loop.stats().epoch
            await loop.enqueue(kr.Request("slow"))
            await running.wait()
            observer = asyncio.create_task(observe(http))
            await asyncio.sleep(0.5)  # a few renewals
            embedded_cluster.inject_fault(
                "PUT",
                f"{leases_path('default')}/{RID}",
                status=500 if failure == "error 500" else None,
                delay=None if failure == "error 500" else 3 * ttl,
                times=None,
            )
            await eventually(lambda: bool(cancelled_at), timeout=3 * ttl)
            observer.cancel()
            assert not loop.stats().is_leader
            # The last record anyone could see before the step-down: others may take the
            # lease over one TTL after first seeing it; the leader had stepped down before.
            last_change = max(seen for seen in first_seen.values() if seen < cancelled_at[0])
            assert cancelled_at[0] < last_change + ttl, (cancelled_at[0] - last_change, ttl)
            # The API heals: it leads again, with an epoch that did not go back.
            embedded_cluster.clear_faults()
            await eventually(lambda: loop.stats().is_leader, timeout=4 * ttl)
            assert loop.stats().epoch >= epoch


async def test_takeover_of_a_lease_recreated_elsewhere_never_goes_below_the_floor(
    api: Any, kube_namespace: str, elector: ElectorFactory
) -> None:
    fenced = MemoryFencedRepository()
    assert await fenced.apply_fenced("device-1", 7, {"on": True})  # an old leader's epoch
    # The Lease was deleted and re-applied from a manifest: no holder, no transitions.
    manifest = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": RID, "namespace": kube_namespace},
        "spec": {"leaseDurationSeconds": 15},
    }
    await client.CoordinationV1Api(api).create_namespaced_lease(kube_namespace, manifest)
    newcomer = elector()
    newcomer.use_epoch_floor(RID, fenced.highest_epoch)  # what a Loop registers
    token = await newcomer.acquire_lease(RID)
    assert token.epoch == 8


async def test_a_recreated_lease_never_reuses_an_epoch_held_before_any_write(
    kube: Any, kube_namespace: str, elector: ElectorFactory, embedded_postgres_dsn: str
) -> None:
    from kopf_reconcile.fencing.postgres import PostgresFencedRepository

    async def idle(req: kr.Request) -> None:
        return None

    async with (
        PostgresFencedRepository(embedded_postgres_dsn) as repo_a,
        PostgresFencedRepository(embedded_postgres_dsn) as repo_b,
    ):
        a = fenced_loop(idle, elector(ttl=5), repo_a, RID)
        async with a:
            await eventually(lambda: a.stats().is_leader)
            held = a.stats().epoch  # A leads but has written nothing at this epoch yet
            await delete_lease(kube, kube_namespace)  # the Lease object disappears
            b = fenced_loop(idle, elector(ttl=5), repo_b, RID)
            async with b:
                await eventually(lambda: b.stats().is_leader)
                assert b.stats().epoch > held  # never the epoch A still holds
                await eventually(lambda: not a.stats().is_leader)  # and A learns it lost


async def test_the_elector_lists_the_leases_of_its_namespace(
    kube_namespace: str, elector: ElectorFactory
) -> None:
    a = elector(ttl=15)
    token = await a.acquire_lease(RID)
    (record,) = await a.list_leases()
    assert (record.namespace, record.reconciler_id, record.holder_id, record.epoch) == (
        kube_namespace,
        RID,
        a.holder_id,
        token.epoch,
    )
    assert record.renewed_at is not None and record.expires_at is not None
    assert record.expires_at - record.renewed_at == datetime.timedelta(seconds=15)
    everywhere = await a.list_leases(all_namespaces=True)
    assert record in everywhere
