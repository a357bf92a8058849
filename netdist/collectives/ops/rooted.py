"""Collectives with a root: ``broadcast``, ``reduce``, ``gather``, ``scatter``.

Routes (``routes.plan``): a binomial tree for small broadcasts and reduces; above the
threshold the host arena, the two-level chain across hosts or a pipelined chain (broadcast) and a ring reduce-scatter
followed by a direct gather to the root (reduce). ``gather`` and ``scatter`` are linear:
the root talks to every rank at once, and arrays may differ in shape and dtype.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from netdist.collectives.channel import Channel
from netdist.collectives.host.arena import host_broadcast
from netdist.collectives.host.two_level import two_level_broadcast
from netdist.collectives.ops.arguments import check_array, contiguous, in_place, reduce_op, tensor_io
from netdist.collectives.ops.context import OpContext
from netdist.collectives.algorithms.ring import chain_broadcast, ring_reduce_scatter
from netdist.collectives.routes import Algorithm, Operation, Turn
from netdist.collectives.algorithms.linear import linear_gather, linear_scatter
from netdist.collectives.algorithms.receive import gather_tasks
from netdist.collectives.algorithms.trees import tree_broadcast, tree_reduce
from netdist.sharding import chunk_bounds
from netdist.tensors import as_arrays, is_tensor, numpy_result, stage_out, to_tensor
from netdist.reduce_kernels import divide_into
from netdist.types import ReduceOp, check_reduce_dtype

__all__ = ["prepare_broadcast", "prepare_gather", "prepare_reduce", "prepare_scatter"]

Body = Callable[[Channel], Awaitable[Any]]


def prepare_broadcast(ctx: OpContext, array: Any, src: int) -> Body:
    """Check ``broadcast``'s arguments, plan, take the turn; the body copying ``array``
    from group rank ``src`` into ``array`` everywhere."""
    src = ctx.peer(src, "broadcast src")
    tensor, array = in_place(array, "broadcast", True)
    work, flat = contiguous(array)
    route, ticket = ctx.route(Operation.BROADCAST, flat.nbytes, flat.itemsize)

    async def body(chan: Channel) -> Any:
        if route.turn is Turn.HOST and ticket is not None:
            async with ctx.arena_for(route, chan, ticket) as (algorithm, arena):
                if arena is not None and algorithm is Algorithm.TWO_LEVEL:
                    await two_level_broadcast(chan, arena, flat, src, route.segment)
                elif arena is not None:
                    await host_broadcast(chan, arena, flat, src, route.segment)
                else:
                    await chain_broadcast(chan, flat, src, route.segment)
        elif route.otherwise is Algorithm.TREE:
            await tree_broadcast(chan, flat, src)
        if work is not array:
            array[...] = work
        return array if tensor is None else tensor

    return body


def prepare_reduce(ctx: OpContext, array: Any, dst: int, op: ReduceOp | str) -> Body:
    """Check ``reduce``'s arguments and plan; the body reducing ``array`` over all ranks
    into ``array`` on group rank ``dst`` (left unchanged elsewhere)."""
    dst = ctx.peer(dst, "reduce dst")
    op = reduce_op(op)
    root = ctx.rank == dst
    tensor, array = in_place(array, "reduce", root)
    check_reduce_dtype(op, array.dtype, "reduce")
    work, flat = contiguous(array)
    n = ctx.world_size
    route, _ = ctx.route(Operation.REDUCE, flat.nbytes, flat.itemsize)

    async def body(chan: Channel) -> Any:
        if route.otherwise is not Algorithm.NOTHING:
            if route.otherwise is Algorithm.TREE:
                await tree_reduce(chan, flat, op, dst, flat if root else flat.copy())
            else:
                await _ring_reduce(chan, flat, op, dst, route.segment)
            if root and op is ReduceOp.MEAN:
                divide_into(flat, n)
            if root and work is not array:
                array[...] = work
        return array if tensor is None else tensor

    return body


async def _ring_reduce(chan: Channel, flat: np.ndarray, op: ReduceOp, dst: int,
                       segment: int) -> None:
    """Reduce ``flat`` into ``dst``: ring reduce-scatter, then every rank sends its
    reduced chunk straight to the root."""
    bounds = chunk_bounds(flat.size, len(chan.ranks))
    lo, hi = bounds[chan.rank]
    shard = np.empty(hi - lo, flat.dtype)
    await ring_reduce_scatter(chan, flat, op, shard, segment)
    gather = chan.derive(1)
    try:
        if chan.rank != dst:
            await gather.send(dst, shard)
            return
        await gather_tasks([gather.recv(p, flat[a:b]) for p, (a, b) in enumerate(bounds)
                            if p != dst and b > a])
        flat[lo:hi] = shard
    finally:
        chan.waiting_on = gather.waiting_on


def prepare_gather(ctx: OpContext, array: Any, dst: int) -> Body:
    """Check ``gather``'s arguments; the body returning every rank's array on ``dst``
    (a list in group rank order; ``None`` elsewhere)."""
    dst = ctx.peer(dst, "gather dst")
    array, wrap, _, _ = tensor_io(array, None, "gather")
    check_array(array, "gather")
    payload = array if array.flags.c_contiguous else np.ascontiguousarray(array)

    async def body(chan: Channel) -> list[Any] | None:
        results = await linear_gather(chan, payload, dst)
        if results is None:
            return None
        if wrap:
            return [to_tensor(r) for r in results]
        return [numpy_result(r, "gather") for r in results]

    return body


def prepare_scatter(ctx: OpContext, arrays: Sequence[Any] | None, src: int,
                    out: Any) -> Body:
    """Check ``scatter``'s arguments; the body returning this rank's array from ``src``
    (in ``out`` when given)."""
    src = ctx.peer(src, "scatter src")
    n = ctx.world_size
    payloads: list[np.ndarray] | None = None
    wrap = False
    if ctx.rank == src:
        if (arrays is None or isinstance(arrays, np.ndarray) or is_tensor(arrays)
                or len(arrays) != n):
            count = "None" if arrays is None else (
                "an array" if isinstance(arrays, np.ndarray) or is_tensor(arrays)
                else f"{len(arrays)} arrays")
            raise ValueError(f"scatter: source rank {src} must pass a list of "
                             f"{n} arrays, got {count}")
        wrap = not isinstance(arrays[ctx.rank], np.ndarray)
        payloads = [np.ascontiguousarray(check_array(a, f"scatter arrays[{i}]"))
                    for i, a in enumerate(as_arrays(arrays, "scatter arrays"))]
    staged = None
    landing: np.ndarray | None = None
    if out is not None:
        if isinstance(out, np.ndarray):
            check_array(out, "scatter out=", writeable=True)
            if not out.flags.c_contiguous:
                raise ValueError("scatter: out= must be C-contiguous")
            landing = out
        else:
            staged = stage_out(out, "scatter out=")
            landing = staged.array
        if payloads is not None and payloads[src].nbytes != landing.nbytes:
            raise ValueError(f"scatter: out= holds {landing.nbytes} bytes but this rank "
                             f"sends itself {payloads[src].nbytes}")

    async def body(chan: Channel) -> Any:
        result = await linear_scatter(chan, payloads, src, landing)
        if out is None:
            return to_tensor(result) if wrap else numpy_result(result, "scatter")
        return out if staged is None else staged.finish()

    return body
