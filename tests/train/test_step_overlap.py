"""distributed_train_step(overlap=True): backward in a worker thread, buckets on the wire
while it runs, results bitwise those of overlap=False; real TCP on loopback, through the
asyncio API (every rank on one loop) and the blocking API (every rank its own progress
thread). A rank lost mid-step fails the step on the survivors, and no thread stays."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

import netdist.train.step as step_module
from netdist.collectives import Group
from netdist.errors import CollectiveError, CollectiveMismatchError, PeerLostError
from netdist.parallel.aggregators import (
    AllReduceAggregator,
    Fp16AllReduceAggregator,
    LocalAggregator,
    TopKAggregator,
)
from netdist.progress import unwrap
from netdist.train.losses import softmax_cross_entropy
from netdist.train.nn import Parameter, Sequential, mlp
from netdist.train.optimizers import SGD
from netdist.train.step import distributed_train_step
from netdist.transport import local_tcp_group
from netdist.transport.inprocess import InProcessTransport

from tests.progress.jobs import JOIN_SECONDS, jobs_of, progress_threads
from tests.ranks import on_every_rank

BOUND = 60.0
SIZES = [12, 24, 16, 8, 5]
STEPS = 4
BUCKET_MB = 600 / 2**20  # a few hundred bytes: a bucket or two per layer


def backward_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "netdist-backward"]


def batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    return rng.standard_normal((16, SIZES[0])), rng.integers(0, SIZES[-1], 16)


class Trainer:
    """One rank's model, optimizer and aggregator, stepping with or without overlap."""

    def __init__(self, make_agg: Any, *, views: bool = False, seed: int = 7) -> None:
        self.model = mlp(SIZES, rng=np.random.default_rng(seed))
        self.params = self.model.parameters()
        self.opt = SGD(self.params, lr=0.1, momentum=0.9)
        self.agg = make_agg()
        if views:  # gradients stored in the buckets (DDP's gradient_as_bucket_view)
            target = unwrap(self.agg)
            for p, view in zip(self.params, target.bucket_views([p.grad for p in self.params])):
                p.grad = view
        self.compute_threads: set[str] = set()

    def compute(self, x: np.ndarray, y: np.ndarray, ready: Any = None) -> tuple[float, list]:
        self.compute_threads.add(threading.current_thread().name)
        self.model.zero_grad()
        logits, ctx = self.model.forward(x)
        loss, g = softmax_cross_entropy(logits, y)
        self.model.backward(ctx, g, on_grad_ready=ready)
        return loss, [p.grad for p in self.params]

    def apply(self, averaged: list[np.ndarray]) -> None:
        for p, a in zip(self.params, averaged):
            if a is not p.grad:
                np.copyto(p.grad, a)
        self.opt.step()

    async def step(self, rank: int, i: int, overlap: bool) -> float:
        x, y = batch(rank, i)
        if overlap:
            return await distributed_train_step(
                lambda ready: self.compute(x, y, ready), self.apply, unwrap(self.agg),
                overlap=True, params=self.params)
        return await distributed_train_step(lambda: self.compute(x, y), self.apply,
                                            unwrap(self.agg))

    def state(self) -> list[bytes]:
        return [p.data.tobytes() for p in self.params]


KINDS = {
    "allreduce": (AllReduceAggregator, False),
    "bucket-views": (AllReduceAggregator, True),
    "fp16": (Fp16AllReduceAggregator, False),
}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_overlap_equals_no_overlap_bitwise_over_tcp(n: int, kind: str) -> None:
    cls, views = KINDS[kind]

    async def rank_main(group: Group) -> list[list[bytes]]:
        rank = group.rank
        plain = Trainer(lambda: cls(group, bucket_mb=BUCKET_MB), views=views)
        overlapped = Trainer(lambda: cls(group, bucket_mb=BUCKET_MB), views=views)
        states = []
        for i in range(STEPS):
            loss_plain = await plain.step(rank, i, overlap=False)
            loss_overlap = await overlapped.step(rank, i, overlap=True)
            assert loss_plain == loss_overlap
            assert overlapped.state() == plain.state(), f"rank {rank} step {i}"
            states.append(overlapped.state())
        assert overlapped.compute_threads == {"netdist-backward"}
        assert overlapped.agg.bytes_sent == plain.agg.bytes_sent > 0
        assert len(overlapped.agg.buckets) >= 2  # float64: (6.*, 4.*), (2.*), (0.*)
        return states

    async with local_tcp_group(n) as transports:
        groups = [Group(t, timeout=30.0) for t in transports]
        async with asyncio.timeout(BOUND):
            per_rank = await asyncio.gather(*(rank_main(g) for g in groups))
    assert all(states == per_rank[0] for states in per_rank)  # ranks agree bitwise
    assert per_rank[0][-1] != Trainer(lambda: None).state()  # and the model moved
    assert backward_threads() == []


def test_overlap_through_the_blocking_api_on_progress_threads() -> None:
    """Each rank: its own progress thread (the loop) and a backward thread per step."""
    n = 2

    def rank_main(job: Any) -> list[list[bytes]]:
        step = job.blocking(step_module)  # distributed_train_step, run on the progress thread
        plain = Trainer(lambda: job.make(AllReduceAggregator, job.group, bucket_mb=BUCKET_MB))
        overlapped = Trainer(lambda: job.make(AllReduceAggregator, job.group,
                                              bucket_mb=BUCKET_MB))
        states = []
        for i in range(STEPS):
            x, y = batch(job.rank, i)
            step.distributed_train_step(lambda: plain.compute(x, y), plain.apply, plain.agg)
            step.distributed_train_step(lambda ready: overlapped.compute(x, y, ready),
                                        overlapped.apply, overlapped.agg, overlap=True,
                                        params=overlapped.params)
            assert overlapped.state() == plain.state()
            states.append(overlapped.state())
        assert overlapped.compute_threads == {"netdist-backward"}
        # without overlap compute runs where the loop runs: on the progress thread, or
        # on this thread while it drives the loop itself (netdist.progress.thread)
        assert plain.compute_threads <= {f"netdist-progress-rank{job.rank}",
                                         threading.current_thread().name}
        return states

    with jobs_of(n) as jobs:
        per_rank = on_every_rank(jobs, rank_main)
    assert per_rank[0] == per_rank[1]
    assert progress_threads() == [] and backward_threads() == []


class LaunchLog:
    """A Group stand-in that logs each all_reduce launch into a shared event list."""

    def __init__(self, group: Group, events: list[Any]) -> None:
        self.group = group
        self.world_size = group.world_size
        self.events = events
        self.first_launch = threading.Event()

    async def all_reduce(self, array: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        self.events.append(("launch", array.size))
        self.first_launch.set()
        return await self.group.all_reduce(array, *args, **kwargs)


async def test_buckets_are_launched_while_backward_still_runs() -> None:
    """Backward pauses after the last layer's gradients are final, until the first bucket
    has been launched; without overlap the launch would only come after backward, and
    the pause would end unlaunched (bounded wait, then the test fails)."""
    n = 2
    events: list[list[Any]] = [[] for _ in range(n)]
    paused: list[bool] = [False] * n

    async def rank_main(group: Group) -> None:
        rank = group.rank
        log = LaunchLog(group, events[rank])
        model = mlp(SIZES, rng=np.random.default_rng(3))
        params = model.parameters()
        agg = AllReduceAggregator(log, bucket_mb=1 / 2**20)  # one byte: a bucket each
        last = model[len(model) - 1]
        x, y = batch(rank, 0)

        def compute(ready: Any) -> tuple[float, list[np.ndarray]]:
            def hook(p: Parameter) -> None:
                events[rank].append(("ready", p.name))
                ready(p)
                if p is last.parameters()[0]:  # the last layer is done: bucket 0, 1 final
                    paused[rank] = log.first_launch.wait(BOUND / 3)

            logits, ctx = model.forward(x)
            loss, g = softmax_cross_entropy(logits, y)
            model.backward(ctx, g, on_grad_ready=hook)
            events[rank].append(("backward done",))
            return loss, [p.grad for p in params]

        await distributed_train_step(compute, lambda avg: None, agg, overlap=True,
                                     params=params)

    async with local_tcp_group(n) as transports:
        groups = [Group(t, timeout=30.0) for t in transports]
        async with asyncio.timeout(BOUND):
            await asyncio.gather(*(rank_main(g) for g in groups))
    assert paused == [True, True], "no bucket was launched while backward waited"
    names = [p.name for p in mlp(SIZES, rng=np.random.default_rng(3)).parameters()]
    for log in events:
        readies = [e[1] for e in log if e[0] == "ready"]
        assert readies == list(reversed(names))  # last layer first, bias before weight
        launches = [i for i, e in enumerate(log) if e[0] == "launch"]
        assert len(launches) == len(names)  # one bucket per parameter
        done = log.index(("backward done",))
        first_layer_weight = log.index(("ready", "0.weight"))
        assert launches[0] < first_layer_weight < done  # on the wire mid-backward
        # each bucket went out after its own gradient was final, in plan order
        sizes = [log[i][1] for i in launches]
        by_name = dict(zip(names, mlp(SIZES, rng=np.random.default_rng(3)).parameters()))
        assert sizes == [by_name[name].size for name in readies]
        for name, at in zip(readies, launches):
            assert log.index(("ready", name)) < at


async def test_lost_rank_mid_step_fails_the_survivors_and_leaves_no_thread() -> None:
    """Rank 2's backward dies in its first layer, two buckets launched; like a crashing
    process, it closes its transport (and so does each survivor after its step failed).
    Every survivor's step raises PeerLostError, only after its own backward thread has
    ended."""
    n = 3
    outcome: dict[int, BaseException] = {}
    backward_over: dict[int, bool] = {}

    async def rank_main(group: Group, transport: Any) -> None:
        rank = group.rank
        model = mlp(SIZES, rng=np.random.default_rng(3))
        params = model.parameters()
        agg = AllReduceAggregator(group, bucket_mb=BUCKET_MB)
        finished = threading.Event()
        x, y = batch(rank, 0)

        def compute(ready: Any) -> tuple[float, list[np.ndarray]]:
            try:
                def hook(p: Parameter) -> None:
                    ready(p)
                    if rank == 2 and p.name == "0.bias":  # buckets 0 and 1 went out
                        raise ValueError("rank 2: backward failed in layer 0")

                logits, ctx = model.forward(x)
                loss, g = softmax_cross_entropy(logits, y)
                model.backward(ctx, g, on_grad_ready=hook)
                return loss, [p.grad for p in params]
            finally:
                finished.set()

        try:
            await distributed_train_step(compute, lambda avg: None, agg, overlap=True,
                                         params=params)
        except BaseException as exc:  # noqa: BLE001 - recorded and checked below
            outcome[rank] = exc
            backward_over[rank] = finished.is_set()
            assert agg.begin([p.grad for p in params]) is not None  # the aggregator is free
            await transport.aclose()  # what a failed rank's process does on its way out

    async with local_tcp_group(n, timeout=30.0) as transports:
        groups = [Group(t, timeout=30.0) for t in transports]
        async with asyncio.timeout(BOUND):
            await asyncio.gather(*(rank_main(g, t) for g, t in zip(groups, transports)))
    assert isinstance(outcome[2], ValueError) and "layer 0" in str(outcome[2])
    for rank in (0, 1):
        assert isinstance(outcome[rank], PeerLostError), repr(outcome[rank])
        # the survivor that lost rank 2 closed too; whoever a survivor lost first, the
        # message names the collective and rank 2
        assert "all_reduce" in str(outcome[rank]) and "rank 2" in str(outcome[rank])
    assert backward_over == {0: True, 1: True, 2: True}
    assert backward_threads() == []


async def test_non_overlapping_aggregators_fall_back_after_backward() -> None:
    groups = [Group(t, timeout=20.0) for t in InProcessTransport.create_group(2, timeout=20.0)]

    async def rank_main(group: Group) -> list[list[bytes]]:
        plain = Trainer(lambda: TopKAggregator(group, ratio=0.5))
        overlapped = Trainer(lambda: TopKAggregator(group, ratio=0.5))
        for i in range(3):
            await plain.step(group.rank, i, overlap=False)
            await overlapped.step(group.rank, i, overlap=True)
            assert overlapped.state() == plain.state()
        assert overlapped.compute_threads == {"netdist-backward"}
        return [overlapped.state()]

    async with asyncio.timeout(BOUND):
        first, second = await asyncio.gather(*(rank_main(g) for g in groups))
    assert first == second
    local = Trainer(LocalAggregator)
    await local.step(0, 0, overlap=True)
    assert local.compute_threads == {"netdist-backward"}


async def test_async_compute_reports_from_the_loop() -> None:
    (group,) = [Group(t) for t in InProcessTransport.create_group(1)]
    trainer = Trainer(lambda: AllReduceAggregator(group))
    x, y = batch(0, 0)

    async def compute(ready: Any) -> tuple[float, list]:
        return trainer.compute(x, y, ready)

    loss = await distributed_train_step(compute, trainer.apply, trainer.agg, overlap=True,
                                        params=trainer.params)
    assert loss > 0 and trainer.compute_threads == {threading.current_thread().name}


async def test_overlap_misuse_is_refused_with_reasons() -> None:
    (group,) = [Group(t) for t in InProcessTransport.create_group(1)]
    trainer = Trainer(lambda: AllReduceAggregator(group))
    x, y = batch(0, 0)
    with pytest.raises(TypeError, match="needs params="):
        await distributed_train_step(lambda ready: trainer.compute(x, y, ready),
                                     trainer.apply, trainer.agg, overlap=True)
    stranger = Parameter("stranger", np.zeros(3))
    with pytest.raises(CollectiveError, match="'stranger', which is not one of the step's 8"):
        await distributed_train_step(lambda ready: ready(stranger), trainer.apply,
                                     trainer.agg, overlap=True, params=trainer.params)
    with pytest.raises(CollectiveError, match=r"ready\(8\): the step has 8 parameters"):
        await distributed_train_step(lambda ready: ready(8), trainer.apply,
                                     trainer.agg, overlap=True, params=trainer.params)
    with pytest.raises(TypeError, match=r"params\[0\] \(str\) has no ndarray gradient"):
        await distributed_train_step(lambda ready: (0.0, []), trainer.apply,
                                     trainer.agg, overlap=True, params=["w"])
    with pytest.raises(CollectiveMismatchError, match="finish\\(\\) got 1 gradients.* 8"):
        await distributed_train_step(lambda ready: (0.0, [np.zeros(1)]), trainer.apply,
                                     trainer.agg, overlap=True, params=trainer.params)
    with pytest.raises(TypeError, match=r"\(loss, grads\)"):
        await distributed_train_step(lambda ready: 1.0, trainer.apply,
                                     trainer.agg, overlap=True, params=trainer.params)
    # none of these left the aggregator busy, and arrays given as params work too
    grads = [p.grad for p in trainer.params]
    loss = await distributed_train_step(
        lambda ready: trainer.compute(x, y, lambda p: ready(p.grad)), trainer.apply,
        trainer.agg, overlap=True, params=grads)
    assert loss > 0
    assert backward_threads() == []
    assert isinstance(trainer.model, Sequential)
