"""Waiting out a layout refusal: the fenced store records another shard layout.

A Loop whose epoch recording is refused with a
:class:`~kopf_reconcile.fencing.protocol.ShardLayoutError` (an unsharded replica of a
reconciler whose scope records a sharded layout, during a rolling change of the layout)
must not stop for good, as it does on other configuration errors: ``kopf-reconcile
reshard`` can make its layout the recorded one. Nor may it thrash: every attempt takes
the lease (a new epoch) and hands it back. :class:`LayoutWait` spaces the attempts out,
from the retry period up to :data:`LAYOUT_RETRY_MAX`, with jitter, and logs the refusal
once per wait; the Loop asks :meth:`LayoutWait.open` before each acquire attempt.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

__all__ = ["LAYOUT_RETRY_MAX", "LayoutRefused", "LayoutWait"]

LAYOUT_RETRY_MAX = 60.0  # seconds: the longest wait between attempts refused for the layout

logger = logging.getLogger("kopf_reconcile.loop")


class LayoutRefused(Exception):
    """An epoch was refused for the layout: the lease is handed back and tried again later.

    Not a :class:`~kopf_reconcile.ConfigError` on purpose: the lease control plane stops
    for good on those, and a layout refusal ends when ``kopf-reconcile reshard`` commits.
    """


class LayoutWait:
    """Backoff between attempts refused for the layout (monotonic clock, jittered)."""

    def __init__(
        self,
        name: str,
        retry_period: float,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._name = name
        self._period = retry_period
        self._rng = rng
        self._clock = clock
        self.backoff = 0.0  # seconds; 0 until a refusal
        self._retry_at = 0.0

    def open(self) -> bool:
        """Whether an attempt may be made now."""
        return self._clock() >= self._retry_at

    def refused(self, reason: Exception) -> LayoutRefused:
        """Wait longer before the next attempt (logged once per wait); what to raise."""
        now = self._clock()
        if now >= self._retry_at:
            self.backoff = min(max(2 * self.backoff, self._period), LAYOUT_RETRY_MAX)
            self._retry_at = now + self.backoff * self._rng.uniform(1.0, 1.2)
            logger.error(
                "loop %s leads nothing: %s (trying again in %.0fs)",
                self._name,
                reason,
                self._retry_at - now,
                extra={"controller": self._name},
            )
        return LayoutRefused(
            f"layout refused (logged as an error above); retrying within {self.backoff:.0f}s"
        )

    def accepted(self) -> None:
        """The layout was accepted: the next refusal starts from the retry period again."""
        self.backoff = 0.0
