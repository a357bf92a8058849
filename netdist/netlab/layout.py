"""PURE: how many ranks run on each host of a test cluster.

``ClusterLayout.parse("2x4")`` is 2 hosts of 4 ranks; ``"1,2,3"`` is 3 hosts with 1, 2
and 3 ranks. Ranks are numbered host-major, as launchers number them: host 0 has ranks
``0 .. R0-1``, host 1 the next ``R1``, and so on; a rank's local rank is its place on its
host. Nothing here touches the network (``netdist.netlab.cluster`` builds the hosts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ClusterLayout"]

_GRID = re.compile(r"\s*(\d+)\s*[xX]\s*(\d+)\s*")


@dataclass(frozen=True, slots=True)
class ClusterLayout:
    """Ranks per host, host 0 first."""

    ranks_per_host: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ranks_per_host:
            raise ValueError("a cluster layout needs at least one host")
        if any(not isinstance(r, int) or r < 1 for r in self.ranks_per_host):
            raise ValueError(f"every host needs at least one rank, got {self.ranks_per_host}")

    @classmethod
    def parse(cls, text: str) -> ClusterLayout:
        """``"HxR"`` (H hosts of R ranks) or ``"R0,R1,..."`` (one count per host)."""
        grid = _GRID.fullmatch(text)
        if grid is not None:
            hosts, ranks = int(grid.group(1)), int(grid.group(2))
            if hosts < 1 or ranks < 1:
                raise ValueError(f"layout {text!r}: hosts and ranks must be at least 1")
            return cls((ranks,) * hosts)
        parts = [part.strip() for part in text.split(",")]
        if not parts or not all(part.isdigit() for part in parts):
            raise ValueError(f"cannot parse layout {text!r}: expected HOSTSxRANKS (2x4) or "
                             "ranks per host (1,2,3)")
        try:
            return cls(tuple(int(part) for part in parts))
        except ValueError as exc:
            raise ValueError(f"layout {text!r}: {exc}") from None

    @property
    def hosts(self) -> int:
        """How many hosts."""
        return len(self.ranks_per_host)

    @property
    def world_size(self) -> int:
        """How many ranks in all."""
        return sum(self.ranks_per_host)

    @property
    def uniform(self) -> bool:
        """Whether every host runs as many ranks."""
        return len(set(self.ranks_per_host)) == 1

    def first_rank(self, host: int) -> int:
        """The lowest rank on ``host``."""
        self._check_host(host)
        return sum(self.ranks_per_host[:host])

    def ranks_of(self, host: int) -> range:
        """The ranks on ``host``."""
        first = self.first_rank(host)
        return range(first, first + self.ranks_per_host[host])

    def host_of(self, rank: int) -> int:
        """The host ``rank`` runs on."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        for host, count in enumerate(self.ranks_per_host):
            if rank < count:
                return host
            rank -= count
        raise AssertionError("unreachable: the rank was range-checked")

    def local_rank(self, rank: int) -> int:
        """``rank``'s place among the ranks of its host."""
        return rank - self.first_rank(self.host_of(rank))

    def _check_host(self, host: int) -> None:
        if not 0 <= host < self.hosts:
            raise ValueError(f"host {host} is not in a cluster of {self.hosts} hosts")

    def __str__(self) -> str:
        if self.uniform and self.hosts > 1:
            return f"{self.hosts}x{self.ranks_per_host[0]}"
        return ",".join(str(r) for r in self.ranks_per_host)
