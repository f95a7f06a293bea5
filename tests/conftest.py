"""Shared fixtures.

``kube`` is a Kubernetes API backend for tests that must hold on every tier;
each such test runs once per backend:

- ``embedded``: the embedded emulation, fresh for each test;
- ``real``: kube-apiserver v1.37.2 (or the release ``make test K8S=...`` selects) with etcd
  (``RealCluster``), one per test
  session, so tests isolate themselves by namespace (``kube_namespace``).

Each backend offers ``.url``, ``.kubeconfig``, ``.api_client()`` and
``.http_session()``. Select one with ``-k embedded`` or ``-k real``. The real
tier is required under ``CI=true``; elsewhere ``KOPF_RECONCILE_SKIP_REAL_APISERVER=1``
skips it (see docs/testing.md).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
from kopf_reconcile.testing.emulated_apiserver.discovery import EMULATED_VERSION
from kopf_reconcile.testing.kube_release import has_feature, kube_version, minor_of
from kopf_reconcile.testing.real_apiserver import RealCluster
from support import start_tier

SKIP_REAL_VARIABLE = "KOPF_RECONCILE_SKIP_REAL_APISERVER"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def real_cluster() -> AsyncIterator[RealCluster]:
    """The real kube-apiserver tier, started once per test session."""
    # Its audit log (kube_audit_log) costs a line per write.
    tier = RealCluster(audit_log=True)
    cluster = await start_tier(tier, "real kube-apiserver tier", SKIP_REAL_VARIABLE)
    try:
        yield cluster
    finally:
        await cluster.stop()


@pytest.fixture(params=["embedded", pytest.param("real", marks=pytest.mark.real_apiserver)])
def kube(request: pytest.FixtureRequest) -> Any:
    """A Kubernetes API: the embedded cluster, then the real API server.

    On the real tier of a release other than the newest (``make test K8S=1.35``), a test
    marked ``feature(gate)`` is skipped where that release lacks the gate, and one marked
    ``v1_37_wording`` (it compares messages word for word with v1.37's, as the embedded API
    words them) is skipped.
    """
    if request.param == "real":
        skip_on_this_release(request.node)
    fixture = "embedded_cluster" if request.param == "embedded" else "real_cluster"
    return request.getfixturevalue(fixture)


def skip_on_this_release(test: pytest.Item) -> None:
    version = kube_version()
    for marker in test.iter_markers("feature"):
        (gate,) = marker.args
        if not has_feature(gate, version):
            pytest.skip(f"the real tier runs Kubernetes {version}, which has no {gate} gate")
    if test.get_closest_marker("v1_37_wording") and minor_of(version) != minor_of(EMULATED_VERSION):
        pytest.skip(f"worded as {EMULATED_VERSION}; the real tier runs Kubernetes {version}")


@pytest.fixture
def kube_audit_log(kube: Any, tmp_path: Path) -> Path:
    """The path of ``kube``'s audit log (JSON lines of audit.k8s.io/v1 Events, one per write,
    in order of completion): the shared real tier's, or one the embedded cluster starts
    for this test."""
    if isinstance(kube, EmbeddedCluster) and kube.audit_log is None:
        kube.enable_audit_log(tmp_path / "audit.log")
    path: Path | None = kube.audit_log
    assert path is not None
    return path


@pytest_asyncio.fixture
async def kube_namespace(kube: Any) -> str:
    """A namespace of ``kube`` that no other test uses."""
    name = f"test-{secrets.token_hex(4)}"
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    async with kube.http_session() as http, http.post("/api/v1/namespaces", json=body) as response:
        assert response.status == 201, await response.text()
    return name
