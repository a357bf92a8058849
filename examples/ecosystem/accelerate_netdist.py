# example: accelerate_netdist.py
# run: netdist launch -n 2 -- python accelerate_netdist.py
import hashlib

import torch
import torch.distributed as dist
from accelerate import Accelerator

from netdist.torch.data_parallel_check import check_data_parallel  # registers netdist too

dist.init_process_group("netdist")          # first: accelerate keeps the group that exists
accelerator = Accelerator(cpu=True)         # cpu=True: DDP on the CPU
check_data_parallel(accelerator)            # ConfigError if every rank would train alone
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                     generator=torch.Generator().manual_seed(2))
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for x, y in loader:                         # 4 steps: each rank takes every other batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)              # gradients averaged over netdist
    optimizer.step()
    optimizer.zero_grad()
losses = accelerator.gather(loss.detach()[None])
accelerator.save_model(model, "accelerate_netdist")  # the main process writes model.safetensors
weights = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
digests = [None] * accelerator.num_processes
dist.all_gather_object(digests, hashlib.sha256(weights.numpy().tobytes()).hexdigest())
print(f"rank {accelerator.process_index}: {dist.get_backend()}, last losses "
      f"{[round(v, 4) for v in losses.tolist()]}, weights identical: {len(set(digests)) == 1}")
accelerator.end_training()                  # also destroys the process group
