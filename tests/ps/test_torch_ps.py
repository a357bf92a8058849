"""The parameter servers with torch tensors and bfloat16, every rank in one event loop.

- The rank-0 ``ParameterServer``: tensors in, tensors out, bitwise equal to the NumPy path;
  ``broadcast_params`` writes into tensors (a non-contiguous one through a copy); bfloat16
  gradients average as torch computes ``((g0 + g1) + g2) / 3``, bit for bit.
- Dedicated and co-located sharded servers with bfloat16 parameters keep a float32 master
  copy and float32 optimizer state: every pulled parameter equals the float32 SGD
  trajectory of the master, rounded by torch to bfloat16, bit for bit.
- ``ServerOptimizerAggregator.init`` writes the first worker's values into every
  worker's tensors, and ``aggregate`` returns those very tensors.
- The bfloat16 checks run again in a process where ``ml_dtypes`` cannot be imported.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from netdist.errors import ParameterServerError
from netdist.optim_kernels import sgd_update
from netdist.ps import (
    ColocatedPS,
    ParameterServer,
    PSClient,
    PSServer,
    ServerOptimizerAggregator,
    SGDConfig,
)
from netdist.ps.placement import ParamSpec, plan_shards
from netdist.ps.shard import ServerShard
from netdist.transport import InProcessTransport
from tests.ps.conftest import raise_any, run_ranks

TIMEOUT = 20.0
REPO = Path(__file__).resolve().parents[2]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (any dtype), for bitwise comparisons."""
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(width)


def assert_bitwise(ours: Any, theirs: Any) -> None:
    ours = ours if isinstance(ours, torch.Tensor) else torch.from_numpy(ours)
    theirs = theirs if isinstance(theirs, torch.Tensor) else torch.from_numpy(theirs)
    assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape)
    assert torch.equal(bits(ours), bits(theirs))


async def on_ranks(n: int, fn: Callable[[int, Any], Awaitable[Any]]) -> list[Any]:
    transports = InProcessTransport.create_group(n, timeout=TIMEOUT)
    try:
        results = await run_ranks([lambda r=r, t=t: fn(r, t) for r, t in enumerate(transports)])
    finally:
        for t in transports:
            await t.aclose()
    raise_any(results)
    return results


# ------------------------------------------------------------- rank-0 ParameterServer


def sync_grads(rank: int) -> list[torch.Tensor]:
    """Two float dtypes, a non-contiguous tensor, an empty one, one from autograd, one
    large enough to travel as direct pieces."""
    g = torch.Generator().manual_seed(rank)
    weight = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.float64))
    (weight * torch.randn(4, 6, generator=g, dtype=torch.float64)).sum().backward()
    assert weight.grad is not None
    return [torch.randn(5, generator=g), torch.randn(3, 8, generator=g).t(), torch.zeros(0),
            weight.grad, torch.randn(70_000, generator=g)]


@pytest.mark.parametrize("n", [2, 3])
async def test_sync_server_tensors_equal_the_numpy_path(n: int) -> None:
    async def rank(r: int, transport: Any) -> tuple[list[Any], list[Any], list[Any]]:
        ps = ParameterServer(transport, chunk_bytes=64 * 1024)
        grads = sync_grads(r)
        before = [g.clone() for g in grads]
        with_tensors = await ps.reduce_gradients(grads)
        assert all(isinstance(t, torch.Tensor) for t in with_tensors)
        for g, b in zip(grads, before):
            assert_bitwise(g, b)  # the inputs are not modified
        with_arrays = await ps.reduce_gradients([g.numpy().copy() for g in grads])
        assert all(isinstance(a, np.ndarray) for a in with_arrays)
        mixed = await ps.aggregate([grads[0], grads[1].numpy()] + grads[2:])
        assert isinstance(mixed[0], torch.Tensor) and isinstance(mixed[1], np.ndarray)
        return with_tensors, with_arrays, mixed

    results = await on_ranks(n, rank)
    for with_tensors, with_arrays, mixed in results:
        for t, a, m, first in zip(with_tensors, with_arrays, mixed, results[0][0]):
            assert_bitwise(t, a)
            assert_bitwise(m, a)
            assert_bitwise(t, first)  # every rank gets the server's bytes
    everyone = [sync_grads(r) for r in range(n)]
    for i in (0, 1, 3):  # the mean in rank order, as the server sums it
        acc = everyone[0][i]
        for g in everyone[1:]:
            acc = acc + g[i]
        assert_bitwise(results[1][0][i], acc / n)


async def test_broadcast_params_writes_into_tensors() -> None:
    source = [torch.arange(12.0).reshape(3, 4), torch.full((70_000,), 2.5),
              torch.tensor([1.0, 2.0], dtype=torch.float64)]

    async def rank(r: int, transport: Any) -> list[Any]:
        ps = ParameterServer(transport, chunk_bytes=64 * 1024)
        if r == 0:
            params: list[Any] = [source[0].t().contiguous().t(), source[1], source[2]]
        elif r == 1:  # a non-contiguous tensor is filled through a copy, copied back
            params = [torch.zeros(4, 3).t(), torch.zeros(70_000),
                      torch.zeros(2, dtype=torch.float64)]
        else:
            params = [np.zeros((3, 4), np.float32), np.zeros(70_000, np.float32),
                      torch.zeros(2, dtype=torch.float64)]
        returned = await ps.broadcast_params(params)
        assert all(a is b for a, b in zip(returned, params))
        return params

    results = await on_ranks(3, rank)
    for params in results:
        for got, want in zip(params, source):
            assert_bitwise(torch.as_tensor(got), want)


@pytest.mark.parametrize("n", [2, 3])
async def test_sync_server_bfloat16_is_torchs_mean(n: int) -> None:
    await check_sync_bfloat16(n)


async def check_sync_bfloat16(n: int) -> None:
    """bfloat16 tensors (small packed ones, one of direct pieces, a non-contiguous one)
    average to torch's ``in_order_sum / n`` bit for bit, on every rank."""
    def grads(rank: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(100 + rank)
        scale = 2.0 ** torch.randint(-6, 6, (140_000,), generator=g)
        return [torch.randn(300, generator=g).bfloat16(),
                (torch.randn(140_000, generator=g) * scale).bfloat16(),
                torch.randn(4, 5, generator=g).bfloat16().t()]

    async def rank(r: int, transport: Any) -> list[Any]:
        result = await ParameterServer(transport, chunk_bytes=64 * 1024).reduce_gradients(grads(r))
        assert all(t.dtype == torch.bfloat16 for t in result)
        return result

    results = await on_ranks(n, rank)
    everyone = [grads(r) for r in range(n)]
    for i in range(3):
        acc = everyone[0][i]
        for g in everyone[1:]:
            acc = acc + g[i]
        for result in results:
            assert_bitwise(result[i], acc / n)


async def test_sync_server_refuses_unusable_tensors_before_sending() -> None:
    async def rank(r: int, transport: Any) -> list[Any]:
        ps = ParameterServer(transport)
        with pytest.raises(ValueError, match="gradient 1: netdist works on CPU tensors, "
                                             "got one on meta"):
            await ps.reduce_gradients([torch.zeros(2), torch.zeros(2, device="meta")])
        with pytest.raises(TypeError, match="floating point, got int64"):
            await ps.reduce_gradients([torch.zeros(2, dtype=torch.int64)])
        with pytest.raises(TypeError, match="list of gradients, got a single Tensor"):
            await ps.reduce_gradients(torch.zeros(2))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="parameter 0: netdist works on CPU tensors"):
            await ps.broadcast_params([torch.zeros(2, device="meta")])
        # nothing went out: the next round is the first one on both sides
        return await ps.reduce_gradients([torch.full((2,), float(r))])

    for result in await on_ranks(2, rank):
        assert_bitwise(result[0], torch.full((2,), 0.5))


# ------------------------------------------------------ sharded servers, bfloat16 master


STEPS = 3
LR, MOMENTUM = 0.1, 0.9
BOUND = 40  # the 10x8 weight (80 elements) is sliced across both servers


def bf16_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 10), torch.nn.Tanh(),
                               torch.nn.Linear(10, 2)).to(torch.bfloat16)


def bf16_batch(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + index)
    return (torch.randn(6, 8, generator=g).bfloat16(),
            torch.randn(6, 2, generator=g).bfloat16())


async def train_bf16(client: Any, index: int) -> dict[str, Any]:
    """Worker ``index``: init from a bf16 model (only worker 0's values count), then
    ``STEPS`` steps of real backward through ``step(out=the model's parameters)``."""
    model = bf16_model()
    if index != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    agg = ServerOptimizerAggregator(client, optimizer=SGDConfig(lr=LR, momentum=MOMENTUM),
                                    bigarray_bound=BOUND)
    params = list(model.parameters())
    assert await agg.init(params) == params
    pulled = [[p.detach().clone() for p in params]]
    pushed = []
    for step in range(STEPS):
        model.zero_grad()
        x, y = bf16_batch(index, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad for p in params]
        pushed.append([g.clone() for g in grads])  # type: ignore[union-attr]
        result = await agg.aggregate(grads)
        assert all(a is b for a, b in zip(result, params))  # written into the model
        pulled.append([p.detach().clone() for p in params])
    return {"pulled": pulled, "pushed": pushed}


def master_reference(pushed: list[list[list[torch.Tensor]]]) -> list[list[torch.Tensor]]:
    """What the servers must send: float32 master weights, float32 SGD with momentum on
    the float32 mean of the workers' bfloat16 gradients (worker order), rounded to
    bfloat16 by torch."""
    master = [p.detach().float().numpy().copy() for p in bf16_model().parameters()]
    buffers: list[np.ndarray | None] = [None] * len(master)
    expected = [[torch.from_numpy(m).bfloat16() for m in master]]
    for step in range(STEPS):
        for i, m in enumerate(master):
            grads = [worker[step][i].float().numpy() for worker in pushed]
            mean = grads[0].reshape(-1).copy()
            for g in grads[1:]:
                mean += g.reshape(-1)
            mean /= len(grads)
            buffers[i] = sgd_update(m.reshape(-1), mean, buffers[i], lr=LR, momentum=MOMENTUM,
                                    nesterov=False, weight_decay=0.0)
        expected.append([torch.from_numpy(m).bfloat16() for m in master])
    return expected


async def check_sharded_bfloat16(mode: str) -> None:
    """Two workers, two servers (dedicated, or inside the workers' ranks)."""
    transports = InProcessTransport.create_group(4 if mode == "dedicated" else 2,
                                                 timeout=TIMEOUT)
    servers: list[PSServer] = []
    try:
        if mode == "dedicated":
            servers = [PSServer(t, num_servers=2) for t in transports[:2]]

            async def worker(t: Any, index: int) -> Any:
                async with PSClient(t, num_servers=2) as client:
                    return await train_bf16(client, index)

            fns: list[Callable[[], Awaitable[Any]]] = [s.run for s in servers]
            fns += [lambda t=t, i=i: worker(t, i) for i, t in enumerate(transports[2:])]
            results = await run_ranks(fns)
            raise_any(results)
            results = results[2:]
        else:
            async def colocated(t: Any, index: int) -> Any:
                async with ColocatedPS(t, num_servers=2) as ps:
                    assert ps.server is not None
                    servers.append(ps.server)
                    return await train_bf16(ps, index)

            results = await run_ranks([lambda t=t, i=i: colocated(t, i)
                                       for i, t in enumerate(transports)])
            raise_any(results)
    finally:
        for t in transports:
            await t.aclose()
    expected = master_reference([r["pushed"] for r in results])
    for result in results:
        for got_step, want_step in zip(result["pulled"], expected, strict=True):
            for got, want in zip(got_step, want_step, strict=True):
                assert got.dtype == torch.bfloat16
                assert_bitwise(got, want)
    for server in servers:
        assert server.params is not None and server.master is not None
        assert server.params.dtype.itemsize == 2 and server.master.dtype == np.float32
        assert server.optimizer is not None
        assert server.optimizer.state["momentum_buffer"].dtype == np.float32
        assert server.version == STEPS
    # the updates are real: the last pull is not the first
    assert not torch.equal(bits(results[0]["pulled"][-1][0]), bits(results[0]["pulled"][0][0]))


@pytest.mark.parametrize("mode", ["dedicated", "colocated"])
async def test_sharded_bfloat16_keeps_a_float32_master(mode: str) -> None:
    await check_sharded_bfloat16(mode)


def test_server_shard_float32_is_the_plain_update() -> None:
    """float32 shards keep one buffer: master and wire are the same array."""
    initial = np.arange(6, dtype=np.float32)
    shard = ServerShard(SGDConfig(lr=0.5), initial)
    assert shard.master is shard.wire is initial and not shard.mixed
    shard.apply([np.ones(6, np.float32), np.full(6, 3.0, np.float32)], 2)
    np.testing.assert_array_equal(initial, np.arange(6, dtype=np.float32) - 1.0)


def test_bfloat16_plans_and_specs() -> None:
    spec = ParamSpec.from_wire(["w", [3, 4], "bfloat16"])
    plan = plan_shards([spec, ParamSpec("b", (4,), "bfloat16")], 2, bigarray_bound=10)
    assert plan.dtype == "bfloat16" and plan.is_sliced(0)
    with pytest.raises(TypeError, match="floating point, got int32"):
        plan_shards([ParamSpec("i", (4,), "int32")], 1)


async def test_gradients_of_another_dtype_than_bfloat16_are_refused() -> None:
    async def worker(client: PSClient, index: int) -> None:
        await client.init([torch.zeros(4, dtype=torch.bfloat16)],
                          optimizer=SGDConfig(lr=0.1))
        with pytest.raises(TypeError, match="'0' is float32, the parameter server holds "
                                            "bfloat16"):
            await client.push([torch.zeros(4)])
        with pytest.raises(TypeError, match="is float32, the parameter server holds bfloat16"):
            await client.pull(out=[torch.zeros(4)])

    transports = InProcessTransport.create_group(2, timeout=TIMEOUT)

    async def work() -> None:
        async with PSClient(transports[1], num_servers=1) as client:
            await worker(client, 0)

    try:
        raise_any(await run_ranks([PSServer(transports[0], num_servers=1).run, work]))
    finally:
        for t in transports:
            await t.aclose()


async def test_aggregator_init_writes_worker_zeros_values_into_every_worker() -> None:
    async def worker(index: int, t: Any) -> list[torch.Tensor]:
        async with ColocatedPS(t, num_servers=1) as ps:
            weight = torch.full((3, 2), float(index + 1)).t()  # non-contiguous: copied back
            bias = torch.full((2,), 10.0 * (index + 1))
            agg = ServerOptimizerAggregator(ps, optimizer=SGDConfig(lr=1.0), max_staleness=0)
            await agg.init([weight, bias])
            assert torch.equal(weight, torch.ones(2, 3))
            assert torch.equal(bias, torch.full((2,), 10.0))
            result = await agg.aggregate([torch.ones(2, 3), torch.full((2,), float(index))])
            assert result[0] is weight and result[1] is bias
            again = [torch.zeros(2, 3), torch.zeros(2)]
            await agg.init(again)  # registered already: a pull of the current values
            assert agg.out == again and all(torch.equal(a, b)
                                            for a, b in zip(again, [weight, bias]))
            return [weight.clone(), bias.clone()]

    results = await on_ranks(2, worker)
    for weight, bias in results:
        assert torch.equal(weight, torch.zeros(2, 3))
        assert torch.equal(bias, torch.full((2,), 9.5))


async def test_aggregator_without_optimizer_needs_an_initialised_client() -> None:
    async def worker(index: int, t: Any) -> None:
        async with ColocatedPS(t, num_servers=1) as ps:
            agg = ServerOptimizerAggregator(ps)
            with pytest.raises(ParameterServerError, match=r"pull\(\) needs a PSClient after"):
                await agg.init([torch.zeros(2)])
            await ps.init([torch.full((2,), 4.0)], optimizer=SGDConfig(lr=1.0))
            target = torch.zeros(2)
            await agg.init([target])  # a pull of the servers' values
            assert torch.equal(target, torch.full((2,), 4.0)) and agg.out == [target]

    await on_ranks(1, worker)


# ------------------------------------------------------------- without ml_dtypes

NO_ML_DTYPES = textwrap.dedent('''
    import sys
    sys.modules["ml_dtypes"] = None
    import asyncio
    from netdist.types import BFLOAT16, BFLOAT16_RAW
    from tests.ps import test_torch_ps as t

    assert BFLOAT16 is BFLOAT16_RAW
    asyncio.run(t.check_sync_bfloat16(3))
    asyncio.run(t.check_sharded_bfloat16("dedicated"))
    asyncio.run(t.check_sharded_bfloat16("colocated"))
    print("ok")
''')


@pytest.mark.slow
def test_bfloat16_without_ml_dtypes() -> None:
    done = subprocess.run([sys.executable, "-c", NO_ML_DTYPES], cwd=REPO, capture_output=True,
                          text=True, timeout=90.0, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr

