"""Small helpers shared by the test suites (importable as ``support``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import kopf_reconcile as kr

DEFAULT_TIMEOUT = 10.0


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = 0.01,
    message: str = "",
) -> None:
    """Poll ``condition`` until it holds; fail with ``message`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {message or condition}")
        await asyncio.sleep(interval)


def fenced_loop(
    reconcile: object,
    elector: kr.LeaderElector,
    repo: kr.FencedRepository,
    reconciler_id: str,
    renew_interval: float = 0.1,
) -> kr.Loop:
    """A Loop that leads through ``elector`` and writes through ``repo`` (requests by hand)."""
    return (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)  # type: ignore[arg-type]
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(elector)
        .with_fenced_repo(repo)
        .with_reconciler_id(reconciler_id)
        .with_renew_interval(renew_interval)
        .build()
    )
