"""The digits CNN trained with netdist's ring aggregator equals DDP on Gloo (issue 15).

A small convolutional net on the 8x8 digits the netdist demo trains on
(``netdist.train.data``: scikit-learn's bundled images, standardised, sharded with the
demo's seeded ``shard_indices``), trained ``STEPS`` SGD-with-momentum steps at 2 and at
3 ranks, each rank a fresh process over real TCP on 127.0.0.1. Every rank process trains
the same model twice from the same seed on the same batches: once as
``DistributedDataParallel`` on a Gloo process group (the reference), once with
``netdist.torch.GradientSync`` over a netdist job's ``AllReduceAggregator`` (ring
all-reduce, mean; overlapped with backward), then returns both results.

- 2 ranks: bitwise equal. DDP halves each gradient and sums two of them, netdist sums
  two and halves; both are exact (an addition of two floats is commutative, halving is
  exact away from subnormals).
- 3 ranks: DDP sums thirds in Gloo's order, netdist divides the sum by three in its own
  ring order, so the last bits may differ; every parameter agrees within 1e-6 of its
  largest magnitude after all the steps (``MAX_RELATIVE``), and every netdist rank holds
  bitwise the same parameters.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from netdist.train.data import iterate_batches, load_digits_dataset, shard_indices

from .torch_ranks import (TEST_TIMEOUT, assert_bitwise_equal, free_port, init_process_group,
                          run_ranks)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]

STEPS = 12
PER_RANK_BATCH = 16
SEED = 0
MAX_RELATIVE = 1e-6


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and a linear classifier over 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.relu(self.conv1(x.view(-1, 1, 8, 8)))
        x = nn.functional.max_pool2d(nn.functional.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def make_cnn() -> DigitsCNN:
    """The same initial weights on every rank and in both runs (seeded)."""
    torch.manual_seed(SEED)
    return DigitsCNN()


Batches = list[tuple[np.ndarray, np.ndarray]]
"""``(features (b, 64) float32, labels (b,) int64)`` per step."""


def rank_batches(world_size: int) -> list[Batches]:
    """Every rank's ``STEPS`` batches of the demo's digits training set: its seeded shard
    of the epoch-0 permutation (DistributedSampler's layout), ``PER_RANK_BATCH`` at a
    time. Built once here and handed to the rank processes, which then need not import
    scikit-learn (seconds per process on a loaded machine)."""
    data = load_digits_dataset(seed=SEED, dtype=np.float32)
    out = []
    for rank in range(world_size):
        indices = shard_indices(len(data.x_train), rank, world_size, epoch=0, seed=SEED)
        batches = [(data.x_train[batch], data.y_train[batch])
                   for batch in iterate_batches(indices, PER_RANK_BATCH, drop_last=True)]
        assert len(batches) >= STEPS
        out.append(batches[:STEPS])
    return out


def train(model: nn.Module, batches: Batches, sync: Any = None) -> dict[str, Any]:
    """SGD with momentum over ``batches``; ``sync()`` (netdist) runs between backward and
    the step. Returns the final parameters, the first step's averaged gradients and the
    local losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    first_grads: list[torch.Tensor] = []
    losses = []
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        if sync is not None:
            sync()
        if step == 0:
            first_grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        losses.append(loss.detach())
    return {"params": [p.detach().clone() for p in model.parameters()],
            "first_grads": first_grads, "losses": torch.stack(losses)}


def both_worker(rank: int, world_size: int, backend: str, init_method: str, out_dir: str,
                netdist_port: int, token: str, batches: list[Batches]) -> dict[str, Any]:
    """One rank: the DDP-on-Gloo reference, then the same training on netdist, both on
    ``batches[rank]``."""
    import netdist
    from netdist.parallel.aggregators import AllReduceAggregator
    from netdist.torch.gradient_sync import GradientSync

    batches = batches[rank]
    init_process_group(rank, world_size, backend, init_method)
    results = {"ddp": train(DDP(make_cnn()), batches)}
    with netdist.connect(rank=rank, world_size=world_size, token=token,
                         job_id=f"digits-cnn-{token[:8]}",
                         coordinator=("127.0.0.1", netdist_port), listen_host="127.0.0.1",
                         advertise_addr="127.0.0.1", timeout=60.0) as job:
        model = make_cnn()
        with GradientSync(job, model, job.make(AllReduceAggregator, job.group),
                          overlap=True) as sync:
            results["netdist"] = train(model, batches, sync.sync)
            results["netdist"]["overlapped"] = sync.overlap
    return results


def run(world_size: int, out_dir: Path) -> list[dict[str, Any]]:
    return run_ranks(both_worker, world_size, "gloo", out_dir, netdist_port=free_port(),
                     token=secrets.token_hex(16), batches=rank_batches(world_size))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected| / max |expected|``: the error relative to the tensor's
    scale (element-wise ratios are meaningless for weights that pass through zero)."""
    return float((actual - expected).abs().max() / expected.abs().max())


def test_two_ranks_equal_ddp_on_gloo_bitwise(tmp_path: Path) -> None:
    results = run(2, tmp_path)
    for rank, result in enumerate(results):
        ours, ddp = result["netdist"], result["ddp"]
        assert ours["overlapped"] is True
        assert_bitwise_equal(ours["first_grads"], ddp["first_grads"],
                             f"rank {rank} first-step gradients")
        assert_bitwise_equal(ours["losses"], ddp["losses"], f"rank {rank} losses")
        assert_bitwise_equal(ours["params"], ddp["params"],
                             f"rank {rank} parameters after {STEPS} steps")
    assert_bitwise_equal(results[1]["netdist"]["params"], results[0]["netdist"]["params"],
                         "rank 1 vs rank 0")
    losses = results[0]["ddp"]["losses"]
    assert losses[-4:].mean() < losses[:4].mean()  # it learns


def test_three_ranks_match_ddp_on_gloo_within_1e_6(tmp_path: Path) -> None:
    results = run(3, tmp_path)
    for rank, result in enumerate(results):
        ours, ddp = result["netdist"], result["ddp"]
        assert ours["overlapped"] is True
        for what in ("first_grads", "params"):
            errors = [relative_error(a, e) for a, e in zip(ours[what], ddp[what])]
            assert len(errors) == 6 and max(errors) <= MAX_RELATIVE, \
                f"rank {rank} {what}: relative errors {errors}"
        assert_bitwise_equal(result["netdist"]["params"], results[0]["netdist"]["params"],
                             f"netdist rank {rank} vs rank 0")
