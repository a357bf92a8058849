"""Collectives over real TCP sockets on 127.0.0.1 (all ranks in one event loop)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.errors import NetdistTimeoutError, PeerLostError
from netdist.transport.local_tcp import local_tcp_group
from netdist.types import ReduceOp
from tests.collectives.helpers import RING, SMALL, assert_bitwise_equal
from tests.ranks import run_ranks

ALGOS = {"small": SMALL, "ring": RING}


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
async def test_tcp_all_reduce(n: int, algo: str) -> None:
    size = 30_001  # uneven chunks; with 16 KiB segments, several segments per chunk

    def data(rank: int) -> np.ndarray:
        return np.random.default_rng(rank).integers(-10**6, 10**6, size)

    def floats(rank: int) -> np.ndarray:
        return np.random.default_rng(100 + rank).standard_normal(size)

    async def body(g: Group) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ints = await g.all_reduce(data(g.rank), timeout=20)
        fl = await g.all_reduce(floats(g.rank), ReduceOp.MEAN, timeout=20)
        mx = await g.all_reduce(floats(g.rank).astype(np.float32), ReduceOp.MAX, timeout=20)
        return ints, fl, mx

    async with local_tcp_group(n, timeout=20.0) as transports:
        results = await run_ranks(transports, body, small_message_bytes=ALGOS[algo],
                                  segment_bytes=16 * 1024)
    expected = np.sum([data(r) for r in range(n)], axis=0)
    for ints, _, _ in results:
        np.testing.assert_array_equal(ints, expected)
    assert_bitwise_equal([fl for _, fl, _ in results])
    assert_bitwise_equal([mx for _, _, mx in results])
    np.testing.assert_allclose(results[0][1], np.mean([floats(r) for r in range(n)], axis=0),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(
        results[0][2], np.max([floats(r).astype(np.float32) for r in range(n)], axis=0))


@pytest.mark.parametrize("algo", ALGOS)
async def test_tcp_other_collectives(algo: str) -> None:
    n = 3

    async def body(g: Group) -> dict[str, object]:
        rows = g.rank + 2
        shard = np.full((rows, 5), g.rank, np.float32)
        gathered = await g.all_gather(shard, timeout=20)
        arr = np.arange(40_000, dtype=np.int32) * (g.rank + 1)
        rs = await g.reduce_scatter(arr, timeout=20)
        b = np.arange(50_000, dtype=np.float64) if g.rank == 1 else np.zeros(50_000)
        await g.broadcast(b, 1, timeout=20)
        r = np.ones(10_000) * (g.rank + 1)
        await g.reduce(r, 0, timeout=20)
        objs = await g.all_gather_object({"r": g.rank}, timeout=20)
        await g.barrier(timeout=20)
        return {"gathered": gathered, "rs": rs, "b": b, "r": r, "objs": objs}

    async with local_tcp_group(n, timeout=20.0) as transports:
        results = await run_ranks(transports, body, small_message_bytes=ALGOS[algo],
                                  segment_bytes=8 * 1024)
    expected_gather = np.concatenate([np.full((r + 2, 5), r, np.float32) for r in range(n)])
    full = np.arange(40_000, dtype=np.int32) * 6
    from netdist.sharding import chunk_bounds
    for rank, res in enumerate(results):
        np.testing.assert_array_equal(res["gathered"], expected_gather)
        a, b = chunk_bounds(40_000, n)[rank]
        np.testing.assert_array_equal(res["rs"], full[a:b])
        np.testing.assert_array_equal(res["b"], np.arange(50_000, dtype=np.float64))
        assert res["objs"] == [{"r": r} for r in range(n)]
    np.testing.assert_array_equal(results[0]["r"], np.full(10_000, 6.0))
    np.testing.assert_array_equal(results[1]["r"], np.full(10_000, 2.0))


async def test_tcp_subgroups_and_async_ops_interleaved() -> None:
    async def body(g: Group) -> tuple[np.ndarray, np.ndarray]:
        sub = g.new_group([3, 1])
        big = np.full(200_000, float(g.rank))
        work = await g.all_reduce(big, async_op=True, timeout=20)
        small = np.array([g.rank * 1.0])
        if sub.is_member:
            await sub.all_reduce(small, timeout=20)
        await work
        return big, small

    async with local_tcp_group(4, timeout=20.0) as transports:
        results = await run_ranks(transports, body, small_message_bytes=1024,
                                  segment_bytes=64 * 1024)
    for rank, (big, small) in enumerate(results):
        np.testing.assert_array_equal(big, np.full(200_000, 6.0))
        assert small[0] == (4.0 if rank in (1, 3) else rank)


@pytest.mark.parametrize("algo", ALGOS)
async def test_tcp_rank_closing_mid_all_reduce_fails_the_others(algo: str) -> None:
    n = 4
    op_timeout = 1.5
    async with local_tcp_group(n, timeout=20.0) as transports:
        groups = [Group(t, small_message_bytes=ALGOS[algo], segment_bytes=16 * 1024)
                  for t in transports]
        loop = asyncio.get_running_loop()
        started = loop.time()
        works = [await g.all_reduce(np.ones(500_000), async_op=True, timeout=op_timeout)
                 for g in groups[:3]]
        await transports[3].aclose()  # rank 3 leaves instead of taking part
        errors = []
        for w in works:
            with pytest.raises((PeerLostError, NetdistTimeoutError)) as info:
                async with asyncio.timeout(op_timeout + 5):
                    await w
            errors.append(info.value)
        assert loop.time() - started < op_timeout + 2
        for g in groups:
            await g.aclose()
    for exc in errors:
        assert "all_reduce" in str(exc)
        assert "rank 3" in str(exc)  # the lost rank is named, even in a timeout
    assert any(isinstance(exc, PeerLostError) and exc.rank == 3 for exc in errors)
