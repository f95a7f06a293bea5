"""Real components for tests: an embedded Kubernetes API and an embedded PostgreSQL.

Both run for real on 127.0.0.1 (or a Unix socket) and are spoken to exactly as
production talks to a cluster and a database: over HTTP and the PostgreSQL
wire protocol. Import cost is kept low: the heavy modules load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
    from kopf_reconcile.testing.fence import install_fence
    from kopf_reconcile.testing.operator_process import OperatorProcess, eventually
    from kopf_reconcile.testing.postgres import EmbeddedPostgres

__all__ = ["EmbeddedCluster", "EmbeddedPostgres", "OperatorProcess", "eventually", "install_fence"]


def __getattr__(name: str) -> Any:
    if name == "EmbeddedCluster":
        from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster

        return EmbeddedCluster
    if name == "EmbeddedPostgres":
        from kopf_reconcile.testing.postgres import EmbeddedPostgres

        return EmbeddedPostgres
    if name == "install_fence":
        from kopf_reconcile.testing.fence import install_fence

        return install_fence
    if name in ("OperatorProcess", "eventually"):
        from kopf_reconcile.testing import operator_process

        return getattr(operator_process, name)
    raise AttributeError(name)
