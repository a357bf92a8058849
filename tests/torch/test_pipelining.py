"""torch.distributed.pipelining, unmodified, on netdist: 2 stages, GPipe and 1F1B.

An MLP is split by hand into two ``PipelineStage``s, one per rank; ``ScheduleGPipe`` and
``Schedule1F1B`` run 4 micro-batches per step.  Stage 0 sends activations forward and
stage 1 sends activation gradients back (point-to-point ``isend``/``irecv`` batches, plus
the shape-inference handshake of the first step), all through the backend.  Nothing is
summed across ranks, so the run on netdist must give *bitwise* the losses, gradients and
parameters of the run on Gloo -- and of the same model trained in a single process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from .torch_ranks import (CANDIDATE, TEST_TIMEOUT, assert_bitwise_equal, init_process_group,
                          run_ranks, synthetic_classification)

# Two runs of rank processes per test: on a loaded machine that can outlast the default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MICROBATCHES = 4
BATCH = 32
STEPS = 3
LR = 0.1


def make_model() -> nn.Sequential:
    """The MLP to pipeline, seeded: every rank and the reference start identical."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def split(model: nn.Sequential, stage: int) -> nn.Sequential:
    """The manual 2-stage split: stage 0 is the first Linear+ReLU, stage 1 the rest."""
    return model[:2] if stage == 0 else model[2:]


def snapshot(module: nn.Module, attr: str) -> dict[str, torch.Tensor]:
    """A copy of every parameter (``attr="data"``) or gradient (``attr="grad"``), by name."""
    return {name: getattr(p, attr).detach().clone() for name, p in module.named_parameters()}


def pipeline_train(rank: int, world_size: int, backend: str, init_method: str, out_dir: str,
                   ) -> dict[str, Any]:
    """Train this rank's stage for ``STEPS`` steps under each schedule in turn.

    Per schedule (a fresh model each time): the micro-batch losses of every step (on the
    last stage), this stage's gradients after every step's backward, its final parameters.
    """
    init_process_group(rank, world_size, backend, init_method)
    x, y = synthetic_classification(STEPS, BATCH)
    results: dict[str, Any] = {}
    for name, schedule_cls in SCHEDULES.items():
        module = split(make_model(), rank)
        stage = PipelineStage(module, rank, world_size, torch.device("cpu"))
        schedule = schedule_cls(stage, n_microbatches=MICROBATCHES,
                                loss_fn=nn.functional.cross_entropy)
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        losses, grads = [], []
        for step in range(STEPS):
            opt.zero_grad()
            if rank == 0:
                schedule.step(x[step])
            else:
                step_losses: list[torch.Tensor] = []
                schedule.step(target=y[step], losses=step_losses)
                losses.append(torch.stack([loss.detach() for loss in step_losses]))
            grads.append(snapshot(module, "grad"))
            opt.step()
        results[name] = {"losses": losses, "grads": grads, "final": snapshot(module, "data")}
    return results


def single_process() -> list[dict[str, Any]]:
    """The reference: the whole model in this process, the same micro-batches in order.

    Gradients accumulate micro-batch by micro-batch and are divided by their number, as
    the schedules do (``scale_grads=True``).  Returned in the shape of the ranks' results.
    Runs on one intra-op thread, like the rank processes (the thread count can change how
    a matrix product rounds).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _single_process()
    finally:
        torch.set_num_threads(threads)


def _single_process() -> list[dict[str, Any]]:
    model = make_model()
    x, y = synthetic_classification(STEPS, BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    stages = [split(model, 0), split(model, 1)]
    out: list[dict[str, Any]] = [{"losses": [], "grads": []} for _ in stages]
    for step in range(STEPS):
        opt.zero_grad()
        losses = []
        for xb, yb in zip(x[step].chunk(MICROBATCHES), y[step].chunk(MICROBATCHES), strict=True):
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            losses.append(loss.detach())
        for p in model.parameters():
            assert p.grad is not None
            p.grad.div_(MICROBATCHES)
        out[1]["losses"].append(torch.stack(losses))
        for rank, stage in enumerate(stages):
            out[rank]["grads"].append(snapshot(stage, "grad"))
        opt.step()
    for rank, stage in enumerate(stages):
        out[rank]["final"] = snapshot(stage, "data")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Both schedules on 2 ranks, on Gloo and on the candidate backend (netdist)."""
    root = tmp_path_factory.mktemp("pipelining")
    return {backend: run_ranks(pipeline_train, 2, backend, root / backend)
            for backend in ("gloo", CANDIDATE)}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_two_stage_schedule_matches_gloo_and_single_process(
        runs: dict[str, list[dict[str, Any]]], schedule: str) -> None:
    reference = single_process()
    for rank in range(2):
        nd, gl = runs[CANDIDATE][rank][schedule], runs["gloo"][rank][schedule]
        assert len(nd["grads"]) == STEPS
        assert_bitwise_equal(nd, gl, f"{schedule}: rank {rank}'s losses/gradients/parameters")
        for key in ("grads", "final"):
            assert_bitwise_equal(nd[key], reference[rank][key],
                                 f"{schedule}: rank {rank}'s {key} vs the single-process model")
    losses = runs[CANDIDATE][1][schedule]["losses"]
    assert [tuple(step.shape) for step in losses] == [(MICROBATCHES,)] * STEPS
    assert_bitwise_equal(losses, reference[1]["losses"],
                         f"{schedule}: micro-batch losses vs the single-process model")
    assert runs[CANDIDATE][0][schedule]["losses"] == []  # only the last stage has losses
