"""FSDP: exact equivalence with single-process training for every strategy, the seeds'
cases, memory accounting, clipping, state dicts and failures."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.collectives.channel import CollectiveMismatchError
from netdist.errors import FSDPError, NetdistTimeoutError
from netdist.parallel.flat_param import FlatParamLayout
from netdist.parallel.fsdp import FSDP, MemoryEstimate, ShardedStateDict, ShardingStrategy
from netdist.parallel.sharded_optim import ShardedAdam, ShardedSGD
from netdist.train.losses import softmax_cross_entropy
from netdist.train.nn import Module, Parameter, Sequential, mlp
from netdist.train.optimizers import SGD, Adam
from netdist.transport.inprocess import InProcessTransport
from tests import ranks

FULL = ShardingStrategy.FULL_SHARD
GRAD_OP = ShardingStrategy.SHARD_GRAD_OP
NO = ShardingStrategy.NO_SHARD
HYBRID = ShardingStrategy.HYBRID_SHARD

SIZES = [9, 13, 10, 5]  # Linear params 130, 140, 55: uneven over 2, 3 and 4 shards
ROWS = 3                # rows per rank per step
STEPS = 10
TIMEOUT = 20.0
TOL = 1e-12


def make_model(seed: int = 1234) -> Sequential:
    return mlp(SIZES, rng=np.random.default_rng(seed), dtype=np.float64)


def make_batches(n: int, steps: int = STEPS, seed: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n * ROWS, SIZES[0])), rng.integers(0, SIZES[-1], n * ROWS))
            for _ in range(steps)]


def rank_slice(rank: int) -> slice:
    return slice(rank * ROWS, (rank + 1) * ROWS)


OPTIMIZERS: dict[str, Callable[[list[Any]], Any]] = {
    "sgd-momentum": lambda params: SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: Adam(params, lr=0.01),
}


def clip_(params: Sequence[Parameter], max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ on whole gradients (the single-process reference)."""
    norm = float(np.sqrt(sum(float(np.dot(p.grad.ravel(), p.grad.ravel())) for p in params)))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad *= coef
    return norm


def reference_training(batches, optimizer_factory, *, clip: float | None = None
                       ) -> tuple[dict[str, np.ndarray], list[float], Any]:
    model = make_model()
    optimizer = optimizer_factory(model.parameters())
    norms = []
    for x, y in batches:
        model.zero_grad()
        logits, ctx = model.forward(x)
        _, grad = softmax_cross_entropy(logits, y)
        model.backward(ctx, grad)
        if clip is not None:
            norms.append(clip_(model.parameters(), clip))
        optimizer.step()
    return model.state_dict(), norms, optimizer


def make_groups(n: int) -> list[Group]:
    return [Group(t, timeout=TIMEOUT) for t in InProcessTransport.create_group(n, timeout=TIMEOUT)]


run_ranks = functools.partial(ranks.run_ranks, with_rank=True, close=True)
"""``await run_ranks(groups, fn)``: ``fn(rank, group)`` on every rank concurrently (60 s
bound); groups and transports closed afterwards."""


def strategy_kwargs(strategy: ShardingStrategy, intra: int | None) -> dict[str, Any]:
    return {"intra_node_size": intra} if strategy is HYBRID else {}


async def train_fsdp(fsdp: FSDP, rank: int, batches, *, clip: float | None = None) -> list[float]:
    norms = []
    for x, y in batches:
        fsdp.zero_grad()
        logits = await fsdp.forward(x[rank_slice(rank)])
        _, grad = softmax_cross_entropy(logits, y[rank_slice(rank)])
        await fsdp.backward(grad)
        if clip is not None:
            norms.append(await fsdp.clip_grad_norm(clip))
        await fsdp.step()
    return norms


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


# --------------------------------------------------------------- equivalence, every strategy

CASES = [
    (FULL, 2, None), (FULL, 3, None), (FULL, 4, None),
    (GRAD_OP, 2, None), (GRAD_OP, 3, None), (GRAD_OP, 4, None),
    (NO, 2, None), (NO, 3, None), (NO, 4, None),
    (HYBRID, 4, 2),   # 2 nodes x 2 ranks
    (HYBRID, 2, 1),   # 2 nodes x 1 rank: pure replication
    (HYBRID, 2, 2),   # 1 node x 2 ranks: pure FULL_SHARD
]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("prefetch", "in_thread"), [(0, False), (1, True)],
                         ids=["prefetch-off", "prefetch-on"])
@pytest.mark.parametrize(("strategy", "n", "intra"), CASES,
                         ids=[f"{s.name}-n{n}" + (f"-{n // i}x{i}" if i else "")
                              for s, n, i in CASES])
async def test_ten_steps_match_single_process(strategy, n, intra, prefetch, in_thread, optimizer):
    batches = make_batches(n)
    expected, _, ref_opt = reference_training(batches, OPTIMIZERS[optimizer])

    async def rank_fn(rank: int, group: Group) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        model = make_model()
        fsdp = FSDP(model, group, strategy, optimizer=OPTIMIZERS[optimizer](model.parameters()),
                    prefetch_depth=prefetch, compute_in_thread=in_thread, timeout=TIMEOUT,
                    **strategy_kwargs(strategy, intra))
        await train_fsdp(fsdp, rank, batches)
        return (await fsdp.full_state_dict(rank0_only=False),
                await fsdp.full_optim_state_dict(rank0_only=False))

    results = await run_ranks(make_groups(n), rank_fn)
    for params, _ in results:
        assert max_diff(params, expected) <= TOL
    # the sharded optimizer state, gathered, is the single-process optimizer's state
    ref_state = ref_opt.state_dict()["state"]
    got_state = results[0][1]["state"]
    assert got_state.keys() == ref_state.keys()
    for name, entry in ref_state.items():
        assert got_state[name].keys() == entry.keys()
        for key, value in entry.items():
            if key == "step":
                assert got_state[name][key] == value == STEPS
            else:
                assert float(np.abs(got_state[name][key] - value).max()) <= TOL


@pytest.mark.parametrize("min_params", [150, 10_000])
async def test_grouped_units_and_deep_prefetch_match(min_params):
    """Auto-wrap thresholds that group layers, and a prefetch deeper than the model."""
    n = 3
    batches = make_batches(n, steps=4)
    expected, _, _ = reference_training(batches, OPTIMIZERS["adam"])

    async def rank_fn(rank: int, group: Group) -> tuple[Any, dict[str, np.ndarray]]:
        model = make_model()
        fsdp = FSDP(model, group, FULL, optimizer=ShardedAdam(lr=0.01),
                    auto_wrap_min_params=min_params, prefetch_depth=3, timeout=TIMEOUT)
        await train_fsdp(fsdp, rank, batches)
        return fsdp.unit_layer_ranges, await fsdp.full_state_dict()

    results = await run_ranks(make_groups(n), rank_fn)
    expected_units = ((0, 4), (4, 5)) if min_params == 150 else ((0, 5),)
    assert results[0][0] == expected_units
    assert max_diff(results[0][1], expected) <= TOL
    assert all(r[1] == {} for r in results[1:])  # rank0_only


async def test_full_shard_over_real_tcp():
    """FULL_SHARD with prefetch over real sockets (create_local_tcp_group)."""
    from netdist.transport.local_tcp import create_local_tcp_group

    n = 3
    batches = make_batches(n, steps=5)
    expected, _, _ = reference_training(batches, OPTIMIZERS["adam"])
    transports = await asyncio.wait_for(create_local_tcp_group(n, timeout=TIMEOUT), 30)
    groups = [Group(t, timeout=TIMEOUT) for t in transports]

    async def rank_fn(rank: int, group: Group) -> dict[str, np.ndarray]:
        model = make_model()
        fsdp = FSDP(model, group, FULL, optimizer=Adam(model.parameters(), lr=0.01),
                    prefetch_depth=1, timeout=TIMEOUT)
        await train_fsdp(fsdp, rank, batches)
        return await fsdp.full_state_dict(rank0_only=False)

    for params in await run_ranks(groups, rank_fn):
        assert max_diff(params, expected) <= TOL


# --------------------------------------------------------------- the seeds' cases


class Shift(Module):
    """``y = x + b``: one parameter, so its flat buffer is exactly ``b``."""

    def __init__(self, values: Sequence[float]) -> None:
        self.b = Parameter("b", np.asarray(values, dtype=np.float64))

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        return [("b", self.b)]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        return x + self.b.data, None

    def backward(self, ctx: Any, grad_out: np.ndarray) -> np.ndarray:
        self.b.grad += grad_out.sum(axis=0)
        return grad_out


async def test_full_shard_of_10_20_30_40_on_two_ranks():
    async def rank_fn(rank: int, group: Group) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        model = Sequential(Shift([10.0, 20.0, 30.0, 40.0]))
        fsdp = FSDP(model, group, FULL, timeout=TIMEOUT)
        shard = fsdp.local_shards()[0].copy()
        freed = model.parameters()[0].data.size  # not gathered between calls
        out = await fsdp.forward(np.zeros((1, 4)))
        return shard, np.array([freed]), out

    (s0, f0, out0), (s1, f1, out1) = await run_ranks(make_groups(2), rank_fn)
    np.testing.assert_array_equal(s0, [10.0, 20.0])
    np.testing.assert_array_equal(s1, [30.0, 40.0])
    assert f0[0] == f1[0] == 0
    np.testing.assert_array_equal(out0, [[10.0, 20.0, 30.0, 40.0]])
    np.testing.assert_array_equal(out1, out0)


@pytest.mark.parametrize(("strategy", "n", "intra"), [(FULL, 3, None), (GRAD_OP, 3, None),
                                                      (NO, 3, None), (HYBRID, 4, 2)])
async def test_forward_output_identical_on_all_ranks(strategy, n, intra):
    x = np.random.default_rng(5).standard_normal((4, SIZES[0]))
    expected = make_model()(x)

    async def rank_fn(rank: int, group: Group) -> np.ndarray:
        fsdp = FSDP(make_model(), group, strategy, timeout=TIMEOUT,
                    **strategy_kwargs(strategy, intra))
        return await fsdp.forward(x, requires_grad=False)

    for out in await run_ranks(make_groups(n), rank_fn):
        np.testing.assert_array_equal(out, expected)


def local_flat_grads(rank: int, batch: tuple[np.ndarray, np.ndarray],
                     layouts: Sequence[FlatParamLayout]) -> list[np.ndarray]:
    """Rank ``rank``'s own (unreduced) gradient, flattened per unit with FSDP's layout."""
    model = make_model()
    x, y = batch
    logits, ctx = model.forward(x[rank_slice(rank)])
    _, grad = softmax_cross_entropy(logits, y[rank_slice(rank)])
    model.backward(ctx, grad)
    grads = {p.name: p.grad for p in model.parameters()}
    return [layout.flatten([grads[s.name] for s in layout.slots]) for layout in layouts]


async def test_shard_grad_op_grads_are_the_reduce_scattered_mean_and_step_regathers():
    n = 3
    batch = make_batches(n, steps=1)[0]
    expected_after, _, _ = reference_training([batch], OPTIMIZERS["sgd-momentum"])

    async def rank_fn(rank: int, group: Group) -> Any:
        model = make_model()
        fsdp = FSDP(model, group, GRAD_OP, optimizer=ShardedSGD(0.1, momentum=0.9),
                    timeout=TIMEOUT)
        logits = await fsdp.forward(batch[0][rank_slice(rank)])
        _, grad = softmax_cross_entropy(logits, batch[1][rank_slice(rank)])
        await fsdp.backward(grad)
        grads = [g.copy() for g in fsdp.local_grad_shards()]
        await fsdp.step()
        return fsdp.unit_layouts, grads, model.state_dict()

    results = await run_ranks(make_groups(n), rank_fn)
    layouts = results[0][0]
    per_rank = [local_flat_grads(r, batch, layouts) for r in range(n)]
    for rank, (_, grads, params) in enumerate(results):
        for u, layout in enumerate(layouts):
            lo, _ = layout.shard_bounds(rank)
            valid = layout.valid_numel(rank)
            mean = sum(g[u] for g in per_rank) / n
            np.testing.assert_allclose(grads[u], mean[lo:lo + valid], rtol=0, atol=1e-15)
        # every rank holds the whole, fully updated parameters in the module itself
        assert max_diff(params, expected_after) <= TOL
        np.testing.assert_array_equal(np.concatenate([v.ravel() for v in params.values()]),
                                      np.concatenate([v.ravel()
                                                      for v in results[0][2].values()]))


async def test_no_shard_equals_plain_all_reduce():
    n = 3
    batch = make_batches(n, steps=1)[0]

    async def rank_fn(rank: int, group: Group) -> Any:
        model = make_model()
        fsdp = FSDP(model, group, NO, timeout=TIMEOUT)
        logits = await fsdp.forward(batch[0][rank_slice(rank)])
        _, grad = softmax_cross_entropy(logits, batch[1][rank_slice(rank)])
        await fsdp.backward(grad)
        got = [g.copy() for g in fsdp.local_grad_shards()]
        # the same flat buffers reduced by hand with Group.all_reduce(MEAN)
        plain = local_flat_grads(rank, batch, fsdp.unit_layouts)
        for flat in plain:
            await group.all_reduce(flat, "mean")
        module_grads = {p.name: p.grad.copy() for p in model.parameters()}
        return got, plain, module_grads, fsdp.unit_layouts

    for got, plain, module_grads, layouts in await run_ranks(make_groups(n), rank_fn):
        for g, p, layout in zip(got, plain, layouts):
            np.testing.assert_array_equal(g, p[:layout.numel])
            # NO_SHARD keeps Parameter.grad pointing at the reduced gradient
            for slot, view in zip(layout.slots, layout.views(p)):
                np.testing.assert_array_equal(module_grads[slot.name], view)


# --------------------------------------------------------------- memory


def wide_model() -> Sequential:
    return mlp([16, 40, 40, 8], rng=np.random.default_rng(0))   # 680, 1640, 328 params


async def test_full_shard_holds_one_nth_of_no_shard_plus_gathered_units():
    n = 4
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((ROWS, 16)), rng.integers(0, 8, ROWS)

    async def rank_fn(rank: int, group: Group) -> Any:
        out = {}
        for strategy, depth in ((NO, 1), (FULL, 0), (FULL, 1), (GRAD_OP, 1)):
            model = wide_model()
            fsdp = FSDP(model, group, strategy, optimizer=ShardedAdam(0.01),
                        prefetch_depth=depth, timeout=TIMEOUT)
            for _ in range(2):
                fsdp.zero_grad()
                logits = await fsdp.forward(x)
                _, grad = softmax_cross_entropy(logits, y)
                await fsdp.backward(grad)
                await fsdp.step()
            out[strategy, depth] = (fsdp.memory_stats(), fsdp.memory_estimate(),
                                    [lay.padded_numel * 8 for lay in fsdp.unit_layouts])
        return out

    results = await run_ranks(make_groups(n), rank_fn)
    for by_strategy in results:
        no_shard, _, _ = by_strategy[NO, 1]
        # NO_SHARD: params + grads + 2 Adam moments, all whole (2648 float64 each)
        assert no_shard.persistent == 4 * 2648 * 8
        assert no_shard.peak_gathered == 0
        for depth in (0, 1):
            full, estimate, unit_bytes = by_strategy[FULL, depth]
            ideal = no_shard.persistent / n
            assert abs(full.persistent - ideal) <= 0.10 * ideal
            assert full.persistent == estimate.persistent
            # nothing stays gathered between steps; at most 1 + prefetch_depth units at once
            assert full.gathered == 0 and full.grad_buffers == 0
            window = max(sum(unit_bytes[i:i + depth + 1]) for i in range(len(unit_bytes)))
            assert full.peak_gathered == window == estimate.peak_gathered
            assert full.peak_grad_buffers <= estimate.peak_grad_buffers
            assert full.peak_total <= full.persistent + window + estimate.peak_grad_buffers
            assert full.peak_total <= ideal * 1.10 + window + estimate.peak_grad_buffers
        grad_op, estimate, unit_bytes = by_strategy[GRAD_OP, 1]
        assert grad_op.params == sum(unit_bytes) and grad_op.peak_gathered == 0
        assert grad_op.persistent == estimate.persistent


async def test_memory_estimate_for_every_strategy_from_one_fsdp():
    async def rank_fn(rank: int, group: Group) -> dict[ShardingStrategy, MemoryEstimate]:
        fsdp = FSDP(wide_model(), group, FULL, optimizer=ShardedSGD(0.1, momentum=0.9),
                    timeout=TIMEOUT)
        return {s: fsdp.memory_estimate(s, intra_node_size=2) for s in ShardingStrategy}

    results = await run_ranks(make_groups(4), rank_fn)
    est = results[0]
    total = 2648 * 8
    assert (est[NO].params, est[NO].grads, est[NO].optimizer) == (total, total, total)
    # padded to multiples of 4: 680, 1640, 328 -> shards of 170, 410, 82 elements
    assert est[FULL].params == est[FULL].grads == (170 + 410 + 82) * 8
    assert est[GRAD_OP].params == total and est[GRAD_OP].grads == est[FULL].grads
    assert est[HYBRID].params == (340 + 820 + 164) * 8
    assert est[FULL].peak_gathered == (1640 + 680) * 8   # prefetch_depth=1: two units
    assert est[NO].peak_gathered == est[GRAD_OP].peak_gathered == 0
    assert sum(r[FULL].optimizer for r in results) == total


# --------------------------------------------------------------- clipping


@pytest.mark.parametrize(("strategy", "n", "intra"), [(FULL, 3, None), (GRAD_OP, 2, None),
                                                      (NO, 3, None), (HYBRID, 4, 2)])
async def test_clip_grad_norm_matches_single_process(strategy, n, intra):
    batches = make_batches(n, steps=4)
    expected, ref_norms, _ = reference_training(batches, OPTIMIZERS["sgd-momentum"], clip=0.1)
    assert min(ref_norms) > 0.1  # the clip is active on every step

    async def rank_fn(rank: int, group: Group) -> tuple[list[float], dict[str, np.ndarray]]:
        model = make_model()
        fsdp = FSDP(model, group, strategy, optimizer=ShardedSGD(0.1, momentum=0.9),
                    timeout=TIMEOUT, **strategy_kwargs(strategy, intra))
        norms = await train_fsdp(fsdp, rank, batches, clip=0.1)
        return norms, await fsdp.full_state_dict(rank0_only=False)

    for norms, params in await run_ranks(make_groups(n), rank_fn):
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-12, atol=0)
        assert max_diff(params, expected) <= TOL


async def test_clip_grad_norm_inf_and_no_clip_below_threshold():
    batch = make_batches(2, steps=1)[0]
    model = make_model()
    logits, ctx = model.forward(batch[0])
    model.backward(ctx, softmax_cross_entropy(logits, batch[1])[1])
    inf_norm = max(float(np.abs(p.grad).max()) for p in model.parameters())

    async def rank_fn(rank: int, group: Group) -> tuple[float, float, list[np.ndarray]]:
        fsdp = FSDP(make_model(), group, FULL, timeout=TIMEOUT)
        logits = await fsdp.forward(batch[0][rank_slice(rank)])
        await fsdp.backward(softmax_cross_entropy(logits, batch[1][rank_slice(rank)])[1])
        before = [g.copy() for g in fsdp.local_grad_shards()]
        norm_inf = await fsdp.clip_grad_norm(1e9, norm_type=float("inf"))
        after = fsdp.local_grad_shards()
        for b, a in zip(before, after):
            np.testing.assert_array_equal(a, b)  # below the threshold nothing changes
        return norm_inf, await fsdp.clip_grad_norm(1e9), before

    for norm_inf, _, _ in await run_ranks(make_groups(2), rank_fn):
        assert norm_inf == pytest.approx(inf_norm, rel=1e-12)


# --------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("strategy", [FULL, NO])
async def test_two_micro_batches_in_flight_accumulate(strategy):
    n = 2
    batches = make_batches(n, steps=3)
    expected, _, _ = reference_training(batches, OPTIMIZERS["adam"])

    async def rank_fn(rank: int, group: Group) -> dict[str, np.ndarray]:
        fsdp = FSDP(make_model(), group, strategy, optimizer=ShardedAdam(0.01), timeout=TIMEOUT)
        for x, y in batches:
            xs, ys = x[rank_slice(rank)], y[rank_slice(rank)]
            fsdp.zero_grad()
            halves = [slice(0, 2), slice(2, ROWS)]
            outs = [await fsdp.forward_with_ctx(xs[h]) for h in halves]
            for h, (logits, ctx) in zip(halves, outs):
                _, grad = softmax_cross_entropy(logits, ys[h])
                rows = h.stop - h.start
                await fsdp.backward(grad * (rows / ROWS), ctx=ctx)
            await fsdp.step()
        return await fsdp.full_state_dict(rank0_only=False)

    for params in await run_ranks(make_groups(n), rank_fn):
        assert max_diff(params, expected) <= TOL


# --------------------------------------------------------------- state dicts


async def test_sharded_state_dict_specs_and_full_state_dict():
    from netdist.checkpoint import TensorShardSpec

    n = 3

    async def rank_fn(rank: int, group: Group) -> tuple[ShardedStateDict, dict[str, Any]]:
        model = make_model()
        fsdp = FSDP(model, group, FULL, optimizer=ShardedAdam(0.01), timeout=TIMEOUT)
        batches = make_batches(n, steps=1)
        await train_fsdp(fsdp, rank, batches)
        return fsdp.sharded_state_dict(), await fsdp.full_state_dict(rank0_only=False)

    results = await run_ranks(make_groups(n), rank_fn)
    full = results[0][1]
    for rank, (sd, _) in enumerate(results):
        assert sd.step == 1 and sd.hyperparams["lr"] == 0.01
        assert set(sd.tensors) == set(full) | {f"optim.{k}.{m}" for k in full
                                               for m in ("exp_avg", "exp_avg_sq")}
        for name, spec in sd.specs.items():
            assert isinstance(spec, TensorShardSpec)
            assert spec.local_shape(rank) == sd.tensors[name].shape
        for name, value in full.items():
            assert sd.shapes[name] == value.shape
    # the pieces, concatenated in rank order, are the flattened parameters
    for name, value in full.items():
        pieces = [sd.tensors[name] for sd, _ in results]
        np.testing.assert_array_equal(np.concatenate(pieces), value.ravel())


async def test_hybrid_sharded_state_dict_names_node_zero_as_owner():
    async def rank_fn(rank: int, group: Group) -> ShardedStateDict:
        fsdp = FSDP(make_model(), group, HYBRID, intra_node_size=2, timeout=TIMEOUT)
        return fsdp.sharded_state_dict()

    results = await run_ranks(make_groups(4), rank_fn)
    spec = results[0].specs["0.weight"]
    assert spec.shard_dim == 0 and spec.full_shape == (117,)
    assert spec.shard_sizes == (65, 52, 0, 0)   # 130-element unit over 2: 65 | 65
    assert [r.tensors["0.weight"].size for r in results] == [65, 52, 0, 0]


@pytest.mark.parametrize(("strategy", "n", "intra"), [(FULL, 3, None), (GRAD_OP, 3, None),
                                                      (HYBRID, 4, 2), (NO, 2, None)])
async def test_checkpoint_round_trip_to_another_world_size(tmp_path, strategy, n, intra):
    """Save FULL_SHARD on 2 ranks with netdist.checkpoint, load under another strategy
    and world size (in place), continue training: identical to uninterrupted
    single-process training."""
    from netdist.checkpoint import ShardedArray, load, save

    batches = make_batches(12, steps=4)

    def to_state(sd: ShardedStateDict) -> dict[str, Any]:
        tensors = {k: ShardedArray(v) if sd.specs[k].shard_dim == 0 else v
                   for k, v in sd.tensors.items()}
        return {"tensors": tensors, "step": sd.step}

    def rows(rank: int, n: int, x: np.ndarray) -> np.ndarray:
        per = len(x) // n
        return x[rank * per:(rank + 1) * per]

    async def train_steps(fsdp: FSDP, rank: int, n: int, steps) -> None:
        for x, y in steps:
            fsdp.zero_grad()
            logits = await fsdp.forward(rows(rank, n, x))
            await fsdp.backward(softmax_cross_entropy(logits, rows(rank, n, y))[1])
            await fsdp.step()

    async def first(rank: int, group: Group) -> None:
        fsdp = FSDP(make_model(), group, FULL, optimizer=ShardedAdam(0.01), timeout=TIMEOUT)
        await train_steps(fsdp, rank, 2, batches[:2])
        await save(to_state(fsdp.sharded_state_dict()), tmp_path, group, step=2,
                   timeout=TIMEOUT)

    async def second(rank: int, group: Group) -> dict[str, np.ndarray]:
        fsdp = FSDP(make_model(seed=99), group, strategy, optimizer=ShardedAdam(0.01),
                    timeout=TIMEOUT, **strategy_kwargs(strategy, intra))
        sd = fsdp.sharded_state_dict()
        loaded = await load(tmp_path, group, like=to_state(sd), timeout=TIMEOUT)
        await fsdp.load_sharded_state_dict(sd.tensors, step=loaded["step"])
        await train_steps(fsdp, rank, n, batches[2:])
        return await fsdp.full_state_dict(rank0_only=False)

    await run_ranks(make_groups(2), first)
    expected, _, _ = reference_training(batches, OPTIMIZERS["adam"])
    for params in await run_ranks(make_groups(n), second):
        assert max_diff(params, expected) <= TOL


async def test_load_full_state_dict_round_trip():
    async def rank_fn(rank: int, group: Group) -> dict[str, np.ndarray]:
        source = make_model(seed=3).state_dict()
        fsdp = FSDP(make_model(), group, FULL, timeout=TIMEOUT)
        fsdp.load_full_state_dict(source)
        return await fsdp.full_state_dict(rank0_only=False)

    expected = make_model(seed=3).state_dict()
    for params in await run_ranks(make_groups(3), rank_fn):
        assert max_diff(params, expected) == 0.0


# --------------------------------------------------------------- validation and failures


async def test_hybrid_world_size_must_be_a_multiple():
    groups = make_groups(3)
    try:
        with pytest.raises(ValueError, match="world size 3 is not a multiple of "
                                             "intra_node_size 2"):
            FSDP(make_model(), groups[0], HYBRID, intra_node_size=2)
        with pytest.raises(ValueError, match="needs intra_node_size"):
            FSDP(make_model(), groups[0], HYBRID)
        with pytest.raises(ValueError, match="HYBRID_SHARD only"):
            FSDP(make_model(), groups[0], FULL, intra_node_size=3)
        with pytest.raises(ValueError, match="unknown sharding strategy"):
            FSDP(make_model(), groups[0], "zero-4")
        with pytest.raises(ValueError, match="prefetch_depth"):
            FSDP(make_model(), groups[0], prefetch_depth=-1)
    finally:
        await run_ranks(groups, lambda r, g: asyncio.sleep(0))


async def test_strategy_names_parse():
    assert ShardingStrategy.parse("full_shard") is FULL
    assert ShardingStrategy.parse("HYBRID_SHARD") is HYBRID
    assert ShardingStrategy.parse(NO) is NO


@pytest.mark.parametrize("differ", ["seed", "prefetch"])
async def test_ranks_that_disagree_fail_together(differ):
    async def rank_fn(rank: int, group: Group) -> str:
        seed = 1234 + rank if differ == "seed" else 1234
        fsdp = FSDP(make_model(seed), group, FULL, timeout=TIMEOUT,
                    prefetch_depth=rank if differ == "prefetch" else 1)
        with pytest.raises(CollectiveMismatchError, match="group rank 1 differs") as info:
            await fsdp.forward(np.zeros((1, SIZES[0])))
        return str(info.value)

    messages = await run_ranks(make_groups(2), rank_fn)
    assert messages[0] == messages[1]
    assert ("same seed" in messages[0]) == (differ == "seed")
    assert ("prefetch_depth 1 (group rank 0: 0)" in messages[0]) == (differ == "prefetch")


async def test_missing_peer_times_out_and_releases_buffers():
    groups = make_groups(2)

    async def rank_fn(rank: int, group: Group) -> Any:
        fsdp = FSDP(make_model(), group, FULL, timeout=1.0, compute_in_thread=False)
        await fsdp.forward(np.zeros((1, SIZES[0])))
        if rank == 1:
            return None  # takes no part in the second forward
        with pytest.raises(NetdistTimeoutError):
            await fsdp.forward(np.zeros((1, SIZES[0])))
        stats = fsdp.memory_stats()
        assert stats.gathered == 0 and stats.grad_buffers == 0
        assert all(p.data.size == 0 for p in fsdp.module.parameters())
        await fsdp.aclose()
        with pytest.raises(FSDPError, match="closed"):
            await fsdp.forward(np.zeros((1, SIZES[0])))
        return stats

    await run_ranks(groups, rank_fn)


async def test_backward_needs_a_forward_and_a_step_needs_an_optimizer():
    async def rank_fn(rank: int, group: Group) -> None:
        fsdp = FSDP(make_model(), group, NO, timeout=TIMEOUT)
        with pytest.raises(FSDPError, match="no forward context"):
            await fsdp.backward(np.zeros((1, SIZES[-1])))
        with pytest.raises(FSDPError, match="no optimizer"):
            await fsdp.step()
        with pytest.raises(ValueError, match="does not come from"):
            await fsdp.backward(np.zeros((1, SIZES[-1])), ctx=[1, 2, 3])

    await run_ranks(make_groups(2), rank_fn)


def test_module_checks():
    group = Group(InProcessTransport.create_group(1)[0])

    class NoBackward:
        def forward(self, x: np.ndarray) -> tuple[np.ndarray, None]:
            return x, None

    with pytest.raises(TypeError, match="no backward"):
        FSDP(type("M", (), {"layers": [NoBackward()]})(), group)
    shared = Shift([1.0, 2.0])
    twice = type("M", (), {"layers": [shared, shared]})()
    with pytest.raises(ValueError, match="shared between layers"):
        FSDP(twice, group)
    mixed = Sequential(Shift([1.0]), Shift([2.0]))
    mixed.layers[1].b.data = mixed.layers[1].b.data.astype(np.float32)
    with pytest.raises(TypeError, match="mixes dtypes"):
        FSDP(mixed, group, auto_wrap_min_params=10)


@pytest.mark.parametrize("depth", [0, 1])
async def test_gathers_per_step_and_last_unit_kept_for_backward(depth):
    """FULL_SHARD gathers every unit for forward and again for backward; with prefetch
    the last unit stays gathered from forward into backward (one all-gather saved)."""
    batch = make_batches(2, steps=1)[0]

    async def rank_fn(rank: int, group: Group) -> list[int]:
        fsdp = FSDP(make_model(), group, FULL, optimizer=ShardedSGD(0.1), prefetch_depth=depth,
                    timeout=TIMEOUT)
        last = fsdp.unit_layouts[-1].padded_numel * 8
        await fsdp.forward(batch[0][rank_slice(rank)], requires_grad=False)
        after_inference = fsdp.memory_stats().gathered
        logits = await fsdp.forward(batch[0][rank_slice(rank)])
        after_forward = fsdp.memory_stats().gathered
        await fsdp.backward(softmax_cross_entropy(logits, batch[1][rank_slice(rank)])[1])
        await fsdp.step()
        return [after_inference, after_forward, fsdp.memory_stats().gathered,
                fsdp.timings().allgathers, last]

    for inference, forward, after_step, gathers, last in await run_ranks(make_groups(2),
                                                                          rank_fn):
        units = 3
        assert inference == 0 and after_step == 0
        assert forward == (last if depth else 0)
        assert gathers == units + 2 * units - (1 if depth else 0)
