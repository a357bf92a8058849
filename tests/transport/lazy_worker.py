"""A rank of a real multi-process job, for tests/transport/test_lazy_connect.py.

Run as ``python -m tests.transport.lazy_worker MODE [ARGS]`` with the NETDIST_* variables
set (connections on first use, the default). Prints status lines the test waits for;
exit code 0 means the expected outcome.

Modes:
  ring N        print "STARTUP <rank> <peers>" (connections held right after start-up),
                wait for a line on stdin (every rank has counted), run one ring all-reduce of N float64 on the transport (each rank sends
                only to its right neighbour and receives only from its left one), check
                the sum exactly, print "PEERS <rank> <peers>" (connections held after it;
                peers comma-separated, "-" for none), then wait for a line on stdin
  wait SRC HB   heartbeat interval HB seconds; print "READY <rank>". Rank SRC then waits
                to be stopped or killed by the test. Every other rank waits for a line on
                stdin, posts a receive from SRC (which connects to it: never before),
                prints "WAITING <rank> <peers>" and reports how the receive ended:
                "PEERLOST <lost rank> <message>" (exit 0) or something else (exit 1)
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from netdist.errors import PeerLostError
from netdist.transport import Transport, init
from tests.ranks import start_until_blocked

PARKED = 120.0
"""Bound on how long the victim waits to be stopped or killed (the test acts in seconds)."""


def peers_text(peers: tuple[int, ...]) -> str:
    return ",".join(map(str, peers)) or "-"


async def ring_all_reduce(transport: Transport, data: np.ndarray, tag: int) -> None:
    """Sum ``data`` over every rank in place: a ring reduce-scatter, then a ring
    all-gather, each n - 1 steps of send-right / receive-left on the transport."""
    n, rank = transport.world_size, transport.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = np.array_split(data, n)  # views of data
    for step in range(n - 1):
        mine, theirs = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        incoming = np.empty_like(theirs)
        await asyncio.gather(transport.send(right, mine, tag=tag),
                             transport.recv(left, tag=tag, out=incoming))
        theirs += incoming
    for step in range(n - 1):
        await asyncio.gather(transport.send(right, chunks[(rank + 1 - step) % n], tag=tag),
                             transport.recv(left, tag=tag, out=chunks[(rank - step) % n]))


async def ring(size: int) -> int:
    async with init() as transport:
        rank, n = transport.rank, transport.world_size
        print(f"STARTUP {rank} {peers_text(transport.connected_peers())}", flush=True)
        # start the ring only once every rank has counted: a neighbour already in the
        # ring would dial this rank while its rendezvous is still finishing
        await asyncio.to_thread(sys.stdin.readline)
        data = np.arange(size, dtype=np.float64) + rank
        await ring_all_reduce(transport, data, tag=1)
        expected = n * np.arange(size, dtype=np.float64) + n * (n - 1) / 2
        if not np.array_equal(data, expected):
            print(f"WRONG SUM {rank}", flush=True)
            return 1
        print(f"PEERS {rank} {peers_text(transport.connected_peers())}", flush=True)
        # stay until every rank has counted (a neighbour that leaves closes its connection)
        await asyncio.to_thread(sys.stdin.readline)
    return 0


async def wait(src: int, heartbeat: float) -> int:
    async with init(heartbeat_interval=heartbeat, heartbeat_misses=4) as transport:
        rank = transport.rank
        print(f"READY {rank}", flush=True)
        if rank == src:
            async with asyncio.timeout(PARKED):
                await asyncio.Event().wait()  # stopped or killed by the test
            return 1
        await asyncio.to_thread(sys.stdin.readline)  # the test says "go"
        # returns once the receive is posted (and so the connection to SRC begun)
        receiving = await start_until_blocked(transport.recv(src, tag=3, timeout=60.0))
        print(f"WAITING {rank} {peers_text(transport.connected_peers())}", flush=True)
        try:
            await receiving
        except PeerLostError as exc:
            print(f"PEERLOST {exc.rank} {exc}", flush=True)
            return 0
        except Exception as exc:  # noqa: BLE001 - reported to the test as is
            print(f"OTHER {type(exc).__name__}: {exc}", flush=True)
            return 1
        print("RECEIVED unexpectedly", flush=True)
        return 1


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "ring":
        return asyncio.run(ring(int(argv[1])))
    if mode == "wait":
        return asyncio.run(wait(int(argv[1]), float(argv[2])))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
