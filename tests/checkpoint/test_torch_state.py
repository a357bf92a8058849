"""Checkpoints of real torch training state (issue 15, item 3).

Model and optimizer ``state_dict()``s go into ``save`` / ``load`` and the per-rank API as
they are; modules, optimizers and ``RNGState`` restore in place (an optimizer's lazily
created state included); tied weights are stored once and tied again; replicated buffers
that differ between ranks warn or refuse; a consolidated file feeds
``load_state_dict(strict=True)`` and ``from_pretrained``; bf16/fp16 round-trip bitwise
with and without ``ml_dtypes`` (and fail clearly without torch either).

Unit tests run their ranks on an in-process ``Group`` (real files). The acceptance test
trains in real processes over TCP (``torch_ckpt_worker.py``): saved at 2 ranks, resumed
at 3, compared with the uninterrupted run bit for bit.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from netdist.checkpoint import (
    AsyncCheckpointer,
    ReplicaCheck,
    ReplicaDivergenceWarning,
    RNGState,
    consolidate,
    list_checkpoints,
    load,
    load_distributed,
    load_metadata,
    save,
    save_distributed,
)
from netdist.collectives import Group
from netdist.errors import CheckpointError, CheckpointMismatchError, TensorDeviceError
from tests.checkpoint import torch_bf16_worker as bf16
from tests.ranks import finish_ranks, run_ranks, start_ranks

REPO = Path(__file__).resolve().parents[2]
OP_TIMEOUT = 20.0


# --------------------------------------------------------------------------- helpers


def assert_bitwise(actual: Any, expected: Any, where: str = "state") -> None:
    """Equal structure, equal plain values, tensors of equal dtype, shape and bits."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), \
            f"{where}: {actual.dtype} {list(actual.shape)} != " \
            f"{expected.dtype} {list(expected.shape)}"
        a = actual.detach().contiguous().reshape(-1).view(torch.uint8)
        e = expected.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, e), f"{where}: bits differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {type(actual).__name__} is not a dict"
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_bitwise(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), \
            f"{where}: {actual!r} != {expected!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bitwise(a, e, f"{where}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, \
            f"{where}: {actual!r} != {expected!r}"


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class TinyLM(torch.nn.Module):
    """GPT-2's layout in miniature: the output projection is the embedding (tied)."""

    def __init__(self, vocab: int = 64, dim: int = 16, tied: bool = True) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.ln = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(self.wte(tokens)))


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.95), amsgrad=True)


def trained(kind: str, steps: int = 3, seed: int = 0) -> tuple[Mlp, torch.optim.Optimizer]:
    """A model and optimizer after ``steps`` steps on fixed data (same on every call)."""
    torch.manual_seed(seed)
    model = Mlp()
    optimizer = make_optimizer(kind, model.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(8, 6, generator=gen)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.linspace(-1, 1, 48).reshape(8, 6)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def data_bytes(directory: Path) -> int:
    """Tensor bytes (header excluded) of every safetensors file in ``directory``."""
    total = 0
    for path in directory.glob("*.safetensors"):
        raw = path.read_bytes()
        (header,) = struct.unpack("<Q", raw[:8])
        total += len(raw) - 8 - header
    return total


def safetensors_header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length])


# --------------------------------------------------------------------------- state dicts


@pytest.mark.parametrize("kind", ["sgd", "adam"])
async def test_state_dicts_go_in_as_they_are_and_come_back_bitwise(tmp_path: Path,
                                                                   kind: str) -> None:
    model, optimizer = trained(kind)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "epoch": 3}
    await run_ranks(2, lambda g: save(state, tmp_path, g, timeout=OP_TIMEOUT))

    # no `like`: the saved tree, torch tensors, at another world size
    for got in await run_ranks(3, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT)):
        assert_bitwise(got["model"], state["model"], "model")
        assert_bitwise(got["optim"], state["optim"], "optim")  # param_groups too
        assert got["epoch"] == 3
    meta = load_metadata(tmp_path)
    assert "optim.param_groups" in meta.state.objects  # plain values: JSON, once
    expected_state = {"sgd": {"momentum_buffer"},
                      "adam": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}}[kind]
    assert {name.split(".")[-1] for name in meta.tensor_specs
            if name.startswith("optim.state.")} == expected_state

    # the rebuilt state dicts load into a new model and optimizer, which then train on
    # exactly like the originals
    got = (await run_ranks(1, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT)))[0]
    torch.manual_seed(42)
    model2 = Mlp()
    optimizer2 = make_optimizer(kind, model2.parameters())
    model2.load_state_dict(got["model"], strict=True)
    optimizer2.load_state_dict(got["optim"])
    one_step(model, optimizer)
    one_step(model2, optimizer2)
    assert_bitwise(model2.state_dict(), model.state_dict(), "model after a step")
    assert_bitwise(optimizer2.state_dict(), optimizer.state_dict(), "optimizer after a step")


@pytest.mark.parametrize("kind", ["sgd", "adam"])
async def test_load_restores_model_and_fresh_optimizer_in_place(tmp_path: Path,
                                                                kind: str) -> None:
    model, optimizer = trained(kind)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(2):
        one_step(model, optimizer)
        scheduler.step()
    torch.manual_seed(5)
    np.random.seed(6)
    state = {"model": model, "optim": optimizer, "sched": scheduler, "rng": RNGState(),
             "step": 12}
    await run_ranks(2, lambda g: save(state, tmp_path, g, timeout=OP_TIMEOUT))
    expected = copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict(),
                              "sched": scheduler.state_dict()})
    after_rng = (torch.rand(3), np.random.random(3))

    fresh: list[dict[str, Any]] = []
    for rank in range(3):
        torch.manual_seed(100 + rank)  # different weights, no optimizer state yet
        m = Mlp()
        o = make_optimizer(kind, m.parameters())
        fresh.append({"model": m, "optim": o,
                      "sched": torch.optim.lr_scheduler.StepLR(o, step_size=9, gamma=0.1),
                      "rng": RNGState(), "step": 0})
    assert not fresh[0]["optim"].state
    pointers = [[p.data_ptr() for p in f["model"].parameters()] for f in fresh]
    np.random.seed(999)
    results = await run_ranks(3, lambda g: load(tmp_path, g, like=fresh[g.rank],
                                                timeout=OP_TIMEOUT))
    # the generators are where they were at save time (the last rank restored them)
    assert torch.equal(torch.rand(3), after_rng[0])
    assert np.array_equal(np.random.random(3), after_rng[1])
    for rank, (f, got) in enumerate(zip(fresh, results)):
        assert got["model"] is f["model"] and got["optim"] is f["optim"]
        assert got["step"] == 12
        # parameters were filled in place: same tensors, same memory
        assert [p.data_ptr() for p in f["model"].parameters()] == pointers[rank]
        assert len(f["optim"].state) == len(list(f["model"].parameters()))  # created
        assert_bitwise(f["model"].state_dict(), expected["model"], "model")
        assert_bitwise(f["optim"].state_dict(), expected["optim"], "optim")
        assert_bitwise(f["sched"].state_dict(), expected["sched"], "sched")
    # and they train on exactly like the original
    one_step(model, optimizer)
    one_step(fresh[2]["model"], fresh[2]["optim"])
    assert_bitwise(fresh[2]["model"].state_dict(), model.state_dict(), "after a step")
    assert_bitwise(fresh[2]["optim"].state_dict(), optimizer.state_dict(), "after a step")


async def test_a_model_that_does_not_match_is_refused_before_reading(tmp_path: Path) -> None:
    model, _ = trained("sgd")
    await run_ranks(1, lambda g: save({"model": model}, tmp_path, g, timeout=OP_TIMEOUT))

    class Wider(Mlp):
        def __init__(self) -> None:
            super().__init__()
            self.fc2 = torch.nn.Linear(10, 4)  # 4 outputs where the checkpoint has 3

    class Extra(Mlp):
        def __init__(self) -> None:
            super().__init__()
            self.fc3 = torch.nn.Linear(3, 3)

    class Fewer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(6, 10)

    cases = [(Wider(), r"'model.fc2.weight': target shape \(4, 10\)"),
             (Extra(), r"holds tensors the checkpoint lacks: \['model.fc3.bias', "
                       r"'model.fc3.weight'\]"),
             (Fewer(), r"the checkpoint has tensors that 'model' \(Fewer\) lacks: "
                       r"\['model.fc2.bias', 'model.fc2.weight'\]")]
    for target, message in cases:
        before = copy.deepcopy(target.state_dict())
        errors = await run_ranks(1, lambda g: load(tmp_path, g, like={"model": target},
                                                   timeout=OP_TIMEOUT), return_exceptions=True)
        assert isinstance(errors[0], CheckpointMismatchError), errors[0]
        assert re.search(message, str(errors[0])), str(errors[0])
        assert_bitwise(target.state_dict(), before, "untouched")
    fewer = Fewer()
    await run_ranks(1, lambda g: load(tmp_path, g, like={"model": fewer}, strict=False,
                                      timeout=OP_TIMEOUT))
    assert torch.equal(fewer.fc1.weight, model.fc1.weight)


async def test_state_dict_views_as_like_fill_the_parameters(tmp_path: Path) -> None:
    model, optimizer = trained("adam")
    await run_ranks(2, lambda g: save({"model": model.state_dict()}, tmp_path, g,
                                      timeout=OP_TIMEOUT))
    torch.manual_seed(9)
    targets = [Mlp() for _ in range(2)]
    await run_ranks(2, lambda g: load(tmp_path, g, like={"model": targets[g.rank].state_dict()},
                                      timeout=OP_TIMEOUT))
    for target in targets:
        assert_bitwise(target.state_dict(), model.state_dict())
    # named_parameters() (Parameters with requires_grad) work as well, in place
    target = Mlp()
    await run_ranks(1, lambda g: load(
        tmp_path, g, like={"model": dict(target.named_parameters())}, timeout=OP_TIMEOUT))
    assert_bitwise(target.state_dict(), model.state_dict())
    assert all(p.requires_grad for p in target.parameters())


async def test_optimizer_state_dict_as_like_needs_its_lazy_state(tmp_path: Path) -> None:
    """A state dict is data, not the optimizer: it cannot grow the state a fresh optimizer
    lacks, and says what to pass instead."""
    model, optimizer = trained("sgd")
    await run_ranks(1, lambda g: save({"optim": optimizer.state_dict()}, tmp_path, g,
                                      timeout=OP_TIMEOUT))
    fresh = make_optimizer("sgd", Mlp().parameters())
    errors = await run_ranks(1, lambda g: load(tmp_path, g, like={"optim": fresh.state_dict()},
                                               timeout=OP_TIMEOUT), return_exceptions=True)
    assert isinstance(errors[0], CheckpointMismatchError)
    assert "optim.state.0.momentum_buffer" in str(errors[0])
    got = await run_ranks(1, lambda g: load(tmp_path, g, like={"optim": fresh},
                                            timeout=OP_TIMEOUT))
    assert got[0]["optim"] is fresh
    assert_bitwise(fresh.state_dict(), optimizer.state_dict())


def test_per_rank_api_takes_state_dicts(tmp_path: Path) -> None:
    model, optimizer = trained("adam")
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 7}
    for rank in range(2):
        result = save_distributed(state, tmp_path, rank, 2, step=7)
    assert result.committed
    torch.manual_seed(3)
    target = Mlp()
    target_optimizer = make_optimizer("adam", target.parameters())
    for rank in range(3):
        got = load_distributed(tmp_path, rank, 3, like={"model": target,
                                                        "optim": target_optimizer, "step": 0})
        assert got["step"] == 7 and got["model"] is target
        assert_bitwise(target.state_dict(), model.state_dict(), f"rank {rank} model")
        assert_bitwise(target_optimizer.state_dict(), optimizer.state_dict(), f"rank {rank}")
    # without like: the flat names, as before; out= fills torch tensors in place
    flat = load_distributed(tmp_path, 0, 1)
    assert np.array_equal(flat["model.fc1.weight"], model.fc1.weight.detach().numpy())
    out = {"model.fc2.bias": torch.zeros(3)}
    got = load_distributed(tmp_path, 0, 1, out=out)
    assert got["model.fc2.bias"] is out["model.fc2.bias"]
    assert torch.equal(out["model.fc2.bias"], model.fc2.bias.detach())
    # plain values that differ per rank are stored per rank
    for rank in range(2):
        save_distributed({"model": model.state_dict(), "cursor": rank * 10}, tmp_path / "pr",
                         rank, 2)
    assert load_metadata(tmp_path / "pr").state.rank_objects == {"cursor": (0, 10)}
    got = load_distributed(tmp_path / "pr", 1, 2, like={"model": Mlp().state_dict(),
                                                        "cursor": -1})
    assert got["cursor"] == 10
    # the background checkpointer takes a flat state_dict() of tensors (bf16 included)
    half = {**model.state_dict(), "fc1.weight": model.fc1.weight.detach().to(torch.bfloat16)}
    with AsyncCheckpointer(tmp_path / "async", 0, 1) as checkpointer:
        checkpointer.save_async(half, step=1).wait(timeout=OP_TIMEOUT)
    target = {k: torch.zeros_like(v) for k, v in half.items()}
    load_distributed(tmp_path / "async", 0, 1, out=target)
    assert_bitwise(target, half)


# --------------------------------------------------------------------------- tied weights


async def test_tied_weights_are_stored_once_and_tied_again(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tied = TinyLM()
    untied = TinyLM(tied=False)
    untied.load_state_dict(tied.state_dict())
    state_tied = {"model": tied.state_dict()}
    await run_ranks(2, lambda g: save(state_tied, tmp_path / "tied", g, timeout=OP_TIMEOUT))
    await run_ranks(2, lambda g: save({"model": untied.state_dict()}, tmp_path / "untied", g,
                                      timeout=OP_TIMEOUT))
    wte_bytes = tied.wte.weight.numel() * 4
    tied_dir, untied_dir = tmp_path / "tied" / "step_000000", tmp_path / "untied" / "step_000000"
    assert data_bytes(tied_dir) == data_bytes(untied_dir) - wte_bytes
    sizes = [sum(p.stat().st_size for p in d.glob("*.safetensors")) for d in (tied_dir, untied_dir)]
    assert sizes[1] - sizes[0] >= wte_bytes
    assert "model.lm_head.weight" not in load_metadata(tied_dir).tensor_specs

    # no like: one tensor under both names
    for got in await run_ranks(3, lambda g: load(tmp_path / "tied", g, timeout=OP_TIMEOUT)):
        assert got["model"]["lm_head.weight"] is got["model"]["wte.weight"]
        assert_bitwise(got["model"], state_tied["model"])
        fresh = TinyLM()
        fresh.load_state_dict(got["model"], strict=True)
        assert fresh.lm_head.weight is fresh.wte.weight
    # in place into a tied model: the tie survives, the values are the saved ones
    torch.manual_seed(1)
    targets = [TinyLM() for _ in range(2)]
    await run_ranks(2, lambda g: load(tmp_path / "tied", g, like={"model": targets[g.rank]},
                                      timeout=OP_TIMEOUT))
    for target in targets:
        assert target.lm_head.weight is target.wte.weight
        assert_bitwise(target.state_dict(), tied.state_dict())
    # into an untied model both copies get the one stored tensor
    target = TinyLM(tied=False)
    await run_ranks(1, lambda g: load(tmp_path / "tied", g, like={"model": target},
                                      timeout=OP_TIMEOUT))
    assert_bitwise(target.state_dict(), tied.state_dict())


def _tiny_gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1,
                                     n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


async def test_gpt2_checkpoint_matches_save_pretrained_and_from_pretrained(tmp_path: Path
                                                                           ) -> None:
    model = _tiny_gpt2()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.lm_head.weight is model.transformer.wte.weight
    await run_ranks(2, lambda g: save({"model": model.state_dict()}, tmp_path / "ckpt", g,
                                      timeout=OP_TIMEOUT))
    model.save_pretrained(tmp_path / "hf")
    # the tie is stored once: exactly the tensor bytes save_pretrained writes
    assert data_bytes(tmp_path / "ckpt" / "step_000000") == data_bytes(tmp_path / "hf")

    export = tmp_path / "export"
    export.mkdir()
    consolidate(tmp_path / "ckpt", export / "model.safetensors", prefix="model.", tied="drop")
    model.config.save_pretrained(export)
    assert safetensors_header(export / "model.safetensors")["__metadata__"]["format"] == "pt"
    loaded = transformers.GPT2LMHeadModel.from_pretrained(export)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert_bitwise(loaded.state_dict(), reference, "from_pretrained")

    consolidate(tmp_path / "ckpt", tmp_path / "full.safetensors", prefix="model.")
    fresh = transformers.GPT2LMHeadModel(model.config)
    fresh.load_state_dict(safetensors.torch.load_file(tmp_path / "full.safetensors"),
                          strict=True)
    assert_bitwise(fresh.state_dict(), reference, "load_file + load_state_dict")


async def test_consolidated_file_loads_with_load_state_dict_strict(tmp_path: Path) -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = TinyLM()
            self.bn = torch.nn.BatchNorm1d(16)
            self.half = torch.nn.Linear(4, 4).to(torch.float16)

    torch.manual_seed(0)
    net = Net()
    net.bn(torch.randn(8, 16))  # running stats and num_batches_tracked (int64) move
    optimizer = torch.optim.Adam(net.parameters())
    net.lm(torch.arange(4)).sum().backward()
    optimizer.step()
    await run_ranks(2, lambda g: save({"model": net, "optim": optimizer}, tmp_path / "ckpt", g,
                                      timeout=OP_TIMEOUT))
    consolidate(tmp_path / "ckpt", tmp_path / "net.safetensors", prefix="model.")
    torch.manual_seed(1)
    fresh = Net()
    fresh.load_state_dict(safetensors.torch.load_file(tmp_path / "net.safetensors"),
                          strict=True)
    assert_bitwise(fresh.state_dict(), net.state_dict())
    assert fresh.bn.num_batches_tracked.dtype == torch.int64


# --------------------------------------------------------------------------- replicas


def _bn_model(rank: int) -> torch.nn.Module:
    """Equal parameters on every rank; BatchNorm statistics from this rank's data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    model(torch.randn(10, 4, generator=torch.Generator().manual_seed(rank)))
    return model


async def test_replicated_buffers_that_differ_warn_and_save_rank_0s(tmp_path: Path) -> None:
    models = [_bn_model(rank) for rank in range(3)]
    with pytest.warns(ReplicaDivergenceWarning) as caught:
        await run_ranks(3, lambda g: save({"model": models[g.rank]}, tmp_path, g,
                                          timeout=OP_TIMEOUT))
    assert len(caught) == 3  # every rank says so
    text = str(caught[0].message)
    assert "'model.1.running_mean' differs between rank 0 and ranks 1, 2" in text
    assert "'model.1.running_var'" in text and "rank 0's copy" in text
    assert "weight" not in text and "num_batches_tracked" not in text  # those are equal
    got = (await run_ranks(1, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT)))[0]
    assert_bitwise(got["model"], models[0].state_dict())  # rank 0's, as the warning says


async def test_replicated_buffers_that_differ_refuse_when_asked(tmp_path: Path) -> None:
    models = [_bn_model(rank) for rank in range(2)]
    for check in (ReplicaCheck.ERROR, "error", True):
        errors = await run_ranks(2, lambda g: save({"model": models[g.rank]}, tmp_path, g,
                                                   check_replicated=check,
                                                   timeout=OP_TIMEOUT),
                                 return_exceptions=True)
        for error in errors:
            assert isinstance(error, CheckpointMismatchError), error
            assert "'model.1.running_mean' differs between rank 0 and rank 1" in str(error)
            assert "nothing was saved" in str(error)
        assert list_checkpoints(tmp_path) == []
    # off: no comparison, no warning (warnings are errors here)
    await run_ranks(2, lambda g: save({"model": models[g.rank]}, tmp_path, g,
                                      check_replicated=ReplicaCheck.OFF, timeout=OP_TIMEOUT))
    assert [step for step, _ in list_checkpoints(tmp_path)] == [0]
    with pytest.raises(ValueError, match="check_replicated"):
        await run_ranks(1, lambda g: save({"m": models[0]}, tmp_path, g,
                                          check_replicated="sometimes"))


# --------------------------------------------------------------------------- dtypes


def _parent_bf16_checkpoint(root: Path) -> None:
    """bf16 saved from ml_dtypes NumPy arrays (no torch involved) at 2 ranks."""
    state = {"model": {"w": bf16.bf16_bits().view(ml_dtypes.bfloat16),
                       "h": bf16.fp16_bits().view(np.float16), "f": bf16.f32_values()},
             "step": 3}
    asyncio.run(run_ranks(2, lambda g: save(state, root, g, timeout=OP_TIMEOUT)))


async def test_bf16_and_fp16_round_trip_bitwise_through_safetensors_own_dtypes(
        tmp_path: Path) -> None:
    await run_ranks(2, lambda g: save(bf16.torch_state(), tmp_path, g, timeout=OP_TIMEOUT))
    step_dir = tmp_path / "step_000000"
    codes = {}
    for path in step_dir.glob("*.safetensors"):
        codes.update({k: v["dtype"] for k, v in safetensors_header(path).items()
                      if k != "__metadata__"})
        for name, tensor in safetensors.torch.load_file(path).items():  # plain safetensors
            if name == "model.w":
                assert tensor.dtype == torch.bfloat16
                assert np.array_equal(bf16.raw_bits(tensor), bf16.bf16_bits())
    assert codes == {"model.w": "BF16", "model.h": "F16", "model.f": "F32"}
    for got in await run_ranks(3, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT)):
        bf16.check_torch_state(got, "load without like")
    like = {"model": {"w": torch.zeros(7, 5, dtype=torch.bfloat16),
                      "h": torch.zeros(9, dtype=torch.float16), "f": torch.zeros(3, 4)},
            "step": 0}
    got = (await run_ranks(1, lambda g: load(tmp_path, g, like=like, timeout=OP_TIMEOUT)))[0]
    assert got["model"]["w"] is like["model"]["w"]
    bf16.check_torch_state(got, "load into like")
    # with ml_dtypes the flat per-rank API gives NumPy bf16, same bits
    flat = load_distributed(tmp_path, 0, 1)
    assert flat["model.w"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(bf16.raw_bits(flat["model.w"]), bf16.bf16_bits())
    consolidate(tmp_path, tmp_path / "all.safetensors")
    tensors = safetensors.torch.load_file(tmp_path / "all.safetensors")
    assert np.array_equal(bf16.raw_bits(tensors["model.w"]), bf16.bf16_bits())
    assert np.array_equal(bf16.raw_bits(tensors["model.h"]), bf16.fp16_bits())


def _run_hidden(mode: str, directory: Path, hide: list[str]) -> None:
    prelude = "; ".join(f"sys.modules[{name!r}] = None" for name in hide)
    code = (f"import sys, runpy; {prelude}; "
            f"runpy.run_module('tests.checkpoint.torch_bf16_worker', run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code, mode, str(directory)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), \
        f"{mode} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


def test_bf16_without_ml_dtypes_round_trips_as_torch_bf16(tmp_path: Path) -> None:
    _parent_bf16_checkpoint(tmp_path / "parent")
    _run_hidden("no-ml-dtypes", tmp_path, ["ml_dtypes"])
    # what the process without ml_dtypes wrote reads back here (with it) bit for bit
    for name in ("mine", "mine_per_rank"):
        flat = load_distributed(tmp_path / name, 0, 1)
        assert flat["model.w"].dtype == np.dtype(ml_dtypes.bfloat16)
        assert np.array_equal(bf16.raw_bits(flat["model.w"]), bf16.bf16_bits())
        assert np.array_equal(bf16.raw_bits(flat["model.h"]), bf16.fp16_bits())
    got = asyncio.run(run_ranks(2, lambda g: load(tmp_path / "mine", g, timeout=OP_TIMEOUT)))
    for state in got:
        bf16.check_torch_state(state, "written without ml_dtypes")


def test_bf16_without_ml_dtypes_or_torch_is_a_clear_error(tmp_path: Path) -> None:
    _parent_bf16_checkpoint(tmp_path / "parent")
    _run_hidden("no-torch", tmp_path, ["ml_dtypes", "torch"])


def test_netdist_checkpoint_never_imports_torch() -> None:
    code = """
import asyncio, sys, tempfile
import numpy as np
from netdist.checkpoint import RNGState, load, load_distributed, save, save_distributed
from netdist.collectives import Group
from netdist.transport import InProcessTransport

async def main(d):
    ts = InProcessTransport.create_group(2, timeout=10)
    gs = [Group(t) for t in ts]
    state = {"w": np.ones(3), "rng": RNGState(), "step": 1}
    await asyncio.gather(*(save(state, d, g) for g in gs))
    await asyncio.gather(*(load(d, g, like=state) for g in gs))
    for x in (*gs, *ts):
        await x.aclose()

with tempfile.TemporaryDirectory() as d:
    asyncio.run(main(d))
    save_distributed({"a": {"b": np.zeros(2)}, "n": 1}, d + "/p", 0, 1)
    load_distributed(d + "/p", 0, 1, like={"a": {"b": np.zeros(2)}, "n": 0})
print("torch" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"]


async def test_tensors_a_checkpoint_cannot_address_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(TensorDeviceError, match=r"'w': the tensor is on device meta.*\.cpu\(\)"):
        save_distributed({"w": torch.empty(3, device="meta")}, tmp_path, 0, 1)
    with pytest.raises(TypeError, match=r"'z': torch dtype torch.complex64 cannot be stored"):
        save_distributed({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path, 0, 1)
    errors = await run_ranks(2, lambda g: save(
        {"w": torch.empty(3, device="meta") if g.rank == 1 else torch.empty(3)}, tmp_path, g,
        timeout=OP_TIMEOUT), return_exceptions=True)
    assert isinstance(errors[1], TensorDeviceError) and "device meta" in str(errors[1])
    assert isinstance(errors[0], CheckpointError) and "rank(s) 1" in str(errors[0])
    assert list_checkpoints(tmp_path) == []


# --------------------------------------------------------------------------- acceptance


def _run_job(n: int, args: list[str], out: Path, timeout: float = 90.0) -> list[dict[str, Any]]:
    """``n`` worker processes joined over TCP on 127.0.0.1, run to the end (bounded); what
    each rank saved."""
    out.mkdir(parents=True)
    procs = start_ranks(n, "tests.checkpoint.torch_ckpt_worker", [*args[:2], str(out), *args[2:]],
                        timeout=60, job_prefix="ckpt")
    for rank, done in enumerate(finish_ranks(procs, timeout)):
        assert done.returncode == 0, f"rank {rank} of {args[0]} failed:\n{done.stdout}"
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(n)]


@pytest.mark.slow
@pytest.mark.timeout(200)  # two jobs of up to 90 s each: torch starts slowly on a busy box
def test_saved_at_two_ranks_resumed_at_three_matches_the_uninterrupted_run(
        tmp_path: Path) -> None:
    steps, save_at = 6, 3
    ckpt = tmp_path / "ckpt"
    uninterrupted = _run_job(2, ["fresh", str(ckpt), str(steps), str(save_at)], tmp_path / "a")
    for other in uninterrupted[1:]:
        assert_bitwise(other["final"], uninterrupted[0]["final"], "ranks of the 2-rank run")
    meta = load_metadata(ckpt)
    assert (meta.num_ranks, meta.step) == (2, save_at)
    assert set(meta.state.objects["rng"]) == {"python", "numpy", "torch"}  # equal: once
    assert not meta.state.rank_objects

    resumed = _run_job(3, ["resume", str(ckpt), str(steps)], tmp_path / "b")
    reference = uninterrupted[0]
    for rank, result in enumerate(resumed):
        assert result["world_size"] == 3 and result["start"] == save_at
        # model, optimizers (momentum buffers, Adam moments and step: created in the fresh
        # optimizers) and the schedule are exactly the saved ones
        assert_bitwise(result["restored"], reference["at_save"], f"rank {rank} restored")
        # and training on continues exactly as if it had never stopped
        assert result["losses"] == reference["losses"][save_at:]
        assert_bitwise(result["final"], reference["final"], f"rank {rank} final")
        # without the generators the batches differ, and so does the result
        assert differs(result["no_rng"]["model"], reference["final"]["model"])
