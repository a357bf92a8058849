"""Closing a listener never strands a connection it accepted a moment before.

asyncio's selector loop accepts a socket in one turn and makes its transport in the next
(in a task). A ``Server.close()`` between the two made that transport's construction fail
an assertion, which asyncio swallows: the accepted socket stayed open until the garbage
collector found it ("unclosed transport", a ResourceWarning that failed a later test
about once in twenty loaded runs). ``close_listener`` lets such transports be made first,
so their protocol closes them and the peer sees the connection end.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from netdist.transport.connection import close_listener, stop_accepting


class _ClosingProtocol(asyncio.Protocol):
    """What a closing transport's connections do when made: close at once."""

    def __init__(self, made: list[asyncio.BaseTransport]) -> None:
        self._made = made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._made.append(transport)
        transport.close()


def _close_between_accept_and_transport(begin_close: Callable[[asyncio.Server], None],
                                        ) -> tuple[int, bytes]:
    """Connect, then start closing the listener in the turn after the one that accepted
    the connection, before its transport is made; return how many transports were made
    and what the client reads (``b""``: the server side closed the connection)."""
    loop = asyncio.SelectorEventLoop()  # the race is the selector loop's (uvloop accepts in C)
    made: list[asyncio.BaseTransport] = []

    async def scenario() -> bytes:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        server = await loop.create_server(lambda: _ClosingProtocol(made), sock=listener)
        # the kernel completes the handshake into the backlog: the listener is readable
        client = socket.create_connection(listener.getsockname(), timeout=10)
        try:
            # this turn runs ``queue_close`` first, then the accept (found by its poll),
            # which queues the accept task behind what ``queue_close`` queued
            loop.call_soon(lambda: loop.call_soon(begin_close, server))
            for _ in range(20):  # bounded: a few turns make, close and drop the transport
                await asyncio.sleep(0)
            await server.wait_closed()
            assert not server.is_serving()
            return await loop.run_in_executor(None, client.recv, 1)
        finally:
            client.close()

    try:
        read = loop.run_until_complete(scenario())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()
    return len(made), read


def test_a_connection_accepted_just_before_close_listener_is_closed() -> None:
    tasks: list[asyncio.Task[None]] = []

    def begin_close(server: asyncio.Server) -> None:  # what TcpTransport's close does
        stop_accepting(server)
        tasks.append(asyncio.ensure_future(close_listener(server)))

    made, read = _close_between_accept_and_transport(begin_close)
    assert made == 1 and read == b""
    assert tasks[0].done() and tasks[0].exception() is None


def test_stop_accepting_refuses_later_connections_but_keeps_the_server_open() -> None:
    loop = asyncio.SelectorEventLoop()
    made: list[asyncio.BaseTransport] = []

    async def scenario() -> None:
        server = await loop.create_server(lambda: _ClosingProtocol(made), "127.0.0.1", 0)
        stop_accepting(server)
        assert server.sockets  # still open: transports on their way can attach
        address = server.sockets[0].getsockname()
        late = socket.create_connection(address, timeout=10)  # lands in the backlog only
        try:
            for _ in range(10):
                await asyncio.sleep(0)
            assert made == []
            await close_listener(server)
            await server.wait_closed()
            assert not server.is_serving() and server.sockets == ()
        finally:
            late.close()

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
