"""Data-parallel training with netdist's own API on the nodes Slurm gives a job.

Run as ``sbatch netdist_job.sbatch python3 slurm_train.py``: srun starts one copy per task
and ``netdist.init()`` takes the rank from SLURM_PROCID, the world size from SLURM_NTASKS
and the coordinator and token from the job script. A checkpoint is saved after every
step; when the job runs again after a requeue (SLURM_RESTART_COUNT=1, 2, ...) it resumes
from the newest one, so it ends with the weights an uninterrupted run ends with.
"""

import argparse
import asyncio
import hashlib
import os
import socket

import numpy as np

import netdist
from netdist import SGD, AllReduceAggregator, distributed_train_step, softmax_cross_entropy
from netdist.checkpoint import list_checkpoints, load, save
from netdist.collectives import Group
from netdist.train import mlp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--pause", type=float, default=0.0, metavar="SECONDS",
                        help="sleep after each step, to watch a run or requeue it by hand")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        default=f"ckpt-{os.environ.get('SLURM_JOB_ID', 'local')}",
                        help="default ckpt-$SLURM_JOB_ID: a requeued job keeps its id")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    async with netdist.init() as transport, Group(transport) as group:
        rank, world = group.rank, group.world_size
        hosts = await group.all_gather_object(socket.gethostname())
        total = await group.all_reduce(np.array([rank + 1.0]))
        if rank == 0:
            placement = ", ".join(f"{host}: ranks {[r for r, h in enumerate(hosts) if h == host]}"
                                  for host in dict.fromkeys(hosts))
            print(f"{world} ranks on {len(set(hosts))} hosts ({placement}); "
                  f"all-reduce of rank + 1 = {total[0]:.0f}")

        model = mlp([8, 32, 3], rng=np.random.default_rng(0))  # the same model everywhere
        params = model.parameters()
        optimizer = SGD(params, lr=0.1, momentum=0.9)
        aggregator = AllReduceAggregator(group)
        for p, view in zip(params, aggregator.bucket_views([p.grad for p in params])):
            p.grad = view                   # gradients live in the all-reduce buckets

        state = {"model": model, "optimizer": optimizer, "step": 0}
        start = 0
        found = bool(list_checkpoints(args.checkpoint_dir)) if rank == 0 else None
        if await group.broadcast_object(found, 0):      # one decision for every rank
            start = (await load(args.checkpoint_dir, group, like=state))["step"]
            if rank == 0:
                print(f"restart {os.environ.get('SLURM_RESTART_COUNT', '0')}: resuming "
                      f"after step {start} from {args.checkpoint_dir}")

        loss = float("nan")
        for step in range(start + 1, args.steps + 1):
            batch = np.random.default_rng([rank, step])  # this rank's batch of this step,
            x = batch.normal(size=(16, 8))               # the same again after a restart
            y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0)

            def compute(x=x, y=y):
                model.zero_grad()
                logits, ctx = model.forward(x)
                step_loss, grad = softmax_cross_entropy(logits, y)
                model.backward(ctx, grad)               # adds into p.grad
                return step_loss, [p.grad for p in params]

            loss = await distributed_train_step(compute, lambda _: optimizer.step(), aggregator)
            await save({"model": model, "optimizer": optimizer, "step": step},
                       args.checkpoint_dir, group, step=step, keep_last=2)
            await asyncio.sleep(args.pause)

        digest = hashlib.sha256(b"".join(p.data.tobytes() for p in params)).hexdigest()
        digests = await group.all_gather_object(digest)
        print(f"rank {rank} on {hosts[rank]}: step {args.steps} loss {loss:.4f}, "
              f"replicas identical: {len(set(digests)) == 1}, weights {digest[:16]}")


asyncio.run(main(parse_args()))
