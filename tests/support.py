"""Small helpers shared by the test suites (importable as ``support``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

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
