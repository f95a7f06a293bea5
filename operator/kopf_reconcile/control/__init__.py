"""The leadership control plane: holding a lease over a LeaderElector, and epoch floors.

It sits between the kernel's Loop and the electors: it speaks only the protocols of
:mod:`kopf_reconcile.leader.protocol` and :mod:`kopf_reconcile.fencing.protocol`, never an
adapter (Kubernetes, PostgreSQL) or kopf.
"""
