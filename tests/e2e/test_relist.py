"""A deletion while kopf's watch has to list again (410 Gone) still reaches the reconciler.

A real ``kopf-reconcile run`` process on an embedded cluster whose change history is
short. The operator is paused (SIGSTOP) while its watch is cut, an object is deleted and
more changes than the history holds are made; once resumed, the watch cannot resume from
its resourceVersion (410 Expired inside the stream, as kube-apiserver answers) and kopf
lists again. The listing no longer holds the deleted object: it must be reported gone.

Only the embedded tier can cut a watch on demand while the client is paused; the sweep
itself is also pinned by ``tests/unit/test_relisting.py``.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from operator_e2e import OPERATORS, Operators

from kopf_reconcile.testing import EmbeddedCluster
from support import eventually

pytestmark = pytest.mark.slow

HISTORY = 20  # changes a watch can resume from
CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest_asyncio.fixture
async def short_memory_cluster() -> AsyncIterator[EmbeddedCluster]:
    async with EmbeddedCluster(history_size=HISTORY) as cluster:
        yield cluster


async def test_an_object_deleted_while_the_watch_lists_again_is_reported_gone(
    short_memory_cluster: EmbeddedCluster,
) -> None:
    cluster = short_memory_cluster
    operators = Operators(cluster.kubeconfig, "default")
    try:
        operator = await operators.start(handlers=OPERATORS / "selected.py")
        async with cluster.http_session() as http:
            for name, team in (("doomed", "a"), ("survivor", "a"), ("churn", "b")):
                body = {"metadata": {"name": name, "labels": {"team": team}}, "data": {"n": "0"}}
                async with http.post(CONFIGMAPS, json=body) as response:
                    assert response.status == 201, await response.text()
            await operator.printed("reconcile default/doomed live", timeout=30)
            await operator.printed("reconcile default/survivor live", timeout=30)

            operator.process.send_signal(signal.SIGSTOP)
            try:
                assert cluster.cut_watches(r".*/configmaps") >= 1
                async with http.delete(f"{CONFIGMAPS}/doomed") as response:
                    assert response.status == 200, await response.text()
                await outrun_history(http, f"{CONFIGMAPS}/churn")  # the deletion leaves it
            finally:
                operator.process.send_signal(signal.SIGCONT)

            await operator.printed("reconcile default/doomed gone", timeout=30)
            assert not operator.lines("default/survivor gone"), operator.text
    finally:
        await operators.stop_all()


async def test_a_child_or_watched_object_deleted_while_the_watch_lists_again_reconciles_its_owner(
    short_memory_cluster: EmbeddedCluster,
) -> None:
    cluster = short_memory_cluster
    operators = Operators(cluster.kubeconfig, "default")
    secrets = "/api/v1/namespaces/default/secrets"
    leases = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
    try:
        operator = await operators.start(handlers=OPERATORS / "owning.py")
        async with cluster.http_session() as http:
            owner_body = {"metadata": {"name": "site", "labels": {"role": "owner"}}}
            async with http.post(CONFIGMAPS, json=owner_body) as response:
                owner = await response.json()
                assert response.status == 201, owner
            reference = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": "site",
                "uid": owner["metadata"]["uid"],
                "controller": True,
            }
            child = {"metadata": {"name": "page", "ownerReferences": [reference]}}
            async with http.post(secrets, json=child) as response:
                assert response.status == 201, await response.text()
            pointer = {"metadata": {"name": "pointer", "annotations": {"owner": "site"}}}
            async with http.post(leases, json=pointer) as response:
                assert response.status == 201, await response.text()
            await operator.printed("reconcile default/site children=page", timeout=30)
            before = len(operator.output)

            operator.process.send_signal(signal.SIGSTOP)
            try:
                assert cluster.cut_watches(r".*/(secrets|leases)") >= 2
                for path in (f"{secrets}/page", f"{leases}/pointer"):
                    async with http.delete(path) as response:
                        assert response.status == 200, await response.text()
                churn = {"metadata": {"name": "churn"}, "data": {"n": "MA=="}}
                async with http.post(secrets, json=churn) as response:
                    assert response.status == 201, await response.text()
                await outrun_history(http, f"{secrets}/churn")  # the deletions leave it
            finally:
                operator.process.send_signal(signal.SIGCONT)

            # Both swept deletions reconcile the owner (deduplicated: once or twice).
            # The swept deletion of the child reconciles its owner, which no longer has it.
            await eventually(
                lambda: "reconcile default/site children=" in operator.output[before:],
                timeout=30,
                message="the owner reconciled without its child",
            )
            # ... and the watched Lease's swept deletion was mapped (a map_to of an identity
            # alone would have failed).
            assert not operator.lines("could not take a watch event"), operator.text
    finally:
        await operators.stop_all()


async def outrun_history(http: aiohttp.ClientSession, path: str) -> None:
    """Change the object at ``path`` more often than the cluster's history holds."""
    for n in range(1, HISTORY + 5):
        patch = {"metadata": {"labels": {"n": str(n)}}}
        async with http.patch(path, json=patch, headers=MERGE) as response:
            assert response.status == 200, await response.text()
