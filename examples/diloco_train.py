# example: diloco_train.py
# run: netdist launch -n 2 -- python diloco_train.py
import numpy as np
import torch
from torch import nn

import netdist
from netdist.parallel.diloco import DiLoCo, DiLoCoConfig

torch.manual_seed(0)                       # the same initial model on every rank
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
inner = torch.optim.AdamW(model.parameters(), lr=0.01)   # any inner optimizer
x = torch.randn(256, 8)
y = x.sum(dim=1, keepdim=True)             # learn a sum

with netdist.connect() as job:
    config = DiLoCoConfig(sync_every=25, quantization="int8")
    diloco = job.make(DiLoCo, job.group, list(model.parameters()), config)
    mine = slice(128 * job.rank, 128 * (job.rank + 1))   # this rank's data
    for step in range(100):
        inner.zero_grad()
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        inner.step()                       # a local step: nothing is sent
        diloco.step()                      # every 25th: outer gradients averaged in int8
    diloco.finish()
    dense = 100 * sum(p.numel() for p in model.parameters()) * 4
    sums = job.group.all_gather(np.array([float(sum(g.sum() for g in diloco.global_arrays()))]))
    print(f"rank {job.rank}: loss {loss.item():.3f}, {diloco.outer_steps} outer steps, "
          f"sent {diloco.bytes_sent} B instead of {dense} B, same global model on all "
          f"ranks: {bool(sums[0] == sums[1])}")
