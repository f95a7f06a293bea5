"""Readiness checks repeated in the background, all with the same hysteresis.

A :class:`PeriodicProbe` runs :meth:`~PeriodicProbe.check_once` every
``interval`` seconds; :meth:`~PeriodicProbe.problem` is ``None`` while the last
verdict passed, else a one-line reason (for ``/readyz`` and the log). A probe
that has not finished its first round reports that too.

A refusal (a forbidden watch, a database that rejects the URL) is the verdict at
once. Any other failure of a replica that was ready is checked again after
``RECHECK`` seconds and counts only after ``TRANSIENT_ROUNDS`` failed rounds in a
row: a busy API server or database is no reason to leave the Services.

:class:`StoreProbe` connects to the PostgreSQL database a replica needs to lead
(its lease table) or to write (its fenced store): a replica that cannot reach it
could never take over, so a rollout must not replace working replicas with it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Callable

from kopf_reconcile.api import ConfigError
from kopf_reconcile.database import check_database
from kopf_reconcile.redaction import redact_dsn

__all__ = ["PeriodicProbe", "StoreProbe", "first_problem"]

logger = logging.getLogger("kopf_reconcile.readiness")

#: Seconds between two rounds of checks, and the time one round's request may take.
DEFAULT_INTERVAL = 10.0
REQUEST_TIMEOUT = 10.0
#: A ready replica turns not ready after this many failed rounds in a row (a refusal: one),
#: checking again after RECHECK seconds in between.
TRANSIENT_ROUNDS = 3
RECHECK = 1.0


class PeriodicProbe(abc.ABC):
    """A check repeated every ``interval`` seconds; ``problem()`` tells the last verdict."""

    #: What is checked, for the log ("the watches", "the database").
    subject = "the checks"

    def __init__(self, *, interval: float = DEFAULT_INTERVAL) -> None:
        self._interval = interval
        self._problem: str | None = f"{self.subject}: not checked yet"
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0

    def problem(self) -> str | None:
        """``None`` when the last verdict passed."""
        return self._problem

    @abc.abstractmethod
    async def check_once(self) -> str | None:
        """One round: why it failed, or ``None``."""

    def is_refusal(self, problem: str) -> bool:
        """Whether ``problem`` is a verdict at once (no retry can change it soon)."""
        return False

    async def start(self) -> None:
        self._task = asyncio.create_task(
            self._run(), name=f"kopf-reconcile probe of {self.subject}"
        )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        failed_rounds = 0
        while True:
            try:
                problem = await self.check_once()
            except Exception as exc:  # the probe must outlive any one failure
                problem = f"{self.subject} cannot be checked: {exc.__class__.__name__}: {exc}"
            self.rounds += 1
            failed_rounds = 0 if problem is None else failed_rounds + 1
            transient = problem is not None and not self.is_refusal(problem)
            if transient and self._problem is None and failed_rounds < TRANSIENT_ROUNDS:
                logger.debug("a check of %s failed, checking again: %s", self.subject, problem)
                await asyncio.sleep(min(self._interval, RECHECK))
                continue
            if problem != self._problem:
                if problem is None:
                    logger.info("%s: ready", self.subject)
                else:
                    logger.warning("not ready: %s", problem)
            self._problem = problem
            await asyncio.sleep(self._interval)


class StoreProbe(PeriodicProbe):
    """Connects to the database at ``dsn`` every round (named ``source`` when it refuses)."""

    subject = "the database"

    def __init__(self, dsn: str, source: str, *, interval: float = DEFAULT_INTERVAL) -> None:
        super().__init__(interval=interval)
        self._dsn = dsn
        self._source = source
        self._refusal: str | None = None

    async def check_once(self) -> str | None:
        where = f"PostgreSQL at {redact_dsn(self._dsn)}"
        try:
            failure = await check_database(self._dsn, self._source, REQUEST_TIMEOUT)
        except ConfigError as exc:
            self._refusal = str(exc)
            return self._refusal
        return None if failure is None else f"{where} cannot be reached: {failure}"

    def is_refusal(self, problem: str) -> bool:
        return problem == self._refusal


def first_problem(*probes: PeriodicProbe) -> Callable[[], str | None]:
    """A readiness problem: the first probe's that has one."""

    def problem() -> str | None:
        return next((p for p in map(PeriodicProbe.problem, probes) if p is not None), None)

    return problem
