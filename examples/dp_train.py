# example: dp_train.py
# run: netdist launch -n 2 -- python dp_train.py
import asyncio
import hashlib

import numpy as np

import netdist
from netdist import SGD, AllReduceAggregator, distributed_train_step, softmax_cross_entropy
from netdist.collectives import Group
from netdist.train import mlp


async def main() -> None:
    async with netdist.init() as transport, Group(transport) as group:
        model = mlp([8, 32, 3], rng=np.random.default_rng(0))  # same seed: same model everywhere
        params = model.parameters()
        optimizer = SGD(params, lr=0.1, momentum=0.9)
        aggregator = AllReduceAggregator(group, bucket_mb=25)
        for p, view in zip(params, aggregator.bucket_views([p.grad for p in params])):
            p.grad = view                   # gradients live in the all-reduce buckets: no copies

        data = np.random.default_rng(100 + group.rank)          # every rank its own batches

        def compute():
            x, y = data.normal(size=(16, 8)), data.integers(0, 3, size=16)
            model.zero_grad()
            logits, ctx = model.forward(x)
            loss, grad = softmax_cross_entropy(logits, y)
            model.backward(ctx, grad)       # adds into p.grad
            return loss, [p.grad for p in params]

        def apply(averaged):                # here `averaged` are the p.grad arrays themselves
            optimizer.step()

        for step in range(5):
            loss = await distributed_train_step(compute, apply, aggregator)
        digest = hashlib.sha256(b"".join(p.data.tobytes() for p in params)).hexdigest()
        digests = await group.all_gather_object(digest)
        print(f"rank {group.rank}: loss {loss:.4f}, replicas identical: {len(set(digests)) == 1}, "
              f"{aggregator.bytes_sent} bytes in {len(aggregator.buckets)} bucket(s)")


asyncio.run(main())
