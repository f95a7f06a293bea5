"""Monotonic-epoch fenced writes to PostgreSQL, fenced per entity and per scope.

A write carrying ``epoch`` is applied only when ``epoch >= last_epoch`` of its entity
**and** ``epoch >=`` the epoch recorded for its scope, and then advances ``last_epoch``:
a zombie leader that wakes up after one or more handovers is rejected by the database
itself, for every entity of the scope. One module per concern:

=================  ============================================================
``schema``         the tables (fence rows, epochs, dead letters, redrives, leaders)
``base``           what every concern shares: pool, scope, tenancy, bounded transactions
``documents``      the fenced write (a JSON document or the user's SQL) and its reads
``epochs``         the epoch that leads each scope (the scope fence), its history
``layout``         how a shard layout is named in the epochs rows
``reshard``        a base scope's shard layout, its shard scopes, and the reshard
``dead_letters``   dead letters and redrive requests, fenced as writes are
``repository``     :class:`PostgresFencedRepository`, which joins them
=================  ============================================================
"""

from __future__ import annotations

from kopf_reconcile.fencing.postgres.base import DEFAULT_SCOPE
from kopf_reconcile.fencing.postgres.repository import PostgresFencedRepository
from kopf_reconcile.fencing.postgres.reshard import ReshardReport
from kopf_reconcile.fencing.postgres.schema import DEFAULT_FENCE_TABLE

__all__ = ["DEFAULT_FENCE_TABLE", "DEFAULT_SCOPE", "PostgresFencedRepository", "ReshardReport"]
