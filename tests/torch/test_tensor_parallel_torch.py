"""Tensor parallelism with torch (issue 30, item 2): netdist's torch layers, and torch's own.

netdist's layers (``netdist.torch.tensor_parallel``) run on 2 blocking ``Job`` ranks over
TCP on 127.0.0.1, one thread per rank (autograd runs a CPU backward on the calling
thread, so every collective runs on its rank's thread), and are compared in float64 with
the plain torch layers they were cut from: forward output, input gradient, parameter
gradients (the pieces ``tp_placements`` names), and 20 SGD steps of column -> tanh -> row.

torch's own tensor parallelism (DTensor, ``parallelize_module`` with ``ColwiseParallel``
and ``RowwiseParallel`` on a CPU mesh) runs over the ``torch.distributed`` backend
``"netdist"`` in 2 fresh rank processes: bit for bit what it computes over Gloo (a sum of
two floats is the same in either order), and the plain model's training to 1e-12.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from netdist.errors import CollectiveError
from netdist.progress import Job
from netdist.sharding import Replicate, Shard
from netdist.torch.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_tp,
    scatter_to_tp,
)
from tests.progress.jobs import connect_jobs
from tests.ranks import on_every_rank

from .torch_ranks import (CANDIDATE, TEST_TIMEOUT, assert_bitwise_equal, init_process_group,
                          run_ranks)

WORLD = 2
TIMEOUT = 20.0
BOUND = 60.0
IN, HIDDEN, OUT = 5, 7, 6
"""7 hidden units: 4 + 3 over the two ranks."""
VOCAB, DIM = 11, 3
STEPS = 20
TOL = 1e-12


@pytest.fixture(scope="module")
def on_ranks() -> Iterator[Callable[[Callable[[Any], Any]], list[Any]]]:
    """``on_ranks(fn)``: ``fn(job.group)`` on each of 2 blocking ranks, one thread each."""
    jobs: list[Job] = connect_jobs(WORLD, timeout=TIMEOUT)
    try:
        yield lambda fn: on_every_rank(jobs, lambda job: fn(job.group), timeout=BOUND)
    finally:
        for job in jobs:
            job.close()


def seeded_linear(fan_in: int, fan_out: int, seed: int) -> nn.Linear:
    """A float64 ``nn.Linear`` drawn from its own generator (threads share torch's)."""
    layer = nn.Linear(fan_in, fan_out, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float64) - 0.5)
    return layer


def normal(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL, msg=what)


def check_grads(tp: Any, full: nn.Module, what: str) -> None:
    """``tp``'s parameter gradients are the pieces of ``full``'s its placements name."""
    expected = dict(full.named_parameters())
    assert set(tp.tp_placements) == set(expected) == {n for n, _ in tp.named_parameters()}
    for name, p in tp.named_parameters():
        assert tp.full_shapes[name] == tuple(expected[name].shape)
        close(p.grad, tp.layout.piece(name, expected[name].grad), f"{what} {name}.grad")


CASES = ["column", "column+gather", "row", "row+split-input", "column->relu->row",
         "embedding"]


def run_case(case: str, group: Any) -> None:
    """Forward and backward of ``case`` on this rank against the plain torch layers."""
    if case == "embedding":
        full: nn.Module = nn.Embedding(VOCAB, DIM, dtype=torch.float64)
        with torch.no_grad():
            full.weight.copy_(normal(VOCAB, DIM, seed=0))
        model: nn.Module = VocabParallelEmbedding.from_embedding(full, group)
        ids = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(1))
        grad = normal(4, 5, DIM, seed=2)
        y_ref = full(ids)
        y_ref.backward(grad)
        y = model(ids)
        assert_bitwise_equal(y, y_ref.detach(), "embedding output")  # a row and zeros
        y.backward(grad)
        assert_bitwise_equal(model.weight.grad, full.weight.grad[model.layout.shard.slice],
                             "embedding weight gradient")
        assert model.tp_placements == {"weight": Shard(0)}
        return
    if case == "column->relu->row":
        first, second = seeded_linear(IN, HIDDEN, 0), seeded_linear(HIDDEN, OUT, 1)
        col = ColumnParallelLinear.from_linear(first, group)
        row = RowParallelLinear.from_linear(second, group)
        full, model = nn.Sequential(first, nn.ReLU(), second), nn.Sequential(col, nn.ReLU(), row)
        fan_in, fan_out, pairs = IN, OUT, [(col, first), (row, second)]
    else:
        fan_in, fan_out = (IN, HIDDEN) if case.startswith("column") else (HIDDEN, OUT)
        linear = full = seeded_linear(fan_in, fan_out, 0)
        if case.startswith("column"):
            model = ColumnParallelLinear.from_linear(linear, group,
                                                     gather_output=case == "column+gather")
        else:
            model = RowParallelLinear.from_linear(linear, group,
                                                  input_is_parallel=case == "row")
        pairs = [(model, linear)]
    part = pairs[0][0].layout.shard.slice
    x = normal(2, 3, fan_in, seed=3).requires_grad_()
    grad = normal(2, 3, fan_out, seed=4)
    y_ref = full(x)
    y_ref.backward(grad)
    assert x.grad is not None
    grad_in_ref, x.grad = x.grad, None

    x_local = x.detach()[..., part].clone().requires_grad_() if case == "row" else x
    y = model(x_local)
    out_split = case == "column"
    close(y, y_ref.detach()[..., part] if out_split else y_ref.detach(), f"{case} output")
    y.backward(grad[..., part] if out_split else grad)
    assert x_local.grad is not None
    close(x_local.grad, grad_in_ref[..., part] if case == "row" else grad_in_ref,
          f"{case} input gradient")
    for tp, ref in pairs:
        check_grads(tp, ref, case)


@pytest.mark.parametrize("case", CASES)
def test_layers_match_plain_torch(on_ranks: Any, case: str) -> None:
    on_ranks(lambda group: run_case(case, group))


def train(model: nn.Module) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, IN, generator=gen, dtype=torch.float64)
        target = torch.randn(8, OUT, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_twenty_sgd_steps_match_the_plain_mlp(on_ranks: Any) -> None:
    def plain() -> nn.Sequential:
        return nn.Sequential(seeded_linear(IN, HIDDEN, 0), nn.Tanh(),
                             seeded_linear(HIDDEN, OUT, 1))

    def body(group: Any) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], list[Any]]:
        source = plain()
        model = nn.Sequential(ColumnParallelLinear.from_linear(source[0], group), nn.Tanh(),
                              RowParallelLinear.from_linear(source[2], group))
        losses = train(model)
        layers = [model[0], model[2]]
        return (losses, [{k: v.detach().clone() for k, v in layer.state_dict().items()}
                         for layer in layers], [layer.tp_placements for layer in layers])

    per_rank = on_ranks(body)
    reference = plain()
    ref_losses = train(reference)
    for losses, _, placements in per_rank:
        close(losses, ref_losses, "losses")
        assert placements == [{"weight": Shard(0), "bias": Shard(0)},
                              {"weight": Shard(1), "bias": Replicate()}]
    for index, full in enumerate([reference[0], reference[2]]):
        for name, value in full.state_dict().items():
            placement = per_rank[0][2][index][name]
            pieces = [r[1][index][name] for r in per_rank]
            whole = (pieces[0] if isinstance(placement, Replicate)
                     else torch.cat(pieces, dim=placement.dim))
            close(whole, value, f"layer {index} {name} after {STEPS} steps")


def test_gather_and_scatter_are_conjugate(on_ranks: Any) -> None:
    """``gather_from_tp`` puts uneven column blocks side by side and its backward keeps
    this rank's columns; ``scatter_to_tp`` the reverse."""
    def body(group: Any) -> None:
        rank = group.rank
        width = 4 if rank == 0 else 3  # 7 columns: chunk_bounds(7, 2) = [0:4], [4:7]
        local = torch.full((2, width), float(rank + 1), dtype=torch.float64,
                           requires_grad=True)
        whole = gather_from_tp(local, group, 7)
        assert whole.tolist() == [[1.0] * 4 + [2.0] * 3] * 2
        whole.backward(torch.arange(14, dtype=torch.float64).reshape(2, 7))
        assert local.grad is not None
        start = 0 if rank == 0 else 4
        assert local.grad.tolist() == [list(range(start, start + width)),
                                       list(range(7 + start, 7 + start + width))]
        x = torch.arange(7, dtype=torch.float64, requires_grad=True)
        mine = scatter_to_tp(x, group)
        assert mine.tolist() == list(range(start, start + width))
        mine.backward(torch.ones(width, dtype=torch.float64))
        assert x.grad is not None and x.grad.tolist() == [1.0] * 7

    on_ranks(body)


def test_errors_name_the_layer(on_ranks: Any) -> None:
    def body(group: Any) -> None:
        col = ColumnParallelLinear.from_linear(seeded_linear(IN, HIDDEN, 0), group)
        row = RowParallelLinear(HIDDEN, OUT, group, dtype=torch.float64)
        with pytest.raises(ValueError, match="ColumnParallelLinear.forward"):
            col(torch.zeros(2, IN + 1, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"RowParallelLinear.forward.*input \(split\)"):
            row(torch.zeros(2, HIDDEN, dtype=torch.float64))
        emb = VocabParallelEmbedding(VOCAB, DIM, group)
        with pytest.raises(TypeError, match="VocabParallelEmbedding.forward.*float32"):
            emb(torch.zeros(3))
        with pytest.raises(ValueError, match=r"\[0, 11\)"):
            emb(torch.tensor([VOCAB]))
        with pytest.raises(ValueError, match="padding_idx"):
            VocabParallelEmbedding.from_embedding(nn.Embedding(VOCAB, DIM, padding_idx=0),
                                                  group)

        async def on_the_loop() -> Any:  # backward all-reduces the input's gradient
            x = torch.zeros(1, IN, dtype=torch.float64, requires_grad=True)
            return col(x).sum().backward()

        with pytest.raises(CollectiveError, match="run the layer's compute in a thread"):
            group.progress.run(on_the_loop())

    on_ranks(body)


# -- torch's own tensor parallelism over the netdist backend ------------------------------


class Block(nn.Module):
    """fc1 -> ReLU -> fc2, the names ``parallelize_module``'s plan refers to."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32, dtype=torch.float64)
        self.fc2 = nn.Linear(32, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


DTENSOR_STEPS = 5


def dtensor_train(model: nn.Module) -> torch.Tensor:
    """A few SGD steps on the same batches on every rank (tensor parallelism: the input
    is replicated); the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(DTENSOR_STEPS):
        x = torch.randn(4, 16, generator=gen, dtype=torch.float64)
        target = torch.randn(4, 8, generator=gen, dtype=torch.float64)
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def dtensor_worker(rank: int, world_size: int, backend: str, init_method: str,
                   out_dir: str) -> dict[str, Any]:
    """``parallelize_module`` with a column-then-row plan on a 1-D CPU mesh, trained."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    init_process_group(rank, world_size, backend, init_method)
    mesh = init_device_mesh("cpu", (world_size,))
    model = parallelize_module(Block(), mesh, {"fc1": ColwiseParallel(),
                                               "fc2": RowwiseParallel()})
    weight = model.fc1.weight
    assert isinstance(weight, DTensor)
    losses = dtensor_train(model)
    return {"losses": losses, "local_shape": list(weight.to_local().shape),
            "full": {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}}


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_torch_dtensor_tensor_parallel_runs_on_netdist(tmp_path: Path) -> None:
    gloo = run_ranks(dtensor_worker, WORLD, "gloo", tmp_path / "gloo")
    cand = run_ranks(dtensor_worker, WORLD, CANDIDATE, tmp_path / CANDIDATE)
    plain = Block()
    ref_losses = dtensor_train(plain)
    for rank in range(WORLD):
        assert cand[rank]["local_shape"] == [16, 16]  # fc1's 32 rows, half on each rank
        assert_bitwise_equal(cand[rank]["losses"], gloo[rank]["losses"], f"rank {rank} losses")
        assert_bitwise_equal(cand[rank]["full"], gloo[rank]["full"], f"rank {rank} parameters")
        close(cand[rank]["losses"], ref_losses, "losses against the plain model")
        for name, value in plain.named_parameters():
            close(cand[rank]["full"][name], value.detach(), f"{name} against the plain model")
