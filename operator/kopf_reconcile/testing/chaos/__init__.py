"""Process chaos: the example operator's replicas as real processes under a seeded nemesis.

The deterministic simulation (:mod:`kopf_reconcile.testing.simulation`) runs the
real Loop on virtual time against model stores. This package runs the real
thing instead: ``kopf-reconcile run operator/examples/devices.py`` as several
OS processes, a real API server process (the embedded one, or kube-apiserver
with etcd), a real PostgreSQL, and breaks them the way production breaks —
SIGKILL, SIGSTOP, graceful restarts, API errors and slow answers, cut watches,
a paused or restarted API server, a stopped database, killed database
connections, and a replica partitioned from the API while it still reaches the
database. Afterwards it checks, from the database's own audit and the
replicas' own monotonic-stamped leadership reports, that no stale write was
accepted, that no two replicas led at once beyond what a pause explains, and
that every Device converged (no lost update). With ``shards`` > 1 the example
runs sharded, replicas also join and leave (moving shards by hand-off, which the
nemesis strikes), and every invariant is checked per shard.

* :mod:`.harness` — the run (:func:`run`, :class:`Chaos`);
* :mod:`.nemesis` — the faults, drawn from the seed, the workload and the supervisor;
* :mod:`.checks` — quiescing, then every invariant, per scope;
* :mod:`.report` — the options of a run (:class:`Options`) and its report (:class:`Report`);
* :mod:`.stage` — the replica positions, and the state and plumbing the three share;
* :mod:`.leadership` — leadership intervals and their overlaps;
* :mod:`.reconciles` — reconciles of one entity by two replicas at once;
* :mod:`.proxy` — the per-replica TCP proxy that partitions one replica;
* :mod:`.replica` — ``kopf-reconcile run`` plus the leadership report
  (:meth:`~kopf_reconcile.control.holding.LeaseHolder.observe`).

``python -m kopf_reconcile.testing.chaos --seed 1 --duration 60 --replicas 3``
(``make chaos``) runs it for both electors and prints a summary table. The
replicas import only :mod:`.replica`: the harness loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kopf_reconcile.testing.chaos.harness import (
        ELECTORS,
        TIERS,
        Chaos,
        ChaosError,
        Options,
        Report,
        run,
    )

__all__ = ["ELECTORS", "TIERS", "Chaos", "ChaosError", "Options", "Report", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kopf_reconcile.testing.chaos import harness

        return getattr(harness, name)
    raise AttributeError(name)
