"""A loopback TCP proxy that can be cut and brought back: Redis lost and restarted without touching Redis.

The machine's Redis is shared (other gateways and tests use it), so the fleet soak and the tests cut a proxy in
front of it instead of restarting it: ``cut`` resets every open connection and stops listening (clients see
resets, then refused connections), ``start`` listens again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:target_port`` (port 0: a free one, kept across restarts)."""

    def __init__(self, target_port: int = 6379) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def up(self) -> bool:
        """Listening now."""
        return self._server is not None

    async def start(self) -> None:
        """Listen (again) on ``port``."""
        if self._server is None:
            self._server = await asyncio.start_server(
                self._handle, "127.0.0.1", self.port, reuse_address=True
            )
            self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Reset every connection and stop listening (idempotent)."""
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()
        self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        self._writers -= {writer, up_writer}
