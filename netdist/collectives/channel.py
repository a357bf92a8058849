"""The per-operation view of a transport that collective executors talk through.

A ``Channel`` binds one collective call to its transport, its group's rank table, its
tag and its deadline, so executors speak in *group* ranks and never compute tags. It
also remembers which peer the operation last waited for, so a timeout can say so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from netdist.errors import CollectiveMismatchError
from netdist.transport.base import Transport

__all__ = ["Channel", "ScratchPool", "CollectiveMismatchError", "EAGER_BYTES",
           "PLAN_CACHE_SIZE"]

T = TypeVar("T")

PLAN_CACHE_SIZE = 256
"""Plans a group keeps (they are pure, so equal arguments give equal plans)."""

EAGER_BYTES = 256 * 1024
"""``exchange`` sends first and receives after for messages up to this size; larger
ones send and receive concurrently so neither side waits on a full socket buffer."""


class ScratchPool:
    """Reusable scratch buffers of one group, so large collectives do not fault in fresh
    pages on every call. Concurrent collectives each get their own buffer; at most
    ``keep`` idle buffers are retained."""

    def __init__(self, keep: int = 2) -> None:
        self._idle: list[np.ndarray] = []
        self._keep = keep

    @contextlib.contextmanager
    def take(self, nbytes: int) -> Iterator[np.ndarray]:
        """A ``uint8`` buffer of at least ``nbytes`` for the duration of the block."""
        buffer = None
        for index, candidate in enumerate(self._idle):
            if candidate.nbytes >= nbytes:
                buffer = self._idle.pop(index)
                break
        if buffer is None:
            buffer = np.empty(max(nbytes, 1), np.uint8)
        try:
            yield buffer
        finally:
            self._idle.append(buffer)
            if len(self._idle) > self._keep:
                self._idle.sort(key=lambda b: b.nbytes)
                del self._idle[0]

    def clear(self) -> None:
        self._idle.clear()


class Channel:
    """Send and receive for one collective call, in group ranks, on one tag."""

    __slots__ = ("transport", "ranks", "rank", "tag", "timeout", "op", "waiting_on",
                 "record", "_plans", "_scratch")

    def __init__(self, transport: Transport, ranks: tuple[int, ...], rank: int, tag: int,
                 timeout: float, op: str,
                 plans: dict[tuple[Any, ...], Any] | None = None,
                 scratch: ScratchPool | None = None) -> None:
        self.transport = transport
        self.ranks = ranks
        """Group rank -> transport rank."""
        self.rank = rank
        """This rank within the group."""
        self.tag = tag
        self.timeout = timeout
        self.op = op
        self.waiting_on = -1
        """Group rank this operation last waited to hear from (-1: none yet)."""
        self.record: list[Any] | None = None
        """The call's flight record (``netdist.trace.Recorder.begin``); ``None`` for a
        channel that is one phase of a call, or a point-to-point call."""
        self._plans = {} if plans is None else plans
        self._scratch = ScratchPool(keep=0) if scratch is None else scratch

    def scratch(self, nbytes: int) -> contextlib.AbstractContextManager[np.ndarray]:
        """Borrow a ``uint8`` scratch buffer of at least ``nbytes`` from the group."""
        return self._scratch.take(nbytes)

    def plan(self, build: Callable[..., T], *args: Any) -> T:
        """``build(*args)``, remembered in the group's plan cache (plans are pure)."""
        key = (build, *args)
        found = self._plans.get(key)
        if found is None:
            if len(self._plans) >= PLAN_CACHE_SIZE:
                self._plans.clear()
            found = self._plans[key] = build(*args)
        return found  # type: ignore[no-any-return]

    def derive(self, sub_tag: int) -> Channel:
        """A channel for a second phase of the same operation on ``tag + sub_tag``."""
        return Channel(self.transport, self.ranks, self.rank, self.tag + sub_tag,
                       self.timeout, self.op, self._plans, self._scratch)

    def subset(self, members: tuple[int, ...], sub_tag: int) -> Channel:
        """A channel among some of this channel's group ranks (``members``, which include
        this rank), on ``tag + sub_tag``: one phase of a hierarchical collective."""
        return Channel(self.transport, tuple(self.ranks[m] for m in members),
                       members.index(self.rank), self.tag + sub_tag, self.timeout, self.op,
                       self._plans, self._scratch)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def waited_for(self) -> int:
        """The transport rank this operation last waited to hear from (-1: none)."""
        return -1 if self.waiting_on < 0 else self.ranks[self.waiting_on]

    async def send(self, peer: int, data: Any, sub: int = 0) -> None:
        """Send ``data`` to group rank ``peer`` on sub-tag ``sub`` of this operation."""
        await self.transport.send(self.ranks[peer], data, tag=self.tag + sub,
                                  timeout=self.timeout)

    async def recv(self, peer: int, out: np.ndarray | None = None, sub: int = 0) -> np.ndarray:
        """Receive the next message from group rank ``peer`` (into ``out`` if given)."""
        self.waiting_on = peer
        return await self.transport.recv(self.ranks[peer], tag=self.tag + sub, out=out,
                                         timeout=self.timeout)

    async def exchange(self, send_to: int, data: np.ndarray, recv_from: int | None = None,
                       out: np.ndarray | None = None, sub: int = 0) -> np.ndarray:
        """Send ``data`` to ``send_to`` and receive the next message from ``recv_from``
        (default: the same peer).

        Up to ``EAGER_BYTES`` the send goes first and the receive after it, which saves a
        task per message; larger messages are received concurrently with the send.
        """
        source = send_to if recv_from is None else recv_from
        if data.nbytes <= EAGER_BYTES:
            await self.send(send_to, data, sub)
            return await self.recv(source, out, sub)
        receiving = asyncio.ensure_future(self.recv(source, out, sub))
        try:
            await self.send(send_to, data, sub)
        except BaseException:
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)
            raise
        return await receiving
