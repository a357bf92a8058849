"""FSDP2 (``fully_shard`` on a CPU DeviceMesh), unmodified, on netdist: Gloo's losses.

The same sharded MLP trains twice as fresh rank processes, on Gloo and on netdist,
with identical seeds, data and code, once on each of three mesh layouts: a 1-D mesh and
two 2-D meshes over the same 2 ranks (a 2x2 mesh would need 4 ranks, too slow here).
FSDP2 all-gathers parameters before each layer's forward and backward and
reduce-scatters the gradients (all-reduces them across a replicate dimension).  At
2 ranks every reduction adds two floats, which gives the same bits in either order, so
the tests assert *bitwise* equal losses and parameters: Gloo's own runs are
deterministic, and the three mesh layouts give the very same bits too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from .torch_ranks import (CANDIDATE, TEST_TIMEOUT, assert_bitwise_equal, init_process_group,
                          run_ranks, synthetic_classification, train_steps)

# Two runs of rank processes per test: on a loaded machine that can outlast the default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]

WORLD = 2
PER_RANK_BATCH = 8
STEPS = 8


def make_model() -> nn.Sequential:
    """The MLP every run shards, seeded so every rank and run starts from the same values."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def train(model: nn.Module, rank: int, world_size: int) -> torch.Tensor:
    """``STEPS`` Adam steps on this rank's share of each global batch; the local losses."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return train_steps(model, opt, rank, world_size, STEPS, PER_RANK_BATCH)


def fsdp_train(rank: int, world_size: int, backend: str, init_method: str, out_dir: str,
               *, meshes: Sequence[tuple[int, ...]]) -> dict[str, Any]:
    """For each mesh shape: shard a fresh model with ``fully_shard``, train, report.

    A 1-D shape is plain FSDP over its one dimension; a 2-D shape is HSDP, named
    ``("replicate", "shard")``.  Per mesh the result holds the local losses, the shape of
    this rank's local shard of the first weight, and the full (all-gathered) parameters.
    """
    init_process_group(rank, world_size, backend, init_method)
    results: dict[str, Any] = {}
    for shape in meshes:
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = make_model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        losses = train(model, rank, world_size)
        weight = model[0].weight
        assert isinstance(weight, DTensor)
        results[str(shape)] = {
            "losses": losses,
            "local_shape": list(weight.to_local().shape),
            "local": weight.to_local().detach().clone(),
            "full": {k: v.full_tensor().detach().clone()
                     for k, v in model.named_parameters() if isinstance(v, DTensor)},
        }
    return results


def reference_losses() -> list[torch.Tensor]:
    """The same training, undistributed: one model per rank-batch averaged by hand.

    Each step averages the two ranks' gradients like the data-parallel runs do, so this
    is what FSDP2 must compute up to rounding.  Returns each rank's local loss per step.
    """
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = synthetic_classification(STEPS, WORLD * PER_RANK_BATCH)
    losses: list[list[torch.Tensor]] = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        for rank in range(WORLD):
            rows = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
            loss = nn.functional.cross_entropy(model(x[step, rows]), y[step, rows])
            (loss / WORLD).backward()
            losses[rank].append(loss.detach())
        opt.step()
        opt.zero_grad()
    return [torch.stack(per_rank) for per_rank in losses]


#: the mesh shapes every run trains on, one after the other in the same process group
MESHES = [(2,), (2, 1), (1, 2)]
#: per-rank results of the Gloo run and of the candidate run
Runs = tuple[list[Any], list[Any]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """:func:`fsdp_train` over :data:`MESHES` on Gloo, then on the candidate (netdist)."""
    root = tmp_path_factory.mktemp("fsdp2")
    return (run_ranks(fsdp_train, WORLD, "gloo", root / "gloo", meshes=MESHES),
            run_ranks(fsdp_train, WORLD, CANDIDATE, root / CANDIDATE, meshes=MESHES))


def test_fully_shard_on_1d_cpu_mesh_matches_gloo_bitwise(runs: Runs) -> None:
    gloo, cand = runs
    reference = reference_losses()
    for rank in range(WORLD):
        nd, gl = cand[rank]["(2,)"], gloo[rank]["(2,)"]
        assert nd["local_shape"] == [32, 64]  # each rank holds half of the 64x64 weight
        assert_bitwise_equal(nd["losses"], gl["losses"], f"rank {rank}'s losses")
        assert_bitwise_equal(nd["local"], gl["local"], f"rank {rank}'s shard")
        assert_bitwise_equal(nd["full"], gl["full"], f"rank {rank}'s full parameters")
        torch.testing.assert_close(nd["losses"], reference[rank], rtol=1e-5, atol=1e-6)
    assert not torch.equal(cand[0]["(2,)"]["local"], cand[1]["(2,)"]["local"])
    assert_bitwise_equal(cand[1]["(2,)"]["full"], cand[0]["(2,)"]["full"], "replicas")
    assert cand[0]["(2,)"]["losses"][-1] < cand[0]["(2,)"]["losses"][0]


def test_fully_shard_on_2d_cpu_meshes_matches_gloo_bitwise(runs: Runs) -> None:
    # Two ranks only: (2, 1) replicates across both ranks (HSDP's all-reduce across the
    # "replicate" dimension), (1, 2) shards across both (reduce-scatter within "shard").
    gloo, cand = runs
    for rank in range(WORLD):
        for shape in ("(2, 1)", "(1, 2)"):
            nd, gl = cand[rank][shape], gloo[rank][shape]
            assert_bitwise_equal(nd["losses"], gl["losses"], f"{shape} rank {rank}'s losses")
            assert_bitwise_equal(nd["full"], gl["full"], f"{shape} rank {rank}'s parameters")
        assert cand[rank]["(2, 1)"]["local_shape"] == [64, 64]  # replicated, not sharded
        assert cand[rank]["(1, 2)"]["local_shape"] == [32, 64]
        # Same averaged gradients whichever way the mesh splits the two ranks.
        for shape in ("(2, 1)", "(1, 2)"):
            assert_bitwise_equal(cand[rank][shape]["losses"], cand[rank]["(2,)"]["losses"],
                                 f"rank {rank}'s losses, {shape} vs the 1-D mesh")
