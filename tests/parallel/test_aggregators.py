"""Aggregators over InProcessTransport + Group: exact equivalence with single-process
training, bitwise-identical ranks, bucketing, fp16 and top-k."""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.compression import compress_gradients, decompress_gradients
from netdist.errors import NetdistError
from netdist.parallel.aggregators import (
    AllReduceAggregator,
    Bucket,
    BucketEntry,
    Fp16AllReduceAggregator,
    GradientAggregator,
    LocalAggregator,
    TopKAggregator,
    plan_buckets,
)
from netdist.train.data import epoch_permutation, iterate_batches, load_digits_dataset, shard_indices
from netdist.train.losses import softmax_cross_entropy
from netdist.train.nn import mlp
from tests.ranks import start_until_blocked
from netdist.train.optimizers import SGD
from netdist.train.step import distributed_train_step
from netdist.transport.inprocess import InProcessTransport
from tests import ranks

TIMEOUT = 20.0


def make_groups(n: int) -> list[Group]:
    return [Group(t, timeout=TIMEOUT) for t in InProcessTransport.create_group(n, timeout=TIMEOUT)]


run_ranks = functools.partial(ranks.run_ranks, with_rank=True)
"""``await run_ranks(groups, fn)``: ``fn(rank, group)`` on every rank concurrently (60 s
bound); the groups stay open."""


# ---------------------------------------------------------------- pure bucket planning

def test_plan_buckets_reverse_order_and_cap():
    plan = plan_buckets([10, 20, 30, 40], ["<f4"] * 4, bucket_bytes=200)
    # reverse order: 40 (160 B) + 30 -> 280 B >= 200 closes; 20 + 10 -> 120 B, last bucket
    assert plan == (
        Bucket("<f4", 70, (BucketEntry(3, 0, 40), BucketEntry(2, 40, 30))),
        Bucket("<f4", 30, (BucketEntry(1, 0, 20), BucketEntry(0, 20, 10))),
    )
    assert plan[0].nbytes == 280


def test_plan_buckets_separates_dtypes_and_skips_empty():
    plan = plan_buckets([4, 0, 4, 4], [np.float32, np.float32, np.float64, np.float32],
                        bucket_bytes=1 << 20, reverse=False)
    assert [(b.dtype, [e.index for e in b.entries]) for b in plan] == [
        ("<f4", [0, 3]), ("<f8", [2])]


async def test_bfloat16_gradients_average_in_bfloat16_buckets() -> None:
    """ml_dtypes' bfloat16 has the raw dtype.str '<V2': buckets name it by its wire name,
    so the bucket buffer is bfloat16 and the average is computed in bfloat16."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    plan = plan_buckets([3, 2], [bf16, np.float32], bucket_bytes=1 << 20)
    assert sorted(b.dtype for b in plan) == ["<f4", "bfloat16"]
    groups = make_groups(2)
    grads = [[np.array([1.0, 2.0, 3.0], bf16) * (r + 1)] for r in range(2)]

    async def run(r: int) -> list[np.ndarray]:
        return await AllReduceAggregator(groups[r]).aggregate(grads[r])

    results = await asyncio.gather(*(run(r) for r in range(2)))
    for (avg,) in results:
        assert avg.dtype == bf16
        np.testing.assert_array_equal(avg.astype(np.float32), [1.5, 3.0, 4.5])


def test_plan_buckets_large_tensor_alone_and_many_small_fused():
    plan = plan_buckets([1000] + [10] * 200, ["<f8"] * 201, bucket_bytes=4000)
    assert sum(len(b.entries) for b in plan) == 201
    assert any(b.entries == (BucketEntry(0, 0, 1000),) for b in plan)
    assert len(plan) <= 2 + 200 * 10 * 8 // 4000
    with pytest.raises(ValueError):
        plan_buckets([1], ["<f4"], bucket_bytes=0)


# ---------------------------------------------------------------- the key property

def reference_training(data, n, b, steps, seed):
    """Single process, global batch n*b, walking the same permutation."""
    model = mlp([64, 32, 16, 10], rng=np.random.default_rng(seed))
    params = model.parameters()
    opt = SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    snapshots = []
    epoch = 0
    while len(snapshots) < steps:
        perm = epoch_permutation(len(data.x_train), epoch, seed)
        usable = len(perm) - len(perm) % n
        for batch in iterate_batches(perm[:usable], n * b):
            model.zero_grad()
            logits, ctx = model.forward(data.x_train[batch])
            _, g = softmax_cross_entropy(logits, data.y_train[batch])
            model.backward(ctx, g)
            opt.step()
            snapshots.append([p.data.copy() for p in params])
            if len(snapshots) == steps:
                break
        epoch += 1
    return snapshots


async def distributed_training(data, groups, b, steps, seed, make_agg):
    n = len(groups)

    async def rank_main(rank, group):
        model = mlp([64, 32, 16, 10], rng=np.random.default_rng(seed))
        params = model.parameters()
        opt = SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
        agg = make_agg(group)
        snapshots, losses = [], []
        epoch = 0
        while len(snapshots) < steps:
            idx = shard_indices(len(data.x_train), rank, n, epoch, seed)
            for batch in iterate_batches(idx, b):
                def compute(batch=batch):
                    model.zero_grad()
                    logits, ctx = model.forward(data.x_train[batch])
                    loss, g = softmax_cross_entropy(logits, data.y_train[batch])
                    model.backward(ctx, g)
                    return loss, [p.grad for p in params]

                def apply(avg):
                    for p, a in zip(params, avg):
                        if a is not p.grad:
                            np.copyto(p.grad, a)
                    opt.step()

                losses.append(await distributed_train_step(compute, apply, agg))
                snapshots.append([p.data.copy() for p in params])
                if len(snapshots) == steps:
                    break
            epoch += 1
        return snapshots, losses, agg

    return await run_ranks(groups, rank_main)


@pytest.fixture(scope="module")
def digits():
    return load_digits_dataset(seed=0)


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_allreduce_training_equals_single_process_with_n_times_batch(digits, n):
    b, steps, seed = 8, 20, 3
    reference = reference_training(digits, n, b, steps, seed)
    # 256-byte buckets: (bias 2 + weight 2), (bias 1 + weight 1) are fused, bias 0 and
    # the 32x64 weight each fill a bucket alone and are reduced in place.
    results = await distributed_training(
        digits, make_groups(n), b, steps, seed,
        lambda g: AllReduceAggregator(g, bucket_mb=256 / 2**20))
    agg = results[0][2]
    assert [len(bk.entries) for bk in agg.buckets] == [2, 2, 1, 1]
    for step in range(steps):
        for rank in range(1, n):
            for p0, pr in zip(results[0][0][step], results[rank][0][step]):
                assert np.array_equal(p0, pr), f"rank {rank} differs at step {step}"
        diff = max(float(np.max(np.abs(p - q)))
                   for p, q in zip(results[0][0][step], reference[step]))
        assert diff <= 1e-12, f"step {step}: max abs diff {diff}"
    # parameters actually moved, and the local losses fell
    assert float(np.max(np.abs(reference[-1][0] - reference[0][0]))) > 1e-3
    total = sum(p.nbytes for p in reference[0])
    assert agg.bytes_sent == steps * total and agg.last_bytes_sent == total


async def test_many_small_tensors_mean_few_collectives():
    n = 2
    groups = make_groups(n)
    calls = [0] * n

    class Counting:
        def __init__(self, g, r):
            self.g, self.r = g, r
            self.world_size = g.world_size

        async def all_reduce(self, *args, **kwargs):
            calls[self.r] += 1
            return await self.g.all_reduce(*args, **kwargs)

    async def rank_main(rank, group):
        agg = AllReduceAggregator(Counting(group, rank), bucket_mb=1)
        rng = np.random.default_rng(rank)
        grads = [rng.normal(size=100).astype(np.float32) for _ in range(200)]
        expected = [g.copy() for g in grads]
        out = await agg.aggregate(grads)
        assert all(o is g for o, g in zip(out, grads))  # written into the caller's arrays
        return expected, out

    (e0, o0), (e1, o1) = await run_ranks(groups, rank_main)
    assert calls == [1, 1]
    for a, b, r0, r1 in zip(e0, e1, o0, o1):
        np.testing.assert_array_equal(r0, r1)
        np.testing.assert_allclose(r0, (a + b) / 2, rtol=1e-6)


async def test_non_contiguous_and_read_only_gradients():
    groups = make_groups(2)

    async def rank_main(rank, group):
        agg = AllReduceAggregator(group, bucket_mb=1)
        base = np.full((4, 6), float(rank + 1))
        strided = base[:, ::2]  # non-contiguous view, written through
        frozen = np.full(5, float(10 * (rank + 1)))
        frozen.flags.writeable = False
        out = await agg.aggregate([strided, frozen])
        return base, out, frozen

    for base, out, frozen in await run_ranks(groups, rank_main):
        np.testing.assert_array_equal(out[0], np.full((4, 3), 1.5))
        assert out[0] is not None and np.shares_memory(out[0], base)
        np.testing.assert_array_equal(base[:, 1::2], base[:, 1::2] * 0 + base[0, 1])
        assert out[1] is not frozen
        np.testing.assert_array_equal(out[1], np.full(5, 15.0))


async def test_layout_change_replans_and_world_of_one():
    (g,) = make_groups(1)
    agg = AllReduceAggregator(g)
    x = np.ones(3)
    assert (await agg.aggregate([x]))[0] is x
    assert agg.bytes_sent == 0
    groups = make_groups(2)

    async def rank_main(rank, group):
        agg = AllReduceAggregator(group, bucket_mb=1)
        first = await agg.aggregate([np.full(3, float(rank))])
        second = await agg.aggregate([np.full(2, float(rank)), np.full(7, 2.0 * rank)])
        return first, second, agg.bytes_sent

    for first, second, sent in await run_ranks(groups, rank_main):
        np.testing.assert_array_equal(first[0], [0.5] * 3)
        np.testing.assert_array_equal(second[1], [1.0] * 7)
        assert sent == 3 * 8 + 9 * 8


async def test_lost_peer_raises_instead_of_hanging():
    transports = InProcessTransport.create_group(2, timeout=5.0)
    group0 = Group(transports[0], timeout=5.0)
    Group(transports[1], timeout=5.0)
    await transports[1].aclose()
    agg = AllReduceAggregator(group0, bucket_mb=1 / 1024)
    grads = [np.ones(1000), np.ones(10), np.ones(10)]
    with pytest.raises(NetdistError):
        await asyncio.wait_for(agg.aggregate(grads), timeout=30)


# ---------------------------------------------------------------- fp16

async def test_fp16_aggregator_halves_bytes_and_is_close():
    n = 4
    groups = make_groups(n)
    rng = np.random.default_rng(0)
    inputs = [[rng.normal(size=(50, 20)).astype(np.float32), rng.normal(size=20).astype(np.float32)]
              for _ in range(n)]
    expected = [sum(inp[i] for inp in inputs) / n for i in range(2)]

    async def rank_main(rank, group):
        agg = Fp16AllReduceAggregator(group, bucket_mb=1)
        out = await agg.aggregate([a.copy() for a in inputs[rank]])
        return out, agg.bytes_sent

    results = await run_ranks(groups, rank_main)
    for out, sent in results:
        assert sent * 2 == sum(a.nbytes for a in inputs[0])
        for o, e in zip(out, expected):
            assert o.dtype == np.float32
            np.testing.assert_allclose(o, e, rtol=2e-3, atol=2e-3)
        for o, o0 in zip(out, results[0][0]):
            np.testing.assert_array_equal(o, o0)


# ---------------------------------------------------------------- top-k

async def test_topk_ratio_one_is_the_exact_mean():
    n = 3
    groups = make_groups(n)
    rng = np.random.default_rng(1)
    inputs = [[rng.integers(-50, 50, size=(7, 5)).astype(np.float64),
               rng.integers(-50, 50, size=9).astype(np.float64)] for _ in range(n)]

    async def rank_main(rank, group):
        agg = TopKAggregator(group, ratio=1.0)
        return await agg.aggregate([a.copy() for a in inputs[rank]])

    for out in await run_ranks(groups, rank_main):
        for i in range(2):
            np.testing.assert_array_equal(out[i], sum(inp[i] for inp in inputs) / n)


async def test_topk_bytes_and_union_of_selections():
    n = 2
    groups = make_groups(n)
    rng = np.random.default_rng(2)
    inputs = [[rng.normal(size=(100, 100)).astype(np.float32),
               rng.normal(size=1000).astype(np.float32)] for _ in range(n)]

    async def rank_main(rank, group):
        agg = TopKAggregator(group, ratio=0.01)
        out = await agg.aggregate([a.copy() for a in inputs[rank]])
        return out, agg

    results = await run_ranks(groups, rank_main)
    for out, agg in results:
        assert agg.last_bytes_sent == (100 + 10) * 8
        assert agg.bytes_sent <= 0.025 * agg.dense_bytes
        for o, o0 in zip(out, results[0][0]):
            np.testing.assert_array_equal(o, o0)
    # the average of every rank's stateless top-k, exactly
    expected = [sum(d for d in (decompress_gradients(compress_gradients(inputs[r], 0.01),
                                                     [a.shape for a in inputs[r]])[i]
                                for r in range(n))) / n for i in range(2)]
    for o, e in zip(results[0][0], expected):
        np.testing.assert_array_equal(o, e)
    assert np.count_nonzero(results[0][0][0]) <= 200


async def test_topk_aggregator_still_trains(digits):
    n, b, steps, seed = 2, 16, 60, 0
    results = await distributed_training(
        digits, make_groups(n), b, steps, seed, lambda g: TopKAggregator(g, ratio=0.05))
    for rank in range(1, n):
        for p0, pr in zip(results[0][0][-1], results[rank][0][-1]):
            np.testing.assert_array_equal(p0, pr)
    losses = results[0][1]
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:5])
    agg = results[0][2]
    assert agg.bytes_sent <= 0.1 * agg.dense_bytes


async def test_aggregators_satisfy_the_protocol():
    (g,) = make_groups(1)
    for agg in (LocalAggregator(), AllReduceAggregator(g), Fp16AllReduceAggregator(g),
                TopKAggregator(g, 0.1)):
        assert isinstance(agg, GradientAggregator)


async def test_concurrent_aggregate_calls_are_refused():
    groups = make_groups(2)

    async def rank_main(rank, group):
        agg = AllReduceAggregator(group, bucket_mb=1)
        first = await start_until_blocked(agg.aggregate([np.ones(10)]))  # the first call runs
        with pytest.raises(NetdistError, match="still running"):
            await agg.aggregate([np.ones(10)])
        return await first

    for out in await run_ranks(groups, rank_main):
        np.testing.assert_array_equal(out[0], np.ones(10))


async def test_bucket_views_move_no_bytes_locally():
    groups = make_groups(3)

    async def rank_main(rank, group):
        agg = AllReduceAggregator(group, bucket_mb=64 / 2**20)  # 16 float32 per bucket
        like = [np.empty((3, 4), np.float32), np.empty(5, np.float32), np.empty(40, np.float32)]
        views = agg.bucket_views(like)
        assert [v.shape for v in views] == [(3, 4), (5,), (40,)]
        assert all(not v.any() for v in views)

        def no_copies(*args):
            raise AssertionError("copied although the gradients live in the buckets")

        agg._fill = no_copies
        agg._drain = no_copies
        for v in views:
            v += rank + 1.0  # what a backward pass does
        out = await agg.aggregate(views)
        assert all(o is v for o, v in zip(out, views))
        return out

    for out in await run_ranks(groups, rank_main):
        for o in out:
            np.testing.assert_array_equal(o, np.full(o.shape, 2.0, np.float32))
    with pytest.raises(TypeError):
        Fp16AllReduceAggregator(groups[0]).bucket_views([np.zeros(3, np.float32)])


@pytest.mark.parametrize("n", [3])
async def test_equivalence_with_gradients_as_bucket_views(digits, n):
    """Same key property when the model's gradients live inside the buckets."""
    b, steps, seed = 8, 20, 5
    reference = reference_training(digits, n, b, steps, seed)

    async def rank_main(rank, group):
        model = mlp([64, 32, 16, 10], rng=np.random.default_rng(seed))
        params = model.parameters()
        opt = SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
        agg = AllReduceAggregator(group, bucket_mb=1 / 1024)
        for p, view in zip(params, agg.bucket_views([p.grad for p in params])):
            p.grad = view
        snapshots = []
        epoch = 0
        while len(snapshots) < steps:
            for batch in iterate_batches(shard_indices(len(digits.x_train), rank, n, epoch, seed), b):
                def compute(batch=batch):
                    model.zero_grad()
                    logits, ctx = model.forward(digits.x_train[batch])
                    loss, g = softmax_cross_entropy(logits, digits.y_train[batch])
                    model.backward(ctx, g)
                    return loss, [p.grad for p in params]

                def apply(avg):
                    assert all(a is p.grad for a, p in zip(avg, params))
                    opt.step()

                await distributed_train_step(compute, apply, agg)
                snapshots.append([p.data.copy() for p in params])
                if len(snapshots) == steps:
                    break
            epoch += 1
        return snapshots

    results = await run_ranks(make_groups(n), rank_main)
    for step in range(steps):
        for rank in range(1, n):
            assert all(np.array_equal(a, c) for a, c in zip(results[0][step], results[rank][step]))
        diff = max(float(np.max(np.abs(p - q))) for p, q in zip(results[0][step], reference[step]))
        assert diff <= 1e-12
