"""Point-to-point plumbing shared by the parameter-server modes.

``Endpoint`` gives the parameter server ``send``/``recv`` in *group* ranks over either a
``netdist.collectives.Group`` (anything with ``transport``, ``ranks``, ``rank`` and
``world_size``) or a bare ``Transport`` (the world). It talks to the group's transport
directly on the parameter server's own tag range (``netdist.ps.protocol``), so a round
costs exactly one message per chunk and peer, and failures keep the transport's precise
errors (``PeerLostError`` names the global rank, which ``group_rank`` maps back).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Sequence
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

import numpy as np

from netdist.collectives.tags import reserve_tags
from netdist.collectives.tags import TagRange
from netdist.errors import NotInGroupError, PeerLostError
from netdist.ps.protocol import check_tag_range
from netdist.ps.roles import PSRoles, ps_roles
from netdist.transport.base import MAX_TAG, Transport, as_payload_array
from netdist.transport.mailbox import PeerMailbox, byte_view

__all__ = ["GroupLike", "Endpoint", "reserve_ps_tags", "Loopback", "RankFailure", "WorkerSession", "run_all",
           "first_error", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 60.0
"""Used when neither the group nor the transport states a default timeout."""

T = TypeVar("T")


class GroupLike(Protocol):
    """The part of ``netdist.collectives.Group`` the parameter server relies on."""

    @property
    def transport(self) -> Transport: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def ranks(self) -> Sequence[int]: ...


class RankFailure(Exception):
    """Internal: an operation with group rank ``rank`` failed with ``error``."""

    def __init__(self, rank: int, what: str, error: BaseException) -> None:
        super().__init__(f"{what}: {error}")
        self.rank = rank
        self.what = what
        self.error = error


class WorkerSession(abc.ABC):
    """``async with`` for a parameter-server worker: leaving the block normally closes
    it (the servers hear DONE); leaving on an exception aborts with that error, so the
    servers and the other workers learn why instead of waiting for a timeout."""

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This worker's rank (named in the abort reason)."""

    @abc.abstractmethod
    async def close(self) -> Any:
        """Finish normally."""

    @abc.abstractmethod
    async def abort(self, reason: str) -> None:
        """Stop and tell every server ``reason``."""

    async def aclose(self) -> None:
        """Same as ``close``."""
        await self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None:
            await self.close()
        else:
            await self.abort(f"worker rank {self.rank} failed: {type(exc).__name__}: {exc}")


class Loopback:
    """Messages from this rank to itself: a co-located server and worker share one.

    Transports refuse self-sends, so a rank hosting both a server and a worker routes
    their messages through this mailbox instead, with the transport's semantics (FIFO
    per tag, ``out=`` receives land in place, bounded waits).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._box = PeerMailbox(rank)

    def send(self, data: Any, tag: int) -> None:
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag {tag} is out of range")
        array = as_payload_array(data)
        landing = self._box.claim(tag, array.dtype, array.shape)
        if array.nbytes:
            landing.buffer[...] = byte_view(array)
        landing.complete()

    async def recv(self, tag: int, out: np.ndarray | None, timeout: float) -> np.ndarray:
        return await self._box.recv(tag, out, timeout)


class Endpoint:
    """Send and receive in group ranks, with the group's default timeout."""

    def __init__(self, comm: GroupLike | Transport, timeout: float | None = None,
                 loopback: Loopback | None = None) -> None:
        if isinstance(comm, Transport):
            self.transport = comm
            self.ranks: tuple[int, ...] = tuple(range(comm.world_size))
            self.rank = comm.rank
        else:
            if getattr(comm, "is_member", True) is False:
                raise NotInGroupError("this rank is not a member of the parameter server's group")
            transport = getattr(comm, "transport", None)
            if not isinstance(transport, Transport):
                raise TypeError("the parameter server needs a netdist Group or Transport, got "
                                f"{type(comm).__name__}")
            self.transport = transport
            self.ranks = tuple(int(r) for r in comm.ranks)
            self.rank = int(comm.rank)
        self.world_size = len(self.ranks)
        self._group_rank = {g: i for i, g in enumerate(self.ranks)}
        if timeout is None:
            timeout = (getattr(comm, "timeout", None) or getattr(self.transport, "timeout", None)
                       or getattr(getattr(self.transport, "config", None), "timeout", None)
                       or DEFAULT_TIMEOUT)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = float(timeout)
        if loopback is not None and loopback.rank != self.rank:
            raise ValueError(f"loopback of rank {loopback.rank} used on rank {self.rank}")
        self.loopback = loopback

    def group_rank(self, global_rank: int) -> int | None:
        return self._group_rank.get(global_rank)

    def global_rank(self, rank: int) -> int:
        return self.ranks[rank]

    async def send(self, peer: int, data: Any, tag: int, timeout: float | None = None) -> None:
        if peer == self.rank and self.loopback is not None:
            self.loopback.send(data, tag)
            await asyncio.sleep(0)  # let the receiver run, as a real send would
            return
        await self.transport.send(self.ranks[peer], data, tag=tag,
                                  timeout=self.timeout if timeout is None else timeout)

    async def recv(self, peer: int, tag: int, out: np.ndarray | None = None,
                   timeout: float | None = None) -> np.ndarray:
        if peer == self.rank and self.loopback is not None:
            return await self.loopback.recv(tag, out,
                                            self.timeout if timeout is None else timeout)
        return await self.transport.recv(self.ranks[peer], tag=tag, out=out,
                                         timeout=self.timeout if timeout is None else timeout)

    def describe(self, error: BaseException) -> str:
        """Error text with global ranks of a lost peer translated to group ranks."""
        if isinstance(error, PeerLostError):
            rank = self.group_rank(error.rank)
            if rank is not None and rank != error.rank:
                return f"{error} (group rank {rank})"
        return str(error) or type(error).__name__


def reserve_ps_tags(comm: GroupLike | Transport, owner: str,
                    tags: TagRange | None = None) -> TagRange:
    """``tags`` checked, or the next range of ``owner`` reserved among ``comm``'s ranks.

    A bare transport counts as the whole world, so a server given the transport and its
    workers given the world ``Group`` (or the reverse) reserve the same range.
    """
    if tags is None:
        if isinstance(comm, Transport):
            tags = reserve_tags(comm, range(comm.world_size), owner)
        else:
            tags = reserve_tags(comm.transport, comm.ranks, owner)
    return check_tag_range(tags)


def open_endpoint(group: GroupLike | Transport, *, num_servers: int, timeout: float | None,
                  colocated: bool, loopback: Loopback | None) -> tuple[Endpoint, PSRoles]:
    """The endpoint and server/worker roles both ends of the sharded PS start from."""
    if colocated and loopback is None:
        raise ValueError("a co-located server and worker must share a Loopback "
                         "(use netdist.ps.ColocatedPS)")
    endpoint = Endpoint(group, timeout, loopback if colocated else None)
    return endpoint, ps_roles(endpoint.world_size, num_servers, colocated=colocated)


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first leaf of an exception group that is not a cancellation."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for leaf in leaves:
        if not isinstance(leaf, asyncio.CancelledError):
            return leaf
    return leaves[0]


async def run_all(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Run ``awaitables`` concurrently; on the first failure cancel the rest and raise it.

    Unlike ``asyncio.gather`` nothing is left running behind a failure; unlike a bare
    ``TaskGroup`` the caller gets the first real error, not an ``ExceptionGroup``.
    """
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as tg:
            for aw in awaitables:
                tasks.append(tg.create_task(_as_coroutine(aw)))
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return [t.result() for t in tasks]


async def _as_coroutine(aw: Awaitable[T]) -> T:
    return await aw
