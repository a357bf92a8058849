"""PURE: how many bytes crossed each link of a rank, per peer and per host (``Traffic``).

A transport counts, for every peer, two kinds of bytes:

- **payload**: the data messages exactly as the application handed them over and got
  them back (``send``'s array bytes; ``recv``'s), and how many messages. A message sent
  counts once it has been handed to the socket whole (a frame cut short by a timeout or
  a lost connection adds the payload bytes that were written, but no message); a
  message received counts once it has fully arrived, whether into a posted ``out=`` or
  held for a later ``recv``, so a frame cut short on arrival adds nothing.
- **wire**: everything written to or read from the socket -- frame prefixes and
  headers, the handshake, heartbeats, goodbyes, partial frames. 0 where there is no
  socket (``InProcessTransport``).

The running counts (``TrafficCounter``) are plain integer adds on the hot path: no
allocation per message. ``Transport.traffic()`` reads them into a ``Traffic`` snapshot,
which groups the peers by host key (``Traffic.by_host``: the link to each other host;
``Traffic.own_host``: the ranks sharing this rank's host) and subtracts, so a window is
measured as ``after - before``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["PeerTraffic", "Traffic", "TrafficCounter"]


@dataclass(frozen=True, slots=True)
class PeerTraffic:
    """Bytes and messages exchanged with one peer (or a sum over several)."""

    sent_bytes: int = 0
    """Payload bytes of data messages handed to the link."""
    sent_messages: int = 0
    """Data messages handed to the link whole."""
    received_bytes: int = 0
    """Payload bytes of data messages that fully arrived."""
    received_messages: int = 0
    """Data messages that fully arrived."""
    wire_sent_bytes: int = 0
    """Every byte written to the socket (headers, control frames, heartbeats included)."""
    wire_received_bytes: int = 0
    """Every byte read from the socket."""

    def __add__(self, other: PeerTraffic) -> PeerTraffic:
        if not isinstance(other, PeerTraffic):
            return NotImplemented
        return PeerTraffic(
            self.sent_bytes + other.sent_bytes, self.sent_messages + other.sent_messages,
            self.received_bytes + other.received_bytes,
            self.received_messages + other.received_messages,
            self.wire_sent_bytes + other.wire_sent_bytes,
            self.wire_received_bytes + other.wire_received_bytes)

    def __sub__(self, other: PeerTraffic) -> PeerTraffic:
        if not isinstance(other, PeerTraffic):
            return NotImplemented
        return PeerTraffic(
            self.sent_bytes - other.sent_bytes, self.sent_messages - other.sent_messages,
            self.received_bytes - other.received_bytes,
            self.received_messages - other.received_messages,
            self.wire_sent_bytes - other.wire_sent_bytes,
            self.wire_received_bytes - other.wire_received_bytes)

    def describe(self) -> str:
        """One line: payload (messages) and wire bytes each way."""
        return (f"sent {self.sent_bytes} B in {self.sent_messages} msgs "
                f"(wire {self.wire_sent_bytes} B), received {self.received_bytes} B in "
                f"{self.received_messages} msgs (wire {self.wire_received_bytes} B)")


_ZERO = PeerTraffic()


class TrafficCounter:
    """The running counts of one link, which the transport adds to as bytes move.

    Mutable on purpose: one object per peer (TCP: per connection), updated with plain
    integer adds where frames are written and land. ``snapshot()`` freezes it.
    """

    __slots__ = ("sent_bytes", "sent_messages", "received_bytes", "received_messages",
                 "wire_sent_bytes", "wire_received_bytes")

    def __init__(self) -> None:
        self.sent_bytes = 0
        self.sent_messages = 0
        self.received_bytes = 0
        self.received_messages = 0
        self.wire_sent_bytes = 0
        self.wire_received_bytes = 0

    def snapshot(self) -> PeerTraffic:
        """The counts so far, as an immutable ``PeerTraffic``."""
        return PeerTraffic(self.sent_bytes, self.sent_messages, self.received_bytes,
                           self.received_messages, self.wire_sent_bytes,
                           self.wire_received_bytes)


@dataclass(frozen=True)
class Traffic:
    """What one rank exchanged with each peer, as of one moment (``Transport.traffic()``).

    ``peers`` holds every other rank of the job (zeros for a peer never talked to).
    ``host_keys`` is every rank's host key in rank order (``Transport.host_keys()``), or
    ``None`` where the transport does not know them; ``by_host`` and ``own_host`` are
    then empty and zero. Counts only grow, so ``after - before`` is what moved in between.
    """

    rank: int
    peers: Mapping[int, PeerTraffic]
    host_keys: tuple[bytes, ...] | None = None
    _hosts: Mapping[bytes, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peers", MappingProxyType(dict(sorted(self.peers.items()))))
        hosts: dict[bytes, list[int]] = {}
        if self.host_keys is not None:
            for rank, key in enumerate(self.host_keys):
                hosts.setdefault(key, []).append(rank)
        object.__setattr__(self, "_hosts", MappingProxyType(
            {key: tuple(ranks) for key, ranks in hosts.items()}))

    @property
    def total(self) -> PeerTraffic:
        """The sum over every peer."""
        return _sum(self.peers.values())

    @property
    def own_host(self) -> PeerTraffic:
        """The sum over the peers on this rank's host (zero when host keys are unknown)."""
        if self.host_keys is None:
            return _ZERO
        mine = self.host_keys[self.rank]
        return _sum(t for peer, t in self.peers.items() if self.host_keys[peer] == mine)

    @property
    def by_host(self) -> Mapping[bytes, PeerTraffic]:
        """Per other host (by host key): the link from this rank to the ranks there."""
        keys = self.host_keys
        if keys is None:
            return MappingProxyType({})
        mine = keys[self.rank]
        return MappingProxyType({
            key: _sum(self.peers.get(rank, _ZERO) for rank in ranks)
            for key, ranks in self._hosts.items() if key != mine})

    def ranks_on(self, host_key: bytes) -> tuple[int, ...]:
        """The ranks whose host key is ``host_key`` (``()`` if none or keys are unknown)."""
        return self._hosts.get(host_key, ())

    def __sub__(self, before: Traffic) -> Traffic:
        """What moved between ``before`` and this snapshot (same rank required)."""
        if not isinstance(before, Traffic):
            return NotImplemented
        if before.rank != self.rank:
            raise ValueError(f"cannot subtract rank {before.rank}'s traffic from rank "
                             f"{self.rank}'s")
        return Traffic(self.rank, {peer: t - before.peers.get(peer, _ZERO)
                                   for peer, t in self.peers.items()}, self.host_keys)

    def describe(self) -> str:
        """Readable lines: the total, each other host's link, then each active peer."""
        lines = [f"rank {self.rank} total: {self.total.describe()}"]
        if self.host_keys is not None:
            lines.append(f"  own host: {self.own_host.describe()}")
            for key, link in self.by_host.items():
                ranks = ", ".join(map(str, self.ranks_on(key)))
                lines.append(f"  link to host of ranks {ranks}: {link.describe()}")
        for peer, t in self.peers.items():
            if t != _ZERO:
                lines.append(f"  rank {peer}: {t.describe()}")
        return "\n".join(lines)


def _sum(items: Iterable[PeerTraffic]) -> PeerTraffic:
    total = _ZERO
    for item in items:
        total = total + item
    return total
