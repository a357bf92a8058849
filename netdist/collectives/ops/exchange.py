"""Collectives without a root or a size-dependent route: ``all_to_all``, ``barrier``,
``monitored_barrier`` and the object collectives.

``all_to_all`` runs every pairwise exchange at once; ``barrier`` is the dissemination
barrier (no root, ``ceil(log2 n)`` rounds); ``monitored_barrier`` goes through group
rank 0, which names the ranks that did not arrive (``netdist.collectives.algorithms.barrier``);
the object collectives move msgpack blobs by Bruck's all-gather and the binomial tree.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from netdist.collectives.channel import Channel
from netdist.collectives.algorithms.barrier import root_monitored_barrier
from netdist.collectives.objects import pack_object_blob, unpack_object_blob
from netdist.collectives.ops.arguments import check_array
from netdist.collectives.ops.context import OpContext
from netdist.collectives.algorithms.barrier import dissemination_barrier
from netdist.collectives.algorithms.bruck import bruck_all_gather_blobs
from netdist.collectives.algorithms.linear import all_to_all_exchange
from netdist.collectives.algorithms.trees import tree_broadcast_blob
from netdist.tensors import as_arrays, stage_out

__all__ = [
    "prepare_all_gather_object",
    "prepare_all_to_all",
    "prepare_barrier",
    "prepare_broadcast_object",
    "prepare_monitored_barrier",
]

Body = Callable[[Channel], Awaitable[Any]]


def prepare_all_to_all(ctx: OpContext, inputs: Sequence[Any], outputs: Sequence[Any]) -> Body:
    """Check ``all_to_all``'s arguments; the body sending ``inputs[j]`` to group rank
    ``j`` and receiving its array for this rank into ``outputs[j]``."""
    n, me = ctx.world_size, ctx.rank
    if len(inputs) != n or len(outputs) != n:
        raise ValueError(f"all_to_all needs {n} input and {n} output arrays (one per "
                         f"member), got {len(inputs)} and {len(outputs)}")
    sends = [np.ascontiguousarray(check_array(a, f"all_to_all inputs[{j}]"))
             for j, a in enumerate(as_arrays(inputs, "all_to_all inputs"))]
    staged = [None if isinstance(o, np.ndarray) else stage_out(o, f"all_to_all outputs[{j}]")
              for j, o in enumerate(outputs)]
    landings: list[np.ndarray] = [o if s is None else s.array  # type: ignore[misc]
                                  for o, s in zip(outputs, staged)]
    for j, out in enumerate(landings):
        check_array(out, f"all_to_all outputs[{j}]", writeable=True)
        if not out.flags.c_contiguous:
            raise ValueError(f"all_to_all: outputs[{j}] must be C-contiguous")
    if landings[me].nbytes != sends[me].nbytes:
        raise ValueError(f"all_to_all: outputs[{me}] holds {landings[me].nbytes} bytes "
                         f"but this rank sends itself {sends[me].nbytes}")

    async def body(chan: Channel) -> Sequence[Any]:
        await all_to_all_exchange(chan, sends, landings)
        for s in staged:
            if s is not None:
                s.finish()
        return outputs

    return body


def prepare_barrier(ctx: OpContext) -> Body:
    """The dissemination barrier."""
    async def body(chan: Channel) -> None:
        await dissemination_barrier(chan)

    return body


def prepare_monitored_barrier(ctx: OpContext, seconds: float, wait_all_ranks: bool) -> Body:
    """The barrier through group rank 0 that names who did not arrive within ``seconds``."""
    async def body(chan: Channel) -> None:
        await root_monitored_barrier(chan, seconds, wait_all_ranks)

    return body


def prepare_all_gather_object(ctx: OpContext, obj: Any) -> Body:
    """Encode ``obj`` now; the body returning every rank's object in group rank order
    (a rank that could not encode raises ``TypeError``, the others name it)."""
    blob, error = pack_object_blob(obj, "all_gather_object")

    async def body(chan: Channel) -> list[Any]:
        blobs = await bruck_all_gather_blobs(chan, blob)
        if error is not None:
            raise error
        return [unpack_object_blob(b, chan.op, source) for source, b in enumerate(blobs)]

    return body


def prepare_broadcast_object(ctx: OpContext, obj: Any, src: int) -> Body:
    """Encode ``obj`` on ``src``; the body returning ``src``'s object on every rank."""
    src = ctx.peer(src, "broadcast_object src")
    blob, error = (pack_object_blob(obj, "broadcast_object") if ctx.rank == src
                   else (b"", None))

    async def body(chan: Channel) -> Any:
        received = await tree_broadcast_blob(chan, blob, src)
        if error is not None:
            raise error
        return unpack_object_blob(received, chan.op, src)

    return body
