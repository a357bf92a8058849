# example: allreduce.py
# run: netdist launch -n 4 -- python allreduce.py
import asyncio

import numpy as np

import netdist
from netdist import ReduceOp
from netdist.collectives import Group


async def main() -> None:
    # Reads NETDIST_* (or torchrun / Slurm / Open MPI) variables; rank 0 hosts the coordinator.
    async with netdist.init() as transport:
        group = Group(transport)
        grad = np.full(4, float(group.rank + 1), dtype=np.float32)
        await group.all_reduce(grad, op=ReduceOp.MEAN)   # in place, identical on every rank
        print(f"rank {group.rank} of {group.world_size}: {grad}")


asyncio.run(main())
