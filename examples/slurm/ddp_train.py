"""Torch DDP on the ``netdist`` backend, as srun, torchrun or a Kubeflow PyTorchJob start it.

``sbatch netdist_job.sbatch python3 ddp_train.py`` runs it on 2 nodes x 2 tasks; the job
script exports MASTER_ADDR and MASTER_PORT, where torch's store meets. The same file is
the command of the PyTorchJob in docs/kubernetes.md. Every rank trains on its own
batches; DDP averages the gradients, so the replicas end identical, with the weights one
process gets from every rank's batches at once.
"""

import hashlib
import os
import socket

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 20
LR = 0.05


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s 16 samples of step ``step``."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=gen)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def main() -> None:
    # srun sets SLURM_PROCID / SLURM_NTASKS; torchrun and a PyTorchJob set RANK / WORLD_SIZE
    rank = int(os.environ.get("RANK") or os.environ["SLURM_PROCID"])
    world = int(os.environ.get("WORLD_SIZE") or os.environ["SLURM_NTASKS"])
    dist.init_process_group("netdist", rank=rank, world_size=world)  # store: MASTER_ADDR:PORT
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()                   # DDP all-reduces the gradients over netdist
        optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()
    digests: list[str | None] = [None] * world
    dist.all_gather_object(digests, digest)
    print(f"rank {rank} of {world} on {socket.gethostname()} ({dist.get_backend()}): "
          f"loss {loss.item():.4f}, replicas identical: {len(set(digests)) == 1}, "
          f"weights sum {weights.double().sum().item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
