"""What the end of a reconcile does: the entity's next look, metrics, Event, dead letter.

A reconcile ends in one of four ways, each told to the
:class:`~kopf_reconcile.dispatch_queue.DispatchQueue` (when the entity is looked at
next), to the metrics (``results``), and, when the Loop has them, to its Events
(:mod:`kopf_reconcile.events`) and its durable dead letters
(:mod:`kopf_reconcile.dead_letters`):

* **succeeded**: the reconciler returned ``None`` or a :class:`~kopf_reconcile.Result`;
  the entity is looked at again after ``requeue_after``, else after the jittered
  resync interval (with ``default_requeue``), else at its next trigger. Returning
  anything else is a programmer error, and dead-letters the entity.
* **failed**: it raised; the entity is retried with exponential backoff.
* **dead-lettered**: a :class:`~kopf_reconcile.PermanentError`, or an entity id the
  tenancy cannot read; no retry until a fresh trigger.
* **fenced**: a :class:`~kopf_reconcile.fencing.protocol.StaleEpochError` escaped, so
  a higher epoch has led: the entity is requeued without backoff growth, and the Loop
  steps down (``step_down``).

Which exception is which, and cancellation, are the Loop's (``Loop._process``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kopf_reconcile.api import Result
from kopf_reconcile.backoff import requeue_jitter
from kopf_reconcile.config import LoopConfig
from kopf_reconcile.dead_letters import DurableDeadLetters
from kopf_reconcile.dispatch_queue import DispatchQueue
from kopf_reconcile.events import LoopEvents
from kopf_reconcile.fencing.protocol import StaleEpochError
from kopf_reconcile.metrics import BoundMetrics

__all__ = ["ReconcileOutcomes"]

logger = logging.getLogger("kopf_reconcile.loop")


class ReconcileOutcomes:
    """How one Loop answers the end of each reconcile (see the module docstring).

    ``step_down`` is called with the queue when a fenced write was rejected.
    """

    def __init__(
        self,
        config: LoopConfig,
        name: str,
        metrics: BoundMetrics,
        *,
        events: LoopEvents | None = None,
        durable: DurableDeadLetters | None = None,
        step_down: Callable[[DispatchQueue], None],
    ) -> None:
        self._cfg = config
        self._name = name
        self._metrics = metrics
        self._count_results = config.metrics is not None
        self._events = events
        self._durable = durable
        self._step_down = step_down

    def succeeded(self, queue: DispatchQueue, entity: str, outcome: object) -> None:
        requeue_after: float | None
        if outcome is None:
            requeue_after = 0.0
        elif isinstance(outcome, Result):
            requeue_after = outcome.requeue_after
        else:
            self.dead_letter(
                queue,
                entity,
                f"reconciler returned {outcome!r}; it must return kopf_reconcile.Result or None "
                "(a programmer error)",
            )
            return
        cfg = self._cfg
        if self._count_results:
            self._metrics.results["requeue_after" if requeue_after else "success"].inc()
        if not requeue_after:
            requeue_after = requeue_jitter(cfg.rng, cfg.interval) if cfg.default_requeue else None
        queue.done_success(entity, requeue_after)
        if self._events is not None:
            self._events.succeeded(entity)
        if self._durable is not None:
            self._durable.succeeded(entity)

    def failed(self, queue: DispatchQueue, entity: str, exc: BaseException) -> None:
        delay = queue.done_error(entity)
        metrics = self._metrics
        metrics.results["error"].inc()
        metrics.errors.inc()
        metrics.retries.inc()
        if self._events is not None:
            self._events.failed(entity, exc)
        logger.error(
            "reconcile of %r by %s failed; retrying in %.3fs: %r",
            entity,
            self._name,
            delay,
            exc,
            exc_info=exc,
            extra={"controller": self._name, "entity": entity},
        )

    def dead_letter(
        self, queue: DispatchQueue, entity: str, reason: str, message: str | None = None
    ) -> None:
        """Dead-letter ``entity``: ``reason`` for the log, ``message`` (default: the reason)
        for its Event and its durable dead letter."""
        queue.done_permanent(entity)
        self._metrics.results["permanent"].inc()
        if self._events is not None:
            self._events.dead_lettered(entity, message or reason)
        if self._durable is not None:
            self._durable.dead_lettered(entity, message or reason)
        logger.error(
            "entity %r of %s dead-lettered (no retry until a fresh trigger): %s",
            entity,
            self._name,
            reason,
            extra={"controller": self._name, "entity": entity},
        )

    def fenced(self, queue: DispatchQueue, entity: str, exc: StaleEpochError) -> None:
        queue.done_requeue(entity)
        self._metrics.results["fenced"].inc()
        logger.warning(
            "reconcile of %r by %s was fenced (%s); stepping down: a higher epoch has written",
            entity,
            self._name,
            exc,
            extra={"controller": self._name, "entity": entity},
        )
        self._step_down(queue)
