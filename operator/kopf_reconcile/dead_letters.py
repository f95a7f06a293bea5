"""Durable dead letters: a leader's dead letters kept in its fenced store, and redrives.

Without a store, a dead letter lives in the leader's work queue only and is forgotten
on failover or restart; the queue keeps it across the Loop's own terms, so a Loop that
leads again still holds the dead letters it had when it lost the lease (another leader
may have seen one succeed meanwhile: it runs again at its next fresh trigger). With a
fenced repository that is a :class:`~kopf_reconcile.fencing.protocol.DeadLetterStore`
(``PostgresFencedRepository`` is), the Loop's :class:`DurableDeadLetters`:

* writes each dead letter to the store (reason, first and last time, attempts, epoch)
  and clears it when the entity next succeeds. Writes go out in the background, one
  at a time in the order they happened (a clear never overtakes the record it clears),
  each carrying the leader's epoch: the store refuses a deposed leader's;
* when the Loop starts leading, before it dispatches anything (its resync-all
  included), loads the scope's dead letters (a new leader knows the old one's: they
  count in :meth:`~kopf_reconcile.Loop.stats` and are cleared on success) and makes
  them its queue's dead set, so its resync-all does not retry them: they wait for a
  change or a redrive, as under the old leader. An entity a fresh trigger queued (a
  change the follower saw, which the dead letter may predate) keeps its run; a timer
  or a run interrupted at a step-down is no change (see
  :meth:`~kopf_reconcile.workqueue.WorkQueue.bury`). An entity dead in the queue but
  without a letter in the store is dead no longer: another leader saw it succeed (or
  redrove it) since this Loop last led. The load waits first for this Loop's own
  pending writes, so the store it reads has them;
* the load is bounded by :data:`LOAD_TIMEOUT`: a store that does not answer in time (or
  fails) must not hold a new leader's dispatch back for an outage's length. The Loop
  then leads without them, with an empty dead set (a warning says so): each dead
  letter is retried once, by the resync-all or its next trigger, and is dead again if
  it still fails. The letters are loaded again at the next redrive poll, for counting
  and clearing only (the resync-all may have run them by then);
* while it leads, every ``redrive_interval`` takes the redrive requests of its scope
  from the store (``kopf-reconcile redrive`` writes them) and adds those entities to
  its queue, as a fresh trigger. Followers never look: the requests wait for the leader.

A store error is logged; the write is dropped (the in-memory dead letter and its
metric stay right) and the redrive poll retries at its next tick.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from kopf_reconcile.fencing.protocol import DeadLetterStore

__all__ = ["DurableDeadLetters"]

logger = logging.getLogger("kopf_reconcile.dead_letters")

MAX_PENDING_WRITES = 10_000  # writes waiting for an unreachable store before new ones are dropped
LOAD_TIMEOUT = 5.0  # how long a new leader waits for its dead letters before it dispatches


class DurableDeadLetters:
    """A Loop's dead letters in a :class:`DeadLetterStore`, and the redrives it hands over."""

    def __init__(
        self,
        store: DeadLetterStore,
        *,
        name: str,
        epoch: Callable[[], int],
        redrive: Callable[[str], None],
        replace_dead: Callable[[Iterable[str]], object],
        interval: float,
    ) -> None:
        """Create it inside the running event loop; ``redrive`` adds an entity to the queue
        (a fresh trigger), ``replace_dead`` makes the loaded dead letters its dead set; the
        load is bounded by :data:`LOAD_TIMEOUT`."""
        self._store = store
        self._name = name
        self._epoch = epoch
        self._redrive = redrive
        self._replace_dead = replace_dead
        self._interval = interval
        #: Entities with a dead letter in the store, as far as this leader knows (this term).
        self.known: set[str] = set()
        self._writes: asyncio.Queue[tuple[str, str, str | None, int]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._leading: asyncio.Task[None] | None = None

    def dead_lettered(self, entity_id: str, reason: str) -> None:
        if entity_id:
            self.known.add(entity_id)
            self._write("record", entity_id, reason)

    def succeeded(self, entity_id: str) -> None:
        if entity_id in self.known:
            self.known.discard(entity_id)
            self._write("clear", entity_id, None)

    def lead(self, dispatch: Callable[[], None]) -> None:
        """This Loop leads: load the scope's dead letters, call ``dispatch`` (the Loop starts
        dispatching), then poll for redrive requests. :meth:`lose` before ``dispatch`` is
        called means it never is."""
        self.lose()
        self._leading = asyncio.create_task(
            self._lead(dispatch), name=f"{self._name}: dead letters"
        )

    def lose(self) -> None:
        if self._leading is not None:
            self._leading.cancel()
            self._leading = None

    async def close(self, timeout: float = 5.0) -> None:
        """Stop polling; let the pending writes finish for up to ``timeout`` seconds."""
        self.lose()
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await self._writes.join()
        except TimeoutError:
            logger.warning(
                "loop %s: %d dead-letter write(s) not done at stop, dropped",
                self._name,
                self._writes.qsize(),
            )
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)

    # -- internals ---------------------------------------------------------------------

    def _write(self, op: str, entity_id: str, reason: str | None) -> None:
        if self._writes.qsize() >= MAX_PENDING_WRITES:
            logger.warning(
                "loop %s: dead-letter store behind by %d writes; dropping the %s of %r",
                self._name,
                MAX_PENDING_WRITES,
                op,
                entity_id,
            )
            return
        self._writes.put_nowait((op, entity_id, reason, self._epoch()))
        if self._writer is None:
            self._writer = asyncio.create_task(
                self._write_all(), name=f"{self._name}: dead-letter writes"
            )

    async def _write_all(self) -> None:
        while True:
            op, entity_id, reason, epoch = await self._writes.get()
            try:
                if op == "record":
                    assert reason is not None
                    done = await self._store.record_dead_letter(entity_id, epoch, reason)
                else:
                    done = await self._store.clear_dead_letter(entity_id, epoch)
                if not done and op == "record":
                    logger.warning(
                        "loop %s: the dead letter of %r at epoch %d was refused by the store "
                        "(a higher epoch leads)",
                        self._name,
                        entity_id,
                        epoch,
                    )
            except Exception as exc:
                logger.warning(
                    "loop %s: cannot %s the dead letter of %r in the store: %r",
                    self._name,
                    op,
                    entity_id,
                    exc,
                )
            finally:
                self._writes.task_done()

    async def _load(self) -> bool:
        """Make the store's dead letters the queue's dead set; whether they could be read."""
        self.known = set()  # a previous term's knowledge may be stale: the store decides
        try:
            async with asyncio.timeout(LOAD_TIMEOUT):
                if self._writer is not None:
                    await self._writes.join()  # this Loop's own letters reach the store first
                letters = await self._store.dead_letters()
        except Exception as exc:
            self._replace_dead(())
            logger.warning(
                "loop %s: cannot load the dead letters from the store within %.1fs (%r); "
                "leading without them: each of them is retried once, and they are loaded "
                "again at the next redrive poll",
                self._name,
                LOAD_TIMEOUT,
                exc,
            )
            return False
        self.known = {letter.entity_id for letter in letters}
        self._replace_dead(self.known)
        if letters:
            logger.info("loop %s: %d dead letter(s) in the store", self._name, len(letters))
        return True

    async def _lead(self, dispatch: Callable[[], None]) -> None:
        loaded = await self._load()
        dispatch()
        while True:
            try:
                if not loaded:  # counted and cleared on success; dispatch runs already
                    letters = await self._store.dead_letters()
                    self.known.update(letter.entity_id for letter in letters)
                    loaded = True
                    logger.info(
                        "loop %s: %d dead letter(s) in the store, loaded late",
                        self._name,
                        len(letters),
                    )
                for entity_id in await self._store.take_redrives(self._epoch()):
                    logger.info("loop %s: redrive of %r requested", self._name, entity_id)
                    self._redrive(entity_id)
            except Exception as exc:
                logger.warning(
                    "loop %s: cannot read dead letters or redrives from the store: %r",
                    self._name,
                    exc,
                )
            await asyncio.sleep(self._interval)
