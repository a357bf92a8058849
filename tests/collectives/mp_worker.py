"""One rank of the multi-process collective tests: ``python -m tests.collectives.mp_worker``.

Modes (first argument):

- ``check``: all_reduce (both algorithms; MEAN of floats and of int8), reduce_scatter,
  all_gather (uneven), broadcast and an object all-gather, each compared exactly with its
  closed form; prints ``OK rank R`` and exits 0, or prints ``MISMATCH ...`` and exits 1.
- ``kill VICTIM``: a large ring all_reduce; rank VICTIM SIGKILLs itself after sending a
  few segments. Survivors print ``ERROR <type>: <message>`` and exit 3 (or exit 0 with
  ``UNEXPECTED success``).
- ``shmkill VICTIM``: one large all_reduce through shared memory (which sets it up), then
  a second in which rank VICTIM SIGKILLs itself after its first signals, mid-round (with
  single copy, while its peers read its array); survivors report as for ``kill``.

- ``lane ROUNDS``: ROUNDS small all-reduces of changing sizes and values through the
  group's shared-memory lane (``NETDIST_SPIN_US`` sets how long each polls before it
  sleeps on a TCP wake-up), each compared exactly; prints ``LANE <has_lane>`` and
  ``OK rank R``.
- ``lanekill VICTIM``: a few small all-reduces through the lane, then rank VICTIM
  SIGKILLs itself instead of joining the next one; survivors report as for ``kill``.

Every mode but the lane's prints ``MODE <local mode>`` after its first large collective.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import numpy as np

from netdist.collectives import Group
from netdist.sharding import chunk_bounds
from netdist.transport.bootstrap import init
from netdist.types import ReduceOp


def _fail(what: str) -> None:
    print(f"MISMATCH {what}", flush=True)
    raise SystemExit(1)


async def check() -> None:
    async with init() as transport:
        async with Group(transport, timeout=30, segment_bytes=64 * 1024) as g:
            n, r = g.world_size, g.rank
            for threshold in (1 << 40, 0):  # latency-optimal, then ring
                g.small_message_bytes = threshold
                arr = (np.arange(100_003, dtype=np.int64) % 1000) * (r + 1)
                await g.all_reduce(arr)
                if not np.array_equal(arr, (np.arange(100_003) % 1000) * (n * (n + 1) // 2)):
                    _fail(f"all_reduce threshold={threshold}")
                if threshold == 0:
                    print(f"MODE {g.local_mode.value if g.local_mode else None}", flush=True)
                mean = np.full(100_003, 1.0 + r, np.float64)
                await g.all_reduce(mean, ReduceOp.MEAN)
                if not np.array_equal(mean, np.full(100_003, (n + 1) / 2)):
                    _fail(f"all_reduce MEAN threshold={threshold}")
                # integers: NCCL's average, the int8 sum wrapped, divided toward zero
                ints = [((np.arange(100_003) * 7 + 31 * k) % 256 - 128).astype(np.int8)
                        for k in range(n)]
                wrapped = (sum(i.astype(np.int64) for i in ints) + 128) % 256 - 128
                truncated = np.where(wrapped < 0, -(-wrapped // n), wrapped // n)
                average = ints[r].copy()
                await g.all_reduce(average, ReduceOp.MEAN)
                if average.dtype != np.int8 or not np.array_equal(average, truncated):
                    _fail(f"all_reduce MEAN int8 threshold={threshold}")
                flt = np.full(70_000, 0.25 * (r + 1), np.float32)
                await g.all_reduce(flt, ReduceOp.MAX)
                if not np.array_equal(flt, np.full(70_000, 0.25 * n, np.float32)):
                    _fail("all_reduce MAX")
                full = np.arange(50_000, dtype=np.float64) * (r + 1)
                shard = await g.reduce_scatter(full)
                a, b = chunk_bounds(50_000, n)[r]
                if not np.array_equal(shard, np.arange(a, b, dtype=np.float64)
                                      * (n * (n + 1) // 2)):
                    _fail("reduce_scatter")
                rows = 1000 * (r + 1)
                gathered = await g.all_gather(np.full((rows, 3), r, np.int32))
                expected = np.concatenate([np.full((1000 * (k + 1), 3), k, np.int32)
                                           for k in range(n)])
                if not np.array_equal(gathered, expected):
                    _fail("all_gather")
                data = np.arange(300_000, dtype=np.float32) if r == n - 1 else \
                    np.zeros(300_000, np.float32)
                await g.broadcast(data, n - 1)
                if not np.array_equal(data, np.arange(300_000, dtype=np.float32)):
                    _fail("broadcast")
            objs = await g.all_gather_object({"rank": r, "pid": os.getpid()})
            if [o["rank"] for o in objs] != list(range(n)):
                _fail("all_gather_object")
            await g.barrier()
    print(f"OK rank {r}", flush=True)


def _die_after(transport: Any, sends: int) -> None:
    """Make this rank SIGKILL itself on its send number ``sends + 1``: no goodbye at all."""
    original = transport.send
    sent = 0

    async def send(dst: int, data: Any, **kwargs: Any) -> None:
        nonlocal sent
        sent += 1
        if sent > sends:
            os.kill(os.getpid(), signal.SIGKILL)
        await original(dst, data, **kwargs)

    transport.send = send


async def _large_all_reduce_fails(g: Group, rank: int) -> None:
    """The survivors' side: report the all-reduce's error (exit 3), or its success."""
    print(f"READY rank {rank}", flush=True)
    try:
        await g.all_reduce(np.ones(8 * 1024 * 1024, np.float32),
                           timeout=float(os.environ["MP_OP_TIMEOUT"]))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        raise SystemExit(3) from None
    print("UNEXPECTED success", flush=True)


async def kill(victim: int) -> None:
    async with init() as transport:
        g = Group(transport, segment_bytes=256 * 1024, small_message_bytes=0)
        if transport.rank == victim:
            _die_after(transport, 3)  # a few segments out
        await g.barrier(timeout=30)
        await _large_all_reduce_fails(g, transport.rank)


async def shmkill(victim: int) -> None:
    async with init() as transport:
        g = Group(transport, small_message_bytes=0, shm_slot_bytes=64 * 1024)
        await g.all_reduce(np.ones(1 << 20, np.float32), timeout=30)
        print(f"MODE {g.local_mode.value if g.local_mode else None}", flush=True)
        print(f"COPY {g.local_copy.value if g.local_copy else None}", flush=True)
        if transport.rank == victim:
            # 3 peers: its 3 "in" signals out (single copy: the peers now read its array),
            # then gone at the first "reduced", mid-round on either copy path
            _die_after(transport, 3)
        await _large_all_reduce_fails(g, transport.rank)


async def lane(rounds: int) -> None:
    async with init() as transport:
        async with Group(transport, timeout=30) as g:
            n, r = g.world_size, g.rank
            for i in range(rounds):
                size = 1 + (i * 37) % 2048  # 4 bytes .. 8 KiB, every round a new size
                values = np.arange(size, dtype=np.int32) + (i * n + r)
                await g.all_reduce(values)
                expected = n * np.arange(size, dtype=np.int32) + (i * n * n + n * (n - 1) // 2)
                if not np.array_equal(values, expected):
                    _fail(f"lane all_reduce round {i}")
            print(f"LANE {g.has_lane}", flush=True)
    print(f"OK rank {r}", flush=True)


async def lanekill(victim: int) -> None:
    async with init() as transport:
        g = Group(transport, timeout=30)
        for _ in range(5):
            await g.all_reduce(np.ones(4, np.float32))
        print(f"LANE {g.has_lane}", flush=True)
        if transport.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        print(f"READY rank {transport.rank}", flush=True)
        try:
            await g.all_reduce(np.ones(4, np.float32),
                               timeout=float(os.environ["MP_OP_TIMEOUT"]))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
            raise SystemExit(3) from None
        print("UNEXPECTED success", flush=True)


def main() -> None:
    mode = sys.argv[1]
    if mode == "check":
        asyncio.run(check())
    elif mode == "kill":
        asyncio.run(kill(int(sys.argv[2])))
    elif mode == "shmkill":
        asyncio.run(shmkill(int(sys.argv[2])))
    elif mode == "lane":
        asyncio.run(lane(int(sys.argv[2])))
    elif mode == "lanekill":
        asyncio.run(lanekill(int(sys.argv[2])))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
