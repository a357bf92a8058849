"""torch.distributed.checkpoint, unmodified, on netdist: save sharded, load resharded.

The flow, run once on Gloo and once on netdist (fresh rank processes, same seeds, data and
code): 2 ranks shard an MLP with FSDP2, train a few Adam steps and ``dcp.save`` the model
and optimizer state dicts (``torch.distributed.checkpoint.state_dict`` helpers); then
3 ranks build the model from *different* random values, shard it three ways (uneven
shards: 50 rows split 17/17/16) and ``dcp.load`` the checkpoint.  DCP plans both sides
with torch's object collectives (gather/scatter/broadcast of plans) and barriers, so the
whole exchange runs through the backend under test.  The test also loads each checkpoint
into a plain model in the pytest process (world size 1, no process group).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._pytree import tree_map_only

from .torch_ranks import (CANDIDATE, TEST_TIMEOUT, assert_bitwise_equal, init_process_group,
                          run_ranks, train_steps)

# Two runs of rank processes per test: on a loaded machine that can outlast the default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]

PER_RANK_BATCH = 8
SAVE_WORLD = 2
LOAD_WORLD = 3
FULL = StateDictOptions(full_state_dict=True)


def make_model(seed: int) -> nn.Sequential:
    """An MLP whose row counts (50, 10) do not split evenly over 3 ranks."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 50), nn.ReLU(), nn.Linear(50, 10))


def shard(model: nn.Sequential, world_size: int) -> None:
    """``fully_shard`` each Linear and the root over a 1-D CPU mesh of every rank."""
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world_size: int,
          steps: int, seed: int) -> torch.Tensor:
    """``steps`` optimizer steps on this rank's share of a data stream; the local losses."""
    return train_steps(model, opt, rank, world_size, steps, PER_RANK_BATCH, seed=seed)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """A copy of the unsharded model and optimizer state dicts, as every rank sees them.

    Copied: some entries (Adam's ``step``) are the optimizer's own tensors, which later
    steps update in place.
    """
    model_sd, optim_sd = get_state_dict(model, opt, options=FULL)
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(),
                         {"model": model_sd, "optim": optim_sd})


def save_sharded(rank: int, world_size: int, backend: str, init_method: str, out_dir: str,
                 *, checkpoint: str) -> dict[str, Any]:
    """Train the sharded model 3 steps and ``dcp.save`` it; return the full state saved."""
    init_process_group(rank, world_size, backend, init_method)
    model = make_model(seed=0)
    shard(model, world_size)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = train(model, opt, rank, world_size, steps=3, seed=1)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    return {"losses": losses, "saved": full_state(model, opt)}


def load_resharded(rank: int, world_size: int, backend: str, init_method: str, out_dir: str,
                   *, checkpoint: str) -> dict[str, Any]:
    """Load the checkpoint into a model sharded ``world_size`` ways, then train on.

    Returns the full state right after loading, this rank's local shard shapes, and the
    losses of 2 further steps.
    """
    init_process_group(rank, world_size, backend, init_method)
    model = make_model(seed=99)  # nothing of the saved values survives unless loaded
    shard(model, world_size)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = full_state(model, opt)
    shapes = [list(p.to_local().shape) for p in model.parameters()]  # type: ignore[attr-defined]
    return {"loaded": loaded, "shapes": shapes,
            "losses": train(model, opt, rank, world_size, steps=2, seed=2)}


def load_in_one_process(checkpoint: Path) -> dict[str, Any]:
    """Load the checkpoint into a plain (unsharded) model here, without a process group."""
    model = make_model(seed=98)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():  # DCP announces the single-process load it was asked for
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


Saved = dict[str, tuple[list[dict[str, Any]], Path]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """Each backend's 2-rank sharded save: per-rank results and the checkpoint directory."""
    root = tmp_path_factory.mktemp("dcp")
    runs: Saved = {}
    for backend in ("gloo", CANDIDATE):
        checkpoint = root / backend / "checkpoint"
        results = run_ranks(save_sharded, SAVE_WORLD, backend, root / backend / "save",
                            checkpoint=str(checkpoint))
        runs[backend] = (results, checkpoint)
    return runs


def test_sharded_save_at_2_ranks_matches_gloo(saved: Saved) -> None:
    (gloo, _), (cand, checkpoint) = saved["gloo"], saved[CANDIDATE]
    assert sorted(f.name for f in checkpoint.iterdir()) == [".metadata", "__0_0.distcp",
                                                            "__1_0.distcp"]
    reference = cand[0]["saved"]
    assert sorted(reference["optim"]["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert reference["optim"]["state"]["0.weight"]["step"].item() == 3.0
    assert_bitwise_equal(cand[1]["saved"], reference, "rank 1's full state vs rank 0's")
    for rank in range(SAVE_WORLD):
        assert_bitwise_equal(cand[rank]["losses"], gloo[rank]["losses"],
                             f"rank {rank}'s losses before saving")
    # What was saved: the same bits whichever backend trained the model.
    assert_bitwise_equal(reference, gloo[0]["saved"], "saved state")


def test_load_resharded_at_3_ranks_restores_exactly_what_was_saved(saved: Saved,
                                                                   tmp_path: Path) -> None:
    loaded = {backend: run_ranks(load_resharded, LOAD_WORLD, backend, tmp_path / backend,
                                 checkpoint=str(checkpoint))
              for backend, (_, checkpoint) in saved.items()}
    for backend, results in loaded.items():
        reference = saved[backend][0][0]["saved"]
        for rank, res in enumerate(results):
            assert_bitwise_equal(res["loaded"], reference,
                                 f"{backend}: state loaded on rank {rank} of {LOAD_WORLD}")
        # Resharded: the 50 and 10 rows of the two layers split unevenly three ways.
        assert [res["shapes"] for res in results] == [
            [[17, 64], [17], [4, 50], [4]],
            [[17, 64], [17], [4, 50], [4]],
            [[16, 64], [16], [2, 50], [2]],
        ]
    # Training on from the loaded state: 3 ranks may sum in another order, so 1e-6.
    for rank in range(LOAD_WORLD):
        torch.testing.assert_close(loaded[CANDIDATE][rank]["losses"],
                                   loaded["gloo"][rank]["losses"], rtol=1e-6, atol=0.0)


def test_load_at_world_size_1_restores_exactly_what_was_saved(saved: Saved) -> None:
    for backend, (results, checkpoint) in saved.items():
        assert_bitwise_equal(load_in_one_process(checkpoint), results[0]["saved"],
                             f"{backend}'s checkpoint loaded in one process")
