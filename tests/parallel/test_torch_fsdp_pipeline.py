"""Torch tensors in FSDP and the pipeline: the same bits as the NumPy path, bfloat16 too.

Two kinds of model:

- netdist.train's NumPy MLP fed CPU tensors (inputs, targets, gradients, state dicts):
  every result must equal, bit for bit, the run fed the same data as NumPy arrays;
- Module-API layers that compute with torch (parameters hold tensors), float32 and
  bfloat16: FSDP and the pipeline hand them tensors over their own buffers, and every
  result must equal, bit for bit, the same layers run in one process with the
  averaging written out in torch ((g0 + g1) / 2, which is how netdist rounds bfloat16).

The bfloat16 tests run once here and once in a process where ``ml_dtypes`` is hidden
(bfloat16 then travels and reduces as raw bits).
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from netdist.collectives import Group  # noqa: E402
from netdist.optim_kernels import sgd_update  # noqa: E402
from netdist.parallel.fsdp import FSDP, ShardingStrategy  # noqa: E402
from netdist.parallel.pipeline import PipelineParallel, stash_nbytes  # noqa: E402
from netdist.parallel.sharded_optim import ShardedSGD  # noqa: E402
from netdist.parallel.stages import (  # noqa: E402
    PipelineParallelConfig,
    PipelineStage,
    micro_batch_bounds,
    split_into_stages,
)
from netdist.train.losses import softmax_cross_entropy  # noqa: E402
from netdist.train.nn import mlp  # noqa: E402
from netdist.train.optimizers import SGD  # noqa: E402
from netdist.types import BFLOAT16, BFLOAT16_RAW  # noqa: E402
from tests import ranks  # noqa: E402

TIMEOUT = 20.0
WORLD = 2
SIZES = [6, 10, 8, 3]
STEPS = 3
LR = 0.05
MOMENTUM = 0.9
REPO_ROOT = Path(__file__).resolve().parents[2]
HIDDEN_ML_DTYPES = os.environ.get("NETDIST_TEST_ML_DTYPES_HIDDEN") == "1"


def bits(t: Any) -> Any:
    """A tensor's raw bits, so comparisons see -0.0, NaN payloads and bf16 exactly."""
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                   8: torch.int64}[t.element_size()])


def assert_bitwise(ours: Any, theirs: Any, what: str) -> None:
    assert torch.is_tensor(ours), f"{what}: got {type(ours).__name__}, not a tensor"
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, \
        f"{what}: {ours.dtype}{tuple(ours.shape)} != {theirs.dtype}{tuple(theirs.shape)}"
    assert torch.equal(bits(ours), bits(theirs)), f"{what}: values differ"


def test_the_carrier_is_the_expected_one() -> None:
    """This process carries bfloat16 as ml_dtypes' type, or as raw bits where hidden."""
    assert (BFLOAT16 == BFLOAT16_RAW) == HIDDEN_ML_DTYPES


# -- Module-API layers computing with torch ---------------------------------------------------

@dataclass(eq=False)
class TorchParam:
    name: str
    data: Any
    grad: Any


class TorchLinear:
    """``y = x @ W + b`` in torch; backward adds into ``p.grad`` in place."""

    def __init__(self, n_in: int, n_out: int, gen: Any, dtype: Any) -> None:
        weight = (torch.randn(n_in, n_out, generator=gen) * n_in ** -0.5).to(dtype)
        bias = (torch.randn(n_out, generator=gen) * 0.1).to(dtype)
        self.weight = TorchParam("weight", weight, torch.zeros_like(weight))
        self.bias = TorchParam("bias", bias, torch.zeros_like(bias))

    def parameters(self) -> list[TorchParam]:
        return [self.weight, self.bias]

    def named_parameters(self) -> list[tuple[str, TorchParam]]:
        return [("weight", self.weight), ("bias", self.bias)]

    def forward(self, x: Any) -> tuple[Any, Any]:
        assert torch.is_tensor(x)
        return x @ self.weight.data + self.bias.data, x

    def backward(self, x: Any, g: Any) -> Any:
        self.weight.grad += x.T @ g
        self.bias.grad += g.sum(0)
        return g @ self.weight.data.T


class TorchTanh:
    def parameters(self) -> list[TorchParam]:
        return []

    def forward(self, x: Any) -> tuple[Any, Any]:
        y = torch.tanh(x)
        return y, y

    def backward(self, y: Any, g: Any) -> Any:
        return g * (1 - y * y)


class TorchSequential:
    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers

    def parameters(self) -> list[TorchParam]:
        return [p for layer in self.layers for p in layer.parameters()]

    def named_parameters(self) -> list[tuple[str, TorchParam]]:
        return [(f"{i}.{n}", p) for i, layer in enumerate(self.layers)
                if hasattr(layer, "named_parameters") for n, p in layer.named_parameters()]

    def forward(self, x: Any) -> tuple[Any, list[Any]]:
        ctxs = []
        for layer in self.layers:
            x, ctx = layer.forward(x)
            ctxs.append(ctx)
        return x, ctxs

    def backward(self, ctxs: list[Any], g: Any) -> Any:
        for layer, ctx in zip(reversed(self.layers), reversed(ctxs)):
            g = layer.backward(ctx, g)
        return g

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad.zero_()


def torch_mlp(dtype: Any, seed: int = 1234) -> TorchSequential:
    gen = torch.Generator().manual_seed(seed)
    layers: list[Any] = []
    for a, b in zip(SIZES, SIZES[1:]):
        layers += [TorchLinear(a, b, gen, dtype), TorchTanh()]
    return TorchSequential(layers[:-1])


def mse(y: Any, t: Any) -> tuple[Any, Any]:
    """Mean squared error and its gradient, in the prediction's dtype."""
    diff = y - t
    return (diff * diff).mean(), diff * (2.0 / diff.numel())


def torch_batches(dtype: Any, rows: int, steps: int = STEPS) -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(rows, SIZES[0], generator=gen).to(dtype),
             torch.randn(rows, SIZES[-1], generator=gen).to(dtype)) for _ in range(steps)]


def sgd_reference(p: TorchParam, grad: Any, buf: Any | None) -> Any:
    """``ShardedSGD``'s rule on a whole tensor: netdist's SGD kernel in float32 (exact for
    float32; bfloat16 widened), parameter and momentum rounded back once, as torch
    rounds. Returns the new momentum buffer."""
    p32 = p.data.float().numpy().copy()
    b32 = np.zeros_like(p32) if buf is None else buf.float().numpy().copy()
    sgd_update(p32, grad.float().numpy(), b32, lr=LR, momentum=MOMENTUM, nesterov=False,
               weight_decay=0.0, first_step=buf is None)
    p.data = torch.from_numpy(p32).to(p.data.dtype)
    return torch.from_numpy(b32).to(p.data.dtype)


def rank_rows(rank: int, rows: int) -> slice:
    return slice(rank * rows, (rank + 1) * rows)


on_ranks = functools.partial(ranks.run_ranks, with_rank=True, op_timeout=TIMEOUT,
                             timeout=TIMEOUT)
"""``await on_ranks(n, fn)``: ``fn(rank, group)`` on ``n`` in-process ranks (groups with
``timeout=TIMEOUT``), within 60 s; everything closed after."""


# -- FSDP: a NumPy model fed tensors -----------------------------------------------------------

async def fsdp_numpy_model(as_tensors: bool, strategy: ShardingStrategy) -> list[Any]:
    """Three steps of a float32 NumPy MLP under FSDP, fed arrays or the same data as
    tensors; returns per rank the outputs, input gradients and final parameters."""
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((WORLD * 4, SIZES[0])).astype(np.float32),
                rng.integers(0, SIZES[-1], WORLD * 4)) for _ in range(STEPS)]
    start = {k: v.copy() for k, v in
             mlp(SIZES, rng=np.random.default_rng(99), dtype=np.float32).state_dict().items()}

    def wrap(a: np.ndarray) -> Any:
        return torch.from_numpy(a) if as_tensors else a

    async def body(rank: int, group: Group) -> Any:
        model = mlp(SIZES, rng=np.random.default_rng(1234), dtype=np.float32)
        fsdp = FSDP(model, group, strategy, optimizer=ShardedSGD(LR, momentum=MOMENTUM))
        # a torch user's state dict: Parameters that require grad
        fsdp.load_full_state_dict({k: torch.nn.Parameter(torch.from_numpy(v.copy()))
                                   if as_tensors else v for k, v in start.items()})
        outputs = []
        for x, y in batches:
            fsdp.zero_grad()
            out = await fsdp.forward(wrap(x[rank_rows(rank, 4)]))
            assert torch.is_tensor(out) == as_tensors
            logits = out.numpy() if as_tensors else out
            _, grad = softmax_cross_entropy(logits, y[rank_rows(rank, 4)])
            grad_in = await fsdp.backward(wrap(grad.astype(np.float32)))
            assert torch.is_tensor(grad_in) == as_tensors
            await fsdp.step()
            outputs.append((np.array(logits), np.asarray(grad_in).copy()))
        state = await fsdp.full_state_dict(rank0_only=False)
        assert all(isinstance(v, np.ndarray) for v in state.values())  # a NumPy module
        return outputs, state

    return await on_ranks(WORLD, body)


@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD,
                                      ShardingStrategy.NO_SHARD], ids=lambda s: s.name)
async def test_fsdp_of_a_numpy_model_fed_tensors_equals_the_numpy_run(strategy) -> None:
    arrays = await fsdp_numpy_model(False, strategy)
    tensors = await fsdp_numpy_model(True, strategy)
    for rank in range(WORLD):
        for step, ((out_a, gin_a), (out_t, gin_t)) in enumerate(zip(arrays[rank][0],
                                                                    tensors[rank][0])):
            assert np.array_equal(out_a, out_t), (rank, step)
            assert np.array_equal(gin_a, gin_t), (rank, step)
        for name, value in arrays[rank][1].items():
            assert value.tobytes() == tensors[rank][1][name].tobytes(), (rank, name)


# -- FSDP: a model of torch tensors ------------------------------------------------------------

def fsdp_reference(dtype: Any, batches: Sequence[tuple[Any, Any]], rows: int
                   ) -> tuple[list[list[Any]], dict[str, Any], dict[str, Any]]:
    """The torch model in one process: each rank's gradient, averaged as (g0 + g1) / 2,
    then ``sgd_reference``. Returns each step's per-rank outputs, the final parameters
    and the momentum buffers."""
    model = torch_mlp(dtype)
    named = dict(model.named_parameters())
    bufs: dict[str, Any] = {}
    outputs = []
    for x, t in batches:
        grads, outs = [], []
        for rank in range(WORLD):
            model.zero_grad()
            y, ctxs = model.forward(x[rank_rows(rank, rows)])
            _, g = mse(y, t[rank_rows(rank, rows)])
            model.backward(ctxs, g)
            outs.append(y)
            grads.append({n: p.grad.clone() for n, p in named.items()})
        outputs.append(outs)
        for name, p in named.items():
            bufs[name] = sgd_reference(p, (grads[0][name] + grads[1][name]) / 2,
                                       bufs.get(name))
    return outputs, {n: p.data for n, p in named.items()}, bufs


STRATEGIES = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP,
              ShardingStrategy.NO_SHARD]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_fsdp_of_torch_layers_equals_one_process(dtype: str, strategy) -> None:
    dt = getattr(torch, dtype)
    rows = 3
    batches = torch_batches(dt, WORLD * rows)
    ref_outputs, ref_params, ref_bufs = fsdp_reference(dt, batches, rows)

    async def body(rank: int, group: Group) -> Any:
        model = torch_mlp(dt)
        fsdp = FSDP(model, group, strategy, optimizer=ShardedSGD(LR, momentum=MOMENTUM))
        assert fsdp.holds_tensors
        assert all(torch.is_tensor(p.data) and p.data.dtype == dt
                   for p in model.parameters())
        outputs = []
        for x, t in batches:
            fsdp.zero_grad()
            y = await fsdp.forward(x[rank_rows(rank, rows)])
            _, g = mse(y, t[rank_rows(rank, rows)])
            assert torch.is_tensor(await fsdp.backward(g))
            await fsdp.step()
            outputs.append(y)
        assert all(torch.is_tensor(s) and s.dtype == dt for s in fsdp.local_shards())
        state = await fsdp.full_state_dict(rank0_only=False)
        optim = await fsdp.full_optim_state_dict(rank0_only=False)
        return outputs, state, optim

    for rank, (outputs, state, optim) in enumerate(await on_ranks(WORLD, body)):
        for step, y in enumerate(outputs):
            assert_bitwise(y, ref_outputs[step][rank], f"{dtype} rank {rank} output {step}")
        for name, value in ref_params.items():
            assert_bitwise(state[name], value, f"{dtype} rank {rank} parameter {name}")
            assert_bitwise(optim["state"][name]["momentum_buffer"], ref_bufs[name],
                           f"{dtype} rank {rank} momentum buffer {name}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_fsdp_state_dicts_of_torch_layers_are_tensors_over_live_storage(dtype: str
                                                                             ) -> None:
    dt = getattr(torch, dtype)
    reference = dict(torch_mlp(dt, seed=5).named_parameters())

    async def body(rank: int, group: Group) -> Any:
        fsdp = FSDP(torch_mlp(dt), group, ShardingStrategy.FULL_SHARD,
                    optimizer=ShardedSGD(LR, momentum=MOMENTUM))
        sd = fsdp.sharded_state_dict()
        assert all(torch.is_tensor(v) and v.dtype == dt for v in sd.tensors.values())
        assert {spec.dtype for spec in sd.specs.values()} == {dtype}
        for value in sd.tensors.values():  # an in-place load writes through the views
            value.fill_(rank + 1)
        await fsdp.load_sharded_state_dict(sd.tensors)
        state = await fsdp.full_state_dict(rank0_only=False)
        owners = {name: value.float().unique().tolist() for name, value in state.items()}
        # a state dict of whole tensors (torch Parameters) loads whatever the module holds
        fsdp.load_full_state_dict({name: torch.nn.Parameter(p.data.clone())
                                   for name, p in reference.items()})
        loaded = await fsdp.full_state_dict(rank0_only=False)
        # and the pieces of a sharded state dict load from copies too
        pieces = {k: v.clone() for k, v in fsdp.sharded_state_dict().tensors.items()}
        await fsdp.load_sharded_state_dict({k: torch.zeros_like(v) for k, v in pieces.items()})
        await fsdp.load_sharded_state_dict(pieces)
        again = await fsdp.full_state_dict(rank0_only=False)
        return owners, loaded, again

    for owners, loaded, again in await on_ranks(WORLD, body):
        assert all(set(values) <= {1.0, 2.0} for values in owners.values()), owners
        assert set().union(*map(set, owners.values())) == {1.0, 2.0}  # both ranks' pieces
        for name, p in reference.items():
            assert_bitwise(loaded[name], p.data, f"{dtype} {name} loaded")
            assert_bitwise(again[name], p.data, f"{dtype} {name} reloaded")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_fsdp_clips_torch_gradients_as_torch_scales_them(dtype: str) -> None:
    """The infinity norm (exact in any order) of the averaged gradients, and every
    gradient times ``max_norm / (norm + 1e-6)``: in float32, rounded once for bfloat16."""
    dt = getattr(torch, dtype)
    rows = 3
    x, t = torch_batches(dt, WORLD * rows, steps=1)[0]
    model = torch_mlp(dt)
    grads = []
    for rank in range(WORLD):
        model.zero_grad()
        y, ctxs = model.forward(x[rank_rows(rank, rows)])
        model.backward(ctxs, mse(y, t[rank_rows(rank, rows)])[1])
        grads.append([p.grad.clone() for p in model.parameters()])
    averaged = [(a + b) / 2 for a, b in zip(*grads)]
    norm = max(float(g.float().abs().max()) for g in averaged)
    coef = 0.01 / (norm + 1e-6)
    clipped = [(g.float() * coef).to(dt) for g in averaged]
    # units: one per Linear (its weight, then its bias), flattened
    per_unit = [torch.cat([clipped[i].reshape(-1), clipped[i + 1].reshape(-1)])
                for i in range(0, len(clipped), 2)]

    async def body(rank: int, group: Group) -> Any:
        fsdp = FSDP(torch_mlp(dt), group, ShardingStrategy.FULL_SHARD)
        y = await fsdp.forward(x[rank_rows(rank, rows)])
        await fsdp.backward(mse(y, t[rank_rows(rank, rows)])[1])
        found = await fsdp.clip_grad_norm(0.01, norm_type=math.inf)
        return found, fsdp.local_grad_shards()

    results = await on_ranks(WORLD, body)
    assert [found for found, _ in results] == [norm] * WORLD
    for unit, expected in enumerate(per_unit):
        ours = torch.cat([shards[unit] for _, shards in results])
        assert_bitwise(ours, expected, f"{dtype} unit {unit} clipped gradient")


async def test_fsdp_refuses_unusable_tensors_naming_them() -> None:
    async def body(rank: int, group: Group) -> None:
        model = torch_mlp(torch.bfloat16)
        fsdp = FSDP(model, group, ShardingStrategy.FULL_SHARD)
        with pytest.raises(TypeError, match=r"parameter '0.weight': dtype float32, layout has "
                                            r"bfloat16"):
            fsdp.load_full_state_dict({n: p.data.float() for n, p in
                                       torch_mlp(torch.bfloat16).named_parameters()})
        with pytest.raises(ValueError, match="netdist works on CPU tensors, got one on meta"):
            await fsdp.forward(torch.empty(2, SIZES[0], dtype=torch.bfloat16, device="meta"))
        sd = fsdp.sharded_state_dict()
        with pytest.raises(TypeError, match="dtype float32, FSDP holds bfloat16"):
            await fsdp.load_sharded_state_dict({k: v.float() for k, v in sd.tensors.items()})
        mixed = torch_mlp(torch.float32)
        mixed.layers[0].weight.data = mixed.layers[0].weight.data.numpy()
        with pytest.raises(TypeError, match="mixes parameters holding torch tensors and "
                                            "NumPy arrays"):
            FSDP(mixed, group, ShardingStrategy.FULL_SHARD)
        await fsdp.aclose()

    await on_ranks(WORLD, body)


# -- pipeline: a NumPy model fed tensors -------------------------------------------------------

pipeline_ranks = functools.partial(ranks.run_ranks, with_rank=True, as_groups=False,
                                   op_timeout=TIMEOUT)
"""``await pipeline_ranks(n, body)``: ``body(rank, transport)`` on ``n`` in-process ranks,
within 60 s; transports closed after."""


async def pipeline_numpy_model(as_tensors: bool, schedule: str) -> list[Any]:
    """Three steps of netdist.train's float64 MLP on 2 stages, inputs and targets given as
    arrays or as the same data in tensors; then ``predict``."""
    rng = np.random.default_rng(11)
    batches = [(rng.standard_normal((5, SIZES[0])), rng.integers(0, SIZES[-1], 5))
               for _ in range(STEPS)]
    config = PipelineParallelConfig(2, 2, schedule)
    layers = 2 * (len(SIZES) - 1) - 1

    def wrap(a: np.ndarray) -> Any:
        return torch.from_numpy(a) if as_tensors else a

    async def body(rank: int, transport: Any) -> Any:
        model = mlp(SIZES, rng=np.random.default_rng(1234), dtype=np.float64)
        stage = split_into_stages(layers, 2)[rank]
        pipe = PipelineParallel(transport, stage.select(model.layers), config,
                                loss_fn=softmax_cross_entropy,
                                optimizer_factory=lambda ps: SGD(ps, lr=LR, momentum=MOMENTUM),
                                timeout=TIMEOUT)
        assert not pipe.tensors
        losses = [await pipe.train_step(wrap(x), wrap(y)) for x, y in batches]
        params = {p.name: p.data.copy() for p in pipe.parameters}
        predicted = await pipe.predict(wrap(batches[0][0]))
        return losses, params, predicted

    return await pipeline_ranks(2, body)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_pipeline_of_a_numpy_model_fed_tensors_equals_the_numpy_run(schedule: str
                                                                          ) -> None:
    arrays = await pipeline_numpy_model(False, schedule)
    tensors = await pipeline_numpy_model(True, schedule)
    assert [r[0] for r in arrays] == [r[0] for r in tensors]  # the same float losses
    assert arrays[1][0][0] is not None
    for rank in range(2):
        for name, value in arrays[rank][1].items():
            assert value.tobytes() == tensors[rank][1][name].tobytes(), (rank, name)
    assert arrays[0][2] is None and tensors[0][2] is None
    assert isinstance(arrays[1][2], np.ndarray) and torch.is_tensor(tensors[1][2])
    assert arrays[1][2].tobytes() == tensors[1][2].numpy().tobytes()


def test_stash_nbytes_counts_tensor_memory_once() -> None:
    t = torch.zeros(4, 3, dtype=torch.bfloat16)
    a = np.zeros(5)
    ctx = {"x": t, "again": [t, (t,)], "rows": t[1:3], "array": a, "view": torch.from_numpy(a)}
    # t: 24 bytes once; its row slice: 12 more (another size); the array and a tensor over
    # the very same memory: 40 once
    assert stash_nbytes(ctx) == 24 + 12 + 40


# -- pipeline: torch layers ----------------------------------------------------------------------

class TorchSGD:
    """``p.data -= lr * p.grad`` in torch, in the parameters' dtype."""

    def __init__(self, params: list[TorchParam]) -> None:
        self.params = params

    def step(self) -> None:
        for p in self.params:
            p.data -= LR * p.grad


ROWS = 5       # per replica: micro-batches of 3 and 2 rows (loss weights 3/5 and 2/5)
MICRO = 2


def pipeline_reference(dt: Any, batches: Sequence[tuple[Any, Any]], replicas: int
                       ) -> tuple[list[float], dict[str, Any], Any]:
    """The torch model in one process: per replica the micro-batches' gradients of
    ``loss * rows / ROWS`` accumulated, averaged over replicas as (g0 + g1) / 2, then
    ``TorchSGD``. Returns replica 0's losses, the final parameters and its prediction of
    the first batch, micro-batch by micro-batch."""
    model = torch_mlp(dt)
    named = dict(model.named_parameters())
    optimizer = TorchSGD(list(named.values()))
    bounds = micro_batch_bounds(ROWS, MICRO)
    losses = []
    for x, t in batches:
        grads = []
        for replica in range(replicas):
            model.zero_grad()
            xs, ts = x[rank_rows(replica, ROWS)], t[rank_rows(replica, ROWS)]
            total = 0.0
            for a, b in bounds:
                y, ctxs = model.forward(xs[a:b])
                loss, g = mse(y, ts[a:b])
                total += (b - a) / ROWS * float(loss)
                model.backward(ctxs, g * ((b - a) / ROWS))
            grads.append({n: p.grad.clone() for n, p in named.items()})
            if replica == 0:
                losses.append(total)
        if replicas == 2:
            for name, p in named.items():
                p.grad = (grads[0][name] + grads[1][name]) / 2
        optimizer.step()
    x0 = batches[0][0][rank_rows(0, ROWS)]
    predicted = torch.cat([model.forward(x0[a:b])[0] for a, b in bounds])
    return losses, {n: p.data for n, p in named.items()}, predicted


async def torch_pipeline(dt: Any, schedule: str, replicas: int,
                         stages: Sequence[PipelineStage], tensors: bool | None = None
                         ) -> tuple[list[Any], list[Any]]:
    batches = torch_batches(dt, replicas * ROWS)
    config = PipelineParallelConfig(len(stages), MICRO, schedule, replicas)

    async def body(rank: int, transport: Any) -> Any:
        model = torch_mlp(dt)
        names = {id(p): n for n, p in model.named_parameters()}
        stage = stages[config.stage_of(rank)]
        replica = config.replica_of(rank)
        pipe = PipelineParallel(transport, stage.select(model.layers), config, loss_fn=mse,
                                optimizer_factory=TorchSGD, timeout=TIMEOUT, tensors=tensors)
        assert pipe.tensors
        losses = []
        for x, t in batches:
            xs, ts = x[rank_rows(replica, ROWS)], t[rank_rows(replica, ROWS)]
            losses.append(await pipe.train_step(xs if pipe.is_first else None,
                                                ts if pipe.is_last else None))
        params = {names[id(p)]: p.data.clone() for p in pipe.parameters}
        predicted = await pipe.predict(batches[0][0][rank_rows(replica, ROWS)]
                                       if pipe.is_first else None)
        return losses, params, predicted

    return batches, await pipeline_ranks(config.world_size, body)


def check_pipeline(dt: Any, batches: Any, results: list[Any], replicas: int,
                   num_stages: int) -> None:
    ref_losses, ref_params, ref_predicted = pipeline_reference(dt, batches, replicas)
    seen: dict[str, Any] = {}
    for rank, (losses, params, predicted) in enumerate(results):
        last = rank % num_stages == num_stages - 1
        if last and rank // num_stages == 0:
            assert losses == ref_losses  # replica 0's loss, the same float sums
            assert_bitwise(predicted, ref_predicted, f"rank {rank} predict")
        if not last:
            assert losses == [None] * STEPS and predicted is None
        for name, value in params.items():
            seen.setdefault(name, value)
            assert_bitwise(value, ref_params[name], f"rank {rank} {name}")
    assert sorted(seen) == sorted(ref_params)  # the stages together hold every parameter


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_pipeline_of_torch_layers_equals_one_process(dtype: str, schedule: str,
                                                           replicas: int) -> None:
    dt = getattr(torch, dtype)
    stages = split_into_stages(len(torch_mlp(dt).layers), 2)
    batches, results = await torch_pipeline(dt, schedule, replicas, stages)
    check_pipeline(dt, batches, results, replicas, 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_pipeline_stage_without_parameters_takes_tensors_when_told(dtype: str) -> None:
    """Stage 1 is a lone Tanh: no parameters say it computes with torch, tensors=True does."""
    dt = getattr(torch, dtype)
    stages = [PipelineStage(0, 1, 0), PipelineStage(1, 2, 1), PipelineStage(2, 5, 2)]
    batches, results = await torch_pipeline(dt, "1f1b", 1, stages, tensors=True)
    check_pipeline(dt, batches, results, 1, 3)


# -- the same bfloat16 tests without ml_dtypes ---------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(HIDDEN_ML_DTYPES, reason="already the run without ml_dtypes")
def test_bfloat16_tests_pass_without_ml_dtypes() -> None:
    """This file's bfloat16 tests in a process where ``ml_dtypes`` cannot be imported:
    bfloat16 is carried as raw bits and must give the very same bits."""
    script = textwrap.dedent(f'''
        import sys
        sys.modules["ml_dtypes"] = None  # as if not installed
        import pytest
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", {__file__!r},
                              "-k", "bfloat16 or carrier"]))
    ''')
    env = dict(os.environ, NETDIST_TEST_ML_DTYPES_HIDDEN="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=110, env=env, cwd=REPO_ROOT, check=False)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and " passed" in summary and "failed" not in summary, \
        done.stdout[-4000:] + done.stderr[-4000:]
