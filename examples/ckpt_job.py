# example: ckpt_job.py
# run: netdist launch -n 2 -- python ckpt_job.py
import asyncio

import numpy as np

import netdist
from netdist.checkpoint import ShardedArray, load, save
from netdist.collectives import Group


async def main() -> None:
    async with netdist.init() as transport, Group(transport) as group:
        r = group.rank
        state = {
            "model": {"w": np.arange(6.0).reshape(2, 3)},        # replicated: written once
            "emb": ShardedArray(np.full((3 - r, 4), float(r))),  # rows 0-2 on rank 0, 3-4 on rank 1
            "step": 100,                                         # equal everywhere: stored once
            "rng": np.random.default_rng(r),                     # differs per rank: stored per rank
        }
        # overwrite=True: running the example again replaces step 100
        result = await save(state, "ckpt_job", group, step=100, keep_last=2, overwrite=True)
        like = {"model": {"w": np.zeros((2, 3))}, "emb": ShardedArray(np.zeros((3 - r, 4))),
                "step": 0, "rng": np.random.default_rng(99)}
        loaded = await load("ckpt_job", group, like=like)        # fills like's arrays in place
        same = loaded["rng"].random() == np.random.default_rng(r).random()
        print(f"rank {r}: {result.path.name} step={loaded['step']} "
              f"emb={like['emb'].data[:, 0].tolist()} rng restored={same}")


asyncio.run(main())
