"""One rank of the cut-link test: all-reduce across hosts until a host's link is cut.

    python -m tests.multihost.cut_worker READY_DIR

Runs up to ``ROUNDS`` all-reduces of ``ELEMENTS`` float32 (the two-level route), creates
``READY_DIR/rank<R>`` after the first one (the test cuts a link once every rank has),
and on the loss prints ``LOST rank=<r> origin=<o> at=<CLOCK_MONOTONIC>`` and exits 0 (the
expected ending: a failing exit would have the harness kill the other ranks). Finishing
every round without a loss prints ``NO LOSS`` and exits 1.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import numpy as np

from netdist.collectives import Group
from netdist.errors import PeerLostError
from netdist.transport.bootstrap import init

ROUNDS = 2000  # bounded: about 40 ms each at 1 Gbit/s, far beyond any test's deadline
ELEMENTS = 1 << 20


async def main(ready: Path) -> int:
    try:
        async with init() as transport:
            group = Group(transport)
            data = np.ones(ELEMENTS, np.float32)
            for round_ in range(ROUNDS):
                await group.all_reduce(data)
                if round_ == 0:
                    print(f"MODE {group.local_mode}", flush=True)
                    (ready / f"rank{group.rank}").touch()
    except PeerLostError as lost:
        print(f"LOST rank={lost.rank} origin={lost.origin_rank} at={time.monotonic():.3f} "
              f"{lost}", flush=True)
        return 0
    print("NO LOSS", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(Path(sys.argv[1]))))
