"""PURE: which group ranks share a host, and which algorithm family that allows.

Every rank computes the same ``HostLayout`` from the same gathered host keys, so the
choice between TCP, shared memory on one host and the hierarchical algorithms is made
identically everywhere without another message.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HostLayout", "LocalMode", "MAX_LOCAL_RANKS"]

MAX_LOCAL_RANKS = 32
"""Most ranks of one group on one host that share a segment. Every rank signals every
other rank of its host twice per round, so beyond this the signals (and the connections
they need) cost more than loopback TCP saves; such groups use TCP."""


class LocalMode(enum.Enum):
    """How a group's large collectives move their payload."""

    TCP = "tcp"
    """Every payload over TCP: shared memory is off somewhere, or no two ranks share a host,
    or a host holds more than ``MAX_LOCAL_RANKS`` of the group's ranks."""
    SINGLE_HOST = "single-host"
    """All ranks on one host: payloads through one shared segment, TCP for signals only."""
    HIERARCHICAL = "hierarchical"
    """Several hosts with the same number (>= 2) of ranks each: inside a host through shared
    memory, across hosts over TCP between the ranks of equal local index."""
    UNEVEN_HOSTS = "uneven hosts"
    """Several hosts holding different numbers of the group's ranks, some two or more: the
    two-level all-reduce and broadcast use ``lanes`` (the smallest host's rank count)
    ranks per host across hosts; the other collectives go over TCP."""


@dataclass(frozen=True)
class HostLayout:
    """The group's ranks by host. ``hosts`` lists each host's group ranks in ascending order,
    hosts ordered by their lowest rank; ``host`` and ``local`` locate ``rank`` in it."""

    mode: LocalMode
    hosts: tuple[tuple[int, ...], ...]
    rank: int
    host: int
    local: int

    @classmethod
    def from_keys(cls, keys: Sequence[bytes], enabled: Sequence[bool], rank: int) -> HostLayout:
        """Group ranks by equal ``keys``; the mode is TCP unless every rank has shared memory
        ``enabled`` and the hosts allow one of the shared-memory modes."""
        order: dict[bytes, list[int]] = {}
        for r, key in enumerate(keys):
            order.setdefault(key, []).append(r)
        hosts = tuple(tuple(members) for members in order.values())
        sizes = {len(members) for members in hosts}
        if not all(enabled) or max(sizes) < 2 or max(sizes) > MAX_LOCAL_RANKS:
            mode = LocalMode.TCP
        elif len(hosts) == 1:
            mode = LocalMode.SINGLE_HOST
        elif len(sizes) > 1:
            mode = LocalMode.UNEVEN_HOSTS
        else:
            mode = LocalMode.HIERARCHICAL
        host = _host_of(hosts, rank)
        return cls(mode, hosts, rank, host, hosts[host].index(rank))

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """Group ranks on this rank's host, in order (local index = position)."""
        return self.hosts[self.host]

    @property
    def cross_ranks(self) -> tuple[int, ...]:
        """Group ranks with this rank's local index, one per host, in host order (hosts
        with the same number of ranks each)."""
        return self.lane(self.local)

    @property
    def lanes(self) -> int:
        """How many ranks of every host carry data across hosts: the smallest host's rank
        count (local indices ``0 .. lanes - 1``)."""
        return min(len(members) for members in self.hosts)

    def lane(self, index: int) -> tuple[int, ...]:
        """The group ranks of local index ``index`` (< ``lanes``), one per host, in host
        order: the ranks that carry lane ``index``'s share across hosts."""
        return tuple(members[index] for members in self.hosts)

    def host_of(self, rank: int) -> int:
        """The index in ``hosts`` of group rank ``rank``'s host."""
        return _host_of(self.hosts, rank)

    @property
    def is_leader(self) -> bool:
        """The lowest rank of its host creates the host's segment."""
        return self.local == 0


def _host_of(hosts: tuple[tuple[int, ...], ...], rank: int) -> int:
    """The index in ``hosts`` of the host holding ``rank``."""
    return next(h for h, members in enumerate(hosts) if rank in members)
