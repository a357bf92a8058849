"""PURE the little a collective checkpoint needs from a group, as a typed ``Protocol``.

``netdist.checkpoint.save`` / ``load`` use a group's rank and size and two object
collectives: one ``all_gather_object`` per phase (every rank's plan, manifest or status)
and a ``broadcast_object`` from rank 0 (the commit verdict, the checkpoint found).
:class:`netdist.Group` satisfies :class:`GroupLike` as it is; so does any object with
these members (a subgroup, a test double, an adapter over another framework's group),
which keeps ``checkpoint`` independent of ``collectives`` (DESIGN.md: checkpoint needs
only rank, world size and a gather from the group, plus the filesystem).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["GroupLike"]


class GroupLike(Protocol):
    """What ``netdist.checkpoint.save`` and ``load`` call on their ``group``.

    Every rank of the group calls the same collectives in the same order; ``timeout``
    bounds each one (None: the group's default), and a collective that fails or times
    out on one rank must raise there rather than hang (``netdist.Group`` raises a
    ``netdist.errors`` exception naming the peer).
    """

    @property
    def rank(self) -> int:
        """This process's rank in the group, ``0 <= rank < world_size``."""
        ...

    @property
    def world_size(self) -> int:
        """How many ranks the group has."""
        ...

    async def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's msgpack-able ``obj``, in rank order, on every rank."""
        ...

    async def broadcast_object(self, obj: Any, src: int, *,
                               timeout: float | None = None) -> Any:
        """Rank ``src``'s msgpack-able ``obj`` on every rank (ignored elsewhere)."""
        ...
