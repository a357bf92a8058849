"""DistributedDataParallel, unmodified, on netdist: the same training run as on Gloo.

Every scenario runs twice, as fresh rank processes: once with backend ``"gloo"`` and once
with ``"netdist"``.  Seeds, data, model and code are identical; only the backend name
differs.  The 2-rank scenarios share one process group per backend (each builds its own
model and DDP wrapper, reseeded), which saves six process launches.

Each rank starts from a *different* random initialisation, so the parameters only agree
because DDP broadcasts rank 0's at construction.  At 2 ranks a sum of two floats does not
depend on the order it is taken in, so the runs must agree bit for bit; at 3 ranks the
reduction order may differ between backends, so they agree to 1e-6 (relative).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .torch_ranks import (CANDIDATE, TEST_TIMEOUT, assert_bitwise_equal, init_process_group,
                          run_ranks, synthetic_classification)

# Two runs of rank processes per test: on a loaded machine that can outlast the default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]

PER_RANK_BATCH = 16
FEATURES = 64
CLASSES = 10


def make_data(world_size: int, steps: int,
              image: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batches of every step (``world_size * PER_RANK_BATCH`` rows each).

    ``image`` reshapes the 64 features to 1x8x8 images for the CNN.
    """
    x, y = synthetic_classification(steps, world_size * PER_RANK_BATCH, FEATURES, CLASSES)
    if image:
        x = x.reshape(steps, world_size * PER_RANK_BATCH, 1, 8, 8)
    return x, y


def make_mlp(layers: int = 2) -> nn.Sequential:
    """A small MLP: ``layers - 1`` hidden 64-wide ReLU layers, then a 10-way head."""
    mods: list[nn.Module] = []
    for _ in range(layers - 1):
        mods += [nn.Linear(FEATURES, FEATURES), nn.ReLU()]
    mods.append(nn.Linear(FEATURES, CLASSES))
    return nn.Sequential(*mods)


def make_bn_cnn() -> nn.Sequential:
    """A small CNN on 1x8x8 images with a BatchNorm2d between the conv and the head."""
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 8 * 8, CLASSES))


def local_batch(x: torch.Tensor, y: torch.Tensor, step: int,
                rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s contiguous share of step ``step``'s global batch."""
    rows = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    return x[step, rows], y[step, rows]


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter and buffer, by name."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ddp_train(rank: int, world_size: int, *, steps: int, model: str = "mlp", layers: int = 2,
              bucket_cap_mb: float | None = None, accumulate: int = 1) -> dict[str, Any]:
    """Train with DDP (default process group) for ``steps`` optimizer steps.

    ``accumulate > 1`` runs ``accumulate - 1`` micro-batches under ``no_sync()`` before
    the synchronising one (each micro-batch is a fresh batch of the data stream).  The
    result holds every micro-batch's local loss, the parameters before and after DDP's
    construction, the final parameters, and for BatchNorm models the BN buffers seen at
    the start and at the end of each forward.
    """
    torch.manual_seed(100 + rank)  # different on every rank: DDP must broadcast rank 0's
    net = make_bn_cnn() if model == "bn_cnn" else make_mlp(layers)
    before = params_of(net)
    kwargs: dict[str, Any] = {}
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    ddp = DDP(net, **kwargs)
    after_construction = params_of(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data(world_size, steps * accumulate, image=(model == "bn_cnn"))

    bn_pre: list[list[torch.Tensor]] = []
    bn_post: list[list[torch.Tensor]] = []
    if model == "bn_cnn":
        bn = net[1]

        def snapshot() -> list[torch.Tensor]:  # running_mean, running_var, num_batches_tracked
            return [buf.detach().clone() for buf in bn.buffers()]

        bn.register_forward_pre_hook(lambda mod, args: bn_pre.append(snapshot()))
        bn.register_forward_hook(lambda mod, args, out: bn_post.append(snapshot()))

    losses = []
    unsynced_grads: list[torch.Tensor] = []
    synced_grads: list[torch.Tensor] = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            xb, yb = local_batch(x, y, step * accumulate + micro, rank)
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = nn.functional.cross_entropy(ddp(xb), yb)
                loss.backward()
            losses.append(loss.detach())
            if accumulate > 1:
                grad = next(ddp.parameters()).grad
                assert grad is not None
                (synced_grads if last else unsynced_grads).append(grad.detach().clone())
        opt.step()
    result: dict[str, Any] = {
        "before": before,
        "after_construction": after_construction,
        "losses": torch.stack(losses),
        "final": params_of(net),
        "final_params": {k: v.detach().clone() for k, v in net.named_parameters()},
        "bn_pre": bn_pre,
        "bn_post": bn_post,
        "unsynced_grads": unsynced_grads,
        "synced_grads": synced_grads,
        # DDP rebuilds its buckets in gradient-ready order after the first step.
        "buckets": str(ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")),
        "buckets_reduced": int(ddp._get_ddp_logging_data().get("num_buckets_reduced", 0)),
    }
    return result


def ddp_scenarios(rank: int, world_size: int, backend: str, init_method: str, out_dir: str,
                  *, scenarios: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Join the process group, then run :func:`ddp_train` once per named scenario."""
    init_process_group(rank, world_size, backend, init_method)
    return {name: ddp_train(rank, world_size, **kwargs) for name, kwargs in scenarios.items()}


#: one run's per-rank results
Results = list[dict[str, Any]]
#: per scenario name: the Gloo run's and the candidate run's results
Runs = dict[str, tuple[Results, Results]]

#: the 2-rank scenarios: ddp_train's keyword arguments by name
TWO_RANK_SCENARIOS: dict[str, dict[str, Any]] = {
    "mlp": {"steps": 120},
    "batchnorm": {"steps": 20, "model": "bn_cnn"},
    "buckets": {"steps": 30, "layers": 4, "bucket_cap_mb": 0.005},
    "no_sync": {"steps": 15, "accumulate": 3},
}


def run_both(root: Path, world_size: int,
             scenarios: dict[str, dict[str, Any]]) -> Runs:
    """Run the scenarios on Gloo, then on the candidate backend (netdist).

    Returns, per scenario, the Gloo run's and the candidate run's per-rank results.
    """
    gloo, cand = (run_ranks(ddp_scenarios, world_size, backend, root / backend,
                            scenarios=scenarios)
                  for backend in ("gloo", CANDIDATE))
    return {name: ([r[name] for r in gloo], [r[name] for r in cand]) for name in scenarios}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every 2-rank scenario, on Gloo and on netdist."""
    return run_both(tmp_path_factory.mktemp("ddp"), 2, TWO_RANK_SCENARIOS)


def check_replicas(results: list[dict[str, Any]]) -> None:
    """DDP's invariants within one run: broadcast at construction, identical replicas."""
    ref = results[0]
    for rank, res in enumerate(results[1:], start=1):
        # The ranks started different, so equality below is DDP's broadcast at work.
        assert not torch.equal(res["before"]["0.weight"], ref["before"]["0.weight"])
        assert_bitwise_equal(res["after_construction"], ref["before"],
                             f"rank {rank}'s parameters after DDP() vs rank 0's initial ones")
        assert_bitwise_equal(res["final_params"], ref["final_params"],
                             f"rank {rank}'s final parameters vs rank 0's")


def test_two_ranks_losses_bitwise_equal_to_gloo_for_120_steps(two_ranks: Runs) -> None:
    steps = TWO_RANK_SCENARIOS["mlp"]["steps"]
    gloo, cand = two_ranks["mlp"]
    for results in (gloo, cand):
        check_replicas(results)
    for rank in range(2):
        nd, gl = cand[rank], gloo[rank]
        assert nd["losses"].shape == (steps,)
        assert_bitwise_equal(nd["losses"], gl["losses"], f"rank {rank}'s per-step losses")
        assert_bitwise_equal(nd["final"], gl["final"], f"rank {rank}'s final parameters")
    losses = cand[0]["losses"]
    assert losses[-10:].mean() < 0.5 * losses[0]  # it does learn


def test_three_ranks_losses_within_1e_6_of_gloo(tmp_path: Path) -> None:
    steps = 60
    gloo, cand = run_both(tmp_path, 3, {"mlp": {"steps": steps}})["mlp"]
    for results in (gloo, cand):
        check_replicas(results)
    for rank in range(3):
        nd, gl = cand[rank], gloo[rank]
        assert nd["losses"].shape == (steps,)
        torch.testing.assert_close(nd["losses"], gl["losses"], rtol=1e-6, atol=0.0)
        for name, value in nd["final"].items():
            torch.testing.assert_close(value, gl["final"][name], rtol=1e-5, atol=1e-6)


def test_batchnorm_buffers_are_broadcast_from_rank_0_as_on_gloo(two_ranks: Runs) -> None:
    steps = TWO_RANK_SCENARIOS["batchnorm"]["steps"]
    gloo, cand = two_ranks["batchnorm"]
    for backend, results in (("gloo", gloo), (CANDIDATE, cand)):
        check_replicas(results)
        for rank, res in enumerate(results):
            assert len(res["bn_pre"]) == len(res["bn_post"]) == steps
            for step in range(1, steps):
                # DDP broadcasts rank 0's buffers before each forward: what every rank
                # holds when its BatchNorm runs is what rank 0 held after the last one.
                assert_bitwise_equal(res["bn_pre"][step], results[0]["bn_post"][step - 1],
                                     f"{backend} rank {rank}'s BN buffers at step {step}")
        # Each rank's own forward moves its statistics to different values; without the
        # broadcast the replicas would drift apart.
        assert all(not torch.equal(results[1]["bn_post"][s][0], results[0]["bn_post"][s][0])
                   for s in range(steps))
    for rank in range(2):
        nd, gl = cand[rank], gloo[rank]
        assert_bitwise_equal(nd["bn_pre"], gl["bn_pre"], f"rank {rank}'s BN buffers")
        assert_bitwise_equal(nd["bn_post"], gl["bn_post"], f"rank {rank}'s BN buffers")
        assert_bitwise_equal(nd["losses"], gl["losses"], f"rank {rank}'s per-step losses")
        assert_bitwise_equal(nd["final"], gl["final"], f"rank {rank}'s final state")


def test_three_gradient_buckets_as_on_gloo(two_ranks: Runs) -> None:
    gloo, cand = two_ranks["buckets"]
    for results in (gloo, cand):
        check_replicas(results)
    for rank in range(2):
        nd, gl = cand[rank], gloo[rank]
        # 52.5 KB of gradients, 5 KB cap: 3 buckets, each all-reduced asynchronously as
        # soon as its gradients are ready, while backward goes on with the next ones.
        assert nd["buckets"] == gl["buckets"] == "19240, 16640, 16640"
        assert nd["buckets_reduced"] == gl["buckets_reduced"] == 3
        assert_bitwise_equal(nd["losses"], gl["losses"], f"rank {rank}'s per-step losses")
        assert_bitwise_equal(nd["final"], gl["final"], f"rank {rank}'s final parameters")


def test_no_sync_accumulation_as_on_gloo(two_ranks: Runs) -> None:
    steps, accumulate = (TWO_RANK_SCENARIOS["no_sync"][k] for k in ("steps", "accumulate"))
    gloo, cand = two_ranks["no_sync"]
    for results in (gloo, cand):
        check_replicas(results)
        r0, r1 = results
        assert len(r0["unsynced_grads"]) == steps * (accumulate - 1)
        # Under no_sync() each rank accumulates only its own gradients ...
        assert all(not torch.equal(a, b)
                   for a, b in zip(r0["unsynced_grads"], r1["unsynced_grads"], strict=True))
        # ... and the synchronising backward leaves the same averaged sum on both.
        assert_bitwise_equal(r0["synced_grads"], r1["synced_grads"], "synced gradients")
    for rank in range(2):
        nd, gl = cand[rank], gloo[rank]
        assert nd["losses"].shape == (steps * accumulate,)
        for key in ("losses", "unsynced_grads", "synced_grads", "final"):
            assert_bitwise_equal(nd[key], gl[key], f"rank {rank}'s {key}")
