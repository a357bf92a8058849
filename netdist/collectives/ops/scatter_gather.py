"""``reduce_scatter`` and ``all_gather``: the two halves of a sharded all-reduce.

Both split along ``chunk_bounds`` (the first ``size % n`` chunks one element or row
longer), the rule ``shard_tensor`` uses, so a reduce-scatter's output feeds an
all-gather's ``out=`` directly. Routes: ``routes.plan`` (arena on one host, two-level
across hosts of equal size, or ring when large; the all-reduce or Bruck's all-gather when small).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import numpy as np

from netdist.collectives.channel import Channel, CollectiveMismatchError
from netdist.collectives.host.arena import HostArena
from netdist.collectives.host.settings import ShmCopy
from netdist.collectives.host.two_level import two_level_all_gather, two_level_reduce_scatter
from netdist.collectives.ops.arguments import check_array, contiguous, reduce_op, tensor_io
from netdist.collectives.ops.context import OpContext, arena_mode
from netdist.collectives.plan import offsets_from_sizes
from netdist.collectives.algorithms.ring import ring_all_gather, ring_reduce_scatter
from netdist.collectives.routes import (
    UNKNOWN_SIZE,
    Algorithm,
    Operation,
    all_gather_algorithm,
)
from netdist.collectives.algorithms.bruck import bruck_all_gather, bruck_all_gather_blobs
from netdist.collectives.algorithms.doubling import doubling_all_reduce
from netdist.sharding import chunk_bounds
from netdist.tensors import to_tensor
from netdist.reduce_kernels import divide_into
from netdist.types import ReduceOp, check_reduce_dtype, dtype_to_wire

__all__ = ["prepare_all_gather", "prepare_reduce_scatter"]

Body = Callable[[Channel], Awaitable[Any]]


def prepare_reduce_scatter(ctx: OpContext, array: Any, op: ReduceOp | str,
                           out: Any) -> Body:
    """Check ``reduce_scatter``'s arguments, plan, take the turn; the body returning this
    rank's chunk of the reduction (in ``out`` when given)."""
    op = reduce_op(op)
    array, wrap, out, staged = tensor_io(array, out, "reduce_scatter")
    check_array(array, "reduce_scatter")
    check_reduce_dtype(op, array.dtype, "reduce_scatter")
    _, flat = contiguous(array)
    n, rank = ctx.world_size, ctx.rank
    lo, hi = chunk_bounds(flat.size, n)[rank]
    if out is None:
        result = np.empty(hi - lo, array.dtype)
    else:
        check_array(out, "reduce_scatter out=", writeable=True)
        if out.dtype != array.dtype:
            raise ValueError(f"reduce_scatter: out= has dtype {out.dtype.name}, "
                             f"input has {array.dtype.name}")
        if out.size != hi - lo:
            raise ValueError(
                f"reduce_scatter: out= holds {out.size} elements but group rank "
                f"{rank}'s chunk of {flat.size} elements over {n} ranks has {hi - lo}")
        if not out.flags.c_contiguous:
            raise ValueError("reduce_scatter: out= must be C-contiguous")
        result = out
    out_flat = result.reshape(-1)
    route, ticket = ctx.route(Operation.REDUCE_SCATTER, flat.nbytes, flat.itemsize)

    async def body(chan: Channel) -> Any:
        if route.otherwise is Algorithm.NOTHING:
            out_flat[...] = flat[lo:hi]
        elif ticket is None:  # doubling over a copy, keeping the own chunk
            scratch = flat.copy()
            await doubling_all_reduce(chan, scratch, op)
            out_flat[...] = scratch[lo:hi]
        else:
            async with ctx.arena_for(route, chan, ticket) as (algorithm, arena):
                if arena is not None and algorithm is Algorithm.TWO_LEVEL:
                    await two_level_reduce_scatter(chan, arena, flat, op,
                                                   chunk_bounds(flat.size, n), out_flat,
                                                   ctx.tuning.segment_bytes)
                elif arena is not None:
                    await arena.reduce_scatter(chan, flat, op, chunk_bounds(flat.size, n),
                                               out_flat, None)
                else:
                    await ring_reduce_scatter(chan, flat, op, out_flat, route.segment)
        if op is ReduceOp.MEAN and n > 1:
            divide_into(out_flat, n)
        if staged is not None:
            return staged.finish()
        return to_tensor(result) if wrap else result

    return body


def prepare_all_gather(ctx: OpContext, shard: Any, out: Any) -> Body:
    """Check ``all_gather``'s arguments, plan, take the turn; the body returning every
    rank's shard concatenated along axis 0 (in ``out`` when given)."""
    shard, wrap, out, staged = tensor_io(shard, out, "all_gather")
    check_array(shard, "all_gather")
    mine = shard.reshape(1) if shard.ndim == 0 else shard
    mine = mine if mine.flags.c_contiguous else np.ascontiguousarray(mine)
    n, rank = ctx.world_size, ctx.rank
    trailing = mine.shape[1:]
    row = int(np.prod(trailing, dtype=np.int64))
    rows: list[int] = []
    if out is not None:
        check_array(out, "all_gather out=", writeable=True)
        if out.dtype != mine.dtype:
            raise ValueError(f"all_gather: out= has dtype {out.dtype.name}, shard has "
                             f"{mine.dtype.name}")
        if out.ndim == 0 or out.shape[1:] != trailing:
            raise ValueError(f"all_gather: out= has shape {out.shape}; expected "
                             f"(rows, {', '.join(map(str, trailing))}) for shards of "
                             f"shape {shard.shape}")
        if not out.flags.c_contiguous:
            raise ValueError("all_gather: out= must be C-contiguous")
        rows = [b - a for a, b in chunk_bounds(out.shape[0], n)]
        if rows[rank] != mine.shape[0]:
            raise ValueError(
                f"all_gather: out= has {out.shape[0]} rows, so group rank {rank} "
                f"must contribute {rows[rank]} rows (chunk_bounds over {n} ranks) "
                f"but its shard has {mine.shape[0]}")
    # without out= the total size is only known after the shape exchange
    route, ticket = ctx.route(Operation.ALL_GATHER,
                              UNKNOWN_SIZE if out is None else out.nbytes, mine.itemsize)

    async def body(chan: Channel) -> Any:
        if ticket is None:
            return await gather(chan, None)
        async with ctx.host.turn(chan, ticket) as arena:
            return await gather(chan, arena)

    async def gather(chan: Channel, arena: HostArena | None) -> Any:
        if out is None:
            sizes = await _exchange_shapes(chan, mine, rank)
            result = np.empty((sum(sizes), *trailing), mine.dtype)
        else:
            sizes, result = rows, out
        out_flat = result.reshape(-1)
        chunks = tuple((a * row, b * row) for a, b in offsets_from_sizes(sizes))
        a, b = chunks[rank]
        place, own = out_flat[a:b], mine.reshape(-1)
        if place.ctypes.data != own.ctypes.data:  # not already in place
            place[...] = own
        algorithm, segment = all_gather_algorithm(
            route, out_flat.nbytes, out_flat.itemsize, n, arena_mode(arena), ctx.tuning,
            arena is not None and arena.copy is ShmCopy.SINGLE, ctx.across_hosts)
        if algorithm is not Algorithm.NOTHING:
            data = chan.derive(1)
            try:
                if algorithm is Algorithm.ARENA and arena is not None:
                    await arena.all_gather(chan, out_flat, chunks)
                elif algorithm is Algorithm.TWO_LEVEL and arena is not None:
                    await two_level_all_gather(chan, arena, out_flat, chunks, segment)
                elif algorithm is Algorithm.BRUCK:
                    await bruck_all_gather(data, out_flat, chunks)
                else:
                    await ring_all_gather(data, out_flat, chunks, segment)
            finally:
                chan.waiting_on = data.waiting_on
        if staged is not None:
            return staged.finish()
        return to_tensor(result) if wrap else result

    return body


async def _exchange_shapes(chan: Channel, mine: np.ndarray, rank: int) -> list[int]:
    """All-gather every rank's shard shape and dtype; ``CollectiveMismatchError`` if
    trailing dims or dtypes differ (raised identically on every rank)."""
    name = dtype_to_wire(mine.dtype)  # bfloat16 is one name with or without ml_dtypes
    meta = msgpack.packb([name, list(mine.shape)])
    blobs = await bruck_all_gather_blobs(chan, meta)
    sizes = []
    for source, blob in enumerate(blobs):
        dtype_name, shape = msgpack.unpackb(blob)
        if dtype_name != name or tuple(shape[1:]) != mine.shape[1:]:
            raise CollectiveMismatchError(
                f"all_gather: group rank {source} has a {dtype_name} shard of shape "
                f"{tuple(shape)} but group rank {rank} has {name} "
                f"{mine.shape}; dtype and trailing dims must agree")
        sizes.append(int(shape[0]))
    return sizes
