"""``MEAN`` on integer dtypes is NCCL's average, bit for bit, on every route (issue 27).

The sum wraps around in the element type (as ``SUM`` does) and one division by the group
size follows with C's semantics: truncation toward zero for signed types, plain division
for unsigned ones. The data are full-range random integers plus hand-picked columns (the
type's extremes on every rank, and a sum of -7), so the sums wrap, are negative and leave
remainders of every sign; the reference is computed in Python's unbounded integers.

Routes (``routes.plan``): ``small_message_bytes`` picks the latency routes (``SMALL``:
the shared-memory lane where shared memory is on, recursive doubling or a binomial tree
over TCP) or the bandwidth routes (``RING``: the host arena, single-copy and staged,
where shared memory is on, the pipelined ring over TCP); the autouse ``data_path``
fixture runs every test both ways. Between real processes, and across two pretend hosts
(the hierarchical route), ``mp_worker check`` averages integers too.
"""

from __future__ import annotations

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.collectives.host.lane import lane_supported
from netdist.collectives.host.settings import ShmCopy
from netdist.sharding import chunk_bounds
from netdist.types import ReduceOp
from tests.ranks import run_ranks

from .helpers import RING, SMALL, assert_bitwise_equal

DTYPES = ["int8", "int32", "int64", "uint8"]
ALGOS = {"small": SMALL, "ring": RING}
SIZES = {"small": 203, "ring": 20_003}  # the small size fits the lane (8 KiB) in int64


def rank_data(dtype: str, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s input: column 0 the type's minimum and column 1 its maximum on
    every rank (sums that wrap), column 2 -7 on rank 0 and 0 elsewhere, then full-range
    random integers."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng([rank, info.bits, int(info.kind == "u")])
    data = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    data[:3] = [info.min, info.max, (-7 if rank == 0 else 0) if info.kind == "i" else 7]
    return data


def c_average(arrays: list[np.ndarray]) -> np.ndarray:
    """NCCL's average in Python integers: the sum wrapped to the element type, then C's
    division (truncated toward zero) by the number of ranks."""
    info = np.iinfo(arrays[0].dtype)
    span, n = 1 << info.bits, len(arrays)
    out = []
    for column in zip(*(a.tolist() for a in arrays)):
        total = (sum(column) - info.min) % span + info.min  # wraps as the element type
        out.append(-(-total // n) if total < 0 else total // n)
    return np.array(out, arrays[0].dtype)


def expected_route(algo: str, data_path: str) -> tuple[bool, bool]:
    """(lane, arena): which shared-memory route the all-reduce takes."""
    shm = data_path == "shm"
    return (algo == "small" and shm and lane_supported(), algo == "ring" and shm)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3])
async def test_all_reduce_mean_of_integers_is_ncclavg(n: int, algo: str,
                                                       data_path: str) -> None:
    size = SIZES[algo]

    async def body(g: Group) -> tuple[dict[str, np.ndarray], bool | None, bool]:
        out = {}
        for dtype in DTYPES:
            array = rank_data(dtype, g.rank, size)
            assert await g.all_reduce(array, ReduceOp.MEAN, timeout=10) is array
            out[dtype] = array
        return out, g.has_lane, g.local_copy is not None

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=4096)
    lane, arena = expected_route(algo, data_path)
    for dtype in DTYPES:
        got = [r[0][dtype] for r in results]
        assert_bitwise_equal(got)
        expected = c_average([rank_data(dtype, r, size) for r in range(n)])
        assert got[0].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got[0], expected)
    for _, has_lane, used_arena in results:
        assert bool(has_lane) is lane and used_arena is arena


def test_the_reference_truncates_toward_zero() -> None:
    """The hand-picked columns, worked out: what the other tests compare against."""
    three = [rank_data("int8", r, 3) for r in range(3)]
    # -128 * 3 = -384 wraps to -128 -> -42 (floor would give -43); 127 * 3 = 381 wraps
    # to 125 -> 41; -7 / 3 -> -2 (floor: -3)
    assert c_average(three).tolist() == [-42, 41, -2]
    two = [rank_data("int32", r, 3) for r in range(2)]
    assert c_average(two).tolist() == [0, -1, -3]  # wraps to 0 and -2; -7 / 2 -> -3
    assert c_average([rank_data("uint8", r, 3) for r in range(2)]).tolist() == [0, 127, 7]


@pytest.mark.parametrize("copy", list(ShmCopy))
async def test_all_reduce_mean_of_integers_through_the_host_arena(copy: ShmCopy) -> None:
    """Both arena copies divide inside the fold, block by block: the same bits."""
    n, size = 3, 70_001

    async def body(g: Group) -> tuple[list[np.ndarray], ShmCopy | None]:
        out = []
        for dtype in DTYPES:
            array = rank_data(dtype, g.rank, size)
            await g.all_reduce(array, ReduceOp.MEAN, timeout=10)
            out.append(array)
        return out, g.local_copy

    results = await run_ranks(n, body, small_message_bytes=RING, shared_memory=True,
                              shm_slot_bytes=64 * 1024, shm_copy=copy)
    assert [used for _, used in results] == [copy] * n
    for i, dtype in enumerate(DTYPES):
        got = [arrays[i] for arrays, _ in results]
        assert_bitwise_equal(got)
        np.testing.assert_array_equal(
            got[0], c_average([rank_data(dtype, r, size) for r in range(n)]))


@pytest.mark.parametrize("algo", ALGOS)
async def test_reduce_and_reduce_scatter_mean_of_integers(algo: str) -> None:
    n, size, root = 3, SIZES[algo], 1

    async def body(g: Group) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        out = {}
        for dtype in DTYPES:
            reduced = rank_data(dtype, g.rank, size)
            await g.reduce(reduced, root, ReduceOp.MEAN, timeout=10)
            shard = await g.reduce_scatter(rank_data(dtype, g.rank, size), ReduceOp.MEAN,
                                           timeout=10)
            out[dtype] = reduced, shard
        return out

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=4096)
    for dtype in DTYPES:
        inputs = [rank_data(dtype, r, size) for r in range(n)]
        expected = c_average(inputs)
        np.testing.assert_array_equal(results[root][dtype][0], expected)
        for rank, (lo, hi) in enumerate(chunk_bounds(size, n)):
            reduced, shard = results[rank][dtype]
            np.testing.assert_array_equal(shard, expected[lo:hi])
            assert shard.dtype == np.dtype(dtype)
            if rank != root:  # reduce leaves the other ranks' arrays alone
                np.testing.assert_array_equal(reduced, inputs[rank])
