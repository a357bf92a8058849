"""One TCP connection speaking netdist frames: framing, flow control, failure.

``FrameConnection`` is an ``asyncio.BufferedProtocol`` whose ``get_buffer`` and
``buffer_updated`` delegate to ``netdist.wire.FrameDecoder``. While a data frame's payload
is arriving, the buffer handed to the event loop is the destination array itself (the
``out=`` of a posted ``recv``, or the array an unexpected message will be kept in), so the
kernel copies payload bytes straight into place: zero-copy receive.

Sending writes the frame's prefix and header, then the array's own memory, and returns
only once the event loop no longer references that memory (its write buffer has drained).
uvloop keeps references to written buffers; asyncio's selector loop copies what it cannot
send at once. Waiting for the drain is correct for both, and on the standard loop the
payload goes out in chunks so little of it is ever copied.

Every failure (EOF, reset, protocol violation, missed heartbeats, an interrupted frame)
goes through ``fail()`` exactly once: it records a factory for the error every later
operation raises, fails the frame that was landing, the peer's mailbox and every waiting
sender, and closes the socket. Nothing here raises an OS or asyncio exception to callers:
``netdist.transport.os_errors`` names each one (``lost_reason``, ``transport_error``).
A peer's last frame may be an ERROR naming the rank that went away first (it aborted
because it lost that one, see ``netdist.transport.blame``); the ``PeerLostError`` then
carries that rank as ``origin_rank`` and its message leads with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

from netdist.config import AdmissionLimits, WireLimits
from netdist.errors import (
    ConfigError,
    ConnectError,
    NetdistTimeoutError,
    PeerLostError,
    RemoteProtocolError,
)
from netdist.transport.blame import LossOrigin, read_farewell
from netdist.transport.link_stats import (
    LinkWatch,
    TcpStats,
    cap_retransmit_backoff,
    tcp_stats,
    unsent_bytes,
)
from netdist.transport.mailbox import Landing, PeerMailbox
from netdist.transport.os_errors import (
    OsErrorKind,
    Stage,
    kind_of,
    lost_reason,
    transport_error,
)
from netdist.transport.traffic import TrafficCounter
from netdist.wire import (
    NEED_DATA,
    ControlFrame,
    DataEnd,
    DataStart,
    DataHeader,
    FrameDecoder,
    FrameKind,
    encode_control,
)

__all__ = [
    "FrameConnection",
    "ErrorFactory",
    "SOCKET_BUFFER_BYTES",
    "HANDSHAKE_SCRATCH_BYTES",
    "SCRATCH_BYTES",
    "handshake_limits",
    "tune_socket",
    "send_buffer_request",
    "read_sysctl",
    "is_loopback_host",
    "check_listen_security",
    "start_listener",
    "listen",
    "open_connection",
    "retry_pause",
    "RETRY_FIRST_PAUSE",
    "run_handshake",
]

logger = logging.getLogger("netdist.transport")

ErrorFactory = Callable[[], Exception]
"""Builds a fresh exception per waiter (an exception instance must not be raised twice)."""

SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
"""SO_SNDBUF requested for a peer socket when that gives more than the kernel's send
autotuning would (``send_buffer_request``); the kernel grants twice the request, capped
at twice ``net.core.wmem_max``. SO_RCVBUF is never set: setting it fixes the receive
buffer at twice ``min(request, net.core.rmem_max)`` and turns off receive autotuning,
which can grow it to ``net.ipv4.tcp_rmem[2]``. A connection moves at most one window per
round trip, so over a long link the buffers bound the rate: ``benchmarks/link_fill.py``
measured netdist's former fixed 4 MiB receive buffer (5.7 MiB advertised window) at
half the link at twice that bandwidth-delay product, and at 10-25% of it on a host with
the kernel's default ``rmem_max`` (212992); see docs/multihost.md, "Keeping the link
full"."""

_WMEM_MAX = "/proc/sys/net/core/wmem_max"
_TCP_WMEM = "/proc/sys/net/ipv4/tcp_wmem"

SMALL_FRAME_BYTES = 64 * 1024
"""Frames up to this payload size are joined into one ``bytes`` object: one syscall, and
the caller's memory is released at once (latency path)."""

SMALL_BACKLOG_BYTES = 4 * 1024 * 1024
"""A small send waits for the write buffer to drain only when more than this is queued."""

DEFER_CLAIM_BYTES = 256 * 1024
"""A data frame at least this large with no receive posted waits one loop turn for one."""

COPYING_LOOP_CHUNK_BYTES = 256 * 1024
"""On loops that copy unsent data (asyncio's selector loop), the payload is written in
chunks of this size, each once the previous one has drained, so almost nothing is copied."""


HANDSHAKE_SCRATCH_BYTES = 1024
"""Read buffer of a connection until it authenticates (grows, up to the handshake header
limit, only for a header that passed its length check): a stranger costs about this much."""

SCRATCH_BYTES = 256 * 1024
"""Read buffer for prefixes and headers once the peer has authenticated."""

ACKED_CLOSE_GRACE = 2.0
"""Seconds a clean close still waits for a peer's goodbye once the peer's kernel has
acknowledged every byte (they are safe there; the peer reads them when it can)."""

_QUICK_CLOSE_SECONDS = 1.0
_DRAIN_FIRST_POLL = 0.005
_DRAIN_MAX_POLL = 0.25

_DEFAULT_ADMISSION = AdmissionLimits()

_NOT_STARTED = -1
_DONE = -2


def handshake_limits(limits: WireLimits, header_bytes: int) -> WireLimits:
    """``limits`` with headers capped at ``header_bytes``: what a peer that has not
    authenticated yet may send (handshake frames are far smaller than the job's limit)."""
    if limits.max_header_bytes <= header_bytes:
        return limits
    return dataclasses.replace(limits, max_header_bytes=header_bytes)


def read_sysctl(path: str) -> int | None:
    """The last number in the sysctl file ``path`` (``tcp_wmem``'s maximum), or None where
    it cannot be read (not Linux)."""
    try:
        with open(path, encoding="ascii") as handle:
            return int(handle.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def send_buffer_request(wmem_max: int | None, tcp_wmem_max: int | None) -> int | None:
    """The SO_SNDBUF to ask for, or None to leave the send buffer to autotuning.

    An explicit request gets ``2 * min(SOCKET_BUFFER_BYTES, wmem_max)`` and stops the
    buffer growing; autotuning grows it up to ``tcp_wmem_max`` (``net.ipv4.tcp_wmem[2]``)
    as the window needs. Ask only where the request gets more; with either sysctl
    unknown (not Linux), ask, as netdist always did.
    """
    if wmem_max is None or tcp_wmem_max is None:
        return SOCKET_BUFFER_BYTES
    granted = 2 * min(SOCKET_BUFFER_BYTES, wmem_max)
    return SOCKET_BUFFER_BYTES if granted > tcp_wmem_max else None


def tune_socket(sock: socket.socket) -> None:
    """TCP_NODELAY, the larger of an explicit and an autotuned send buffer
    (``send_buffer_request``, from this network namespace's sysctls), the receive buffer
    left to the kernel's autotuning (see ``SOCKET_BUFFER_BYTES``) and a capped
    retransmission back-off (``netdist.transport.link_stats``); errors are ignored (the
    kernel may refuse)."""
    options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    request = send_buffer_request(read_sysctl(_WMEM_MAX), read_sysctl(_TCP_WMEM))
    if request is not None:
        options.append((socket.SOL_SOCKET, socket.SO_SNDBUF, request))
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except OSError:  # pragma: no cover - platform specific; a tuning, not a requirement
            pass
    cap_retransmit_backoff(sock)


def _loop_keeps_references(transport: asyncio.BaseTransport) -> bool:
    """True for transports known to write from the caller's buffer (uvloop)."""
    return type(transport).__module__.startswith("uvloop")


class FrameConnection(asyncio.BufferedProtocol):
    """A framed, flow-controlled TCP connection; see the module docstring.

    The owner (``TcpTransport`` or the rendezvous code) drives the handshake with
    ``next_control`` / ``write_control`` (``run_handshake``), then calls
    ``attach(peer_rank, mailbox)`` so data frames land in the peer's mailbox, and sends
    with ``send_frame``.

    Until ``mark_authenticated()`` (which ``run_handshake`` calls when the handshake
    succeeds) the connection reads under ``handshake_limits(limits,
    handshake_header_bytes)`` into a ``HANDSHAKE_SCRATCH_BYTES`` buffer, so a peer that
    never authenticates costs about a kilobyte, not the job's buffers. ``release`` (from
    ``AdmissionControl``) is called once, when the connection authenticates or closes.
    """

    def __init__(self, limits: WireLimits, *, label: str,
                 on_made: Callable[[FrameConnection], None] | None = None,
                 on_failed: Callable[[FrameConnection], None] | None = None,
                 handshake_header_bytes: int = _DEFAULT_ADMISSION.handshake_header_bytes,
                 release: Callable[[], None] | None = None) -> None:
        self.label = label
        """Who is at the other end, for messages ("rank 2 at 10.0.0.5:4242")."""
        self.peer_rank: int | None = None
        self.mailbox: PeerMailbox | None = None
        self.transport: asyncio.Transport | None = None
        self.last_received = 0.0
        self.last_sent = 0.0
        self.reads = 0
        """Receive callbacks so far; the liveness monitor turns changes into timestamps."""
        self.writes = 0
        """Frames written so far (data and control)."""
        self.counts = TrafficCounter()
        """Payload and wire bytes this connection moved (``netdist.transport.traffic``):
        wire bytes from the first handshake byte on, payload once data frames flow."""
        self._seen = (0, 0)
        self.link = LinkWatch()
        """The kernel's view of the link (losses, acknowledgements) for liveness."""
        self.peer_said_bye = False
        self.loss_origin: LossOrigin | None = None
        """Set when the peer's last frame (ERROR) named who went away first."""
        self.dropped_locally = False
        """True when this side dropped the connection (a send or recv gave up mid-frame)."""
        self._linger = False  # we sent BYE and half-closed: wait for the peer's EOF
        self._loop = asyncio.get_running_loop()
        self._limits = limits
        self._authenticated = False
        self._release = release
        self._decoder = FrameDecoder(handshake_limits(limits, handshake_header_bytes),
                                     scratch_bytes=HANDSHAKE_SCRATCH_BYTES)
        self._on_made = on_made
        self._on_failed = on_failed
        self._controls: deque[ControlFrame] = deque()
        self._control_waiter: asyncio.Future[None] | None = None
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._landing: Landing | None = None
        self._landing_tag = 0
        self._landing_nbytes = 0
        self._payload_left = 0
        """Payload bytes still to land in ``_landing`` (exact: drives the fast path)."""
        self._deferred: DataHeader | None = None
        self._sending = False
        """True while a frame is being written; frames never interleave."""
        self._send_waiters: deque[asyncio.Future[None]] = deque()
        self._keeps_references = True
        self._failure: ErrorFactory | None = None
        self._failure_reason = ""
        self._reading_paused = False
        self._closed: asyncio.Future[None] = self._loop.create_future()

    # -- state ---------------------------------------------------------------------------

    @property
    def failed(self) -> bool:
        """True once the connection has failed or been closed; every operation raises."""
        return self._failure is not None

    @property
    def failure_reason(self) -> str:
        """Why the connection failed ("" while it is healthy)."""
        return self._failure_reason

    def error(self) -> Exception:
        """The exception operations on a failed connection raise."""
        if self._failure is None:  # pragma: no cover - callers check ``failed`` first
            return ConnectError(f"connection to {self.label} is not failed")
        return self._failure()

    def peername(self) -> str:
        """``host:port`` of the remote end, or ``"?"``."""
        if self.transport is None:
            return "?"
        peer = self.transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            return f"{peer[0]}:{peer[1]}"
        return "?"

    def sockname(self) -> tuple[str, int] | None:
        """Local ``(host, port)`` of the socket."""
        if self.transport is None:
            return None
        local = self.transport.get_extra_info("sockname")
        if isinstance(local, tuple) and len(local) >= 2:
            return str(local[0]), int(local[1])
        return None

    @property
    def authenticated(self) -> bool:
        """True once ``mark_authenticated()`` lifted the handshake limits."""
        return self._authenticated

    def mark_authenticated(self) -> None:
        """The handshake proved the peer: lift the limits put on strangers.

        From the next frame on, the decoder reads under the connection's full limits with
        a ``SCRATCH_BYTES`` buffer (bytes already received are kept), and the admission
        slot is released. Called by ``run_handshake``; idempotent.
        """
        if self._authenticated:
            return
        self._authenticated = True
        self._decoder.set_limits(self._limits, scratch_bytes=SCRATCH_BYTES)
        self._release_admission()

    def _release_admission(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def attach(self, peer_rank: int, mailbox: PeerMailbox | None, label: str) -> None:
        """The handshake succeeded: data frames from now on land in ``mailbox``."""
        self.peer_rank = peer_rank
        self.mailbox = mailbox
        self.label = label
        if self._failure is not None:
            if mailbox is not None:
                mailbox.fail(self._failure)
            return
        # frames that arrived right behind the handshake's last frame wait in the
        # decoder (reading was paused): deliver them now
        self._pump()

    def observe(self, now: float) -> tuple[float, float]:
        """Seconds since we last sent, and since we last received, as of ``now``.

        Called by the liveness monitor each tick; activity counters (not clock reads on
        every packet) mark when something moved, at the monitor's resolution.
        """
        seen_reads, seen_writes = self._seen
        if self.reads != seen_reads:
            self.last_received = now
        if self.writes != seen_writes:
            self.last_sent = now
        self._seen = (self.reads, self.writes)
        return now - self.last_sent, now - self.last_received

    def tcp_stats(self) -> TcpStats | None:
        """The kernel's counters of this connection now (``None``: no socket yet, closed,
        or not readable on this platform)."""
        return None if self.transport is None else tcp_stats(self.transport)

    def watch_link(self, now: float) -> None:
        """Feed the kernel's counters for this connection to ``link`` (each liveness tick,
        after ``observe``)."""
        if self.transport is not None:
            self.link.observe(tcp_stats(self.transport), now, self.last_received)

    # -- asyncio protocol callbacks ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream connection always gets a read/write transport; uvloop's is not an
        # asyncio.Transport subclass, so this is a static-only narrowing (no isinstance)
        stream = cast(asyncio.Transport, transport)
        self.transport = stream
        now = self._loop.time()
        self.last_received = self.last_sent = now
        self._keeps_references = _loop_keeps_references(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_socket(sock)
        # pause_writing whenever anything is buffered, resume_writing once it has all
        # gone to the kernel: that is the "caller's memory is free" signal senders wait on.
        stream.set_write_buffer_limits(high=0, low=0)
        if self.label == "?":
            self.label = self.peername()
        if self._on_made is not None:
            self._on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.reads += 1
        self.counts.wire_received_bytes += nbytes
        left = self._payload_left
        if left > nbytes:
            # fast path: the bytes went straight into the landing payload, more to come
            self._payload_left = left - nbytes
            self._decoder.buffer_updated(nbytes)
            return
        try:
            self._decoder.buffer_updated(nbytes)
        except Exception as exc:  # pragma: no cover - the decoder's own buffer misuse
            self._violation(f"internal error while reading: {exc!r}")
            return
        self._payload_left = 0
        self._pump()

    def eof_received(self) -> bool | None:
        return None  # let the transport close itself; connection_lost reports the EOF

    def connection_lost(self, exc: Exception | None) -> None:
        self._release_admission()  # the descriptor is gone: a stranger's slot is free
        if self._failure is None:
            if self.peer_said_bye:
                reason = f"{self.label} closed its transport (left the job)"
            else:  # EOF (exc is None) or the OS error that ended the connection
                reason = lost_reason(exc, self.label, self._progress())
            self.fail(reason)
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        pass  # senders poll get_write_buffer_size() and wait for resume_writing

    def resume_writing(self) -> None:
        self._wake_drain_waiters()

    # -- receiving -----------------------------------------------------------------------

    def _pump(self) -> None:
        """Decode what is buffered; never lets an exception escape into the event loop."""
        try:
            self._process_events()
        except RemoteProtocolError as exc:
            self._violation(str(exc))
        except Exception as exc:
            logger.exception("netdist: internal error reading from %s", self.label)
            self._violation(f"internal error while reading: {exc!r}")

    def _process_events(self) -> None:
        decoder = self._decoder
        while self._failure is None:
            if self._controls or self._deferred is not None:
                return  # waiting for a driver, or for a receiver to post its recv
            event = decoder.next_event()
            if event is NEED_DATA:
                if self._reading_paused:
                    self._reading_paused = False
                    if self.transport is not None:
                        self.transport.resume_reading()
                return
            if isinstance(event, DataStart):
                header = event.header
                mailbox = self.mailbox
                if mailbox is None:
                    raise RemoteProtocolError(
                        "data frame received before the handshake completed")
                if header.nbytes >= DEFER_CLAIM_BYTES and not mailbox.has_posted(header.tag):
                    # No receive is posted yet. The receiver of the previous message is
                    # usually about to post one (its wake-up is already scheduled), so
                    # give it one loop turn before falling back to an unexpected-message
                    # buffer, which would cost an allocation and a copy.
                    self._deferred = header
                    self._pause_reading()
                    self._loop.call_soon(self._claim_deferred)
                    return
                self._claim(mailbox, header)
            elif isinstance(event, DataEnd):
                landing = self._landing
                self._landing = None
                if landing is None:  # pragma: no cover - decoder always sends DataStart
                    raise RemoteProtocolError("data frame ended without starting")
                counts = self.counts
                counts.received_bytes += self._landing_nbytes
                counts.received_messages += 1
                landing.complete()
            elif self.mailbox is None:
                # Handshake or rendezvous phase: hand the frame to whoever drives it and
                # decode nothing further until it asks (the next frame may be data that
                # needs the mailbox the driver attaches on success). Reading pauses so
                # the decoder's scratch cannot overflow meanwhile.
                self._controls.append(event)
                self._wake_control_waiter()
                self._pause_reading()
                return
            else:
                self._on_control(event)

    def _claim(self, mailbox: PeerMailbox, header: DataHeader) -> None:
        landing = mailbox.claim(header.tag, header.dtype, header.shape)
        self._landing = landing
        self._landing_tag = header.tag
        nbytes = header.nbytes
        self._landing_nbytes = nbytes
        already = min(self._decoder.buffered, nbytes)  # copied in from scratch
        self._decoder.set_payload_destination(landing.buffer)
        if already < nbytes:
            self._payload_left = nbytes - already

    def _claim_deferred(self) -> None:
        header, self._deferred = self._deferred, None
        if header is None or self._failure is not None or self.mailbox is None:
            return
        try:
            self._claim(self.mailbox, header)
        except Exception as exc:  # pragma: no cover - defensive, as in _pump
            self._violation(f"internal error while reading: {exc!r}")
            return
        self._pump()

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _on_control(self, frame: ControlFrame) -> None:
        kind = frame.kind
        if kind == FrameKind.HEARTBEAT:
            return
        if kind == FrameKind.BYE:
            self.peer_said_bye = True
            self.fail(f"{self.label} closed its transport (left the job)", orderly=True)
            return
        if kind == FrameKind.ERROR and self.peer_rank is not None:
            # the peer's last word: who went away first and how the peer is leaving
            farewell = read_farewell(frame.fields, self.peer_rank)
            self.fail(farewell.message(), orderly=True, origin=farewell.origin)
            return
        raise RemoteProtocolError(f"unexpected {kind.name} frame after the handshake")

    def _progress(self) -> str:
        if self._landing is None:
            return ""
        total = self._landing_nbytes
        done = total - self._payload_left
        return f" after {done} of {total} payload bytes (tag {self._landing_tag})"

    def abandon_withdrawn_landing(self, why: str) -> None:
        """Fail the connection if the frame now landing lost its receiver mid-payload.

        Called after a ``recv`` timed out or was cancelled. A frame already landing in
        its ``out=`` cannot be redirected (the kernel writes straight into it), and
        dropping it would silently shift every later message on that tag, so the
        connection is failed instead.
        """
        landing = self._landing
        if landing is not None and landing.withdrawn and self._failure is None:
            self.fail(f"{why}{self._progress()}; the connection to {self.label} was "
                      "dropped so the rest of the frame cannot land in released memory",
                      local=True)

    def _violation(self, reason: str) -> None:
        # before authentication the owner reports the dropped stranger (rate-limited)
        logger.log(logging.WARNING if self._authenticated else logging.DEBUG,
                   "netdist: protocol violation from %s: %s; closing the connection",
                   self.label, reason)
        self.fail(f"{self.label} violated the protocol: {reason}", remote_protocol=True)

    def _wake_control_waiter(self) -> None:
        waiter = self._control_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_drain_waiters(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def next_control(self, deadline: float, what: str) -> ControlFrame:
        """The next control frame (handshake / rendezvous phase), by loop time ``deadline``.

        Raises ``NetdistTimeoutError`` naming ``what``; the connection's failure error if it
        fails meanwhile.
        """
        if not self._controls:
            self._pump()  # the driver is ready for the next frame: decode what is buffered
        while not self._controls:
            if self._failure is not None:
                raise self._failure()
            waiter = self._loop.create_future()
            self._control_waiter = waiter
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                raise NetdistTimeoutError(
                    f"{what}: {self.label} sent nothing in time") from None
            finally:
                self._control_waiter = None
        return self._controls.popleft()

    # -- sending -------------------------------------------------------------------------

    def write_control(self, frame: bytes) -> bool:
        """Write a complete control frame now unless a data frame is being written.

        Returns False (and writes nothing) when the connection is failed or busy.
        """
        if self._failure is not None or self._sending or self.transport is None:
            return False
        if self.transport.is_closing():
            return False
        self.transport.write(frame)
        self.writes += 1
        self.counts.wire_sent_bytes += len(frame)
        return True

    async def send_frame(self, buffers: Sequence[bytes | memoryview], tag: int,
                         payload_nbytes: int, deadline: float, started: float) -> None:
        """Write one data frame; return once the caller's memory is no longer referenced.

        ``buffers`` is ``encode_data``'s output. Frames never interleave (one sender at a
        time). Raises ``NetdistTimeoutError`` after ``deadline`` (loop time), or the
        connection's failure error. A timeout or cancellation after the first byte went
        out fails the connection, so the peer never takes a partial frame as data.
        ``counts`` adds the payload bytes as they are handed to the socket and the message
        once all of it was (see ``netdist.transport.traffic``).
        """
        peer = self.label
        if self._failure is not None:
            raise self._failure()
        if self._sending or self._send_waiters:
            await self._acquire_send(deadline, tag, started)
        else:
            self._sending = True
        written = _NOT_STARTED  # payload bytes handed to the transport
        try:
            if self._failure is not None:
                raise self._failure()
            transport = self.transport
            if transport is None or transport.is_closing():
                # closing before the loss was registered: the peer is gone all the same
                if self.peer_rank is None:
                    raise ConnectError(f"connection to {peer} is closed")
                raise PeerLostError(self.peer_rank,
                                    f"connection to {peer} closed (tag {tag})")
            header = buffers[0]
            counts = self.counts
            if payload_nbytes <= SMALL_FRAME_BYTES:
                frame = header if len(buffers) == 1 else b"".join(buffers)
                transport.write(frame)
                written = payload_nbytes
                self.writes += 1
                counts.wire_sent_bytes += len(frame)
                counts.sent_bytes += payload_nbytes
                counts.sent_messages += 1
                if transport.get_write_buffer_size() > SMALL_BACKLOG_BYTES:
                    await self._wait_drained(deadline)
                return
            payload = memoryview(buffers[1]).cast("B")
            if self._keeps_references:
                transport.writelines([header, payload])
                written = payload_nbytes
                counts.wire_sent_bytes += len(header) + payload_nbytes
                counts.sent_bytes += payload_nbytes
            else:
                transport.write(header)
                written = 0
                counts.wire_sent_bytes += len(header)
                chunk = COPYING_LOOP_CHUNK_BYTES
                while written < payload_nbytes:
                    if transport.get_write_buffer_size() > 0:
                        await self._wait_drained(deadline)
                    end = min(written + chunk, payload_nbytes)
                    transport.write(payload[written:end])
                    counts.wire_sent_bytes += end - written
                    counts.sent_bytes += end - written
                    written = end
                    self.writes += 1
            counts.sent_messages += 1  # handed over whole; the drain below frees memory
            await self._wait_drained(deadline)
            self.writes += 1
            written = _DONE  # the frame is entirely with the kernel
        except TimeoutError:
            elapsed = self._loop.time() - started
            detail = self._interrupted(tag, written, payload_nbytes, "timed out")
            raise NetdistTimeoutError(
                f"send to {peer} (tag {tag}) timed out after {elapsed:.2f}s{detail}"
            ) from None
        except asyncio.CancelledError:
            self._interrupted(tag, written, payload_nbytes, "was cancelled")
            raise
        except (OSError, RuntimeError) as exc:
            # a write on a transport that just died (RuntimeError: written after its
            # write_eof): fail the connection with what the OS said, unless the frame was
            # cut short (that says more) or it failed already, and report its failure
            self._interrupted(tag, written, payload_nbytes, f"failed ({exc!r})")
            if self._failure is None:
                self.fail(lost_reason(exc, peer))
            raise self.error() from None
        finally:
            self._release_send()

    async def _acquire_send(self, deadline: float, tag: int, started: float) -> None:
        """Wait for our turn to write a frame (FIFO; the lock is handed over directly)."""
        waiter = self._loop.create_future()
        self._send_waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release_send()  # granted just as we gave up: pass it on
            else:
                waiter.cancel()
                try:
                    self._send_waiters.remove(waiter)
                except ValueError:
                    pass
            if isinstance(exc, TimeoutError):
                elapsed = self._loop.time() - started
                raise NetdistTimeoutError(
                    f"send to {self.label} (tag {tag}) timed out after {elapsed:.2f}s "
                    "waiting for earlier sends to the same rank") from None
            raise

    def _release_send(self) -> None:
        while self._send_waiters:
            waiter = self._send_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # ownership passes to the waiter
                return
        self._sending = False

    def _interrupted(self, tag: int, written: int, total: int, how: str) -> str:
        """Fail the connection if a frame was cut short; return a detail for the error."""
        if written == _NOT_STARTED:
            return " waiting to start the frame"
        if written == _DONE or self._failure is not None:
            return ""
        self.fail(f"send to {self.label} (tag {tag}) {how} after {written} of {total} "
                  "payload bytes were handed to the socket; the connection was dropped "
                  "so no partial frame is taken as data", local=True)
        return f" ({written} of {total} payload bytes written; connection dropped)"

    async def _wait_drained(self, deadline: float) -> None:
        transport = self.transport
        while transport is not None and transport.get_write_buffer_size() > 0:
            if self._failure is not None:
                raise self._failure()
            waiter = self._loop.create_future()
            self._drain_waiters.append(waiter)
            async with asyncio.timeout_at(deadline):
                await waiter
        if self._failure is not None:
            raise self._failure()

    # -- failure and close ---------------------------------------------------------------

    def fail(self, reason: str, *, orderly: bool = False, remote_protocol: bool = False,
             error: ErrorFactory | None = None, origin: LossOrigin | None = None,
             local: bool = False) -> None:
        """Fail the connection once: every waiter and later operation raises.

        ``error`` overrides the default ``PeerLostError`` (after the handshake) or
        ``ConnectError`` / ``RemoteProtocolError`` (before it). ``origin`` is the rank
        the peer said went away first (its ERROR frame); the ``PeerLostError`` carries it
        as ``origin_rank``. ``local`` marks a drop decided here (a send or receive gave
        up mid-frame), which never makes the peer the origin of a later abort.
        """
        if self._failure is not None:
            return
        rank = self.peer_rank
        self.loss_origin = origin
        self.dropped_locally = local
        if error is None:
            if rank is not None:
                origin_rank = None if origin is None else origin.rank
                origin_reason = None if origin is None else origin.reason

                def error() -> Exception:
                    return PeerLostError(rank, reason, origin_rank=origin_rank,
                                         origin_reason=origin_reason)
            elif remote_protocol:
                def error() -> Exception:
                    return RemoteProtocolError(reason)
            else:
                def error() -> Exception:
                    return ConnectError(reason)
        self._failure = error
        self._failure_reason = reason
        landing, self._landing = self._landing, None
        self._payload_left = 0
        self._deferred = None
        if self.mailbox is not None:  # first: it notes whether a frame was still landing
            self.mailbox.fail(error)
        if landing is not None:
            landing.fail(error())
        self._wake_control_waiter()
        self._wake_drain_waiters()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if orderly and not self._sending:
                if self._linger and transport.can_write_eof():
                    # Half-close after everything buffered (our BYE last) is written; the
                    # socket closes when the peer, having read it all, closes its side.
                    # Closing at once could drop the tail of our data if this process (or
                    # its container's network) goes away before the kernel delivered it.
                    try:
                        transport.write_eof()
                    except OSError:  # the peer is already gone: nothing left to deliver
                        transport.close()
                else:
                    transport.close()
            else:
                transport.abort()
        if self._on_failed is not None:
            self._on_failed(self)

    def close(self, *, send_bye: bool, error: ErrorFactory | None = None,
              reason: str = "connection closed", farewell: bytes | None = None) -> None:
        """Close from our side: send BYE when possible (no frame half written), then close.

        ``farewell`` (an encoded ERROR frame naming why this rank leaves, see
        ``netdist.transport.blame``) replaces the BYE; it goes out the same way.
        """
        if send_bye and self._failure is None:
            last = encode_control(FrameKind.BYE) if farewell is None else farewell
            self._linger = self.write_control(last)
        self.fail(reason, orderly=True, error=error)

    async def wait_closed(self, timeout: float) -> None:
        """Wait until the socket is closed (aborting it after ``timeout``). Never raises."""
        if self.transport is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._closed)
        except TimeoutError:
            # The peer never closed its side: close ours gracefully when we half-closed
            # (the kernel still delivers what it holds), abort otherwise.
            if self._linger:
                self.transport.close()
            else:
                self.transport.abort()
            try:
                async with asyncio.timeout(1.0):
                    await asyncio.shield(self._closed)
            except TimeoutError:  # pragma: no cover - abort always calls connection_lost
                pass

    async def wait_delivered(self, deadline: float, liveness_window: float) -> int:
        """After ``close(send_bye=True)``: wait until the peer has everything sent to it.

        The peer closes its side once it has read this side's goodbye, which travels
        behind every data frame, so its EOF proves delivery. While waiting, the kernel's
        send queue (``SIOCOUTQ``) must keep shrinking: a queue that has not moved for a
        liveness window (stretched on a lossy link, see ``LinkWatch``) means a stopped or
        partitioned peer, and nothing waits past ``deadline`` (loop time; the operation
        timeout). Once the peer's kernel has acknowledged every byte, its goodbye is
        waited for ``ACKED_CLOSE_GRACE`` seconds more: the bytes are safe in its kernel.

        Returns the bytes the peer's kernel never acknowledged: 0 when all were
        delivered, -1 when the platform cannot count them and the peer never confirmed.
        The socket is closed either way (gracefully: the kernel still delivers what it
        can). A connection that failed or never sent its goodbye (nothing to deliver, or
        its loss is already reported) is waited for briefly and returns 0. Never raises.
        """
        transport = self.transport
        if transport is None:
            return 0
        if not self._linger:
            await self.wait_closed(_QUICK_CLOSE_SECONDS)
            return 0
        loop = self._loop
        left = unsent_bytes(transport)
        moved_at = loop.time()
        poll = _DRAIN_FIRST_POLL
        acked_by: float | None = None
        while not self._closed.done():
            now = loop.time()
            self.watch_link(now)
            queued = unsent_bytes(transport)
            if queued is not None and (left is None or queued < left):
                moved_at = now
            left = queued
            if left == 0 and acked_by is None:
                acked_by = now + ACKED_CLOSE_GRACE
            stalled = now - moved_at > self.link.window(liveness_window)
            if now >= deadline or (acked_by is not None and now >= acked_by) or (
                    left is not None and left > 0 and stalled):
                break
            limit = min(poll, deadline - now)
            if acked_by is not None:
                limit = min(limit, acked_by - now)
            try:
                async with asyncio.timeout(max(limit, 0.0)):
                    await asyncio.shield(self._closed)
            except TimeoutError:
                poll = min(poll * 2, _DRAIN_MAX_POLL)
        if self._closed.done():
            return 0
        final = unsent_bytes(transport)
        transport.close()  # graceful: what the kernel still holds may yet arrive
        try:
            async with asyncio.timeout(_QUICK_CLOSE_SECONDS):
                await asyncio.shield(self._closed)
        except TimeoutError:  # pragma: no cover - close always calls connection_lost
            pass
        if final == 0:
            return 0
        return -1 if final is None else final


# -- sockets: listening, connecting, the handshake driver ------------------------------

_WILDCARD_HOSTS = frozenset(("", "0.0.0.0", "::", "*"))


async def is_loopback_host(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    if host in _WILDCARD_HOSTS:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:  # a name that does not resolve is not loopback; binding reports it
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(
        ipaddress.ip_address(str(addr).split("%")[0]).is_loopback for addr in addresses)


async def check_listen_security(host: str, token: str | None, insecure: bool,
                                what: str) -> None:
    """Refuse to listen beyond loopback without a token unless ``insecure`` is set."""
    if token or insecure or await is_loopback_host(host):
        return
    shown = host or "all interfaces"
    raise ConfigError(
        f"{what} would listen on {shown}, which is not a loopback address, and no token "
        "is set: anyone who can reach the port could join the job. Set NETDIST_TOKEN "
        "(the same secret on every rank), or pass insecure=True / NETDIST_INSECURE=1 "
        "to accept that risk explicitly")


async def start_listener(host: str, port: int, factory: Callable[[], asyncio.BaseProtocol],
                         *, what: str) -> tuple[asyncio.Server, tuple[str, int]]:
    """Bind ``host:port`` (port 0 picks a free one) and serve ``factory`` connections.

    Returns the server and the bound ``(host, port)``. Raises ``ConnectError``.
    """
    loop = asyncio.get_running_loop()
    bind_host = None if host in _WILDCARD_HOSTS else host.strip("[]")
    try:
        infos = await loop.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise transport_error(exc, what, f"listen address {host!r}", Stage.RESOLVE) from exc
    last: OSError | None = None
    for family, type_, proto, _, address in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and bind_host is None:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            tune_socket(sock)  # accepted sockets inherit the buffer sizes
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
            server = await loop.create_server(factory, sock=sock)
        except OSError as exc:  # try the next address; the last error is reported
            sock.close()
            last = exc
            continue
        bound = sock.getsockname()
        return server, (str(bound[0]), int(bound[1]))
    raise transport_error(last, what, f"{host}:{port}", Stage.LISTEN) from last


def stop_accepting(server: asyncio.Server) -> None:
    """Stop ``server`` taking new connections, without closing it yet (``close_listener``).

    asyncio (3.11's selector loops) accepts a socket in one loop turn and makes its
    transport in the next, in a task; a ``Server.close()`` between the two makes that
    transport's construction fail an assertion, which asyncio swallows, leaking the
    accepted socket. Unregistering the listening sockets first ends new accepts at once
    and leaves the server open for the transports already on their way.
    """
    loop = asyncio.get_running_loop()
    for sock in server.sockets:
        loop.remove_reader(sock.fileno())  # False (harmless) where the loop accepts itself


async def close_listener(server: asyncio.Server) -> None:
    """Close ``server`` without losing a connection it accepted a moment ago (see
    ``stop_accepting``): the transports accepted before this call are made first, and
    each goes to its protocol, which closes it if its owner is closing. Callers still
    ``wait_closed()`` once their connections are closed (since 3.12 that waits for them).
    """
    stop_accepting(server)
    await asyncio.sleep(0)  # accept tasks queued before stop_accepting make their transports
    server.close()


async def listen(host: str, port: int, factory: Callable[[], asyncio.BaseProtocol], *,
                 token: str | None, insecure: bool, what: str,
                 fallback_to_all: bool) -> tuple[asyncio.Server, tuple[str, int]]:
    """``start_listener`` behind the token rule of ``check_listen_security``.

    With ``fallback_to_all``, a ``host`` that is not a local interface (a NAT, service
    or load-balancer address given as the advertise/coordinator address) is served on
    all interfaces instead -- which, like any non-loopback address, needs a token.
    """
    await check_listen_security(host, token, insecure, what)
    try:
        return await start_listener(host, port, factory, what=what)
    except ConnectError as exc:
        if not (fallback_to_all
                and kind_of(exc.__cause__) is OsErrorKind.ADDRESS_NOT_LOCAL):
            raise
    await check_listen_security("", token, insecure, f"{what} (all interfaces)")
    logger.info("netdist: %s is not a local address; %s listens on all interfaces",
                host, what)
    return await start_listener("", port, factory, what=what)


async def open_connection(host: str, port: int, factory: Callable[[], FrameConnection],
                          *, deadline: float, what: str, retry: bool,
                          refused_grace: float | None = None) -> FrameConnection:
    """Connect to ``host:port``; with ``retry`` keep trying until ``deadline`` (loop time).

    Retrying covers a server that is not up yet (rank 0 may start after the others).
    With ``refused_grace`` (seconds), a port that has refused every attempt for that long
    is given up on before ``deadline``: for a peer whose listener was bound before its
    address was published, a refusal means it is gone. Raises ``ConnectError`` naming
    ``what`` and the last OS error, which is also its ``__cause__``
    (``ConnectionRefusedError`` when refused).
    """
    loop = asyncio.get_running_loop()
    delay = 0.02
    attempts = 0
    last: BaseException | None = None
    refused_since: float | None = None
    while True:
        attempts += 1
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        try:
            async with asyncio.timeout(remaining):
                _, protocol = await loop.create_connection(factory, host.strip("[]"), port)
            return protocol
        except TimeoutError:
            last = TimeoutError("connect timed out")
            break
        except OSError as exc:
            last = exc
            if kind_of(exc) is OsErrorKind.REFUSED:
                now = loop.time()
                refused_since = now if refused_since is None else refused_since
                if refused_grace is not None and now - refused_since >= refused_grace:
                    break
            else:
                refused_since = None
        if not retry:
            break
        pause = min(delay, deadline - loop.time())
        if pause <= 0:
            break
        await asyncio.sleep(pause)  # back off before retrying; not synchronisation
        delay = min(delay * 2, 0.5)
    raise transport_error(last, what, f"{host}:{port}", Stage.CONNECT,
                          detail=f" ({attempts} attempt{'s' if attempts != 1 else ''})"
                          ) from last


RETRY_FIRST_PAUSE = 0.02
"""First back-off, in seconds, before retrying a connection; it doubles up to 0.5."""


async def retry_pause(pause: float | None, deadline: float) -> float | None:
    """Back off ``pause`` seconds before a retry, unless that would pass ``deadline``.

    Returns the next pause (doubled, at most 0.5 s), or ``None`` when there is no time
    left for another attempt (the caller raises its last error). Not synchronisation:
    the wait only spaces out attempts at a peer that closed or refused the last one.
    """
    if pause is None:
        return None
    loop = asyncio.get_running_loop()
    if loop.time() + pause >= deadline:
        return None
    await asyncio.sleep(pause)
    return min(pause * 2, 0.5)


async def run_handshake(conn: FrameConnection, handshake: Any, *, deadline: float,
                        what: str, first: bytes | None = None) -> Any:
    """Drive a ``ClientHandshake`` / ``ServerHandshake`` over ``conn`` until done.

    Sends ``first`` (the client's HELLO) if given; then for every control frame: send
    what the step says, raise its error, stop when done, marking ``conn`` authenticated
    (it reads under the job's limits from then on). Returns the final
    ``HandshakeStep``. Raises the handshake's ``AuthenticationError``, the connection's
    failure, or ``NetdistTimeoutError`` at ``deadline``.
    """
    if first is not None and not conn.write_control(first):
        raise conn.error() if conn.failed else ConnectError(f"{what}: connection closed")
    while True:
        frame = await conn.next_control(deadline, what)
        step = handshake.receive(frame)
        if step.send:
            conn.write_control(step.send)
        if step.error is not None:
            raise step.error
        if step.done:
            conn.mark_authenticated()
            return step
