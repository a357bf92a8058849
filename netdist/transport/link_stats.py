"""What the kernel knows about one TCP connection: acknowledged bytes, losses, backlog.

The transport decides two things from it that its own frames cannot tell:

- **liveness on a lossy link** (``LinkWatch``). A peer whose frames stop arriving is
  presumed dead after the liveness window. On a link that drops packets, TCP's
  retransmission back-off can hold a live peer's frames longer than that: the bytes are
  retransmitted, lost again, and the timer doubles. When the connection showed losses
  (retransmissions, segments that arrived out of order) while the peer was still
  talking, the window stretches by ``LOSSY_LINK_FACTOR``; a partition or a stopped
  process on a clean link causes losses only after the silence began, so such a peer is
  still named within the plain window. Where the kernel allows it (Linux 6.15+,
  ``TCP_RTO_MAX_MS``), the retransmission back-off is also capped at
  ``RETRANSMIT_BACKOFF_CAP`` seconds (``cap_retransmit_backoff``), so a live peer's
  bytes are retried at least that often; older kernels get linear timeouts for thin
  streams, the heartbeats' case.
- **delivery at close** (``unsent_bytes``): how many bytes this side wrote that the peer's
  kernel has not acknowledged yet (``SIOCOUTQ``). A clean close waits for them.

Everything here degrades to "unknown" (``None``) where the platform has no ``TCP_INFO``
or ``SIOCOUTQ`` (macOS, a non-TCP socket): callers then keep the plain rules.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
import termios
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TcpStats",
    "tcp_stats",
    "unsent_bytes",
    "cap_retransmit_backoff",
    "LinkWatch",
    "LOSSY_LINK_FACTOR",
    "RETRANSMIT_BACKOFF_CAP",
]

LOSSY_LINK_FACTOR = 3.0
"""How much longer a silent peer is waited for while its link is losing packets and its
kernel still acknowledges: the liveness window times this is the documented bound on
naming a stopped rank over a lossy link."""

RETRANSMIT_BACKOFF_CAP = 1.0
"""Seconds: the longest TCP may wait between two retransmissions of the same bytes, where
the kernel lets a socket set it (``TCP_RTO_MAX_MS``; 1 s is the smallest it accepts)."""

KERNEL_GIVE_UP_MS = 120_000
"""Milliseconds of unacknowledged data after which the kernel drops a connection whose
back-off is capped (``TCP_USER_TIMEOUT``; see ``cap_retransmit_backoff``)."""

_TCP_RTO_MAX_MS = 44  # linux/tcp.h, since 6.15
_TCP_THIN_LINEAR_TIMEOUTS = 16  # linux/tcp.h, since 2.6.34
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_TCP_INFO_BYTES = 232

# struct tcp_info (linux/tcp.h): offsets of the fields read here
_U8_RETRANSMITS = 2
_U8_BACKOFF = 4
_U32_LAST_ACK_RECV = 56
_U32_TOTAL_RETRANS = 100
_U64_BYTES_ACKED = 120
_U64_BYTES_RECEIVED = 128
_U32_RCV_OOOPACK = 224


@dataclass(frozen=True, slots=True)
class TcpStats:
    """The fields of the kernel's ``tcp_info`` that liveness and close use.

    Counters that an older kernel does not report are ``None``.
    """

    retransmits: int
    """Retransmissions of the oldest unacknowledged segment so far (0: none pending)."""
    backoff: int
    """How many times the retransmission timer has doubled for that segment."""
    last_ack_recv: float
    """Seconds since the peer's kernel last acknowledged anything."""
    total_retrans: int
    """Segments retransmitted over the connection's life."""
    bytes_acked: int | None
    """Bytes this side sent that the peer's kernel acknowledged (Linux 4.1+)."""
    bytes_received: int | None
    """Bytes received from the peer (Linux 4.1+)."""
    rcv_ooopack: int | None
    """Segments from the peer that arrived out of order, behind a lost one (Linux 5.4+)."""


def _socket_of(sock_or_transport: Any) -> Any:
    """The socket behind an asyncio/uvloop transport, or ``sock_or_transport`` itself."""
    get_extra_info = getattr(sock_or_transport, "get_extra_info", None)
    if get_extra_info is not None:
        return get_extra_info("socket")
    return sock_or_transport


def tcp_stats(sock_or_transport: Any) -> TcpStats | None:
    """The kernel's view of a TCP connection, or ``None`` where it cannot be read."""
    sock = _socket_of(sock_or_transport)
    if sock is None or _TCP_INFO is None or not sys.platform.startswith("linux"):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
    except (OSError, ValueError):  # closed, or not a TCP socket
        return None
    if len(raw) < _U32_TOTAL_RETRANS + 4:
        return None

    def u64(offset: int) -> int | None:
        return struct.unpack_from("<Q", raw, offset)[0] if len(raw) >= offset + 8 else None

    ooo = struct.unpack_from("<I", raw, _U32_RCV_OOOPACK)[0] \
        if len(raw) >= _U32_RCV_OOOPACK + 4 else None
    return TcpStats(
        retransmits=raw[_U8_RETRANSMITS],
        backoff=raw[_U8_BACKOFF],
        last_ack_recv=struct.unpack_from("<I", raw, _U32_LAST_ACK_RECV)[0] / 1000.0,
        total_retrans=struct.unpack_from("<I", raw, _U32_TOTAL_RETRANS)[0],
        bytes_acked=u64(_U64_BYTES_ACKED),
        bytes_received=u64(_U64_BYTES_RECEIVED),
        rcv_ooopack=ooo,
    )


def unsent_bytes(sock_or_transport: Any) -> int | None:
    """Bytes in the socket's send queue that the peer has not acknowledged (``SIOCOUTQ``).

    0 once the peer's kernel holds everything written; ``None`` where unknown.
    """
    sock = _socket_of(sock_or_transport)
    if sock is None or not sys.platform.startswith("linux"):
        return None
    try:
        fd = sock.fileno()
        if fd < 0:
            return None
        buf = fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0")  # SIOCOUTQ == TIOCOUTQ
    except (OSError, ValueError):  # closed meanwhile: unknown, as documented
        return None
    return int(struct.unpack("<i", buf)[0])


def cap_retransmit_backoff(sock: socket.socket, seconds: float = RETRANSMIT_BACKOFF_CAP) -> bool:
    """Cap TCP's retransmission back-off at ``seconds`` where the kernel allows it.

    Also turns on linear timeouts for thin streams (``TCP_THIN_LINEAR_TIMEOUTS``, Linux
    2.6.34+): while fewer than four segments are in flight, as for heartbeats on an idle
    connection, the first six retries of a lost segment are not backed off, which is
    what keeps a live peer's heartbeats moving on kernels without ``TCP_RTO_MAX_MS``.
    Returns whether the cap was set (False on kernels before Linux 6.15 and elsewhere).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_THIN_LINEAR_TIMEOUTS, 1)
    except OSError:  # a tuning the kernel may not offer; the cap below still helps
        pass
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_RTO_MAX_MS, max(1000, int(seconds * 1000)))
    except OSError:  # kernel before 6.15: no cap, as documented
        return False
    try:
        # The kernel gives up on a connection after a number of retries it turns into a
        # time by assuming the back-off doubles up to TCP_RTO_MAX_MS: with the cap, 15
        # retries (tcp_retries2) last about 13 s and an orphan's 8 about 6 s, so on a
        # lossy link it would drop a live connection, or a closed socket's last bytes (a
        # rendezvous table), long before the liveness rules decide. A time budget keeps
        # retrying for KERNEL_GIVE_UP seconds instead; liveness names a dead peer sooner.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, KERNEL_GIVE_UP_MS)
    except (OSError, AttributeError):  # no TCP_USER_TIMEOUT: the kernel's retries rule
        pass
    return True


class LinkWatch:
    """Per connection: was the link losing packets while the peer was still talking?

    ``observe`` is called on every liveness tick with the kernel's counters and the loop
    time this side last heard from the peer; ``window(base)`` is then the silence to
    allow before presuming the peer dead: ``base * LOSSY_LINK_FACTOR`` when the
    connection lost packets (retransmissions, segments that arrived out of order) within
    that stretched window before the peer went quiet, else ``base``. (A lookback of one
    plain window missed lossy links where none of the last few heartbeats happened to
    be retransmitted: about 3% of silences at 30% loss.)

    Only losses the peer was heard after count: a partition or a stopped process on a
    clean link makes this side retransmit its heartbeats too, but those losses follow the
    silence, so such a peer is still named within the plain window. On a link that was
    already losing packets a stalled stream and a stopped peer look alike until the
    stretched window ends, which is therefore the bound on naming a rank there.
    """

    __slots__ = ("_last", "_loss_at", "_loss_heard_at", "_heard_at")

    def __init__(self) -> None:
        self._last: TcpStats | None = None
        self._loss_at = float("-inf")
        self._loss_heard_at = float("-inf")
        self._heard_at = float("-inf")

    def observe(self, stats: TcpStats | None, now: float, heard_at: float) -> None:
        """Record the kernel's counters at loop time ``now``; ``heard_at`` is when this
        side last received anything from the peer."""
        self._heard_at = heard_at
        if stats is not None:
            last, self._last = self._last, stats
            if stats.retransmits > 0 or stats.backoff > 0 or (last is not None and (
                    stats.total_retrans > last.total_retrans
                    or (stats.rcv_ooopack or 0) > (last.rcv_ooopack or 0))):
                self._loss_at = now
        if heard_at >= self._loss_at:
            self._loss_heard_at = self._loss_at  # the peer spoke after that loss

    def lossy(self, base: float) -> bool:
        """True when the link lost packets within ``LOSSY_LINK_FACTOR * base`` seconds
        before the peer went quiet (see the class docstring)."""
        return self._heard_at - self._loss_heard_at <= base * LOSSY_LINK_FACTOR

    def window(self, base: float) -> float:
        """The silence allowed before presuming the peer dead (see the class docstring)."""
        return base * LOSSY_LINK_FACTOR if self.lossy(base) else base
