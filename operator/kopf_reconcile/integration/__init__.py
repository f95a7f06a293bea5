"""What runs a Loop inside a process: the kopf shim, the CLI, settings, probes and logs.

Only :mod:`~kopf_reconcile.integration.kopf_shim` and
:mod:`~kopf_reconcile.integration.cli` import kopf. The kernel, the control plane and
the adapters never import this package.
"""
