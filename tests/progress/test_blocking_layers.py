"""Every layer above the collectives, driven from synchronous code through the blocking API.

Aggregators, the parameter server, FSDP and collective checkpoints run on each rank's
progress thread through ``Job.make`` / ``Job.blocking`` and must give what the asyncio
API gives (bitwise where the asyncio API is bitwise), over real TCP on loopback.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

import netdist.checkpoint as checkpoint
from netdist.collectives import Group
from netdist.parallel import AllReduceAggregator, TopKAggregator
from netdist.parallel.fsdp import FSDP, ShardingStrategy
from netdist.progress import Job
from netdist.ps import ColocatedPS, SGDConfig
from netdist.train import SGD, mlp, softmax_cross_entropy

from tests.progress.jobs import JOIN_SECONDS, jobs_of, progress_threads
from tests.ranks import on_every_rank, run_ranks


def gradients(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(s).astype(np.float32) for s in (3, 1000, 50_000, 7)]


def test_aggregators_through_the_blocking_api_equal_the_asyncio_api() -> None:
    async def reference(group: Group) -> list[list[bytes]]:
        out = []
        for cls in (AllReduceAggregator, TopKAggregator):
            agg = cls(group)
            for _ in range(2):
                out.append([g.tobytes() for g in await agg.aggregate(gradients(group.rank))])
        return out

    def blocking(job: Job) -> list[list[bytes]]:
        out = []
        for cls in (AllReduceAggregator, TopKAggregator):
            agg = job.make(cls, job.group)
            for _ in range(2):
                out.append([g.tobytes() for g in agg.aggregate(gradients(job.rank))])
        return out

    expected = asyncio.run(run_ranks(3, reference, tcp=True, op_timeout=30.0, guard=JOIN_SECONDS))
    with jobs_of(3) as jobs:
        assert on_every_rank(jobs, blocking) == expected
    assert progress_threads() == []


def test_the_parameter_server_through_the_blocking_api() -> None:
    def worker(job: Job) -> tuple[list[float], bool]:
        with job.make(ColocatedPS, job.group, num_servers=1) as ps:
            w, = ps.init({"w": np.zeros(3)}, optimizer=SGDConfig(lr=0.5), max_staleness=0)
            target = 1.0 if job.rank == 0 else 3.0
            for _ in range(3):  # gradient of |w - target|^2 / 2; the mean is w - 2
                w, = ps.step([w - target])
            return w.tolist(), ps.is_server

    with jobs_of(2) as jobs:
        results = on_every_rank(jobs, worker)
    assert results == [([1.75] * 3, True), ([1.75] * 3, False)]
    assert progress_threads() == []


def fsdp_batches(rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
    data = np.random.default_rng(1)
    batches = []
    for _ in range(3):
        x, y = data.normal(size=(16, 20)), data.integers(0, 5, size=16)
        mine = slice(8 * rank, 8 * rank + 8)
        batches.append((x[mine], y[mine]))
    return batches


def test_fsdp_through_the_blocking_api_equals_the_asyncio_api_bitwise() -> None:
    def model_and_optimizer() -> tuple[Any, Any]:
        model = mlp([20, 64, 64, 5], rng=np.random.default_rng(0))
        return model, SGD(model.parameters(), lr=0.1, momentum=0.9)

    async def reference(group: Group) -> dict[str, bytes]:
        model, opt = model_and_optimizer()
        async with FSDP(model, group, ShardingStrategy.FULL_SHARD, optimizer=opt) as fsdp:
            for x, y in fsdp_batches(group.rank):
                fsdp.zero_grad()
                logits = await fsdp.forward(x)
                await fsdp.backward(softmax_cross_entropy(logits, y)[1])
                await fsdp.step()
            full = await fsdp.full_state_dict(rank0_only=False)
        return {k: v.tobytes() for k, v in full.items()}

    def blocking(job: Job) -> dict[str, bytes]:
        model, opt = model_and_optimizer()
        with job.make(FSDP, model, job.group, ShardingStrategy.FULL_SHARD, optimizer=opt) as fsdp:
            for x, y in fsdp_batches(job.rank):
                fsdp.zero_grad()
                logits = fsdp.forward(x)
                fsdp.backward(softmax_cross_entropy(logits, y)[1])
                fsdp.step()
            full = fsdp.full_state_dict(rank0_only=False)
        return {k: v.tobytes() for k, v in full.items()}

    expected = asyncio.run(run_ranks(2, reference, tcp=True, op_timeout=30.0, guard=JOIN_SECONDS))
    with jobs_of(2) as jobs:
        assert on_every_rank(jobs, blocking) == expected
    assert progress_threads() == []


def test_collective_checkpoints_save_and_load_through_the_blocking_api(tmp_path: Path) -> None:
    def body(job: Job) -> tuple[str, bytes, int]:
        ckpt = job.blocking(checkpoint)
        state = {"weights": np.arange(10, dtype=np.float32), "step": 7}
        result = ckpt.save(state, tmp_path, job.group, step=7)
        loaded = ckpt.load(tmp_path, job.group)
        return str(result.path), loaded["weights"].tobytes(), loaded["step"]

    with jobs_of(2) as jobs:
        results = on_every_rank(jobs, body)
    expected = np.arange(10, dtype=np.float32).tobytes()
    assert [r[1:] for r in results] == [(expected, 7), (expected, 7)]
    saved = Path(results[0][0])
    assert saved.parent == tmp_path and saved.name.startswith("step_") and saved.name.endswith("7")
    assert (saved / "metadata.json").is_file()
    assert progress_threads() == []
