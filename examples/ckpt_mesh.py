# example: ckpt_mesh.py
# run: netdist launch -n 4 -- python ckpt_mesh.py
import asyncio

import numpy as np

import netdist
from netdist.checkpoint import ShardedArray, load, save
from netdist.collectives import Group
from netdist.sharding import MeshPosition, MeshSharding, Replicate, Shard, mesh_coordinate

W = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # column-parallel: rows split over tp
E = np.arange(5 * 4, dtype=np.float32).reshape(5, 4)  # split along both dims: dp and tp
PLACEMENTS = {"w": (Replicate(), Shard(0)), "e": (Shard(0), Shard(1))}


def model(rank, shape, blank=False):
    """This rank's pieces on a ("dp", "tp") mesh of ``shape`` (mesh rank = group rank)."""
    mesh = MeshPosition(shape, ("dp", "tp"), mesh_coordinate(shape, rank))
    state = {"b": np.zeros(3) if blank else np.arange(3.0)}  # replicated: written once
    for name, full in (("w", W), ("e", E)):
        split = MeshSharding.even(full.shape, shape, PLACEMENTS[name])
        (r0, r1), (c0, c1) = split.piece_box(split.piece_of(rank))
        piece = np.zeros((r1 - r0, c1 - c0), np.float32) if blank else full[r0:r1, c0:c1].copy()
        state[name] = ShardedArray(piece, placements=PLACEMENTS[name], mesh=mesh)
    return state


async def main() -> None:
    async with netdist.init() as transport, Group(transport) as group:
        r = group.rank
        await save(model(r, (2, 2)), "ckpt_mesh", group, step=1, overwrite=True)  # dp=2 x tp=2
        like = model(r, (1, 4), blank=True)  # the same 4 ranks as dp=1 x tp=4
        await load("ckpt_mesh", group, like=like)  # fills each rank's new pieces in place
        print(f"rank {r}: w rows {like['w'].data[:, 0].tolist()} "
              f"e column {like['e'].data[:, 0].tolist()}")


asyncio.run(main())
