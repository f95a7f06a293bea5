"""``async with resource:`` for objects whose only exit action is ``await close()``."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class AsyncClosing:
    """Mixin: entering returns the object, leaving awaits its ``close()``."""

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
