"""PURE: one rank's running totals, per peer (``counters(transport) -> Counters``).

What a dashboard or ``/metrics`` (``netdist.trace.prometheus``) wants to see of a rank
without tracing it: the bytes and messages it exchanged with each peer
(``Transport.traffic()``), how many of its collectives ended waiting for each peer and how
long they took (``Recorder.waits`` / ``Recorder.wait_ns``), how often TCP had to
retransmit on the link to each peer (the kernel's ``tcp_info``, where the transport can
read it: ``TcpTransport.link_stats()``), whether the peer is known to be gone, and for
the rank as a whole the collectives its flight recorder saw and the dumps it wrote.

Every count only grows (except ``lost`` and ``tracing``), so two snapshots subtract into
what happened in between, as ``Traffic`` does.

Read a snapshot on the transport's event loop (the counts live there)::

    snapshot = counters(transport)                  # asyncio code on that loop

or from synchronous code driving a progress-thread ``Job``, by handing the job's blocking
transport proxy over; the read then runs on the progress thread::

    snapshot = counters(job.transport)              # netdist.connect() / Job

This module imports neither asyncio nor socket: it reads the transport through its public
methods only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from netdist.transport.base import Transport

__all__ = ["PeerCounters", "Counters", "counters"]


@dataclass(frozen=True, slots=True)
class PeerCounters:
    """What one rank exchanged with one peer, and waited for it, so far."""

    peer: int
    """The peer's transport rank (``-1`` in ``Counters.total``: a sum over every peer)."""
    sent_bytes: int = 0
    """Payload bytes of data messages handed to the link (``PeerTraffic.sent_bytes``)."""
    sent_messages: int = 0
    received_bytes: int = 0
    received_messages: int = 0
    wire_sent_bytes: int = 0
    """Every byte written to the socket: headers, handshake, heartbeats included."""
    wire_received_bytes: int = 0
    collective_waits: int = 0
    """Collectives of this rank whose last wait was for this peer (``Recorder.waits``)."""
    wait_seconds: float = 0.0
    """The whole duration of those collectives, summed (``Recorder.wait_ns``)."""
    stalls: int | None = None
    """TCP segments the kernel retransmitted on the connection to this peer over its life
    (``tcp_info.tcpi_total_retrans``): each one held the stream up for at least a
    retransmission timeout or a fast-retransmit round trip. ``None`` where unknown: no
    TCP connection to the peer (in-process transports, never connected), a connection
    already closed, or a platform without ``TCP_INFO``."""
    lost: bool = False
    """Whether the transport knows the peer is gone."""

    def __add__(self, other: PeerCounters) -> PeerCounters:
        if not isinstance(other, PeerCounters):
            return NotImplemented
        return PeerCounters(
            -1, self.sent_bytes + other.sent_bytes, self.sent_messages + other.sent_messages,
            self.received_bytes + other.received_bytes,
            self.received_messages + other.received_messages,
            self.wire_sent_bytes + other.wire_sent_bytes,
            self.wire_received_bytes + other.wire_received_bytes,
            self.collective_waits + other.collective_waits,
            self.wait_seconds + other.wait_seconds,
            _add_known(self.stalls, other.stalls), self.lost or other.lost)


@dataclass(frozen=True)
class Counters:
    """One rank's counters as of one moment (``counters(transport)``)."""

    rank: int
    world_size: int
    peers: Mapping[int, PeerCounters]
    """Every other rank of the job, ascending (zeros for a peer never talked to)."""
    collectives: int = 0
    """Collective calls the flight recorder saw since the start (``Recorder.recorded``)."""
    flight_dumps: int = 0
    """Flight-recorder dumps this rank wrote (on errors, ``SIGUSR1`` or by request)."""
    tracing: bool = False
    """Whether a trace is being recorded now."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "peers", MappingProxyType(dict(sorted(self.peers.items()))))

    @property
    def total(self) -> PeerCounters:
        """The sum over every peer (``peer == -1``; ``lost``: any peer lost; ``stalls``:
        the sum of the known ones, ``None`` if none is known)."""
        return _sum(self.peers.values())


def counters(transport: Transport | Any) -> Counters:
    """This rank's ``Counters`` now; see the module docstring.

    ``transport`` is a ``Transport``, read on the caller's thread (which must be the
    transport's event loop's), or a blocking proxy of one (``job.transport``), read on
    its progress thread. A transport that keeps no link statistics (no ``link_stats``
    method) reports ``stalls=None`` for every peer.
    """
    call = getattr(getattr(transport, "progress", None), "call", None)
    target = getattr(transport, "target", None)
    if call is not None and target is not None:  # a Blocking / Awaiting proxy
        result: Counters = call(_read, target)
        return result
    return _read(transport)


def _read(transport: Transport) -> Counters:
    traffic = transport.traffic()
    recorder = transport.recorder
    link_stats = getattr(transport, "link_stats", None)
    stats: Mapping[int, Any] = link_stats() if link_stats is not None else {}
    waits, wait_ns = recorder.waits, recorder.wait_ns
    peers = {}
    for peer, moved in traffic.peers.items():
        link = stats.get(peer)
        peers[peer] = PeerCounters(
            peer, moved.sent_bytes, moved.sent_messages, moved.received_bytes,
            moved.received_messages, moved.wire_sent_bytes, moved.wire_received_bytes,
            waits[peer] if peer < len(waits) else 0,
            (wait_ns[peer] if peer < len(wait_ns) else 0) / 1e9,
            None if link is None else int(link.total_retrans),
            transport.lost_peer_error(peer) is not None)
    return Counters(transport.rank, transport.world_size, peers,
                    collectives=recorder.recorded, flight_dumps=recorder.dumps,
                    tracing=recorder.trace is not None)


def _add_known(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else a + b


def _sum(items: Iterable[PeerCounters]) -> PeerCounters:
    total = PeerCounters(-1)
    for item in items:
        total = total + item
    return total
