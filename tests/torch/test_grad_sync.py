"""``GradientSync``: a torch training loop on netdist's own aggregators, over real TCP.

Two runs of 2 fresh rank processes each: a reference run with DistributedDataParallel on
Gloo, and one netdist ``Job`` per rank that trains the same MLP (same seed, same data,
same SGD with momentum) once per scenario: blocking ``sync()``, overlapped ``sync()``
(post-accumulate-grad hooks reporting into an ``OverlapSession`` during backward), each
with ``zero_grad(set_to_none=False)`` and torch's default ``set_to_none=True``, both
again with the gradients as views into the all-reduce buckets, then the float16 and top-k
aggregators.

At 2 ranks the average is bitwise independent of how it is taken: DDP multiplies each
gradient by 1/2 before summing, netdist sums and then divides by 2, and both are exact
(a sum of two floats is commutative; halving is exact away from subnormals), so the
netdist runs must equal DDP bit for bit.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .torch_ranks import (TEST_TIMEOUT, assert_bitwise_equal, init_process_group,
                          run_ranks, synthetic_classification)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]

WORLD = 2
STEPS = 20
PER_RANK_BATCH = 16
FEATURES = 64
CLASSES = 10
BUCKET_MB = 0.004
"""About 4 KiB per bucket: the MLP's gradients fill several buckets."""


def make_mlp() -> nn.Sequential:
    """The same small MLP on every rank (seeded), so no broadcast is needed."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU(),
                         nn.Linear(FEATURES, FEATURES), nn.ReLU(),
                         nn.Linear(FEATURES, CLASSES))


def train(rank: int, model: nn.Module, step_fn: Any, set_to_none: bool,
          steps: int = STEPS) -> dict[str, Any]:
    """``steps`` SGD steps on this rank's slice of the shared data; ``step_fn()`` syncs
    the gradients between backward and the optimizer. Returns the final parameters and
    the gradients of the first step."""
    x, y = synthetic_classification(STEPS, WORLD * PER_RANK_BATCH, FEATURES, CLASSES)
    rows = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first_grads: list[torch.Tensor] = []
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        nn.functional.cross_entropy(model(x[step, rows]), y[step, rows]).backward()
        step_fn()
        if step == 0:
            first_grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                           for p in model.parameters()]
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "first_grads": first_grads}


def ddp_worker(rank: int, world_size: int, backend: str, init_method: str,
               out_dir: str) -> dict[str, Any]:
    """The reference: DDP on Gloo."""
    init_process_group(rank, world_size, backend, init_method)
    ddp = DDP(make_mlp())
    return train(rank, ddp, lambda: None, set_to_none=True)


def netdist_worker(rank: int, world_size: int, backend: str, init_method: str,
                   out_dir: str, token: str) -> dict[str, Any]:
    """Every GradientSync scenario on one netdist Job per rank (rank 0's coordinator on
    the port ``init_method`` names)."""
    import netdist
    from netdist.parallel.aggregators import (AllReduceAggregator, Fp16AllReduceAggregator,
                                              TopKAggregator)
    from netdist.torch.gradient_sync import GradientSync

    port = urlparse(init_method).port
    results: dict[str, Any] = {}
    with netdist.connect(rank=rank, world_size=world_size, token=token,
                         job_id=f"grad-sync-{token[:8]}", coordinator=("127.0.0.1", port),
                         listen_host="127.0.0.1", advertise_addr="127.0.0.1",
                         timeout=60.0) as job:
        ring = job.make(AllReduceAggregator, job.group, BUCKET_MB)
        for name, overlap, set_to_none, views in [("blocking", False, False, False),
                                                  ("blocking_none", False, True, False),
                                                  ("overlap", True, False, False),
                                                  ("overlap_none", True, True, False),
                                                  ("view_blocking_none", False, True, True),
                                                  ("view_overlap_none", True, True, True)]:
            model = make_mlp()
            with GradientSync(job, model, ring, overlap=overlap,
                              grad_as_bucket_view=views) as sync:
                opened: list[bool] = []
                in_buckets: list[bool] = []

                def step(sync: GradientSync = sync, opened: list[bool] = opened,
                         in_buckets: list[bool] = in_buckets) -> None:
                    opened.append(sync._session is not None)  # begun during backward?
                    sync.sync()
                    if sync._views is not None:  # every .grad is still its bucket view
                        in_buckets.append(all(
                            p.grad is not None and p.grad.data_ptr() == v.data_ptr()
                            for p, v in zip(sync.params, sync._views)))

                results[name] = train(rank, model, step, set_to_none)
                results[name]["overlapped"] = sync.overlap
                results[name]["opened_in_backward"] = all(opened)
                results[name]["grads_in_buckets"] = len(in_buckets) == STEPS and all(in_buckets)
                results[name]["buckets"] = len(ring.buckets)
        for name, make in [("fp16", lambda: job.make(Fp16AllReduceAggregator, job.group,
                                                     BUCKET_MB)),
                           ("topk", lambda: job.make(TopKAggregator, job.group, 0.25))]:
            model = make_mlp()
            with GradientSync(job, model, make(), overlap=True) as sync:
                results[name] = train(rank, model, sync.sync, True, steps=5)
                results[name]["overlapped"] = sync.overlap
    return results


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(ddp_worker, WORLD, "gloo", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def netdist_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(netdist_worker, WORLD, "netdist-job", tmp_path_factory.mktemp("job"),
                     token=secrets.token_hex(16))


RING_SCENARIOS = ["blocking", "blocking_none", "overlap", "overlap_none", "view_blocking_none",
                  "view_overlap_none"]


@pytest.mark.parametrize("scenario", RING_SCENARIOS)
def test_ring_equals_ddp_on_gloo_bitwise(ddp_run: list[dict[str, Any]],
                                         netdist_run: list[dict[str, Any]],
                                         scenario: str) -> None:
    """20 steps with GradientSync(AllReduceAggregator) give DDP's parameters bit for bit,
    blocking or overlapped, with either zero_grad flavour, on every rank."""
    for rank in range(WORLD):
        got = netdist_run[rank][scenario]
        assert got["buckets"] > 1
        assert_bitwise_equal(got["first_grads"], ddp_run[rank]["first_grads"],
                             f"rank {rank} {scenario} first-step gradients")
        assert_bitwise_equal(got["params"], ddp_run[rank]["params"],
                             f"rank {rank} {scenario} parameters after {STEPS} steps")


def test_overlap_reports_during_backward(netdist_run: list[dict[str, Any]]) -> None:
    """Overlapped mode opened its session from a gradient hook inside backward on every
    step (so buckets could travel during backward); blocking mode never did."""
    for rank in range(WORLD):
        for scenario in ("overlap", "overlap_none", "view_overlap_none"):
            assert netdist_run[rank][scenario]["overlapped"] is True
            assert netdist_run[rank][scenario]["opened_in_backward"] is True
        for scenario in ("blocking", "blocking_none", "view_blocking_none"):
            assert netdist_run[rank][scenario]["overlapped"] is False


def test_bucket_views_survive_set_to_none(netdist_run: list[dict[str, Any]]) -> None:
    """With grad_as_bucket_view, after every one of the 20 syncs (each step began with
    zero_grad(set_to_none=True)) every param.grad is again a view into the buckets."""
    for rank in range(WORLD):
        for scenario in ("view_blocking_none", "view_overlap_none"):
            assert netdist_run[rank][scenario]["grads_in_buckets"] is True


def test_overlap_equals_blocking_bitwise(netdist_run: list[dict[str, Any]]) -> None:
    """The overlapped and blocking runs agree bit for bit (same buckets, same MEAN)."""
    for rank in range(WORLD):
        run = netdist_run[rank]
        for scenario in RING_SCENARIOS[1:]:
            assert_bitwise_equal(run[scenario]["params"], run["blocking"]["params"],
                                 f"rank {rank} {scenario} vs blocking")


@pytest.mark.parametrize("scenario", ["fp16", "topk"])
def test_compressed_aggregators_keep_ranks_identical(netdist_run: list[dict[str, Any]],
                                                     scenario: str) -> None:
    """float16 (overlapped) and top-k (no ``begin``: synced after backward) train, and
    every rank ends with bitwise the same parameters."""
    assert netdist_run[0][scenario]["overlapped"] is (scenario == "fp16")
    assert_bitwise_equal(netdist_run[1][scenario]["params"], netdist_run[0][scenario]["params"],
                         f"{scenario}: rank 1 vs rank 0")
    assert_bitwise_equal(netdist_run[1][scenario]["first_grads"],
                         netdist_run[0][scenario]["first_grads"],
                         f"{scenario}: first-step gradients, rank 1 vs rank 0")


def test_fp16_first_step_is_the_mean_to_fp16_precision(
        netdist_run: list[dict[str, Any]]) -> None:
    """The float16 average of the first step equals the exact (float32) average to
    float16's precision (same start, same data: the first gradients are comparable)."""
    exact = netdist_run[0]["blocking_none"]["first_grads"]
    fp16 = netdist_run[0]["fp16"]["first_grads"]
    for i, (e, h) in enumerate(zip(exact, fp16)):
        torch.testing.assert_close(h, e, rtol=2e-3, atol=2e-5)
    assert any(not torch.equal(h, e) for e, h in zip(exact, fp16))  # float16 did round
