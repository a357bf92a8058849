"""PURE route planner: the only place a collective's algorithm is chosen.

A collective's route is decided in two steps, both here:

1. **At issue** (``plan``), from what every rank knows alike -- the operation, the
   message size, the group size and the group's ``Tuning`` -- the planner picks which
   one-host *turn* the call takes (``Turn``) and the algorithm for each answer that turn
   can give. Turns are taken in issue order on every rank, so this step must not depend
   on anything that may differ between ranks.
2. **Inside the turn** (``Route.settle``), once the ranks have agreed whether they share
   a host (the lane is up, or the arena's ``LocalMode``), the route names the one
   algorithm that runs. ``all_gather`` without ``out=`` learns its size only after the
   shape exchange, so its second step also takes the total size
   (``all_gather_algorithm``).

The algorithms, for a group of ``n`` ranks and ``small_message_bytes`` (default 1 MiB):

- ``all_reduce``: up to the threshold, recursive doubling (``log2 n`` rounds, with the fold
  for non-powers of two), through the shared-memory lane when the message fits it
  (``LANE_BYTES``) and every rank is on one host; above it, the host arena on one host,
  the two-level schedule across hosts (``host.two_level``: fold inside each host, every
  lane rank carries its share across, pipelined), else a pipelined ring reduce-scatter +
  all-gather, so each rank sends and receives ``2(n-1)/n`` of the data.
- ``reduce_scatter`` / ``all_gather``: above the threshold the arena on a single host, the
  two-level schedule across hosts of equal size, else the ring; below it the all-reduce
  (keeping the own chunk) and Bruck's all-gather.
- ``broadcast``: binomial tree below; above it the arena on one host, a chain across
  hosts through one rank per host (two-level), or a pipelined chain.
  ``reduce``: binomial tree below, ring reduce-scatter + direct gather to the root above.
- ``gather`` / ``scatter``: linear (the root talks to every rank at once); ``all_to_all``:
  every pair at once; ``barrier``: dissemination; the object collectives: Bruck's
  all-gather and the binomial tree over byte blobs.

Where the group spans hosts (``across_hosts``: by the transport's host keys, known alike
everywhere), the threshold is at most ``ACROSS_HOSTS_SMALL_BYTES``. The two-level
schedules run only where the host's ranks reach each other's arrays (single copy, which
the arena's setup probes); otherwise the staged arena (hosts of equal size: all-reduce
and broadcast) or the TCP algorithm runs.

Every rank ends an all-reduce with bitwise-identical results: the ring reduces each chunk
along one fixed chain and copies the result, recursive doubling combines operands lower
rank first everywhere, and the lane and the arena reduce in one fixed order.

Pipelined algorithms cut each ring step's chunk into about ``PIECES`` segments of
``MIN_SEGMENT_BYTES .. segment_bytes`` (``segment_elements``): segments amortise
Python's per-message cost, and several per step let step ``t + 1`` start before step
``t`` has finished.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from netdist.collectives.host.layout import LocalMode

__all__ = [
    "ACROSS_HOSTS_SMALL_BYTES",
    "Algorithm",
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_SMALL_MESSAGE_BYTES",
    "LANE_BYTES",
    "MIN_SEGMENT_BYTES",
    "Operation",
    "PIECES",
    "Route",
    "Turn",
    "Tuning",
    "all_gather_algorithm",
    "plan",
    "segment_elements",
    "small_bytes",
]

DEFAULT_SMALL_MESSAGE_BYTES = 1024 * 1024
"""Messages up to this many bytes use the latency-optimal algorithms."""

DEFAULT_SEGMENT_BYTES = 4 * 1024 * 1024
"""Largest pipeline segment of the ring and chain algorithms."""

DEFAULT_PIPELINE_DEPTH = 4
"""Scratch segments an in-place ring reduce-scatter rotates through (receives into
scratch are posted at most this far ahead)."""

LANE_BYTES = 8 * 1024
"""Largest all-reduce (bytes per rank) that goes through the shared-memory lane
(``host.lane``): where one message's wake-up, not its bytes, decides the time."""

PIECES = 4
"""Each ring step's chunk is cut into about this many segments (a chain broadcast into
twice as many), within ``MIN_SEGMENT_BYTES .. segment_bytes``."""

MIN_SEGMENT_BYTES = 256 * 1024
"""Smallest segment the ring and chain algorithms cut a mid-sized message into."""

ACROSS_HOSTS_SMALL_BYTES = 64 * 1024
"""Where a group spans hosts, messages above this size (or ``small_message_bytes`` if
lower) take the bandwidth-optimal routes: across a 1-10 Gbit/s link a message's bytes
outweigh a few round trips long before 1 MiB, and recursive doubling moves the whole
message across the link once per rank."""

UNKNOWN_SIZE = -1
"""``plan``'s ``nbytes`` for an ``all_gather`` whose size the shape exchange will tell."""


class Operation(enum.Enum):
    """The collectives whose algorithm depends on size or host layout."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    REDUCE = "reduce"


class Algorithm(enum.Enum):
    """What moves the bytes of one collective call."""

    NOTHING = "nothing"
    """One member, or no data: nothing crosses a link (a reduce-scatter copies its chunk)."""
    DOUBLING = "recursive doubling"
    """All-reduce in ``log2 n`` rounds (``reduce_scatter``: of a copy, keeping the chunk)."""
    LANE = "shared-memory lane"
    """Small all-reduce through a segment shared by every rank of the one host."""
    ARENA = "host arena"
    """Payloads through the host's shared segment, TCP only between hosts."""
    RING = "ring"
    """Pipelined ring (``reduce``: ring reduce-scatter, then a direct gather to the root)."""
    BRUCK = "bruck"
    """All-gather in ``ceil(log2 n)`` rounds."""
    TREE = "binomial tree"
    """Rooted broadcast or reduce in ``ceil(log2 n)`` rounds."""
    CHAIN = "pipelined chain"
    """Broadcast along a chain from the root, segment by segment."""
    TWO_LEVEL = "two-level"
    """Across hosts: inside each host through the ranks' own arrays (single copy), across
    hosts by every lane rank carrying its share over TCP, the stages pipelined
    (``host.two_level``)."""


class Turn(enum.Enum):
    """Which one-host path a call queues for at issue (one turn at a time per path)."""

    NONE = "none"
    LANE = "lane"
    HOST = "host"


@dataclass
class Tuning:
    """A group's algorithm thresholds; every rank of a group must use the same values.
    ``ValueError`` names a value out of range."""

    small_message_bytes: int = DEFAULT_SMALL_MESSAGE_BYTES
    """Messages up to this size use the latency-optimal algorithms."""
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    """Largest pipeline segment of the ring and chain algorithms."""
    pipeline_depth: int = DEFAULT_PIPELINE_DEPTH
    """Scratch segments the in-place ring reduce-scatter rotates through."""

    def __post_init__(self) -> None:
        for name, least in (("small_message_bytes", 0), ("segment_bytes", 1),
                            ("pipeline_depth", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


@dataclass(frozen=True)
class Route:
    """The plan of one call: the turn it takes and what runs for each answer of the turn.

    ``shared`` runs when the turn offers shared memory for this operation, ``otherwise``
    when it does not (or when there is no turn). ``segment`` is the pipeline segment in
    elements (0 where nothing is pipelined).
    """

    turn: Turn
    shared: Algorithm
    otherwise: Algorithm
    segment: int = 0
    arena_modes: frozenset[LocalMode] = frozenset()
    """The arena modes in which ``shared`` runs (a ``Turn.HOST`` route)."""
    two_level_modes: frozenset[LocalMode] = frozenset()
    """The arena modes (across hosts) in which ``Algorithm.TWO_LEVEL`` runs, where the
    host's ranks can reach each other's arrays (single copy)."""

    def settle(self, lane_up: bool = False, arena: LocalMode | None = None,
               single_copy: bool = False) -> Algorithm:
        """The algorithm that runs, once the turn has told whether the lane is up or
        which arena the ranks share (``None``: no arena) and whether its ranks reach each
        other's arrays (``single_copy``)."""
        if self.turn is Turn.LANE:
            return self.shared if lane_up else self.otherwise
        if self.turn is Turn.HOST:
            if single_copy and arena in self.two_level_modes:
                return Algorithm.TWO_LEVEL
            return self.shared if arena in self.arena_modes else self.otherwise
        return self.otherwise


_ANY_ARENA = frozenset({LocalMode.SINGLE_HOST, LocalMode.HIERARCHICAL})
_SINGLE_HOST = frozenset({LocalMode.SINGLE_HOST})
_ACROSS_HOSTS = frozenset({LocalMode.HIERARCHICAL, LocalMode.UNEVEN_HOSTS})
_EVEN_HOSTS = frozenset({LocalMode.HIERARCHICAL})


def segment_elements(itemsize: int, nbytes: int, pieces: int, segment_bytes: int) -> int:
    """Segment length in elements for pipelining ``nbytes`` in about ``pieces`` parts.

    ``segment_bytes`` is the largest segment; smaller messages are cut finer (down to
    ``MIN_SEGMENT_BYTES``) so that a step can forward its first segment long before its
    last one has arrived.
    """
    seg = min(segment_bytes, max(min(MIN_SEGMENT_BYTES, segment_bytes), nbytes // pieces))
    return max(1, seg // max(1, itemsize))


_NOTHING = Route(Turn.NONE, Algorithm.NOTHING, Algorithm.NOTHING)
_LANE_OR_DOUBLING = Route(Turn.LANE, Algorithm.LANE, Algorithm.DOUBLING)
_DOUBLING = Route(Turn.NONE, Algorithm.DOUBLING, Algorithm.DOUBLING)
_BRUCK = Route(Turn.NONE, Algorithm.BRUCK, Algorithm.BRUCK)
_TREE = Route(Turn.NONE, Algorithm.TREE, Algorithm.TREE)
_GATHER_IN_TURN = Route(Turn.HOST, Algorithm.ARENA, Algorithm.RING, 0, _SINGLE_HOST,
                        _EVEN_HOSTS)
# the routes without a segment are shared values: a small call allocates nothing to plan


def small_bytes(tuning: Tuning, across_hosts: bool) -> int:
    """The largest message that takes the latency-optimal routes."""
    if across_hosts:
        return min(tuning.small_message_bytes, ACROSS_HOSTS_SMALL_BYTES)
    return tuning.small_message_bytes


def plan(op: Operation, nbytes: int, itemsize: int, world_size: int, tuning: Tuning,
         across_hosts: bool = False) -> Route:
    """The route of ``op`` over ``nbytes`` (elements of ``itemsize`` bytes) among
    ``world_size`` ranks, which span several hosts if ``across_hosts``; ``nbytes`` is
    ``UNKNOWN_SIZE`` for an ``all_gather`` whose size the shape exchange will tell.
    Depends only on what every rank knows alike."""
    n = world_size
    if n < 2 or nbytes == 0:
        return _NOTHING
    large = nbytes == UNKNOWN_SIZE or nbytes > small_bytes(tuning, across_hosts)
    if op is Operation.ALL_REDUCE:
        if large:
            return Route(Turn.HOST, Algorithm.ARENA, Algorithm.RING,
                         segment_elements(itemsize, nbytes // n, PIECES, tuning.segment_bytes),
                         _ANY_ARENA, _ACROSS_HOSTS)
        return _LANE_OR_DOUBLING if nbytes <= LANE_BYTES else _DOUBLING
    if op is Operation.REDUCE_SCATTER:
        if large:
            return Route(Turn.HOST, Algorithm.ARENA, Algorithm.RING,
                         segment_elements(itemsize, nbytes // n, PIECES, tuning.segment_bytes),
                         _SINGLE_HOST, _EVEN_HOSTS)
        return _DOUBLING
    if op is Operation.ALL_GATHER:
        # the arena can carry it only when it is large; which algorithm runs is told
        # once the size is known (``all_gather_algorithm``)
        return _GATHER_IN_TURN if large else _BRUCK
    if op is Operation.BROADCAST:
        if not large:
            return _TREE
        # a chain of two has nothing to overlap: one message is cheapest
        segment = (nbytes // max(1, itemsize) if n == 2 else
                   segment_elements(itemsize, nbytes, 2 * PIECES, tuning.segment_bytes))
        return Route(Turn.HOST, Algorithm.ARENA, Algorithm.CHAIN, segment, _ANY_ARENA,
                     _ACROSS_HOSTS)
    if op is Operation.REDUCE:
        if not large:
            return _TREE
        return Route(Turn.NONE, Algorithm.RING, Algorithm.RING,
                     segment_elements(itemsize, nbytes // n, PIECES, tuning.segment_bytes))
    raise ValueError(f"no route for {op!r}")


def all_gather_algorithm(route: Route, total_nbytes: int, itemsize: int, world_size: int,
                         arena: LocalMode | None, tuning: Tuning,
                         single_copy: bool = False,
                         across_hosts: bool = False) -> tuple[Algorithm, int]:
    """``(algorithm, segment)`` of an ``all_gather`` once its total size is known (after
    the shape exchange, inside the turn ``route`` took)."""
    if world_size < 2 or total_nbytes == 0:
        return Algorithm.NOTHING, 0
    if total_nbytes <= small_bytes(tuning, across_hosts):
        return Algorithm.BRUCK, 0
    settled = route.settle(arena=arena, single_copy=single_copy)
    if settled is Algorithm.ARENA:
        return Algorithm.ARENA, 0
    segment = segment_elements(itemsize, total_nbytes // world_size, PIECES,
                               tuning.segment_bytes)
    return (Algorithm.TWO_LEVEL if settled is Algorithm.TWO_LEVEL else Algorithm.RING), segment
