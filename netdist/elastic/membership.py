"""PURE: who is in an elastic job, in which order, and whether a side may carry on.

A membership is numbered (its *epoch*) and lists the members' slots in rank order: rank
``i`` of the epoch's transport is ``slots[i]``. The order is stable across epochs: the
survivors keep their relative order and joiners come after them (by slot), so the first
member is always the longest-standing one. That member leads the agreement on the next
epoch (it hosts the epoch's rendezvous); when it is lost, the next one in order leads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Membership", "has_majority", "next_order", "parse_endpoint", "format_endpoint"]


@dataclass(frozen=True, slots=True)
class Membership:
    """One epoch's members: ``slots[i]`` is rank ``i``; ``endpoints[i]`` its endpoint."""

    epoch: int
    slots: tuple[int, ...]
    endpoints: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.slots) != len(self.endpoints) or not self.slots:
            raise ValueError(f"a membership needs one endpoint per slot, got {self.slots!r} "
                             f"and {self.endpoints!r}")
        if len(set(self.slots)) != len(self.slots):
            raise ValueError(f"slots repeat in {self.slots!r}")

    @property
    def size(self) -> int:
        """How many members."""
        return len(self.slots)

    @property
    def leader(self) -> int:
        """The slot that leads the next agreement (the first member)."""
        return self.slots[0]

    def rank_of(self, slot: int) -> int:
        """The rank of ``slot`` in this epoch (``ValueError`` if it is not a member)."""
        return self.slots.index(slot)

    def endpoint_of(self, slot: int) -> str:
        """The endpoint of member ``slot``."""
        return self.endpoints[self.rank_of(slot)]

    def __str__(self) -> str:
        return f"epoch {self.epoch} (slots {', '.join(map(str, self.slots))})"


def has_majority(previous: Sequence[int], present: Iterable[int]) -> bool:
    """Whether ``present`` holds a strict majority of the ``previous`` members.

    Only a side with a strict majority of the last membership forms the next one, so two
    sides of a partition can never both carry on.
    """
    alive = set(present) & set(previous)
    return 2 * len(alive) > len(previous)


def next_order(previous: Sequence[int], survivors: Iterable[int],
               joiners: Iterable[int]) -> tuple[int, ...]:
    """The next epoch's rank order: survivors in their old order, then joiners by slot."""
    alive = set(survivors)
    kept = [slot for slot in previous if slot in alive]
    return tuple(kept + sorted(set(joiners) - set(kept)))


def parse_endpoint(text: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as ``(host, port)``; ``ValueError`` names it."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def format_endpoint(host: str, port: int) -> str:
    """``(host, port)`` as ``"host:port"`` (brackets around an IPv6 host)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
