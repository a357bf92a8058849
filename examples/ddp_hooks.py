# example: ddp_hooks.py
# run: netdist launch -n 2 -- python ddp_hooks.py
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from netdist.torch.hooks import TopKHook, comm_hook, job_of

dist.init_process_group("netdist")           # or "gloo", with job = netdist.connect()
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
state = TopKHook(job_of(), ratio=0.01)       # the netdist job behind the process group
model.register_comm_hook(state, comm_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.linspace(-1, 1, 16 * 64).reshape(16, 64) + rank
y = x.sum(dim=1, keepdim=True)
for step in range(20):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()   # buckets sent during backward
    opt.step()
s = state.stats
print(f"rank {rank}: {s.steps} steps, {s.last_step.sent} bytes sent per step, "
      f"{s.ratio:.3f} of fp32 all-reduce")
state.close()
dist.destroy_process_group()
