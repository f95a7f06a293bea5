"""What a reconciler is, what it receives and what it returns.

A reconciler converges *one* entity toward its desired state. The Loop calls
it with a :class:`Request` naming the entity and schedules the next look from
what it returns:

* ``Result(requeue_after=d)`` with ``d > 0``: look again after ``d`` seconds;
* ``Result()`` or ``None``: look again at the loop's interval (unless the loop
  was built ``without_default_requeue()``);
* a raised exception: transient, retried with per-entity exponential backoff
  (a ``requeue_after`` is meaningless then: the error path wins);
* a raised :class:`PermanentError`: retrying cannot help; the entity is
  dead-lettered until a fresh trigger names it again.

Reconcilers must be idempotent and level-triggered: they may run again without
any change (periodic resync, coalesced re-runs, retries).

Configuration errors. Every configuration error the framework raises is a
:class:`ConfigError` (a :class:`ValueError`) whose message names the option and
the bad value, so a misconfigured operator fails when it is built or started
with a sentence a user can act on, never later with a confusing runtime error.
Durations are float seconds everywhere; a :class:`datetime.timedelta` is
accepted too and converted by :func:`seconds`, in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import inspect
import math
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

Duration = float | int | datetime.timedelta


class ConfigError(ValueError):
    """A configuration option has an invalid value; the message names both."""


def seconds(option: str, value: object) -> float:
    """Convert a duration option (seconds or timedelta) to float seconds, or raise."""
    if isinstance(value, datetime.timedelta):
        result = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{option} must be a number of seconds or a timedelta, got {value!r}")
    else:
        result = float(value)
    if math.isnan(result) or math.isinf(result):
        raise ConfigError(f"{option} must be a finite duration, got {value!r}")
    return result


def positive_seconds(option: str, value: object) -> float:
    """A duration that must be strictly positive."""
    result = seconds(option, value)
    if result <= 0:
        raise ConfigError(f"{option} must be > 0 seconds, got {value!r}")
    return result


RESYNC_ALL = ""
"""The entity id of a resync-all request: "re-observe every entity you own"."""


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """The entity to reconcile. ``""`` is the resync-all sentinel (see ``TickerTrigger``)."""

    entity_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """The scheduling hint a reconciler returns."""

    requeue_after: float = 0

    def __post_init__(self) -> None:
        after = seconds("Result.requeue_after", self.requeue_after)
        if after < 0:
            raise ConfigError(f"Result.requeue_after must be >= 0, got {self.requeue_after!r}")
        object.__setattr__(self, "requeue_after", after)

    @classmethod
    def after(cls, delay: Duration) -> Result:
        """``Result(requeue_after=delay)``, accepting a timedelta."""
        return cls(requeue_after=seconds("requeue_after", delay))


class PermanentError(Exception):
    """Retrying cannot help: dead-letter the entity until a fresh trigger."""


@runtime_checkable
class Reconciler(Protocol):
    """An object with one async method converging one entity."""

    async def reconcile(self, req: Request) -> Result | None:
        """Converge ``req.entity_id``; see the module docstring for the contract."""
        ...


ReconcileFn = Callable[[Request], Awaitable[object]]
ReconcilerLike = Reconciler | Callable[[Request], object]


def as_reconcile_fn(reconciler: object) -> tuple[str, ReconcileFn]:
    """Normalise what a user passes as a reconciler into ``(name, async callable)``.

    Accepted: an object with a ``reconcile`` method (async or sync), an async
    function, or a sync function (run in a worker thread so it cannot block the
    event loop; a thread cannot be interrupted, so a cancelled sync reconcile
    ends when its thread returns, and its entity is not reconciled again before).
    """
    if reconciler is None:
        raise ConfigError("reconciler is required, got None")
    target = getattr(reconciler, "reconcile", reconciler)
    if not callable(target):
        raise ConfigError(
            f"reconciler must be callable or have a reconcile() method, got {reconciler!r}"
        )
    name = _name_of(reconciler)
    _check_takes_a_request(name, target)
    if _is_async(target):
        return name, target
    sync_target = target

    async def in_thread(req: Request) -> object:
        thread = asyncio.ensure_future(asyncio.to_thread(sync_target, req))
        try:
            return await asyncio.shield(thread)
        except asyncio.CancelledError:
            # A thread cannot be interrupted: stay "in progress" until it returns, so the
            # entity is not handed to another worker while this call still runs; then
            # let the cancellation through.
            while not thread.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({thread})
            raise

    return name, in_thread


def _check_takes_a_request(name: str, target: Callable[..., object]) -> None:
    """Refuse, when it is defined, a reconciler that cannot be called with one Request.

    A kopf handler's signature (``spec, name, **kwargs``) would otherwise fail on every
    call, retried with backoff forever, instead of once where it is written.
    """
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # a builtin or extension without a signature: let the call tell
    try:
        signature.bind(Request(RESYNC_ALL))
    except TypeError as exc:
        raise ConfigError(
            f"reconciler {name!r} must accept one argument, the kr.Request, and no other "
            f"required one: its signature is {name}{signature} ({exc}). kopf's keyword "
            "arguments (spec, name, body, ...) are not passed to a reconciler: read the object "
            "with kr.cached(req) (req.entity_id is <namespace>/<name>)"
        ) from None


def _is_async(fn: Callable[..., object]) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - async __call__ of a callable object
    )


def _name_of(reconciler: object) -> str:
    name = getattr(reconciler, "__name__", None)
    if isinstance(name, str):
        return name
    return type(reconciler).__name__
