# example: ddp_netdist.py
# run: netdist launch -n 2 -- python ddp_netdist.py
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("netdist")          # env:// from netdist launch, torchrun, Slurm...
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.linspace(-1, 1, 32).reshape(8, 4) + rank  # each rank trains on its own batch
y = x.sum(dim=1, keepdim=True)
for step in range(20):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()                          # gradients averaged over netdist
    opt.step()
total = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).sum()
highest = total.clone()
dist.all_reduce(highest, op=dist.ReduceOp.MAX)
print(f"rank {rank}: loss {loss.item():.4f}, weights agree: {bool(highest == total)}")
dist.destroy_process_group()
