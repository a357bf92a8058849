"""Collectives over any ``Transport``: ``Group`` (all_reduce, reduce_scatter, all_gather,
broadcast, gather, scatter, reduce, barrier, object collectives, p2p), subgroups and
``Work`` handles for overlapped communication.

::

    from netdist.collectives import Group
    group = Group(transport)
    await group.all_reduce(grads, op=ReduceOp.MEAN)
    work = await group.all_gather(shard, async_op=True)
    full = await work
"""

from netdist.errors import CollectiveMismatchError
from netdist.collectives.group import (
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_SMALL_MESSAGE_BYTES,
    P2P_TAG_LIMIT,
    Group,
)
from netdist.collectives.work import Work

__all__ = [
    "Group",
    "Work",
    "CollectiveMismatchError",
    "DEFAULT_SMALL_MESSAGE_BYTES",
    "DEFAULT_SEGMENT_BYTES",
    "P2P_TAG_LIMIT",
]
