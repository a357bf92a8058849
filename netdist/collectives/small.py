"""Latency-optimal executors for small messages: recursive doubling, binomial trees,
Bruck all-gather, dissemination barrier, linear gather and scatter.

Each runs a pure plan from ``plan.py`` with one message per peer per round; for small
arrays the number of rounds (``ceil(log2 n)``), not the bytes, decides the time.
"""

from __future__ import annotations

import asyncio

import numpy as np

from netdist.collectives.channel import Channel, CollectiveMismatchError
from netdist.collectives.plan import (
    DoublingPlan,
    binomial_tree,
    bruck_allgather_plan,
    dissemination_partners,
    recursive_doubling_plan,
)
from netdist.transport.barrier import dissemination_rounds
from netdist.transport.mailbox import byte_view
from netdist.types import ReduceOp, combine

__all__ = [
    "doubling_all_reduce",
    "tree_broadcast",
    "tree_reduce",
    "bruck_all_gather",
    "bruck_all_gather_blobs",
    "dissemination_barrier",
    "linear_gather",
    "linear_scatter",
    "gather_tasks",
    "all_to_all_exchange",
    "tree_broadcast_blob",
]

_EMPTY = np.empty(0, np.uint8)


def _check_same(chan: Channel, mine: np.ndarray, theirs: np.ndarray, peer: int) -> None:
    if theirs.nbytes != mine.nbytes or theirs.dtype != mine.dtype:
        raise CollectiveMismatchError(
            f"{chan.op}: group rank {peer} contributed {theirs.dtype.name}"
            f"{list(theirs.shape)} ({theirs.nbytes} bytes) but group rank {chan.rank} "
            f"has {mine.dtype.name}[{mine.size}] ({mine.nbytes} bytes); every rank must "
            "pass the same shape and dtype")


CHECKED_BYTES = 4096
"""Up to this size messages are received into fresh arrays and their dtype and shape
compared with ours (a mismatch is reported by rank, at no cost that matters); larger
ones land in pooled scratch (``out=``), where the transport checks the byte size."""


async def _recv_like(chan: Channel, peer: int, like: np.ndarray,
                     scratch: np.ndarray | None, send: np.ndarray | None = None) -> np.ndarray:
    """Receive from ``peer`` a message shaped like ``like`` (sending ``send`` first)."""
    if send is not None:
        incoming = await chan.exchange(peer, send, out=scratch)
    else:
        incoming = await chan.recv(peer, scratch)
    if scratch is None:
        _check_same(chan, like, incoming, peer)
        return incoming.reshape(-1)
    return incoming


async def doubling_all_reduce(chan: Channel, flat: np.ndarray, op: ReduceOp) -> None:
    """Recursive-doubling all-reduce of the 1-D ``flat`` in place (any world size)."""
    plan = chan.plan(recursive_doubling_plan, chan.rank, chan.world_size)
    if plan.fold_send_to >= 0:
        await chan.send(plan.fold_send_to, flat)
        if flat.nbytes <= CHECKED_BYTES:
            flat[...] = await _recv_like(chan, plan.fold_send_to, flat, None)
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
        theirs = await _recv_like(chan, plan.fold_recv_from, flat, scratch)
        combine(op, theirs, flat, flat)
    for peer, peer_is_lower in plan.rounds:
        theirs = await _recv_like(chan, peer, flat, scratch, send=flat)
        if peer_is_lower:
            combine(op, theirs, flat, flat)
        else:
            combine(op, flat, theirs, flat)


async def tree_broadcast(chan: Channel, flat: np.ndarray, root: int) -> None:
    """Binomial-tree broadcast of the 1-D ``flat`` from group rank ``root``, in place."""
    node = chan.plan(binomial_tree, chan.rank, chan.world_size, root)
    if node.parent >= 0:
        if flat.nbytes <= CHECKED_BYTES:
            flat[...] = await _recv_like(chan, node.parent, flat, None)
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
            theirs = await _recv_like(chan, child, flat, scratch)
            combine(op, result, theirs, result)
    if node.parent >= 0:
        await chan.send(node.parent, result)


async def bruck_all_gather(chan: Channel, out_flat: np.ndarray,
                           chunks: tuple[tuple[int, int], ...]) -> None:
    """Bruck all-gather into ``out_flat``; this rank's chunk must already be in place.

    Each round packs the blocks it forwards into one message (small data, so the copy is
    cheap) and unpacks the received blocks into their final positions.
    """
    rank = chan.rank
    for index, rnd in enumerate(chan.plan(bruck_allgather_plan, rank, chan.world_size)):
        if len(rnd.send_blocks) == 1:
            a, b = chunks[rnd.send_blocks[0]]
            payload = out_flat[a:b]
        else:
            payload = np.concatenate([out_flat[chunks[c][0]:chunks[c][1]]
                                      for c in rnd.send_blocks])
        expected = sum(chunks[c][1] - chunks[c][0] for c in rnd.recv_blocks)
        incoming = (await chan.exchange(rnd.send_to, payload, rnd.recv_from)).reshape(-1)
        if incoming.size != expected or incoming.dtype != out_flat.dtype:
            raise CollectiveMismatchError(
                f"{chan.op}: group rank {rnd.recv_from} sent {incoming.dtype.name}"
                f"[{incoming.size}] in round {index} but {out_flat.dtype.name}[{expected}] "
                "was expected from the agreed shard sizes")
        offset = 0
        for c in rnd.recv_blocks:
            a, b = chunks[c]
            out_flat[a:b] = incoming[offset:offset + b - a]
            offset += b - a


async def bruck_all_gather_blobs(chan: Channel, blob: bytes) -> list[bytes]:
    """All-gather one byte string per rank (any lengths) with Bruck's algorithm.

    Messages are a 8-byte-per-block length table followed by the blocks, so no separate
    size exchange is needed.
    """
    n = chan.world_size
    blobs: list[bytes | None] = [None] * n
    blobs[chan.rank] = blob
    for index, rnd in enumerate(chan.plan(bruck_allgather_plan, chan.rank, n)):
        parts = [blobs[c] for c in rnd.send_blocks]
        lengths = np.array([len(p) for p in parts], dtype="<u8")  # type: ignore[arg-type]
        message = lengths.tobytes() + b"".join(parts)  # type: ignore[arg-type]
        incoming = bytes(byte_view(await chan.exchange(
            rnd.send_to, np.frombuffer(message, np.uint8), rnd.recv_from)))
        count = len(rnd.recv_blocks)
        table = np.frombuffer(incoming[:8 * count], dtype="<u8")
        if table.size != count or 8 * count + int(table.sum()) != len(incoming):
            raise CollectiveMismatchError(
                f"{chan.op}: malformed all-gather message from group rank {rnd.recv_from} "
                f"in round {index}")
        offset = 8 * count
        for c, length in zip(rnd.recv_blocks, table.tolist(), strict=True):
            blobs[c] = incoming[offset:offset + length]
            offset += length
    return blobs  # type: ignore[return-value]


async def tree_broadcast_blob(chan: Channel, blob: bytes, root: int) -> bytes:
    """Binomial-tree broadcast of a byte string whose length only the root knows."""
    node = chan.plan(binomial_tree, chan.rank, chan.world_size, root)
    if node.parent >= 0:
        blob = bytes(byte_view(await chan.recv(node.parent)))
    payload = np.frombuffer(blob, np.uint8)
    for child in reversed(node.children):
        await chan.send(child, payload)
    return blob


async def dissemination_barrier(chan: Channel) -> None:
    """Barrier in ``ceil(log2 n)`` rounds of empty messages (no root): the transport's
    dissemination barrier on group ranks, on the operation's tag, bounded by the group."""
    await dissemination_rounds(chan.rank,
                               chan.plan(dissemination_partners, chan.rank, chan.world_size),
                               lambda peer, _: chan.send(peer, _EMPTY),
                               lambda peer, _: chan.recv(peer))


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
                       + [_recv_exact(chan, p, outputs[p]) for p in peers])


async def _recv_exact(chan: Channel, peer: int, out: np.ndarray) -> None:
    received = await chan.recv(peer, out=out)
    if received.nbytes != out.nbytes:
        raise CollectiveMismatchError(
            f"{chan.op}: group rank {peer} sent {received.nbytes} bytes but group rank "
            f"{chan.rank} expected {out.nbytes}")


async def gather_tasks(coros: list) -> list:  # type: ignore[type-arg]
    """Run coroutines concurrently; on the first failure cancel and await the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
