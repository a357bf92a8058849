# example: elastic_diloco.py
# run: netdist launch --elastic -n 3 -- python elastic_diloco.py
import numpy as np

import netdist.elastic as elastic

data = np.random.default_rng(0)
x = data.normal(size=(240, 8))
y = x @ data.normal(size=8)

w = np.zeros(8)                                              # the live (local) model
diloco = elastic.ElasticDiLoCo([w], sync_every=4)            # outer SGD, Nesterov 0.9
sampler = elastic.ElasticSampler(len(x), global_batch=48)    # 4 micro-batches per member


def inner_step(ids):                                         # any inner optimizer
    w[:] -= 0.05 * x[ids].T @ (x[ids] @ w - y[ids]) / len(ids)


with elastic.connect(diloco.state, sampler=sampler) as job:  # global model + momentum
    while job.step < 20:                                     # 20 outer steps
        job.run_step(lambda ctx: diloco.step_blocking(ctx, inner_step))
    loss = float(np.mean((x @ w - y) ** 2))
    print(f"outer step {job.step}, {job.world_size} members, loss {loss:.6f}, "
          f"data epoch {sampler.data_epoch}")
