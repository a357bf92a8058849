"""Receives shared by the algorithms: checked receives of small messages, exact-size
receives, and running a step's sends and receives together.

Up to ``CHECKED_BYTES`` a message is received into a fresh array and its dtype and shape
compared with ours, so a mismatch across ranks is reported by rank; larger ones land in
pooled scratch (``out=``), where the transport checks the byte size.
"""

from __future__ import annotations

import asyncio

import numpy as np

from netdist.collectives.channel import Channel, CollectiveMismatchError

__all__ = ["CHECKED_BYTES", "EMPTY", "check_same", "gather_tasks", "recv_exact", "recv_like"]

EMPTY = np.empty(0, np.uint8)
"""The payload of a signal (a barrier round)."""


def check_same(chan: Channel, mine: np.ndarray, theirs: np.ndarray, peer: int) -> None:
    """``CollectiveMismatchError`` naming ``peer`` unless ``theirs`` matches ``mine``."""
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


async def recv_like(chan: Channel, peer: int, like: np.ndarray,
                     scratch: np.ndarray | None, send: np.ndarray | None = None) -> np.ndarray:
    """Receive from ``peer`` a message shaped like ``like`` (sending ``send`` first)."""
    if send is not None:
        incoming = await chan.exchange(peer, send, out=scratch)
    else:
        incoming = await chan.recv(peer, scratch)
    if scratch is None:
        check_same(chan, like, incoming, peer)
        return incoming.reshape(-1)
    return incoming


async def recv_exact(chan: Channel, peer: int, out: np.ndarray) -> None:
    """Receive from ``peer`` into ``out``; ``CollectiveMismatchError`` unless the message
    has exactly ``out``'s bytes."""
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
