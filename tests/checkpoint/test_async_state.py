"""``AsyncCheckpointer`` takes nested torch/NumPy training state, as ``save_distributed``.

Model and optimizer ``state_dict()``s, the module, optimizer, LR scheduler and
``RNGState`` themselves, nested dicts and lists of plain values: all snapshotted when
``save_async`` returns. The writer thread is held until training has gone on and changed
everything in place (an event the test sets, so the write provably happens after the
changes); the checkpoint then holds the state of the call, bit for bit, and a load at
another world size restores it into a fresh model and optimizer.
"""

from __future__ import annotations

import copy
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import netdist.checkpoint.async_save as async_save
from netdist.checkpoint import (
    AsyncCheckpointer,
    RNGState,
    ShardedArray,
    list_checkpoints,
    load_distributed,
    load_metadata,
    save_distributed,
)
from netdist.checkpoint.api import write_share
from netdist.errors import CheckpointError, TensorDeviceError
from tests.checkpoint.test_overlap import COLS, ROWS, STORAGE, Windowed, assert_windows
from tests.checkpoint.test_torch_state import (Mlp, TinyLM, assert_bitwise, data_bytes,
                                               make_optimizer, one_step, trained)

WAIT = 30.0


class GatedWriter:
    """Holds every background write until :meth:`release` (a real event, no sleeps)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.started = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.started.set()
        if not self.open.wait(WAIT):
            raise TimeoutError("the test never released the writer")
        return write_share(*args, **kwargs)

    def release(self) -> None:
        self.open.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> GatedWriter:
    writer = GatedWriter()
    monkeypatch.setattr(async_save, "write_share", writer)
    return writer


def run_to_save(kind: str) -> tuple[Mlp, torch.optim.Optimizer, Any]:
    """A model, optimizer and LR schedule a few steps in (the same on every call)."""
    model, optimizer = trained(kind)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(2):
        one_step(model, optimizer)
        scheduler.step()
    return model, optimizer, scheduler


def training_state(kind: str) -> dict[str, Any]:
    model, optimizer, scheduler = run_to_save(kind)
    torch.manual_seed(7)
    np.random.seed(8)
    random.seed(9)
    return {"model": model, "optim": optimizer, "sched": scheduler, "rng": RNGState(),
            "ema": {"weight": model.fc1.weight.detach().clone().numpy(), "decay": 0.99},
            "meta": {"step": 3, "lr": 0.1, "history": [1.5, 2.5], "tag": "run-a"}}


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint must hold: every part as it is now."""
    return {"model": copy.deepcopy(state["model"].state_dict()),
            "optim": copy.deepcopy(state["optim"].state_dict()),
            "sched": copy.deepcopy(state["sched"].state_dict()),
            "ema": copy.deepcopy(state["ema"]), "meta": copy.deepcopy(state["meta"]),
            "after_rng": (torch.rand(2), np.random.random(2), random.random())}


def keep_training(state: dict[str, Any]) -> None:
    """Everything moves on in place: parameters, moments, schedule, RNGs, plain values."""
    for _ in range(2):
        one_step(state["model"], state["optim"])
        state["sched"].step()
    state["ema"]["weight"] *= 0.5
    state["meta"]["history"].append(3.5)
    state["meta"]["step"] = 5
    torch.rand(5)
    np.random.random(5)
    random.random()


def fresh_like(kind: str, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Mlp()
    optimizer = make_optimizer(kind, model.parameters())
    return {"model": model, "optim": optimizer,
            "sched": torch.optim.lr_scheduler.StepLR(optimizer, step_size=9, gamma=0.1),
            "rng": RNGState(), "ema": {"weight": np.zeros((10, 6), np.float32), "decay": 0.0},
            "meta": {"step": 0, "lr": 0.0, "history": [], "tag": ""}}


def check_restored(got: dict[str, Any], like: dict[str, Any], expected: dict[str, Any],
                   where: str) -> None:
    assert got["model"] is like["model"] and got["optim"] is like["optim"]
    assert_bitwise(like["model"].state_dict(), expected["model"], f"{where} model")
    assert_bitwise(like["optim"].state_dict(), expected["optim"], f"{where} optim")
    assert_bitwise(like["sched"].state_dict(), expected["sched"], f"{where} sched")
    assert np.array_equal(got["ema"]["weight"], expected["ema"]["weight"]), where
    assert got["ema"]["weight"] is like["ema"]["weight"]  # filled in place
    assert got["ema"]["decay"] == 0.99 and got["meta"] == expected["meta"], where
    after = (torch.rand(2), np.random.random(2), random.random())  # generators restored
    assert torch.equal(after[0], expected["after_rng"][0]), where
    assert np.array_equal(after[1], expected["after_rng"][1]) and after[2] == \
        expected["after_rng"][2], where


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_nested_state_is_the_state_of_the_call_while_training_goes_on(
        tmp_path: Path, gate: GatedWriter, kind: str) -> None:
    """Two ranks save asynchronously; training changes everything in place before the
    held writes run; a 3-rank load restores the state of the call bit for bit."""
    states = [training_state(kind) for _ in range(2)]  # both ranks: same replicated state
    futures = []
    checkpointers = [AsyncCheckpointer(tmp_path, rank, 2, keep_last=2) for rank in range(2)]
    try:
        for rank, checkpointer in enumerate(checkpointers):
            futures.append(checkpointer.save_async(states[rank], step=3))
        expected = snapshot(states[0])  # the RNGs as the call left them, then drawn
        assert gate.started.wait(WAIT)  # a write is underway, held at the gate
        for state in states:
            keep_training(state)
        assert not any(f.done() for f in futures)
        changed = states[0]["model"].state_dict()
        assert any(not torch.equal(changed[k], expected["model"][k]) for k in changed)
        gate.release()
        results = [f.wait(WAIT) for f in futures]
    finally:
        gate.release()
        for checkpointer in checkpointers:
            checkpointer.close()
    assert sum(r.committed for r in results) == 1 and results[0].step == 3
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3]
    meta = load_metadata(tmp_path)
    assert meta.state.objects["meta"]["history"] == [1.5, 2.5]
    assert "optim.param_groups" in meta.state.objects

    for rank in range(3):
        like = fresh_like(kind, 100 + rank)
        got = load_distributed(tmp_path, rank, 3, like=like)
        check_restored(got, like, expected, f"rank {rank} of 3")
    # and the restored model trains on exactly like the original from the call
    original = fresh_like(kind, 1)
    load_distributed(tmp_path, 0, 1, like=original)
    reference_model, reference_optim, _ = run_to_save(kind)
    one_step(original["model"], original["optim"])
    one_step(reference_model, reference_optim)
    assert_bitwise(original["model"].state_dict(), reference_model.state_dict(), "a step on")


def test_async_files_equal_save_distributed_files(tmp_path: Path) -> None:
    """One code path: the background save of a nested state writes the same bytes."""
    state = training_state("adam")
    for rank in range(2):
        save_distributed(state, tmp_path / "sync", rank, 2)
        with AsyncCheckpointer(tmp_path / "async", rank, 2) as checkpointer:
            checkpointer.save_async(state).wait(WAIT)
    for name in ["metadata.json", "rank_00000.safetensors", "rank_00001.safetensors"]:
        assert (tmp_path / "sync" / name).read_bytes() == \
            (tmp_path / "async" / name).read_bytes(), name


def test_ties_and_views_are_staged_and_written_once(tmp_path: Path, gate: GatedWriter
                                                    ) -> None:
    torch.manual_seed(0)
    lm, windowed = TinyLM(), Windowed(0)
    state = {"lm": lm.state_dict(), "windowed": windowed, "step": 1}
    expected = copy.deepcopy({"lm": lm.state_dict(), "windowed": windowed.state_dict()})
    with AsyncCheckpointer(tmp_path, 0, 1) as checkpointer:
        held = checkpointer.reserve(state)
        stored = (lm.wte.weight.numel() + 2 * 16 + ROWS * COLS + STORAGE) * 4
        assert held == stored  # the tie and the windows take no staging memory of their own
        future = checkpointer.save_async(state, step=1)
        with torch.no_grad():
            lm.wte.weight.add_(1.0)
            windowed.weight.mul_(-1.0)
            windowed.tail.zero_()
        gate.release()
        future.wait(WAIT)
    assert data_bytes(tmp_path / "step_000001") == stored
    torch.manual_seed(5)
    target_lm, target_windowed = TinyLM(), Windowed(3)
    got = load_distributed(tmp_path, 0, 1, like={"lm": target_lm, "windowed": target_windowed,
                                                 "step": 0})
    assert got["step"] == 1
    assert_bitwise(target_lm.state_dict(), expected["lm"], "lm")
    assert target_lm.lm_head.weight is target_lm.wte.weight
    assert_bitwise(target_windowed.state_dict(), expected["windowed"], "windowed")
    assert_windows(target_windowed)


def test_invalid_nested_input_raises_at_the_call(tmp_path: Path) -> None:
    model, optimizer = trained("sgd")
    with AsyncCheckpointer(tmp_path, 0, 1) as checkpointer:
        with pytest.raises(TensorDeviceError, match=r"'model.w': the tensor is on device meta"):
            checkpointer.save_async({"model": {"w": torch.empty(3, device="meta")}})
        with pytest.raises(TypeError, match="cannot store a object in checkpoint metadata"):
            checkpointer.save_async({"model": model, "bad": object()})
        with pytest.raises(ValueError, match="is a ShardedArray: the per-rank API"):
            checkpointer.save_async({"w": ShardedArray(torch.zeros(2))})
        assert checkpointer.in_flight is None
        checkpointer.save_async({"model": model, "optim": optimizer}, step=0).wait(WAIT)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [0]


def test_a_failed_nested_write_leaves_the_previous_step(tmp_path: Path) -> None:
    model, optimizer = trained("adam")
    with AsyncCheckpointer(tmp_path, 0, 1) as checkpointer:
        checkpointer.save_async({"model": model, "optim": optimizer}, step=1).wait(WAIT)
        expected = copy.deepcopy(model.state_dict())
        (tmp_path / ".step_000002.tmp-g1").write_bytes(b"in the way")  # staging blocked
        future = checkpointer.save_async({"model": model, "optim": optimizer}, step=2)
        with pytest.raises(CheckpointError, match="rank 0 could not prepare checkpoint"):
            future.wait(WAIT)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    target = Mlp()
    load_distributed(tmp_path, 0, 1, like={"model": target, "optim": make_optimizer(
        "adam", target.parameters())})
    assert_bitwise(target.state_dict(), expected, "step 1")
