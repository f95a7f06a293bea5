"""Prometheus instruments of the reconcile loop.

Names carry the prefix ``kopf_reconcile_``; label names follow
controller-runtime and client-go (``controller``, ``result``, ``name``) so
their dashboards carry over. ``controller`` (``name`` on the work queue's series) is the
reconciler id: unique in an operator, where two reconcilers may share a function name.
:func:`register_metrics` creates every instrument on a registry; a Loop given the
resulting :class:`Metrics` pre-binds its label set at start and initialises every
series to 0. Set a field to ``None`` to disable that instrument.

The ``shard`` label. A sharded reconciler (``shards=N``) runs one Loop per shard,
each under a lease and an epoch of its own, so its state is per shard: every
counter and gauge carries ``shard`` (``"0"`` .. ``"N-1"``) next to ``controller``
(or ``name``), which stays the reconciler's id. An unsharded reconciler's series
carry ``shard=""``, which Prometheus stores as no label at all: its queries and
its series read as if the label did not exist. Histograms carry no ``shard``
(N times their buckets would buy little): the shards a replica leads observe into
one series per controller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "kopf_reconcile"

RESULTS = ("success", "error", "requeue_after", "permanent", "fenced", "canceled")
"""Outcomes of one reconcile, the values of ``reconcile_total{result}``."""

FENCED_OUTCOMES = ("accepted", "stale", "error")

API_WRITE_OUTCOMES = ("accepted", "refused_locally", "refused_by_server", "error")
"""Outcomes of a fenced Kubernetes API write, the values of ``api_writes_total{outcome}``:
refused before it was sent (the lease was not live), refused by the API server's fence
(a newer epoch holds the Lease), or any other failure."""

# controller-runtime's reconcile_time_seconds buckets: up to 60 s, because
# reconciles are slower than the 10 s top of prometheus-client's default.
RECONCILE_TIME_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7,
    0.8, 0.9, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5, 6, 7, 8, 9, 10, 15,
    20, 25, 30, 40, 50, 60,
)  # fmt: skip
# client-go workqueue latency buckets: 10^-8 .. 10^3 seconds, one per decade.
WORKQUEUE_BUCKETS = tuple(10.0**e for e in range(-8, 4))


@dataclasses.dataclass
class Metrics:
    """The instruments a Loop records to; ``None`` disables one."""

    reconcile_total: Counter | None = None
    reconcile_errors_total: Counter | None = None
    reconcile_time_seconds: Histogram | None = None
    active_workers: Gauge | None = None
    max_concurrent_reconciles: Gauge | None = None
    leader: Gauge | None = None
    epoch: Gauge | None = None
    lease_transitions_total: Counter | None = None
    lease_errors_total: Counter | None = None
    lease_permanent_errors_total: Counter | None = None
    lease_renew_seconds: Histogram | None = None
    workqueue_depth: Gauge | None = None
    follower_backlog: Gauge | None = None
    workqueue_adds_total: Counter | None = None
    workqueue_retries_total: Counter | None = None
    workqueue_queue_duration_seconds: Histogram | None = None
    workqueue_work_duration_seconds: Histogram | None = None
    dead_letter_entities: Gauge | None = None
    fenced_writes_total: Counter | None = None
    api_writes_total: Counter | None = None


def register_metrics(registry: CollectorRegistry | None = None) -> Metrics:
    """Create every instrument on ``registry`` (prometheus-client's default one if None)."""
    reg = REGISTRY if registry is None else registry
    ctl = ("controller",)  # histograms: one series per controller, whatever its shards
    ctl_shard = ("controller", "shard")
    queue_shard = ("name", "shard")

    def name(metric: str) -> str:
        return f"{PREFIX}_{metric}"

    return Metrics(
        reconcile_total=Counter(
            name("reconcile_total"),
            "Reconciles per controller and result.",
            [*ctl_shard, "result"],
            registry=reg,
        ),
        reconcile_errors_total=Counter(
            name("reconcile_errors_total"), "Reconciles that failed.", ctl_shard, registry=reg
        ),
        reconcile_time_seconds=Histogram(
            name("reconcile_time_seconds"),
            "Duration of one reconcile.",
            ctl,
            buckets=RECONCILE_TIME_BUCKETS,
            registry=reg,
        ),
        active_workers=Gauge(
            name("active_workers"), "Reconciles running now.", ctl_shard, registry=reg
        ),
        max_concurrent_reconciles=Gauge(
            name("max_concurrent_reconciles"), "Configured worker count.", ctl_shard, registry=reg
        ),
        leader=Gauge(
            name("leader"),
            "1 while this process holds the lease (its shard's, with a shard label).",
            ctl_shard,
            registry=reg,
        ),
        epoch=Gauge(name("epoch"), "Fencing epoch of the lease held.", ctl_shard, registry=reg),
        lease_transitions_total=Counter(
            name("lease_transitions_total"),
            "Leases acquired by this process.",
            ctl_shard,
            registry=reg,
        ),
        lease_errors_total=Counter(
            name("lease_errors_total"),
            "Failed lease acquisitions and renewals.",
            ctl_shard,
            registry=reg,
        ),
        lease_permanent_errors_total=Counter(
            name("lease_permanent_errors_total"),
            "Lease requests refused with a client error that retrying cannot fix "
            "(4xx but 408, 409, 429: forbidden, namespace not found, invalid); "
            "also counted in lease_errors_total.",
            ctl_shard,
            registry=reg,
        ),
        lease_renew_seconds=Histogram(
            name("lease_renew_seconds"), "Duration of lease renewals.", ctl, registry=reg
        ),
        workqueue_depth=Gauge(
            name("workqueue_depth"),
            "Entities ready to run while leading (0 on a follower: see follower_backlog).",
            queue_shard,
            registry=reg,
        ),
        follower_backlog=Gauge(
            name("follower_backlog"),
            "Entities a follower keeps for when it leads (every object it has seen); "
            "not a work queue, 0 while leading.",
            queue_shard,
            registry=reg,
        ),
        workqueue_adds_total=Counter(
            name("workqueue_adds_total"), "Triggers received.", queue_shard, registry=reg
        ),
        workqueue_retries_total=Counter(
            name("workqueue_retries_total"), "Retries after errors.", queue_shard, registry=reg
        ),
        workqueue_queue_duration_seconds=Histogram(
            name("workqueue_queue_duration_seconds"),
            "Time an entity waited ready before a worker took it.",
            ("name",),
            buckets=WORKQUEUE_BUCKETS,
            registry=reg,
        ),
        workqueue_work_duration_seconds=Histogram(
            name("workqueue_work_duration_seconds"),
            "Time a worker spent on an entity.",
            ("name",),
            buckets=WORKQUEUE_BUCKETS,
            registry=reg,
        ),
        dead_letter_entities=Gauge(
            name("dead_letter_entities"), "Entities dead-lettered now.", ctl_shard, registry=reg
        ),
        fenced_writes_total=Counter(
            name("fenced_writes_total"),
            "Fenced writes per outcome.",
            [*ctl_shard, "outcome"],
            registry=reg,
        ),
        api_writes_total=Counter(
            name("api_writes_total"),
            "Kubernetes API writes of reconcilers (kopf_reconcile.fenced_client()) per outcome.",
            [*ctl_shard, "outcome"],
            registry=reg,
        ),
    )


class _Null:
    """Stands in for a disabled instrument: every recording is a no-op."""

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


_NULL = _Null()


class BoundMetrics:
    """One controller's instruments with their labels bound (no label lookup per reconcile).

    Binding initialises every series to 0, so dashboards and alerts see the
    controller from its first scrape. Gauges that mirror loop state are read
    at scrape time from the callables given, costing nothing per reconcile.
    ``shard`` is the ``shard`` label of the counters and gauges: the shard's number
    for the Loop of one shard of a sharded reconciler, ``""`` otherwise.
    """

    def __init__(
        self,
        metrics: Metrics | None,
        controller: str,
        *,
        shard: str = "",
        depth: Callable[[], float] | None = None,
        backlog: Callable[[], float] | None = None,
        in_flight: Callable[[], float] | None = None,
        dead: Callable[[], float] | None = None,
    ) -> None:
        m = metrics or Metrics()

        def counter(c: Counter | None, *labels: str) -> Counter | _Null:
            if c is None:
                return _NULL
            child = c.labels(*labels)
            child.inc(0)
            return child

        def hist(h: Histogram | None, *labels: str) -> Histogram | _Null:
            return _NULL if h is None else h.labels(*labels)

        def gauge(g: Gauge | None, *labels: str) -> Gauge | _Null:
            if g is None:
                return _NULL
            child = g.labels(*labels)
            child.set(0)
            return child

        self.results = {r: counter(m.reconcile_total, controller, shard, r) for r in RESULTS}
        self.errors = counter(m.reconcile_errors_total, controller, shard)
        self.reconcile_time = hist(m.reconcile_time_seconds, controller)
        self.active_workers = gauge(m.active_workers, controller, shard)
        self.max_concurrent = gauge(m.max_concurrent_reconciles, controller, shard)
        self.leader = gauge(m.leader, controller, shard)
        self.epoch = gauge(m.epoch, controller, shard)
        self.lease_transitions = counter(m.lease_transitions_total, controller, shard)
        self.lease_errors = counter(m.lease_errors_total, controller, shard)
        self.lease_permanent_errors = counter(m.lease_permanent_errors_total, controller, shard)
        self.lease_renew = hist(m.lease_renew_seconds, controller)
        self.depth = gauge(m.workqueue_depth, controller, shard)
        self.backlog = gauge(m.follower_backlog, controller, shard)
        self.adds = counter(m.workqueue_adds_total, controller, shard)
        self.retries = counter(m.workqueue_retries_total, controller, shard)
        self.queue_duration = hist(m.workqueue_queue_duration_seconds, controller)
        self.work_duration = hist(m.workqueue_work_duration_seconds, controller)
        self.dead_letters = gauge(m.dead_letter_entities, controller, shard)
        self.fenced_writes = {
            o: counter(m.fenced_writes_total, controller, shard, o) for o in FENCED_OUTCOMES
        }
        self.api_writes = {
            o: counter(m.api_writes_total, controller, shard, o) for o in API_WRITE_OUTCOMES
        }
        for instrument, fn in (
            (self.depth, depth),
            (self.backlog, backlog),
            (self.active_workers, in_flight),
            (self.dead_letters, dead),
        ):
            if fn is not None and isinstance(instrument, Gauge):
                instrument.set_function(fn)
