# example: ps_torch_train.py
# run: netdist launch -n 2 -- python ps_torch_train.py
import torch
from torch import nn

import netdist
from netdist.ps import ColocatedPS, SGDConfig, ServerOptimizerAggregator
from netdist.torch.gradient_sync import GradientSync

torch.manual_seed(0)                       # the same data on every rank
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
x = torch.randn(64, 8)
y = x.sum(dim=1, keepdim=True)             # learn a sum

with netdist.connect() as job:
    ps = job.make(ColocatedPS, job.group, num_servers=1)       # rank 0 also serves
    updates = job.make(ServerOptimizerAggregator, ps, optimizer=SGDConfig(lr=0.05),
                       max_staleness=2)                          # SGD runs on the server
    sync = GradientSync(job, model, updates)   # every rank now has rank 0's weights
    mine = slice(32 * job.rank, 32 * (job.rank + 1))
    for step in range(100):
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        sync.sync()            # push .grad; pull weights at most 2 updates behind
        if step == 0:
            first = loss.item()
    report = ps.close()        # rank 0's server returns once every rank is done
    print(f"rank {job.rank}: loss {first:.2f} at the start, below 0.1 at the end: "
          f"{loss.item() < 0.1}")
    if report is not None:
        print(f"server: {len(report.log)} gradients applied, none more than 2 updates "
              f"stale: {report.max_staleness_observed <= 2}")
