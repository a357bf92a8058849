"""PURE destinations of a load: the region of a saved tensor each leaf of ``like`` receives.

Shared by the collective ``load`` and the per-rank ``load_distributed(like=...)``
(through :mod:`netdist.checkpoint.restore`); no I/O happens here.

- an array or tensor: the whole tensor;
- a ``ShardedArray`` along one dim: its rank's slice along that dim, placed by every
  rank's extent (collective) or by the even re-split ``chunk_sizes`` (per rank);
- a ``ShardedArray`` on a mesh (a torch ``DTensor`` too): the piece its placements give
  its rank on the new mesh, built from every rank's place and local shape exactly as a
  save builds it (collective), or the even split, netdist's or torch's, that gives the
  rank the shape it holds (per rank; refused when both do, with different regions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from netdist.checkpoint.metadata import TensorShardSpec
from netdist.checkpoint.planner import Box, box_shape
from netdist.checkpoint.state import ShardedArray, leaf_array
from netdist.checkpoint.summary import MeshExtent, ShardExtent, mesh_sharding_of
from netdist.errors import CheckpointMismatchError
from netdist.sharding import ChunkRule, MeshPosition, MeshSharding, chunk_bounds

__all__ = ["Extent", "full_box", "like_region"]

Extent = ShardExtent | MeshExtent
"""What a rank of a collective load told the others about a ``ShardedArray`` of ``like``."""


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)



def like_region(name: str, path: str, spec: TensorShardSpec, value: Any, rank: int,
                      world_size: int, extents: Sequence[Mapping[str, Extent]] | None
                      ) -> tuple[Box, np.ndarray]:
    """The box of saved tensor ``name`` (placed by ``spec``) that ``like``'s leaf
    ``value`` at ``path`` receives on ``rank`` of ``world_size``, and the array it is
    read into (module docstring); ``CheckpointMismatchError`` for a leaf that cannot
    receive any."""
    if not isinstance(value, ShardedArray):
        dest = leaf_array(value, name)
        if not dest.flags.writeable:
            raise CheckpointMismatchError(f"{name!r}: `like` must hold writeable arrays")
        return full_box(spec.full_shape), dest
    dest, dim = leaf_array(value.data, name), value.shard_dim
    if not dest.flags.writeable:
        raise CheckpointMismatchError(f"{name!r}: `like` must hold writeable arrays")
    if dim is None:
        return _mesh_box(name, path, spec, value, dest, rank, world_size, extents), dest
    if dim >= len(spec.full_shape):
        raise CheckpointMismatchError(f"{name!r}: `like` shards dim {dim} of a "
                                      f"{len(spec.full_shape)}-d tensor")
    if extents is not None:  # collective: every rank's extent is known
        per_rank = [e for e in (x.get(path) for x in extents) if isinstance(e, ShardExtent)]
        if len(per_rank) != len(extents):
            raise CheckpointMismatchError(f"{name!r}: `like` holds it as a ShardedArray "
                                          f"along dim {dim} on rank {rank}, not on every rank")
        offset = sum(e.extent for e in per_rank[:rank])
        total = sum(e.extent for e in per_rank)
        tiles = all(e.shard_dim == dim for e in per_rank) and total == spec.full_shape[dim]
        what = f"(dim {dim}, {total} in all)"
    else:  # per rank: this rank's part of the even re-split
        offset, stop = chunk_bounds(spec.full_shape[dim], world_size)[rank]
        tiles = stop - offset == dest.shape[dim]
        what = (f"(rank {rank} holds {dest.shape[dim]} along dim {dim}; the even split "
                f"over {world_size} ranks gives it {stop - offset})")
    if not tiles:
        raise CheckpointMismatchError(
            f"{name!r}: the shards in `like` {what} do not tile the checkpoint's full "
            f"shape {spec.full_shape}")
    corners = list(full_box(spec.full_shape))
    corners[dim] = (offset, offset + dest.shape[dim])
    return tuple(corners), dest


def _mesh_box(name: str, path: str, spec: TensorShardSpec, value: ShardedArray,
              dest: np.ndarray, rank: int, world_size: int,
              extents: Sequence[Mapping[str, Extent]] | None) -> Box:
    """The box a ``ShardedArray`` on a mesh receives: its piece on the new mesh."""
    position = value.mesh
    if not isinstance(position, MeshPosition) or value.placements is None:  # pragma: no cover
        raise CheckpointMismatchError(f"{name!r}: not placed on a mesh")
    if extents is not None:  # collective: the placement from every rank's piece
        per_rank = [e.get(path) for e in extents]
        sharding = mesh_sharding_of(
            name, [e.place if isinstance(e, MeshExtent) else None for e in per_rank],
            [e.shape if isinstance(e, MeshExtent) else () for e in per_rank])
    else:
        if (position.size, position.rank) != (world_size, rank):
            raise CheckpointMismatchError(
                f"{name!r}: `like` places it at mesh rank {position.rank} of "
                f"{position.size}, but this is rank {rank} of {world_size}")
        sharding = _even_mesh(name, spec, value.placements, position, tuple(dest.shape))
    if sharding.full_shape != spec.full_shape:
        raise CheckpointMismatchError(
            f"{name!r}: the pieces in `like` make up a tensor of shape {sharding.full_shape}, "
            f"the checkpoint holds {spec.full_shape}")
    return sharding.piece_box(sharding.piece_of(rank))


def _even_mesh(name: str, spec: TensorShardSpec, placements: Any, position: MeshPosition,
               shape: tuple[int, ...]) -> MeshSharding:
    """The even split (netdist's or torch's) that gives ``position``'s rank a piece of
    ``shape``; ``CheckpointMismatchError`` when neither does, or both do differently."""
    if any(getattr(p, "dim", 0) >= len(spec.full_shape) for p in placements):
        raise CheckpointMismatchError(f"{name!r}: placements {list(placements)} name dims a "
                                      f"{len(spec.full_shape)}-d tensor lacks")
    fits = {}
    for rule in ChunkRule:
        candidate = MeshSharding.even(spec.full_shape, position.shape, placements, rule)
        box = candidate.piece_box(candidate.piece_of(position.rank))
        if box_shape(box) == shape:
            fits[box] = candidate
    if len(fits) != 1:
        reason = "neither netdist's nor torch's even split gives" if not fits else \
            "netdist's and torch's even splits give different regions of that shape to"
        raise CheckpointMismatchError(
            f"{name!r}: {reason} mesh rank {position.rank} the piece of shape {shape} it "
            f"holds in `like` ({list(placements)} on a mesh of shape {position.shape}, full "
            f"shape {spec.full_shape}); load collectively, where every rank's piece is known")
    return next(iter(fits.values()))
