"""torch ``DTensor``s in checkpoints: a ``DTensor`` is the :class:`ShardedArray` of its
local tensor, placed on its device mesh.

Imported only once a ``DTensor`` has been seen in a state (``netdist.checkpoint.state``
recognises one through ``sys.modules`` without importing torch), so netdist never imports
torch for NumPy checkpoints.

A ``DTensor`` on a mesh made by ``init_device_mesh`` is saved with its ``Shard(dim)`` /
``Replicate()`` placements, the mesh's shape and dimension names and this rank's
coordinate; its local tensor (``to_local()``, which shares the ``DTensor``'s memory) is
what is written, and what a load fills in place. A ``DTensor`` on a sub-mesh
(``mesh["tp"]`` of a ``("dp", "tp")`` mesh, as tensor parallelism uses) is placed on the
whole (root) mesh, replicated along the dimensions the sub-mesh leaves out, so every
tensor of one state sits on one mesh. The root mesh must lay out the ranks ``0..n-1``
row-major (``init_device_mesh`` does): a mesh rank is then the rank in the group that
saves. ``Partial`` placements (pending reductions) and torch's internal
``_StridedShard`` cannot be stored: redistribute to ``Shard``/``Replicate`` first.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import placement_types

from netdist.checkpoint.state import ShardedArray
from netdist.sharding import MeshPlacement, MeshPosition, Replicate, Shard

__all__ = ["dtensor_piece"]

_STRIDED = getattr(placement_types, "_StridedShard", None)


def _placement(placement: Any, name: str) -> MeshPlacement:
    if isinstance(placement, Partial):
        raise ValueError(
            f"{name!r}: a DTensor with a Partial placement holds pending partial results, "
            f"which a checkpoint cannot store; redistribute it to Shard/Replicate "
            f"placements first (dtensor.redistribute(mesh, [Replicate(), ...]))")
    if _STRIDED is not None and isinstance(placement, _STRIDED):
        raise ValueError(f"{name!r}: DTensor placement {placement!r} (a strided shard) is "
                         f"not supported; redistribute it to Shard/Replicate placements")
    if isinstance(placement, TorchShard):
        return Shard(int(placement.dim))
    if isinstance(placement, TorchReplicate):
        return Replicate()
    raise ValueError(f"{name!r}: DTensor placement {placement!r} cannot be checkpointed "
                     f"(only Shard and Replicate)")


def dtensor_piece(tensor: DTensor, name: str) -> ShardedArray:
    """The :class:`ShardedArray` a checkpoint stores for ``tensor`` (module docstring):
    its local tensor (sharing memory), placements on the root mesh and this rank's
    position there. ``ValueError`` naming ``name`` for what cannot be stored."""
    mesh = tensor.device_mesh
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    placements = [_placement(p, name) for p in tensor.placements]
    root_names = tuple(root.mesh_dim_names or (f"dim{i}" for i in range(root.ndim)))
    if root is not mesh:
        names = mesh.mesh_dim_names or ()
        if not set(names) <= set(root_names) or len(names) != mesh.ndim:
            raise ValueError(f"{name!r}: the DTensor's mesh dims {names} are not dims of its "
                             f"root mesh {root_names} (flattened dims are not supported)")
        by_name = dict(zip(names, placements))
        placements = [by_name.get(n, Replicate()) for n in root_names]
    layout = root.mesh.flatten().tolist()
    if layout != list(range(len(layout))):
        raise ValueError(f"{name!r}: the DTensor's mesh lays out ranks {layout[:16]}; a "
                         f"checkpoint needs the ranks 0..{len(layout) - 1} in row-major "
                         f"order (as init_device_mesh builds it)")
    coordinate = root.get_coordinate()
    if coordinate is None:
        raise ValueError(f"{name!r}: this rank is not on the DTensor's mesh")
    position = MeshPosition(tuple(root.mesh.shape), root_names, tuple(coordinate))
    return ShardedArray(tensor.to_local(), placements=tuple(placements), mesh=position)
