"""One member of the elastic torch test job: an MLP trained with torch SGD (momentum)
through ``ElasticDataParallel``; progress and final files as ``tests.elastic._member``
writes them (``w`` is every parameter, flattened), and the same ``ELASTIC_TEST_DIE``
hook for the compute phase."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import torch

import netdist.elastic as elastic
from tests.elastic._plan import member_plan

SAMPLES = 96
GLOBAL_BATCH = 16


def main() -> int:
    plan = member_plan(default_steps=30)
    slot, out, steps, pause, die_at = plan.slot, plan.out, plan.steps, plan.pause, plan.die_at
    torch.manual_seed(0)
    x = torch.randn(SAMPLES, 6)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    edp = elastic.ElasticDataParallel(model, optimizer)
    sampler = elastic.ElasticSampler(SAMPLES, GLOBAL_BATCH, seed=2)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def step_fn(ctx: elastic.BlockingStepContext) -> None:
        if ctx.step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        edp.step(ctx, lambda ids: loss_fn(model(x[ids]), y[ids]))
        time.sleep(pause)  # stands in for a longer computation

    with elastic.connect(edp.state(), sampler=sampler) as job:
        until_world = int(os.environ.get("ELASTIC_TEST_UNTIL_WORLD", "0"))
        joined = job.step  # a replacement trains at least one step before deciding
        while job.step < steps or job.world_size < until_world or job.step == joined:
            job.run_step(step_fn)
            (out / f"slot{slot}.json.tmp").write_text(json.dumps(
                {"step": job.step, "epoch": job.epoch, "rank": job.rank,
                 "world_size": job.world_size, "pid": os.getpid()}))
            (out / f"slot{slot}.json.tmp").replace(out / f"slot{slot}.json")
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        momentum = torch.cat([optimizer.state[p]["momentum_buffer"].reshape(-1)
                              for p in model.parameters()]).numpy()
        changes = [[c.epoch, list(c.slots), c.seconds, c.sync.fetched_bytes if c.sync else 0,
                    len(c.sync.donors) if c.sync else 0] for c in job.job.changes]
        np.savez(out / f"slot{slot}.final.tmp.npz", w=flat, momentum=momentum,
                 used=np.ones((1, 1), dtype=np.int64), changes=np.array(json.dumps(changes)),
                 step=job.step, data_epoch=0, cursor=0)
        os.replace(out / f"slot{slot}.final.tmp.npz", out / f"slot{slot}.final.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
