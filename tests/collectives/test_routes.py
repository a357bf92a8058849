"""Every route decision of ``netdist.collectives.routes``, as tables.

The planner is PURE: these tests need no transport. Each row is one decision: the
operation, the message, the group size and the tuning in; the turn taken at issue and
the algorithm that runs for each answer of the turn out.
"""

from __future__ import annotations

import pytest

from netdist.collectives.host.layout import LocalMode
from netdist.collectives.routes import (
    LANE_BYTES,
    MIN_SEGMENT_BYTES,
    PIECES,
    UNKNOWN_SIZE,
    Algorithm,
    Operation,
    Route,
    Turn,
    Tuning,
    all_gather_algorithm,
    plan,
    segment_elements,
)

A = Algorithm
KIB, MIB = 1024, 1024 * 1024
SMALL = Tuning()  # small_message_bytes 1 MiB, segment_bytes 4 MiB
TINY_THRESHOLD = Tuning(small_message_bytes=1024)  # a threshold below the lane's size
NO_ARENA, SINGLE, HIER = None, LocalMode.SINGLE_HOST, LocalMode.HIERARCHICAL

# (op, nbytes, world, tuning) -> (turn, lane down / no arena, lane up, single host, hierarchical)
TABLE = [
    # one member or no data: nothing moves, no turn
    (Operation.ALL_REDUCE, 4 * MIB, 1, SMALL, Turn.NONE, A.NOTHING, A.NOTHING, A.NOTHING, A.NOTHING),
    (Operation.ALL_REDUCE, 0, 4, SMALL, Turn.NONE, A.NOTHING, A.NOTHING, A.NOTHING, A.NOTHING),
    (Operation.BROADCAST, 0, 4, SMALL, Turn.NONE, A.NOTHING, A.NOTHING, A.NOTHING, A.NOTHING),
    (Operation.REDUCE, 8, 1, SMALL, Turn.NONE, A.NOTHING, A.NOTHING, A.NOTHING, A.NOTHING),
    (Operation.REDUCE_SCATTER, 8, 1, SMALL, Turn.NONE, A.NOTHING, A.NOTHING, A.NOTHING, A.NOTHING),
    (Operation.ALL_GATHER, UNKNOWN_SIZE, 1, SMALL, Turn.NONE, A.NOTHING, A.NOTHING, A.NOTHING, A.NOTHING),
    # all_reduce: the lane up to LANE_BYTES, doubling up to the threshold, arena or ring above
    (Operation.ALL_REDUCE, 8, 2, SMALL, Turn.LANE, A.DOUBLING, A.LANE, A.DOUBLING, A.DOUBLING),
    (Operation.ALL_REDUCE, LANE_BYTES, 4, SMALL, Turn.LANE, A.DOUBLING, A.LANE, A.DOUBLING, A.DOUBLING),
    (Operation.ALL_REDUCE, LANE_BYTES + 1, 4, SMALL, Turn.NONE, A.DOUBLING, A.DOUBLING, A.DOUBLING, A.DOUBLING),
    (Operation.ALL_REDUCE, MIB, 4, SMALL, Turn.NONE, A.DOUBLING, A.DOUBLING, A.DOUBLING, A.DOUBLING),
    (Operation.ALL_REDUCE, MIB + 4, 4, SMALL, Turn.HOST, A.RING, A.RING, A.ARENA, A.ARENA),
    # a threshold below the lane's size: above it the host turn wins, the lane is not asked
    (Operation.ALL_REDUCE, 2 * KIB, 4, TINY_THRESHOLD, Turn.HOST, A.RING, A.RING, A.ARENA, A.ARENA),
    (Operation.ALL_REDUCE, KIB, 4, TINY_THRESHOLD, Turn.LANE, A.DOUBLING, A.LANE, A.DOUBLING, A.DOUBLING),
    # reduce_scatter: doubling of a copy when small; the arena only on a single host
    (Operation.REDUCE_SCATTER, MIB, 4, SMALL, Turn.NONE, A.DOUBLING, A.DOUBLING, A.DOUBLING, A.DOUBLING),
    (Operation.REDUCE_SCATTER, 2 * MIB, 4, SMALL, Turn.HOST, A.RING, A.RING, A.ARENA, A.RING),
    # all_gather: Bruck when small and known; a host turn when large or unknown
    (Operation.ALL_GATHER, MIB, 4, SMALL, Turn.NONE, A.BRUCK, A.BRUCK, A.BRUCK, A.BRUCK),
    (Operation.ALL_GATHER, 2 * MIB, 4, SMALL, Turn.HOST, A.RING, A.RING, A.ARENA, A.RING),
    (Operation.ALL_GATHER, UNKNOWN_SIZE, 4, SMALL, Turn.HOST, A.RING, A.RING, A.ARENA, A.RING),
    # broadcast: tree when small; arena (any) or chain when large
    (Operation.BROADCAST, MIB, 4, SMALL, Turn.NONE, A.TREE, A.TREE, A.TREE, A.TREE),
    (Operation.BROADCAST, 2 * MIB, 4, SMALL, Turn.HOST, A.CHAIN, A.CHAIN, A.ARENA, A.ARENA),
    # reduce: tree when small, ring reduce-scatter + gather when large; never a turn
    (Operation.REDUCE, MIB, 4, SMALL, Turn.NONE, A.TREE, A.TREE, A.TREE, A.TREE),
    (Operation.REDUCE, 2 * MIB, 4, SMALL, Turn.NONE, A.RING, A.RING, A.RING, A.RING),
]


@pytest.mark.parametrize(
    "op, nbytes, world, tuning, turn, plain, lane_up, single, hierarchical", TABLE,
    ids=[f"{row[0].value}-{row[1]}B-n{row[2]}-t{row[3].small_message_bytes}" for row in TABLE])
def test_route_table(op: Operation, nbytes: int, world: int, tuning: Tuning, turn: Turn,
                     plain: Algorithm, lane_up: Algorithm, single: Algorithm,
                     hierarchical: Algorithm) -> None:
    route = plan(op, nbytes, 4, world, tuning)
    assert route.turn is turn
    assert route.settle() is plain
    assert route.settle(arena=NO_ARENA) is plain
    assert route.settle(lane_up=True) is lane_up
    assert route.settle(arena=SINGLE) is single
    assert route.settle(arena=HIER) is hierarchical
    assert route.settle(arena=LocalMode.TCP) is plain


def test_the_route_depends_only_on_what_every_rank_knows() -> None:
    """Same inputs, same route: a plan is a value, so every rank takes the same turn."""
    for op, nbytes, world, tuning, *_ in TABLE:
        assert plan(op, nbytes, 4, world, tuning) == plan(op, nbytes, 4, world, tuning)


# (nbytes per ring chunk, pieces, segment_bytes) -> elements of 4 bytes
SEGMENTS = [
    (256 * MIB, PIECES, 4 * MIB, (4 * MIB) // 4),  # capped at segment_bytes
    (4 * MIB, 4, 4 * MIB, MIB // 4),  # a quarter of the chunk
    (100, 4, 4 * MIB, MIN_SEGMENT_BYTES // 4),  # never below the minimum
    (4 * MIB, 4, 64, 16),  # an explicit small segment_bytes wins over the minimum
    (4 * MIB, 4, 2, 1),  # at least one element
]


@pytest.mark.parametrize("nbytes, pieces, segment_bytes, elements", SEGMENTS)
def test_segment_elements(nbytes: int, pieces: int, segment_bytes: int, elements: int) -> None:
    assert segment_elements(4, nbytes, pieces, segment_bytes) == elements


def test_pipelined_routes_carry_their_segment() -> None:
    tuning = Tuning(segment_bytes=4 * MIB)
    ring = plan(Operation.ALL_REDUCE, 64 * MIB, 4, 4, tuning)
    assert ring.segment == segment_elements(4, 16 * MIB, PIECES, 4 * MIB) == MIB
    scatter = plan(Operation.REDUCE_SCATTER, 64 * MIB, 4, 4, tuning)
    assert scatter.segment == ring.segment
    reduce = plan(Operation.REDUCE, 64 * MIB, 4, 4, tuning)
    assert reduce.segment == ring.segment
    # a chain broadcast cuts the whole message into twice as many pieces ...
    chain = plan(Operation.BROADCAST, 64 * MIB, 4, 4, tuning)
    assert chain.segment == segment_elements(4, 64 * MIB, 2 * PIECES, 4 * MIB) == MIB
    # ... except between two ranks, where nothing overlaps: one message
    pair = plan(Operation.BROADCAST, 64 * MIB, 4, 2, tuning)
    assert pair.segment == 16 * MIB
    assert plan(Operation.ALL_REDUCE, 8, 4, 4, tuning).segment == 0


# (total bytes, world, arena mode) -> (algorithm, segment elements) once the size is known
GATHERS = [
    (0, 4, SINGLE, A.NOTHING, 0),
    (8 * MIB, 1, SINGLE, A.NOTHING, 0),
    (MIB, 4, SINGLE, A.BRUCK, 0),
    (MIB, 4, NO_ARENA, A.BRUCK, 0),
    (8 * MIB, 4, SINGLE, A.ARENA, 0),
    (8 * MIB, 4, HIER, A.RING, segment_elements(4, 2 * MIB, PIECES, 4 * MIB)),
    (8 * MIB, 4, NO_ARENA, A.RING, segment_elements(4, 2 * MIB, PIECES, 4 * MIB)),
]


@pytest.mark.parametrize("total, world, arena, algorithm, segment", GATHERS)
def test_all_gather_algorithm_once_the_size_is_known(total: int, world: int,
                                                     arena: LocalMode | None,
                                                     algorithm: Algorithm, segment: int) -> None:
    route = plan(Operation.ALL_GATHER, UNKNOWN_SIZE, 4, world, SMALL)
    assert all_gather_algorithm(route, total, 4, world, arena, SMALL) == (algorithm, segment)


def test_a_route_without_a_turn_ignores_what_shared_memory_offers() -> None:
    route = Route(Turn.NONE, A.LANE, A.DOUBLING)
    assert route.settle(lane_up=True, arena=SINGLE) is A.DOUBLING


UNEVEN = LocalMode.UNEVEN_HOSTS

# (op, nbytes) -> (hierarchical single copy, uneven single copy, uneven staged): what runs
# across hosts once the turn has said whether the host's ranks reach each other's arrays
ACROSS = [
    (Operation.ALL_REDUCE, 2 * MIB, A.TWO_LEVEL, A.TWO_LEVEL, A.RING),
    (Operation.REDUCE_SCATTER, 2 * MIB, A.TWO_LEVEL, A.RING, A.RING),
    (Operation.ALL_GATHER, 2 * MIB, A.TWO_LEVEL, A.RING, A.RING),
    (Operation.BROADCAST, 2 * MIB, A.TWO_LEVEL, A.TWO_LEVEL, A.CHAIN),
    (Operation.REDUCE, 2 * MIB, A.RING, A.RING, A.RING),
    (Operation.ALL_REDUCE, 8, A.DOUBLING, A.DOUBLING, A.DOUBLING),
]


@pytest.mark.parametrize("op, nbytes, hierarchical, uneven, uneven_staged", ACROSS,
                         ids=[f"{row[0].value}-{row[1]}B" for row in ACROSS])
def test_across_hosts_the_two_level_schedule_needs_single_copy(
        op: Operation, nbytes: int, hierarchical: Algorithm, uneven: Algorithm,
        uneven_staged: Algorithm) -> None:
    route = plan(op, nbytes, 4, 4, SMALL, across_hosts=True)
    assert route.settle(arena=HIER, single_copy=True) is hierarchical
    assert route.settle(arena=UNEVEN, single_copy=True) is uneven
    assert route.settle(arena=UNEVEN) is uneven_staged
    # on one host single copy changes nothing here: the arena decides how it copies
    assert route.settle(arena=SINGLE, single_copy=True) is route.settle(arena=SINGLE)


def test_across_hosts_mid_sized_messages_take_the_bandwidth_routes() -> None:
    """Across hosts recursive doubling would carry the whole message over the link once
    per rank: above ACROSS_HOSTS_SMALL_BYTES the two-level or ring routes run."""
    from netdist.collectives.routes import ACROSS_HOSTS_SMALL_BYTES, small_bytes

    assert small_bytes(SMALL, across_hosts=False) == MIB
    assert small_bytes(SMALL, across_hosts=True) == ACROSS_HOSTS_SMALL_BYTES == 64 * KIB
    assert small_bytes(Tuning(small_message_bytes=KIB), across_hosts=True) == KIB
    mid = 256 * KIB
    assert plan(Operation.ALL_REDUCE, mid, 4, 8, SMALL).otherwise is A.DOUBLING
    across = plan(Operation.ALL_REDUCE, mid, 4, 8, SMALL, across_hosts=True)
    assert across.turn is Turn.HOST and across.otherwise is A.RING
    assert across.settle(arena=HIER, single_copy=True) is A.TWO_LEVEL
    assert plan(Operation.ALL_REDUCE, 64 * KIB, 4, 8, SMALL,
                across_hosts=True).otherwise is A.DOUBLING
    assert all_gather_algorithm(plan(Operation.ALL_GATHER, UNKNOWN_SIZE, 4, 8, SMALL, True),
                                mid, 4, 8, HIER, SMALL, True, True)[0] is A.TWO_LEVEL
