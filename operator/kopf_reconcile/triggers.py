"""Sources of reconcile work.

A :class:`Trigger` runs until cancelled and hands requests to the Loop with
``await emit(request)``. ``emit`` is a callable returning an awaitable (a Loop's is
not a coroutine function), and a trigger must await what it returns: when the
loop's intake has room, the request is taken when ``emit`` is called and the
awaitable is already done; when it is full, the request is taken once the awaitable
completes (backpressure: it blocks until there is room, and never drops a request).
Calling ``emit`` without awaiting the result may therefore lose that request.
Deduplication, delays and backoff live in the Loop, not in triggers. The Loop owns
the trigger tasks: it starts each under :func:`supervise`, which restarts one that crashes (with
backoff), and cancels them on stop, so a trigger cannot leak a task.

Lanes. The ``emit`` a Loop hands its triggers is an :class:`Emitter`: besides
``await emit(request)`` (fresh work: something changed) it offers
``await emit.resync(request)`` for a re-observation of an entity nothing is known
to have changed (a resync-all's fan-out). Resync requests wait in a lane of their
own, behind fresh ones but never starved by them. :func:`resync_emit` picks
``emit.resync`` when the ``emit`` given has it, and ``emit`` itself otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Protocol, runtime_checkable

from kopf_reconcile.api import RESYNC_ALL, ConfigError, Duration, Request, positive_seconds

# Call it, then await what it returns (see the module docstring).
Emit = Callable[[Request], Awaitable[None]]


class Emitter:
    """A Loop's ``emit``: call it for fresh work, ``.resync`` for re-observations."""

    __slots__ = ("_fresh", "resync")

    def __init__(self, fresh: Emit, resync: Emit) -> None:
        self._fresh = fresh
        self.resync = resync

    def __call__(self, request: Request) -> Awaitable[None]:
        return self._fresh(request)


def resync_emit(emit: Emit) -> Emit:
    """The low-priority (resync lane) variant of ``emit``, or ``emit`` when it has none."""
    resync: Emit = emit.resync if isinstance(emit, Emitter) else emit
    return resync


# Supervision reports as part of the Loop that owns the trigger.
logger = logging.getLogger("kopf_reconcile.loop")

TRIGGER_RESTART_MIN = 0.1  # the first restart of a crashed trigger waits this long
TRIGGER_RESTART_MAX = 30.0  # ... doubling up to this; a run that lasted longer resets it


@runtime_checkable
class Trigger(Protocol):
    """A producer of requests; runs until cancelled."""

    async def run(self, emit: Emit) -> None:
        """Emit requests until cancelled (returning means the source is exhausted).

        ``await emit(request)`` for each: ``emit`` returns an awaitable that must be
        awaited (done at once when the intake has room, else once it has).
        """
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


async def supervise(trigger: Trigger, emit: Emit, *, controller: str) -> None:
    """Run ``trigger`` until it is exhausted or cancelled; restart it after a crash.

    Restarts back off from :data:`TRIGGER_RESTART_MIN` doubling to
    :data:`TRIGGER_RESTART_MAX`; a run that lasted longer than that starts the
    backoff over. ``controller`` names the owning Loop in the logs.
    """
    clock = asyncio.get_running_loop().time
    delay = TRIGGER_RESTART_MIN
    while True:
        started = clock()
        try:
            await trigger.run(emit)
        except Exception:
            logger.exception(
                "trigger %r of %s crashed; restarting in %.1fs",
                trigger,
                controller,
                delay,
                extra={"controller": controller},
            )
        else:
            logger.info("trigger %r of %s is exhausted", trigger, controller)
            return
        if clock() - started > TRIGGER_RESTART_MAX:
            delay = TRIGGER_RESTART_MIN
        await asyncio.sleep(delay)
        delay = min(delay * 2, TRIGGER_RESTART_MAX)
