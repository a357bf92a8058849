"""Dissemination barrier over point-to-point messages: ceil(log2 n) rounds, no root.

In round r every rank sends an empty message to ``rank + 2**r`` and waits for one from
``rank - 2**r`` (mod n). After the last round every rank has heard, directly or
transitively, from every other rank. The distances ``2**r`` are distinct modulo n, so
each barrier takes exactly one message from each source it hears from, and FIFO order
per (peer, tag) keeps consecutive barriers apart without sequence numbers.
"""

from __future__ import annotations

import asyncio

from netdist.errors import NetdistTimeoutError
from netdist.transport.base import MAX_TAG, Transport

__all__ = ["BARRIER_TAG", "dissemination_barrier", "barrier_partners"]

BARRIER_TAG = MAX_TAG
"""Reserved transport tag for ``Transport.barrier``; applications must not use it."""

_EMPTY = b""


def barrier_partners(rank: int, world_size: int) -> list[tuple[int, int]]:
    """``(send_to, recv_from)`` for each round of a dissemination barrier."""
    rounds = []
    distance = 1
    while distance < world_size:
        rounds.append(((rank + distance) % world_size, (rank - distance) % world_size))
        distance *= 2
    return rounds


async def dissemination_barrier(transport: Transport, timeout: float, *,
                                tag: int = BARRIER_TAG) -> None:
    """Run one barrier on ``transport``; raises ``NetdistTimeoutError`` after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for round_index, (send_to, recv_from) in enumerate(
            barrier_partners(transport.rank, transport.world_size)):
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise NetdistTimeoutError(
                f"barrier timed out after {timeout:.2f}s in round {round_index} "
                f"(waiting for rank {recv_from})")
        await transport.send(send_to, _EMPTY, tag=tag, timeout=remaining)
        try:
            await transport.recv(recv_from, tag=tag, timeout=max(deadline - loop.time(), 1e-3))
        except NetdistTimeoutError:
            raise NetdistTimeoutError(
                f"barrier timed out after {timeout:.2f}s in round {round_index}: rank "
                f"{transport.rank} never heard from rank {recv_from}") from None
