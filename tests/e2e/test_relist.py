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

import pytest
import pytest_asyncio
from operator_e2e import OPERATORS, Operators

from kopf_reconcile.testing import EmbeddedCluster

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
                for n in range(1, HISTORY + 5):  # the deletion leaves the history
                    patch = {"data": {"n": str(n)}}
                    async with http.patch(
                        f"{CONFIGMAPS}/churn", json=patch, headers=MERGE
                    ) as response:
                        assert response.status == 200, await response.text()
            finally:
                operator.process.send_signal(signal.SIGCONT)

            await operator.printed("reconcile default/doomed gone", timeout=30)
            assert not operator.lines("default/survivor gone"), operator.text
    finally:
        await operators.stop_all()
