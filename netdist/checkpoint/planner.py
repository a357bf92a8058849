"""PURE checkpoint planning: who writes what, and which byte ranges each rank reads.

Plans are functions of the metadata only, so every rank computes the same plan without
talking to the others, and tests build every rank's plan in one process:

- :func:`assign_writers` dedups: every distinct piece of a tensor (the whole of a
  replicated tensor, each cell of a mesh-placed one's shard grid) is written once, by the
  rank among those holding it with the fewest planned bytes so far (largest pieces
  first, ties to the lowest rank): a balanced greedy (LPT) schedule instead of "rank 0
  writes everything".
- :func:`plan_writes` lists, per rank, the arrays that go into its file.
- :func:`plan_reads` maps a wanted region of each tensor (a box in full-tensor
  coordinates) onto the stored pieces that overlap it: only those regions are read.
- :func:`run_layout` describes a box of a C-ordered array as a grid of contiguous runs,
  which is what turns a read plan into ``pread`` calls.

Sizes are exact Python ints (``math.prod``), never NumPy's wrapping int64, so a shape
from a hostile file cannot wrap around to a small byte count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from netdist.checkpoint.dtypes import CHECKPOINT_DTYPES
from netdist.checkpoint.metadata import TensorShardSpec, Writer
from netdist.errors import CheckpointCorruptError, CheckpointMismatchError

__all__ = [
    "read_ranks",
    "Box",
    "Piece",
    "writers_of",
    "WriteItem",
    "WritePlan",
    "ReadItem",
    "assign_writers",
    "plan_writes",
    "plan_reads",
    "target_boxes",
    "intersect",
    "box_shape",
    "box_size",
    "run_layout",
]

Box = tuple[tuple[int, int], ...]
"""A region of an array: one ``(start, stop)`` per dimension."""


def _itemsize(spec: TensorShardSpec) -> int:
    return CHECKPOINT_DTYPES[spec.dtype].itemsize if spec.dtype is not None else 1


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_size(box: Box) -> int:
    """Elements in ``box``, exactly (1 for the 0-d box)."""
    return math.prod(box_shape(box))


def intersect(a: Box, b: Box) -> Box | None:
    """Intersection of two boxes, ``None`` when it holds no element."""
    if len(a) != len(b):
        raise ValueError(f"boxes of different rank: {a} and {b}")
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def _shift(box: Box, origin: Box) -> Box:
    return tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


Piece = tuple[str, int]
"""A tensor's piece: ``(tensor name, piece index)`` (``TensorShardSpec.piece_box``)."""


def writers_of(name: str, spec: TensorShardSpec, writers: Mapping[str, Writer]) -> tuple[int, ...]:
    """The rank storing each piece of ``name``: a sharded tensor's shards by their own
    ranks, the others as ``writers`` records them (``CheckpointCorruptError`` when it
    records none, or not one per piece)."""
    if spec.num_shards is not None:
        return tuple(range(spec.num_shards))
    writer = writers.get(name)
    if writer is None:
        kind = "replicated" if spec.is_replicated else "mesh-placed"
        raise CheckpointCorruptError(f"no writer recorded for {kind} tensor {name!r}")
    found = writer if isinstance(writer, tuple) else (writer,)
    if len(found) != spec.num_pieces:
        raise CheckpointCorruptError(f"tensor {name!r} has {spec.num_pieces} pieces but "
                                     f"{len(found)} writers are recorded")
    return found


@dataclass(frozen=True, slots=True)
class WriteItem:
    """One array in one rank's file: its name, local shape and whether other ranks hold
    the same piece (``replicated``: a replicated tensor, or a mesh piece with several
    holders)."""

    name: str
    shape: tuple[int, ...]
    dtype: str | None
    nbytes: int
    replicated: bool


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Every rank's file contents; ``bytes_per_rank[r]`` is rank ``r``'s planned payload."""

    num_ranks: int
    writers: Mapping[str, Writer]
    items: tuple[tuple[WriteItem, ...], ...]
    bytes_per_rank: tuple[int, ...]

    def for_rank(self, rank: int) -> tuple[WriteItem, ...]:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} out of range for world size {self.num_ranks}")
        return self.items[rank]


def assign_writers(specs: Mapping[str, TensorShardSpec], num_ranks: int,
                   pinned: Mapping[Piece, int] | None = None) -> dict[str, Writer]:
    """Pick the one rank that writes each piece held by several ranks.

    Start from each rank's pieces that only it holds (its shards); take the shared
    pieces largest first (ties by name, then piece) and give each to the rank holding it
    with the fewest planned bytes (ties to the lowest rank). ``pinned`` fixes the writer
    of some pieces (counted first). Deterministic: every rank computes the same answer
    from the same specs. Returns a :data:`Writer` per replicated tensor (a rank) and
    per mesh-placed tensor (a rank per piece).
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    pinned = pinned or {}
    load = [0] * num_ranks
    chosen: dict[Piece, int] = {}
    shared = []
    for name, spec in specs.items():
        itemsize = _itemsize(spec)
        for piece, holders in enumerate(spec.piece_holders(num_ranks)):
            nbytes = box_size(spec.piece_box(piece)) * itemsize
            rank = pinned.get((name, piece), holders[0] if len(holders) == 1 else None)
            if rank is None:
                shared.append((nbytes, name, piece, holders))
                continue
            chosen[name, piece] = rank
            load[rank] += nbytes
    for nbytes, name, piece, holders in sorted(shared, key=lambda t: (-t[0], t[1], t[2])):
        rank = min(holders, key=lambda r: (load[r], r))
        chosen[name, piece] = rank
        load[rank] += nbytes
    writers: dict[str, Writer] = {}
    for name, spec in specs.items():
        if spec.is_replicated:
            writers[name] = chosen[name, 0]
        elif spec.mesh is not None:
            writers[name] = tuple(chosen[name, piece] for piece in range(spec.num_pieces))
    return writers


def plan_writes(specs: Mapping[str, TensorShardSpec], num_ranks: int,
                writers: Mapping[str, Writer] | None = None) -> WritePlan:
    """Plan every rank's file: the pieces it writes (its shards, the replicated tensors
    and mesh pieces it was assigned), at most one piece of each tensor."""
    if writers is None:
        writers = assign_writers(specs, num_ranks)
    items: list[list[WriteItem]] = [[] for _ in range(num_ranks)]
    for name, spec in specs.items():
        itemsize = _itemsize(spec)
        holders = spec.piece_holders(num_ranks)
        for piece, rank in enumerate(writers_of(name, spec, writers)):
            shape = box_shape(spec.piece_box(piece))
            items[rank].append(WriteItem(name, shape, spec.dtype, math.prod(shape) * itemsize,
                                         len(holders[piece]) > 1))
    totals = tuple(sum(item.nbytes for item in rank_items) for rank_items in items)
    return WritePlan(num_ranks, dict(writers), tuple(tuple(r) for r in items), totals)


@dataclass(frozen=True, slots=True)
class ReadItem:
    """Copy ``src_box`` of the array ``name`` stored in rank ``src_rank``'s file (whose
    stored shape is ``src_shape``) into ``dst_box`` of the destination array."""

    name: str
    src_rank: int
    src_shape: tuple[int, ...]
    src_box: Box
    dst_box: Box

    @property
    def size(self) -> int:
        return box_size(self.src_box)


def target_boxes(specs: Mapping[str, TensorShardSpec], rank: int) -> dict[str, Box]:
    """The box of every tensor that ``rank`` holds under ``specs``."""
    return {name: spec.box(rank) for name, spec in specs.items()}


def _some_names(saved: Mapping[str, object], limit: int = 8) -> str:
    names = sorted(saved)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def plan_reads(saved: Mapping[str, TensorShardSpec], writers: Mapping[str, Writer],
               wanted: Mapping[str, Box]) -> dict[str, tuple[ReadItem, ...]]:
    """For each wanted tensor region, the stored pieces that cover it.

    ``saved`` and ``writers`` describe the checkpoint; ``wanted[name]`` is a box in
    full-tensor coordinates (any box: a shard along the saved dim, along another dim, a
    piece of another mesh, or the whole tensor). Only the pieces that overlap it are
    read, each from the file of the rank that stored it; they tile the box exactly once.
    A wanted name the checkpoint lacks is a ``CheckpointMismatchError`` naming it.
    """
    plan: dict[str, tuple[ReadItem, ...]] = {}
    for name, want in wanted.items():
        if name not in saved:
            raise CheckpointMismatchError(
                f"plan_reads: tensor {name!r} is not in the checkpoint, which holds "
                f"{len(saved)} tensors ({_some_names(saved)})")
        spec = saved[name]
        if len(want) != len(spec.full_shape):
            raise ValueError(f"{name}: wanted box {want} does not match shape {spec.full_shape}")
        for (lo, hi), n in zip(want, spec.full_shape):
            if not 0 <= lo <= hi <= n:
                raise ValueError(f"{name}: wanted box {want} is outside shape {spec.full_shape}")
        if box_size(want) == 0:
            plan[name] = ()
            continue
        pieces = []
        for piece, src in enumerate(writers_of(name, spec, writers)):
            stored = spec.piece_box(piece)
            overlap = intersect(want, stored)
            if overlap is None:
                continue
            pieces.append(ReadItem(name, src, box_shape(stored), _shift(overlap, stored),
                                   _shift(overlap, want)))
        plan[name] = tuple(pieces)
    return plan


def run_layout(shape: tuple[int, ...], box: Box) -> tuple[int, int]:
    """Describe ``box`` of a C-ordered array of ``shape`` as contiguous runs.

    Returns ``(k, run)``: the box is the grid of index tuples over dims ``< k`` (within
    the box), and each grid point is one contiguous run of ``run`` elements starting at
    the box's corner along dims ``>= k``. A box that is one contiguous range has ``k``
    such that every dim before it has extent 1 within the box.
    """
    ndim = len(shape)
    run = 1
    k = ndim
    for dim in range(ndim - 1, -1, -1):
        lo, hi = box[dim]
        run *= hi - lo
        k = dim
        if (lo, hi) != (0, shape[dim]):
            break
    return k, run


def read_ranks(plan: Mapping[str, Sequence[ReadItem]]) -> set[int]:
    """The ranks whose files a read plan opens."""
    return {item.src_rank for items in plan.values() for item in items}
