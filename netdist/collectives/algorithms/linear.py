"""Linear exchanges: the root talks to every rank at once (``gather``, ``scatter``), and
every pair at once (``all_to_all``). Arrays may differ in shape and dtype; the time is
that of the busiest link.
"""

from __future__ import annotations

import numpy as np

from netdist.collectives.algorithms.receive import gather_tasks, recv_exact
from netdist.collectives.channel import Channel
from netdist.transport.mailbox import byte_view

__all__ = ["all_to_all_exchange", "linear_gather", "linear_scatter"]


async def linear_gather(chan: Channel, array: np.ndarray, root: int) -> list[np.ndarray] | None:
    """Every rank sends ``array`` to ``root``; the root receives all concurrently."""
    if chan.rank != root:
        await chan.send(root, array)
        return None
    peers = [p for p in range(chan.world_size) if p != root]
    received = await gather_tasks([chan.recv(p) for p in peers])
    results: list[np.ndarray] = []
    for p in range(chan.world_size):
        results.append(array.copy() if p == root else received[p - (p > root)])
    return results


async def linear_scatter(chan: Channel, arrays: list[np.ndarray] | None,
                         root: int, out: np.ndarray | None = None) -> np.ndarray:
    """The root sends ``arrays[i]`` to group rank ``i``; returns this rank's array (in
    ``out`` if given: C-contiguous, holding exactly the bytes this rank gets)."""
    if chan.rank != root:
        return await chan.recv(root, out)
    if arrays is None:  # validated by the caller; kept for type narrowing
        raise ValueError("scatter needs arrays on the source rank")
    await gather_tasks([chan.send(p, arrays[p])
                         for p in range(chan.world_size) if p != root])
    if out is None:
        return arrays[root].copy()
    if arrays[root].nbytes:
        byte_view(out)[...] = byte_view(arrays[root])
    return out


async def all_to_all_exchange(chan: Channel, sends: list[np.ndarray],
                              outputs: list[np.ndarray]) -> None:
    """Rank ``i`` sends ``sends[j]`` to rank ``j`` and receives rank ``j``'s array into
    ``outputs[j]``, with every send and receive in flight at once."""
    me = chan.rank
    outputs[me].reshape(-1).view(np.uint8)[...] = sends[me].reshape(-1).view(np.uint8)
    peers = [p for p in range(chan.world_size) if p != me]
    await gather_tasks([chan.send(p, sends[p]) for p in peers]
                       + [recv_exact(chan, p, outputs[p]) for p in peers])
