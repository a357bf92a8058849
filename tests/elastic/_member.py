"""One member of the elastic test job: NumPy linear regression, accounted samples.

Run as a process with the elastic environment (``tests.elastic.cluster``). Every step
all-reduces the gradient sum together with a one-hot count of the sample ids this member
used, so the state's ``used`` matrix records, per data epoch, how often each id entered
a committed step: the test asserts it is exactly one everywhere.

Test hooks (environment):
- ``ELASTIC_TEST_DIR``: after each commit, write ``slot<S>.json`` (step, epoch, rank,
  world size) atomically, and at the end ``slot<S>.final.npz`` (w, used, changes);
- ``ELASTIC_TEST_DIE=<phase>:<step>``: SIGKILL this process at ``phase`` of step
  ``step`` (only slot ``ELASTIC_TEST_DIE_SLOT`` if that is set) (``compute``, ``reduce`` (after the gradient all-reduce), ``vote`` (after the
  vote, before the commit), ``agree`` (while asking for an agreement), ``fetch`` (while
  sending or receiving state)); only on its first start (restart count 0);
- ``ELASTIC_TEST_STEPS``: steps to train (default 40); ``ELASTIC_TEST_STEP_SECONDS``:
  minimum seconds per step (default 0); ``ELASTIC_TEST_UNTIL_WORLD``: keep training past
  the steps until the epoch has that many members (a replacement is in), so a slow
  start of the replacement cannot find the job already over (the decision is the same
  on every member: all see the same step and membership).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import logging
import netdist.elastic as elastic
if os.environ.get("ELASTIC_TEST_LOG"):
    logging.basicConfig(level=logging.INFO)
import netdist.elastic.job as job_module
import netdist.elastic.transfer as transfer_module

SAMPLES = 96
FEATURES = 8
GLOBAL_BATCH = 12
EPOCHS_MAX = 64
LR = 0.05


def dataset() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((SAMPLES, FEATURES))
    y = x @ rng.standard_normal(FEATURES) + 0.1 * rng.standard_normal(SAMPLES)
    return x, y


def _die_hooks(slot: int) -> tuple[str, int]:
    spec = os.environ.get("ELASTIC_TEST_DIE", "")
    only = os.environ.get("ELASTIC_TEST_DIE_SLOT")
    if (not spec or os.environ.get("NETDIST_RESTART_COUNT", "0") != "0"
            or (only is not None and int(only) != slot)):
        return "", -1
    phase, step = spec.split(":")
    if phase == "agree":
        original = job_module.ElasticJob._agree

        async def agree(self, deadline):  # type: ignore[no-untyped-def]
            if self.step >= int(step):
                os.kill(os.getpid(), signal.SIGKILL)
            return await original(self, deadline)

        job_module.ElasticJob._agree = agree  # type: ignore[method-assign]
    if phase == "fetch":
        original_sync = transfer_module.synchronize_state

        async def sync(group, state, at, *rest):  # type: ignore[no-untyped-def]
            transport = group.transport
            send = transport.send

            async def dying_send(*args, **kwargs):  # type: ignore[no-untyped-def]
                os.kill(os.getpid(), signal.SIGKILL)
                return await send(*args, **kwargs)

            if at >= int(step):
                transport.send = dying_send
            try:
                return await original_sync(group, state, at, *rest)
            finally:
                transport.send = send

        job_module.synchronize_state = sync
    return phase, int(step)


def main() -> int:
    slot = int(os.environ["NETDIST_ELASTIC_SLOT"])
    out = Path(os.environ["ELASTIC_TEST_DIR"])
    steps = int(os.environ.get("ELASTIC_TEST_STEPS", "40"))
    step_seconds = float(os.environ.get("ELASTIC_TEST_STEP_SECONDS", "0"))
    phase, die_at = _die_hooks(slot)
    x, y = dataset()
    w = np.zeros(FEATURES)
    momentum = np.zeros(FEATURES)
    used = np.zeros((EPOCHS_MAX, SAMPLES), dtype=np.int64)
    state = elastic.ElasticState({"w": w, "momentum": momentum, "used": used})
    sampler = elastic.ElasticSampler(SAMPLES, GLOBAL_BATCH, seed=3)

    def die(now: str, step: int) -> None:
        if phase == now and step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def step_fn(ctx: elastic.BlockingStepContext) -> None:
        started = time.perf_counter()
        ids = ctx.batch
        assert ids is not None
        die("compute", ctx.step)
        residual = x[ids] @ w - y[ids]
        payload = np.zeros(FEATURES + SAMPLES)
        payload[:FEATURES] = x[ids].T @ residual
        np.add.at(payload[FEATURES:], ids, 1.0)
        spare = step_seconds - (time.perf_counter() - started)
        if spare > 0:
            time.sleep(spare)  # stands in for a longer computation
        total = ctx.all_reduce(payload)
        die("reduce", ctx.step)
        data_epoch = sampler.data_epoch

        def commit() -> None:
            grad = total[:FEATURES] / ctx.global_count
            momentum[:] = 0.9 * momentum + grad
            w[:] = w - LR * momentum
            used[data_epoch] += total[FEATURES:].astype(np.int64)
            die("vote", ctx.step)

        ctx.on_commit(commit)

    with elastic.connect(state, sampler=sampler) as job:
        until_world = int(os.environ.get("ELASTIC_TEST_UNTIL_WORLD", "0"))
        joined = job.step  # a replacement trains at least one step before deciding
        while job.step < steps or job.world_size < until_world or job.step == joined:
            job.run_step(step_fn)
            record = {"step": job.step, "epoch": job.epoch, "rank": job.rank,
                      "world_size": job.world_size, "pid": os.getpid()}
            tmp = out / f"slot{slot}.json.tmp"
            tmp.write_text(json.dumps(record))
            tmp.replace(out / f"slot{slot}.json")
        changes = [[c.epoch, list(c.slots), c.seconds,
                    c.sync.fetched_bytes if c.sync else 0,
                    len(c.sync.donors) if c.sync else 0] for c in job.job.changes]
        np.savez(out / f"slot{slot}.final.tmp.npz", w=w, used=used,
                 changes=np.array(json.dumps(changes)), step=job.step,
                 data_epoch=sampler.data_epoch, cursor=sampler.cursor,
                 resumed=job.job.resumed, discarded=job.job.discarded,
                 deferred=len(sampler.deferred))
        os.replace(out / f"slot{slot}.final.tmp.npz", out / f"slot{slot}.final.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
