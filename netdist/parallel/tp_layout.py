"""PURE: which piece of a tensor-parallel layer each rank holds, and how it is placed.

The tensor-parallel layers (NumPy ``netdist.parallel.tensor_parallel``, torch
``netdist.torch.tensor_parallel``) split one dimension of a weight over the ``n`` ranks
of their group in contiguous chunks, the first ``total % n`` chunks one larger
(``netdist.sharding.chunk_bounds``, the rule ``Group.all_gather(out=...)`` and
``reduce_scatter`` use, so a gathered output lands in place without a shape exchange).
This module holds that arithmetic, the placements the layers report for checkpoints on a
device mesh, and the shape checks both kits share, so the NumPy and torch layers cannot
disagree about any of it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from netdist.sharding import Replicate, Shard, chunk_bounds

__all__ = ["TPKind", "TPShard", "TPLayout", "TPLayoutOwner", "tp_layout", "check_last_dim",
           "check_ids"]

A = TypeVar("A")


class TPKind(str, enum.Enum):
    """The three tensor-parallel layers; the value is the layer's class name."""

    COLUMN = "ColumnParallelLinear"
    ROW = "RowParallelLinear"
    EMBEDDING = "VocabParallelEmbedding"


@dataclass(frozen=True, slots=True)
class TPShard:
    """This rank's contiguous piece ``[start, stop)`` of a dimension of ``total`` items."""

    total: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)


@dataclass(frozen=True, slots=True)
class TPLayout:
    """How one tensor-parallel layer is split over its group, seen from one rank.

    ``shard`` is this rank's piece of the split dimension (output features of a column
    layer, input features of a row layer, vocabulary rows of an embedding);
    ``placements`` and ``full_shapes`` are keyed by the layer's parameter names
    (``weight``, and ``bias`` when it has one).
    """

    kind: TPKind
    rank: int
    world_size: int
    shard: TPShard
    placements: dict[str, Shard | Replicate]
    full_shapes: dict[str, tuple[int, ...]]

    def piece(self, name: str, full: A) -> A:
        """This rank's piece of the whole parameter ``name`` (a view: index a NumPy array
        or a torch tensor alike; the caller copies)."""
        placement = self.placements[name]
        if isinstance(placement, Replicate):
            return full
        index = (slice(None),) * placement.dim + (self.shard.slice,)
        return full[index]  # type: ignore[index, no-any-return]

    def local_shape(self, name: str) -> tuple[int, ...]:
        """The shape of this rank's piece of parameter ``name``."""
        shape = list(self.full_shapes[name])
        placement = self.placements[name]
        if isinstance(placement, Shard):
            shape[placement.dim] = self.shard.size
        return tuple(shape)


class TPLayoutOwner:
    """What every tensor-parallel layer (NumPy or torch) reports from its ``layout``."""

    layout: TPLayout

    @property
    def tp_placements(self) -> dict[str, Shard | Replicate]:
        """Per local parameter name, how it lies along the tensor-parallel mesh dimension:
        ``Shard(dim)`` (split along its own dimension ``dim``) or ``Replicate()``."""
        return dict(self.layout.placements)

    @property
    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per local parameter name, the shape of the whole (unsplit) parameter."""
        return dict(self.layout.full_shapes)


def tp_layout(kind: TPKind, rows: int, cols: int, *, bias: bool, rank: int,
              world_size: int) -> TPLayout:
    """The layout of a layer whose full weight is ``(rows, cols)``: ``(out, in)`` for the
    linear layers, ``(num_embeddings, embedding_dim)`` for the embedding.

    Every rank must get at least one row (column layer, embedding) or one column (row
    layer) of the split dimension: a smaller dimension is a ``ValueError`` naming the
    layer, as are non-positive sizes and a rank outside the group.
    """
    kind = TPKind(kind)
    who = kind.value
    for what, value in (("rows", rows), ("cols", cols), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{who}: {what} must be a positive int, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{who}: rank {rank} is outside the group of {world_size}")
    split_dim = 1 if kind is TPKind.ROW else 0
    total = (rows, cols)[split_dim]
    if total < world_size:
        what = {TPKind.COLUMN: "out_features", TPKind.ROW: "in_features",
                TPKind.EMBEDDING: "num_embeddings"}[kind]
        raise ValueError(f"{who}: {what}={total} cannot give each of the {world_size} "
                         f"ranks of the tensor-parallel group at least one")
    start, stop = chunk_bounds(total, world_size)[rank]
    placements: dict[str, Shard | Replicate] = {"weight": Shard(split_dim)}
    full_shapes: dict[str, tuple[int, ...]] = {"weight": (rows, cols)}
    if bias:
        if kind is TPKind.EMBEDDING:
            raise ValueError(f"{who} has no bias")
        placements["bias"] = Shard(0) if kind is TPKind.COLUMN else Replicate()
        full_shapes["bias"] = (rows,)
    return TPLayout(kind, rank, world_size, TPShard(total, start, stop), placements,
                    full_shapes)


def check_last_dim(who: str, shape: Sequence[int], expected: int, what: str) -> None:
    """``ValueError`` unless ``shape`` has at least one dimension and the last is
    ``expected`` (``what`` says what the array is: "input", "grad_out", ...)."""
    if len(shape) < 1 or shape[-1] != expected:
        raise ValueError(f"{who}: expected {what} with last dimension {expected}, "
                         f"got shape {tuple(shape)}")


def check_ids(who: str, dtype: str, integer: bool, low: int, high: int,
              num_embeddings: int) -> None:
    """``TypeError`` unless the ids' dtype (named ``dtype``) is an ``integer`` one;
    ``ValueError`` unless every id lies in ``[0, num_embeddings)`` (``low`` and ``high``
    are the smallest and largest id; pass ``0, 0`` for an empty batch)."""
    if not integer:
        raise TypeError(f"{who}: ids must be integers, got dtype {dtype}")
    if low < 0 or high >= num_embeddings:
        raise ValueError(f"{who}: ids must lie in [0, {num_embeddings}), got ids from "
                         f"{low} to {high}")
