"""Followers learn of a release at once, on both electors, instead of at their next retry.

A follower's retry period is the renew interval (2 s by default, jittered up
to 2.4 s); a graceful handover must not wait for it. The Kubernetes elector
watches the Lease from the version it last read (both API tiers, through the
``kube`` fixture); the PostgreSQL elector listens for the notification its
release sends (a real PostgreSQL). The Loop-level tests use a renew interval
of 30 s, so a follower that took over within a few seconds can only have been
woken by the release.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import asyncpg
import pytest
import pytest_asyncio
from kubernetes_asyncio.client.exceptions import ApiException

import kopf_reconcile as kr
from conftest import LeaseBackend
from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
from support import eventually

RID = "devices"
WAKE_DEADLINE = 10.0  # far above the expected time (a few milliseconds)
LONG_RENEW = 30.0  # a follower not woken would retry only after this (up to 36 s)
LONG_TTL = 60.0  # long enough for a 30 s renew interval (the renew deadline is 40 s)


def leases_path(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


async def pending_for_a_while(task: asyncio.Task[None], seconds: float = 0.3) -> bool:
    """Whether ``task`` is still running after ``seconds`` (it has not been woken)."""
    await asyncio.wait({task}, timeout=seconds)
    return not task.done()


async def finish(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# -- Kubernetes ---------------------------------------------------------------------------

ElectorFactory = Callable[..., KubernetesLeaseElector]


@pytest.fixture
def k8s_elector(api: Any, kube_namespace: str) -> ElectorFactory:
    def make(ttl: float = LONG_TTL) -> KubernetesLeaseElector:
        return KubernetesLeaseElector(namespace=kube_namespace, ttl=ttl, api=api)

    return make


async def edit_lease(kube: Any, namespace: str, change: str) -> None:
    """Delete the Lease, or hand it to another holder by a merge patch."""
    async with kube.http_session() as http:
        if change == "deleted":
            async with http.delete(f"{leases_path(namespace)}/{RID}") as r:
                assert r.status == 200, await r.text()
            return
        patch = {"spec": {"holderIdentity": "someone-else"}}
        headers = {"Content-Type": "application/merge-patch+json"}
        async with http.patch(f"{leases_path(namespace)}/{RID}", json=patch, headers=headers) as r:
            assert r.status == 200, await r.text()


@pytest.mark.parametrize("change", ["deleted", "handed over"])
async def test_a_follower_wakes_when_the_lease_is_deleted_or_changes_hands(
    kube: Any, kube_namespace: str, k8s_elector: ElectorFactory, change: str
) -> None:
    a, b = k8s_elector(), k8s_elector()
    await a.acquire_lease(RID)
    with pytest.raises(kr.LeaseContended):
        await b.acquire_lease(RID)
    waiting = asyncio.create_task(b.wait_for_release(RID))
    try:
        assert await pending_for_a_while(waiting)
        await edit_lease(kube, kube_namespace, change)
        await asyncio.wait_for(waiting, WAKE_DEADLINE)
    finally:
        await finish(waiting)


async def test_cancelling_the_wait_closes_the_watch(embedded_cluster: EmbeddedCluster) -> None:
    async with embedded_cluster.api_client() as api:
        a, b = (KubernetesLeaseElector("default", ttl=LONG_TTL, api=api) for _ in range(2))
        token = await a.acquire_lease(RID)
        with pytest.raises(kr.LeaseContended):
            await b.acquire_lease(RID)
        waiting = asyncio.create_task(b.wait_for_release(RID))
        await eventually(lambda: embedded_cluster.sizes()["watchers"] == 1)
        await finish(waiting)
        # The server notices a closed connection when it next writes to it.
        await a.renew_lease(token)
        await eventually(lambda: embedded_cluster.sizes()["watchers"] == 0)


async def test_a_watch_version_too_old_is_relisted_and_watched_again() -> None:
    async with EmbeddedCluster(history_size=3) as cluster, cluster.api_client() as api:
        a, b = (KubernetesLeaseElector("default", ttl=LONG_TTL, api=api) for _ in range(2))
        token = await a.acquire_lease(RID)
        with pytest.raises(kr.LeaseContended):
            await b.acquire_lease(RID)
        for name in ("gadgets", "widgets", "gizmos", "doodads"):  # push b's version out
            await a.acquire_lease(name)
        waiting = asyncio.create_task(b.wait_for_release(RID))
        try:
            assert await pending_for_a_while(waiting)  # 410, listed: still held, watching again
            await a.release_lease(token)
            await asyncio.wait_for(waiting, WAKE_DEADLINE)
        finally:
            await finish(waiting)


async def test_a_refused_watch_is_raised_once_then_followers_wait_out_their_retry(
    embedded_cluster: EmbeddedCluster,
) -> None:
    async with embedded_cluster.api_client() as api:
        a, b = (KubernetesLeaseElector("default", ttl=LONG_TTL, api=api) for _ in range(2))
        await a.acquire_lease(RID)
        with pytest.raises(kr.LeaseContended):
            await b.acquire_lease(RID)
        embedded_cluster.inject_fault("GET", leases_path("default"), status=403, times=None)
        with pytest.raises(ApiException) as refused:
            await b.wait_for_release(RID)
        assert refused.value.status == 403
        # Not a watch attempt (and an acquire attempt) every few milliseconds from now on.
        waiting = asyncio.create_task(b.wait_for_release(RID))
        try:
            assert await pending_for_a_while(waiting)
        finally:
            await finish(waiting)


async def test_one_cut_watch_is_watched_again_at_once(embedded_cluster: EmbeddedCluster) -> None:
    async with embedded_cluster.api_client() as api:
        a, b = (KubernetesLeaseElector("default", ttl=LONG_TTL, api=api) for _ in range(2))
        token = await a.acquire_lease(RID)
        with pytest.raises(kr.LeaseContended):
            await b.acquire_lease(RID)
        waiting = asyncio.create_task(b.wait_for_release(RID))
        assert await pending_for_a_while(waiting)
        assert embedded_cluster.cut_watches() >= 1  # a dropped connection, once
        await asyncio.wait_for(waiting, WAKE_DEADLINE)  # "may have changed": the caller tries
        waiting = asyncio.create_task(b.wait_for_release(RID))
        try:
            assert await pending_for_a_while(waiting)  # it watches again, not backing off...
            await a.release_lease(token)
            await asyncio.wait_for(waiting, WAKE_DEADLINE)  # ...so a release wakes it at once
        finally:
            await finish(waiting)


async def test_dropped_watches_between_healthy_ones_never_stop_the_watching(
    embedded_cluster: EmbeddedCluster,
) -> None:
    async with embedded_cluster.api_client() as api:
        a, b = (KubernetesLeaseElector("default", ttl=LONG_TTL, api=api) for _ in range(2))
        token = await a.acquire_lease(RID)
        for _ in range(3):  # a healthy watch (2.5 s), then one dropped connection
            with pytest.raises(kr.LeaseContended):
                await b.acquire_lease(RID)
            waiting = asyncio.create_task(b.wait_for_release(RID))
            assert await pending_for_a_while(waiting, 2.5)
            embedded_cluster.cut_watches()
            await asyncio.wait_for(waiting, WAKE_DEADLINE)
        with pytest.raises(kr.LeaseContended):
            await b.acquire_lease(RID)
        waiting = asyncio.create_task(b.wait_for_release(RID))
        try:
            assert await pending_for_a_while(waiting)
            await a.release_lease(token)
            await asyncio.wait_for(waiting, WAKE_DEADLINE)
        finally:
            await finish(waiting)


# -- PostgreSQL ------------------------------------------------------------------------------

PgFactory = Callable[..., PostgresLeaseElector]


@pytest_asyncio.fixture
async def pg_elector(dsn: str) -> AsyncIterator[PgFactory]:
    made: list[PostgresLeaseElector] = []

    def make(dsn_or_pool: Any = dsn, **options: Any) -> PostgresLeaseElector:
        made.append(PostgresLeaseElector(dsn_or_pool, ttl=LONG_TTL, **options))
        return made[-1]

    yield make
    await asyncio.gather(*(each.close() for each in made))


async def listening_backends(dsn: str) -> list[int]:
    """The server processes of this database that last ran a LISTEN."""
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            "SELECT pid FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'LISTEN %'"
        )
    finally:
        await connection.close()
    return [row["pid"] for row in rows]


async def test_a_lost_listening_connection_wakes_the_follower_and_is_opened_again(
    pg_elector: PgFactory, dsn: str
) -> None:
    a, b = pg_elector(), pg_elector()
    token = await a.acquire_lease(RID)
    with pytest.raises(kr.LeaseContended):
        await b.acquire_lease(RID)
    waiting = asyncio.create_task(b.wait_for_release(RID))
    try:
        assert await pending_for_a_while(waiting)
        [backend] = await listening_backends(dsn)
        admin = await asyncpg.connect(dsn)
        try:
            assert await admin.fetchval("SELECT pg_terminate_backend($1)", backend)
        finally:
            await admin.close()
        await asyncio.wait_for(waiting, WAKE_DEADLINE)  # a release may have gone unheard
    finally:
        await finish(waiting)
    with pytest.raises(kr.LeaseContended):  # listens again before reading
        await b.acquire_lease(RID)
    assert len(await listening_backends(dsn)) == 1
    waiting = asyncio.create_task(b.wait_for_release(RID))
    try:
        assert await pending_for_a_while(waiting)
        await a.release_lease(token)
        await asyncio.wait_for(waiting, WAKE_DEADLINE)
    finally:
        await finish(waiting)


async def test_the_listening_connection_is_not_taken_from_a_borrowed_pool(
    pg_elector: PgFactory, dsn: str
) -> None:
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool:
        a = pg_elector()
        b = pg_elector(pool, listen_dsn=dsn)
        token = await a.acquire_lease(RID)
        with pytest.raises(kr.LeaseContended):
            await b.acquire_lease(RID)
        waiting = asyncio.create_task(b.wait_for_release(RID))
        try:
            assert await pending_for_a_while(waiting)
            # The pool's only connection is free for the leases b leads meanwhile.
            other = await asyncio.wait_for(b.acquire_lease("gadgets"), WAKE_DEADLINE)
            await b.renew_lease(other)
            assert pool.get_size() == 1
            await a.release_lease(token)
            await asyncio.wait_for(waiting, WAKE_DEADLINE)
        finally:
            await finish(waiting)


async def test_a_borrowed_pool_without_a_listen_dsn_leaves_followers_to_their_retry(
    pg_elector: PgFactory, dsn: str
) -> None:
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool:
        a, b = pg_elector(), pg_elector(pool)
        token = await a.acquire_lease(RID)
        with pytest.raises(kr.LeaseContended):
            await b.acquire_lease(RID)
        assert await listening_backends(dsn) == []  # none borrowed, none opened
        waiting = asyncio.create_task(b.wait_for_release(RID))
        try:
            assert await pending_for_a_while(waiting)  # not at once: no spinning either
            await a.release_lease(token)
            assert await pending_for_a_while(waiting)  # unheard: the retry period covers it
        finally:
            await finish(waiting)


async def test_close_closes_the_listening_connection(pg_elector: PgFactory, dsn: str) -> None:
    a, b = pg_elector(), pg_elector()
    await a.acquire_lease(RID)
    with pytest.raises(kr.LeaseContended):
        await b.acquire_lease(RID)
    assert len(await listening_backends(dsn)) == 1
    await b.close()
    await eventually(lambda: _none_listening(dsn), timeout=WAKE_DEADLINE)


async def _none_listening(dsn: str) -> bool:
    return not await listening_backends(dsn)


# -- Loops -------------------------------------------------------------------------------------


def counting_contention(elector: Any) -> list[str]:
    """Count the elector's contended acquire attempts (a replica is following once it had one)."""
    contended: list[str] = []
    acquire = elector.acquire_lease

    async def counted(reconciler_id: str) -> kr.LeaseToken:
        try:
            return cast(kr.LeaseToken, await acquire(reconciler_id))
        except kr.LeaseContended:
            contended.append(reconciler_id)
            raise

    elector.acquire_lease = counted
    return contended


def slow_retry_loop(elector: kr.LeaderElector) -> kr.Loop:
    async def quiet(req: kr.Request) -> None:
        return None

    return (
        kr.Builder(quiet, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(elector)
        .with_reconciler_id(RID)
        .with_renew_interval(LONG_RENEW)
        .build()
    )


async def test_a_loop_follower_takes_a_released_lease_at_once(
    lease_backend: LeaseBackend,
) -> None:
    """The leader's Loop stops; the follower's Loop must lead well before its next retry."""
    leader = slow_retry_loop(lease_backend.make(ttl=LONG_TTL))
    follower_elector = lease_backend.make(ttl=LONG_TTL)
    contended = counting_contention(follower_elector)
    follower = slow_retry_loop(follower_elector)
    await leader.start()
    try:
        await eventually(lambda: leader.stats().is_leader)
        await follower.start()
        await eventually(lambda: bool(contended))  # it follows now
        await leader.stop()
        await eventually(
            lambda: follower.stats().is_leader,
            timeout=WAKE_DEADLINE,
            message=f"the follower did not take over within {WAKE_DEADLINE}s of the release",
        )
    finally:
        await follower.stop()
        await leader.stop()


# -- both electors ---------------------------------------------------------------------------


async def test_a_follower_wakes_when_the_lease_is_released(lease_backend: LeaseBackend) -> None:
    a, b = lease_backend.make(ttl=LONG_TTL), lease_backend.make(ttl=LONG_TTL)
    token = await a.acquire_lease(RID)
    with pytest.raises(kr.LeaseContended):
        await b.acquire_lease(RID)
    waiting = asyncio.create_task(b.wait_for_release(RID))
    try:
        for _ in range(3):  # renewals by the holder do not wake the follower
            await a.renew_lease(token)
            assert await pending_for_a_while(waiting, 0.1)
        await a.release_lease(token)
        await asyncio.wait_for(waiting, WAKE_DEADLINE)
    finally:
        await finish(waiting)
    assert (await b.acquire_lease(RID)).epoch == token.epoch + 1


async def test_a_release_between_the_contended_read_and_the_wait_is_not_missed(
    lease_backend: LeaseBackend,
) -> None:
    a, b = lease_backend.make(ttl=LONG_TTL), lease_backend.make(ttl=LONG_TTL)
    token = await a.acquire_lease(RID)
    with pytest.raises(kr.LeaseContended):
        await b.acquire_lease(RID)
    await a.release_lease(token)
    await asyncio.sleep(0.2)  # the news arrives before the wait starts
    await asyncio.wait_for(b.wait_for_release(RID), WAKE_DEADLINE)


async def test_a_release_heard_during_the_first_contended_read_is_counted(
    pg_elector: PgFactory,
) -> None:
    holder, follower = pg_elector(), pg_elector()
    token = await holder.acquire_lease(RID)
    read = follower._read_heard
    reads = 0

    async def read_then_release(pool: Any, reconciler_id: str) -> Any:
        nonlocal reads
        reads += 1
        heard = await read(pool, reconciler_id)  # it saw the lease held...
        if reads == 2:  # ...on the re-read that listens; the release is heard before it resumes
            await holder.release_lease(token)
            await asyncio.sleep(0.3)
        return heard

    follower._read_heard = read_then_release  # type: ignore[method-assign]
    with pytest.raises(kr.LeaseContended):
        await follower.acquire_lease(RID)
    await asyncio.wait_for(follower.wait_for_release(RID), WAKE_DEADLINE)
