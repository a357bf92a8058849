"""PURE collective schedules: which chunk or segment each rank sends and receives, when.

Every function here is a pure function of (rank, world size, sizes) returning frozen
dataclasses, so the whole schedule of a collective can be checked by building every
rank's plan in one process and playing the messages through plain queues (see
``tests/collectives/test_plan.py``). The executors in ``ring.py`` and ``small.py`` only
move bytes by these plans. Ranks here are *group* ranks (0..world_size-1).

Schedules:

- ``ring_plan``: the bandwidth-optimal ring. With chunks ``c_0..c_{n-1}`` (``c_i`` owned by
  rank ``i``), at ring step ``t`` rank ``r`` sends chunk ``(r - t - 1) mod n`` to ``r + 1``
  and receives chunk ``(r - t - 2) mod n`` from ``r - 1``. Steps ``0..n-2`` are the
  reduce-scatter (receive, combine into place; after step ``n-2`` rank ``r`` holds the
  fully reduced chunk ``r``), steps ``n-1..2n-3`` the all-gather (receive straight into
  the final position). Each rank therefore sends and receives ``2(n-1)/n`` of the data,
  and each chunk is reduced along one fixed chain, so every rank ends with the same bits.
  Chunks are split into segments that are pipelined: segment ``k`` of step ``t + 1`` may
  be sent as soon as segment ``k`` of step ``t`` has arrived.
- ``chain_broadcast_plan``: a pipelined chain from the root, segment by segment.
- ``recursive_doubling_plan``: latency-optimal all-reduce in ``log2 n`` exchange rounds,
  with the standard fold for world sizes that are not powers of two.
- ``binomial_tree``: parent and children for tree broadcast / reduce.
- ``bruck_allgather_plan``: all-gather in ``ceil(log2 n)`` rounds for any ``n``.
"""

from __future__ import annotations

from dataclasses import dataclass

from netdist.sharding import chunk_bounds

__all__ = [
    "RingSend",
    "RingRecv",
    "RingPlan",
    "ring_plan",
    "ring_all_reduce_plan",
    "ring_reduce_scatter_plan",
    "ring_all_gather_plan",
    "segment_bounds",
    "ChainPlan",
    "chain_broadcast_plan",
    "DoublingPlan",
    "recursive_doubling_plan",
    "TreeNode",
    "binomial_tree",
    "BruckRound",
    "bruck_allgather_plan",
    "offsets_from_sizes",
]


def _check_world(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")


def segment_bounds(start: int, stop: int, segment: int) -> tuple[tuple[int, int], ...]:
    """Split ``[start, stop)`` into ``ceil(len / segment)`` near-equal contiguous pieces.

    An empty range has no segments. Splitting evenly (rather than ``segment``-sized pieces
    plus a tail) keeps every message about the same size.
    """
    if segment < 1:
        raise ValueError(f"segment size must be >= 1, got {segment}")
    length = stop - start
    if length < 0:
        raise ValueError(f"empty or negative range [{start}, {stop})")
    if length == 0:
        return ()
    count = -(-length // segment)
    return tuple((start + a, start + b) for a, b in chunk_bounds(length, count))


def offsets_from_sizes(sizes: tuple[int, ...] | list[int]) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of consecutive pieces with the given sizes."""
    bounds = []
    start = 0
    for size in sizes:
        if size < 0:
            raise ValueError(f"sizes must be >= 0, got {list(sizes)}")
        bounds.append((start, start + size))
        start += size
    return tuple(bounds)


# --------------------------------------------------------------------------------------
# Ring


@dataclass(frozen=True, slots=True)
class RingSend:
    """One segment this rank sends to its right neighbour."""

    step: int
    """Ring step (0..n-2 reduce-scatter, n-1..2n-3 all-gather)."""
    chunk: int
    segment: int
    start: int
    """Element offset into the flat buffer (inclusive)."""
    stop: int
    after_recv: int
    """Index into ``RingPlan.recvs`` that must have completed first (-1: none). The
    segment sent at step ``t`` is the one received (and reduced) at step ``t - 1``."""


@dataclass(frozen=True, slots=True)
class RingRecv:
    """One segment this rank receives from its left neighbour."""

    step: int
    chunk: int
    segment: int
    start: int
    stop: int
    reduce: bool
    """True in reduce-scatter steps: combine the incoming segment into place."""
    slot_after_send: int
    """For executors that receive into a two-slot scratch area indexed by step parity
    (a non-destructive reduce-scatter): index into ``RingPlan.sends`` that must have
    completed before this segment's slot bytes may be overwritten (-1: none)."""


@dataclass(frozen=True, slots=True)
class RingPlan:
    rank: int
    world_size: int
    send_to: int
    recv_from: int
    chunks: tuple[tuple[int, int], ...]
    """Element bounds of every rank's chunk."""
    first_step: int
    num_steps: int
    sends: tuple[RingSend, ...]
    recvs: tuple[RingRecv, ...]

    @property
    def sent_elements(self) -> int:
        return sum(s.stop - s.start for s in self.sends)

    @property
    def received_elements(self) -> int:
        return sum(r.stop - r.start for r in self.recvs)


def ring_plan(rank: int, world_size: int, chunks: tuple[tuple[int, int], ...],
              segment: int, first_step: int, num_steps: int) -> RingPlan:
    """The ring schedule for steps ``first_step .. first_step + num_steps - 1``.

    ``chunks`` are the element bounds of each rank's chunk (``len(chunks) == world_size``);
    ``segment`` is the maximum segment length in elements.
    """
    _check_world(rank, world_size)
    n = world_size
    if len(chunks) != n:
        raise ValueError(f"need {n} chunks, got {len(chunks)}")
    if first_step < 0 or num_steps < 0 or first_step + num_steps > 2 * n - 2:
        raise ValueError(f"steps {first_step}..{first_step + num_steps - 1} are outside "
                         f"0..{2 * n - 3} for world size {n}")
    segs = [segment_bounds(a, b, segment) for a, b in chunks]
    sends: list[RingSend] = []
    recvs: list[RingRecv] = []
    # index of the first recv / send of each step, to resolve dependencies
    recv_index: dict[tuple[int, int], int] = {}
    send_index: dict[tuple[int, int], int] = {}
    for t in range(first_step, first_step + num_steps):
        send_chunk = (rank - t - 1) % n
        for k, (a, b) in enumerate(segs[send_chunk]):
            after = recv_index.get((t - 1, k), -1)
            send_index[(t, k)] = len(sends)
            sends.append(RingSend(t, send_chunk, k, a, b, after))
        recv_chunk = (rank - t - 2) % n
        c0 = chunks[recv_chunk][0]
        for k, (a, b) in enumerate(segs[recv_chunk]):
            slot_after = -1
            if t - 2 >= first_step:
                # the slot (parity of t) last held step t-2's segments, which were sent
                # at step t-1: wait for every such send overlapping [a, b) in the slot.
                prev_chunk = (rank - (t - 1) - 1) % n
                p0 = chunks[prev_chunk][0]
                for j, (pa, pb) in enumerate(segs[prev_chunk]):
                    if pa - p0 < b - c0 and a - c0 < pb - p0:
                        slot_after = max(slot_after, send_index[(t - 1, j)])
            recv_index[(t, k)] = len(recvs)
            recvs.append(RingRecv(t, recv_chunk, k, a, b, t < n - 1, slot_after))
    return RingPlan(rank, n, (rank + 1) % n, (rank - 1) % n, tuple(chunks), first_step,
                    num_steps, tuple(sends), tuple(recvs))


def ring_all_reduce_plan(rank: int, world_size: int, total: int, segment: int) -> RingPlan:
    """Ring reduce-scatter then ring all-gather over ``chunk_bounds(total, world_size)``."""
    _check_world(rank, world_size)
    chunks = tuple(chunk_bounds(total, world_size))
    return ring_plan(rank, world_size, chunks, segment, 0, 2 * world_size - 2)


def ring_reduce_scatter_plan(rank: int, world_size: int, total: int, segment: int,
                             chunks: tuple[tuple[int, int], ...] | None = None) -> RingPlan:
    """Ring reduce-scatter: afterwards rank ``r`` holds reduced chunk ``r`` (``chunks``:
    each rank's bounds in the ``total`` elements, default ``chunk_bounds``)."""
    _check_world(rank, world_size)
    if chunks is None:
        chunks = tuple(chunk_bounds(total, world_size))
    elif chunks and (chunks[0][0] < 0 or chunks[-1][1] > total):
        raise ValueError(f"chunks {chunks} reach outside 0..{total}")
    return ring_plan(rank, world_size, chunks, segment, 0, world_size - 1)


def ring_all_gather_plan(rank: int, world_size: int, chunks: tuple[tuple[int, int], ...],
                         segment: int) -> RingPlan:
    """Ring all-gather of per-rank chunks (any sizes): receive each into its place."""
    _check_world(rank, world_size)
    return ring_plan(rank, world_size, chunks, segment, world_size - 1, world_size - 1)


# --------------------------------------------------------------------------------------
# Chain broadcast


@dataclass(frozen=True, slots=True)
class ChainPlan:
    """Pipelined chain broadcast: receive each segment from ``recv_from`` and forward it."""

    rank: int
    world_size: int
    root: int
    recv_from: int
    """-1 on the root."""
    send_to: int
    """-1 on the last rank of the chain."""
    segments: tuple[tuple[int, int], ...]


def chain_broadcast_plan(rank: int, world_size: int, root: int, total: int,
                         segment: int) -> ChainPlan:
    """Chain ``root -> root+1 -> ... -> root-1`` (mod n), ``total`` elements in segments.

    Forwarding segment ``k`` may start once segment ``k`` has arrived, so the chain
    costs about ``total + (n - 2) * segment`` element-times rather than ``(n - 1) * total``.
    """
    _check_world(rank, world_size)
    _check_world(root, world_size)
    n = world_size
    v = (rank - root) % n
    recv_from = -1 if v == 0 else (rank - 1) % n
    send_to = -1 if v == n - 1 else (rank + 1) % n
    return ChainPlan(rank, n, root, recv_from, send_to, segment_bounds(0, total, segment))


# --------------------------------------------------------------------------------------
# Recursive doubling


@dataclass(frozen=True, slots=True)
class DoublingPlan:
    """Recursive-doubling all-reduce for one rank.

    With ``p`` the largest power of two <= n and ``extra = n - p``: ranks ``0, 2, ..,
    2*extra - 2`` fold their data into the next rank up and wait for the result; the
    remaining ``p`` ranks exchange with partner ``newrank ^ 2**k`` in round ``k``. Operands
    are always combined lower-rank side first, so every rank evaluates the identical
    expression and ends with identical bits, even for MAX/MIN of +0.0/-0.0.
    """

    rank: int
    world_size: int
    fold_send_to: int
    """This rank sits out: send its data here first, receive the result from it last."""
    fold_recv_from: int
    """Receive a folded rank's data from here first (it is the lower operand) and send
    it the result last."""
    rounds: tuple[tuple[int, bool], ...]
    """``(partner, partner_is_lower)`` per exchange round."""


def recursive_doubling_plan(rank: int, world_size: int) -> DoublingPlan:
    _check_world(rank, world_size)
    n = world_size
    p = 1
    while p * 2 <= n:
        p *= 2
    extra = n - p
    if rank < 2 * extra and rank % 2 == 0:
        return DoublingPlan(rank, n, rank + 1, -1, ())
    fold_from = rank - 1 if rank < 2 * extra else -1
    newrank = rank // 2 if rank < 2 * extra else rank - extra

    def actual(nr: int) -> int:
        return nr * 2 + 1 if nr < extra else nr + extra

    rounds = []
    mask = 1
    while mask < p:
        partner_new = newrank ^ mask
        rounds.append((actual(partner_new), partner_new < newrank))
        mask *= 2
    return DoublingPlan(rank, n, -1, fold_from, tuple(rounds))


# --------------------------------------------------------------------------------------
# Binomial tree


@dataclass(frozen=True, slots=True)
class TreeNode:
    """A rank's place in the binomial tree rooted at ``root``."""

    rank: int
    world_size: int
    root: int
    parent: int
    """-1 on the root."""
    children: tuple[int, ...]
    """Nearest (smallest subtree) first: receive order for a reduce; a broadcast sends in
    reverse, largest subtree first."""


def binomial_tree(rank: int, world_size: int, root: int) -> TreeNode:
    _check_world(rank, world_size)
    _check_world(root, world_size)
    n = world_size
    v = (rank - root) % n
    parent = -1
    children = []
    mask = 1
    while mask < n:
        if v & mask:
            parent = ((v - mask) + root) % n
            break
        if v + mask < n:
            children.append(((v + mask) + root) % n)
        mask *= 2
    return TreeNode(rank, n, root, parent, tuple(children))


# --------------------------------------------------------------------------------------
# Bruck all-gather


@dataclass(frozen=True, slots=True)
class BruckRound:
    send_to: int
    recv_from: int
    send_blocks: tuple[int, ...]
    """Group ranks whose blocks are sent, in message order."""
    recv_blocks: tuple[int, ...]


def bruck_allgather_plan(rank: int, world_size: int) -> tuple[BruckRound, ...]:
    """Bruck all-gather: ``ceil(log2 n)`` rounds, each rank's block reaches every rank.

    Before round ``k`` rank ``r`` holds blocks ``r, r+1, .., r+2**k-1`` (mod n); it sends
    the first ``min(2**k, n - 2**k)`` of them to ``r - 2**k`` and receives as many from
    ``r + 2**k``.
    """
    _check_world(rank, world_size)
    n = world_size
    rounds = []
    dist = 1
    while dist < n:
        count = min(dist, n - dist)
        rounds.append(BruckRound(
            (rank - dist) % n, (rank + dist) % n,
            tuple((rank + j) % n for j in range(count)),
            tuple((rank + dist + j) % n for j in range(count))))
        dist *= 2
    return tuple(rounds)
