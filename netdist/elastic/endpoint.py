"""The membership endpoint: an authenticated request/reply service every member runs.

Every process of an elastic job listens on its own endpoint (``NETDIST_ELASTIC_PORT``).
Survivors of a failure and joiners send one request to the member that leads the next
agreement (``netdist.elastic.agreement``) and wait for its one reply: the new membership,
or a redirect, a "retry", a refusal. The connection carries netdist's HMAC handshake
(role ``"elastic"``, the slot as the rank), so a process without the job token is
refused before any request is read, and strangers are bounded by ``AdmissionControl``
exactly as on a rank's peer listener.

Frames are control frames whose headers are msgpack maps::

    client -> endpoint   HELLO {op: "join", kind, slot, epoch, members, lost, step, endpoint}
    endpoint -> client   OK    {op: "epoch", epoch, slots, endpoints, coordinator}
                   or    OK    {op: "redirect", endpoint}
                   or    ERROR {code: "retry" | "stale" | "stale_leader" | "no_quorum", reason}
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from netdist.config import AdmissionLimits, WireLimits
from netdist.errors import AuthenticationError, NetdistError
from netdist.transport.admission import AdmissionControl, Release
from netdist.transport.connection import (
    FrameConnection,
    close_listener,
    listen,
    open_connection,
    run_handshake,
    stop_accepting,
)
from netdist.transport.os_errors import Stage, map_os_errors
from netdist.wire import (
    ClientHandshake,
    ControlFrame,
    FrameKind,
    HandshakeIdentity,
    ServerHandshake,
    encode_control,
)

from netdist.elastic.membership import format_endpoint, parse_endpoint

__all__ = ["SLOT_LIMIT", "EndpointIdentity", "EndpointServer", "Reply", "ask"]

logger = logging.getLogger("netdist.elastic")

SLOT_LIMIT = 1 << 16
"""Slots are numbered below this (the handshake's "world size" for endpoint connections)."""

_LIMITS = WireLimits(max_header_bytes=1 << 20, max_payload_bytes=0)
"""Endpoint frames carry only headers; a membership of thousands fits in 1 MiB."""


@dataclass(frozen=True, slots=True)
class EndpointIdentity:
    """What the endpoint handshake proves: the job, its token and the slot."""

    job_id: str
    token: str | None
    slot: int
    insecure: bool = False

    def handshake(self, role: str = "rank") -> HandshakeIdentity:
        """The HMAC handshake identity: role ``elastic`` for the endpoint, ``rank`` for
        a member asking it."""
        return HandshakeIdentity(f"{self.job_id}/elastic", self.slot, SLOT_LIMIT, self.token,
                                 role=role)


@dataclass(frozen=True, slots=True)
class Reply:
    """One answer to a request: a frame kind (OK or ERROR) and its fields."""

    kind: FrameKind
    fields: dict[str, Any]

    @property
    def code(self) -> str | None:
        """The ERROR code (None for OK)."""
        return None if self.kind == FrameKind.OK else str(self.fields.get("code"))


Handler = Callable[[int, dict[str, Any]], Coroutine[Any, Any, Reply]]
"""Answers the request of ``slot`` (fields of its HELLO)."""


class EndpointServer:
    """This process's endpoint; ``await EndpointServer.start(...)``, then ``aclose()``."""

    def __init__(self, identity: EndpointIdentity, handler: Handler,
                 admission: AdmissionLimits, handshake_timeout: float) -> None:
        self.identity = identity
        self._handler = handler
        self._handshake_timeout = handshake_timeout
        self._admission = AdmissionControl(admission, owner=f"slot {identity.slot}'s "
                                           "elastic endpoint", expected=8)
        self._loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: set[FrameConnection] = set()
        self._gone: dict[FrameConnection, asyncio.Future[None]] = {}
        self.address: str = ""

    @classmethod
    async def start(cls, identity: EndpointIdentity, host: str, port: int, handler: Handler,
                    *, admission: AdmissionLimits | None = None,
                    handshake_timeout: float = 5.0) -> EndpointServer:
        """Bind ``host:port`` and serve requests with ``handler``."""
        self = cls(identity, handler, admission or AdmissionLimits(), handshake_timeout)
        self._server, bound = await listen(
            host, port, self._admission.protocol_factory(self._new_connection),
            token=identity.token, insecure=identity.insecure,
            what=f"the elastic endpoint of slot {identity.slot} at {host}:{port}",
            fallback_to_all=True)
        self.address = format_endpoint(host, bound[1])
        return self

    def _new_connection(self, release: Release) -> FrameConnection:
        return FrameConnection(_LIMITS, label="?", on_made=self._on_made,
                               on_failed=self._on_failed, release=release)

    def _on_failed(self, conn: FrameConnection) -> None:
        gone = self._gone.get(conn)
        if gone is not None and not gone.done():
            gone.set_result(None)

    def _on_made(self, conn: FrameConnection) -> None:
        if self._server is None and self.address:
            conn.close(send_bye=False)
            return
        self._conns.add(conn)
        task = self._loop.create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: FrameConnection) -> None:
        where = conn.peername()
        try:
            with map_os_errors(f"elastic endpoint serving {where}", where, Stage.STREAM):
                step = await run_handshake(
                    conn, ServerHandshake(self.identity.handshake("elastic"), peer_label=where),
                    deadline=self._loop.time() + self._handshake_timeout,
                    what=f"elastic endpoint handshake with {where}")
                slot = step.peer_rank
                conn.label = f"slot {slot} at {where}"
                frame = await conn.next_control(self._loop.time() + self._handshake_timeout,
                                                f"request from slot {slot}")
                if frame.kind != FrameKind.HELLO or frame.fields.get("op") != "join":
                    raise NetdistError(f"expected a join request, got {frame.kind.name}")
                # the answer may take an agreement's time; a requester that goes away
                # meanwhile (killed while agreeing) is withdrawn from the agreement
                gone = self._gone[conn] = self._loop.create_future()
                if conn.failed:
                    gone.set_result(None)
                answer: asyncio.Task[Reply] = self._loop.create_task(self._handler(slot, dict(frame.fields)))
                await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not answer.done():
                    answer.cancel()
                    await asyncio.gather(answer, return_exceptions=True)
                    raise NetdistError(f"slot {slot} went away before the answer")
                reply = answer.result()
                conn.write_control(encode_control(reply.kind, reply.fields, limits=_LIMITS))
                conn.close(send_bye=False, reason="answered")
                await conn.wait_closed(1.0)
        except NetdistError as exc:
            if isinstance(exc, AuthenticationError) or not conn.authenticated:
                self._admission.log.warning("netdist elastic: dropped connection from %s: %s",
                                            where, exc)
            else:
                logger.info("netdist elastic: request from %s ended: %s", conn.label, exc)
            conn.close(send_bye=False, reason=f"dropped: {exc}")
        except asyncio.CancelledError:
            conn.close(send_bye=False)
            raise
        finally:
            self._conns.discard(conn)
            self._gone.pop(conn, None)

    async def aclose(self) -> None:
        """Stop serving; idempotent."""
        server, self._server = self._server, None
        if server is not None:
            stop_accepting(server)
        for conn in list(self._conns):
            conn.close(send_bye=False, reason="endpoint closed")
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if server is not None:
            await close_listener(server)


async def ask(endpoint: str, identity: EndpointIdentity, fields: dict[str, Any], *,
              handshake_timeout: float, reply_timeout: float) -> Reply:
    """Send one request to ``endpoint`` and wait for its reply.

    The connection and handshake must complete within ``handshake_timeout`` (a member
    that is stopped or partitioned away is skipped quickly); the reply may take up to
    ``reply_timeout`` (the leader answers once the agreement is complete). Raises
    ``ConnectError`` (refused, unreachable, dropped), ``AuthenticationError`` or
    ``NetdistTimeoutError``.
    """
    loop = asyncio.get_running_loop()
    host, port = parse_endpoint(endpoint)
    started = loop.time()
    conn = await open_connection(
        host, port, lambda: FrameConnection(_LIMITS, label=f"endpoint {endpoint}"),
        deadline=started + handshake_timeout, retry=False,
        what=f"slot {identity.slot} reaching the elastic endpoint {endpoint}")
    try:
        with map_os_errors(f"request to {endpoint}", endpoint, Stage.STREAM):
            handshake = ClientHandshake(identity.handshake(), expect_role="elastic",
                                        peer_label=endpoint)
            await run_handshake(conn, handshake, deadline=started + handshake_timeout,
                                what=f"handshake with the elastic endpoint {endpoint}",
                                first=handshake.initiate())
            conn.write_control(encode_control(FrameKind.HELLO, {"op": "join", **fields},
                                              limits=_LIMITS))
            frame: ControlFrame = await conn.next_control(
                loop.time() + reply_timeout, f"the answer of the elastic endpoint {endpoint}")
            return Reply(frame.kind, dict(frame.fields))
    finally:
        conn.close(send_bye=False, reason="request done")
        await conn.wait_closed(1.0)
