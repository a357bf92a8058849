"""``MetricsServer``: one rank's ``GET /metrics`` (Prometheus text), on its transport's loop.

A minimal HTTP/1.1 server (``asyncio.start_server``, no dependency) that answers
``GET /metrics`` (and ``HEAD``) with ``format_prometheus(counters(transport))``, read on
the loop the transport lives on, so the counts are consistent. Anything else is refused
with a status and nothing more: another path 404, another method 405, a malformed request
400, a request head over ``MAX_REQUEST_BYTES`` 431. Each connection carries one request
and is closed after the answer (``Connection: close``); a client gets ``READ_SECONDS`` to
send its request and ``WRITE_SECONDS`` to take the answer, and at most ``MAX_CLIENTS``
are served at once (more are closed at once), so a slow or idle client cannot hold the
rank's loop or its memory.

Off by default: ``start_metrics_from_env(transport)`` starts one only when
``NETDIST_METRICS_PORT`` is set (``netdist.trace.prometheus.MetricsSettings``), binding
``NETDIST_METRICS_HOST`` (default ``127.0.0.1``), and logs the address it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from netdist.trace.counters import counters
from netdist.trace.prometheus import CONTENT_TYPE, MetricsSettings, format_prometheus
from netdist.transport.base import Transport

__all__ = ["MetricsServer", "start_metrics_server", "start_metrics_from_env",
           "MAX_REQUEST_BYTES", "READ_SECONDS", "WRITE_SECONDS", "MAX_CLIENTS"]

logger = logging.getLogger("netdist.trace")

MAX_REQUEST_BYTES = 8192
"""Longest request head (request line and headers) read; a longer one is answered 431."""
READ_SECONDS = 5.0
"""Time a client has to send its whole request head."""
WRITE_SECONDS = 5.0
"""Time a client has to take the answer."""
MAX_CLIENTS = 16
"""Connections served at once; one more is closed without an answer."""
LINGER_BYTES = 1 << 20
LINGER_SECONDS = 1.0
"""After refusing a request it did not read whole, the server reads and drops up to this
many more bytes for up to this long before closing, so the client sees the answer rather
than a reset connection."""
_CLOSE_SECONDS = 2.0

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 431: "Request Header Fields Too Large",
            500: "Internal Server Error"}


class MetricsServer:
    """A running ``/metrics`` endpoint of one transport; ``start_metrics_server`` makes it."""

    def __init__(self, transport: Transport) -> None:
        """Use ``start_metrics_server``; this only sets up, binding nothing."""
        self.transport = transport
        self.address: tuple[str, int] = ("", 0)
        """``(host, port)`` it is bound to (the real port when asked for 0)."""
        self.requests = 0
        """Requests answered (any status)."""
        self._server: asyncio.AbstractServer | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._closed = False

    async def _bind(self, host: str, port: int) -> None:
        self._server = server = await asyncio.start_server(
            self._serve, host, port, limit=MAX_REQUEST_BYTES)
        sockets = getattr(server, "sockets", None) or ()
        bound = sockets[0].getsockname() if sockets else (host, port)
        self.address = (str(bound[0]), int(bound[1]))

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = self.address[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{self.address[1]}/metrics"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._closed or task is None or len(self._clients) >= MAX_CLIENTS:
            writer.close()
            return
        self._clients.add(task)
        try:
            status, body, head_only = await self._answer(reader)
            self.requests += 1
            await self._write(writer, status, body, head_only)
            if status in (400, 431):
                await _discard_rest(reader, writer)
        except (OSError, asyncio.TimeoutError, ConnectionError):
            pass  # the client went away or would not read: nothing to tell it
        except asyncio.CancelledError:
            pass  # aclose() dropped this connection: the handler just ends
        finally:
            self._clients.discard(task)
            writer.close()
            with contextlib.suppress(OSError, asyncio.TimeoutError, ConnectionError):
                async with asyncio.timeout(_CLOSE_SECONDS):
                    await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
        """The status and body for the request ``reader`` holds, and whether only the
        head goes back (``HEAD``)."""
        try:
            async with asyncio.timeout(READ_SECONDS):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return 431, b"request too large\n", False
        except asyncio.IncompleteReadError as exc:
            if len(exc.partial) >= MAX_REQUEST_BYTES:
                return 431, b"request too large\n", False
            return 400, b"incomplete request\n", False
        except asyncio.TimeoutError:
            return 408, b"request not received in time\n", False
        request_line = head.split(b"\r\n", 1)[0]
        parts = request_line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return 400, b"bad request line\n", False
        method, target = parts[0], parts[1]
        path = target.split(b"?", 1)[0]
        if path != b"/metrics":
            return 404, b"not found: try /metrics\n", False
        if method not in (b"GET", b"HEAD"):
            return 405, b"only GET /metrics\n", False
        try:
            text = format_prometheus(counters(self.transport))
        except Exception:  # a bug here must not take the rank down: say so, log it
            logger.exception("netdist: rank %d could not format its metrics",
                             self.transport.rank)
            return 500, b"metrics unavailable\n", False
        return 200, text.encode("utf-8"), method == b"HEAD"

    async def _write(self, writer: asyncio.StreamWriter, status: int, body: bytes,
                     head_only: bool) -> None:
        content_type = CONTENT_TYPE if status == 200 else "text/plain; charset=utf-8"
        head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                + ("Allow: GET, HEAD\r\n" if status == 405 else "")
                + "Connection: close\r\n\r\n").encode("ascii")
        writer.write(head if head_only else head + body)
        async with asyncio.timeout(WRITE_SECONDS):
            await writer.drain()

    def close(self) -> None:
        """Stop accepting and drop every connection now (``aclose`` waits for it)."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        for task in list(self._clients):
            task.cancel()

    async def aclose(self) -> None:
        """Stop serving: no new connection, open ones dropped; bounded. Idempotent."""
        self.close()
        clients = list(self._clients)
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(_CLOSE_SECONDS):
                await asyncio.gather(*clients, return_exceptions=True)
                if self._server is not None:
                    await self._server.wait_closed()

    def __repr__(self) -> str:
        return f"<MetricsServer rank {self.transport.rank} {self.url}>"


async def start_metrics_server(transport: Transport, host: str = "127.0.0.1",
                               port: int = 0) -> MetricsServer:
    """Serve ``transport``'s counters at ``http://host:port/metrics``; call it on the
    transport's event loop. ``port`` 0 binds any free port (``.address`` tells which).
    ``OSError`` if the address cannot be bound."""
    metrics = MetricsServer(transport)
    await metrics._bind(host, port)
    return metrics


async def start_metrics_from_env(transport: Transport,
                                 env: Mapping[str, str] | None = None) -> MetricsServer | None:
    """Start ``transport``'s metrics server if ``NETDIST_METRICS_PORT`` asks for one (see
    ``MetricsSettings``), logging its address; ``None`` when it is off. A bad value is a
    ``ConfigError`` naming the variable; an address that cannot be bound (in use) is
    logged as a warning and the rank goes on without metrics: telemetry never stops a
    job."""
    settings = MetricsSettings.from_env(env)
    if settings.port is None:
        return None
    port = settings.port_for(_local_index(transport))
    try:
        server = await start_metrics_server(transport, settings.host, port)
    except (OSError, OverflowError) as exc:
        logger.warning("netdist: rank %d could not serve metrics on %s:%d: %s",
                       transport.rank, settings.host, port, exc)
        return None
    logger.info("netdist: rank %d serves metrics at %s", transport.rank, server.url)
    return server


async def _discard_rest(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After refusing a request not read to its end: say we are done writing, then read
    and drop what the client still sends (bounded), so closing does not reset the
    connection before the client has read the answer."""
    if writer.can_write_eof():
        writer.write_eof()
    left = LINGER_BYTES
    with contextlib.suppress(asyncio.TimeoutError):
        async with asyncio.timeout(LINGER_SECONDS):
            while left > 0:
                chunk = await reader.read(min(left, 65536))
                if not chunk:
                    break
                left -= len(chunk)


def _local_index(transport: Transport) -> int:
    """How many lower ranks share this rank's host (0 when host keys are unknown)."""
    keys = transport.host_keys()
    if keys is None or len(keys) <= transport.rank:
        return 0
    mine = keys[transport.rank]
    return sum(1 for key in keys[:transport.rank] if key == mine)
