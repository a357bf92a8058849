"""The parameter-server modes over real TCP connections (all ranks in one event loop)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from netdist.errors import ParameterServerError
from netdist.ps import ParameterServer, PSClient, PSServer, SGDConfig
from tests.ps.conftest import raise_any, run_ranks
from tests.ps.test_parameter_server import single_process_reference, train_rank
from tests.ps.test_sharded import local_reference, make_trainer

local = pytest.importorskip("netdist.transport.local_tcp")


async def test_sync_mode_over_tcp_matches_single_process() -> None:
    n = 4
    async with local.local_tcp_group(n, timeout=20.0) as transports:
        servers = [ParameterServer(t, chunk_bytes=512) for t in transports]
        results = await run_ranks([lambda s=s: train_rank(s, n) for s in servers])
    raise_any(results)
    reference = single_process_reference(n)
    for rank_params in results:
        for got, ref, first in zip(rank_params, reference, results[0]):
            assert np.max(np.abs(got - ref)) <= 1e-12
            assert got.tobytes() == first.tobytes()


async def test_sharded_servers_over_tcp_equal_local_training() -> None:
    optimizer = SGDConfig(lr=0.05, momentum=0.9)
    async with local.local_tcp_group(4, timeout=20.0) as transports:
        trainer = make_trainer(optimizer, 2)

        async def worker(index: int) -> Any:
            async with PSClient(transports[2 + index], num_servers=2) as client:
                return await trainer(client, index)

        results = await run_ranks(
            [PSServer(t, num_servers=2).run for t in transports[:2]]
            + [lambda i=i: worker(i) for i in range(2)])
    raise_any(results)
    reference = local_reference(optimizer, 2)
    for params in results[2:]:
        for a, b in zip(params, reference):
            assert a.tobytes() == b.tobytes()


async def test_lost_worker_over_tcp_fails_the_others_quickly() -> None:
    async with local.local_tcp_group(3, timeout=20.0) as transports:
        servers = [ParameterServer(t) for t in transports]
        grads = [np.ones(100_000)]

        async def dies() -> None:
            await servers[2].reduce_gradients(grads)  # one good round first
            await transports[2].aclose()

        async def trains(rank: int) -> None:
            for _ in range(3):
                await servers[rank].reduce_gradients(grads)

        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await run_ranks([lambda: trains(0), lambda: trains(1), dies])
        elapsed = loop.time() - started
    assert elapsed < 10.0
    for r in (0, 1):
        assert isinstance(results[r], ParameterServerError), results[r]
        assert "worker rank 2" in str(results[r])


async def test_lost_server_over_tcp_fails_workers() -> None:
    async with local.local_tcp_group(3, timeout=20.0) as transports:
        server = PSServer(transports[0], num_servers=1)

        async def serve_then_die() -> None:
            task = asyncio.ensure_future(server.run())
            await server.wait_until(lambda s: s.version >= 2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await transports[0].aclose()

        async def worker(index: int) -> None:
            async with PSClient(transports[1 + index], num_servers=1) as client:
                await client.init([np.zeros(1000)], optimizer=SGDConfig(lr=0.1))
                for _ in range(1000):
                    await client.step([np.ones(1000)])

        results = await run_ranks([serve_then_die, lambda: worker(0), lambda: worker(1)])
    for r in (1, 2):
        assert isinstance(results[r], ParameterServerError), results[r]
        assert "parameter server rank 0" in str(results[r])
