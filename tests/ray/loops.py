"""The train functions ``test_ray_train.py`` runs on Ray Train workers, and the same small
DDP job as a script for ``netdist launch`` (``python -m tests.ray.loops OUT``).

The DDP job is deterministic: float64 weights from one seed, each rank's batch a
function of (rank, step), SGD with momentum. Under Ray it checkpoints after every step
(model, optimizer and step, written by rank 0 and reported with ``ray.train.report``)
and resumes from ``ray.train.get_checkpoint()`` after a restart, so a run that loses a
worker and restarts ends with the weights of a run that did not. One worker can be told
to SIGKILL itself at a chosen step on the first attempt (a marker file makes it happen
once); the survivors write down the error netdist gave them and when.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 4
STATE_FILE = "state.pt"


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer every rank starts from (one seed: the same everywhere)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: the same in every run and every attempt."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> float:
    """One DDP step on this rank's batch; the loss."""
    x, y = batch(rank, step)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # gradients averaged over the process group
    opt.step()
    return float(loss.item())


def weights(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: value.detach().numpy().copy() for name, value in model.state_dict().items()}


def token_digest() -> str:
    """A digest of this worker's ``NETDIST_TOKEN`` (equal tokens, equal digests; the token
    itself is never returned)."""
    return hashlib.sha256(os.environ.get("NETDIST_TOKEN", "").encode()).hexdigest()[:16]


def worker_facts(job: Any) -> dict[str, Any]:
    """What this worker was told (its environment), what Ray says of it and what netdist
    made of it (its host key), for the test to check across workers."""
    import ray
    import ray.train

    from netdist.progress.proxy import unwrap

    context = ray.train.get_context()
    env = {name: os.environ.get(name) for name in (
        "NETDIST_RANK", "NETDIST_WORLD_SIZE", "NETDIST_COORDINATOR", "NETDIST_JOB_ID",
        "NETDIST_HOST_ID", "NETDIST_ADVERTISE_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK",
        "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    keys = unwrap(job.transport).host_keys()
    return {"env": env, "token_digest": token_digest(),
            "token_length": len(os.environ.get("NETDIST_TOKEN", "")),
            "ray": {"rank": context.get_world_rank(), "world_size": context.get_world_size(),
                    "local_rank": context.get_local_rank(),
                    "local_world_size": context.get_local_world_size(),
                    "node_rank": context.get_node_rank(),
                    "node_ip": ray.util.get_node_ip_address()},
            "host_key": keys[job.rank].hex() if keys else None, "pid": os.getpid()}


def _maybe_die(config: dict[str, Any], rank: int, step: int) -> None:
    """SIGKILL this process if ``config["kill"]`` names this rank and step and no worker
    has done so before (the marker file is created exclusively, so only once)."""
    kill = config.get("kill")
    if not kill or kill["rank"] != rank or kill["step"] != step:
        return
    import ray.train

    # Ray Train registers reported checkpoints asynchronously: wait (bounded) until the
    # last one is committed, so the restart resumes from exactly this step
    ray.train.get_all_reported_checkpoints(
        consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED, timeout_s=60)
    try:
        fd = os.open(Path(kill["dir"]) / "killed", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return  # a restarted attempt: train on
    os.write(fd, json.dumps({"rank": rank, "step": step, "time": time.time()}).encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def _note_error(config: dict[str, Any], rank: int, step: int, exc: BaseException) -> None:
    """A survivor writes down the error that ended its step and how long after the kill."""
    kill = config.get("kill")
    if not kill:
        return
    marker = Path(kill["dir"]) / "killed"
    killed_at = json.loads(marker.read_text())["time"] if marker.exists() else None
    note = {"rank": rank, "step": step, "type": type(exc).__name__, "message": str(exc),
            "after_kill_s": None if killed_at is None else time.time() - killed_at}
    (Path(kill["dir"]) / f"error-rank{rank}.json").write_text(json.dumps(note))


def ray_ddp_loop(config: dict[str, Any]) -> dict[str, Any]:
    """The DDP job as a Ray Train function under ``NetdistConfig``: resumes from Ray's
    checkpoint, reports one after every step, then uses netdist's own API on the same
    connections (``netdist.ray.get_job()``). Rank 0 returns the final weights and every
    worker's facts."""
    import ray.train

    import netdist.ray

    rank = dist.get_rank()
    model, opt = build()
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / STATE_FILE, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"]) + 1
    ddp = DDP(model)
    for step in range(start, STEPS):
        _maybe_die(config, rank, step)
        try:
            loss = train_step(ddp, opt, rank, step)
        except Exception as exc:
            _note_error(config, rank, step, exc)
            raise
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step}, Path(folder) / STATE_FILE)
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"step": step, "loss": loss}, checkpoint=saved)
    job = netdist.ray.get_job()
    total = job.group.all_reduce(np.array([rank + 1.0]))
    facts = job.group.all_gather_object(worker_facts(job))
    return {"weights": weights(model), "resumed_from": start, "all_reduce": total.tolist(),
            "backend": dist.get_backend(), "workers": facts}


def ray_own_api_loop(config: dict[str, Any]) -> dict[str, Any]:
    """netdist's own API under ``NetdistJobConfig``: ``netdist.connect()`` joins from the
    environment; an all-reduce, then one data-parallel SGD step through netdist.parallel's
    ``AllReduceAggregator``. Values are chosen so every result is exact."""
    import netdist
    from netdist.parallel import AllReduceAggregator

    with netdist.connect() as job:
        summed = job.group.all_reduce(np.full(4, job.rank + 1.0))
        params = np.array([1.0, 2.0, 3.0])
        grad = params * (job.rank + 1)                     # the mean over ranks is known
        aggregator = job.make(AllReduceAggregator, job.group)
        (averaged,) = aggregator.aggregate([grad])
        params -= config["lr"] * averaged                  # the data-parallel SGD step
        facts = job.group.all_gather_object(worker_facts(job))
        everyone = job.group.all_gather_object(params.tolist())
        return {"world_size": job.world_size, "all_reduce": summed.tolist(),
                "averaged": averaged.tolist(), "params": everyone, "workers": facts}


def main(out: str) -> None:
    """The DDP job under ``netdist launch``; rank 0 saves the final weights to ``out``."""
    dist.init_process_group("netdist")
    rank = dist.get_rank()
    model, opt = build()
    ddp = DDP(model)
    for step in range(STEPS):
        train_step(ddp, opt, rank, step)
    if rank == 0:
        torch.save(model.state_dict(), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
