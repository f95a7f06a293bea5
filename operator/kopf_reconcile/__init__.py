"""kopf-reconcile: controller-runtime-style reconcile loops for kopf operators.

A :class:`Loop` dispatches entity ids from triggers to a reconciler, one
reconcile per entity at a time, with coalescing, delays, per-entity backoff
and dead letters. With a :class:`LeaderElector` only the lease holder
dispatches; with a :class:`FencedRepository` every write carries the lease's
monotonic epoch and the database rejects a stale one, so a paused old leader
cannot overwrite a new leader's work.

Conventional import: ``import kopf_reconcile as kr``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kopf_reconcile.api import ConfigError, PermanentError, Reconciler, Request, Result
from kopf_reconcile.builder import Builder, new
from kopf_reconcile.cache import cached
from kopf_reconcile.events import EventRecord, EventSink, event
from kopf_reconcile.fencing.protocol import (
    DeadLetter,
    DeadLetterStore,
    FencedRepository,
    ShardableRepository,
    StaleEpochError,
)
from kopf_reconcile.fencing.writer import FencedWriter, fenced_writer
from kopf_reconcile.leader.protocol import (
    LeaderElector,
    LeaseContended,
    LeaseError,
    LeaseLost,
    LeaseToken,
    LeaseTTL,
)
from kopf_reconcile.loop import Loop, LoopStats
from kopf_reconcile.metrics import Metrics, register_metrics
from kopf_reconcile.tenancy import Tenancy
from kopf_reconcile.triggers import ChannelTrigger, TickerTrigger, Trigger

if TYPE_CHECKING:
    from kopf_reconcile.fencing.postgres import PostgresFencedRepository
    from kopf_reconcile.integration.conditions import set_status_condition
    from kopf_reconcile.integration.fenced_client import (
        FencedClient,
        Resource,
        fenced_client,
        owner_reference,
    )
    from kopf_reconcile.integration.finalizers import is_deleting
    from kopf_reconcile.integration.kopf_shim import reconciler
    from kopf_reconcile.integration.related import Owns, Watches, owned
    from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector
    from kopf_reconcile.leader.postgres import PostgresLeaseElector

__all__ = [
    "Builder",
    "ChannelTrigger",
    "ConfigError",
    "DeadLetter",
    "DeadLetterStore",
    "EventRecord",
    "EventSink",
    "FencedClient",
    "FencedRepository",
    "FencedWriter",
    "KubernetesLeaseElector",
    "LeaderElector",
    "LeaseContended",
    "LeaseError",
    "LeaseLost",
    "LeaseTTL",
    "LeaseToken",
    "Loop",
    "LoopStats",
    "Metrics",
    "Owns",
    "PermanentError",
    "PostgresFencedRepository",
    "PostgresLeaseElector",
    "Reconciler",
    "Request",
    "Resource",
    "Result",
    "ShardableRepository",
    "StaleEpochError",
    "Tenancy",
    "TickerTrigger",
    "Trigger",
    "Watches",
    "cached",
    "event",
    "fenced_client",
    "fenced_writer",
    "is_deleting",
    "new",
    "owned",
    "owner_reference",
    "reconciler",
    "register_metrics",
    "set_status_condition",
]


# Names whose modules import kopf, kubernetes-asyncio or asyncpg: loaded on first use,
# so importing the kernel stays cheap (and free of kopf).
_LAZY = {
    "reconciler": "kopf_reconcile.integration.kopf_shim",
    "Owns": "kopf_reconcile.integration.related",
    "Watches": "kopf_reconcile.integration.related",
    "owned": "kopf_reconcile.integration.related",
    "is_deleting": "kopf_reconcile.integration.finalizers",
    "FencedClient": "kopf_reconcile.integration.fenced_client",
    "Resource": "kopf_reconcile.integration.fenced_client",
    "fenced_client": "kopf_reconcile.integration.fenced_client",
    "owner_reference": "kopf_reconcile.integration.fenced_client",
    "set_status_condition": "kopf_reconcile.integration.conditions",
    "KubernetesLeaseElector": "kopf_reconcile.leader.kubernetes",
    "PostgresLeaseElector": "kopf_reconcile.leader.postgres",
    "PostgresFencedRepository": "kopf_reconcile.fencing.postgres",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
