"""An embedded Kubernetes API: a fast, bounded emulation of kube-apiserver on 127.0.0.1.

Use :class:`EmbeddedCluster` as an async context manager (or the ``embedded_cluster``
pytest fixture), or run it as a process: ``python -m kopf_reconcile.testing.emulated_apiserver``.
See ``README.md`` next to this package for what is emulated and what is not.
"""

from kopf_reconcile.testing.emulated_apiserver.embedded import EmbeddedCluster
from kopf_reconcile.testing.emulated_apiserver.faults import Fault

__all__ = ["EmbeddedCluster", "Fault"]
