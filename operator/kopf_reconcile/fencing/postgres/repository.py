"""The PostgreSQL fenced repository, as users know it: every concern joined in one class.

* :mod:`~kopf_reconcile.fencing.postgres.documents`: the fenced write and its reads;
* :mod:`~kopf_reconcile.fencing.postgres.epochs`: epochs and the scope fence;
* :mod:`~kopf_reconcile.fencing.postgres.reshard`: the shard layout and its change;
* :mod:`~kopf_reconcile.fencing.postgres.dead_letters`: dead letters and redrives;
* :mod:`~kopf_reconcile.fencing.postgres.base`: the tables, pool, scope and timeouts
  they share; :mod:`~kopf_reconcile.fencing.postgres.schema`: the tables.
"""

from __future__ import annotations

from kopf_reconcile.fencing.postgres.dead_letters import DeadLetters
from kopf_reconcile.fencing.postgres.documents import FencedDocuments
from kopf_reconcile.fencing.postgres.reshard import ShardLayouts

__all__ = ["PostgresFencedRepository"]


class PostgresFencedRepository(FencedDocuments, ShardLayouts, DeadLetters):
    """A :class:`~kopf_reconcile.fencing.protocol.FencedRepository` on PostgreSQL (asyncpg).

    Also an ``EpochRecordingRepository``, a ``ShardableRepository``, a
    ``LoopBoundRepository`` and a ``DeadLetterStore``; for operators of the operator,
    :meth:`reshard`, :meth:`list_dead_letters`, :meth:`request_redrive` and
    :meth:`leadership_changes` (``kopf-reconcile reshard``, ``dead-letters``,
    ``redrive``, ``status``).
    """
