"""``OpContext``: what a collective operation sees of its group.

A group hands the same context to every operation it issues: who takes part (the
transport, the members, this rank), how the algorithms are tuned, and the two one-host
paths whose turns calls queue for in issue order (the arena for large messages, the lane
for small all-reduces). Operations never reach back into ``Group``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.collectives.host.layout import LocalMode
from netdist.collectives.host.settings import ShmCopy
from netdist.collectives.host.lane import LanePath
from netdist.collectives.host.arena import HostArena, HostPath
from netdist.collectives.ops.arguments import timeout_value
from netdist.collectives.tags import P2P_BIT, P2P_TAG_LIMIT
from netdist.collectives.channel import Channel
from netdist.collectives.routes import Algorithm, Operation, Route, Turn, Tuning, plan
from netdist.trace.recorder import ROUTE_FIELD
from netdist.transport.base import Transport

__all__ = ["OpContext", "arena_mode", "route_name", "settle", "spans_hosts"]


@dataclass
class OpContext:
    """Members, tuning and one-host paths of one group, shared by its operations."""

    transport: Transport
    ranks: tuple[int, ...]
    """Group rank -> transport rank."""
    rank: int
    """This process's group rank (-1: not a member)."""
    tuning: Tuning
    host: HostPath
    lane: LanePath
    timeout: float
    """The group's default deadline of each call, in seconds."""
    tag_base: int
    """The group's tag namespace (``netdist.collectives.tags``)."""
    across_hosts: bool = False
    """The members span several hosts (by the transport's host keys): mid-sized messages
    take the bandwidth-optimal routes (``routes.small_bytes``)."""
    planned: str = ""
    """The route the call being issued planned (``route_name``), for the flight recorder:
    set by ``route`` and taken by the group as it makes the call's channel."""

    def take_planned(self) -> str:
        """The route planned by the call being issued ("" if it planned none); cleared."""
        planned, self.planned = self.planned, ""
        return planned

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def peer(self, peer: Any, what: str) -> int:
        """``peer`` as a group rank; ``TypeError`` / ``ValueError`` naming ``what``."""
        if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool):
            raise TypeError(f"{what} must be an int group rank, got {type(peer).__name__}")
        if not 0 <= peer < len(self.ranks):
            raise ValueError(f"{what} {peer} is outside 0..{len(self.ranks) - 1}")
        return int(peer)

    def deadline(self, timeout: float | None) -> float:
        """A point-to-point call's deadline: ``timeout`` (checked) or the group's."""
        return timeout_value(timeout, "timeout") or self.timeout

    def p2p_tag(self, tag: Any) -> int:
        """The wire tag of the group's point-to-point ``tag`` (< ``P2P_TAG_LIMIT``)."""
        if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool):
            raise TypeError(f"tag must be an int, got {type(tag).__name__}")
        if not 0 <= tag < P2P_TAG_LIMIT:
            raise ValueError(f"group send/recv tag must be in 0..{P2P_TAG_LIMIT - 1}, got {tag}")
        return self.tag_base | P2P_BIT | int(tag)

    def route(self, op: Operation, nbytes: int, itemsize: int) -> tuple[Route, int | None]:
        """The route of a call (``routes.plan``) and its turn's ticket, taken now, at issue,
        in issue order (``None``: the route takes no turn)."""
        route = plan(op, nbytes, itemsize, len(self.ranks), self.tuning, self.across_hosts)
        self.planned = route_name(route)
        if route.turn is Turn.HOST:
            return route, self.host.ticket()
        if route.turn is Turn.LANE:
            return route, self.lane.ticket()
        return route, None

    @contextlib.asynccontextmanager
    async def arena_for(self, route: Route, chan: Channel, ticket: int
                        ) -> AsyncIterator[tuple[Algorithm, HostArena | None]]:
        """Hold ``route``'s host turn (``ticket``) for the block and give the algorithm the
        route settles on there (``Route.settle``) with the arena it runs on, or ``None``
        with the route's TCP algorithm. Not on the small-message path (host turns are for
        large calls)."""
        async with self.host.turn(chan, ticket) as arena:
            algorithm = settle(route, arena)
            if chan.record is not None:
                chan.record[ROUTE_FIELD] = algorithm.value
            shared = algorithm in (Algorithm.ARENA, Algorithm.TWO_LEVEL)
            yield algorithm, arena if shared else None


def route_name(route: Route) -> str:
    """How a flight record names ``route`` before its turn settles it: the algorithm, or
    ``"shared / otherwise"`` for a route that depends on its turn."""
    if route.turn is Turn.NONE:
        return route.otherwise.value
    return f"{route.shared.value} / {route.otherwise.value}"


def settle(route: Route, arena: HostArena | None) -> Algorithm:
    """``route.settle`` for the arena a host turn gave (``None``: no arena)."""
    if arena is None:
        return route.settle()
    return route.settle(arena=arena.layout.mode, single_copy=arena.copy is ShmCopy.SINGLE)


def arena_mode(arena: HostArena | None) -> LocalMode | None:
    """The ``LocalMode`` of the arena a host turn gave (``None``: no arena)."""
    return None if arena is None else arena.layout.mode


def spans_hosts(transport: Transport, ranks: tuple[int, ...]) -> bool:
    """Whether the transport ranks ``ranks`` are on more than one host (by the host keys
    the transport learnt at rendezvous; ``False`` where it knows none)."""
    keys = transport.host_keys()
    return keys is not None and len({keys[r] for r in ranks}) > 1
