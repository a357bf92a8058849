"""netdist checkpoints of torch tensor-parallel models: ``DTensor`` state dicts saved with
their placements and loaded in place into models parallelized otherwise (issue 30,
item 4).

A model parallelized with torch's own ``parallelize_module`` (``ColwiseParallel`` /
``RowwiseParallel``) on the process group backend ``"netdist"`` has ``DTensor``
parameters; ``netdist.checkpoint.save`` / ``load`` take its ``state_dict()`` (or the
module itself) as they are. A torch program reaches the netdist ``Group`` behind its
default process group as ``dist.group.WORLD.netdist_group`` and runs the checkpoint
coroutine on that group's progress thread, ``dist.group.WORLD.job.run(...)``.

- 2 ranks, tensor parallel over a 1-D ``("tp",)`` mesh: save; load into a model
  initialised otherwise at tp=2 again; a ``Partial`` DTensor is refused by name;
- 4 ranks, a ``("dp", "tp")`` = 2 x 2 mesh, tensor parallel over ``mesh["tp"]``: load the
  tp=2 checkpoint into the module itself, save (placements on the whole mesh:
  replicated along dp);
- in this process, one rank, no process group: both checkpoints into a plain model.

Every load is compared bit for bit with the full tensors saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from netdist.checkpoint import load, load_distributed, load_metadata, save

from .torch_ranks import (CANDIDATE, TEST_TIMEOUT, assert_bitwise_equal, init_process_group,
                          run_ranks)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]

PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


class MLP(nn.Module):
    """11 hidden units: an uneven split over 2 ranks (torch's rule: 6 and 5)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(8, 11)
        self.down = nn.Linear(11, 6)
        self.norm = nn.LayerNorm(6)  # not parallelized: plain, replicated tensors
        with torch.no_grad():
            self.norm.weight.uniform_()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every DTensor gathered whole (a copy)."""
    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).clone()
            for name, value in model.state_dict().items()}


def local_weight(model: nn.Module) -> torch.Tensor:
    """This rank's local part of the first layer's weight (a ``DTensor``)."""
    return cast(DTensor, model.get_parameter("up.weight")).to_local()


def _world() -> Any:
    """The default process group: a netdist ``ProcessGroupNetdist``."""
    return dist.group.WORLD


def save_tp2(rank: int, world_size: int, backend: str, init_method: str, out_dir: str, *,
             checkpoint: str) -> dict[str, Any]:
    init_process_group(rank, world_size, backend, init_method)
    pg = _world()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = parallelize_module(MLP(seed=0), mesh, PLAN)
    saved = full_state(model)
    pg.job.run(save({"model": model.state_dict(), "step": 3}, checkpoint, pg.netdist_group))
    # a DTensor holding partial sums cannot be stored: every rank is told so
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    try:
        pg.job.run(save({"p": partial}, Path(checkpoint) / "partial", pg.netdist_group))
    except ValueError as exc:
        refused = str(exc)
    else:
        refused = ""
    # into a model initialised otherwise, parallelized alike
    again = parallelize_module(MLP(seed=1), mesh, PLAN)
    weight = local_weight(again)
    pg.job.run(load(checkpoint, pg.netdist_group, like={"model": again.state_dict(),
                                                         "step": 0}))
    assert local_weight(again).data_ptr() == weight.data_ptr()  # in place
    return {"saved": saved, "again": full_state(again), "refused": refused,
            "local": list(local_weight(model).shape)}


def load_dp2_tp2(rank: int, world_size: int, backend: str, init_method: str, out_dir: str, *,
                 checkpoint: str, resaved: str) -> dict[str, Any]:
    init_process_group(rank, world_size, backend, init_method)
    pg = _world()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(MLP(seed=2), mesh["tp"], PLAN)
    got = pg.job.run(load(checkpoint, pg.netdist_group, like={"model": model, "step": 0}))
    assert got["model"] is model and got["step"] == 3
    pg.job.run(save({"model": model.state_dict(), "step": 4}, resaved, pg.netdist_group))
    return {"loaded": full_state(model)}


def plain_load(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint loaded into an unparallelized model in this process (one rank)."""
    model = MLP(seed=3)
    load_distributed(checkpoint, 0, 1, like={"model": model.state_dict(), "step": 0})
    return {name: value.clone() for name, value in model.state_dict().items()}


def test_dtensor_state_saves_with_placements_and_loads_into_any_parallelism(
        tmp_path: Path) -> None:
    first, second = tmp_path / "tp2", tmp_path / "dp2tp2"
    tp2 = run_ranks(save_tp2, 2, CANDIDATE, tmp_path / "run1", checkpoint=str(first))
    reference = tp2[0]["saved"]
    assert [r["local"] for r in tp2] == [[6, 8], [5, 8]]
    for rank, result in enumerate(tp2):
        assert_bitwise_equal(result["saved"], reference, f"rank {rank}'s full state")
        assert_bitwise_equal(result["again"], reference, f"tp=2 again, rank {rank}")
        assert "'p': a DTensor with a Partial placement" in result["refused"], result
    meta = load_metadata(first)
    assert meta.mesh == {"shape": [2], "names": ["tp"]}
    up, down = meta.tensor_specs["model.up.weight"], meta.tensor_specs["model.down.weight"]
    assert up.mesh is not None and up.mesh.extents == ((6, 5), (8,))
    assert down.mesh is not None and [str(p) for p in down.mesh.placements] == ["Shard(1)"]
    assert meta.tensor_specs["model.norm.weight"].is_replicated
    assert_bitwise_equal(plain_load(first), reference, "tp=2 checkpoint in one plain model")

    dp2tp2 = run_ranks(load_dp2_tp2, 4, CANDIDATE, tmp_path / "run2", checkpoint=str(first),
                       resaved=str(second))
    for rank, result in enumerate(dp2tp2):
        assert_bitwise_equal(result["loaded"], reference, f"dp=2 x tp=2, rank {rank}")
    meta = load_metadata(second)
    assert meta.mesh == {"shape": [2, 2], "names": ["dp", "tp"]}
    up = meta.tensor_specs["model.up.weight"]
    assert up.mesh is not None and [str(p) for p in up.mesh.placements] == \
        ["Replicate()", "Shard(0)"]
    assert_bitwise_equal(plain_load(second), reference, "dp2 x tp2 checkpoint, plain model")
