# example: dp_overlap.py
# run: netdist launch -n 2 -- python dp_overlap.py
import asyncio

import numpy as np

import netdist
from netdist import AllReduceAggregator, distributed_train_step, softmax_cross_entropy
from netdist.collectives import Group
from netdist.train import mlp


async def main() -> None:
    async with netdist.init() as transport, Group(transport) as group:
        data = np.random.default_rng(100 + group.rank)
        x, y = data.normal(size=(64, 32)), data.integers(0, 4, size=64)
        grads = {}
        for overlap in (False, True):
            model = mlp([32, 64, 64, 4], rng=np.random.default_rng(0))
            params = model.parameters()
            aggregator = AllReduceAggregator(group, bucket_mb=0.01)  # 10 KiB buckets

            def compute(ready=None):
                model.zero_grad()
                logits, ctx = model.forward(x)
                loss, grad = softmax_cross_entropy(logits, y)
                model.backward(ctx, grad, on_grad_ready=ready)  # reports last layers first
                return loss, [p.grad for p in params]

            if overlap:  # backward in a worker thread; a bucket leaves once its grads are final
                await distributed_train_step(compute, lambda averaged: None, aggregator,
                                             overlap=True, params=params)
            else:
                await distributed_train_step(compute, lambda averaged: None, aggregator)
            grads[overlap] = b"".join(p.grad.tobytes() for p in params)
        print(f"rank {group.rank}: {len(aggregator.buckets)} buckets, "
              f"overlapped == after backward: {grads[True] == grads[False]}")


asyncio.run(main())
