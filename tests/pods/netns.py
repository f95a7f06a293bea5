"""Sockets in another network namespace, and a TCP forwarder across namespaces.

A socket belongs, for its whole life, to the network namespace of the thread
that created it. :func:`socket_in_namespace` creates one in a short-lived thread
that ``setns``es into the namespace and ends, so no thread of the test process
ever stays there; :class:`Forwarder` pipes connections between the host's
loopback and an address inside (or the other way round).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

_CLONE_NEWNET = 0x40000000


def socket_in_namespace(namespace: Path, family: int = socket.AF_INET) -> socket.socket:
    """A TCP socket that lives in the network namespace at ``namespace``.

    A socket belongs to the namespace of the thread that creates it, for its whole
    life: a short-lived thread enters the namespace, creates it, and ends (taking its
    namespace with it), so the calling thread never leaves the host's.
    """
    created: list[socket.socket] = []
    failure: list[BaseException] = []

    def create() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(namespace, os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns({namespace}): {os.strerror(errno)}")
            finally:
                os.close(fd)
            created.append(socket.socket(family, socket.SOCK_STREAM))
        except BaseException as exc:  # handed to the calling thread
            failure.append(exc)

    thread = threading.Thread(target=create, name="netns-socket")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return created[0]


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        sink.close()


class Forwarder:
    """A TCP listener piping each connection to an address, across network namespaces.

    ``listen`` and ``connect`` each make a socket; either may be
    :func:`socket_in_namespace`, so the same class takes the host's loopback into the
    node (the API server) and the node's address out to the host (PostgreSQL).
    """

    def __init__(
        self,
        listen: Callable[[], socket.socket],
        listen_address: tuple[str, int],
        connect: Callable[[], socket.socket],
        connect_address: tuple[str, int] | str,
    ) -> None:
        self._listen, self._listen_address = listen, listen_address
        self._connect, self._connect_address = connect, connect_address
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        sock = self._listen()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(self._listen_address)
        sock.listen(128)
        sock.setblocking(False)
        self._server = await asyncio.start_server(self._accept, sock=sock)
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if isinstance(self._connect_address, str):
                up_reader, up_writer = await asyncio.open_unix_connection(self._connect_address)
            else:
                upstream = await asyncio.to_thread(self._connect)
                upstream.setblocking(False)
                await asyncio.get_running_loop().sock_connect(upstream, self._connect_address)
                up_reader, up_writer = await asyncio.open_connection(sock=upstream)
        except OSError:
            writer.close()
            return
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(_pipe(source, sink))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)
