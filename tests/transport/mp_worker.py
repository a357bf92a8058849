"""A rank of a real multi-process job, for tests/transport/test_multiprocess.py.

Run as ``python -m tests.transport.mp_worker MODE [ARGS]`` with the NETDIST_* variables
set. Prints status lines the test waits for; exit code 0 means the expected outcome.

Modes:
  allpairs           every rank sends distinct arrays to every other rank and checks
                     exactly what it receives; prints "OK <rank> <checksum>"
  watch VICTIM HB    barrier, print "READY <rank>", then wait on a receive from rank
                     VICTIM (heartbeat interval HB seconds); print "PEERLOST <rank> <msg>"
                     when it is lost (the test kills or stops VICTIM)
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

from netdist.errors import PeerLostError
from netdist.transport import init


def expected(src: int, dst: int, size: int) -> np.ndarray:
    """The exact array rank ``src`` sends to rank ``dst``."""
    return (np.arange(size, dtype=np.int64) * 7919 + src * 1_000_003 + dst) % 2**40


async def allpairs() -> int:
    async with init() as transport:
        rank, n = transport.rank, transport.world_size
        sizes = (1, 1000, 300_000)
        sends = [transport.send(peer, expected(rank, peer, size), tag=size)
                 for peer in range(n) if peer != rank for size in sizes]
        receives = {(peer, size): transport.recv(peer, tag=size)
                    for peer in range(n) if peer != rank for size in sizes}
        results = await asyncio.gather(*sends, *receives.values())
        checksum = 0
        for (peer, size), got in zip(receives, results[len(sends):]):
            if not np.array_equal(got, expected(peer, rank, size)):
                print(f"MISMATCH {rank} from {peer} size {size}", flush=True)
                return 1
            checksum += int(got.sum() % 1_000_000_007)
        await transport.barrier()
        print(f"OK {rank} {checksum}", flush=True)
    return 0


async def watch(victim: int, heartbeat: float) -> int:
    async with init(heartbeat_interval=heartbeat, heartbeat_misses=3) as transport:
        await transport.barrier()
        print(f"READY {transport.rank}", flush=True)
        if transport.rank == victim:
            await asyncio.sleep(3600)  # the test kills or stops this process
            return 1
        started = time.monotonic()
        try:
            await transport.recv(victim, tag=1)
        except PeerLostError as exc:
            elapsed = time.monotonic() - started
            print(f"PEERLOST {exc.rank} after {elapsed:.2f}s: {exc}", flush=True)
            return 0
        print("RECEIVED unexpectedly", flush=True)
        return 1


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "allpairs":
        return asyncio.run(allpairs())
    if mode == "watch":
        return asyncio.run(watch(int(argv[1]), float(argv[2])))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
