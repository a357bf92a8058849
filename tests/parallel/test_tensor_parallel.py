"""Tensor-parallel NumPy layers (issue 30, item 2) against the single-process layers.

Every rank runs over real TCP on 127.0.0.1: blocking ``Job`` ranks driven from one
thread each (``tests.progress.jobs``), or plain asyncio ``Group`` ranks in one event loop
whose layer code runs in worker threads (``asyncio.to_thread``, the way netdist's pipeline
and FSDP run layers). Sizes are uneven on purpose (7 outputs over 4 ranks: 2, 2, 2, 1).

- each layer, and column -> ReLU -> row, gives the single-process output and input
  gradient (float64 to 1e-12, float32 to 1e-6, the embedding bit for bit) and each rank's
  parameter gradients are the slices of the full gradients its ``tp_placements`` name;
- 20 SGD steps of column -> tanh -> row (row bias) at TP=2 equal 20 single-process steps;
- a column -> ReLU -> row forward moves exactly the bytes and messages of one all-reduce
  of the (batch, out) activation, and backward one of the (batch, in) input gradient
  (the transport's counters, against a reference all-reduce on the same group);
- wrong shapes are ``ValueError``s naming the layer; a layer called on the thread that
  runs its group's loop raises ``CollectiveError`` instead of deadlocking.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.errors import CollectiveError
from netdist.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from netdist.progress import Job
from netdist.sharding import Replicate, Shard
from netdist.train.losses import mse_loss
from netdist.train.nn import Embedding, Linear, Module, ReLU, Sequential, Tanh
from netdist.train.optimizers import SGD
from netdist.transport.inprocess import InProcessTransport
from netdist.transport.local_tcp import local_tcp_group
from netdist.transport.traffic import PeerTraffic, Traffic
from tests.progress.jobs import connect_jobs
from tests.ranks import on_every_rank

TIMEOUT = 20.0
"""Each collective's deadline."""
BOUND = 60.0
"""Outer bound on one rank's part of a test."""

IN, HIDDEN, OUT = 5, 7, 6
"""Feature sizes: 7 hidden units split 4+3 over 2 ranks and 2+2+2+1 over 4."""
LEAD = (2, 3)
"""Leading dimensions of every input: the layers take any."""
VOCAB, DIM = 11, 3
SEED = 1234


# -- ranks ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def on_ranks() -> Iterator[Callable[[int, Callable[[Any], Any]], list[Any]]]:
    """``on_ranks(n, fn)``: ``fn(job.group)`` on every rank of an ``n``-rank blocking
    job (made on first use, shared by the module's tests), one thread per rank."""
    jobs: dict[int, list[Job]] = {}

    def run(n: int, fn: Callable[[Any], Any]) -> list[Any]:
        if n not in jobs:
            jobs[n] = connect_jobs(n, timeout=TIMEOUT)
        return on_every_rank(jobs[n], lambda job: fn(job.group), timeout=BOUND)

    try:
        yield run
    finally:
        for made in jobs.values():
            for job in made:
                job.close()


# -- references ----------------------------------------------------------------------------


def linear(fan_in: int, fan_out: int, dtype: Any, seed: int = SEED) -> Linear:
    return Linear(fan_in, fan_out, rng=np.random.default_rng(seed), dtype=dtype)


def normal(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype: Any, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    tol = 1e-12 if np.dtype(dtype) == np.float64 else 1e-6
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol, err_msg=what)


def check_grads(tp: Any, full: Module, dtype: Any, who: str) -> None:
    """``tp``'s parameter gradients are the pieces of ``full``'s its placements name."""
    expected = dict(full.named_parameters())
    assert set(tp.tp_placements) == set(expected) == {n for n, _ in tp.named_parameters()}
    for name, p in tp.named_parameters():
        assert tp.full_shapes[name] == expected[name].shape
        assert_close(p.grad, tp.layout.piece(name, expected[name].grad), dtype,
                     f"{who} {name}.grad")


# -- one layer, or a column -> ReLU -> row block, against single-process ------------------


def run_linear_case(case: str, dtype: Any, group: Any) -> None:
    """Forward and backward of ``case`` on this rank, checked against the full layers."""
    if case == "column->relu->row":
        full_a, full_b = linear(IN, HIDDEN, dtype), linear(HIDDEN, OUT, dtype, SEED + 1)
        col = ColumnParallelLinear.from_linear(full_a, group)
        row = RowParallelLinear.from_linear(full_b, group)
        full: Module = Sequential(full_a, ReLU(), full_b)
        model: Module = Sequential(col, ReLU(), row)
        fan_in, fan_out = IN, OUT
        pairs = [(col, full_a), (row, full_b)]
    else:
        fan_in, fan_out = (IN, HIDDEN) if case.startswith("column") else (HIDDEN, OUT)
        full = linear(fan_in, fan_out, dtype)
        if case == "column":
            model = ColumnParallelLinear.from_linear(full, group)
        elif case == "column+gather":
            model = ColumnParallelLinear.from_linear(full, group, gather_output=True)
        else:
            model = RowParallelLinear.from_linear(full, group,
                                                  input_is_parallel=case == "row")
        pairs = [(model, full)]
    x = normal((*LEAD, fan_in), dtype, 1)
    grad = normal((*LEAD, fan_out), dtype, 2)
    part = pairs[0][0].layout.shard.slice
    y_ref, ctx_ref = full.forward(x)
    grad_in_ref = full.backward(ctx_ref, grad)

    x_local = x[..., part] if case == "row" else x
    y, ctx = model.forward(x_local)
    out_split = case == "column"
    assert_close(y, y_ref[..., part] if out_split else y_ref, dtype, f"{case} output")
    grad_in = model.backward(ctx, grad[..., part] if out_split else grad)
    assert_close(grad_in, grad_in_ref[..., part] if case == "row" else grad_in_ref, dtype,
                 f"{case} input gradient")
    for tp, ref in pairs:
        check_grads(tp, ref, dtype, case)


LINEAR_CASES = ["column", "column+gather", "row", "row+split-input", "column->relu->row"]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", LINEAR_CASES)
@pytest.mark.parametrize("n", [2, 4])
def test_linear_layers_match_single_process(on_ranks: Any, n: int, case: str,
                                            dtype: Any) -> None:
    on_ranks(n, lambda group: run_linear_case(case, dtype, group))


def run_embedding_case(dtype: Any, group: Any) -> None:
    full = Embedding(VOCAB, DIM, rng=np.random.default_rng(SEED), dtype=dtype)
    layer = VocabParallelEmbedding.from_embedding(full, group)
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(4, 5))
    ids[0, :3] = 0  # a repeated id: its gradient rows accumulate
    grad = normal((*ids.shape, DIM), dtype, 4)
    y_ref, ctx_ref = full.forward(ids)
    grad_in_ref = full.backward(ctx_ref, grad)
    y, ctx = layer.forward(ids)
    np.testing.assert_array_equal(y, y_ref)  # one row and zeros: exact in any dtype
    grad_in = layer.backward(ctx, grad)
    np.testing.assert_array_equal(grad_in, grad_in_ref)
    assert grad_in.shape == ids.shape and not grad_in.any()
    np.testing.assert_array_equal(layer.weight.grad, full.weight.grad[layer.layout.shard.slice])


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("n", [2, 4])
def test_vocab_parallel_embedding_matches_embedding(on_ranks: Any, n: int,
                                                    dtype: Any) -> None:
    on_ranks(n, lambda group: run_embedding_case(dtype, group))


def test_embedding_is_torch_like() -> None:
    """The reference ``Embedding``: N(0, 1) rows from the rng, lookups, scatter-added
    gradients, zeros for the ids' gradient, and clear errors."""
    emb = Embedding(4, 2, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(emb.weight.data,
                                  np.random.default_rng(0).standard_normal((4, 2)))
    y, ctx = emb.forward(np.array([[1, 1], [3, 0]]))
    np.testing.assert_array_equal(y[0, 1], emb.weight.data[1])
    assert emb.backward(ctx, np.ones((2, 2, 2))).shape == (2, 2)
    np.testing.assert_array_equal(emb.weight.grad, [[1, 1], [2, 2], [0, 0], [1, 1]])
    with pytest.raises(TypeError, match="ids must be integers"):
        emb.forward(np.array([0.5]))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        emb.forward(np.array([4]))


# -- construction, placements ---------------------------------------------------------------


def reassemble(pieces: list[np.ndarray], placement: Shard | Replicate) -> np.ndarray:
    if isinstance(placement, Replicate):
        assert all(np.array_equal(p, pieces[0]) for p in pieces)
        return pieces[0]
    return np.concatenate(pieces, axis=placement.dim)


def build_direct(group: Any) -> list[Any]:
    return [ColumnParallelLinear(IN, HIDDEN, group, rng=np.random.default_rng(SEED)),
            RowParallelLinear(HIDDEN, OUT, group, rng=np.random.default_rng(SEED)),
            VocabParallelEmbedding(VOCAB, DIM, group, rng=np.random.default_rng(SEED))]


@pytest.mark.parametrize("n", [2, 4])
def test_seeded_constructors_give_the_same_full_model_at_every_size(on_ranks: Any,
                                                                    n: int) -> None:
    per_rank = on_ranks(n, lambda group: [(layer.tp_placements, layer.full_shapes,
                                           layer.state_dict())
                                          for layer in build_direct(group)])
    fulls = [linear(IN, HIDDEN, np.float64), linear(HIDDEN, OUT, np.float64),
             Embedding(VOCAB, DIM, rng=np.random.default_rng(SEED))]
    expected_placements = [{"weight": Shard(0), "bias": Shard(0)},
                           {"weight": Shard(1), "bias": Replicate()},
                           {"weight": Shard(0)}]
    for index, (full, placements) in enumerate(zip(fulls, expected_placements)):
        assert all(r[index][0] == placements for r in per_rank)
        assert all(r[index][1] == {k: v.shape for k, v in full.state_dict().items()}
                   for r in per_rank)
        for name, value in full.state_dict().items():
            whole = reassemble([r[index][2][name] for r in per_rank], placements[name])
            np.testing.assert_array_equal(whole, value)


def test_layers_without_bias_and_their_repr(on_ranks: Any) -> None:
    def body(group: Any) -> list[Any]:
        col = ColumnParallelLinear(IN, HIDDEN, group, rng=np.random.default_rng(0),
                                   bias=False)
        row = RowParallelLinear(HIDDEN, OUT, group, rng=np.random.default_rng(0), bias=False)
        assert col.bias is None and [n for n, _ in col.named_parameters()] == ["weight"]
        assert col.tp_placements == {"weight": Shard(0)}
        assert row.tp_placements == {"weight": Shard(1)}
        assert col.local_out_features == row.local_in_features
        return [repr(col), repr(row)]

    reprs = on_ranks(2, body)
    assert reprs[1][0] == ("ColumnParallelLinear(5, 7, rank 1 of 2 holds [4:7], "
                           "dtype=float64)")


# -- training ----------------------------------------------------------------------------


STEPS = 20
BATCH = 8


def mlp_block(group: Any | None) -> Sequential:
    """column -> tanh -> row (both with a bias), or the plain layers without a group."""
    first, second = linear(IN, HIDDEN, np.float64), linear(HIDDEN, OUT, np.float64, SEED + 1)
    if group is None:
        return Sequential(first, Tanh(), second)
    return Sequential(ColumnParallelLinear.from_linear(first, group), Tanh(),
                      RowParallelLinear.from_linear(second, group))


def train(model: Sequential) -> list[float]:
    optimizer = SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = np.random.default_rng(5)
    losses = []
    for _ in range(STEPS):
        x, target = data.standard_normal((BATCH, IN)), data.standard_normal((BATCH, OUT))
        model.zero_grad()
        y, ctx = model.forward(x)
        loss, grad = mse_loss(y, target)
        model.backward(ctx, grad)
        optimizer.step()
        losses.append(loss)
    return losses


def test_twenty_sgd_steps_at_tp2_equal_single_process(on_ranks: Any) -> None:
    def body(group: Any) -> tuple[list[float], list[dict[str, np.ndarray]], list[Any]]:
        model = mlp_block(group)
        losses = train(model)
        layers = [model[0], model[2]]
        return losses, [layer.state_dict() for layer in layers], \
            [layer.tp_placements for layer in layers]

    per_rank = on_ranks(2, body)
    reference = mlp_block(None)
    ref_losses = train(reference)
    for losses, _, _ in per_rank:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-12, atol=1e-12)
    for index, full in enumerate([reference[0], reference[2]]):
        placements = per_rank[0][2][index]
        for name, value in full.state_dict().items():
            whole = reassemble([r[1][index][name] for r in per_rank], placements[name])
            np.testing.assert_allclose(whole, value, rtol=0, atol=1e-12,
                                       err_msg=f"layer {index} {name} after {STEPS} steps")


# -- errors ------------------------------------------------------------------------------


def test_wrong_shapes_are_value_errors_naming_the_layer(on_ranks: Any) -> None:
    def body(group: Any) -> None:
        col, row, emb = build_direct(group)
        split_row = RowParallelLinear(HIDDEN, OUT, group, rng=np.random.default_rng(0),
                                      input_is_parallel=False)
        with pytest.raises(ValueError, match=r"ColumnParallelLinear.forward.*last "
                                             r"dimension 5.*\(2, 4\)"):
            col.forward(np.zeros((2, 4)))
        _, ctx = col.forward(np.zeros((2, IN)))
        with pytest.raises(ValueError, match="ColumnParallelLinear.backward"):
            col.backward(ctx, np.zeros((2, HIDDEN)))  # the whole width, not this rank's
        with pytest.raises(ValueError, match=r"RowParallelLinear.forward.*input \(split\)"):
            row.forward(np.zeros((2, HIDDEN)))
        with pytest.raises(ValueError, match="RowParallelLinear.forward"):
            split_row.forward(np.zeros((2, HIDDEN - 1)))
        with pytest.raises(TypeError, match="VocabParallelEmbedding.forward: ids must be"):
            emb.forward(np.zeros(3))
        with pytest.raises(ValueError, match=r"VocabParallelEmbedding.forward.*\[0, 11\)"):
            emb.forward(np.array([VOCAB]))
        with pytest.raises(ValueError, match="ColumnParallelLinear: out_features=1"):
            ColumnParallelLinear(IN, 1, group, rng=np.random.default_rng(0))
        with pytest.raises(ValueError, match="RowParallelLinear: in_features=1"):
            RowParallelLinear(1, OUT, group, rng=np.random.default_rng(0))
        with pytest.raises(TypeError, match="ColumnParallelLinear: expected a Linear"):
            ColumnParallelLinear.from_linear(emb, group)  # type: ignore[arg-type]

    on_ranks(2, body)
    with pytest.raises(TypeError, match="RowParallelLinear: group must be a netdist Group"):
        RowParallelLinear(IN, OUT, object(), rng=np.random.default_rng(0))  # type: ignore[arg-type]


def test_blocking_layer_on_the_progress_loop_raises_collective_error(on_ranks: Any) -> None:
    """On the progress thread's loop (a coroutine run by ``job.run``), the blocking call
    would wait for the loop it blocks: ``CollectiveError``, and the group still works."""
    def body(group: Any) -> np.ndarray:
        layer = RowParallelLinear(HIDDEN, OUT, group, rng=np.random.default_rng(0),
                                  input_is_parallel=False)
        x = np.ones((2, HIDDEN))

        async def on_the_loop() -> Any:
            return layer.forward(x)

        with pytest.raises(CollectiveError, match="run the layer's compute in a thread"):
            group.progress.run(on_the_loop())
        return layer(x)  # nothing was started: the ranks are still in step

    first, second = on_ranks(2, body)
    np.testing.assert_array_equal(first, second)


async def test_plain_group_layer_on_the_loop_raises_then_works_from_threads() -> None:
    """A plain ``Group``: on its loop's thread the layer raises ``CollectiveError``; from
    worker threads it hands the collectives to that loop and matches ``Linear``."""
    full = linear(HIDDEN, OUT, np.float64)
    x = normal((4, HIDDEN), np.float64, 1)
    async with local_tcp_group(2, timeout=TIMEOUT) as transports:
        groups = [Group(t) for t in transports]
        layers = [RowParallelLinear.from_linear(full, g, input_is_parallel=False)
                  for g in groups]
        for layer in layers:
            with pytest.raises(CollectiveError, match="blocking API"):
                layer.forward(x)
        async with asyncio.timeout(BOUND):
            outputs = await asyncio.gather(*(asyncio.to_thread(layer, x) for layer in layers))
        for y in outputs:
            assert_close(y, full(x), np.float64, "row output")
        for g in groups:
            await g.aclose()


async def test_group_on_a_transport_bound_to_no_loop_raises_collective_error() -> None:
    """``InProcessTransport`` names no loop, so a layer in a worker thread cannot know where
    to hand its collective: a clear ``CollectiveError`` rather than a guess."""
    transports = InProcessTransport.create_group(2, timeout=TIMEOUT)
    layer = ColumnParallelLinear(IN, HIDDEN, Group(transports[0]),
                                 rng=np.random.default_rng(0), gather_output=True)
    with pytest.raises(CollectiveError, match="bound to no loop"):
        await asyncio.to_thread(layer.forward, np.ones((1, IN)))
    with pytest.raises(CollectiveError, match="thread running the group's event loop"):
        layer.forward(np.ones((1, IN)))
    for t in transports:
        await t.aclose()


# -- communication ------------------------------------------------------------------------


def payload(window: Traffic) -> dict[int, PeerTraffic]:
    """Per peer, the data messages of a window (wire bytes differ by tag encodings)."""
    return {peer: PeerTraffic(t.sent_bytes, t.sent_messages, t.received_bytes,
                              t.received_messages) for peer, t in window.peers.items()}


@pytest.mark.parametrize("n", [2, 4])
async def test_column_relu_row_moves_one_all_reduce_each_way(n: int) -> None:
    """Over TCP (shared memory off, so every byte is counted), a column -> ReLU -> row
    forward moves per rank and per peer exactly the data messages of one all-reduce of the
    (batch, out) output, and backward those of one all-reduce of the (batch, in) input
    gradient; the outputs match the single-process block."""
    batch = 16
    full_a, full_b = linear(IN, HIDDEN, np.float64), linear(HIDDEN, OUT, np.float64, SEED + 1)
    reference = Sequential(full_a, ReLU(), full_b)
    x, grad = normal((batch, IN), np.float64, 1), normal((batch, OUT), np.float64, 2)
    y_ref, ctx_ref = reference.forward(x)
    grad_in_ref = reference.backward(ctx_ref, grad)

    async with local_tcp_group(n, timeout=TIMEOUT, heartbeat_interval=60.0) as transports:
        groups = [Group(t, shared_memory=False) for t in transports]
        models = [Sequential(ColumnParallelLinear.from_linear(full_a, g), ReLU(),
                             RowParallelLinear.from_linear(full_b, g)) for g in groups]

        async def each(fn: Callable[[int], Any]) -> list[Any]:
            async with asyncio.timeout(BOUND):
                return list(await asyncio.gather(*(fn(r) for r in range(n))))

        def snapshot() -> list[Traffic]:
            return [t.traffic() for t in transports]

        async def reference_all_reduce(shape: tuple[int, ...]) -> list[Any]:
            return await each(lambda r: groups[r].all_reduce(np.ones(shape)))

        def step(model: Sequential) -> tuple[np.ndarray, np.ndarray]:
            y, ctx = model.forward(x)
            return y, model.backward(ctx, grad)

        await each(lambda r: asyncio.to_thread(step, models[r]))  # connects every pair
        await reference_all_reduce((batch, OUT))
        await reference_all_reduce((batch, IN))

        start = snapshot()
        forwards = await each(lambda r: asyncio.to_thread(models[r].forward, x))
        after_forward = snapshot()
        await reference_all_reduce((batch, OUT))
        after_ref_out = snapshot()
        grads_in = await each(lambda r: asyncio.to_thread(models[r].backward,
                                                          forwards[r][1], grad))
        after_backward = snapshot()
        await reference_all_reduce((batch, IN))
        after_ref_in = snapshot()

        for r in range(n):
            assert_close(forwards[r][0], y_ref, np.float64, "block output")
            assert_close(grads_in[r], grad_in_ref, np.float64, "block input gradient")
            forward = payload(after_forward[r] - start[r])
            backward = payload(after_backward[r] - after_ref_out[r])
            assert forward == payload(after_ref_out[r] - after_forward[r]), f"rank {r}"
            assert backward == payload(after_ref_in[r] - after_backward[r]), f"rank {r}"
            assert sum(t.sent_bytes for t in forward.values()) > 0
            assert forward != backward  # (batch, 6) and (batch, 5): told apart
        for g in groups:
            await g.aclose()
