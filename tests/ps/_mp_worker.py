"""A worker rank for the multi-process parameter-server test (run as a module).

Trains the tests' MLP against ``netdist ps-server`` ranks and writes the SHA-256 of its
final parameters to ``<outdir>/rank<r>.txt``. With ``--die-at STEP`` worker 0 exits
abruptly at that step (a lost worker).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

from netdist.ps import PSClient, SGDConfig, num_servers_from_env
from netdist.transport.bootstrap import init
from tests.ps._model import init_mlp, mse_grads, regression_data

SIZES = (6, 40, 30, 3)
STEPS = 10
BATCH = 8


def digest(params: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p).tobytes())
    return h.hexdigest()


async def main(outdir: Path, die_at: int | None) -> int:
    servers = num_servers_from_env()
    async with init() as transport:
        workers = transport.world_size - servers
        index = transport.rank - servers
        async with PSClient(transport, num_servers=servers) as client:
            params = await client.init(init_mlp(np.random.default_rng(7), SIZES),
                                       optimizer=SGDConfig(lr=0.05, momentum=0.9),
                                       bigarray_bound=200)
            x, y = regression_data(np.random.default_rng(11), STEPS * workers * BATCH,
                                   d_in=SIZES[0], d_out=SIZES[-1])
            for step in range(STEPS):
                if die_at is not None and index == 0 and step == die_at:
                    os._exit(3)  # no goodbye: the servers must notice on their own
                lo = (step * workers + index) * BATCH
                _, grads = mse_grads(params, x[lo:lo + BATCH], y[lo:lo + BATCH])
                params = await client.step(grads)
        (outdir / f"rank{transport.rank}.txt").write_text(digest(params))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--die-at", type=int, default=None)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.outdir, args.die_at)))
