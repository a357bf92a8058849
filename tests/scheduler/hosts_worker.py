"""One task of a Slurm step that reports how its bytes moved: shared memory or TCP.

    python -m tests.scheduler.hosts_worker ELEMENTS

All-reduces ELEMENTS float32 once to warm up (the first large collective sorts the ranks
into hosts and attaches the shared segments), then once more between two
``transport.traffic()`` snapshots, and prints one JSON line: this rank's host name,
``group.local_mode``, the payload bytes it sent to the ranks of its own host and to each
other host, and whether the sum was right.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys

import numpy as np

from netdist.collectives import Group
from netdist.transport.bootstrap import init


async def main(elements: int) -> None:
    async with init() as transport, Group(transport) as group:
        data = np.ones(elements, dtype=np.float32)
        await group.all_reduce(data)
        data[:] = group.rank + 1
        before = transport.traffic()
        await group.all_reduce(data)
        moved = transport.traffic() - before
        expected = group.world_size * (group.world_size + 1) / 2
        print(json.dumps({
            "rank": group.rank, "host": socket.gethostname(),
            "local_mode": group.local_mode and group.local_mode.value,
            "own_host_sent": moved.own_host.sent_bytes,
            "other_hosts_sent": sorted(t.sent_bytes for t in moved.by_host.values()),
            "correct": bool(np.all(data == expected)),
        }), flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
