"""The group's barriers: the dissemination barrier (``Group.barrier``) and the
monitored barrier through rank 0 (``Group.monitored_barrier``).

The dissemination barrier is the transport's (``netdist.transport.dissemination``: one round
loop and one partner schedule for both), run on group ranks on the operation's tag and
bounded by the group's deadline: ``ceil(log2 n)`` rounds of empty messages, no root.

The monitored barrier names the ranks that did not arrive. Gloo's protocol and messages (torch's ``monitored_barrier``): every rank but group rank 0
sends rank 0 a one-byte token and waits for one back. Rank 0 receives the tokens in rank
order until its deadline; a rank whose token did not come (or that was lost) has failed
to pass. Without ``wait_all_ranks`` rank 0 stops at the first such rank, with it it
waits for every rank (those after the deadline get one last, immediate look); either way
it raises ``NetdistTimeoutError`` naming them and sends no release, so the others fail
too, by their own deadline, saying that rank 0 has the details. When every token came,
rank 0 releases every rank. Ranks are group ranks (the transport ranks follow where they
differ). Each wait is bounded by the barrier's timeout; a rank that is not rank 0 waits
at most twice that (its send, then the release).
"""

from __future__ import annotations

import asyncio

import numpy as np

from netdist.collectives.channel import Channel
from netdist.collectives.algorithms.receive import EMPTY, gather_tasks
from netdist.errors import NetdistTimeoutError, PeerLostError
from netdist.transport.dissemination import barrier_partners, dissemination_rounds

__all__ = ["dissemination_barrier", "root_monitored_barrier", "root_monitored_limit"]

_LAST_LOOK = 0.001
"""Seconds rank 0 still waits for a token once its deadline has passed."""

_SLACK = 1.0
"""Seconds past its own waits that a monitored barrier is allowed."""


async def dissemination_barrier(chan: Channel) -> None:
    """Barrier in ``ceil(log2 n)`` rounds of empty messages (no root): the transport's
    dissemination barrier on group ranks, on the operation's tag, bounded by the group."""
    await dissemination_rounds(chan.rank,
                               chan.plan(barrier_partners, chan.rank, chan.world_size),
                               lambda peer, _: chan.send(peer, EMPTY),
                               lambda peer, _: chan.recv(peer))


def root_monitored_limit(seconds: float, world_size: int) -> float:
    """The longest ``root_monitored_barrier`` may run: two waits of ``seconds`` and a
    last look at every rank (the bound for the group's own deadline, which must not
    pre-empt the barrier's messages naming the ranks)."""
    return 2 * seconds + world_size * _LAST_LOOK + _SLACK


async def _send_token(chan: Channel, peer: int, seconds: float) -> None:
    await chan.transport.send(chan.ranks[peer], np.zeros(1, np.uint8), tag=chan.tag,
                              timeout=max(seconds, _LAST_LOOK))


async def _recv_token(chan: Channel, peer: int, seconds: float) -> None:
    chan.waiting_on = peer
    await chan.transport.recv(chan.ranks[peer], tag=chan.tag, out=np.zeros(1, np.uint8),
                              timeout=max(seconds, _LAST_LOOK))


def _named(chan: Channel, ranks: list[int]) -> str:
    """``"1, 2"``, with the transport ranks after them where they differ."""
    listed = ", ".join(map(str, ranks))
    members = [chan.ranks[r] for r in ranks]
    if members == ranks:
        return listed
    return f"{listed} (transport rank{'s' if len(ranks) > 1 else ''} " \
           f"{', '.join(map(str, members))})"


async def root_monitored_barrier(chan: Channel, seconds: float, wait_all_ranks: bool) -> None:
    """Run the monitored barrier (see the module docstring) with timeout ``seconds``."""
    me, ms = chan.rank, int(seconds * 1000)
    if me != 0:
        try:
            await _send_token(chan, 0, seconds)
            await _recv_token(chan, 0, seconds)
        except (NetdistTimeoutError, PeerLostError) as exc:
            raise NetdistTimeoutError(
                f"Rank {me} successfully reached monitoredBarrier, but received errors while "
                f"waiting for send/recv from rank 0. Please check rank 0 logs for faulty "
                f"rank. ({exc})") from exc
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    missing: list[int] = []
    for peer in range(1, chan.world_size):
        remaining = deadline - loop.time()
        if remaining <= 0 and not missing:
            raise NetdistTimeoutError(f"Rank 0 timed out in monitoredBarrier after {ms} ms")
        try:
            await _recv_token(chan, peer, remaining)
        except (NetdistTimeoutError, PeerLostError):
            missing.append(peer)
            if not wait_all_ranks:
                break
    if missing:
        raise NetdistTimeoutError(f"[Rank 0]: Rank{'s' if len(missing) > 1 else ''} "
                                  f"{_named(chan, missing)} failed to pass monitoredBarrier "
                                  f"in {ms} ms")
    await gather_tasks([_send_token(chan, peer, seconds) for peer in range(1, chan.world_size)])
