"""A shard's fenced repository: its own scope, and writes of its own entities only.

A shard Loop of a :class:`~kopf_reconcile.sharded_loop.ShardedLoop` is given a
:class:`ShardFence` as its fenced repository, over the scope the base repository
gives that shard (:meth:`~kopf_reconcile.fencing.protocol.ShardableRepository.for_shard`):

* **a writer fenced per shard**: a reconcile's writer writes only entities of its
  shard (anything else is a :class:`~kopf_reconcile.PermanentError`): an entity is
  fenced in its own shard's scope only, never in two.
* **one shard layout per scope**: recording a shard's epoch first has the ShardedLoop
  record the shard count in the base scope, and a layout refusal (a
  :class:`~kopf_reconcile.fencing.protocol.ShardLayoutError`) becomes a retry with
  backoff (:class:`~kopf_reconcile.control.layout_wait.LayoutRefused`).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from kopf_reconcile.api import PermanentError
from kopf_reconcile.fencing.protocol import (
    DeadLetter,
    FencedRepository,
    ShardableRepository,
    ShardLayoutError,
)

if TYPE_CHECKING:
    from kopf_reconcile.sharded_loop import ShardedLoop

__all__ = ["ShardFence"]

logger = logging.getLogger("kopf_reconcile.loop")


# Dead-letter methods a shard's repository answers for entities of its own shard only.
_OWN_SHARD_ONLY = frozenset(
    {"record_dead_letter", "clear_dead_letter", "take_redrives", "dead_letters"}
)


class ShardFence:
    """Shard ``k``'s repository: its own scope, writes of its own entities only.

    Every other capability of the shard's repository (binding, epoch floors) passes
    through; recording an epoch first records the shard count in the base scope (once,
    and again after a layout refusal), and a layout refusal becomes a retry with backoff
    (:class:`~kopf_reconcile.control.layout_wait.LayoutRefused`). Dead letters are kept
    for entities of its own shard only, as writes are: recording or clearing another
    shard's is refused, and a dead letter or redrive request of another shard's entity
    found in its scope is dropped with a warning (the store keeps each in its entity's
    shard scope; this is the second line of defence).
    """

    def __init__(self, owner: ShardedLoop, base: FencedRepository, shard: int) -> None:
        assert isinstance(base, ShardableRepository)
        self._owner = owner
        self._shard = shard
        self._repo: Any = base.for_shard(shard)

    def _check_home(self, entity_id: object, what: str) -> None:
        if isinstance(entity_id, str) and entity_id:
            home = self._owner.shard_of(entity_id)
            if home != self._shard:
                raise PermanentError(
                    f"entity {entity_id!r} belongs to shard {home} of "
                    f"{self._owner.reconciler_id!r}, not to shard {self._shard} whose "
                    f"{what}: a shard writes only entities of its own shard"
                )

    def _mine(self, entity_ids: list[str], what: str) -> list[str]:
        """``entity_ids`` of this shard; the others are logged as dropped."""
        mine: list[str] = []
        for entity_id in entity_ids:
            home = self._owner.shard_of(entity_id)
            if home == self._shard:
                mine.append(entity_id)
            else:
                logger.warning(
                    "loop %s: dropped the %s of %r found in shard %d's scope: the entity "
                    "belongs to shard %d (request it again if needed)",
                    self._owner.name,
                    what,
                    entity_id,
                    self._shard,
                    home,
                    extra={"controller": self._owner.name},
                )
        return mine

    async def apply_fenced(self, entity_id: str, epoch: int, mutation: object) -> bool:
        self._check_home(entity_id, "reconcile writes it")
        accepted: bool = await self._repo.apply_fenced(entity_id, epoch, mutation)
        return accepted

    # The dead-letter capability, when the shard's repository has it (see __getattr__).

    async def _record_dead_letter(
        self, inner: Any, entity_id: str, epoch: int, reason: str
    ) -> bool:
        self._check_home(entity_id, "dead letter it would record")
        return bool(await inner(entity_id, epoch, reason))

    async def _clear_dead_letter(self, inner: Any, entity_id: str, epoch: int) -> bool:
        self._check_home(entity_id, "dead letter it would clear")
        return bool(await inner(entity_id, epoch))

    async def _take_redrives(self, inner: Any, epoch: int) -> list[str]:
        return self._mine(list(await inner(epoch)), "redrive request")

    async def _dead_letters(self, inner: Any) -> list[DeadLetter]:
        letters: list[DeadLetter] = list(await inner())
        mine = set(self._mine([letter.entity_id for letter in letters], "dead letter"))
        return [letter for letter in letters if letter.entity_id in mine]

    async def record_epoch(self, epoch: int, holder: str) -> None:
        try:
            await self._owner._claim_shard_count()
            await self._repo.record_epoch(epoch, holder)
        except ShardLayoutError as exc:
            raise self._owner._layout_refused(exc) from None
        self._owner._layout_accepted()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_repo", "_owner", "_shard"):
            raise AttributeError(name)
        inner = getattr(self._repo, name)
        if name in _OWN_SHARD_ONLY:
            return functools.partial(getattr(self, f"_{name}"), inner)
        return inner

    def __repr__(self) -> str:
        return f"<shard {self._shard} of {self._repo!r}>"
