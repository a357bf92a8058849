"""One rank of a 2-rank job across a lossy link (``test_lossy_link.py``), in a namespace.

    python -m tests.transport.lossy_worker MODE RANK COORDINATOR_HOST PORT OWN_HOST

``MODE`` ``job``: ``ROUNDS`` all-reduces of a small array, each followed by an idle
pause in which only heartbeats cross the link (where a TCP stall used to outlast the
liveness window), then a barrier and a clean close; prints ``DONE <sum>``.

``MODE`` ``stopped``: one all-reduce, then rank 1 prints ``READY`` and blocks reading
standard input (the test SIGSTOPs it); rank 0 prints ``READY`` and posts a receive from
rank 1 bounded by a long timeout, and prints ``LOST <monotonic seconds> <message>`` when
the transport declares rank 1 lost (``CLOCK_MONOTONIC`` is shared by every namespace).
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

ROUNDS = 12
PAUSE = 2.5  # idle seconds between rounds: longer than a heartbeat interval
ELEMENTS = 64
TOKEN = "lossy-test-token-0123456789abcdef"


async def main(mode: str, rank: int, host: str, port: int, own: str) -> None:
    import netdist
    from netdist.collectives import Group
    from netdist.errors import PeerLostError

    config = netdist.DistributedConfig.from_env(
        {}, rank=rank, world_size=2, coordinator=(host, port), token=TOKEN,
        job_id=f"lossy-{mode}", advertise_addr=own, timeout=300.0)
    async with netdist.init(config) as transport:
        group = Group(transport)
        if mode == "job":
            total = 0.0
            for step in range(ROUNDS):
                data = np.full(ELEMENTS, float(rank + 1 + step), dtype=np.float64)
                await group.all_reduce(data)
                total += float(data.sum())
                await asyncio.sleep(PAUSE)  # workload shape: an idle link, not a wait for anyone
            await group.barrier()
            print(f"DONE {total:.1f}", flush=True)
            return
        data = np.ones(ELEMENTS)
        await group.all_reduce(data)
        print("READY", flush=True)
        if rank == 1:
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
            return
        try:
            await transport.recv(1, tag=7)
        except PeerLostError as exc:
            print(f"LOST {time.monotonic():.3f} {exc}", flush=True)
            await transport.abort(exc)


def expected_total() -> float:
    """What ``DONE`` prints on both ranks: the sum over rounds of (1 + 2 + 2 * step) x n."""
    return float(sum((3 + 2 * step) * ELEMENTS for step in range(ROUNDS)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                     sys.argv[5]))
