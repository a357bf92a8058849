"""The one-host data path: collectives among the ranks of a group that share a host.

Ranks on one host need not push payloads through loopback TCP: they can share memory.
A ``Group`` keeps TCP for its signals and deadlines, and moves the bytes of its
collectives among same-host ranks through memory instead, when every rank allows it
(``NETDIST_SHM``). Across hosts, the two-level schedules fold inside each host and carry
every rank's share across. How the modules fit, bottom up:

- ``layout`` (PURE): which group ranks share a host (from the transport's host keys,
  ``netdist.transport.host_identity``) and so which mode the group uses: TCP, one host,
  or hierarchical (inside each host through memory, across hosts over TCP).
- ``settings`` (PURE): the switches ``NETDIST_SHM`` and ``NETDIST_SHM_COPY`` (``ShmCopy``).
- ``segments``: memfd segments one rank creates and its host's peers attach.
- ``attach``: cross-memory attach, single-copy reads and writes of a peer's arrays.
- ``turns``: ``TurnQueue``, collectives that share one resource take it in issue order.
- ``arena``: ``HostArena`` and ``HostPath``, large all-reduces and broadcasts through a
  segment's slots (or single copy through ``attach``), and the setup every rank agrees on.
- ``peer_arrays``: ``PeerArrays``, one collective's single-copy reach into the arrays of
  the host's other ranks, and the one fold order.
- ``two_level``: all-reduce, reduce-scatter, all-gather and broadcast across hosts at the
  links' bound (fold inside a host, lanes across, pipelined in pieces).
- ``lane``: ``LanePath``, small all-reduces (up to ``LANE_BYTES``) through a segment that
  the ranks poll, with TCP wake-ups.

Names resolve lazily (``netdist._lazy``): importing the PURE ``layout`` or ``settings``
does not import the others and with them asyncio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "HostLayout": "netdist.collectives.host.layout",
    "LocalMode": "netdist.collectives.host.layout",
    "MAX_LOCAL_RANKS": "netdist.collectives.host.layout",
    "ShmCopy": "netdist.collectives.host.settings",
    "shared_memory_copy": "netdist.collectives.host.settings",
    "shared_memory_enabled": "netdist.collectives.host.settings",
    "SegmentLocator": "netdist.collectives.host.segments",
    "SharedSegment": "netdist.collectives.host.segments",
    "TurnQueue": "netdist.collectives.host.turns",
    "HostArena": "netdist.collectives.host.arena",
    "HostPath": "netdist.collectives.host.arena",
    "host_all_reduce": "netdist.collectives.host.arena",
    "host_broadcast": "netdist.collectives.host.arena",
    "PeerArrays": "netdist.collectives.host.peer_arrays",
    "two_level_all_reduce": "netdist.collectives.host.two_level",
    "two_level_reduce_scatter": "netdist.collectives.host.two_level",
    "two_level_all_gather": "netdist.collectives.host.two_level",
    "two_level_broadcast": "netdist.collectives.host.two_level",
    "DEFAULT_SLOT_BYTES": "netdist.collectives.host.arena",
    "HostLane": "netdist.collectives.host.lane",
    "LanePath": "netdist.collectives.host.lane",
    "LANE_BYTES": "netdist.collectives.host.lane",
}

__all__ = [
    "HostLayout",
    "LocalMode",
    "MAX_LOCAL_RANKS",
    "ShmCopy",
    "shared_memory_copy",
    "shared_memory_enabled",
    "SegmentLocator",
    "SharedSegment",
    "TurnQueue",
    "HostArena",
    "HostPath",
    "host_all_reduce",
    "host_broadcast",
    "PeerArrays",
    "two_level_all_reduce",
    "two_level_reduce_scatter",
    "two_level_all_gather",
    "two_level_broadcast",
    "DEFAULT_SLOT_BYTES",
    "HostLane",
    "LanePath",
    "LANE_BYTES",
]

if TYPE_CHECKING:
    from netdist.collectives.host.arena import (
        DEFAULT_SLOT_BYTES,
        HostArena,
        HostPath,
        host_all_reduce,
        host_broadcast,
    )
    from netdist.collectives.host.lane import LANE_BYTES, HostLane, LanePath
    from netdist.collectives.host.layout import MAX_LOCAL_RANKS, HostLayout, LocalMode
    from netdist.collectives.host.peer_arrays import PeerArrays
    from netdist.collectives.host.segments import SegmentLocator, SharedSegment
    from netdist.collectives.host.settings import (
        ShmCopy,
        shared_memory_copy,
        shared_memory_enabled,
    )
    from netdist.collectives.host.turns import TurnQueue
    from netdist.collectives.host.two_level import (
        two_level_all_gather,
        two_level_all_reduce,
        two_level_broadcast,
        two_level_reduce_scatter,
    )
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
