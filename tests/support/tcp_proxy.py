"""A TCP proxy in front of a real server, to cut the network between a client and it.

``cut()`` resets every proxied connection and closes the listening socket, so the client sees
its open connections fail and new ones refused at once: the server looks unreachable, as after
a crash or a firewall REJECT. ``resume()`` listens again on the same port.

Built on asyncio Protocols: each chunk read (up to the transport's read size, 256 KiB) is
handed to the other side's transport as is, and flow control pauses reading on one side while
the other side's write buffer is full, so memory stays bounded for a slow reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from types import TracebackType
from typing import Protocol, Self, cast

# SO_LINGER on with a zero timeout: close() sends RST instead of FIN, an abortive close.
_LINGER_RESET = struct.pack("ii", 1, 0)


def _reset(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    transport.abort()


class Tap(Protocol):
    """Reads one proxied connection's bytes, each way, and says which of them go on: what
    it returns is forwarded, in place of what was read (the rest held, or dropped)."""

    def from_client(self, data: bytes) -> bytes: ...

    def from_server(self, data: bytes) -> bytes: ...


class _Half(asyncio.Protocol):
    """One socket of a proxied connection; forwards what it reads to the other half."""

    def __init__(self, connection: _Connection, *, upstream: bool) -> None:
        self.connection = connection
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.closed = False
        # Read before the other side's socket existed; held until it does.
        self.early: list[bytes] = []

    @property
    def peer(self) -> _Half | None:
        return self.connection.client if self.upstream else self.connection.upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        if self.upstream:
            self.connection.upstream = self
            client = self.connection.client
            if client.closed or client.transport is None:
                self.transport.close()
            else:
                if client.early:
                    self.transport.write(b"".join(client.early))
                    client.early.clear()
                client.transport.resume_reading()
        else:
            self.connection.proxy._accepted(self.connection)

    def data_received(self, data: bytes) -> None:
        proxy = self.connection.proxy
        if self.upstream and self.connection.client_forgotten:
            # The client's host no longer knows the connection: it answers with a reset.
            if self.transport is not None:
                _reset(self.transport)
            return
        if proxy.swallowing:
            return  # black-holed: the connection stays open and carries nothing
        if not self.upstream and proxy.from_client is not None and not proxy.from_client(data):
            return  # dropped by the test's filter
        if self.upstream and proxy.from_server is not None and not proxy.from_server(data):
            return  # dropped by the test's filter
        tap = self.connection.tap
        if tap is not None:
            data = tap.from_server(data) if self.upstream else tap.from_client(data)
            if not data:
                return  # held by the tap (a message not whole yet), or cut there
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        elif self.transport is not None:
            # uvloop starts reading after connection_made returns, undoing a pause made there.
            self.early.append(data)
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        # Half-close is not forwarded: returning None closes this side, and connection_lost
        # then closes the peer after flushing it. PostgreSQL and MQTT never half-close.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        peer = self.peer
        if self.connection.client_forgotten and not self.upstream:
            peer = None  # the server is told nothing
        if peer is not None and peer.transport is not None:
            peer.transport.close()
        self.connection.check_done()

    def pause_writing(self) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.pause_reading()

    def resume_writing(self) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.resume_reading()


class _Connection:
    """A client socket, the upstream socket opened for it, and the task opening it."""

    def __init__(self, proxy: TcpProxy) -> None:
        self.proxy = proxy
        self.client = _Half(self, upstream=False)
        self.upstream: _Half | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.tap = None if proxy.tap is None else proxy.tap()
        # reset_clients(): the client's side is gone, the server not told (see there).
        self.client_forgotten = False

    async def connect_upstream(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.proxy.target_unix is not None:
                await loop.create_unix_connection(
                    lambda: _Half(self, upstream=True), self.proxy.target_unix
                )
            else:
                await loop.create_connection(
                    lambda: _Half(self, upstream=True),
                    self.proxy.target_host,
                    self.proxy.target_port,
                )
        except OSError:
            # The client sees the same refusal the target gave us.
            if self.client.transport is not None:
                _reset(self.client.transport)

    def abort(self) -> None:
        if self.connecting is not None:
            self.connecting.cancel()
        for half in (self.client, self.upstream):
            if half is not None and half.transport is not None and not half.closed:
                _reset(half.transport)

    def check_done(self) -> None:
        if self.done.done() or not self.client.closed:
            return
        if self.connecting is not None and not self.connecting.done():
            # Still inside create_connection: the task's done callback checks again.
            self.connecting.cancel()
            return
        if self.upstream is not None and not self.upstream.closed:
            return
        self.done.set_result(None)
        self.proxy._connections.discard(self)


class TcpProxy:
    """Forward ``listen_host:port`` to ``target_host:target_port``, with a cut switch."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        target_unix: str | None = None,
    ) -> None:
        # target_unix: forward to a unix socket instead (the embedded PostgreSQL's).
        self.target_unix = target_unix
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = listen_host
        self.port: int = listen_port
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self.swallowing = False
        # Called with each chunk a client sends (as read: a packet may span chunks, or a chunk
        # hold several); False drops the chunk instead of forwarding it.
        self.from_client: Callable[[bytes], bool] | None = None
        # The same for each chunk the server sends to a client (a PUBACK that never arrives).
        self.from_server: Callable[[bytes], bool] | None = None
        # Makes a Tap for each new connection, which reads its bytes whole, after the filters.
        self.tap: Callable[[], Tap] | None = None
        # While refusing, a new connection is accepted and reset at once (counted in
        # ``refused``): the server is away, and the test sees its clients try to reach it.
        self.refusing = False
        self.refused = 0

    @property
    def connections(self) -> int:
        """Proxied connections currently open (accepted and not yet fully closed)."""
        return len(self._connections)

    @property
    def listening(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        """Listen and forward. The first start picks the port when ``listen_port`` was 0."""
        if self._server is not None:
            return
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._new_client_half,
            self.listen_host,
            self.port,
            # Rebinding the port of a cut proxy must not wait for TIME_WAIT to expire.
            reuse_address=True,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def resume(self) -> None:
        """Listen again on the same port after cut()."""
        await self.start()

    async def cut(self) -> None:
        """Stop listening (new connections are refused) and reset every open connection.

        Returns once every proxied connection is fully closed.
        """
        server, self._server = self._server, None
        if server is not None:
            server.close()
        connections = list(self._connections)
        for connection in connections:
            connection.abort()
        await asyncio.gather(*(connection.done for connection in connections))
        if server is not None:
            await server.wait_closed()

    def reset_all(self) -> None:
        """Reset every open connection now, from a callback (the listening socket stays)."""
        for connection in list(self._connections):
            connection.abort()

    def reset_clients(self) -> None:
        """Reset every proxied client's socket and tell the servers nothing: their sockets stay
        open and quiet (no FIN, no reset) until a server sends, which is answered with a reset,
        as the client's host does for a connection it no longer knows (it rebooted, or lost
        power: nothing was sent). A server looking at its socket between sends sees nothing."""
        for connection in list(self._connections):
            connection.client_forgotten = True
            half = connection.client
            if half.transport is not None and not half.closed:
                _reset(half.transport)

    def to_clients(self, data: bytes) -> int:
        """Write ``data`` to every proxied client as if its server had sent it (after what
        was forwarded before): a server that sends something again. Returns how many."""
        written = 0
        for connection in self._connections:
            half = connection.client
            if half.transport is not None and not half.closed:
                half.transport.write(data)
                written += 1
        return written

    def black_hole(self) -> None:
        """Keep every connection open but forward nothing, either way: a peer notices only
        by its own timeouts (a link that died without a FIN or a reset)."""
        self.swallowing = True

    async def stop(self) -> None:
        await self.cut()

    def _new_client_half(self) -> _Half:
        return _Connection(self).client

    def _accepted(self, connection: _Connection) -> None:
        transport = connection.client.transport
        assert transport is not None
        if self._server is None:
            # Accepted just before cut() closed the listening socket.
            _reset(transport)
            return
        if self.refusing:
            self.refused += 1
            _reset(transport)
            return
        self._connections.add(connection)
        # Nothing is read from the client until the upstream socket exists to write it to.
        transport.pause_reading()
        connection.connecting = asyncio.get_running_loop().create_task(
            connection.connect_upstream(), name=f"tcp_proxy_connect_{self.port}"
        )
        connection.connecting.add_done_callback(lambda _: connection.check_done())

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
