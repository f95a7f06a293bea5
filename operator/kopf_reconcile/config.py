"""The configuration of a Loop: its options, their defaults, and the rules they obey.

A :class:`~kopf_reconcile.Builder` (and the kopf shim, at decoration time) collects
a :class:`LoopConfig`; :meth:`LoopConfig.validate` checks it once, before a Loop
exists, and every failure is a :class:`~kopf_reconcile.ConfigError` naming the
option and the bad value. Durations are float seconds (a ``timedelta`` is accepted
by the Builder and converted by :func:`~kopf_reconcile.api.seconds`).

The defaults are controller-runtime's and client-go's unless said otherwise. Lease
timing (TTL, renew deadline, renew interval) is one value of its own,
:class:`~kopf_reconcile.leader.timing.LeaseTiming`, built here from the elector's
declared TTL and the renew interval.
"""

from __future__ import annotations

import dataclasses
import random
import re

from kopf_reconcile.api import ConfigError, as_reconcile_fn
from kopf_reconcile.events import EventSink
from kopf_reconcile.fencing.protocol import EpochRecordingRepository, FencedRepository
from kopf_reconcile.leader.protocol import ElectorWithTTL, LeaderElector, LeaseTTL
from kopf_reconcile.leader.timing import DEFAULT_RETRY_PERIOD, LeaseTiming
from kopf_reconcile.metrics import Metrics
from kopf_reconcile.tenancy import Tenancy
from kopf_reconcile.triggers import Trigger

__all__ = [
    "DEFAULT_BACKOFF_BASE",
    "DEFAULT_BACKOFF_MAX",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_INTAKE_CAPACITY",
    "DEFAULT_INTERVAL",
    "DEFAULT_REDRIVE_INTERVAL",
    "DEFAULT_STOP_TIMEOUT",
    "LoopConfig",
    "default_reconciler_id",
    "validate_reconciler_id",
]

DEFAULT_CONCURRENCY = 1  # controller-runtime MaxConcurrentReconciles
DEFAULT_INTERVAL = 10 * 3600.0  # controller-runtime SyncPeriod: 10 h
DEFAULT_BACKOFF_BASE = 0.005  # client-go DefaultControllerRateLimiter: 5 ms
DEFAULT_BACKOFF_MAX = 1000.0  # ... capped at 1000 s
DEFAULT_STOP_TIMEOUT = 30.0  # controller-runtime GracefulShutdownTimeout
DEFAULT_INTAKE_CAPACITY = 100_000  # ready entities before emit() blocks
DEFAULT_REDRIVE_INTERVAL = 2.0  # how often a leader looks for redrive requests in its store

#: The lease and scope names a sharded reconciler derives from its id (``sharding``,
#: ``control.balance``); a reconciler of its own with such an id would share them.
_RESERVED_SUFFIX = re.compile(r"-(shard|member)-[0-9]+$")
_RFC1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)


@dataclasses.dataclass
class LoopConfig:
    """Everything a Builder collected; checked by :meth:`validate` before a Loop is built."""

    reconciler: object
    tenancy: Tenancy
    triggers: list[Trigger]
    concurrency: int = DEFAULT_CONCURRENCY
    interval: float = DEFAULT_INTERVAL
    backoff_base: float = DEFAULT_BACKOFF_BASE
    backoff_max: float = DEFAULT_BACKOFF_MAX
    leader: LeaderElector | None = None
    fenced_repo: FencedRepository | None = None
    metrics: Metrics | None = None
    events: EventSink | None = None
    redrive_interval: float = DEFAULT_REDRIVE_INTERVAL
    name: str | None = None
    reconciler_id: str | None = None
    renew_interval: float = DEFAULT_RETRY_PERIOD
    default_requeue: bool = True
    intake_capacity: int = DEFAULT_INTAKE_CAPACITY
    stop_timeout: float = DEFAULT_STOP_TIMEOUT
    rng: random.Random = dataclasses.field(default_factory=random.Random)
    #: Set by a sharded reconciler on the Loop of each of its shards: that Loop's
    #: reconciler id is ``<id>-shard-<k>``, a suffix no other reconciler may take.
    shard_of: str | None = None
    #: Set with ``shard_of``: the ``controller`` and ``shard`` labels of that Loop's
    #: metrics (the sharded reconciler's id, the shard's number); None: the Loop's
    #: own reconciler id and ``shard=""``.
    metric_labels: tuple[str, str] | None = None

    def names(self) -> tuple[str, str]:
        """The controller name (logs) and the reconciler id (lease, fencing scope, metrics)."""
        name, _ = as_reconcile_fn(self.reconciler)
        if self.name is not None:
            name = self.name
        rid = default_reconciler_id(name) if self.reconciler_id is None else self.reconciler_id
        return name, rid

    def validate(self) -> None:
        """Check every option and how they combine; a ConfigError names the first bad one."""
        if not isinstance(self.tenancy, Tenancy):
            raise ConfigError(
                f"tenancy must be Tenancy.SINGLE_TENANT or Tenancy.TENANT_SCOPED, "
                f"got {self.tenancy!r}"
            )
        if (
            isinstance(self.concurrency, bool)
            or not isinstance(self.concurrency, int)
            or self.concurrency < 1
        ):
            raise ConfigError(f"concurrency must be an integer >= 1, got {self.concurrency!r}")
        if self.interval <= 0:
            raise ConfigError(f"interval must be > 0 seconds, got {self.interval!r}")
        if self.backoff_base <= 0:
            raise ConfigError(f"backoff base must be > 0 seconds, got {self.backoff_base!r}")
        if self.backoff_base > self.backoff_max:
            raise ConfigError(
                f"backoff base ({self.backoff_base!r} s) must not exceed backoff max "
                f"({self.backoff_max!r} s)"
            )
        capacity = self.intake_capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise ConfigError(f"intake capacity must be an integer, got {capacity!r}")
        if capacity < 1:
            raise ConfigError(f"intake capacity must be >= 1, got {capacity!r}")
        if self.stop_timeout < 0:
            raise ConfigError(f"stop timeout must be >= 0 seconds, got {self.stop_timeout!r}")
        rid = validate_reconciler_id(self.names()[1])
        if self.shard_of is None and _RESERVED_SUFFIX.search(rid):
            raise ConfigError(
                f"reconciler_id {rid!r} ends like the lease of a shard or a member of a "
                "sharded reconciler (-shard-<n>, -member-<n>): it would share that lease and "
                "fencing scope; choose another reconciler_id"
            )
        if self.events is not None and not isinstance(self.events, EventSink):
            raise ConfigError(f"events {self.events!r} is not an EventSink (async post)")
        if self.redrive_interval <= 0:
            raise ConfigError(
                f"redrive interval must be > 0 seconds, got {self.redrive_interval!r}"
            )
        repo = self.fenced_repo
        if repo is not None and not isinstance(repo, FencedRepository):
            raise ConfigError(f"fenced repo {repo!r} is not a FencedRepository (apply_fenced)")
        if self.leader is None:
            return
        self.lease_timing()
        if repo is not None and not isinstance(repo, EpochRecordingRepository):
            raise ConfigError(
                f"fenced repo {repo!r} cannot record the epoch a leader leads at "
                "(record_epoch, highest_epoch: the EpochRecordingRepository protocol), so "
                "a paused old leader could still write to entities the new leader has not "
                "written; implement it, or run without a leader"
            )

    def lease_timing(self) -> LeaseTiming:
        """The timing of the leader's lease: its declared TTL, renewed every ``renew_interval``."""
        leader = self.leader
        if not isinstance(leader, LeaderElector):
            raise ConfigError(
                f"leader {leader!r} is not a LeaderElector "
                "(acquire_lease, renew_lease, release_lease)"
            )
        return LeaseTiming.of(_declared_ttl(leader), self.renew_interval)


def default_reconciler_id(name: str) -> str:
    """A lease-name-safe id derived from a reconciler's name (``reconcile_x`` → ``reconcile-x``)."""
    return re.sub(r"[^a-z0-9.-]+", "-", name.lower()).strip("-.") or "reconciler"


def validate_name(value: object) -> str:
    """A controller name (logs): any non-empty string."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"name must be a non-empty string, got {value!r}")
    return value


def validate_reconciler_id(value: object) -> str:
    if not isinstance(value, str) or len(value) > 253 or not _RFC1123_SUBDOMAIN.match(value):
        raise ConfigError(
            f"reconciler_id must be a valid Kubernetes object name (RFC 1123 subdomain: "
            f"lowercase alphanumerics, '-' and '.', at most 253 characters), got {value!r}"
        )
    return value


def _declared_ttl(elector: object) -> LeaseTTL:
    """The elector's declared lease TTL, coerced to :class:`LeaseTTL`, or a ConfigError."""
    if not isinstance(elector, ElectorWithTTL):
        raise ConfigError(
            f"leader {elector!r} does not declare its lease ttl (a `ttl` property: the "
            "ElectorWithTTL protocol); without it the Loop cannot step down before the lease "
            "expires for the other replicas"
        )
    ttl = elector.ttl
    if isinstance(ttl, LeaseTTL):
        return ttl
    try:
        return LeaseTTL(ttl)
    except ConfigError as exc:
        raise ConfigError(f"leader {elector!r} declares an invalid ttl: {exc}") from None
