# example: torchrun_train.py
# run: torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 --local-addr 127.0.0.1 torchrun_train.py OUT
"""DDP on the netdist backend under torchrun, restartable: a DCP checkpoint after every
step, and a restarted attempt resumes from the last complete one.

Writes, under OUT: ``ckpt/step-N`` (a ``torch.distributed.checkpoint`` per step; complete
once its ``.metadata`` exists), ``joined/attempt-A-rank-R.json`` (which attempt each rank
ran in and where it met the others) and ``final-rank-R.json`` (the trained weights, bit
for bit, and the attempt that finished). ``--pause-after K`` is the restart test's hook:
in attempt 0, rank 1 writes ``OUT/paused.json`` (its pid) once step K's checkpoint is
complete and waits there, up to a minute, to be SIGKILLed.
"""
import argparse
import json
import os
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP


def write_json(path: Path, value: dict) -> None:
    """Write ``value`` so that readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value))
    os.replace(part, path)


def last_complete(ckpt: Path) -> int:
    """The newest step whose checkpoint is complete (DCP writes .metadata last), or -1."""
    done = [int(p.name[5:]) for p in ckpt.glob("step-*") if (p / ".metadata").is_file()]
    return max(done, default=-1)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's data for ``step``: the same whichever attempt trains it."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--backend", default="netdist")
    parser.add_argument("--pause-after", type=int, default=None)
    args = parser.parse_args()

    dist.init_process_group(args.backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])  # 0, then 1 after a restart
    ckpt = args.out / "ckpt"

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    resumed = last_complete(ckpt)  # every rank sees the same files: attempt 0 is gone
    if resumed >= 0:
        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=ckpt / f"step-{resumed}")
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    met = getattr(dist.group.WORLD, "store_record", None)  # netdist: where ranks met
    write_json(args.out / "joined" / f"attempt-{attempt}-rank-{rank}.json", {
        "rank": rank, "attempt": attempt, "resumed_after": resumed,
        "record": None if met is None else met.as_dict()})
    print(f"rank {rank}/{world} attempt {attempt}: resuming after step {resumed}", flush=True)

    for step in range(resumed + 1, args.steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state},
                 checkpoint_id=ckpt / f"step-{step}")
        if step == args.pause_after and attempt == 0 and rank == 1:
            write_json(args.out / "paused.json", {"pid": os.getpid(), "step": step})
            threading.Event().wait(60)
            raise SystemExit(f"rank {rank} paused after step {step} and was not killed")

    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    write_json(args.out / f"final-rank-{rank}.json", {
        "rank": rank, "attempt": attempt, "weights": weights.hex()})
    print(f"rank {rank}/{world} attempt {attempt}: finished {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
