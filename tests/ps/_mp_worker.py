"""A worker rank for the multi-process parameter-server tests (run as a module).

Trains against ``netdist ps-server`` ranks and writes the SHA-256 of its final parameters
to ``<outdir>/rank<r>.txt``, and ``<outdir>/rank<r>.json`` with that digest, the versions
it last pulled and the failovers it made. ``NETDIST_PS_REPLICAS`` (set by
``netdist ps-server``) says whether the servers keep backups.

- ``--model mlp`` (default): the tests' MLP on regression data, synchronous unless
  ``--max-staleness`` says otherwise; ``--model dyadic``: the order-free model of
  ``tests.ps._model.dyadic_grads``, whose exact result does not depend on the order
  asynchronous pushes apply in.
- ``--die-at STEP``: worker 0 exits abruptly at that step (a lost worker).
- ``--pause-at STEP``: worker 0 prints ``PAUSED <step>`` before that step's push and
  waits for a line on stdin, so a test can act (kill a server, kill or stop this worker)
  at a known point.
- Every worker prints ``STEP <rank> <step>`` once a step is acknowledged.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from netdist.ps import PSClient, SGDConfig, num_servers_from_env
from netdist.ps import WorkerLoss, replicas_from_env
from netdist.transport.bootstrap import init
from tests.ps._model import dyadic_grads, dyadic_params, init_mlp, mse_grads, regression_data

SIZES = (6, 40, 30, 3)
STEPS = 10
BATCH = 8
DYADIC_LR = 0.5
MLP_OPTIMIZER = SGDConfig(lr=0.05, momentum=0.9)


def digest(params: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p).tobytes())
    return h.hexdigest()


def staleness(text: str) -> int | None:
    return None if text == "none" else int(text)


async def main(args: argparse.Namespace) -> int:
    servers = num_servers_from_env()
    async with init() as transport:
        workers = transport.world_size - servers
        index = transport.rank - servers
        async with PSClient(transport, num_servers=servers,
                            replicas=replicas_from_env()) as client:
            dyadic = args.model == "dyadic"
            start = dyadic_params() if dyadic else init_mlp(np.random.default_rng(7), SIZES)
            params = await client.init(
                start, optimizer=SGDConfig(lr=DYADIC_LR) if dyadic else MLP_OPTIMIZER,
                max_staleness=args.max_staleness, bigarray_bound=200,
                worker_loss=WorkerLoss(args.worker_loss))
            x, y = regression_data(np.random.default_rng(11), args.steps * workers * BATCH,
                                   d_in=SIZES[0], d_out=SIZES[-1])
            for step in range(args.steps):
                if args.die_at is not None and index == 0 and step == args.die_at:
                    os._exit(3)  # no goodbye: the servers must notice on their own
                if args.pause_at is not None and index == 0 and step == args.pause_at:
                    print(f"PAUSED {step}", flush=True)
                    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
                if dyadic:
                    grads = dyadic_grads(index, step)
                else:
                    lo = (step * workers + index) * BATCH
                    _, grads = mse_grads(params, x[lo:lo + BATCH], y[lo:lo + BATCH])
                params = await client.step(grads)
                print(f"STEP {transport.rank} {step}", flush=True)
        (outdir := args.outdir).joinpath(f"rank{transport.rank}.txt").write_text(digest(params))
        outdir.joinpath(f"rank{transport.rank}.json").write_text(json.dumps({
            "digest": digest(params), "versions": list(client.versions),
            "failovers": client.failovers}))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--pause-at", type=int, default=None)
    parser.add_argument("--model", choices=("mlp", "dyadic"), default="mlp")
    parser.add_argument("--max-staleness", type=staleness, default=0)
    parser.add_argument("--worker-loss", choices=[w.value for w in WorkerLoss],
                        default=WorkerLoss.FAIL.value)
    parser.add_argument("--steps", type=int, default=STEPS)
    sys.exit(asyncio.run(main(parser.parse_args())))
