"""Servers inside training ranks (ColocatedPS) and the training-loop adapters."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from netdist.errors import ConfigError, ParameterServerError
from netdist.ps import (
    ColocatedPS,
    ServerOptimizerAggregator,
    SGDConfig,
    max_staleness_from_env,
)
from netdist.train.ps_paths import demo_update_path
from netdist.transport import InProcessTransport
from tests.ps._model import init_mlp, mse_grads, regression_data
from tests.ps.conftest import raise_any, run_ranks
from tests.ps.test_sharded import SIZES, local_reference, make_trainer


async def run_colocated(n: int, servers: int, worker: Any) -> list[Any]:
    transports = InProcessTransport.create_group(n, timeout=10.0)

    async def one(t: Any, index: int) -> Any:
        async with ColocatedPS(t, num_servers=servers) as ps:
            result = await worker(ps, index)
        return result, ps.report

    return await run_ranks([lambda t=t, i=i: one(t, i) for i, t in enumerate(transports)])


@pytest.mark.parametrize("n,servers", [(1, 1), (3, 2), (3, 3)])
async def test_colocated_training_equals_local_reference(n: int, servers: int) -> None:
    optimizer = SGDConfig(lr=0.05, momentum=0.9)
    results = await run_colocated(n, servers, make_trainer(optimizer, n))
    raise_any(results)
    reference = local_reference(optimizer, n)
    for rank, (params, report) in enumerate(results):
        for a, b in zip(params, reference):
            assert a.tobytes() == b.tobytes()
        if rank < servers:
            assert report is not None and report.version == 20
        else:
            assert report is None


async def test_colocated_lost_rank_fails_everyone() -> None:
    transports = InProcessTransport.create_group(3, timeout=10.0)

    async def one(index: int) -> None:
        ps = ColocatedPS(transports[index], num_servers=2)
        async with ps:
            await ps.init([np.zeros(8)], optimizer=SGDConfig(lr=0.1), bigarray_bound=4)
            for step in range(50):
                if index == 2 and step == 2:
                    await transports[2].aclose()
                    return
                await ps.step([np.ones(8)])

    results = await run_ranks([lambda i=i: one(i) for i in range(3)])
    for r in (0, 1):
        assert isinstance(results[r], ParameterServerError), results[r]
        assert "rank 2" in str(results[r])


@dataclass
class FakeParam:
    name: str
    data: np.ndarray
    grad: np.ndarray


class FakeModel:
    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.params = [FakeParam(str(i), a, np.zeros_like(a)) for i, a in enumerate(arrays)]

    def parameters(self) -> list[FakeParam]:
        return self.params


@dataclass(frozen=True)
class FakeConfig:
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    timeout: float | None = None


async def train_with_hooks(name: str, transport: Any, rank: int, n: int) -> list[np.ndarray]:
    seed = 7 if rank == 0 or name != "ps" else 8  # "ps" must broadcast rank 0's values
    model = FakeModel(init_mlp(np.random.default_rng(seed), SIZES))
    hooks = await demo_update_path(name, transport, model, FakeConfig())
    x, y = regression_data(np.random.default_rng(11), 10 * n * 8, d_in=SIZES[0],
                           d_out=SIZES[-1])
    try:
        for step in range(10):
            lo = (step * n + rank) * 8
            params = [p.data for p in model.parameters()]
            _, grads = mse_grads(params, x[lo:lo + 8], y[lo:lo + 8])
            out = await hooks.aggregator.aggregate(grads)
            hooks.apply(out)
    finally:
        if hooks.close is not None:
            await hooks.close()
    return [p.data.copy() for p in model.parameters()]


async def test_demo_paths_ps_and_ps_sharded_agree_bitwise() -> None:
    n = 3
    per_mode = {}
    for name in ("ps", "ps-sharded"):
        transports = InProcessTransport.create_group(n, timeout=10.0)
        results = await run_ranks([lambda t=t, r=r: train_with_hooks(name, t, r, n)
                                   for r, t in enumerate(transports)])
        raise_any(results)
        per_mode[name] = results
    for rank in range(n):
        for a, b in zip(per_mode["ps"][rank], per_mode["ps-sharded"][rank]):
            assert a.tobytes() == b.tobytes()
        for a, b in zip(per_mode["ps"][rank], per_mode["ps"][0]):
            assert a.tobytes() == b.tobytes()


async def test_demo_path_ps_async_runs_and_unknown_name_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NETDIST_PS_MAX_STALENESS", "1")
    monkeypatch.setenv("NETDIST_PS_SERVERS", "1")
    n = 2
    transports = InProcessTransport.create_group(n, timeout=10.0)
    results = await run_ranks([lambda t=t, r=r: train_with_hooks("ps-async", t, r, n)
                               for r, t in enumerate(transports)])
    raise_any(results)
    assert all(np.all(np.isfinite(a)) for a in results[0])
    with pytest.raises(ConfigError, match="no update path"):
        await demo_update_path("ring", transports[0], FakeModel([np.zeros(2)]), FakeConfig())


def test_max_staleness_from_env() -> None:
    assert max_staleness_from_env({}) == 2
    assert max_staleness_from_env({"NETDIST_PS_MAX_STALENESS": "none"}) is None
    assert max_staleness_from_env({"NETDIST_PS_MAX_STALENESS": "0"}) == 0
    with pytest.raises(ConfigError):
        max_staleness_from_env({"NETDIST_PS_MAX_STALENESS": "-1"})


async def test_server_optimizer_aggregator_writes_in_place() -> None:
    transports = InProcessTransport.create_group(2, timeout=10.0)

    async def one(index: int) -> tuple[bool, float]:
        async with ColocatedPS(transports[index], num_servers=1) as ps:
            data = [np.full(3, 1.0)]
            await ps.init(data, optimizer=SGDConfig(lr=0.5))
            agg = ServerOptimizerAggregator(ps, out=data)
            assert agg.returns_parameters
            out = await agg.aggregate([np.full(3, float(index + 1))])
            await asyncio.sleep(0)
            return out[0] is data[0], float(data[0][0])

    results = await run_ranks([lambda i=i: one(i) for i in range(2)])
    raise_any(results)
    assert results == [(True, 0.25), (True, 0.25)]  # 1 - 0.5 * (1 + 2) / 2
