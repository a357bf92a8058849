"""A rank of a real multi-process job, for tests/transport/test_blame_multiprocess.py.

Run as ``python -m tests.transport._blame_worker MODE [ARGS]`` with NETDIST_* set. Every
rank prints ``READY <rank>`` once the job is up, and ``LOST <json>`` describing the error
it then fails with (after which it re-raises, so leaving ``init()`` aborts the transport
and tells the remaining peers why). Rank 2 is always the one that goes away.

Modes:
  chain HOW HB   3 ranks: rank 0 waits on rank 2, rank 1 waits on rank 0 (heartbeat
                 interval HB seconds). HOW says how rank 2 goes: ``kill`` and ``stop``
                 (the test sends SIGKILL / SIGSTOP), ``raise`` (it raises RuntimeError
                 once the test writes a line to its stdin), ``leave`` (it closes its
                 transport cleanly and exits 0 once the test writes a line)
  ps             1 + 3 ranks around a synchronous ParameterServer (rank 0 serves): one
                 healthy round, READY, then a second round the test breaks by SIGKILLing
                 worker rank 2
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

from netdist.errors import NetdistError, PeerLostError
from netdist.ps import ParameterServer
from netdist.transport import init

VICTIM = 2
TAG = 7
PARKED = 120.0
"""Bound on how long the victim waits to be killed (the test kills it within seconds)."""


def report(exc: BaseException) -> None:
    """Print ``LOST <json>``: the error and the origin carried by any PeerLostError in it."""
    lost: BaseException | None = exc
    while lost is not None and not isinstance(lost, PeerLostError):
        lost = lost.__cause__ or lost.__context__
    fields = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(lost, PeerLostError):
        # getattr: the same worker shows what an error without origin fields blamed
        fields.update(rank=lost.rank, origin=getattr(lost, "origin_rank", lost.rank),
                      via=getattr(lost, "via", None),
                      origin_reason=getattr(lost, "origin_reason", str(lost)))
    print("LOST " + json.dumps(fields), flush=True)


async def parked() -> None:
    """Wait to be killed or stopped by the test (bounded)."""
    async with asyncio.timeout(PARKED):
        await asyncio.Event().wait()


async def chain(how: str, heartbeat: float) -> int:
    async with init(heartbeat_interval=heartbeat, heartbeat_misses=4) as transport:
        await transport.barrier()
        rank = transport.rank
        print(f"READY {rank}", flush=True)
        if rank == VICTIM:
            if how in ("kill", "stop"):
                await parked()
                return 1
            await asyncio.to_thread(sys.stdin.readline)  # the test says "go"
            if how == "raise":
                raise RuntimeError("boom in step 3")
            await transport.aclose()  # leaves the job early, cleanly, exit code 0
            print("LEFT", flush=True)
            return 0
        source = VICTIM if rank == 0 else 0
        try:
            await transport.recv(source, tag=TAG)
        except NetdistError as exc:
            report(exc)
            raise
        print("RECEIVED unexpectedly", flush=True)
        return 1


async def ps() -> int:
    async with init() as transport:
        rank = transport.rank
        server = ParameterServer(transport)
        grads = [np.full(5000, float(rank)), np.full(10, 1.0)]
        average = await server.reduce_gradients(grads)
        expected = sum(range(transport.world_size)) / transport.world_size
        if not np.array_equal(average[0], np.full(5000, expected)):
            print(f"WRONG AVERAGE {average[0][:3]}", flush=True)
            return 1
        print(f"READY {rank}", flush=True)
        if rank == VICTIM:
            await parked()
            return 1
        try:
            await server.reduce_gradients(grads)
        except NetdistError as exc:
            report(exc)
            raise
        print("RECEIVED unexpectedly", flush=True)
        return 1


def main(argv: list[str]) -> int:
    if argv[0] == "chain":
        return asyncio.run(chain(argv[1], float(argv[2])))
    if argv[0] == "ps":
        return asyncio.run(ps())
    raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
