"""A model trained on a DP=2 x TP=2 mesh is checkpointed with its placements and loaded
onto other meshes and into one process, byte-exact (issue 30, items 3 and 4 together).

Real TCP ranks (``local_tcp_group``), real files. The saved checkpoint holds each byte of
the model once; loading at TP=4 and into a single process gives exactly the bytes the
DP=2 x TP=2 ranks held.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdist.checkpoint import load, load_metadata, save
from netdist.collectives import Group
from netdist.parallel import AllReduceAggregator
from netdist.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from netdist.sharding import Replicate, Shard, chunk_bounds
from netdist.train import SGD, Sequential, Tanh, mlp, mse_loss
from netdist.train.mesh_state import placed_state_dict
from tests.ranks import run_ranks

pytestmark = pytest.mark.timeout(240)

SIZES = [6, 10, 4]


def full_model(seed: int) -> Sequential:
    return mlp(SIZES, rng=np.random.default_rng(seed), activation=Tanh)


def split(model: Sequential, tp: Group) -> Sequential:
    return Sequential(ColumnParallelLinear.from_linear(model[0], tp), Tanh(),
                      RowParallelLinear.from_linear(model[2], tp))


async def ranks(n: int, body: Any) -> list[Any]:
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2 * n))
    return await run_ranks(n, body, tcp=True, op_timeout=60.0, guard=180.0)


def assemble(pieces: list[dict[str, np.ndarray]], tp_ranks: list[int]) -> dict[str, np.ndarray]:
    """Full tensors from the shards of one replica (``pieces[i]`` held by tp rank
    ``tp_ranks[i]``)."""
    order = [pieces[tp_ranks.index(t)] for t in range(len(tp_ranks))]
    return {"0.weight": np.concatenate([p["0.weight"] for p in order]),
            "0.bias": np.concatenate([p["0.bias"] for p in order]),
            "2.weight": np.concatenate([p["2.weight"] for p in order], axis=1),
            "2.bias": order[0]["2.bias"]}


async def test_trained_on_dp2_tp2_loads_at_tp4_and_in_one_process(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"

    async def train_and_save(world: Group) -> tuple[int, int, dict[str, np.ndarray]]:
        mesh = await world.new_mesh({"dp": 2, "tp": 2})
        tp, dp = mesh.group("tp"), mesh.group("dp")
        model = split(full_model(0), tp)
        optimizer, aggregator = SGD(model.parameters(), lr=0.1), AllReduceAggregator(dp)
        data = np.random.default_rng(5)
        for _ in range(5):
            x, y = data.normal(size=(8, SIZES[0])), data.normal(size=(8, SIZES[-1]))
            rows = slice(4 * dp.rank, 4 * dp.rank + 4)

            def compute() -> None:
                model.zero_grad()
                out, ctx = model.forward(x[rows])
                model.backward(ctx, mse_loss(out, y[rows])[1])
            await asyncio.to_thread(compute)
            await aggregator.aggregate([p.grad for p in model.parameters()])
            optimizer.step()
        state = placed_state_dict(model, mesh)
        assert state["0.weight"].placements == (Replicate(), Shard(0))
        assert state["2.weight"].placements == (Replicate(), Shard(1))
        assert state["2.bias"].placements == (Replicate(), Replicate())
        await save({"model": state}, root, world, step=5)
        return dp.rank, tp.rank, {k: v.data.copy() for k, v in state.items()}

    saved = await ranks(4, train_and_save)
    replicas = [[s for s in saved if s[0] == d] for d in range(2)]
    full = assemble([s[2] for s in replicas[0]], [s[1] for s in replicas[0]])
    for other in replicas[1]:  # the dp replicas hold the same bytes
        twin = next(s for s in replicas[0] if s[1] == other[1])
        assert all(np.array_equal(twin[2][k], other[2][k]) for k in full)

    # each byte of the model once on disk: the tensor bytes in the files are the model's
    metadata = load_metadata(root)
    assert metadata.mesh == {"shape": [2, 2], "names": ["dp", "tp"]}
    directory = root / "step_000005"
    tensor_bytes = 0
    for record in metadata.files:
        raw = (directory / record.name).read_bytes()
        header = int.from_bytes(raw[:8], "little")
        tensor_bytes += len(raw) - 8 - header
    assert tensor_bytes == sum(a.nbytes for a in full.values())

    async def load_at_tp4(world: Group) -> tuple[int, dict[str, np.ndarray]]:
        mesh = await world.new_mesh({"dp": 1, "tp": 4})
        model = split(full_model(99), mesh.group("tp"))  # other weights, overwritten
        await load(root, world, like={"model": placed_state_dict(model, mesh)})
        return mesh.local_rank("tp"), {n: p.data.copy() for n, p in model.named_parameters()}

    for tp_rank, params in await ranks(4, load_at_tp4):
        rows = slice(*chunk_bounds(SIZES[1], 4)[tp_rank])
        assert np.array_equal(params["0.weight"], full["0.weight"][rows])
        assert np.array_equal(params["0.bias"], full["0.bias"][rows])
        assert np.array_equal(params["2.weight"], full["2.weight"][:, rows])
        assert np.array_equal(params["2.bias"], full["2.bias"])

    async def load_in_one_process(world: Group) -> dict[str, np.ndarray]:
        model = full_model(99)
        await load(root, world, like={"model": {n: p.data for n, p in
                                                 model.named_parameters()}})
        return {n: p.data for n, p in model.named_parameters()}

    (single,) = await ranks(1, load_in_one_process)
    assert all(np.array_equal(single[k], full[k]) for k in full)
