"""Sources of reconcile work.

A :class:`Trigger` runs until cancelled and hands requests to the Loop with
``await emit(request)``. ``emit`` applies backpressure: it blocks while the
loop's intake is full and never drops a request. Deduplication, delays and
backoff live in the Loop, not in triggers. The Loop owns the trigger tasks:
it starts them, restarts one that crashes (with backoff), and cancels them on
stop, so a trigger cannot leak a task.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Protocol, runtime_checkable

from kopf_reconcile.api import RESYNC_ALL, Request
from kopf_reconcile.config import ConfigError, Duration, positive_seconds

Emit = Callable[[Request], Awaitable[None]]


@runtime_checkable
class Trigger(Protocol):
    """A producer of requests; runs until cancelled."""

    async def run(self, emit: Emit) -> None:
        """Emit requests until cancelled (returning means the source is exhausted)."""
        ...


class TickerTrigger:
    """Emits the resync-all request ``Request("")`` every ``interval`` seconds.

    The reconciler must treat ``req.entity_id == ""`` as "re-observe every
    entity you own" and fan out to its own entity set.
    """

    def __init__(self, interval: Duration) -> None:
        self.interval = positive_seconds("TickerTrigger interval", interval)

    async def run(self, emit: Emit) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await emit(Request(RESYNC_ALL))

    def __repr__(self) -> str:
        return f"TickerTrigger(interval={self.interval})"


class ChannelTrigger:
    """Forwards requests from an ``asyncio.Queue`` or an async iterable.

    An async iterable that ends ends the trigger (it is not restarted); a queue
    is read forever.
    """

    def __init__(self, source: asyncio.Queue[Request] | AsyncIterable[Request]) -> None:
        if not isinstance(source, asyncio.Queue) and not hasattr(source, "__aiter__"):
            raise ConfigError(
                f"ChannelTrigger source must be an asyncio.Queue or an async iterable, "
                f"got {source!r}"
            )
        self.source = source

    async def run(self, emit: Emit) -> None:
        if isinstance(self.source, asyncio.Queue):
            while True:
                await emit(await self.source.get())
        else:
            async for request in self.source:
                await emit(request)

    def __repr__(self) -> str:
        return f"ChannelTrigger({self.source!r})"
