"""The work queue on the event loop: intake backpressure, timers and waiting workers.

:class:`~kopf_reconcile.workqueue.WorkQueue` decides which entity runs next and when,
without a clock or asyncio. :class:`DispatchQueue` puts it on the running event loop,
as client-go's delaying queue sits over its queue:

* **intake**: :meth:`DispatchQueue.offer` adds an entity at once when it need not wait
  for room, and :meth:`DispatchQueue.put` is what a trigger's ``emit`` awaits otherwise
  (the Loop tries ``offer`` first, so a request that finds room costs no coroutine).
  While the Loop dispatches and ``capacity`` entities are ready, a new entity waits for
  room (backpressure, never a drop); an entity already ready or running never waits. A Loop
  that does not dispatch (a follower) keeps each id once and never blocks its triggers.
  The two lanes of the work queue have their room counted apart: a fresh entity waits
  only while ``capacity`` fresh ones are ready, so a full resync never holds back a
  fresh change; a resync entity waits while ``capacity`` entities of either lane are.
* **timers**: one event-loop timer, armed at the earliest due time of the delayed
  entities (requeues, backoff); when it fires, the due entities become ready and as many
  idle workers as can take them are woken.
* **waiting workers**: a worker with nothing to do waits in :meth:`wait_for_work`; an
  entity becoming ready wakes one.

Time is the event loop's clock (``loop.time()``), the one every part of a Loop reads.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable, Iterable

from kopf_reconcile.workqueue import WorkQueue


class DispatchQueue:
    """A :class:`WorkQueue` served to workers and triggers on the running event loop."""

    def __init__(
        self,
        *,
        backoff_base: float,
        backoff_max: float,
        rng: random.Random,
        capacity: int,
        concurrency: int,
        on_add: Callable[[], None] | None = None,
    ) -> None:
        """Call it inside the running event loop: its timers and waiters belong to it."""
        self.work_queue = WorkQueue(backoff_base=backoff_base, backoff_max=backoff_max, rng=rng)
        #: Whether workers take work; a follower's queue only keeps ids for a failover.
        self.dispatching = False
        self._closed = False
        self._capacity = capacity
        self._concurrency = concurrency
        self._on_add = on_add
        self._event_loop = asyncio.get_running_loop()
        self.now = self._event_loop.time
        self._idle_workers: deque[asyncio.Future[None]] = deque()
        self._waiting_for_room: deque[asyncio.Future[None]] = deque()  # resync entities
        self._waiting_fresh: deque[asyncio.Future[None]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0

    @property
    def ready_count(self) -> int:
        return self.work_queue.ready_count

    @property
    def dead_count(self) -> int:
        return self.work_queue.dead_count

    # -- dispatch switch ---------------------------------------------------------------

    def open(self) -> None:
        """Workers may take work (the Loop leads)."""
        self.dispatching = True

    def close_dispatch(self) -> None:
        """Workers take no more work; triggers waiting for room go on (a follower keeps ids)."""
        self.dispatching = False
        _wake_all(self._waiting_for_room)
        _wake_all(self._waiting_fresh)

    def close(self) -> None:
        """The Loop stops: no timer fires again and every waiter is released."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        _wake_all(self._idle_workers)
        _wake_all(self._waiting_for_room)
        _wake_all(self._waiting_fresh)

    # -- intake ------------------------------------------------------------------------

    async def put(self, entity: str, *, resync: bool = False) -> None:
        """Add ``entity``, first waiting for room while a dispatching queue is full.

        ``resync``: in the resync lane (see :class:`~kopf_reconcile.workqueue.WorkQueue`).
        """
        waiters = self._waiting_for_room if resync else self._waiting_fresh
        while not self.offer(entity, resync=resync):
            room = self._event_loop.create_future()
            waiters.append(room)
            try:
                await room
            except asyncio.CancelledError:
                if room.done() and not room.cancelled():
                    _wake_one(waiters)  # woken, then cancelled: the room goes to the next
                raise

    def offer(self, entity: str, *, resync: bool = False) -> bool:
        """Add ``entity`` unless it must wait for room (see :meth:`put`); whether it was added."""
        if self.dispatching:
            queue = self.work_queue
            ready = queue.ready_count
            if (
                (ready if resync else ready - queue.resync_count) >= self._capacity
                and not queue.is_ready(entity)
                and not queue.is_processing(entity)
                and not self._closed
            ):
                return False
        self.add(entity, resync=resync)
        return True

    def add(self, entity: str, *, resync: bool = False) -> None:
        """Add ``entity`` now (no backpressure), waking a worker if it became ready."""
        if self._on_add is not None:
            self._on_add()
        if (
            self.work_queue.add(entity, self.now(), resync=resync)
            and self.dispatching
            and self._idle_workers
        ):
            _wake_one(self._idle_workers)

    # -- workers -----------------------------------------------------------------------

    async def wait_for_work(self) -> None:
        """Wait until an entity may be ready, dispatch opens or the queue closes."""
        idle = self._event_loop.create_future()
        self._idle_workers.append(idle)
        await idle

    def take(self) -> tuple[str, float]:
        """The next ready entity and since when it was ready; room for one more trigger."""
        taken = self.work_queue.get()
        if self._waiting_for_room:
            _wake_one(self._waiting_for_room)
        if self._waiting_fresh:  # (woken for nothing when a resync entity was taken)
            _wake_one(self._waiting_fresh)
        return taken

    def done_success(self, entity: str, requeue_after: float | None) -> None:
        due = self.work_queue.done_success(entity, self.now(), requeue_after)
        if due is not None and (self._timer is None or due < self._timer_due):
            self._arm_timer()

    def done_error(self, entity: str) -> float:
        """Back the entity off; the delay until its retry."""
        delay = self.work_queue.done_error(entity, self.now())
        self._arm_timer()
        return delay

    def done_permanent(self, entity: str) -> None:
        self.work_queue.done_permanent(entity, self.now())

    def replace_dead(self, entities: Iterable[str]) -> None:
        """Make the dead set a store's dead letters (see :meth:`WorkQueue.replace_dead`)."""
        self._made_room(self.work_queue.replace_dead(entities))

    def _made_room(self, freed: int) -> None:
        """``freed`` ready entities left the queue without a worker: wake as many waiters."""
        for _ in range(freed):
            if not self._waiting_for_room and not self._waiting_fresh:
                return
            if self._waiting_for_room:
                _wake_one(self._waiting_for_room)
            if self._waiting_fresh:
                _wake_one(self._waiting_fresh)

    def done_requeue(self, entity: str) -> None:
        """The run ended without an outcome (cancelled, fenced): ready again, no backoff."""
        self.work_queue.done_requeue(entity, self.now())

    # -- timers ------------------------------------------------------------------------

    def _arm_timer(self) -> None:
        due = self.work_queue.next_due()
        if due is None or self._closed:
            return
        if self._timer is not None and self._timer_due <= due:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = self._event_loop.call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        became_ready = self.work_queue.pop_due(self.now())
        if self.dispatching:
            for _ in range(min(became_ready, self._concurrency)):
                _wake_one(self._idle_workers)
        self._arm_timer()


def _wake_one(waiters: deque[asyncio.Future[None]]) -> None:
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            return


def _wake_all(waiters: deque[asyncio.Future[None]]) -> None:
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
