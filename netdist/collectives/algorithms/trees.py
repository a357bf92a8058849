"""Binomial trees: rooted broadcast and reduce in ``ceil(log2 n)`` rounds, and the
broadcast of a byte string whose length only the root knows (``broadcast_object``).

A reduce combines operands in a fixed order (the tree's), so the root's result does not
depend on timing.
"""

from __future__ import annotations

import numpy as np

from netdist.collectives.algorithms.receive import CHECKED_BYTES, recv_like
from netdist.collectives.channel import Channel
from netdist.collectives.plan import binomial_tree
from netdist.transport.mailbox import byte_view
from netdist.reduce_kernels import combine
from netdist.types import ReduceOp

__all__ = ["tree_broadcast", "tree_broadcast_blob", "tree_reduce"]


async def tree_broadcast(chan: Channel, flat: np.ndarray, root: int) -> None:
    """Binomial-tree broadcast of the 1-D ``flat`` from group rank ``root``, in place."""
    node = chan.plan(binomial_tree, chan.rank, chan.world_size, root)
    if node.parent >= 0:
        if flat.nbytes <= CHECKED_BYTES:
            flat[...] = await recv_like(chan, node.parent, flat, None)
        else:
            await chan.recv(node.parent, flat)
    for child in reversed(node.children):
        await chan.send(child, flat)


async def tree_reduce(chan: Channel, flat: np.ndarray, op: ReduceOp, root: int,
                      result: np.ndarray) -> None:
    """Binomial-tree reduce of the 1-D ``flat`` into ``result`` on ``root``.

    ``flat`` is not modified; ``result`` (same size) receives the partial reduction on
    inner ranks and the full one on the root. Operands combine in a fixed order.
    """
    node = chan.plan(binomial_tree, chan.rank, chan.world_size, root)
    if result is not flat:
        result[...] = flat
    with chan.scratch(0 if flat.nbytes <= CHECKED_BYTES else flat.nbytes) as raw:
        scratch = None if flat.nbytes <= CHECKED_BYTES else \
            raw[:flat.nbytes].view(flat.dtype)
        for child in node.children:
            theirs = await recv_like(chan, child, flat, scratch)
            combine(op, result, theirs, result)
    if node.parent >= 0:
        await chan.send(node.parent, result)


async def tree_broadcast_blob(chan: Channel, blob: bytes, root: int) -> bytes:
    """Binomial-tree broadcast of a byte string whose length only the root knows."""
    node = chan.plan(binomial_tree, chan.rank, chan.world_size, root)
    if node.parent >= 0:
        blob = bytes(byte_view(await chan.recv(node.parent)))
    payload = np.frombuffer(blob, np.uint8)
    for child in reversed(node.children):
        await chan.send(child, payload)
    return blob
