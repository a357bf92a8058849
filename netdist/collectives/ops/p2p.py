"""Point to point within a group: ``send``, ``recv`` and ``recv_any``.

Each ``prepare_*`` checks its arguments and returns ``(deadline, peer, body)``: the
deadline ``Group`` runs ``body`` under and the group rank a timeout names (-1: several).
Tags are the group's (``OpContext.p2p_tag``): they never meet the parent's or another
group's.

The transport receives from one named peer, so a receive from any of several members
(``recv_from_any``) polls them in turn, each with a short receive (``ANY_SOURCE_POLL``)
that owns no buffer. A receive that expires, even while its frame is landing, loses
nothing: the mailbox hands the message to the next receive on the tag
(``netdist.transport.mailbox``). So only the message actually taken is consumed, and
messages that several members race to send are each taken exactly once by repeated
calls. The deadline is checked after every full round of polls, so every source is asked
at least once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from netdist.collectives.channel import Channel
from netdist.collectives.tags import P2P_TAG_LIMIT
from netdist.errors import LocalProtocolError, NetdistTimeoutError
from netdist.collectives.ops.context import OpContext
from netdist.tensors import StagedOut, as_array, is_tensor, numpy_result, stage_out
from netdist.transport.mailbox import byte_view, check_out_buffer

__all__ = ["ANY_SOURCE_POLL", "prepare_recv", "prepare_recv_any", "prepare_send",
           "recv_from_any", "recv_from_any_limit", "recv_landing", "recv_result"]

Prepared = tuple[float, int, Callable[[], Awaitable[Any]]]
"""``(deadline, peer, body)`` of one point-to-point call."""

ANY_SOURCE_POLL = 0.05
"""Seconds a receive from any source waits on each member before asking the next."""

_SLACK = 1.0
"""Seconds past its last round of polls that a receive from any source is allowed."""


def recv_landing(out: Any, what: str) -> tuple[np.ndarray | None, StagedOut | None]:
    """Where a receive's message lands: ``(array, staged)``. ``out`` itself for an ndarray
    (checked: C-contiguous and writeable), a view of an ``out=`` tensor or a contiguous
    stand-in that ``staged`` copies back, or ``(None, None)``: a new array."""
    if out is None:
        return None, None
    if isinstance(out, np.ndarray):
        check_out_buffer(out)
        return out, None
    staged = stage_out(out, f"{what} out=")
    return staged.array, staged


def recv_result(message: np.ndarray, out: Any, staged: StagedOut | None, what: str) -> Any:
    """What a receive returns: the ``out=`` it was given (a tensor copied back where it was
    staged), else the message as a NumPy caller gets it (``numpy_result``)."""
    if staged is not None:
        return staged.finish()
    return message if out is not None else numpy_result(message, what)


def recv_from_any_limit(timeout: float, sources: int) -> float:
    """The longest ``recv_from_any`` may run: its deadline plus one more round of polls
    (the bound for the group's own deadline, which must not cut the last round short)."""
    return timeout + sources * ANY_SOURCE_POLL + _SLACK


async def recv_from_any(chan: Channel, sources: Sequence[int], timeout: float,
                        out: np.ndarray | None = None) -> tuple[int, np.ndarray]:
    """``(src, message)``: the next message on ``chan.tag`` from whichever of ``sources``
    (group ranks, asked in this order) sends first, copied into ``out`` if given (then
    ``out`` is the message; its byte size must be the message's).

    ``NetdistTimeoutError`` once ``timeout`` seconds have passed and a full round of polls
    found nothing; ``PeerLostError`` as soon as a source is lost.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        for peer in sources:
            try:
                message = await chan.transport.recv(chan.ranks[peer], tag=chan.tag,
                                                    timeout=ANY_SOURCE_POLL)
            except NetdistTimeoutError:
                continue
            if out is None:
                return peer, message
            if out.nbytes != message.nbytes:
                raise LocalProtocolError(
                    f"group rank {peer} sent {message.nbytes} bytes "
                    f"({message.dtype.name}{list(message.shape)}) into out= of {out.nbytes}")
            byte_view(out)[...] = byte_view(message)
            return peer, out
        if loop.time() >= deadline:
            listed = ", ".join(map(str, sources))
            raise NetdistTimeoutError(
                f"no message on tag {chan.tag % P2P_TAG_LIMIT} from group rank"
                f"{'s' if len(sources) > 1 else ''} {listed} within {timeout:.2f}s")


def _other_member(ctx: OpContext, peer: Any, what: str) -> int:
    """``peer`` as the group rank of another member; ``ValueError`` for this rank."""
    peer = ctx.peer(peer, what)
    if peer == ctx.rank:
        raise ValueError(f"{what} {peer} is this rank")
    return peer


def prepare_send(ctx: OpContext, array: Any, dst: int, tag: int,
                 timeout: float | None) -> Prepared:
    """Check ``send``'s arguments; the body sending ``array`` (ndarray, CPU tensor or
    bytes-like; a non-contiguous one from a contiguous copy) to group rank ``dst``."""
    if not isinstance(array, np.ndarray) and is_tensor(array):
        array = as_array(array, "send")
    dst = _other_member(ctx, dst, "send dst")
    wire_tag = ctx.p2p_tag(tag)
    deadline = ctx.deadline(timeout)
    target = ctx.ranks[dst]

    async def body() -> None:
        await ctx.transport.send(target, array, tag=wire_tag, timeout=deadline)

    return deadline, dst, body


def prepare_recv(ctx: OpContext, src: int, tag: int, out: Any,
                 timeout: float | None) -> Prepared:
    """Check ``recv``'s arguments; the body receiving the next message from group rank
    ``src`` on ``tag`` (into ``out``, returned, when given)."""
    src = _other_member(ctx, src, "recv src")
    wire_tag = ctx.p2p_tag(tag)
    deadline = ctx.deadline(timeout)
    source = ctx.ranks[src]
    into, staged = recv_landing(out, "recv")

    async def body() -> Any:
        result = await ctx.transport.recv(source, tag=wire_tag, out=into, timeout=deadline)
        return recv_result(result, out, staged, "recv")

    return deadline, src, body


def prepare_recv_any(ctx: OpContext, sources: Sequence[int] | None, tag: int, out: Any,
                     timeout: float | None) -> Prepared:
    """Check ``recv_any``'s arguments; the body returning ``(src, message)`` from
    whichever of ``sources`` (default: every other member) sends first."""
    if sources is None:
        sources = [r for r in range(ctx.world_size) if r != ctx.rank]
    peers = [ctx.peer(s, "recv_any source") for s in sources]
    if not peers or ctx.rank in peers or len(set(peers)) != len(peers):
        raise ValueError(f"recv_any sources must be other members, each once, got "
                         f"{peers} on group rank {ctx.rank}")
    wire_tag = ctx.p2p_tag(tag)
    deadline = ctx.deadline(timeout)
    into, staged = recv_landing(out, "recv_any")
    chan = Channel(ctx.transport, ctx.ranks, ctx.rank, wire_tag, deadline, "recv_any")

    async def body() -> Any:
        src, message = await recv_from_any(chan, peers, deadline, into)
        return src, recv_result(message, out, staged, "recv_any")

    return recv_from_any_limit(deadline, len(peers)), -1, body
