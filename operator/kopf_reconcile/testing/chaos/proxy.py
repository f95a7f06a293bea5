"""A TCP proxy on 127.0.0.1 that can partition one replica from the Kubernetes API.

Each replica's kubeconfig points at its own :class:`PartitionProxy`, which
forwards bytes to the API server. :meth:`PartitionProxy.partition` cuts it off
while the replica keeps reaching PostgreSQL (a Unix socket, not proxied):

``refuse``
    every open connection is reset and new ones are reset at once, as when
    the API server's address is unreachable and the host answers with RST;
``blackhole``
    packets vanish: open connections stop carrying bytes in either direction
    and new connections are accepted but never answered, so the replica's
    requests hang until its own deadlines fire.

:meth:`PartitionProxy.heal` resets whatever the partition left hanging (as TCP
would after its retransmission timeouts) and forwards new connections again.
:meth:`PartitionProxy.reset` resets every connection (the real API server has
no admin API to cut watches), and :attr:`PartitionProxy.delay` holds every
chunk before forwarding it (a slow link).
"""

from __future__ import annotations

import asyncio
import contextlib


class PartitionProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode = "open"  # open | refuse | blackhole
        self.delay = 0.0  # seconds every chunk is held before it is forwarded (a slow link)
        self._healed = asyncio.Event()
        self._healed.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def partition(self, mode: str) -> None:
        if mode not in ("refuse", "blackhole"):
            raise ValueError(f"partition mode must be refuse or blackhole, got {mode!r}")
        self.mode = mode
        self._healed.clear()
        if mode == "refuse":
            self._reset_all()

    def heal(self) -> None:
        self.mode = "open"
        self._reset_all()
        self._healed.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._reset_all()
        self._healed.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def reset(self) -> int:
        """Reset every open connection (cutting watches too); how many there were."""
        count = len(self._writers)
        self._reset_all()
        return count // 2  # each proxied connection has two ends

    def _reset_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._tasks.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "refuse":
            writer.transport.abort()
            return
        self._writers.add(writer)
        if self.mode == "blackhole":
            await self._healed.wait()  # heal() resets this connection
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        try:
            await asyncio.gather(
                self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True
            )
        finally:
            for end in (writer, up_writer):
                end.transport.abort()
                self._writers.discard(end)

    async def _pump(self, source: asyncio.StreamReader, target: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await source.read(65536)
                if not data:
                    break
                if not self._healed.is_set():
                    await self._healed.wait()  # blackholed: held, then reset on heal
                    break
                if self.delay:
                    await asyncio.sleep(self.delay)
                target.write(data)
                await target.drain()
        finally:
            target.transport.abort()
