"""An asyncio event loop on virtual time: idle waits take no real time.

The loop's clock (``loop.time()``) starts at 0 and moves only when the loop
has nothing to run: then it jumps straight to the next timer. A simulation
of a minute of leases, renewals and backoffs therefore runs in milliseconds,
and — since nothing depends on real time — the same program with the same
random seed runs the same way every time.

Work meant for threads (``asyncio.to_thread``, sync reconcilers) runs at
once on the loop's own thread, taking no virtual time: a real thread would
finish at a moment of its own and make the order of events depend on it.
Such work must therefore not block or wait for the loop.

It works by wrapping the selector: ``select(timeout)`` first polls for real
events; with none ready and no thread running, it advances the clock by
``timeout`` instead of sleeping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Deadlock", "VirtualTimeLoop"]

DEADLOCK_AFTER = 5.0  # real seconds with nothing scheduled before a Deadlock is declared


class Deadlock(RuntimeError):
    """Nothing can ever run again: no ready callback, no timer, no thread, no I/O."""


class _InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs "thread" work at once, on the loop's thread: a real thread would finish at a
    moment of its own, and the order of callbacks (so the whole run) would depend on it."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # delivered to the awaiting coroutine, as a thread's
            future.set_exception(exc)
        return future


class _VirtualSelector(selectors.BaseSelector):
    def __init__(self, inner: selectors.BaseSelector, loop: VirtualTimeLoop) -> None:
        self._inner = inner
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._inner.select(0)
        if events:
            return events
        if timeout is None:
            # Nothing scheduled: only a thread the loop did not start (e.g. the executor's
            # shutdown) can still wake it. Wait a little in real time, then give up.
            events = self._inner.select(DEADLOCK_AFTER)
            if not events:
                raise Deadlock("the simulation can never progress: nothing is scheduled")
            return events
        self._loop.advance(timeout)
        return []

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock jumps over idle time."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_VirtualSelector(selectors.DefaultSelector(), self))
        self.set_default_executor(_InlineExecutor())

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)
