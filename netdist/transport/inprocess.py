"""Connected transports inside one event loop, for unit tests of everything above.

Sending copies the payload straight into the receiver's landing buffer (the posted
``out=`` when there is one), so the semantics match ``TcpTransport``: ordered per
(pair, tag), zero-copy-style receive into ``out=``, bounded waits, and closing one
transport makes its peers see ``PeerLostError`` naming it. ``traffic()`` counts payload
bytes and messages as ``TcpTransport`` does; wire bytes are 0 (there is no socket).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from netdist.errors import PeerLostError, TransportClosedError
from netdist.transport.dissemination import dissemination_barrier
from netdist.transport.base import Transport, as_payload_array
from netdist.transport.host_identity import host_key
from netdist.transport.mailbox import PeerMailbox, byte_view
from netdist.transport.traffic import Traffic, TrafficCounter

__all__ = ["InProcessTransport"]


class _Hub:
    """The shared wiring of one in-process group: ``boxes[dst][src]``."""

    def __init__(self, world_size: int) -> None:
        self.transports: list[InProcessTransport] = []
        self.boxes = [[PeerMailbox(src) for src in range(world_size)]
                      for _ in range(world_size)]


class InProcessTransport(Transport):
    """One rank of an in-process group; build a whole group with ``create_group(n)``."""

    def __init__(self, hub: _Hub, rank: int, world_size: int, timeout: float) -> None:
        self._hub = hub
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._closed = False
        self._counts = [TrafficCounter() for _ in range(world_size)]
        """Per peer, what this rank sent it and received from it (own index unused)."""

    @classmethod
    def create_group(cls, world_size: int, *, timeout: float = 30.0) -> list[InProcessTransport]:
        """Return ``world_size`` connected transports, rank i at index i."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        hub = _Hub(world_size)
        hub.transports = [cls(hub, rank, world_size, timeout) for rank in range(world_size)]
        return list(hub.transports)

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, dst: int, data: Any, *, tag: int = 0,
                   timeout: float | None = None) -> None:
        self.check_open("send")
        self.check_peer(dst, "dst")
        tag = self.check_tag(tag)
        array = as_payload_array(data)
        peer = self._hub.transports[dst]
        if peer.closed:
            raise PeerLostError(dst, f"send to rank {dst} (tag {tag}): rank {dst} has closed")
        landing = self._hub.boxes[dst][self.rank].claim(tag, array.dtype, array.shape)
        nbytes = array.nbytes
        if nbytes:
            landing.buffer[...] = byte_view(array)
        landing.complete()
        sent, received = self._counts[dst], peer._counts[self.rank]
        sent.sent_bytes += nbytes
        sent.sent_messages += 1
        received.received_bytes += nbytes  # it has fully arrived: it landed just now
        received.received_messages += 1
        await asyncio.sleep(0)  # let receivers run, as a socket write would

    async def recv(self, src: int, *, tag: int = 0, out: np.ndarray | None = None,
                   timeout: float | None = None) -> np.ndarray:
        self.check_open("recv")
        self.check_peer(src, "src")
        tag = self.check_tag(tag)
        box = self._hub.boxes[self.rank][src]
        return await box.recv(tag, out, self.timeout if timeout is None else timeout)

    def host_keys(self) -> tuple[bytes, ...] | None:
        return (host_key(),) * self.world_size  # every rank lives in this process

    def traffic(self) -> Traffic:
        """Payload bytes and messages per peer (wire bytes 0: no socket)."""
        return Traffic(self.rank, {peer: counts.snapshot()
                                   for peer, counts in enumerate(self._counts)
                                   if peer != self.rank}, self.host_keys())

    def lost_peer_error(self, peer: int) -> Exception | None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            return None
        error = self._hub.boxes[self.rank][peer].failure()
        return error if isinstance(error, PeerLostError) else None

    async def barrier(self, *, timeout: float | None = None) -> None:
        self.check_open("barrier")
        await dissemination_barrier(self, self.timeout if timeout is None else timeout)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finish_recording()
        rank = self.rank
        for dst in range(self.world_size):
            if dst != rank:
                self._hub.boxes[dst][rank].fail(
                    lambda: PeerLostError(rank, f"rank {rank} closed its transport"))
        for src in range(self.world_size):
            self._hub.boxes[rank][src].fail(
                lambda: TransportClosedError(f"rank {rank}: transport is closed"))
