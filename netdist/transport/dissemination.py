"""Dissemination barrier over point-to-point messages: ceil(log2 n) rounds, no root.

In round r every rank sends an empty message to ``rank + 2**r`` and waits for one from
``rank - 2**r`` (mod n). After the last round every rank has heard, directly or
transitively, from every other rank. The distances ``2**r`` are distinct modulo n, so
each barrier takes exactly one message from each source it hears from, and FIFO order
per (peer, tag) keeps consecutive barriers apart without sequence numbers.

``dissemination_rounds`` is the one implementation. ``Transport.barrier`` runs it on
transport ranks, on ``BARRIER_TAG``, under its own deadline (``dissemination_barrier``);
``Group.barrier`` runs it on group ranks through the operation's channel, on the
operation's tag and bounded by the group (``netdist.collectives.algorithms.barrier``);
both take their rounds from ``barrier_partners``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from netdist.errors import NetdistTimeoutError
from netdist.transport.base import MAX_TAG, Transport

__all__ = ["BARRIER_TAG", "dissemination_barrier", "dissemination_rounds", "barrier_partners"]

BARRIER_TAG = MAX_TAG
"""Reserved transport tag for ``Transport.barrier``; applications must not use it."""

_EMPTY = b""

Step = Callable[[int, float | None], Awaitable[object]]
"""``send(peer, timeout)`` sends the empty message to ``peer``; ``recv(peer, timeout)``
waits for the one from ``peer``. ``timeout`` is what is left of the barrier's deadline,
or None where the caller bounds the barrier itself."""


def barrier_partners(rank: int, world_size: int) -> tuple[tuple[int, int], ...]:
    """``(send_to, recv_from)`` for each of the ``ceil(log2 n)`` rounds of a dissemination
    barrier: the one schedule of the transport's barrier and the groups' (PURE)."""
    rounds = []
    distance = 1
    while distance < world_size:
        rounds.append(((rank + distance) % world_size, (rank - distance) % world_size))
        distance *= 2
    return tuple(rounds)


async def dissemination_rounds(rank: int, partners: Sequence[tuple[int, int]], send: Step,
                               recv: Step, *, timeout: float | None = None) -> None:
    """Run ``rank``'s rounds of a dissemination barrier: for each ``(send_to, recv_from)``
    of ``partners`` (``barrier_partners``), send to one, then wait for the other.

    With ``timeout`` the whole barrier has that long: each step gets what is left, and
    running out raises ``NetdistTimeoutError`` naming the round and the rank not heard
    from. Without it the caller bounds the barrier, and the steps' errors pass through.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    for round_index, (send_to, recv_from) in enumerate(partners):
        remaining = None if deadline is None else deadline - loop.time()
        if remaining is not None and remaining <= 0:
            raise NetdistTimeoutError(
                f"barrier timed out after {timeout:.2f}s in round {round_index} "
                f"(waiting for rank {recv_from})")
        await send(send_to, remaining)
        try:
            await recv(recv_from, None if deadline is None
                       else max(deadline - loop.time(), 1e-3))
        except NetdistTimeoutError:
            if deadline is None:
                raise
            raise NetdistTimeoutError(
                f"barrier timed out after {timeout:.2f}s in round {round_index}: rank "
                f"{rank} never heard from rank {recv_from}") from None


async def dissemination_barrier(transport: Transport, timeout: float, *,
                                tag: int = BARRIER_TAG) -> None:
    """Run one barrier on ``transport``; raises ``NetdistTimeoutError`` after ``timeout``."""
    await dissemination_rounds(
        transport.rank, barrier_partners(transport.rank, transport.world_size),
        lambda peer, left: transport.send(peer, _EMPTY, tag=tag, timeout=left),
        lambda peer, left: transport.recv(peer, tag=tag, timeout=left),
        timeout=timeout)
