"""Recursive-doubling all-reduce: ``log2 n`` rounds of pairwise exchanges, with a fold for
a world size that is not a power of two (the ranks beyond the largest power of two hand
their data to a partner first and get the result back last).

Operands combine lower rank first on every rank, so every rank ends with bitwise-identical
results. For small messages the number of rounds, not the bytes, decides the time.
"""

from __future__ import annotations

import numpy as np

from netdist.collectives.algorithms.receive import CHECKED_BYTES, recv_like
from netdist.collectives.channel import Channel
from netdist.collectives.plan import DoublingPlan, recursive_doubling_plan
from netdist.reduce_kernels import combine
from netdist.types import ReduceOp

__all__ = ["doubling_all_reduce"]


async def doubling_all_reduce(chan: Channel, flat: np.ndarray, op: ReduceOp) -> None:
    """Recursive-doubling all-reduce of the 1-D ``flat`` in place (any world size)."""
    plan = chan.plan(recursive_doubling_plan, chan.rank, chan.world_size)
    if plan.fold_send_to >= 0:
        await chan.send(plan.fold_send_to, flat)
        if flat.nbytes <= CHECKED_BYTES:
            flat[...] = await recv_like(chan, plan.fold_send_to, flat, None)
        else:
            await chan.recv(plan.fold_send_to, flat)  # the result lands in place
        return
    if flat.nbytes <= CHECKED_BYTES:
        await _doubling_rounds(chan, flat, op, plan, None)
    else:
        with chan.scratch(flat.nbytes) as raw:
            await _doubling_rounds(chan, flat, op, plan, raw[:flat.nbytes].view(flat.dtype))
    if plan.fold_recv_from >= 0:
        await chan.send(plan.fold_recv_from, flat)


async def _doubling_rounds(chan: Channel, flat: np.ndarray, op: ReduceOp,
                           plan: DoublingPlan, scratch: np.ndarray | None) -> None:
    if plan.fold_recv_from >= 0:
        theirs = await recv_like(chan, plan.fold_recv_from, flat, scratch)
        combine(op, theirs, flat, flat)
    for peer, peer_is_lower in plan.rounds:
        theirs = await recv_like(chan, peer, flat, scratch, send=flat)
        if peer_is_lower:
            combine(op, theirs, flat, flat)
        else:
            combine(op, flat, theirs, flat)
