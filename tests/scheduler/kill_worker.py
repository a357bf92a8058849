"""One task of a Slurm step in which a task dies mid-job: the tests' victim and survivors.

    python -m tests.scheduler.kill_worker VICTIM

Every rank all-reduces in a loop; after the third round rank VICTIM kills itself with
SIGKILL (no goodbye, as when the OOM killer or a node fault takes it). The others must
not hang: each prints ``LOST rank R: <message>`` with the ``PeerLostError``'s
``origin_rank`` and exits 1, unless Slurm ends it first (``--kill-on-bad-exit=1``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import numpy as np

from netdist.collectives import Group
from netdist.errors import PeerLostError
from netdist.transport.bootstrap import init

ROUNDS = 200


async def main(victim: int) -> int:
    async with init() as transport, Group(transport) as group:
        data = np.ones(1 << 16, dtype=np.float32)
        try:
            for round_ in range(ROUNDS):
                if round_ == 3 and group.rank == victim:
                    print(f"rank {group.rank}: killing myself", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                await group.all_reduce(data)
                await asyncio.sleep(0.02)
        except PeerLostError as exc:
            print(f"LOST rank {exc.origin_rank}: {exc}", flush=True)
            return 1
    print(f"rank {group.rank}: finished all {ROUNDS} rounds", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(int(sys.argv[1]))))
