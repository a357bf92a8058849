"""Subsystem spans (issue 33): a traced run of each subsystem writes its spans, with the
category, name and arguments ``docs``' trace format gives them.

Each test traces a small real run (in-process transports where that subsystem's own tests
use them; real TCP for the elastic job, which makes its transports itself) with
``Recorder.start_trace``, lets the transports write their files at close, and reads the
``"ph": "X"`` events of the subsystem's category back from ``rank_NNNNN.trace.json``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdist.checkpoint import save
from netdist.collectives import Group
from netdist.parallel.fsdp import FSDP, ShardingStrategy
from netdist.parallel.pipeline import PipelineParallel
from netdist.parallel.schedule import gpipe_schedule
from netdist.parallel.stages import PipelineParallelConfig, split_into_stages
from netdist.ps import ParameterServer, PSClient, PSServer, SGDConfig
from netdist.trace.tracer import SPAN_TIDS, trace_file_name
from netdist.train.losses import softmax_cross_entropy
from netdist.train.nn import mlp
from netdist.train.optimizers import SGD
from netdist.transport import InProcessTransport, Transport
from tests.ranks import gather_ranks

OP = 10.0


def start_tracing(transports: Sequence[Transport], directory: Path) -> None:
    for transport in transports:
        transport.recorder.start_trace(directory)


async def finish(transports: Sequence[Transport], directory: Path,
                 cat: str) -> dict[int, list[dict[str, Any]]]:
    """Close the transports (which writes their traces); per rank, its spans of ``cat``,
    in start order."""
    for transport in transports:
        await transport.aclose()
    found = {}
    for transport in transports:
        data = json.loads((directory / trace_file_name(transport.rank)).read_text())
        events = [e for e in data["traceEvents"] if e.get("cat") == cat]
        for event in events:
            assert event["ph"] == "X" and event["pid"] == transport.rank
            assert event["tid"] == SPAN_TIDS[cat] and event["dur"] >= 0
        found[transport.rank] = sorted(events, key=lambda e: e["ts"])
    return found


def names_and_args(spans: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(span["name"], span["args"]) for span in spans]


# -- parameter servers -------------------------------------------------------------------

async def test_sharded_ps_pushes_pulls_and_serves(tmp_path: Path) -> None:
    transports = InProcessTransport.create_group(3, timeout=OP)  # 1 server, 2 workers
    start_tracing(transports, tmp_path)
    params = [np.arange(12, dtype=np.float64).reshape(3, 4), np.ones(5)]
    model_bytes = sum(p.nbytes for p in params)

    async def worker(transport: Transport) -> None:
        async with PSClient(transport, num_servers=1) as client:
            await client.init(params, optimizer=SGDConfig(lr=0.1))     # pull, seq 1
            await client.push([np.ones_like(p) for p in params])       # seq 2
            await client.pull()                                        # seq 3
            await client.step([np.ones_like(p) for p in params])       # seq 4

    await gather_ranks([PSServer(transports[0], num_servers=1).run,
                        lambda: worker(transports[1]), lambda: worker(transports[2])],
                       guard=30.0)
    spans = await finish(transports, tmp_path, "ps")
    for rank in (1, 2):
        assert names_and_args(spans[rank]) == [
            (name, {"step": seq, "bytes": model_bytes, "servers": 1})
            for name, seq in (("pull", 1), ("push", 2), ("pull", 3), ("step", 4))]
    served = spans[0]
    for worker_rank in (1, 2):
        mine = [(s["name"], s["args"]["step"]) for s in served
                if s["args"].get("worker") == worker_rank]
        assert sorted(mine) == sorted([("serve_pull", 1), ("serve_push", 2),
                                       ("serve_pull", 3), ("serve_push", 4),
                                       ("serve_pull", 4)])
        assert all(s["args"]["shard"] == 0 and s["args"]["bytes"] == model_bytes
                   for s in served if s["args"].get("worker") == worker_rank)
    applied = [s["args"] for s in served if s["name"] == "apply"]
    assert [a["version"] for a in applied] == [0, 1]  # two synchronous updates
    assert all(a["workers"] == 2 and a["shard"] == 0 for a in applied)


async def test_synchronous_ps_rounds(tmp_path: Path) -> None:
    transports = InProcessTransport.create_group(2, timeout=OP)
    start_tracing(transports, tmp_path)
    params = [np.zeros(6, np.float32)]

    async def rank(transport: Transport) -> None:
        ps = ParameterServer(transport)
        await ps.broadcast_params(params if transport.rank else [np.arange(6, dtype=np.float32)])
        await ps.reduce_gradients([np.ones(10, np.float64)])

    await gather_ranks([lambda t=t: rank(t) for t in transports], guard=30.0)
    spans = await finish(transports, tmp_path, "ps")
    for r, role in ((0, "server"), (1, "worker")):
        assert names_and_args(spans[r]) == [
            ("broadcast_params", {"role": role, "bytes": 24}),
            ("reduce_gradients", {"role": role, "bytes": 80})]


# -- FSDP --------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
async def test_fsdp_gathers_and_reductions(tmp_path: Path, strategy: str) -> None:
    transports = InProcessTransport.create_group(2, timeout=OP)
    start_tracing(transports, tmp_path)
    sizes = [5, 8, 3]  # Linear(5, 8): 48 params, ReLU, Linear(8, 3): 27 params

    async def rank(transport: Transport) -> None:
        group = Group(transport, timeout=OP)
        model = mlp(sizes, rng=np.random.default_rng(3), dtype=np.float64)
        fsdp = FSDP(model, group, strategy, optimizer=SGD(model.parameters(), lr=0.1),
                    compute_in_thread=False)
        x = np.random.default_rng(transport.rank).standard_normal((4, sizes[0]))
        logits = await fsdp.forward(x)
        _, grad = softmax_cross_entropy(logits, np.array([0, 1, 2, 0]))
        await fsdp.backward(grad)
        await fsdp.step()
        await fsdp.aclose()
        await group.aclose()

    await gather_ranks([lambda t=t: rank(t) for t in transports], guard=30.0)
    spans = await finish(transports, tmp_path, "fsdp")
    assert spans[0] and [s["name"] for s in spans[0]] == [s["name"] for s in spans[1]]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for span in spans[0]:
        by_name.setdefault(span["name"], []).append(span["args"])
    # two units: layers 0..1 (Linear, ReLU) with 48 params, layer 2 with 27 (padded to 28)
    unit_bytes = {0: 48 * 8, 1: 28 * 8}
    if strategy == "full_shard":
        assert set(by_name) == {"all_gather", "reduce_scatter"}
        # forward waits for units 0, 1; backward for unit 1 (kept from the forward) and
        # unit 0 (gathered again)
        assert [(a["unit"], a["layers"], a["bytes"]) for a in by_name["all_gather"]] == [
            (0, "0..1", unit_bytes[0]), (1, "2..2", unit_bytes[1]),
            (1, "2..2", unit_bytes[1]), (0, "0..1", unit_bytes[0])]
        assert [(a["unit"], a["bytes"]) for a in by_name["reduce_scatter"]] == [
            (1, unit_bytes[1]), (0, unit_bytes[0])]
    elif strategy == "shard_grad_op":
        assert set(by_name) == {"reduce_scatter", "all_gather"}
        assert [a["unit"] for a in by_name["reduce_scatter"]] == [1, 0]
        assert by_name["all_gather"] == [
            {"phase": "step", "units": 2, "bytes": unit_bytes[0] + unit_bytes[1]}]
    else:
        assert set(by_name) == {"all_reduce"}
        assert [(a["unit"], a["bytes"]) for a in by_name["all_reduce"]] == [
            (1, 27 * 8), (0, 48 * 8)]


# -- pipeline ----------------------------------------------------------------------------

async def test_pipeline_stage_actions(tmp_path: Path) -> None:
    sizes = [4, 6, 3]  # Linear, ReLU, Linear: stage 0 = layers 0..1, stage 1 = layer 2
    config = PipelineParallelConfig(2, num_micro_batches=2, schedule="gpipe")
    transports = InProcessTransport.create_group(2, timeout=OP)
    start_tracing(transports, tmp_path)
    stages = split_into_stages(3, 2)
    x = np.random.default_rng(0).standard_normal((4, sizes[0]))
    y = np.array([0, 1, 2, 0])

    async def rank(transport: Transport) -> None:
        model = mlp(sizes, rng=np.random.default_rng(1), dtype=np.float64)
        stage = stages[config.stage_of(transport.rank)]
        pipe = PipelineParallel(transport, stage.select(model.layers), config,
                                loss_fn=softmax_cross_entropy,
                                optimizer_factory=lambda p: SGD(p, lr=0.1), timeout=OP)
        first = transport.rank == 0
        await pipe.train_step(x if first else None, None if first else y)

    await gather_ranks([lambda t=t: rank(t) for t in transports], guard=30.0)
    spans = await finish(transports, tmp_path, "pipeline")
    activation = 2 * 6 * 8  # two rows of six float64 per micro-batch
    schedule = gpipe_schedule(2, 2)
    for r in (0, 1):  # one span per action but sends (background: the p2p track has them)
        assert [(s["name"], s["args"]["micro_batch"]) for s in spans[r]] == [
            (a.kind.value, a.micro_batch) for a in schedule[r]
            if not a.kind.value.startswith("send")]
        assert all(s["args"]["step"] == 0 and s["args"]["stage"] == r for s in spans[r])
    for span in spans[0]:
        args = span["args"]
        if span["name"] == "forward":  # the activation it sends on
            assert args["bytes"] == activation
        elif span["name"] == "recv_grad":
            assert (args["peer"], args["bytes"]) == (1, activation)
        else:
            assert set(args) == {"step", "stage", "micro_batch"}
    received = [s["args"] for s in spans[1] if s["name"] == "recv_activation"]
    assert [(a["peer"], a["bytes"]) for a in received] == [(0, activation)] * 2


# -- checkpoint --------------------------------------------------------------------------

async def test_checkpoint_save_stages(tmp_path: Path) -> None:
    transports = InProcessTransport.create_group(2, timeout=OP)
    trace_dir = tmp_path / "trace"
    start_tracing(transports, trace_dir)

    async def rank(transport: Transport) -> Any:
        group = Group(transport, timeout=OP)
        try:
            return await save({"w": np.arange(10, dtype=np.float32)}, tmp_path / "ckpt",
                              group, step=7)
        finally:
            await group.aclose()

    results = await gather_ranks([lambda t=t: rank(t) for t in transports], guard=30.0)
    spans = await finish(transports, trace_dir, "checkpoint")
    for r in (0, 1):
        names = [s["name"] for s in spans[r]]
        expected = ["stage", "plan", "write", "fsync"] + (["commit"] if r == 0 else [])
        assert names == expected, (r, names)
        args = {s["name"]: s["args"] for s in spans[r]}
        assert args["stage"] == {"step": 7, "tensors": 1}
        assert args["plan"] == {"step": 7, "tensors": 1}
        file = results[r].file.name
        assert args["write"] == {"step": 7, "file": file, "bytes": results[r].nbytes}
        assert args["fsync"] == {"step": 7, "file": file}
        write, fsync = spans[r][2], spans[r][3]
        assert write["ts"] <= fsync["ts"] and \
            fsync["ts"] + fsync["dur"] <= write["ts"] + write["dur"] + 1.0
    assert spans[0][4]["args"] == {"step": 7, "files": 2}


async def test_checkpoint_group_without_a_transport_is_not_traced(tmp_path: Path) -> None:
    class Bare:
        """A GroupLike with no transport (a test double, another framework's group)."""

        def __init__(self, group: Group) -> None:
            self._group = group
            self.rank, self.world_size = group.rank, group.world_size

        async def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> Any:
            return await self._group.all_gather_object(obj, timeout=timeout)

        async def broadcast_object(self, obj: Any, src: int, *,
                                   timeout: float | None = None) -> Any:
            return await self._group.broadcast_object(obj, src, timeout=timeout)

    transports = InProcessTransport.create_group(2, timeout=OP)
    start_tracing(transports, tmp_path / "trace")

    async def rank(transport: Transport) -> Any:
        group = Group(transport, timeout=OP)
        try:
            return await save({"w": np.ones(3)}, tmp_path / "ckpt", Bare(group), step=1)
        finally:
            await group.aclose()

    results = await gather_ranks([lambda t=t: rank(t) for t in transports], guard=30.0)
    assert results[0].committed
    spans = await finish(transports, tmp_path / "trace", "checkpoint")
    assert spans == {0: [], 1: []}


# -- elastic -----------------------------------------------------------------------------

async def test_elastic_epochs_and_commits(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from netdist.elastic import ElasticJob, ElasticState, StepContext
    from tests.elastic.test_elastic_asyncio import configs

    # every transport an epoch makes traces from the start (its recorder reads the
    # environment), and writes its file when the job closes it
    monkeypatch.setenv("NETDIST_TRACE", str(tmp_path))
    weights = [np.zeros(4), np.zeros(4)]
    jobs = await asyncio.wait_for(asyncio.gather(*(
        ElasticJob.start(cfg, ElasticState({"w": w}))
        for cfg, w in zip(configs(2), weights))), 60)
    try:
        async def train(job: ElasticJob, w: np.ndarray) -> None:
            async def step(ctx: StepContext) -> None:
                total = await ctx.all_reduce(np.ones(4))
                ctx.on_commit(lambda: w.__iadd__(total))

            while job.step < 2:
                await job.run_step(step)

        await asyncio.wait_for(asyncio.gather(*(train(j, w) for j, w in zip(jobs, weights))),
                               60)
        epoch = jobs[0].epoch
    finally:
        await asyncio.gather(*(job.aclose() for job in jobs), return_exceptions=True)
    assert all(np.array_equal(w, np.full(4, 4.0)) for w in weights)
    for rank in (0, 1):
        data = json.loads((tmp_path / trace_file_name(rank)).read_text())
        spans = [(e["name"], e["args"]) for e in data["traceEvents"]
                 if e.get("cat") == "elastic"]
        assert spans[0][0] == "epoch"
        assert spans[0][1]["epoch"] == epoch and spans[0][1]["world_size"] == 2
        assert spans[0][1]["rank"] == rank and spans[0][1]["step"] == 0
        assert spans[1:] == [("commit", {"step": s, "epoch": epoch, "world_size": 2})
                             for s in (0, 1)]
