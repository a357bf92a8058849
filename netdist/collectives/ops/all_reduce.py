"""``all_reduce``: on the event loop, or started on the caller's thread.

The route (``routes.plan``) is one of: the host arena, the two-level schedule across
hosts or the pipelined ring (large), the shared-memory lane or recursive doubling (small
enough for the lane), recursive doubling (small). ``start_eagerly`` is the lane route started on the caller's thread without the
event loop, for a blocking caller holding the loop (``ProgressThread.try_call``), where a
loop iteration costs more than the all-reduce itself; it runs only where ``plan`` gives
the lane route and the lane is up, so both starts take the same turn in the same order.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from netdist.collectives.channel import Channel
from netdist.collectives.host.arena import host_all_reduce
from netdist.collectives.host.two_level import two_level_all_reduce
from netdist.collectives.ops.arguments import WIRE_DTYPES, contiguous, in_place, reduce_op
from netdist.collectives.ops.context import OpContext
from netdist.collectives.algorithms.ring import ring_all_reduce
from netdist.collectives.routes import Algorithm, Operation, Turn, plan
from netdist.collectives.algorithms.doubling import doubling_all_reduce
from netdist.reduce_kernels import divide_into
from netdist.types import ReduceOp, check_reduce_dtype

__all__ = ["prepare_all_reduce", "start_eagerly"]

Body = Callable[[Channel], Awaitable[Any]]


def prepare_all_reduce(ctx: OpContext, array: Any, op: ReduceOp | str) -> Body:
    """Check ``all_reduce``'s arguments, plan its route and take its turn; the body that
    reduces ``array`` in place and returns it (the tensor for a tensor input)."""
    op = reduce_op(op)
    tensor, array = in_place(array, "all_reduce", True)
    check_reduce_dtype(op, array.dtype, "all_reduce")
    work, flat = contiguous(array)
    n = ctx.world_size
    route, ticket = ctx.route(Operation.ALL_REDUCE, flat.nbytes, flat.itemsize)
    mean = op is ReduceOp.MEAN

    async def body(chan: Channel) -> Any:
        if route.turn is Turn.HOST and ticket is not None:
            async with ctx.arena_for(route, chan, ticket) as (algorithm, arena):
                if arena is not None and algorithm is Algorithm.TWO_LEVEL:
                    await two_level_all_reduce(chan, arena, flat, op, n if mean else None,
                                               ctx.tuning.segment_bytes,
                                               ctx.tuning.pipeline_depth)
                elif arena is not None:
                    await host_all_reduce(chan, arena, flat, op, mean, route.segment,
                                          ctx.tuning.pipeline_depth)
                else:
                    await ring_all_reduce(chan, flat, op, route.segment,
                                          ctx.tuning.pipeline_depth,
                                          divisor=n if mean else None)
        elif route.otherwise is not Algorithm.NOTHING:
            if route.turn is Turn.LANE and ticket is not None:
                # inline, not a context helper: this is the small-message path
                async with ctx.lane.turn(chan, ticket) as lane:
                    if lane is not None and route.settle(lane_up=True) is Algorithm.LANE:
                        await lane.all_reduce(chan, flat, op)
                    else:
                        await doubling_all_reduce(chan, flat, op)
            else:
                await doubling_all_reduce(chan, flat, op)
            if mean:
                divide_into(flat, n)
        if work is not array:
            array[...] = work
        return array if tensor is None else tensor

    return body


def start_eagerly(ctx: OpContext, array: Any, op: ReduceOp | str,
                  channel: Callable[[], Channel]) -> tuple[np.ndarray, Body | None, Channel] | None:
    """Start ``all_reduce`` of ``array`` on this thread, where its route is the lane and
    the lane is up and idle, and ``array`` is a writeable C-contiguous NumPy array.

    ``None``: nothing was done (no tag taken); the caller runs ``all_reduce``, which runs
    the call or raises what is wrong. Started: ``(array, rest, chan)``, ``rest`` ``None``
    if the call finished here (every peer was already there or arrived within the spin
    budget), else the body that finishes it on the loop under ``chan``'s deadline.
    ``channel`` makes the call's channel, taking its tag.
    """
    lane = ctx.lane.lane
    if (lane is None or not ctx.lane.idle or not isinstance(array, np.ndarray)
            or array.dtype not in WIRE_DTYPES or not array.flags.c_contiguous
            or not array.flags.writeable):
        return None
    route = plan(Operation.ALL_REDUCE, array.nbytes, array.itemsize, ctx.world_size,
                 ctx.tuning)
    if route.turn is not Turn.LANE:
        return None
    op = reduce_op(op)
    check_reduce_dtype(op, array.dtype, "all_reduce")
    ctx.planned = Algorithm.LANE.value
    chan = channel()
    ticket = ctx.lane.ticket()
    flat = array.reshape(-1)
    n = ctx.world_size
    try:
        rnd = lane.begin(flat, op, chan.op)
        if rnd.settled:
            lane.finish(rnd, chan.op)
            if op is ReduceOp.MEAN:
                divide_into(flat, n)
    except BaseException:
        ctx.lane.done(ticket)
        raise
    if rnd.settled:
        ctx.lane.done(ticket)
        return array, None, chan

    async def rest(chan: Channel) -> None:
        try:
            await lane.complete(chan, rnd)
        finally:
            ctx.lane.done(ticket)
        if op is ReduceOp.MEAN:
            divide_into(flat, n)

    return array, rest, chan
