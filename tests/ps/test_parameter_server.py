"""Sync parameter server with rank 0 serving (and training): equivalence and failures."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from netdist.errors import NetdistTimeoutError, ParameterServerError
from netdist.ps import ParameterServer
from netdist.transport import InProcessTransport
from tests.ps._model import init_mlp, mse_grads, regression_data
from tests.ps.conftest import raise_any, run_ranks
from tests.ranks import start_until_blocked

STEPS = 20
BATCH = 8
LR = 0.1


def single_process_reference(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1234)
    params = init_mlp(rng)
    x, y = regression_data(np.random.default_rng(99), STEPS * n * BATCH)
    for step in range(STEPS):
        lo, hi = step * n * BATCH, (step + 1) * n * BATCH
        _, grads = mse_grads(params, x[lo:hi], y[lo:hi])
        for p, g in zip(params, grads):
            p -= LR * g
    return params


async def train_rank(ps: ParameterServer, n: int) -> list[np.ndarray]:
    rank = ps.rank
    if rank == 0:
        params = init_mlp(np.random.default_rng(1234))
    else:  # deliberately different: broadcast_params must overwrite them
        params = [np.zeros_like(p) for p in init_mlp(np.random.default_rng(1))]
    await ps.broadcast_params(params)
    x, y = regression_data(np.random.default_rng(99), STEPS * n * BATCH)
    for step in range(STEPS):
        lo = step * n * BATCH + rank * BATCH
        _, grads = mse_grads(params, x[lo:lo + BATCH], y[lo:lo + BATCH])
        averaged = await ps.reduce_gradients(grads)
        for p, g in zip(params, averaged):
            p -= LR * g
    return params


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("chunk_bytes", [4 * 1024 * 1024, 200])
async def test_sync_training_matches_single_process(n: int, chunk_bytes: int) -> None:
    transports = InProcessTransport.create_group(n, timeout=20.0)
    servers = [ParameterServer(t, chunk_bytes=chunk_bytes) for t in transports]
    assert [s.is_server for s in servers] == [True] + [False] * (n - 1)
    results = await run_ranks([lambda s=s: train_rank(s, n) for s in servers])
    raise_any(results)
    reference = single_process_reference(n)
    for rank_params in results:
        for got, ref in zip(rank_params, reference):
            assert np.max(np.abs(got - ref)) <= 1e-12
    for rank_params in results[1:]:  # bitwise identical on every rank
        for got, first in zip(rank_params, results[0]):
            assert got.tobytes() == first.tobytes()


async def test_average_is_rank_ordered_sum_mixed_dtypes() -> None:
    n = 3
    rng = np.random.default_rng(5)
    per_rank = [[rng.standard_normal((5, 7)), rng.standard_normal(11).astype(np.float32),
                 rng.standard_normal(3)] for _ in range(n)]
    transports = InProcessTransport.create_group(n)
    servers = [ParameterServer(t, chunk_bytes=24) for t in transports]
    results = await run_ranks([lambda r=r: servers[r].reduce_gradients(per_rank[r])
                               for r in range(n)])
    raise_any(results)
    for i in range(3):
        expected = per_rank[0][i].copy()
        for r in range(1, n):
            expected += per_rank[r][i]
        expected /= n
        for r in range(n):
            assert results[r][i].dtype == per_rank[0][i].dtype
            assert results[r][i].shape == per_rank[0][i].shape
            assert results[r][i].tobytes() == expected.tobytes()
    # the inputs are untouched
    assert per_rank[1][0].tobytes() != results[1][0].tobytes()


async def test_non_default_root_serves() -> None:
    n = 3
    transports = InProcessTransport.create_group(n)
    servers = [ParameterServer(t, root=2) for t in transports]
    assert [s.is_server for s in servers] == [False, False, True]
    grads = [[np.full(4, float(r + 1))] for r in range(n)]
    results = await run_ranks([lambda r=r: servers[r].reduce_gradients(grads[r])
                               for r in range(n)])
    raise_any(results)
    for r in range(n):
        np.testing.assert_array_equal(results[r][0], np.full(4, 2.0))


async def test_broadcast_params_overwrites_in_place() -> None:
    n = 3
    transports = InProcessTransport.create_group(n)
    servers = [ParameterServer(t, chunk_bytes=64) for t in transports]
    params = [[np.arange(12, dtype=np.float32).reshape(3, 4) * (r + 1),
               np.arange(5, dtype=np.int64) - r] for r in range(n)]
    originals = [[p for p in ps] for ps in params]
    results = await run_ranks([lambda r=r: servers[r].broadcast_params(params[r])
                               for r in range(n)])
    raise_any(results)
    for r in range(n):
        assert results[r][0] is originals[r][0]
        np.testing.assert_array_equal(params[r][0], np.arange(12, dtype=np.float32).reshape(3, 4))
        np.testing.assert_array_equal(params[r][1], np.arange(5))


async def test_world_size_one_is_identity() -> None:
    [transport] = InProcessTransport.create_group(1)
    ps = ParameterServer(transport)
    grads = [np.arange(3.0)]
    out = await ps.reduce_gradients(grads)
    np.testing.assert_array_equal(out[0], grads[0])
    assert out[0] is not grads[0]
    assert await ps.aggregate(grads) is not None


async def test_layout_mismatch_fails_on_every_rank() -> None:
    n = 3
    transports = InProcessTransport.create_group(n, timeout=5.0)
    servers = [ParameterServer(t) for t in transports]
    grads = [[np.zeros((2, 3))], [np.zeros((2, 3))], [np.zeros((3, 2))]]
    results = await run_ranks([lambda r=r: servers[r].reduce_gradients(grads[r])
                               for r in range(n)])
    for r in range(n):
        assert isinstance(results[r], ParameterServerError), results[r]
        assert "rank 2 passed tensors [float64[3, 2]]" in str(results[r])


async def test_lost_worker_fails_server_and_other_workers() -> None:
    n = 4
    transports = InProcessTransport.create_group(n, timeout=10.0)
    servers = [ParameterServer(t) for t in transports]
    grads = [np.ones(1000)]
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def dies() -> None:
        await transports[2].aclose()

    results = await run_ranks([
        lambda: servers[0].reduce_gradients(grads),
        lambda: servers[1].reduce_gradients(grads),
        dies,
        lambda: servers[3].reduce_gradients(grads),
    ])
    assert loop.time() - started < 5.0
    for r in (0, 1, 3):
        assert isinstance(results[r], ParameterServerError), results[r]
        assert "worker rank 2" in str(results[r])


async def test_lost_server_fails_workers() -> None:
    n = 3
    transports = InProcessTransport.create_group(n, timeout=10.0)
    servers = [ParameterServer(t) for t in transports]
    grads = [np.ones(100)]

    async def server_dies() -> None:
        await transports[0].aclose()

    results = await run_ranks([server_dies,
                               lambda: servers[1].reduce_gradients(grads),
                               lambda: servers[2].reduce_gradients(grads)])
    for r in (1, 2):
        assert isinstance(results[r], ParameterServerError), results[r]
        assert "lost the parameter server (rank 0)" in str(results[r])


async def test_silent_worker_times_out_and_others_are_told() -> None:
    n = 3
    transports = InProcessTransport.create_group(n, timeout=10.0)
    servers = [ParameterServer(t, timeout=0.3) for t in transports]
    grads = [np.ones(10)]
    told = asyncio.Event()

    async def silent() -> None:  # stays quiet until the others have given up
        async with asyncio.timeout(5.0):
            await told.wait()

    async def worker() -> list[np.ndarray]:
        try:
            return await servers[1].reduce_gradients(grads)
        finally:
            told.set()

    results = await run_ranks([lambda: servers[0].reduce_gradients(grads), worker, silent])
    assert isinstance(results[0], NetdistTimeoutError), results[0]
    assert "worker rank 2" in str(results[0])
    assert isinstance(results[1], ParameterServerError), results[1]
    assert "worker rank 2" in str(results[1])


async def test_concurrent_rounds_are_rejected() -> None:
    transports = InProcessTransport.create_group(2, timeout=5.0)
    ps = ParameterServer(transports[1])
    first = await start_until_blocked(ps.reduce_gradients([np.ones(3)]))
    with pytest.raises(ParameterServerError, match="one at a time"):
        await ps.reduce_gradients([np.ones(3)])
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_runs_on_a_subgroup_in_group_ranks() -> None:
    collectives = pytest.importorskip("netdist.collectives")
    transports = InProcessTransport.create_group(4, timeout=10.0)
    groups = [collectives.Group(t) for t in transports]
    subs = [g.new_group([3, 1, 2]) for g in groups]  # group rank 0 is global rank 3

    async def rank(r: int) -> list[np.ndarray] | None:
        if not subs[r].is_member:
            return None
        ps = ParameterServer(subs[r])
        assert ps.is_server == (r == 3)
        return await ps.reduce_gradients([np.full(3, float(subs[r].rank))])

    results = await run_ranks([lambda r=r: rank(r) for r in range(4)])
    raise_any(results)
    assert results[0] is None
    for r in (1, 2, 3):
        np.testing.assert_array_equal(results[r][0], np.full(3, 1.0))  # (0 + 1 + 2) / 3


@pytest.mark.parametrize("chunk_bytes", [100_000, 4 * 1024 * 1024])
async def test_large_tensors_go_direct_and_average_exactly(chunk_bytes: int) -> None:
    n = 3
    rng = np.random.default_rng(9)
    per_rank = [[rng.standard_normal(40_000),                      # 320 KB: direct
                 rng.standard_normal(5),                           # small: packed
                 rng.standard_normal((300, 200)).T,                # big, not contiguous
                 rng.standard_normal(70_000).astype(np.float32),   # big float32
                 rng.standard_normal(3).astype(np.float32)] for _ in range(n)]
    transports = InProcessTransport.create_group(n)
    servers = [ParameterServer(t, chunk_bytes=chunk_bytes) for t in transports]
    for _ in range(2):  # the second round reuses every buffer
        results = await run_ranks([lambda r=r: servers[r].reduce_gradients(per_rank[r])
                                   for r in range(n)])
        raise_any(results)
        for i in range(5):
            expected = per_rank[0][i] + per_rank[1][i]
            expected = expected + per_rank[2][i]
            expected = expected / n
            for r in range(n):
                assert results[r][i].shape == expected.shape
                assert results[r][i].dtype == expected.dtype
                assert np.ascontiguousarray(results[r][i]).tobytes() == \
                    np.ascontiguousarray(expected).tobytes()
    params = [[np.ascontiguousarray(g).copy() for g in grads] for grads in per_rank]
    results = await run_ranks([lambda r=r: servers[r].broadcast_params(params[r])
                               for r in range(n)])
    raise_any(results)
    for r in range(n):
        for a, b in zip(params[r], per_rank[0]):
            assert a.tobytes() == np.ascontiguousarray(b).tobytes()
