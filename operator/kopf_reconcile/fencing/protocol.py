"""The fencing seam: an epoch-aware repository.

A :class:`FencedRepository` records, per entity, the highest epoch that ever
wrote to it and applies a write only when ``epoch >= last_epoch`` (monotonic
fencing, not equality: a late write may arrive after several handovers and
only "older than the highest seen" rejects it). A stale epoch is answered with
``False``, not an exception, so a zombie leader's write is rejected
structurally.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class StaleEpochError(Exception):
    """A fenced write was rejected: this process's epoch is no longer current."""


@runtime_checkable
class FencedRepository(Protocol):
    """Consumer-side persistence that applies a mutation only for a current epoch."""

    async def apply_fenced(self, entity_id: str, epoch: int, mutation: object) -> bool:
        """Apply ``mutation`` if ``epoch >= last_epoch`` of the entity; else ``False``."""
        ...
