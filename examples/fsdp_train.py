# example: fsdp_train.py
# run: netdist launch -n 2 -- python fsdp_train.py
import asyncio

import numpy as np

import netdist
from netdist import FSDP, SGD, ShardingStrategy, softmax_cross_entropy
from netdist.collectives import Group
from netdist.train import mlp


async def main() -> None:
    async with netdist.init() as transport, Group(transport) as group:
        model = mlp([20, 64, 64, 5], rng=np.random.default_rng(0))      # same model on every rank
        reference = mlp([20, 64, 64, 5], rng=np.random.default_rng(0))  # trained alone, to compare
        ref_opt = SGD(reference.parameters(), lr=0.1, momentum=0.9)
        async with FSDP(model, group, ShardingStrategy.FULL_SHARD, prefetch_depth=1,
                        optimizer=SGD(model.parameters(), lr=0.1, momentum=0.9)) as fsdp:
            data = np.random.default_rng(1)
            for step in range(5):
                x, y = data.normal(size=(16, 20)), data.integers(0, 5, size=16)
                mine = slice(8 * group.rank, 8 * group.rank + 8)    # each rank half the batch
                fsdp.zero_grad()
                logits = await fsdp.forward(x[mine])
                loss, grad = softmax_cross_entropy(logits, y[mine])
                await fsdp.backward(grad)
                await fsdp.step()

                reference.zero_grad()                               # the same step, whole batch
                out, ctx = reference.forward(x)
                reference.backward(ctx, softmax_cross_entropy(out, y)[1])
                ref_opt.step()
            full = await fsdp.full_state_dict(rank0_only=False)
            diff = max(np.abs(full[k] - v).max() for k, v in reference.state_dict().items())
            est = {s.name: fsdp.memory_estimate(s).persistent
                   for s in (ShardingStrategy.NO_SHARD, ShardingStrategy.FULL_SHARD)}
            print(f"rank {group.rank}: matches single-process training: {diff < 1e-12}, "
                  f"persistent bytes NO_SHARD {est['NO_SHARD']}, FULL_SHARD {est['FULL_SHARD']}")


asyncio.run(main())
