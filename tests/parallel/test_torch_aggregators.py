"""Aggregators and the parameter-server client with torch tensors (bfloat16 included),
at 2 and 3 in-process ranks.

Each tensor result is checked bitwise: against the same aggregator run on NumPy copies
(the tensor path must change nothing but the types), or, for bfloat16, against torch's
own arithmetic in the order the aggregator combines (recursive doubling for the small
buckets here: ``(g0 + g1) + g2``, then ``/ n``). The last test runs the bfloat16 paths in
a process where ml_dtypes cannot be imported.
"""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import torch

from netdist.collectives import Group
from netdist.parallel.aggregators import (
    AllReduceAggregator,
    Fp16AllReduceAggregator,
    LocalAggregator,
    TopKAggregator,
)
from netdist.ps import PSClient, PSServer, SGDConfig
from netdist.transport.inprocess import InProcessTransport
from tests import ranks

TIMEOUT = 20.0
BOUND = 60.0
SUBPROCESS_TIMEOUT = 90.0
TINY_BUCKETS = 256 / (1 << 20)  # bucket_mb: 256-byte buckets, so several per step


on_ranks = functools.partial(ranks.run_ranks, with_rank=True, op_timeout=TIMEOUT, guard=BOUND,
                             timeout=TIMEOUT)
"""``await on_ranks(n, fn)``: ``fn(rank, group)`` on ``n`` in-process ranks (groups with
``timeout=TIMEOUT``), bounded; groups and transports closed after."""


def grads_of(rank: int) -> list[torch.Tensor]:
    """A model's worth of gradients: two dtypes, a non-contiguous one, an empty one, one
    big enough for a bucket of its own (reduced in place), one from autograd."""
    g = torch.Generator().manual_seed(rank)
    weight = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.float64))
    (weight * torch.randn(4, 6, generator=g, dtype=torch.float64)).sum().backward()
    assert weight.grad is not None
    return [torch.randn(5, generator=g), torch.randn(3, 8, generator=g).t(),
            torch.zeros(0), weight.grad, torch.randn(100, generator=g, dtype=torch.float64),
            torch.randn(7, generator=g)]


def numpy_copies(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    return [t.detach().numpy().copy() for t in tensors]


def assert_bitwise(ours: torch.Tensor, theirs: Any) -> None:
    theirs = theirs if isinstance(theirs, torch.Tensor) else torch.from_numpy(theirs)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ours.element_size()]
    assert torch.equal(ours.contiguous().view(width), theirs.contiguous().view(width))


AGGREGATORS = {
    "allreduce": lambda g: AllReduceAggregator(g, bucket_mb=TINY_BUCKETS),
    "fp16": lambda g: Fp16AllReduceAggregator(g, bucket_mb=TINY_BUCKETS),
    "topk": lambda g: TopKAggregator(g, ratio=0.3),
}


@pytest.mark.parametrize("kind", AGGREGATORS)
@pytest.mark.parametrize("n", [2, 3])
async def test_tensor_gradients_average_in_place_as_arrays_do(n: int, kind: str) -> None:
    async def body(rank: int, group: Group) -> tuple[list[Any], list[Any], list[Any]]:
        tensors = grads_of(rank)
        pointers = [t.data_ptr() for t in tensors]
        by_tensor = AGGREGATORS[kind](group)
        by_array = AGGREGATORS[kind](group)
        results = []
        for _ in range(2):  # the second step runs on the first step's state (top-k)
            results = await by_tensor.aggregate(tensors)
            assert all(r is t for r, t in zip(results, tensors))
            assert [t.data_ptr() for t in tensors] == pointers
        arrays = numpy_copies(grads_of(rank))
        for _ in range(2):
            expected = await by_array.aggregate(arrays)
        assert by_tensor.bytes_sent == by_array.bytes_sent
        return tensors, expected, results

    for tensors, expected, _ in await on_ranks(n, body):
        for t, e in zip(tensors, expected):
            assert_bitwise(t, e)


def bf16_grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(50 + rank)
    scale = 2.0 ** torch.randint(-4, 4, (300,), generator=g)
    return [(torch.randn(300, generator=g) * scale).to(torch.bfloat16),
            (torch.randn(6, 5, generator=g)).to(torch.bfloat16).t(),  # non-contiguous
            torch.randn(4, generator=g)]  # a float32 bucket beside the bfloat16 ones


def in_order(xs: list[torch.Tensor]) -> torch.Tensor:
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    return acc


@pytest.mark.parametrize("n", [2, 3])
async def test_bfloat16_tensor_gradients_average_as_torch_computes(n: int) -> None:
    async def body(rank: int, group: Group) -> list[torch.Tensor]:
        grads = bf16_grads(rank)
        results = await AllReduceAggregator(group, bucket_mb=TINY_BUCKETS).aggregate(grads)
        assert all(r is t for r, t in zip(results, grads))
        return grads

    everyone = [bf16_grads(r) for r in range(n)]
    for grads in await on_ranks(n, body):
        for i, t in enumerate(grads):
            assert t.dtype == everyone[0][i].dtype
            assert_bitwise(t, in_order([g[i] for g in everyone]) / n)


@pytest.mark.parametrize("n", [2, 3])
async def test_bfloat16_gradients_through_fp16_and_topk(n: int) -> None:
    async def body(rank: int, group: Group) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                     torch.dtype]:
        half = bf16_grads(rank)
        await Fp16AllReduceAggregator(group, bucket_mb=TINY_BUCKETS).aggregate(half)
        top = bf16_grads(rank)
        agg = TopKAggregator(group, ratio=1.0)
        await agg.aggregate(top)
        return half, top, agg.compressor.residuals[0].dtype

    everyone = [bf16_grads(r) for r in range(n)]
    for half, top, residual_dtype in await on_ranks(n, body):
        assert residual_dtype == np.float32  # bfloat16 is selected in float32
        for i in range(len(half)):
            xs = [g[i] for g in everyone]
            # fp16: each rank's g * (1/n) rounded to float16, summed in float16 in rank
            # order, then converted back (to bfloat16 through float32, nearest even)
            fp16 = in_order([(x.float() * (1.0 / n)).half() for x in xs])
            assert_bitwise(half[i], fp16.to(xs[0].dtype))
            # top-k at ratio 1: the float32 sum in rank order, divided, rounded once
            assert_bitwise(top[i], (in_order([x.float() for x in xs]) / n).to(xs[0].dtype))


@pytest.mark.parametrize("n", [2, 3])
async def test_overlap_session_with_tensors_reported_from_a_thread(n: int) -> None:
    async def body(rank: int, group: Group) -> tuple[list[torch.Tensor], list[np.ndarray]]:
        agg = AllReduceAggregator(group, bucket_mb=TINY_BUCKETS)
        like = grads_of(rank)
        session = agg.begin(like)

        def backward() -> None:  # reports in reverse, as backward produces them
            for i in reversed(range(len(like))):
                session.ready(i, like[i])

        await asyncio.to_thread(backward)
        results = await session.finish()
        assert all(r is t for r, t in zip(results, like))
        expected = await AllReduceAggregator(group, bucket_mb=TINY_BUCKETS).aggregate(
            numpy_copies(grads_of(rank)))
        return results, expected

    for results, expected in await on_ranks(n, body):
        for t, e in zip(results, expected):
            assert_bitwise(t, e)


@pytest.mark.parametrize("n", [2, 3])
async def test_bucket_views_of_tensors_are_tensors_over_the_buckets(n: int) -> None:
    async def body(rank: int, group: Group) -> list[torch.Tensor]:
        model = torch.nn.Linear(4, 3)
        params = list(model.parameters())
        agg = AllReduceAggregator(group)
        views = agg.bucket_views([p.detach() for p in params])
        assert all(isinstance(v, torch.Tensor) and v.shape == p.shape
                   for v, p in zip(views, params))
        for p, v in zip(params, views):
            p.grad = v
        x = torch.full((2, 4), float(rank + 1))
        model(x).sum().backward()  # accumulates into the views, in place
        assert all(p.grad is v for p, v in zip(params, views))
        grads = [p.grad for p in params]
        results = await agg.aggregate(grads)
        assert all(r is v for r, v in zip(results, views))
        return views

    results = await on_ranks(n, body)
    mean_x = sum(2.0 * (r + 1) for r in range(n)) / n  # d(sum)/dW = sum over the batch of x
    for weight_grad, bias_grad in results:
        assert torch.equal(weight_grad, torch.full((3, 4), mean_x))
        assert torch.equal(bias_grad, torch.full((3,), 2.0))


async def test_local_aggregator_returns_the_tensors() -> None:
    grads = grads_of(0)
    results = await LocalAggregator().aggregate(grads)
    assert all(r is t for r, t in zip(results, grads))


async def test_unusable_tensor_gradients_are_refused() -> None:
    async def body(rank: int, group: Group) -> None:
        agg = AllReduceAggregator(group)
        with pytest.raises(TypeError, match="gradient 1 has dtype int64; gradients must be "
                                            "floating point"):
            await agg.aggregate([torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
        with pytest.raises(ValueError, match="gradient 0: netdist works on CPU tensors, got "
                                             "one on meta"):
            await agg.aggregate([torch.zeros(2, device="meta")])
        with pytest.raises(TypeError, match="gradient 0 is a list, expected a numpy array "
                                            "or a CPU torch.Tensor"):
            await agg.aggregate([[1.0]])

    await on_ranks(2, body)


# ---------------------------------------------------------------- parameter-server client


def ps_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


async def ps_job(num_workers: int, worker: Callable[[PSClient, int], Awaitable[Any]]
                 ) -> list[Any]:
    transports = InProcessTransport.create_group(1 + num_workers, timeout=TIMEOUT)
    server = PSServer(transports[0], num_servers=1)

    async def work(index: int) -> Any:
        async with PSClient(transports[1 + index], num_servers=1) as client:
            return await worker(client, index)

    try:
        async with asyncio.timeout(BOUND):
            results = await asyncio.gather(server.run(), *(work(i) for i in range(num_workers)))
    finally:
        for t in transports:
            await t.aclose()
    return results[1:]


def batch(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)


async def test_ps_client_takes_and_returns_tensors() -> None:
    steps = 3

    async def with_tensors(client: PSClient, index: int) -> list[torch.Tensor]:
        model = ps_model(0)
        named = dict(model.named_parameters())
        params = await client.init(named, optimizer=SGDConfig(lr=0.1, momentum=0.9))
        assert all(isinstance(p, torch.Tensor) for p in params)
        targets = [p.data for p in model.parameters()]
        targets[0] = torch.zeros(5, 4).t()  # non-contiguous out=: filled through a copy
        for step in range(steps):
            with torch.no_grad():
                for p, value in zip(model.parameters(), params):
                    p.copy_(value)
            model.zero_grad()
            x, y = batch(index, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads = {name: p.grad for name, p in model.named_parameters()}
            params = await client.step(grads, out=targets)
            assert all(p is t for p, t in zip(params, targets))
        pulled = await client.pull()
        assert all(isinstance(p, torch.Tensor) for p in pulled)
        return [p.clone() for p in pulled]

    async def with_arrays(client: PSClient, index: int) -> list[np.ndarray]:
        model = ps_model(0)
        arrays = [p.detach().numpy().copy() for p in model.parameters()]
        params = await client.init(arrays, optimizer=SGDConfig(lr=0.1, momentum=0.9))
        for step in range(steps):
            with torch.no_grad():
                for p, value in zip(model.parameters(), params):
                    p.copy_(torch.from_numpy(value))
            model.zero_grad()
            x, y = batch(index, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            params = await client.step([p.grad.numpy().copy() for p in model.parameters()])
        return list(await client.pull())

    tensors = await ps_job(2, with_tensors)
    arrays = await ps_job(2, with_arrays)
    for ours, theirs in zip(tensors, arrays):
        for t, a in zip(ours, theirs):
            assert_bitwise(t, a)


# -------------------------------------------------------- bfloat16 without ml_dtypes

NO_ML_DTYPES_SCRIPT = 'import sys\nsys.modules["ml_dtypes"] = None\n' + textwrap.dedent('''
    import asyncio
    import numpy as np
    import torch
    from netdist.collectives import Group
    from netdist.parallel.aggregators import (AllReduceAggregator, Fp16AllReduceAggregator,
                                              TopKAggregator)
    from netdist.transport.inprocess import InProcessTransport
    from netdist.types import BFLOAT16, BFLOAT16_RAW

    assert BFLOAT16 is BFLOAT16_RAW
    N = 3

    def grads(rank):
        g = torch.Generator().manual_seed(rank)
        return [(torch.randn(300, generator=g) * 2.0 ** torch.randint(-4, 4, (300,),
                 generator=g)).to(torch.bfloat16), torch.randn(4, 5, generator=g).to(
                 torch.bfloat16).t()]

    def bits(t):
        return t.contiguous().view(torch.int16)

    def in_order(xs):
        acc = xs[0]
        for x in xs[1:]:
            acc = acc + x
        return acc

    async def body(group):
        r = group.rank
        mean, half, top = grads(r), grads(r), grads(r)
        results = await AllReduceAggregator(group, bucket_mb=1e-4).aggregate(mean)
        assert all(a is b for a, b in zip(results, mean))
        await Fp16AllReduceAggregator(group, bucket_mb=1e-4).aggregate(half)
        agg = TopKAggregator(group, ratio=1.0)
        await agg.aggregate(top)
        return mean, half, top

    async def main():
        ts = InProcessTransport.create_group(N, timeout=20.0)
        groups = [Group(t) for t in ts]
        results = await asyncio.wait_for(asyncio.gather(*(body(g) for g in groups)), 60)
        everyone = [grads(r) for r in range(N)]
        for mean, half, top in results:
            for i in range(2):
                xs = [g[i] for g in everyone]
                assert torch.equal(bits(mean[i]), bits(in_order(xs) / N))
                fp16 = in_order([(x.float() * (1.0 / N)).half() for x in xs])
                assert torch.equal(bits(half[i]), bits(fp16.to(torch.bfloat16)))
                f32 = in_order([x.float() for x in xs]) / N
                assert torch.equal(bits(top[i]), bits(f32.to(torch.bfloat16)))
        for g in groups:
            await g.aclose()
        print("ok")

    asyncio.run(main())
''')


@pytest.mark.slow
def test_bfloat16_aggregators_without_ml_dtypes() -> None:
    done = subprocess.run([sys.executable, "-c", NO_ML_DTYPES_SCRIPT], capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
