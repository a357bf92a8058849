"""One rank of the trace tests' jobs: ``python -m tests.trace._member STEPS [--late RANK MS]``.

Every step each rank all-reduces a vector (and every fourth step broadcasts one, so the
trace holds two kinds of collective and two routes); rank ``--late`` first spends MS
milliseconds "computing" (the lateness the tests look for: a workload, not a wait).
After each step a rank prints ``step N`` so a test can act at a known point, and waits
for a line on stdin when ``--hold-after K`` says so (a test stops a rank there).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

import netdist
from netdist.collectives import Group


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int)
    parser.add_argument("--late", nargs=2, type=int, metavar=("RANK", "MS"))
    parser.add_argument("--size", type=int, default=4096)
    args = parser.parse_args(argv)
    async with netdist.init() as transport:
        group = Group(transport)
        grad = np.ones(args.size, np.float32)
        for step in range(args.steps):
            if args.late is not None and group.rank == args.late[0]:
                time.sleep(args.late[1] / 1000.0)
            await group.all_reduce(grad)
            if step % 4 == 3:
                await group.broadcast(grad[:16], 0)
            print(f"step {step}", flush=True)
        await group.barrier()
    print("done", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
