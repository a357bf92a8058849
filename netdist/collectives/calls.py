"""How a group runs its calls: one deadline each, errors that name the call, the group
and the peer, and ownership of the tasks of ``async_op=True`` calls.

``Calls.run`` wraps every collective and point-to-point call of a ``Group``: the call's
body runs under its deadline (``Channel.timeout``); a timeout names the member the call
was waiting for and every member the transport knows is lost (after trying, for
``_REACH_SECONDS``, to reach members never talked to); a lost peer names the casualty; a
local protocol error (a frame of the wrong shape or dtype) becomes
``CollectiveMismatchError``. ``Calls.launch`` runs a call as a task the group owns and
returns its ``Work``; ``aclose`` cancels and awaits them all, so no task outlives its
group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from netdist.collectives.channel import Channel, CollectiveMismatchError
from netdist.collectives.work import Work
from netdist.errors import (
    LocalProtocolError,
    NetdistTimeoutError,
    PeerLostError,
    TransportClosedError,
)
from netdist.trace.recorder import OpState
from netdist.transport.base import Transport

__all__ = ["Calls"]

_REACH_SECONDS = 1.0  # after a timeout: how long to try reaching members never talked to

T = TypeVar("T")


class Calls:
    """The calls of one group: run under a deadline with context, or as owned tasks."""

    def __init__(self, transport: Transport, ranks: tuple[int, ...], where: str) -> None:
        self._transport = transport
        self._ranks = ranks
        self._where = where
        """The group, as error messages name it."""
        self._tasks: set[asyncio.Future[Any]] = set()
        self._recorder = transport.recorder

    def cancel(self) -> list[asyncio.Future[Any]]:
        """Cancel every running task; the tasks, to await."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks

    def launch(self, chan: Channel, body: Callable[[Channel], Awaitable[T]]) -> Work:
        """Run ``body`` as a task the group owns (``aclose`` cancels it); its ``Work``."""
        running = asyncio.Event()
        task = asyncio.ensure_future(self.run(chan, body, running))
        self._tasks.add(task)
        task.add_done_callback(self._forget)
        return Work(task, chan.op, running)

    def _forget(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the Work handle re-raises it when awaited

    async def run(self, chan: Channel, body: Callable[[Channel], Awaitable[T]],
                  running: asyncio.Event | None = None) -> T:
        """Run one collective under its deadline, adding context to transport errors;
        ``running`` is set as the body starts (``Work.started``). The call's flight record
        is closed with how it ended; a lost peer or an expired deadline dumps the flight
        recorder (``Recorder.failed``)."""
        record = chan.record
        try:
            result = await self._run(chan, body, running)
        except BaseException as exc:
            if record is not None:
                self._recorder.end(record, _state_of(exc), chan.waited_for)
            if isinstance(exc, (PeerLostError, NetdistTimeoutError)):
                self._recorder.failed(exc)
            raise
        if record is not None:
            self._recorder.end(record, OpState.OK, chan.waited_for)
        return result

    async def _run(self, chan: Channel, body: Callable[[Channel], Awaitable[T]],
                   running: asyncio.Event | None) -> T:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout(chan.timeout):
                if running is not None:
                    running.set()
                return await body(chan)
        except NetdistTimeoutError as exc:
            raise NetdistTimeoutError(f"{chan.op} on {self._where}: {exc}") from exc
        except TimeoutError:
            elapsed = loop.time() - started
            waiting = ("" if chan.waiting_on < 0 else
                       f", waiting for {self._group_rank_of(self._ranks[chan.waiting_on])}")
            lost = await self._lost_peers(reach=_REACH_SECONDS)
            raise NetdistTimeoutError(
                f"{chan.op} on {self._where} timed out after {elapsed:.2f}s"
                f"{waiting}{'; ' + '; '.join(lost) if lost else ''}") from None
        except PeerLostError as exc:
            # a peer that left because *it* lost someone points at the real casualty:
            # name every member the transport knows is gone
            others = await self._lost_peers(exclude=exc.rank)
            member = self._group_rank_of(exc.rank)
            # relayed (``via``): the transport's text already leads with the origin
            story = f"lost {member}: {exc}" if exc.via is None else f"{exc} (lost {member})"
            raise exc.with_message(
                f"{chan.op} on {self._where}: {story}"
                f"{'; also ' + '; '.join(others) if others else ''}") from exc
        except TransportClosedError as exc:
            raise TransportClosedError(f"{chan.op} on {self._where}: {exc}") from exc
        except LocalProtocolError as exc:
            raise CollectiveMismatchError(
                f"{chan.op} on {self._where}: {exc}; every rank must pass the same "
                "shape and dtype") from exc

    async def _lost_peers(self, exclude: int = -1, *, reach: float = 0.0) -> list[str]:
        """Which members are gone, for error messages: what the transport knows, and
        after a timeout (``reach`` seconds) also members this rank never talked to, which
        a transport connecting on first use then tries to reach."""
        peers = [p for p in self._ranks if p not in (self._transport.rank, exclude)]
        if not peers or self._transport.closed:
            return []
        found = await self._transport.find_lost_peers(peers, timeout=reach)
        return [f"{self._group_rank_of(p)} is lost: {found[p]}" for p in peers if p in found]

    def _group_rank_of(self, transport_rank: int) -> str:
        if transport_rank in self._ranks:
            return f"group rank {self._ranks.index(transport_rank)} (transport rank {transport_rank})"
        return f"transport rank {transport_rank}"


def _state_of(error: BaseException) -> str:
    """How a call that raised ``error`` ended, as its flight record says."""
    return OpState.CANCELLED if isinstance(error, asyncio.CancelledError) else OpState.ERROR
