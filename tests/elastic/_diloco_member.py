"""One member of the elastic DiLoCo test job: NumPy linear regression (a weight vector and
a bias) trained with ``ElasticDiLoCo`` (inner SGD on micro-batches, outer Nesterov SGD).

Progress files as ``tests.elastic._member`` writes them; at the end
``slot<S>.final.npz`` holds the global model and the outer momentum (flattened), the
steps committed, the membership changes and ``digests``: the state digest this member saw
at the start of each step it ran (for a joiner, the first one is the fetched state).
Hooks: ``ELASTIC_TEST_DIE=compute:<step>`` SIGKILLs this process when step ``<step>``
starts, before any inner step (only on its first start, only slot
``ELASTIC_TEST_DIE_SLOT`` if set); ``ELASTIC_TEST_STEPS``, ``ELASTIC_TEST_STEP_SECONDS``,
``ELASTIC_TEST_UNTIL_WORLD`` as for ``tests.elastic._member``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import netdist.elastic as elastic
from netdist.elastic.state import state_digest
from tests.elastic._plan import member_plan

SAMPLES = 96
FEATURES = 8
GLOBAL_BATCH = 24
SYNC_EVERY = 3
INNER_LR = 0.05


def main() -> int:
    plan = member_plan(default_steps=20)
    slot, out, steps, pause, die_at = plan.slot, plan.out, plan.steps, plan.pause, plan.die_at
    rng = np.random.default_rng(11)
    x = rng.standard_normal((SAMPLES, FEATURES))
    y = x @ rng.standard_normal(FEATURES) + 0.5 + 0.1 * rng.standard_normal(SAMPLES)
    w = np.zeros(FEATURES)
    b = np.zeros(1)
    diloco = elastic.ElasticDiLoCo([w, b], sync_every=SYNC_EVERY)
    sampler = elastic.ElasticSampler(SAMPLES, GLOBAL_BATCH, seed=5)
    digests: dict[int, str] = {}

    def inner_step(ids: np.ndarray) -> None:
        residual = x[ids] @ w + b - y[ids]
        w[:] -= INNER_LR * x[ids].T @ residual / len(ids)
        b[:] -= INNER_LR * residual.mean()

    def step_fn(ctx: elastic.BlockingStepContext) -> None:
        if ctx.step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        digests.setdefault(ctx.step, state_digest(diloco.state.arrays(), ctx.step))
        started = time.perf_counter()
        diloco.step_blocking(ctx, inner_step)
        spare = pause - (time.perf_counter() - started)
        if spare > 0:
            time.sleep(spare)  # stands in for a longer computation

    with elastic.connect(diloco.state, sampler=sampler) as job:
        until_world = int(os.environ.get("ELASTIC_TEST_UNTIL_WORLD", "0"))
        joined = job.step  # a replacement trains at least one step before deciding
        while job.step < steps or job.world_size < until_world or job.step == joined:
            job.run_step(step_fn)
            (out / f"slot{slot}.json.tmp").write_text(json.dumps(
                {"step": job.step, "epoch": job.epoch, "rank": job.rank,
                 "world_size": job.world_size, "pid": os.getpid()}))
            (out / f"slot{slot}.json.tmp").replace(out / f"slot{slot}.json")
        changes = [[c.epoch, list(c.slots), c.seconds, c.sync.fetched_bytes if c.sync else 0,
                    len(c.sync.donors) if c.sync else 0] for c in job.job.changes]
        np.savez(out / f"slot{slot}.final.tmp.npz",
                 global_model=np.concatenate([g.ravel() for g in diloco.global_arrays]),
                 momentum=np.concatenate([m.ravel() for m in diloco.momentum]),
                 local=np.concatenate([w, b]), changes=np.array(json.dumps(changes)),
                 digests=np.array(json.dumps(sorted(digests.items()))), step=job.step)
        os.replace(out / f"slot{slot}.final.tmp.npz", out / f"slot{slot}.final.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
