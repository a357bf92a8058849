# example: sync_train.py
# run: netdist launch -n 2 -- python sync_train.py
import numpy as np
import torch
from torch import nn

import netdist
from netdist.parallel.aggregators import AllReduceAggregator
from netdist.torch.gradient_sync import GradientSync

torch.manual_seed(0)                       # the same initial model on every rank
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 8)
y = x.sum(dim=1, keepdim=True)             # learn a sum

with netdist.connect() as job:
    ring = job.make(AllReduceAggregator, job.group)       # runs on the progress thread
    sync = GradientSync(job, model, ring, overlap=True)   # buckets travel during backward
    mine = slice(32 * job.rank, 32 * (job.rank + 1))      # this rank's half of the batch
    for step in range(50):
        opt.zero_grad()                                   # set_to_none=True is fine
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        sync.sync()                                       # every .grad: the mean
        opt.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    sums = job.group.all_gather(np.array([float(weights.sum())]))
    print(f"rank {job.rank}: loss {loss.item():.3f}, same weights on all ranks: "
          f"{bool(sums[0] == sums[1])}")
