"""Connections on first use: per-peer bookkeeping of a lazily connecting transport.

With ``ConnectMode.LAZY`` a rank connects to a peer the first time it sends to it or
posts a receive from it (so a dead peer is found by whoever waits on it). ``PeerLinks``
keeps what that needs, apart from the sockets themselves (``TcpTransport`` owns those):

- which peers are being dialled (``dials``), and which could not be reached for good
  (``unreachable``: the error every operation on them raises from then on);
- the senders waiting for a peer's connection, in the order they called ``send``, so
  frames leave in call order once it is up (per (peer, tag) FIFO is the contract): a
  sender that arrives while others still wait queues behind them even if the
  connection is already there, and each waiter, when its turn comes, hands the turn
  on only as it starts its own frame;
- watchers (the dial of the higher rank that lost a simultaneous connect) woken when
  the peer's link settles.

A link *settles* once, for good: the peer's connection was adopted (it may fail later,
which the connection itself reports), the peer was found unreachable, or the transport
is closing. Nothing here touches a socket.

Simultaneous connects: both ranks of a pair may dial each other at once. Exactly one
connection survives, the one the lower rank initiated: a rank refuses a connection from
a higher rank while its own dial to that rank is in progress (``tie_refusal``), and the
higher rank, refused that way (``is_tie_refusal``), waits for the lower rank's
connection instead. A rank adopts a connection only on a successful handshake, and the
accepting side decides, adopts and sends its OK in one step, so both ends always adopt
the same connection and no data ever flows on the other one.
"""

from __future__ import annotations

import asyncio
from collections import deque

from netdist.errors import AuthenticationError, ConnectError, NetdistTimeoutError
from netdist.transport.connection import ErrorFactory
from netdist.transport.os_errors import OsErrorKind, kind_of

__all__ = ["PeerLinks", "REFUSED_GRACE", "tie_refusal", "is_tie_refusal", "unreachable_reason"]

REFUSED_GRACE = 0.0
"""Seconds a peer's port may keep refusing connections before the peer is declared gone:
none. A rank binds its listener before it registers its address, and closes it only when
it closes its transport or dies, so a refusal says what an EOF on a connection says, and
is reported as fast (a caller probing which peers are gone, as ``Group`` does on a
timeout, gets the answer within milliseconds)."""

_TIE_MARK = "simultaneous connect:"


def tie_refusal(me: int, peer: int) -> str:
    """The refusal a lower rank ``me`` sends to ``peer`` while dialling ``peer`` itself."""
    return (f"{_TIE_MARK} rank {me} keeps the connection it is making to rank {peer} "
            "(the lower rank's connection wins)")


def is_tie_refusal(error: BaseException) -> bool:
    """True when ``error`` is a peer's ``tie_refusal`` (not a real authentication failure)."""
    return (isinstance(error, AuthenticationError) and error.code is None
            and _TIE_MARK in str(error))


def unreachable_reason(peer: int, where: str, error: BaseException) -> str:
    """Why ``peer`` (listening at ``where`` per the rendezvous table) is given up on.

    A rank's listener is bound before its address is published, so a refused connection
    means the rank exited, crashed or closed its transport.
    """
    if (isinstance(error, ConnectError) and error.__cause__ is not None
            and kind_of(error.__cause__) is OsErrorKind.REFUSED):
        return (f"rank {peer} refused the connection at {where}: nothing listens there any "
                "more (it exited, crashed or closed its transport)")
    if isinstance(error, NetdistTimeoutError):
        return str(error)  # already says who did not answer, and for how long
    return f"could not connect to rank {peer} at {where}: {error}"


class PeerLinks:
    """Dials, unreachable peers, and senders waiting for a connection (module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.dials: dict[int, asyncio.Task[None]] = {}
        """Outbound connection attempts in progress, by peer."""
        self.unreachable: dict[int, ErrorFactory] = {}
        """Peers never connected whose connection attempt failed for good, with the error
        every operation on them raises."""
        self._senders: dict[int, deque[asyncio.Future[None]]] = {}
        self._watchers: dict[int, list[asyncio.Future[None]]] = {}
        self._closed = False

    def has_senders(self, peer: int) -> bool:
        """True while senders to ``peer`` wait for its connection (or their turn)."""
        return peer in self._senders

    async def wait_turn(self, peer: int, deadline: float, settled: bool) -> None:
        """Wait until ``peer``'s link has settled and every earlier waiting sender has
        started its frame; ``settled`` says whether it already has.

        On return the next waiting sender is released: it runs only once the caller
        suspends, i.e. after the caller has started its own frame (``send_frame`` takes
        its place in the connection's queue before its first suspension). Raises
        ``TimeoutError`` at ``deadline`` (loop time); a timeout or cancellation withdraws
        the caller without disturbing the order of the others.
        """
        queue = self._senders.setdefault(peer, deque())
        turn: asyncio.Future[None] = self._loop.create_future()
        queue.append(turn)
        if (settled or self._closed) and queue[0] is turn:
            turn.set_result(None)
        try:
            if not turn.done():
                async with asyncio.timeout_at(deadline):
                    await turn
        finally:
            self._leave(peer, turn)

    def _leave(self, peer: int, turn: asyncio.Future[None]) -> None:
        """Take ``turn`` out of the queue; if it had been granted, grant the next one."""
        queue = self._senders.get(peer)
        if queue is None:  # pragma: no cover - every turn is queued until it leaves
            return
        try:
            queue.remove(turn)
        except ValueError:  # pragma: no cover
            pass
        if not queue:
            del self._senders[peer]
            return
        granted = turn.done() and not turn.cancelled()
        if granted and not queue[0].done():
            queue[0].set_result(None)

    async def wait_settled(self, peer: int, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds, never raising) until ``settle(peer)``."""
        if self._closed or timeout <= 0:
            return
        watcher: asyncio.Future[None] = self._loop.create_future()
        self._watchers.setdefault(peer, []).append(watcher)
        try:
            async with asyncio.timeout(timeout):
                await watcher
        except TimeoutError:
            pass
        finally:
            watchers = self._watchers.get(peer)
            if watchers is not None and watcher in watchers:
                watchers.remove(watcher)
                if not watchers:
                    del self._watchers[peer]

    def settle(self, peer: int) -> None:
        """``peer``'s link is settled for good: release its first sender and its watchers."""
        queue = self._senders.get(peer)
        if queue and not queue[0].done():
            queue[0].set_result(None)
        for watcher in self._watchers.pop(peer, []):
            if not watcher.done():
                watcher.set_result(None)

    def close(self) -> None:
        """The transport is closing: every link is settled (waiters see it closed)."""
        self._closed = True
        for peer in list(self._senders):
            self.settle(peer)
        for peer in list(self._watchers):
            self.settle(peer)
