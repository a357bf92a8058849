"""Parallelisms composed on one device mesh train exactly like one process (issue 30, item 3).

A small MLP (column, tanh, row, tanh, column, tanh, row) is trained for 20 steps of SGD
in float64, once in a single process on the full batch, and once on a mesh over real TCP
(``local_tcp_group``): tensor parallelism along ``tp`` (``netdist.parallel.tensor_parallel``),
data parallelism along ``dp`` (the all-reduce aggregator, FSDP, or the synchronous
parameter server) and, on 8 ranks, the pipeline along ``pp``. Every rank's parameter
shard must equal the matching slice of the single-process weights to 1e-12 (relative).

The ranks run in one process, each on the event loop with its layers computing in worker
threads, as FSDP and the pipeline run them: the tensor-parallel collectives are submitted
from there to the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from netdist.collectives import DeviceMesh, Group
from netdist.optim import SGDConfig
from netdist.parallel import AllReduceAggregator
from netdist.parallel.fsdp import FSDP, ShardingStrategy
from netdist.parallel.pipeline import PipelineParallel
from netdist.parallel.sharded_optim import ShardedSGD
from netdist.parallel.stages import PipelineParallelConfig
from netdist.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from netdist.ps import ColocatedPS
from netdist.sharding import Replicate, Shard, chunk_bounds
from netdist.train import SGD, Linear, Sequential, Tanh, mse_loss
from tests.ranks import run_ranks as run_tcp_ranks

pytestmark = pytest.mark.timeout(240)

SIZES = (6, 8, 5, 8, 3)
BATCH = 8
STEPS = 20
LR = 0.1
TOLERANCE = {np.float64: (1e-12, 1e-14), np.float32: (1e-6, 1e-7)}
"""(rtol, atol) by dtype: splitting a matmul's sum over ranks changes its rounding, so
float32 cannot be bitwise; after 20 steps it stays within 1e-6."""


def full_model(dtype: Any = np.float64) -> Sequential:
    rng = np.random.default_rng(7)
    layers: list[Any] = []
    for i, (fan_in, fan_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(Linear(fan_in, fan_out, rng=rng, dtype=dtype))
        if i < len(SIZES) - 2:
            layers.append(Tanh())
    return Sequential(*layers)


def batches(dtype: Any = np.float64) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    return [(rng.normal(size=(BATCH, SIZES[0])).astype(dtype),
             rng.normal(size=(BATCH, SIZES[-1])).astype(dtype)) for _ in range(STEPS)]


def reference(dtype: Any = np.float64) -> Sequential:
    """The single-process run: full model, full batch, plain SGD."""
    model = full_model(dtype)
    optimizer = SGD(model.parameters(), lr=LR)
    for x, y in batches(dtype):
        model.zero_grad()
        out, ctx = model.forward(x)
        _, grad = mse_loss(out, y)
        model.backward(ctx, grad)
        optimizer.step()
    return model


def tensor_parallel(model: Sequential, tp: Group) -> Sequential:
    """Every linear layer of ``model`` split over ``tp``: column, row, column, row."""
    layers: list[Any] = []
    column = True
    for layer in model.layers:
        if isinstance(layer, Linear):
            split = ColumnParallelLinear if column else RowParallelLinear
            layers.append(split.from_linear(layer, tp))
            column = not column
        else:
            layers.append(layer)
    return Sequential(*layers)


def expected_shard(full: np.ndarray, placement: Any, tp_rank: int, tp_size: int) -> np.ndarray:
    if isinstance(placement, Replicate):
        return full
    assert isinstance(placement, Shard)
    start, stop = chunk_bounds(full.shape[placement.dim], tp_size)[tp_rank]
    return np.take(full, range(start, stop), axis=placement.dim)


def assert_matches_reference(layers: list[Any], first_layer: int, ref: Sequential,
                             tp_rank: int, tp_size: int,
                             values: dict[str, np.ndarray] | None = None) -> int:
    """Each TP layer's parameters equal the matching slices of the reference's; returns
    how many arrays were compared. ``values`` overrides ``param.data`` by qualified name."""
    compared = 0
    for offset, layer in enumerate(layers):
        placements = getattr(layer, "tp_placements", None)
        if placements is None:
            continue
        full_layer = ref.layers[first_layer + offset]
        for name, param in layer.named_parameters():
            got = param.data if values is None else values[f"{offset}.{name}"]
            want = expected_shard(getattr(full_layer, name).data, placements[name],
                                  tp_rank, tp_size)
            rtol, atol = TOLERANCE[want.dtype.type]
            assert got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                                       err_msg=f"layer {first_layer + offset} {name}")
            compared += 1
    return compared


async def run_ranks(n: int, body: Callable[[Group], Awaitable[Any]]) -> list[Any]:
    """``tests.ranks.run_ranks`` over TCP, with a worker thread for every rank's compute
    (each may wait in its thread on a tensor-parallel collective)."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2 * n))
    return await run_tcp_ranks(n, body, tcp=True, op_timeout=60.0, guard=180.0)


def dp_slice(x: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    start, stop = chunk_bounds(x.shape[0], dp_size)[dp_rank]
    return x[start:stop]


async def local_gradients(model: Sequential, x: np.ndarray, y: np.ndarray) -> None:
    """Forward and backward in a worker thread (the TP collectives leave from there)."""
    def compute() -> None:
        model.zero_grad()
        out, ctx = model.forward(x)
        _, grad = mse_loss(out, y)
        model.backward(ctx, grad)
    await asyncio.to_thread(compute)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
async def test_dp_allreduce_by_tp_matches_one_process(dtype: Any) -> None:
    ref = reference(dtype)

    async def rank(world: Group) -> int:
        mesh = await DeviceMesh.create(world, {"dp": 2, "tp": 2})
        tp, dp = mesh.group("tp"), mesh.group("dp")
        model = tensor_parallel(full_model(dtype), tp)
        optimizer = SGD(model.parameters(), lr=LR)
        aggregator = AllReduceAggregator(dp)
        for x, y in batches(dtype):
            await local_gradients(model, dp_slice(x, dp.rank, 2), dp_slice(y, dp.rank, 2))
            await aggregator.aggregate([p.grad for p in model.parameters()])
            optimizer.step()
        return assert_matches_reference(model.layers, 0, ref, tp.rank, 2)

    assert await run_ranks(4, rank) == [8] * 4  # 4 linear layers, weight and bias


async def test_fsdp_by_tp_matches_one_process() -> None:
    ref = reference()

    async def rank(world: Group) -> int:
        mesh = await world.new_mesh({"dp": 2, "tp": 2})
        tp, dp = mesh.group("tp"), mesh.group("dp")
        model = tensor_parallel(full_model(), tp)
        layers = list(model.layers)
        async with FSDP(model, dp, ShardingStrategy.FULL_SHARD,
                        optimizer=ShardedSGD(lr=LR)) as fsdp:
            for x, y in batches():
                fsdp.zero_grad()
                out = await fsdp.forward(dp_slice(x, dp.rank, 2))
                _, grad = mse_loss(out, dp_slice(y, dp.rank, 2))
                await fsdp.backward(grad)
                await fsdp.step()
            values = await fsdp.full_state_dict(rank0_only=False)
        return assert_matches_reference(layers, 0, ref, tp.rank, 2, values)

    assert await run_ranks(4, rank) == [8] * 4


async def test_sync_parameter_server_by_tp_matches_one_process() -> None:
    ref = reference()

    async def rank(world: Group) -> int:
        mesh = await world.new_mesh({"dp": 2, "tp": 2})
        tp, dp = mesh.group("tp"), mesh.group("dp")
        model = tensor_parallel(full_model(), tp)
        params = model.parameters()
        async with ColocatedPS(dp, num_servers=2) as ps:
            await ps.init([p.data for p in params], optimizer=SGDConfig(lr=LR),
                          max_staleness=0)
            for x, y in batches():
                await local_gradients(model, dp_slice(x, dp.rank, 2), dp_slice(y, dp.rank, 2))
                await ps.step([p.grad for p in params], out=[p.data for p in params])
        return assert_matches_reference(model.layers, 0, ref, tp.rank, 2)

    assert await run_ranks(4, rank) == [8] * 4


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
async def test_pipeline_by_dp_by_tp_matches_one_process(dtype: Any) -> None:
    ref = reference(dtype)
    config = PipelineParallelConfig(num_stages=2, num_micro_batches=2, schedule="1f1b",
                                    data_parallel_size=2)
    cut = 4  # stage 0: linear, tanh, linear, tanh; stage 1: linear, tanh, linear

    async def rank(world: Group) -> int:
        mesh = await world.new_mesh({"pp": 2, "dp": 2, "tp": 2})
        tp = mesh.group("tp")
        stage = mesh.local_rank("pp")
        model = tensor_parallel(full_model(dtype), tp)
        layers = model.layers[:cut] if stage == 0 else model.layers[cut:]
        params = [p for layer in layers for p in layer.parameters()]
        # the pipeline's group: (dp, pp) row-major, so group rank = replica * stages + stage
        pipe = PipelineParallel(world.transport, layers, config, loss_fn=mse_loss,
                                optimizer=SGD(params, lr=LR), group=mesh.group(("dp", "pp")),
                                offload_compute=True)
        replica = mesh.local_rank("dp")
        for x, y in batches(dtype):
            await pipe.train_step(dp_slice(x, replica, 2), dp_slice(y, replica, 2))
        return assert_matches_reference(layers, 0 if stage == 0 else cut, ref, tp.rank, 2)

    assert await run_ranks(8, rank) == [4] * 8  # two linear layers (weight and bias) per stage
