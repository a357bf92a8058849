"""Two-level collectives across hosts (``Algorithm.TWO_LEVEL``): what the links allow.

For ``S`` bytes over ``H`` hosts whose links each carry ``B`` bytes/s per direction, an
all-reduce cannot move less than ``2(H-1)/H x S`` across a host's link, so it takes at
least ``2(H-1)/H x S / B``; a reduce-scatter or all-gather ``(H-1)/H x S``, a broadcast
``S``. A flat ring over all ``N`` ranks moves ``2(N-1)/N x S`` across each host's link
(at 2 hosts x 2 ranks, 1.5x the bound). These schedules reach the bound's byte counts:

- **all-reduce**: the array is cut into ``lanes`` chunks (``HostLayout.lanes``, the
  smallest host's rank count); local rank ``c`` of every host owns chunk ``c``. It folds
  its chunk over its host's ranks by reading their arrays directly (single copy,
  ``PeerArrays``), all-reduces it across hosts in a ring among the ranks of local index
  ``c`` (one per host), and writes the result into its host's arrays. Every lane rank
  carries its share across, not one leader all of it, and the chunk goes in *pieces*
  (of the group's ``segment_bytes``) with two pieces' rings in flight on two tags, so the next piece is
  folded while the link carries the last and the link never waits for a fold or a copy.
- **reduce-scatter** (hosts of equal size): local rank ``c`` folds the chunks of every
  host's rank ``c`` over its host, then reduce-scatters them across hosts in the lane's
  ring, so each rank's reduced chunk ends on that rank.
- **all-gather** (hosts of equal size): the lane's ring gathers the chunks of every
  host's rank ``c``; each segment is written into the host's other arrays as it lands.
- **broadcast**: a pipelined chain across hosts from the root through one rank per host,
  each segment written into the host's other arrays as it lands.

Bitwise: every rank of the group ends an all-reduce with the ring's result, and each
element is folded in one fixed order (local ranks lowest first, then along the ring).
Each collective ends with ``PeerArrays.finish``: no rank returns while another may
still reach into its array.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from netdist.collectives.algorithms.ring import (
    chain_broadcast,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from netdist.collectives.channel import Channel
from netdist.collectives.host.arena import SUB_CROSS, HostArena
from netdist.collectives.host.peer_arrays import fold_block, fold_blocks, fold_buffers
from netdist.collectives.plan import offsets_from_sizes
from netdist.collectives.routes import PIECES, segment_elements
from netdist.sharding import chunk_bounds
from netdist.types import ReduceOp

__all__ = ["two_level_all_reduce", "two_level_reduce_scatter", "two_level_all_gather",
           "two_level_broadcast", "MIN_PIECE_BYTES"]

MIN_PIECE_BYTES = 512 * 1024
"""Smallest piece a mid-sized lane is cut into (``_piece_count``)."""

MIN_PIECES = 4
"""A lane crosses in at least this many pieces where each holds ``MIN_PIECE_BYTES``: the
first fold and the last copy, which the link waits for, are that much shorter."""

_PIECE_TAGS = (SUB_CROSS, SUB_CROSS + 1)
"""Two pieces in flight, on alternating sub-tags (a tag is reused only after the piece
that last used it has finished on this rank)."""


def _piece_count(nbytes: int, piece_bytes: int) -> int:
    """Pieces to cut a lane's ``nbytes`` into: at most about ``piece_bytes`` each, and up
    to ``MIN_PIECES`` where each would still hold ``MIN_PIECE_BYTES`` (or ``piece_bytes``
    if smaller), so even a mid-sized message overlaps its folds with the link."""
    least = min(MIN_PIECE_BYTES, piece_bytes)
    return max(-(-nbytes // piece_bytes), min(MIN_PIECES, nbytes // least), 1)


def _cut(start: int, stop: int, count: int) -> tuple[tuple[int, int], ...]:
    """``[start, stop)`` in ``count`` near-equal pieces (some empty if it is short)."""
    return tuple((start + a, start + b) for a, b in chunk_bounds(stop - start, count))


async def _in_flight(chan: Channel, members: tuple[int, ...], count: int,
                     before: Callable[[int], None],
                     cross: Callable[[Channel, int], Awaitable[None]],
                     after: Callable[[int], None]) -> None:
    """For each piece ``k < count``: ``before(k)`` (on this thread), then ``cross(lane,
    k)`` among ``members`` as a task, at most two at once; ``after(k)`` once its
    ``cross`` is done, in piece order."""
    running: deque[tuple[asyncio.Future[None], int]] = deque()
    try:
        for k in range(count):
            before(k)
            lane = chan.subset(members, _PIECE_TAGS[k % 2])
            running.append((asyncio.ensure_future(cross(lane, k)), k))
            if len(running) == len(_PIECE_TAGS):
                task, done = running.popleft()
                await task
                after(done)
        while running:
            task, done = running.popleft()
            await task
            after(done)
    finally:
        for task, _ in running:
            task.cancel()
        if running:
            await asyncio.gather(*(task for task, _ in running), return_exceptions=True)


def _nothing(k: int) -> None:
    """No step after a piece's ``cross``."""


async def two_level_all_reduce(chan: Channel, arena: HostArena, flat: np.ndarray,
                               op: ReduceOp, divisor: int | None, segment_bytes: int,
                               depth: int) -> None:
    """All-reduce ``flat`` in place over the whole group (see the module docstring)."""
    layout = arena.layout
    peers = await arena.peer_arrays(chan, flat)
    if layout.local < layout.lanes:
        a, b = chunk_bounds(flat.size, layout.lanes)[layout.local]
        hosts = len(layout.hosts)
        pieces = _cut(a, b, _piece_count((b - a) * flat.itemsize, segment_bytes))
        with fold_buffers(chan, flat.dtype) as buffers:

            def fold(k: int) -> None:
                for s, e in fold_blocks(*pieces[k], flat.itemsize):
                    fold_block(op, peers, flat[s:e], s, flat[s:e], buffers)

            async def across(lane: Channel, k: int) -> None:
                piece = flat[pieces[k][0]:pieces[k][1]]
                segment = segment_elements(flat.itemsize, piece.nbytes // hosts, PIECES,
                                           segment_bytes)
                await ring_all_reduce(lane, piece, op, segment, depth, divisor)

            def spread(k: int) -> None:
                for s, e in fold_blocks(*pieces[k], flat.itemsize):
                    peers.write_all(s, flat[s:e])

            await _in_flight(chan, layout.lane(layout.local), len(pieces), fold, across,
                             spread)
    await peers.finish()


async def two_level_reduce_scatter(chan: Channel, arena: HostArena, flat: np.ndarray,
                                   op: ReduceOp, chunks: Sequence[tuple[int, int]],
                                   out: np.ndarray, segment_bytes: int) -> None:
    """Reduce ``flat`` over the group; group rank ``r`` gets chunk ``chunks[r]`` in ``out``
    (which may be that chunk of ``flat``). Hosts of equal size; ``flat`` unchanged."""
    layout = arena.layout
    peers = await arena.peer_arrays(chan, flat)
    members = layout.lane(layout.local)
    mine = [chunks[m] for m in members]  # the lane's chunks, in host order
    count = _piece_count(sum(b - a for a, b in mine) * flat.itemsize, segment_bytes)
    cuts = [_cut(a, b, count) for a, b in mine]  # cuts[h][k]: piece k of host h's chunk
    # staged piece by piece: piece k of every host's chunk, side by side
    sizes = [[cut[k][1] - cut[k][0] for cut in cuts] for k in range(count)]
    starts = np.cumsum([0] + [sum(row) for row in sizes]).tolist()
    own = members.index(chan.rank)
    base = mine[own][0]
    with chan.scratch(starts[-1] * flat.itemsize) as raw, \
            fold_buffers(chan, flat.dtype) as buffers:
        stage = raw[:starts[-1] * flat.itemsize].view(flat.dtype)

        def fold(k: int) -> None:
            at = starts[k]
            for cut in cuts:
                a, b = cut[k]
                for x, y in fold_blocks(a, b, flat.itemsize):
                    fold_block(op, peers, flat[x:y], x, stage[at + x - a:at + y - a],
                               buffers)
                at += b - a

        async def across(lane: Channel, k: int) -> None:
            a, b = cuts[own][k]
            piece = stage[starts[k]:starts[k + 1]]
            segment = segment_elements(flat.itemsize, piece.nbytes // len(members), PIECES,
                                       segment_bytes)
            await ring_reduce_scatter(lane, piece, op, out[a - base:b - base], segment,
                                      offsets_from_sizes(sizes[k]))

        await _in_flight(chan, members, count, fold, across, _nothing)
    await peers.finish()


async def two_level_all_gather(chan: Channel, arena: HostArena, out_flat: np.ndarray,
                               chunks: Sequence[tuple[int, int]], segment: int) -> None:
    """Every rank's chunk of ``out_flat`` (already in place on its owner) lands in every
    rank's ``out_flat``. Hosts of equal size."""
    layout = arena.layout
    peers = await arena.peer_arrays(chan, out_flat)
    members = layout.lane(layout.local)

    def spread(start: int, stop: int) -> None:
        peers.write_all(start, out_flat[start:stop])

    gathering = ring_all_gather(chan.subset(members, SUB_CROSS), out_flat,
                                tuple(chunks[m] for m in members), segment, spread)
    await _spreading(gathering, spread, *chunks[chan.rank], out_flat.itemsize)
    await peers.finish()


async def two_level_broadcast(chan: Channel, arena: HostArena, flat: np.ndarray, root: int,
                              segment: int) -> None:
    """Copy group rank ``root``'s ``flat`` into every rank's ``flat``: a pipelined chain
    across hosts through the root and the lowest rank of every other host, each of which
    writes every segment into its host's other arrays."""
    layout = arena.layout
    root_host = layout.host_of(root)
    carriers = tuple(root if h == root_host else members[0]
                     for h, members in enumerate(layout.hosts))
    peers = await arena.peer_arrays(chan, flat)
    if chan.rank in carriers:

        def spread(start: int, stop: int) -> None:
            peers.write_all(start, flat[start:stop])

        cross = chan.subset(carriers, SUB_CROSS)
        if chan.rank == root:
            sending = chain_broadcast(cross, flat, root_host, segment)
            await _spreading(sending, spread, 0, flat.size, flat.itemsize)
        else:
            await chain_broadcast(cross, flat, root_host, segment, spread)
    await peers.finish()


async def _spreading(work: Awaitable[None], spread: Callable[[int, int], None],
                     start: int, stop: int, itemsize: int) -> None:
    """Run ``work`` as a task while ``spread``-ing ``[start, stop)`` block by block,
    letting the loop run it between blocks (so the link is fed while this rank copies);
    ``work``'s error propagates, and the task never outlives the call."""
    task = asyncio.ensure_future(work)
    try:
        for a, b in fold_blocks(start, stop, itemsize):
            if task.done() and (task.cancelled() or task.exception() is not None):
                break  # awaiting it raises
            spread(a, b)
            await asyncio.sleep(0)
        await task
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
