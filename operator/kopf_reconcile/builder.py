"""The one way to construct a Loop: ``Builder(reconciler, tenancy).with_...().build()``.

``build()`` refuses what makes a Loop meaningless (no reconciler, no trigger,
fencing without a leadership epoch), then has the configuration check itself
(:meth:`~kopf_reconcile.config.LoopConfig.validate`: tenancy, value ranges,
reconciler id, the lease timing of the elector and the renew interval, declared
capabilities). Every failure is a :class:`~kopf_reconcile.ConfigError` naming
the option and the value.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Self

from kopf_reconcile.api import ConfigError, Duration, ReconcilerLike, as_reconcile_fn, seconds
from kopf_reconcile.config import LoopConfig, validate_name
from kopf_reconcile.events import EventSink
from kopf_reconcile.fencing.protocol import FencedRepository
from kopf_reconcile.leader.protocol import LeaderElector
from kopf_reconcile.loop import Loop
from kopf_reconcile.metrics import Metrics
from kopf_reconcile.sharded_loop import ShardedLoop
from kopf_reconcile.sharding import ShardAssignment, validate_shards
from kopf_reconcile.tenancy import Tenancy
from kopf_reconcile.triggers import Trigger


class Builder:
    """Fluent configuration of a :class:`~kopf_reconcile.loop.Loop`."""

    def __init__(self, reconciler: ReconcilerLike, tenancy: Tenancy) -> None:
        self._config = LoopConfig(reconciler=reconciler, tenancy=tenancy, triggers=[])
        self._shards = ShardAssignment(1)

    def with_trigger(self, trigger: Trigger) -> Self:
        """Add a source of requests (may be called more than once)."""
        if not callable(getattr(trigger, "run", None)):
            raise ConfigError(f"trigger must have an async run(emit) method, got {trigger!r}")
        self._config.triggers.append(trigger)
        return self

    def with_concurrency(self, n: int) -> Self:
        """Worker count: reconciles of distinct entities running at once. Default 1."""
        self._config.concurrency = n
        return self

    def with_interval(self, interval: Duration) -> Self:
        """Requeue after a success without ``requeue_after`` (±10 % jitter). Default 10 h."""
        self._config.interval = seconds("interval", interval)
        return self

    def with_backoff(self, base: Duration, maximum: Duration) -> Self:
        """Per-entity retry delay: after the n-th failure in a row, drawn uniformly from
        ``[0, min(maximum, base·2ⁿ⁻¹)]`` (full jitter: ``base`` is no minimum). Default 5 ms,
        1000 s."""
        self._config.backoff_base = seconds("backoff base", base)
        self._config.backoff_max = seconds("backoff max", maximum)
        return self

    def with_leader(self, elector: LeaderElector) -> Self:
        """Dispatch only while holding this elector's lease. Default: none (single process)."""
        self._config.leader = elector
        return self

    def with_fenced_repo(self, repo: FencedRepository) -> Self:
        """Give every reconcile a FencedWriter bound to the lease epoch. Requires a leader."""
        self._config.fenced_repo = repo
        return self

    def with_metrics(self, metrics: Metrics) -> Self:
        """Record to these instruments (see ``register_metrics``). Default: none."""
        if not isinstance(metrics, Metrics):
            raise ConfigError(f"metrics must come from register_metrics(), got {metrics!r}")
        self._config.metrics = metrics
        return self

    def with_events(self, sink: EventSink) -> Self:
        """Record failures, dead letters and recoveries as events (see ``kopf_reconcile.events``).

        Default: none. The kopf shim gives its Loops a sink that posts Kubernetes Events.
        """
        self._config.events = sink
        return self

    def with_redrive_interval(self, interval: Duration) -> Self:
        """How often a leader with a dead-letter store looks for redrive requests. Default 2 s."""
        self._config.redrive_interval = seconds("redrive interval", interval)
        return self

    def with_name(self, name: str) -> Self:
        """Controller name in logs. Default: the reconciler's name."""
        self._config.name = validate_name(name)
        return self

    def with_reconciler_id(self, reconciler_id: str) -> Self:
        """Lease name, fencing scope and metrics' ``controller`` label (RFC 1123 subdomain).
        Default: derived from the name."""
        self._config.reconciler_id = reconciler_id
        return self

    def with_renew_interval(self, interval: Duration) -> Self:
        """How often the lease is renewed. Default 2 s; below 2/3 of the lease TTL (LeaseTiming)."""
        self._config.renew_interval = seconds("renew_interval", interval)
        return self

    def with_intake_capacity(self, n: int) -> Self:
        """Ready entities before a trigger's emit() blocks (backpressure). Default 100 000."""
        self._config.intake_capacity = n
        return self

    def with_stop_timeout(self, timeout: Duration) -> Self:
        """How long stop() lets in-flight reconciles finish. Default 30 s."""
        self._config.stop_timeout = seconds("stop timeout", timeout)
        return self

    def with_random(self, rng: random.Random) -> Self:
        """The source of jitter (backoff, requeue, lease retries); seed it to replay a run.

        Default: a fresh ``random.Random()``. Deterministic tests and simulations pass
        a seeded one.
        """
        if not isinstance(rng, random.Random):
            raise ConfigError(f"random must be a random.Random, got {rng!r}")
        self._config.rng = rng
        return self

    def with_shards(self, shards: int, *, by_namespace: bool = False) -> Self:
        """Split the entities into ``shards`` shards, each led under a lease of its own.

        Default 1 (not sharded). With N > 1, shard ``k`` has the lease and fencing scope
        ``<reconciler id>-shard-<k>``; an entity's shard is FNV-1a 64 of its id modulo N, or
        with ``by_namespace`` the one of N equal ranges of the hash space that the hash of
        what precedes its first ``/`` falls in (as the API server's shard selectors split
        it: :mod:`kopf_reconcile.sharding`). Requires a leader,
        and a fenced repository that can fence shards (``ShardableRepository``); see
        :mod:`kopf_reconcile.sharded_loop`. ``concurrency`` is per shard.
        """
        self._shards = ShardAssignment(validate_shards(shards), by_namespace)
        return self

    def without_default_requeue(self) -> Self:
        """Do not re-observe after a success unless the reconciler asks (``requeue_after``)."""
        self._config.default_requeue = False
        return self

    def build(self) -> Loop:
        """Check the configuration is meaningful and valid, and construct the Loop."""
        config = dataclasses.replace(self._config, triggers=list(self._config.triggers))
        as_reconcile_fn(config.reconciler)  # raises ConfigError when missing or not callable
        if config.leader is not None:
            _require_methods(
                "leader", config.leader, "acquire_lease", "renew_lease", "release_lease"
            )
        if config.fenced_repo is not None:
            _require_methods("fenced repo", config.fenced_repo, "apply_fenced")
        config.validate()
        if not config.triggers:
            raise ConfigError(
                "trigger: a loop needs at least one with_trigger(...); without one it never "
                "receives work"
            )
        if config.fenced_repo is not None and config.leader is None:
            raise ConfigError(
                "fenced repo: with_fenced_repo() requires with_leader(); without a "
                "leadership epoch every write would carry epoch 0 and nothing is fenced"
            )
        if self._shards.shards > 1:
            return ShardedLoop(
                config, shards=self._shards.shards, by_namespace=self._shards.by_namespace
            )
        return Loop(config)


def new(reconciler: ReconcilerLike, tenancy: Tenancy) -> Builder:
    """``Builder(reconciler, tenancy)``."""
    return Builder(reconciler, tenancy)


def _require_methods(option: str, value: object, *methods: str) -> None:
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        raise ConfigError(f"{option} {value!r} lacks method(s): {', '.join(missing)}")
