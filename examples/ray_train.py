# example: ray_train.py
import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train.torch import TorchTrainer
from torch.nn.parallel import DistributedDataParallel as DDP

import netdist.ray


def train_loop(config: dict) -> dict:
    rank = dist.get_rank()                    # torch's process group runs on netdist
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.linspace(-1, 1, 32).reshape(8, 4) + rank  # each worker trains on its own batch
    y = x.sum(dim=1, keepdim=True)
    for step in range(config["steps"]):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()                       # gradients averaged over netdist
        opt.step()
    job = netdist.ray.get_job()               # netdist's own API on the same connections
    total = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).sum()
    sums = job.group.all_gather(total.reshape(1).numpy())
    return {"backend": dist.get_backend(), "world_size": job.world_size,
            "loss": round(loss.item(), 4), "replicas agree": bool((sums == sums[0]).all())}


ray.init()                                    # RAY_ADDRESS's cluster, or one on this machine
trainer = TorchTrainer(train_loop, train_loop_config={"steps": 20},
                       torch_config=netdist.ray.NetdistConfig(),
                       scaling_config=ray.train.ScalingConfig(num_workers=2))
result = trainer.fit()                        # rank 0's return value comes back
print(result.return_value)
