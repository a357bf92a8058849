"""Single copy: one collective's view of the arrays of this host's other ranks.

Where every rank of a host can read and write the others' memory (cross-memory attach,
``attach.py``; the arena's setup probes it), a collective needs no staging area: each
rank announces its array's address to its host's peers, and a rank that owns part of
the work reads the peers' elements straight into its cache-sized buffers and writes the
results straight into their arrays. ``PeerArrays`` is that exchange, the reads and
writes, and the closing handshake after which no rank reaches into another's array
again (so each may return and reuse it).

``fold_block`` is the one fold order used with it: a block of every local rank's array,
lowest local rank first, the same order the staged arena folds in, so both paths give
the same bits. ``fold_blocks`` cuts a range into the blocks it folds, and
``fold_buffers`` lends the two cache-sized buffers it reads peers' blocks into.
"""

from __future__ import annotations

import contextlib
import errno
import struct
from collections.abc import Callable, Iterator

import numpy as np

from netdist.collectives.channel import Channel
from netdist.collectives.host import attach
from netdist.collectives.plan import segment_bounds
from netdist.errors import LocalProtocolError, PeerLostError, SharedMemoryError
from netdist.reduce_kernels import combine
from netdist.types import ReduceOp

__all__ = ["PeerArrays", "fold_block", "fold_blocks", "fold_buffers", "FOLD_BLOCK_BYTES",
           "SUB_ADDRESS", "SUB_DONE"]

FOLD_BLOCK_BYTES = 256 * 1024
"""Each peer's block is read into a buffer this size, which stays in cache while it is
folded and the result written on."""

SUB_ADDRESS, SUB_DONE = 8, 11
"""Sub-tags of a single-copy call's announcements and closing handshake: the staged
arena's round tags (``arena.py``), which no round uses while a single-copy call runs."""

_ADDRESS = struct.Struct("<QQ")  # the array's address and byte count
_DONE = b"\x01"


class PeerArrays:
    """The arrays of one collective on this host's ranks, reachable by single copy.

    ``local_ranks`` are the host's group ranks in local order; ``pids`` maps each to its
    process id. Offsets are in elements of the collective's dtype.
    """

    def __init__(self, chan: Channel, local_ranks: tuple[int, ...], pids: dict[int, int],
                 addresses: dict[int, int], itemsize: int) -> None:
        self._chan = chan
        self.local_ranks = local_ranks
        self.me = local_ranks.index(chan.rank)
        self._pids = pids
        self._addresses = addresses
        self._itemsize = itemsize
        self._peers = tuple(r for r in local_ranks if r != chan.rank)

    @classmethod
    async def exchange(cls, chan: Channel, local_ranks: tuple[int, ...],
                       pids: dict[int, int], array: np.ndarray) -> PeerArrays:
        """Every local rank announces ``array`` (C-contiguous, of the same byte count on
        every local rank: ``LocalProtocolError`` names a rank whose differs) and learns
        the others' (``SUB_ADDRESS`` messages)."""
        peers = tuple(r for r in local_ranks if r != chan.rank)
        announcement = _ADDRESS.pack(array.ctypes.data, array.nbytes)
        for peer in peers:
            await chan.send(peer, announcement, SUB_ADDRESS)
        addresses = {}
        for peer in peers:
            raw = (await chan.recv(peer, sub=SUB_ADDRESS)).tobytes()
            if len(raw) != _ADDRESS.size:
                raise LocalProtocolError(f"group rank {peer} sent a {len(raw)}-byte array "
                                         f"announcement; single copy expects {_ADDRESS.size}")
            address, nbytes = _ADDRESS.unpack(raw)
            if nbytes != array.nbytes:
                raise LocalProtocolError(f"group rank {peer} has a {nbytes}-byte array in "
                                         f"this {chan.op}, group rank {chan.rank} "
                                         f"{array.nbytes}")
            addresses[peer] = int(address)
        return cls(chan, local_ranks, pids, addresses, array.itemsize)

    def read(self, local: int, offset: int, into: np.ndarray) -> np.ndarray:
        """``into`` = local rank ``local``'s elements from ``offset``; returns ``into``."""
        self._move(self.local_ranks[local], attach.read_into, offset, into)
        return into

    def write_all(self, offset: int, data: np.ndarray) -> None:
        """Write ``data`` at element ``offset`` of every other local rank's array."""
        for peer in self._peers:
            self._move(peer, attach.write_from, offset, data)

    def _move(self, peer: int, move: Callable[[int, int, np.ndarray], None], offset: int,
              local: np.ndarray) -> None:
        try:
            move(self._pids[peer], self._addresses[peer] + offset * self._itemsize, local)
        except attach.RemoteReadError as exc:
            if exc.errno == errno.ESRCH:
                raise PeerLostError(self._chan.ranks[peer], f"group rank {peer}'s process "
                                    "is gone (its memory cannot be reached)") from None
            raise SharedMemoryError(f"cannot reach group rank {peer}'s array: "
                                    f"{exc.strerror}") from None

    async def finish(self) -> None:
        """Tell every local peer this rank is done with their arrays, and wait until each
        has said the same (``SUB_DONE``): afterwards nobody reaches into this rank's
        array."""
        for peer in self._peers:
            await self._chan.send(peer, _DONE, SUB_DONE)
        for peer in self._peers:
            await self._chan.recv(peer, sub=SUB_DONE)


def fold_blocks(start: int, stop: int, itemsize: int) -> tuple[tuple[int, int], ...]:
    """``[start, stop)`` in blocks of at most ``FOLD_BLOCK_BYTES``."""
    return segment_bounds(start, stop, max(1, FOLD_BLOCK_BYTES // itemsize))


@contextlib.contextmanager
def fold_buffers(chan: Channel, dtype: np.dtype) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Two ``FOLD_BLOCK_BYTES`` buffers of ``dtype`` from the group's scratch pool, for
    ``fold_block``."""
    block = max(1, FOLD_BLOCK_BYTES // dtype.itemsize)
    with chan.scratch(2 * block * dtype.itemsize) as raw:
        buffers = raw[:2 * block * dtype.itemsize].view(dtype)
        yield buffers[:block], buffers[block:]


def fold_block(op: ReduceOp, peers: PeerArrays, own: np.ndarray, offset: int,
               target: np.ndarray, buffers: tuple[np.ndarray, np.ndarray]) -> None:
    """``target`` = elements ``offset .. offset + len(own)`` of every local rank's array
    folded in local rank order (lowest first); this rank's operand is ``own``, which
    ``target`` may be. ``buffers`` are two scratch arrays at least as long."""
    count = own.size
    first, spare = buffers[0][:count], buffers[1][:count]
    me = peers.me
    size = len(peers.local_ranks)
    if size == 1:
        if target is not own:
            target[...] = own
        return

    def operand(index: int, into: np.ndarray) -> np.ndarray:
        return own if index == me else peers.read(index, offset, into)

    # the own block is an operand of the first fold or a later one: a later one must
    # still read it raw, so then the sum builds up in ``first`` and is copied in at the end
    in_place = np.may_share_memory(target, own)
    acc = first if in_place and me > 1 else target
    combine(op, operand(0, first), operand(1, spare), acc)
    for index in range(2, size):
        combine(op, acc, operand(index, spare), acc)
    if acc is not target:
        target[...] = acc
