"""Collectives over any ``Transport``: ``Group`` (all_reduce, reduce_scatter, all_gather,
broadcast, gather, scatter, reduce, barrier, monitored_barrier, object collectives, p2p
and recv_any), subgroups and ``Work`` handles for overlapped communication;
``QuantizedReducer`` for int8 / int4 all-reduce and reduce-scatter.

::

    from netdist.collectives import Group
    group = Group(transport)
    await group.all_reduce(grads, op=ReduceOp.MEAN)
    work = await group.all_gather(shard, async_op=True)
    full = await work

The one-host data path (shared memory among the ranks of a host) is the subpackage
``netdist.collectives.host``.

Names resolve lazily (``netdist._lazy``): importing the PURE ``netdist.collectives.plan``
or ``netdist.collectives.host.layout`` does not import ``group.py`` and with it asyncio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "Group": "netdist.collectives.group",
    "Work": "netdist.collectives.work",
    "QuantizedReducer": "netdist.collectives.quantized",
    "DeviceMesh": "netdist.collectives.mesh",
    "CollectiveMismatchError": "netdist.errors",
    "DEFAULT_SMALL_MESSAGE_BYTES": "netdist.collectives.routes",
    "DEFAULT_SEGMENT_BYTES": "netdist.collectives.routes",
    "P2P_TAG_LIMIT": "netdist.collectives.group",
}

__all__ = [
    "Group",
    "Work",
    "QuantizedReducer",
    "DeviceMesh",
    "CollectiveMismatchError",
    "DEFAULT_SMALL_MESSAGE_BYTES",
    "DEFAULT_SEGMENT_BYTES",
    "P2P_TAG_LIMIT",
]

if TYPE_CHECKING:
    from netdist.collectives.group import P2P_TAG_LIMIT, Group
    from netdist.collectives.mesh import DeviceMesh
    from netdist.collectives.quantized import QuantizedReducer
    from netdist.collectives.routes import DEFAULT_SEGMENT_BYTES, DEFAULT_SMALL_MESSAGE_BYTES
    from netdist.collectives.work import Work
    from netdist.errors import CollectiveMismatchError
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
