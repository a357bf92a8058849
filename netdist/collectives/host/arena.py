"""Collectives among the ranks of one host, through a shared segment (``HostArena``).

Payloads move through shared memory; TCP carries only one-byte signals between the
host's ranks ("my input for round k is in my slot", "my part of round k is reduced").
Each rank of the host owns one *slot* per round parity, and the host shares one *result*
area per parity; two parities let round ``k + 1`` be written while round ``k`` is still
being read. Every wait is a transport ``recv`` under the collective's deadline, so a
lost or slow peer fails the operation exactly as it would over TCP.

All-reduce, per round ``k`` (``L`` ranks on the host; the data cut into ``L`` chunks as
the ring cuts it, and each chunk into rounds of ``slot_bytes / L``; a collective picks its
slot size so that it takes about ``TARGET_ROUNDS`` rounds, within limits):

1. every rank copies piece ``k`` of every chunk into its slot and signals ``in``;
2. rank ``j`` folds piece ``k`` of chunk ``j`` over all slots, lowest rank first, into
   the result area (so every rank ends with the same bits) and signals ``red``;
3. every rank copies the whole result of round ``k`` out into its array.

Each rank copies its data in once and out once, and reads ``1/L`` of everyone's input
to reduce: no kernel copies, no socket buffers. Round ``k + 1``'s copy-in overlaps the
wait for round ``k``'s reductions. Why two parities suffice: a rank writes its parity-p
slot again (round ``k + 2``) only after everyone signalled ``red`` for round ``k``, and
folds into the parity-p result only after everyone signalled ``in`` for round ``k + 2``,
which each rank does after copying round ``k``'s result out.

Single copy (``ShmCopy.SINGLE``, the default where the kernel allows it; ``peer_arrays``):
on one host the slots are skipped and the ranks reach into each other's arrays themselves (cross-memory attach,
``attach.py``). Every rank sends its array's address (the ``in`` signal); rank ``j``
then owns chunk ``j``: block by block it reads each peer's block into a cache-sized
buffer, folds them straight into its own array, and writes the reduced block, still in
cache, into every peer's array. It signals ``done`` and returns once everyone has. Chunk
``j`` of any array is read raw and written only by rank ``j`` (reads first, block by
block), so no rank's fold sees a reduced block, and a rank's array is left alone once
every ``done`` is in. Per byte reduced that is one copy across processes instead of two,
no staging writes, and one signal round after the addresses.

Between collectives the same holds: each one ends only when no other rank still reads
what this rank writes first in the next (the final ``red``/``done`` waits, and the
broadcast root's release), and the group runs its shared-memory collectives one at a
time in issue order (``HostPath``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

import msgpack
import numpy as np

from netdist.collectives.channel import Channel
from netdist.collectives.host import attach
from netdist.collectives.host.layout import HostLayout, LocalMode
from netdist.collectives.host.peer_arrays import (
    PeerArrays,
    fold_block,
    fold_blocks,
    fold_buffers,
)
from netdist.collectives.host.segments import SegmentLocator, SharedSegment
from netdist.collectives.host.settings import ShmCopy
from netdist.collectives.host.turns import TurnQueue
from netdist.collectives.algorithms.ring import chain_broadcast, ring_all_reduce
from netdist.collectives.algorithms.bruck import bruck_all_gather_blobs
from netdist.errors import SharedMemoryError
from netdist.sharding import chunk_bounds
from netdist.transport.host_identity import host_key
from netdist.reduce_kernels import combine, divide_into
from netdist.types import ReduceOp

__all__ = ["HostArena", "HostPath", "open_host_arena", "host_all_reduce", "host_broadcast",
           "DEFAULT_SLOT_BYTES", "SUB_TAGS"]

logger = logging.getLogger("netdist.collectives")

DEFAULT_SLOT_BYTES = 4 * 1024 * 1024
"""Fewest bytes each rank stages per round (``Group(shm_slot_bytes=)``)."""

MAX_SLOT_BYTES = 16 * 1024 * 1024
"""Most bytes each rank stages per round: large collectives take about ``TARGET_ROUNDS``
rounds up to this, since every round costs ``2 (L - 1)`` signals per rank."""

TARGET_ROUNDS = 4

SEGMENT_BUDGET = 256 * 1024 * 1024
"""With many ranks on a host, the largest slot shrinks so a segment stays within this
(address space: pages are touched only as large collectives use them)."""

_ALIGN = 64
_SIGNAL = b"\x01"

# sub-tags of the collective's tag (group.py reserves 0-7 for the TCP algorithms)
_SUB_IN, _SUB_REDUCED, _SUB_GATHER_IN, _SUB_GATHER_DONE = 8, 9, 10, 11
_SUB_SETUP, _SUB_LOCATE = 12, 13
SUB_CROSS = 14
"""Sub-tag of the across-hosts phase of a hierarchical collective."""
SUB_TAGS = range(8, 15)


@dataclass(frozen=True)
class _Pieces:
    """Round ``k`` of ``chunks`` cut into pieces of at most ``piece`` elements."""

    chunks: Sequence[tuple[int, int]]
    piece: int

    @property
    def rounds(self) -> int:
        longest = max(b - a for a, b in self.chunks)
        return max(1, -(-longest // self.piece))

    def of(self, k: int) -> list[tuple[int, int]]:
        """``(start, stop)`` in the flat array of every chunk's piece in round ``k``."""
        out = []
        for a, b in self.chunks:
            start = min(a + k * self.piece, b)
            out.append((start, min(start + self.piece, b)))
        return out


class HostArena:
    """The shared segment of one group's ranks on this host, and the collectives over it."""

    def __init__(self, segment: SharedSegment, layout: HostLayout, min_slot: int,
                 max_slot: int, pids: dict[int, int] | None = None) -> None:
        self.segment = segment
        self.layout = layout
        self.min_slot = min_slot
        self.max_slot = max_slot
        self.slot_bytes = min_slot
        """The running collective's slot size (the arena runs one at a time)."""
        self._peers = tuple(p for p in layout.local_ranks if p != layout.rank)
        self._pids = pids
        """Group rank -> process id of every rank of the host, when the ranks can read
        each other's memory (single copy); None keeps the staged path."""

    async def peer_arrays(self, chan: Channel, array: np.ndarray) -> PeerArrays:
        """Announce ``array`` to this host's other ranks and learn theirs (single copy;
        ``SharedMemoryError`` on an arena that stages its copies)."""
        if self._pids is None:
            raise SharedMemoryError("single-copy transfer on an arena that stages its copies")
        return await PeerArrays.exchange(chan, self.layout.local_ranks, self._pids, array)

    @property
    def copy(self) -> ShmCopy:
        """How this arena's all-reduce moves bytes (agreed by every rank at setup)."""
        return ShmCopy.STAGED if self._pids is None else ShmCopy.SINGLE

    @staticmethod
    def data_bytes(local_size: int, max_slot: int) -> int:
        return 2 * (local_size + 1) * max_slot

    def _size_slots(self, per_rank_bytes: int) -> None:
        """Pick this collective's slot size from the bytes each rank stages in all: about
        ``TARGET_ROUNDS`` rounds, within ``min_slot .. max_slot`` (equal on every rank)."""
        wanted = -(-per_rank_bytes // TARGET_ROUNDS)
        wanted = -(-wanted // 4096) * 4096
        self.slot_bytes = max(self.min_slot, min(self.max_slot, wanted))

    @property
    def local_size(self) -> int:
        return len(self.layout.local_ranks)

    def close(self) -> None:
        self.segment.close()

    # -- views ----------------------------------------------------------------------------

    def _region(self, parity: int, index: int, dtype: np.dtype, count: int) -> np.ndarray:
        offset = (parity * (self.local_size + 1) + index) * self.slot_bytes
        return self.segment.array(offset, count * dtype.itemsize).view(dtype)

    def slot(self, parity: int, local: int, dtype: np.dtype, count: int) -> np.ndarray:
        return self._region(parity, local, dtype, count)

    def result(self, parity: int, dtype: np.dtype, count: int) -> np.ndarray:
        return self._region(parity, self.local_size, dtype, count)

    # -- signals --------------------------------------------------------------------------

    async def _signal(self, chan: Channel, sub: int, peers: Sequence[int] | None = None,
                      data: bytes = _SIGNAL) -> None:
        for peer in self._peers if peers is None else peers:
            await chan.send(peer, data, sub)

    async def _wait(self, chan: Channel, sub: int, peers: Sequence[int] | None = None) -> None:
        for peer in self._peers if peers is None else peers:
            await chan.recv(peer, sub=sub)

    # -- algorithms -----------------------------------------------------------------------

    def _pieces(self, flat: np.ndarray, chunks: Sequence[tuple[int, int]]) -> _Pieces:
        return _Pieces(chunks, max(1, self.slot_bytes // (len(chunks) * flat.itemsize)))

    def _copy_in(self, flat: np.ndarray, pieces: _Pieces, k: int, own: bool = True) -> None:
        """Stage round ``k``'s pieces of ``flat`` in this rank's slot for the ranks that
        fold them; this rank's own piece only if ``own`` (else its fold reads ``flat``)."""
        me = self.layout.local
        slot = self.slot(k % 2, me, flat.dtype, len(pieces.chunks) * pieces.piece)
        for j, (a, b) in enumerate(pieces.of(k)):
            if own or j != me:
                slot[j * pieces.piece:j * pieces.piece + b - a] = flat[a:b]

    def _fold(self, op: ReduceOp, dtype: np.dtype, pieces: _Pieces, k: int,
              out: np.ndarray, divisor: int | None, flat: np.ndarray | None = None) -> None:
        """``out`` = this rank's piece of round ``k`` folded over every slot, lowest first;
        with ``flat`` (which ``out`` must not overlap), this rank's own contribution is
        read from there instead of from its slot (``_copy_in(own=False)``)."""
        j = self.layout.local
        a, b = pieces.of(k)[j]
        lo, hi = j * pieces.piece, j * pieces.piece + b - a
        width = len(pieces.chunks) * pieces.piece
        slots = [self.slot(k % 2, i, dtype, width)[lo:hi] for i in range(self.local_size)]
        if flat is not None:
            slots[j] = flat[a:b]
        combine(op, slots[0], slots[1], out)
        for other in slots[2:]:
            combine(op, out, other, out)
        if divisor is not None:
            divide_into(out, divisor)

    async def all_reduce(self, chan: Channel, flat: np.ndarray, op: ReduceOp,
                         divisor: int | None) -> None:
        """All-reduce ``flat`` in place among this host's ranks (see the module docstring)."""
        if self._pids is not None:
            await self._all_reduce_single_copy(chan, flat, op, divisor)
            return
        n = self.local_size
        self._size_slots(flat.nbytes)
        pieces = self._pieces(flat, chunk_bounds(flat.size, n))
        width = n * pieces.piece
        j = self.layout.local
        self._copy_in(flat, pieces, 0, own=False)
        await self._signal(chan, _SUB_IN)
        for k in range(pieces.rounds):
            await self._wait(chan, _SUB_IN)
            result = self.result(k % 2, flat.dtype, width)
            self._fold(op, flat.dtype, pieces, k, result[j * pieces.piece:
                       j * pieces.piece + _length(pieces.of(k)[j])], divisor, flat)
            await self._signal(chan, _SUB_REDUCED)
            if k + 1 < pieces.rounds:
                self._copy_in(flat, pieces, k + 1, own=False)
                await self._signal(chan, _SUB_IN)
            await self._wait(chan, _SUB_REDUCED)
            for i, (a, b) in enumerate(pieces.of(k)):
                flat[a:b] = result[i * pieces.piece:i * pieces.piece + b - a]

    async def _all_reduce_single_copy(self, chan: Channel, flat: np.ndarray, op: ReduceOp,
                                      divisor: int | None) -> None:
        """All-reduce by reaching into the peers' arrays directly (see the module
        docstring): fold this rank's chunk, push it to every peer, wait for theirs."""
        peers = await self.peer_arrays(chan, flat)
        a, b = chunk_bounds(flat.size, self.local_size)[self.layout.local]
        with fold_buffers(chan, flat.dtype) as buffers:
            for start, stop in fold_blocks(a, b, flat.itemsize):
                target = flat[start:stop]
                fold_block(op, peers, target, start, target, buffers)
                if divisor is not None:
                    divide_into(target, divisor)
                peers.write_all(start, target)
        await peers.finish()  # every chunk is in; nobody reaches in

    async def reduce_scatter(self, chan: Channel, flat: np.ndarray, op: ReduceOp,
                             chunks: Sequence[tuple[int, int]], out: np.ndarray,
                             divisor: int | None) -> None:
        """Reduce ``flat`` among this host's ranks; local rank ``j`` gets chunk ``j`` in
        ``out`` (which may be ``flat[chunk j]`` itself: each piece is staged before it is
        overwritten)."""
        self._size_slots(flat.nbytes)
        pieces = self._pieces(flat, chunks)
        lo = chunks[self.layout.local][0]
        own = np.may_share_memory(out, flat)  # else the fold reads this rank's piece in place
        for k in range(pieces.rounds):
            if k >= 2:  # parity k % 2 was last read in round k - 2
                await self._wait(chan, _SUB_REDUCED)
            self._copy_in(flat, pieces, k, own)
            await self._signal(chan, _SUB_IN)
            await self._wait(chan, _SUB_IN)
            a, b = pieces.of(k)[self.layout.local]
            self._fold(op, flat.dtype, pieces, k, out[a - lo:b - lo], divisor,
                       None if own else flat)
            await self._signal(chan, _SUB_REDUCED)
        for _ in range(min(2, pieces.rounds)):
            await self._wait(chan, _SUB_REDUCED)

    async def all_gather(self, chan: Channel, out_flat: np.ndarray,
                         chunks: Sequence[tuple[int, int]]) -> None:
        """Every local rank's chunk of ``out_flat`` (already in place on its owner) lands
        in every local rank's ``out_flat``."""
        me = self.layout.local
        self._size_slots(max(b - a for a, b in chunks) * out_flat.itemsize)
        piece = max(1, self.slot_bytes // out_flat.itemsize)
        pieces = _Pieces(chunks, piece)
        for k in range(pieces.rounds):
            if k >= 2:
                await self._wait(chan, _SUB_GATHER_DONE)
            a, b = pieces.of(k)[me]
            self.slot(k % 2, me, out_flat.dtype, piece)[:b - a] = out_flat[a:b]
            await self._signal(chan, _SUB_GATHER_IN)
            await self._wait(chan, _SUB_GATHER_IN)
            for i, (a, b) in enumerate(pieces.of(k)):
                if i != me and b > a:
                    out_flat[a:b] = self.slot(k % 2, i, out_flat.dtype, piece)[:b - a]
            await self._signal(chan, _SUB_GATHER_DONE)
        for _ in range(min(2, pieces.rounds)):
            await self._wait(chan, _SUB_GATHER_DONE)

    async def broadcast(self, chan: Channel, flat: np.ndarray, root: int) -> None:
        """Copy ``flat`` of local rank ``root`` into every local rank's ``flat``: the root
        stages each round once (in all slots of a parity at once), the others copy out.

        The staging area spans the other ranks' slots, so the root releases everyone only
        when all copies are out: no rank's next collective writes its slot earlier."""
        me = self.layout.local
        root_rank = self.layout.local_ranks[root]
        self._size_slots(-(-flat.nbytes // self.local_size))
        piece = max(1, self.local_size * self.slot_bytes // flat.itemsize)
        rounds = max(1, -(-flat.size // piece))
        for k in range(rounds):
            a, b = k * piece, min((k + 1) * piece, flat.size)
            staged = self._region(k % 2, 0, flat.dtype, piece)[:b - a]
            if me == root:
                if k >= 2:
                    await self._wait(chan, _SUB_GATHER_DONE)
                staged[...] = flat[a:b]
                await self._signal(chan, _SUB_GATHER_IN)
            else:
                await chan.recv(root_rank, sub=_SUB_GATHER_IN)
                flat[a:b] = staged
                await chan.send(root_rank, _SIGNAL, _SUB_GATHER_DONE)
        if me == root:
            for _ in range(min(2, rounds)):
                await self._wait(chan, _SUB_GATHER_DONE)
            await self._signal(chan, _SUB_GATHER_IN)  # release: every copy is out
        else:  # nobody writes the staging slots again before all have read them
            await chan.recv(root_rank, sub=_SUB_GATHER_IN)


def _length(bounds: tuple[int, int]) -> int:
    return bounds[1] - bounds[0]


async def open_host_arena(chan: Channel, enabled: bool,
                          slot_bytes: int = DEFAULT_SLOT_BYTES,
                          copy: ShmCopy = ShmCopy.SINGLE
                          ) -> tuple[HostLayout, HostArena | None]:
    """Find which ranks of ``chan``'s group share a host and give them a shared segment.

    Every rank of the group calls this at the same collective (the group's first large
    one). Host keys come from the transport (registered at rendezvous); a transport
    that does not know them has the ranks exchange them over the authenticated transport.
    If no two ranks can share memory, that is the answer, with no message at all.
    Otherwise each host's lowest rank creates the segment and sends its locator to the
    others, who attach, and one exchange agrees on the outcome: if any rank has shared
    memory off, or could not create or attach, every rank uses TCP (saying why once).
    The same exchange carries each rank's probe target; on one host a second exchange
    agrees whether every rank could read every other's memory (single copy) or the
    all-reduce stages its copies (``copy``, or a failed probe anywhere).
    """
    layout = await host_layout(chan, enabled)
    if layout.mode is LocalMode.TCP:
        return layout, None
    local_size = len(layout.local_ranks)
    fit = SEGMENT_BUDGET // (2 * (local_size + 1)) // 4096 * 4096
    max_slot = max(64 * 1024, min(MAX_SLOT_BYTES, fit))
    min_slot = max(4096, min(slot_bytes, max_slot))
    segment, problem = await create_or_attach(
        chan, layout, enabled, HostArena.data_bytes(local_size, max_slot))
    token = (attach.ProbeToken() if copy is ShmCopy.SINGLE and attach.available()
             else None)
    segment, targets = await agree_on_segment(
        chan, segment, problem, None if token is None else token.target.pack(),
        "collectives use TCP")
    if segment is None:
        return replace(layout, mode=LocalMode.TCP), None
    pids = await _agree_single_copy(chan, layout,
                                    [attach.ProbeTarget.unpack(t) for t in targets], token)
    return layout, HostArena(segment, layout, min_slot, max_slot, pids)


async def host_layout(chan: Channel, enabled: bool) -> HostLayout:
    """Which of ``chan``'s group ranks share a host (one collective of every rank).

    Host keys come from the transport (registered at rendezvous); a transport that does
    not know them has the ranks exchange them, and their ``enabled`` settings, over the
    authenticated transport. With known keys each rank's own setting is agreed on later,
    in ``agree_on_segment``.
    """
    known = chan.transport.host_keys()
    if known is None:
        setup = chan.derive(_SUB_SETUP)
        blobs = await bruck_all_gather_blobs(setup, msgpack.packb([enabled, host_key()]))
        entries = [msgpack.unpackb(blob) for blob in blobs]
        keys = [bytes(key) for _, key in entries]
        flags = [bool(on) for on, _ in entries]
    else:
        keys = [known[r] for r in chan.ranks]
        flags = [True] * len(keys)  # each rank's own setting is agreed on below
    return HostLayout.from_keys(keys, flags, chan.rank)


async def agree_on_segment(chan: Channel, segment: SharedSegment | None, problem: str | None,
                           extra: object, fallback: str
                           ) -> tuple[SharedSegment | None, list[object]]:
    """One exchange agreeing whether every rank holds the host's segment: each rank
    sends its ``problem`` (None: attached) and ``extra``. If any rank has a problem,
    every rank drops the segment and returns None, and group rank 0 says why once
    (``fallback`` says what happens instead). Otherwise the creator's descriptor is
    closed (every peer has attached) and the segment is returned with every rank's
    ``extra``, in group rank order."""
    outcomes = await bruck_all_gather_blobs(chan.derive(_SUB_SETUP),
                                            msgpack.packb([problem, extra]))
    entries = [_outcome(msgpack.unpackb(b)) for b in outcomes]
    failed = [(r, text) for r, (text, _) in enumerate(entries) if text is not None]
    if failed:
        if segment is not None:
            segment.close()
        if chan.rank == 0:
            chosen = all(text == _OFF for _, text in failed)
            logger.log(logging.INFO if chosen else logging.WARNING,
                       "netdist: shared memory off for this group, %s: %s", fallback,
                       "; ".join(f"group rank {r}: {t}" for r, t in failed))
        return None, []
    if segment is None:  # every rank reported no problem, so each holds its segment
        raise SharedMemoryError(f"group rank {chan.rank} agreed on shared memory without "
                                "holding a segment")
    segment.release_fd()  # every local peer has attached (the exchange above says so)
    return segment, [extra for _, extra in entries]


def _outcome(entry: object) -> tuple[str | None, object]:
    """A rank's setup outcome: its problem (None: ready) and its extra field."""
    fields = list(entry) if isinstance(entry, (list, tuple)) else []
    if len(fields) != 2 or not (fields[0] is None or isinstance(fields[0], str)):
        return f"malformed setup outcome {entry!r}", None
    return fields[0], fields[1]


async def _agree_single_copy(chan: Channel, layout: HostLayout,
                             targets: Sequence[attach.ProbeTarget | None],
                             token: attach.ProbeToken | None) -> dict[int, int] | None:
    """Group rank -> pid of the host's ranks if every rank read every other's probe
    token back (single copy), else None (staged; said once, at INFO). ``token`` is this
    rank's own, kept alive until everyone has probed it."""
    problem: str | None = None
    if token is None:
        problem = ("single copy is off on this rank (NETDIST_SHM_COPY=staged or "
                   "shm_copy='staged')" if attach.available() else
                   "cross-memory attach (process_vm_readv/writev) is not available "
                   "on this rank")
    else:
        for peer in layout.local_ranks:
            if peer != layout.rank and problem is None:
                problem = attach.probe_peer(targets[peer], f"group rank {peer}")
    verdicts = await bruck_all_gather_blobs(chan.derive(_SUB_SETUP), msgpack.packb(problem))
    del token  # every rank has probed it
    texts = [msgpack.unpackb(b) for b in verdicts]
    problems = [(r, str(text)) for r, text in enumerate(texts) if text is not None]
    if problems:
        if chan.rank == 0:
            logger.info("netdist: shared-memory all-reduce stages its copies: %s",
                        "; ".join(f"group rank {r}: {t}" for r, t in problems))
        return None
    pids = {peer: target.pid for peer, target in enumerate(targets) if target is not None}
    if len(pids) != len(targets):  # every rank read every target back: none is missing
        raise SharedMemoryError(f"group rank {chan.rank} agreed on single copy without "
                                "every rank's probe target")
    return pids


_OFF = "shared memory is off on this rank (NETDIST_SHM=0 or shared_memory=False)"


async def create_or_attach(chan: Channel, layout: HostLayout, enabled: bool,
                            size: int) -> tuple[SharedSegment | None, str | None]:
    """The host's lowest rank creates a segment of ``size`` data bytes and sends its
    locator to the host's other ranks, which attach; returns the segment and this rank's
    problem, if any."""
    leader = layout.local_ranks[0]
    segment: SharedSegment | None = None
    problem: str | None = None if enabled else _OFF
    if layout.is_leader:
        if enabled:
            try:
                segment = SharedSegment.create(size)
            except SharedMemoryError as exc:
                problem = str(exc)
        locator = None if segment is None else segment.locator.pack()
        for peer in layout.local_ranks[1:]:
            await chan.send(peer, msgpack.packb(locator), _SUB_LOCATE)
        return segment, problem
    packed = msgpack.unpackb((await chan.recv(leader, sub=_SUB_LOCATE)).tobytes())
    if not enabled:
        return None, problem
    if packed is None:
        return None, f"group rank {leader} could not create the host's segment"
    try:
        return SharedSegment.attach(SegmentLocator.unpack(packed),
                                    peer=f"group rank {leader}"), None
    except SharedMemoryError as exc:
        return None, str(exc)


class HostPath:
    """A group's same-host data path.

    The group's first collective that could use shared memory sets it up
    (``open_host_arena``); after that, while shared memory is on, the group's
    shared-memory collectives run one at a time in issue order (they share the slots),
    each holding its *turn*. Tickets are taken when a collective is issued, so every rank
    serves them in the same order. When the setup chose TCP, turns are free for all.
    """

    def __init__(self, enabled: bool, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 copy: ShmCopy = ShmCopy.SINGLE) -> None:
        self.enabled = enabled
        self.slot_bytes = slot_bytes
        self.copy = copy
        self.layout: HostLayout | None = None
        self.arena: HostArena | None = None
        self._turns = TurnQueue()

    def ticket(self) -> int:
        """Take the next turn (call when the collective is issued, in issue order)."""
        return self._turns.ticket()

    @contextlib.asynccontextmanager
    async def turn(self, chan: Channel, ticket: int) -> AsyncIterator[HostArena | None]:
        """Wait for ``ticket``'s turn and yield the arena (``None``: use TCP)."""
        try:
            await self._turns.wait(ticket)
            if self.layout is None:
                self.layout, self.arena = await open_host_arena(
                    chan, self.enabled, self.slot_bytes, self.copy)
                self._turns.free = self.arena is None
            yield self.arena
        finally:
            self._turns.done(ticket)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None


async def host_all_reduce(chan: Channel, arena: HostArena, flat: np.ndarray, op: ReduceOp,
                          mean: bool, segment: int, depth: int) -> None:
    """All-reduce ``flat`` in place over the whole group: through the arena alone on one
    host; hierarchically (shared-memory reduce-scatter inside each host, ring all-reduce
    of each chunk across hosts between ranks of equal local index, shared-memory
    all-gather, one stage after the other) on several hosts of equal size whose ranks
    cannot reach each other's arrays (else ``two_level`` runs, pipelined)."""
    layout = arena.layout
    divisor = chan.world_size if mean else None
    if layout.mode is LocalMode.SINGLE_HOST:
        await arena.all_reduce(chan, flat, op, divisor)
        return
    chunks = chunk_bounds(flat.size, arena.local_size)
    lo, hi = chunks[layout.local]
    await arena.reduce_scatter(chan, flat, op, chunks, flat[lo:hi], None)
    if hi > lo:
        cross = chan.subset(layout.cross_ranks, SUB_CROSS)
        await ring_all_reduce(cross, flat[lo:hi], op, segment, depth, divisor=divisor)
    await arena.all_gather(chan, flat, chunks)


async def host_broadcast(chan: Channel, arena: HostArena, flat: np.ndarray, root: int,
                         segment: int) -> None:
    """Broadcast ``flat`` from group rank ``root``: across hosts by a TCP chain between the
    ranks with the root's local index, then inside every host from that rank's copy."""
    layout = arena.layout
    root_host = layout.host_of(root)
    root_local = layout.hosts[root_host].index(root)
    if layout.mode is LocalMode.HIERARCHICAL and layout.local == root_local:
        cross = chan.subset(layout.cross_ranks, SUB_CROSS)
        await chain_broadcast(cross, flat, root_host, segment)
    await arena.broadcast(chan, flat, root_local)
