# example: elastic_train.py
# run: netdist launch --elastic -n 3 -- python elastic_train.py
import numpy as np

import netdist.elastic as elastic

data = np.random.default_rng(0)
x = data.normal(size=(240, 8))
y = x @ data.normal(size=8)

w = np.zeros(8)
state = elastic.ElasticState({"w": w})                      # what a replacement fetches
sampler = elastic.ElasticSampler(len(x), global_batch=24)   # every sample once per epoch


def step(ctx):
    ids = ctx.batch                                          # this member's share
    grad = x[ids].T @ (x[ids] @ w - y[ids])                  # summed over its samples
    total = ctx.all_reduce(grad)                             # over the current members

    def commit():                                            # runs only if the step commits
        w[:] -= 0.05 * total / ctx.global_count

    ctx.on_commit(commit)


with elastic.connect(state, sampler=sampler) as job:
    while job.step < 100:
        job.run_step(step)
    loss = float(np.mean((x @ w - y) ** 2))
    print(f"step {job.step}, {job.world_size} members, loss {loss:.6f}, "
          f"data epoch {sampler.data_epoch}")
