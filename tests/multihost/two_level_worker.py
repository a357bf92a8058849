"""One rank of a job whose hosts are told apart by ``NETDIST_HOST_ID`` (or by network
namespaces): every large collective, in every dtype, checked bit for bit.

    python -m tests.multihost.two_level_worker ELEMENTS [--staged] [--torch]

Inputs are small integers in each dtype (``netdist.collectives.benchmark``'s patterns),
so every sum is exact in every order: the expected result is the single-host one, and
the comparison is bitwise. ``small_message_bytes`` and ``segment_bytes`` are small, so
a test-sized array takes the large-message routes and crosses the hosts in several
pieces. Prints ``MODE <local mode> <copy>`` and ``OK rank R``; exits 1 naming the first
collective that differed. ``--torch`` runs the same through ``torch.distributed`` with
backend ``netdist``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import numpy as np

from netdist.collectives import Group
from netdist.collectives.benchmark import _as, _dtype, _pattern
from netdist.sharding import chunk_bounds
from netdist.transport.bootstrap import init

DTYPES = ("float32", "float64", "bfloat16", "int64")
SMALL_MESSAGE_BYTES = 16 * 1024
SEGMENT_BYTES = 64 * 1024


def inputs(rank: int, world: int, count: int, dtype: np.dtype[Any]) -> np.ndarray:
    """Rank ``rank``'s input as int64 values (exact in ``dtype``)."""
    return np.roll(_pattern(count, dtype), 7 * rank + world)


def bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).view(np.uint8).tobytes()


def expected_cases(rank: int, world: int, count: int, name: str) -> dict[str, np.ndarray]:
    """What every collective must return on ``rank``, computed here from every input."""
    dtype = _dtype(name)
    everyone = [inputs(r, world, count, dtype) for r in range(world)]
    total = np.sum(everyone, axis=0)
    lo, hi = chunk_bounds(count, world)[rank]
    shards = [inputs(r, world, 1000 + 37 * r, dtype) for r in range(world)]
    return {
        "all_reduce": _as(total, dtype),
        "reduce_scatter": _as(total[lo:hi], dtype),
        "all_gather": _as(np.concatenate(shards), dtype),
        "broadcast_last": _as(everyone[world - 1], dtype),
        "broadcast_first": _as(everyone[0], dtype),
    }


async def run_group(count: int, staged: bool) -> int:
    async with init() as transport:
        rank, world = transport.rank, transport.world_size
        group = Group(transport, small_message_bytes=SMALL_MESSAGE_BYTES,
                      segment_bytes=SEGMENT_BYTES, shm_copy="staged" if staged else None)
        async with group:
            for name in DTYPES:
                dtype = _dtype(name)
                want = expected_cases(rank, world, count, name)
                mine = _as(inputs(rank, world, count, dtype), dtype)
                got = {
                    "all_reduce": await group.all_reduce(mine.copy()),
                    "reduce_scatter": await group.reduce_scatter(mine.copy()),
                    "all_gather": await group.all_gather(
                        _as(inputs(rank, world, 1000 + 37 * rank, dtype), dtype)),
                    "broadcast_last": await group.broadcast(mine.copy(), world - 1),
                    "broadcast_first": await group.broadcast(mine.copy(), 0),
                }
                for case, result in got.items():
                    if bits(result) != bits(want[case]):
                        print(f"DIFFERS rank {rank} {case} {name}", flush=True)
                        return 1
            print(f"MODE {group.local_mode.value if group.local_mode else None} "
                  f"{group.local_copy.value if group.local_copy else None}", flush=True)
    print(f"OK rank {rank}", flush=True)
    return 0


def run_torch(count: int) -> int:
    import torch
    import torch.distributed as dist

    import netdist.torch  # noqa: F401  (registers the backend)
    from netdist.bfloat16 import bfloat16_to_float32

    dist.init_process_group("netdist")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for name in ("float32", "float64", "bfloat16", "int64"):
            dtype = _dtype(name)
            want = expected_cases(rank, world, count, name)

            def tensor(values: np.ndarray) -> torch.Tensor:
                exact = _as(values, dtype)
                if name == "bfloat16":
                    return torch.from_numpy(bfloat16_to_float32(exact)).to(torch.bfloat16)
                return torch.from_numpy(exact.copy())

            def same(result: torch.Tensor, case: str) -> bool:
                if name == "bfloat16":
                    return bool(torch.equal(result, torch.from_numpy(
                        bfloat16_to_float32(want[case])).to(torch.bfloat16)))
                return bool(np.array_equal(result.numpy(), want[case]))

            mine = tensor(inputs(rank, world, count, dtype))
            reduced = mine.clone()
            dist.all_reduce(reduced)
            last = mine.clone()
            dist.broadcast(last, world - 1)
            checks = {"all_reduce": reduced, "broadcast_last": last}
            if count % world == 0:  # torch's reduce_scatter_tensor needs equal chunks
                scattered = torch.empty(count // world, dtype=mine.dtype)
                dist.reduce_scatter_tensor(scattered, mine.clone())
                checks["reduce_scatter"] = scattered
            for case, result in checks.items():
                if not same(result, case):
                    print(f"DIFFERS rank {rank} {case} {name} (torch)", flush=True)
                    return 1
    finally:
        dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("elements", type=int)
    parser.add_argument("--staged", action="store_true")
    parser.add_argument("--torch", action="store_true")
    args = parser.parse_args()
    if args.torch:
        sys.exit(run_torch(args.elements))
    sys.exit(asyncio.run(run_group(args.elements, args.staged)))


if __name__ == "__main__":
    main()
