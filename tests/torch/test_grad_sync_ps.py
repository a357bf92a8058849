"""``GradientSync`` with the parameter servers, over real TCP: one run of 2 rank processes.

Each rank is one netdist ``Job`` that trains the same small classifier (same data, each
rank on its half of every batch) once per parameter-server mode:

- ``sync_ps``: the rank-0 ``ParameterServer`` averages the gradients (rank 1 starts from
  other weights and gets rank 0's through ``broadcast_params`` of its torch parameters);
  a local ``torch.optim.SGD`` steps. Must equal single-process SGD on the whole batch
  (computed in rank 0's process, which has paid torch.optim's first-use import already).
- ``sharded``: ``ColocatedPS`` on both ranks, ``max_staleness=0``, SGD with momentum on the
  servers (``ServerOptimizerAggregator``; ``GradientSync`` registers the model, so rank 1's
  own initial weights are replaced by rank 0's). Must equal the same reference.
- ``bounded``: rank 0 hosts the only server, ``max_staleness=2``; before each of its
  steps rank 0 waits until rank 1's push is held back by the bound (or rank 1 is done),
  so while rank 1 trains it runs two versions ahead and rank 0's gradients are applied
  exactly two versions late. The server's log must show that, and never more; the loss
  must fall. (The wait is on the server's own state change, not a sleep.)
- ``async``: ``max_staleness=None``; every push applies on its own, so each server's
  version ends at exactly ``2 x STEPS``; the loss must fall.
- ``bf16``: the model in bfloat16 through sharded servers (float32 master weights
  there): both ranks end with the same bfloat16 weights and the loss falls.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from torch import nn

from .torch_ranks import TEST_TIMEOUT, assert_bitwise_equal, run_ranks, synthetic_classification

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]

WORLD = 2
STEPS = 24
PER_RANK = 16
FEATURES = 16
CLASSES = 4
LR = 0.2
MOMENTUM = 0.9
BOUND = 2
BIGARRAY = 256
"""The 32x16 first weight (512 elements) is sliced across both servers."""


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(),
                         nn.Linear(32, CLASSES)).to(dtype)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_classification(STEPS, WORLD * PER_RANK, FEATURES, CLASSES)


def train(rank: int, model: nn.Module, sync: Any, opt: torch.optim.Optimizer | None,
          before_step: Any = None) -> dict[str, Any]:
    """``STEPS`` steps on this rank's half of every batch: backward, ``sync.sync()``, then
    the local optimizer if there is one (none when the servers run it)."""
    x, y = data()
    dtype = next(model.parameters()).dtype
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses = []
    for step in range(STEPS):
        if before_step is not None:
            before_step()
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x[step, rows].to(dtype)).float(),
                                           y[step, rows])
        loss.backward()
        sync.sync()
        if opt is not None:
            opt.step()
        losses.append(loss.item())
    return {"params": [p.detach().clone() for p in model.parameters()],
            "losses": torch.tensor(losses, dtype=torch.float64)}


def netdist_worker(rank: int, world_size: int, backend: str, init_method: str,
                   out_dir: str, token: str) -> dict[str, Any]:
    import netdist
    from netdist.progress.proxy import unwrap
    from netdist.ps import ColocatedPS, ParameterServer, ServerOptimizerAggregator, SGDConfig
    from netdist.ps.staleness import WorkerState
    from netdist.torch.gradient_sync import GradientSync

    ranges = set()  # each scenario reserves its own tag range from the group
    port = urlparse(init_method).port
    results: dict[str, Any] = {}
    with netdist.connect(rank=rank, world_size=world_size, token=token,
                         job_id=f"grad-sync-ps-{token[:8]}", coordinator=("127.0.0.1", port),
                         listen_host="127.0.0.1", advertise_addr="127.0.0.1",
                         timeout=60.0) as job:
        # -- the rank-0 parameter server as a gradient aggregator, local optimizer
        model = make_model(seed=rank)          # rank 1 starts elsewhere ...
        ps = job.make(ParameterServer, job.group)
        ps.broadcast_params(list(model.parameters()))   # ... and gets rank 0's weights
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        with GradientSync(job, model, ps) as sync:
            assert not sync.updates_parameters
            results["sync_ps"] = train(rank, model, sync, opt)
        ps.aclose()

        # -- servers run the optimizer: synchronous, bounded staleness, asynchronous
        for index, (name, servers, staleness, dtype) in enumerate([
                ("sharded", 2, 0, torch.float32), ("bounded", 1, BOUND, torch.float32),
                ("async", 2, None, torch.float32), ("bf16", 2, 0, torch.bfloat16)]):
            model = make_model(seed=rank, dtype=dtype)
            colocated = job.make(ColocatedPS, job.group, num_servers=servers)
            ranges.add(unwrap(colocated).client.tags.base)
            assert len(ranges) == index + 1
            updates = job.make(ServerOptimizerAggregator, colocated,
                               optimizer=SGDConfig(lr=LR, momentum=MOMENTUM),
                               max_staleness=staleness, bigarray_bound=BIGARRAY)
            before_step = None
            if name == "bounded" and rank == 0:
                server = unwrap(colocated).server

                def ahead(server: Any = server) -> None:
                    """Wait until rank 1 (worker 1) is held back by the bound, or done."""
                    job.run(server.wait_until(lambda s: s.clock.blocked or s.clock.state(1)
                                              is WorkerState.DONE, timeout=30.0))

                before_step = ahead
            with GradientSync(job, model, updates) as sync:
                assert sync.updates_parameters
                initial = [p.detach().clone() for p in model.parameters()]
                results[name] = train(rank, model, sync, None, before_step)
                results[name]["initial"] = initial
            report = colocated.close()
            results[name]["log"] = ([] if report is None else
                                    [[e.worker, e.worker_version, e.server_version]
                                     for e in report.log])
            results[name]["version"] = -1 if report is None else report.version
    if rank == 0:  # here, where torch.optim is imported already (seconds, the first time)
        results["reference"] = single_process_reference()
    return results


def single_process_reference() -> dict[str, Any]:
    """SGD with momentum on the whole batch of every step, in one process."""
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = data()
    for step in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[step]), y[step]).backward()
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()]}


def assert_learns(losses: torch.Tensor) -> None:
    """The loss fell: the last 6 steps average under half of the first 4 (each step's
    batch differs, so single losses are noisy)."""
    assert losses[-6:].mean() < 0.5 * losses[:4].mean(), losses.tolist()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(netdist_worker, WORLD, "netdist-job", tmp_path_factory.mktemp("ps"),
                     token=secrets.token_hex(16))


@pytest.mark.parametrize("scenario", ["sync_ps", "sharded"])
def test_synchronous_ps_equals_single_process_sgd(run: list[dict[str, Any]],
                                                  scenario: str) -> None:
    """24 steps of the 2-rank job with the synchronous parameter server (gradients
    averaged on rank 0 and SGD local, or SGD on the sharded servers) give the
    parameters of single-process SGD with momentum on the whole batch (the largest
    difference measured: 2.4e-7)."""
    reference = run[0]["reference"]["params"]
    for rank in range(WORLD):
        for got, want in zip(run[rank][scenario]["params"], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_bitwise_equal(run[1][scenario]["params"], run[0][scenario]["params"],
                         f"{scenario}: rank 1 vs rank 0")


def test_registering_the_model_gives_every_rank_rank_0s_weights(
        run: list[dict[str, Any]]) -> None:
    """GradientSync's init replaced rank 1's own initial weights by rank 0's."""
    for scenario in ("sharded", "bounded", "async", "bf16"):
        assert_bitwise_equal(run[1][scenario]["initial"], run[0][scenario]["initial"],
                             f"{scenario}: initial weights, rank 1 vs rank 0")
    own = [p.detach() for p in make_model(seed=1).parameters()]
    assert not torch.equal(own[0], run[1]["sharded"]["initial"][0])


def test_bounded_staleness_never_exceeds_the_bound(run: list[dict[str, Any]]) -> None:
    """Rank 0 let rank 1 run ahead until the bound held it back before each of its
    steps, so while rank 1 trained, rank 0's gradients were applied exactly BOUND
    versions late; no gradient was applied later than that."""
    log = run[0]["bounded"]["log"]
    assert len(log) == WORLD * STEPS and run[1]["bounded"]["log"] == []
    staleness = {worker: [s - w for who, w, s in log if who == worker] for worker in (0, 1)}
    assert len(staleness[0]) == len(staleness[1]) == STEPS
    assert all(0 <= s <= BOUND for s in staleness[0] + staleness[1])
    # every push rank 0 made while rank 1 was still training waited for rank 1 to be
    # held back by the bound, so it landed exactly BOUND updates late
    last_of_rank1 = max(i for i, (who, _, _) in enumerate(log) if who == 1)
    held = [s - w for who, w, s in log[:last_of_rank1] if who == 0]
    assert held and held == [BOUND] * len(held), log
    for rank in range(WORLD):
        assert_learns(run[rank]["bounded"]["losses"])


def test_async_applies_every_push_alone_and_learns(run: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        result = run[rank]["async"]
        assert result["version"] == WORLD * STEPS  # both ranks serve a shard
        assert sorted(w for w, _, _ in result["log"]) == [0] * STEPS + [1] * STEPS
        assert_learns(result["losses"])


def test_bfloat16_model_through_the_servers(run: list[dict[str, Any]]) -> None:
    """A bfloat16 model trains through sharded servers and stays identical on both
    ranks; with float32 master weights on the servers its losses stay within 0.02 of the
    float32 run's (measured: 0.0035)."""
    assert all(p.dtype == torch.bfloat16 for p in run[0]["bf16"]["params"])
    assert_bitwise_equal(run[1]["bf16"]["params"], run[0]["bf16"]["params"],
                         "bf16: rank 1 vs rank 0")
    for rank in range(WORLD):
        losses = run[rank]["bf16"]["losses"]
        assert_learns(losses)
        torch.testing.assert_close(losses, run[rank]["sharded"]["losses"], rtol=0, atol=0.02)
