"""The pipelined demo job (``--pipeline-stages``): in one process over InProcessTransport
(2 stages x 1 and 2 stages x 2 replicas), its configuration errors and CLI flags, and one
real multi-process run of ``netdist demo --pipeline-stages 2`` over TCP (slow)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from netdist.cli.main import main as netdist_main
from netdist.cli.worker import add_training_flags, config_from_args, training_argv
from netdist.errors import ConfigError
from netdist.parallel.stages import PipelineStage
from netdist.train.data import load_digits_dataset
from netdist.train.digits_job import (
    DemoConfig,
    DemoResult,
    build_model,
    pipeline_stages_for,
    train_worker,
)
from netdist.transport.inprocess import InProcessTransport
from tests.ranks import run_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]

EPOCH_LINE = (r"epoch +\d+/\d+  step +\d+/\d+  loss \d+\.\d{4}  samples/s [\d,]+  "
              r"idle \d+\.\d%  sent [\d.]+ (B|KiB|MiB)/step$")


async def run_job(n: int, config: DemoConfig, lines: list[str] | None = None) -> list[DemoResult]:
    log = lines.append if lines is not None else None
    return await run_ranks(n, lambda t: train_worker(t, config, log=log), as_groups=False,
                           op_timeout=30.0, guard=100)


# The digits split keeps 1438 training samples: 45 batches of 32 (the last of 30 rows),
# or 23 global batches of 64 for two replicas (the last of 30 rows, 15 per replica).
@pytest.mark.parametrize(("n", "steps_per_epoch"), [(2, 45), (4, 23)])
async def test_pipelined_demo_reaches_95_percent(n, steps_per_epoch):
    """Default epochs, 2 stages x n/2 replicas: the acceptance bar of the demo."""
    lines: list[str] = []
    results = await run_job(n, DemoConfig(pipeline_stages=2), lines)
    # every rank returns replica 0's accuracy, broadcast from its last stage
    assert len({r.test_accuracy for r in results}) == 1
    assert results[0].test_accuracy >= 0.95
    assert all(r.steps == 20 * steps_per_epoch for r in results)
    assert lines[0].startswith(f"netdist demo: pipeline of 2 stages x {n // 2} replicas "
                               f"({n} ranks), schedule 1f1b, 4 micro-batches, MLP "
                               f"64-128-64-10 cut [0:2] 8,320 params | [2:5] 8,906 params")
    assert lines[-1] == f"final test accuracy: {results[0].test_accuracy:.1%}"
    epoch_lines = lines[1:-1]
    assert len(epoch_lines) == 20  # one rank (rank 0) reports, once per epoch
    assert all(re.match(EPOCH_LINE, line) for line in epoch_lines), epoch_lines
    assert epoch_lines[-1].startswith(f"epoch 20/20  step {20 * steps_per_epoch:>5}/"
                                      f"{20 * steps_per_epoch}  loss ")
    # the loss printed is the last stages' (the first stage never computes one)
    assert float(epoch_lines[-1].split("loss ")[1].split()[0]) == pytest.approx(
        results[0].final_loss, abs=5e-5)
    assert results[0].final_loss < 0.05


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("n", [2, 4])
async def test_short_pipelined_runs_train(n, schedule):
    """Two epochs, both schedules: 96.4% (2 x 1) and 94.7% (2 x 2) with seed 0."""
    config = DemoConfig(pipeline_stages=2, epochs=2, schedule=schedule)
    results = await run_job(n, config)
    assert len({r.test_accuracy for r in results}) == 1
    assert results[0].test_accuracy >= 0.90
    assert results[0].final_loss < 0.6  # from ln(10) = 2.30 at the start
    assert all(r.bytes_sent > 0 for r in results)  # activations / activation gradients


async def test_four_stages_with_a_parameter_free_stage():
    """4 stages of the 5-layer MLP by parameter count leave one stage a lone ReLU."""
    config = DemoConfig(pipeline_stages=4, epochs=1, micro_batches=2)
    model = build_model(config, load_digits_dataset(seed=0, dtype=np.float32))
    assert pipeline_stages_for(model, config) == [
        PipelineStage(0, 2, 0), PipelineStage(2, 3, 1), PipelineStage(3, 4, 2),
        PipelineStage(4, 5, 3)]
    results = await run_job(4, config)
    assert len({r.test_accuracy for r in results}) == 1
    assert results[0].test_accuracy > 0.8
    assert results[0].steps == 45


def test_stage_cut_by_params_or_layers():
    dataset = load_digits_dataset(seed=0, dtype=np.float32)
    by_params = DemoConfig(pipeline_stages=2)
    by_layers = DemoConfig(pipeline_stages=2, pipeline_balance="layers")
    model = build_model(by_params, dataset)
    # Linear 64->128 (8,320) + ReLU | Linear 128->64 (8,256) + ReLU + Linear 64->10 (650)
    assert pipeline_stages_for(model, by_params) == [PipelineStage(0, 2, 0),
                                                    PipelineStage(2, 5, 1)]
    assert pipeline_stages_for(model, by_layers) == [PipelineStage(0, 3, 0),
                                                    PipelineStage(3, 5, 1)]
    with pytest.raises(ConfigError, match="pipeline_stages >= 1"):
        pipeline_stages_for(model, DemoConfig())


def test_config_errors():
    with pytest.raises(ConfigError, match="--aggregator topk cannot be combined"):
        DemoConfig(pipeline_stages=2, aggregator="topk")
    with pytest.raises(ConfigError, match="cannot checkpoint"):
        DemoConfig(pipeline_stages=2, checkpoint_dir="/tmp/x")
    with pytest.raises(ConfigError, match="cannot checkpoint"):
        DemoConfig(pipeline_stages=2, checkpoint_dir="/tmp/x", resume=True)
    with pytest.raises(ConfigError, match=r"--hidden 128,64 has 5 \(3 Linear \+ 2 ReLU\)"):
        DemoConfig(pipeline_stages=6)
    with pytest.raises(ConfigError, match="has 3"):
        DemoConfig(pipeline_stages=4, hidden=(32,))
    with pytest.raises(ConfigError, match="--micro-batches 4"):
        DemoConfig(pipeline_stages=2, batch_size=3)
    with pytest.raises(ConfigError, match="unknown pipeline schedule"):
        DemoConfig(pipeline_stages=2, schedule="zigzag")
    with pytest.raises(ConfigError, match="unknown pipeline balance"):
        DemoConfig(pipeline_stages=2, pipeline_balance="flops")
    with pytest.raises(ConfigError, match="micro_batches must be >= 1"):
        DemoConfig(pipeline_stages=2, micro_batches=0)
    with pytest.raises(ConfigError, match="pipeline_stages must be >= 0"):
        DemoConfig(pipeline_stages=-1)
    with pytest.raises(ConfigError, match="need --pipeline-stages"):
        DemoConfig(micro_batches=8)
    with pytest.raises(ConfigError, match="need --pipeline-stages"):
        DemoConfig(schedule="gpipe")
    config = DemoConfig(pipeline_stages=2)
    assert [config.check_world_size(w) for w in (2, 4, 6)] == [1, 2, 3]
    assert DemoConfig().check_world_size(3) == 3
    with pytest.raises(ConfigError, match="multiple of 2 .* got 3 ranks"):
        config.check_world_size(3)
    # one stage is allowed: a micro-batched, purely data-parallel pipeline
    assert DemoConfig(pipeline_stages=1).check_world_size(3) == 3


async def test_world_size_not_a_multiple_fails_on_every_rank():
    transports = InProcessTransport.create_group(3, timeout=30.0)
    results = await asyncio.wait_for(asyncio.gather(
        *(train_worker(t, DemoConfig(pipeline_stages=2), log=None) for t in transports),
        return_exceptions=True), timeout=30)
    assert all(isinstance(r, ConfigError) for r in results), results
    assert "multiple of 2" in str(results[0])
    # 1438 samples cannot fill 2 replicas x 800 micro-batches: refused before any traffic
    with pytest.raises(ConfigError, match="use fewer --micro-batches"):
        await train_worker(InProcessTransport.create_group(2, timeout=30.0)[0],
                           DemoConfig(pipeline_stages=1, batch_size=2000, micro_batches=800),
                           log=None)


def test_cli_flags_round_trip():
    parser = argparse.ArgumentParser()
    add_training_flags(parser)
    args = parser.parse_args(["--pipeline-stages", "2", "--micro-batches", "8",
                              "--schedule", "gpipe", "--pipeline-balance", "layers",
                              "--epochs", "3"])
    config = config_from_args(args)
    assert config == DemoConfig(pipeline_stages=2, micro_batches=8, schedule="gpipe",
                                pipeline_balance="layers", epochs=3)
    assert config_from_args(parser.parse_args(training_argv(args))) == config
    plain = parser.parse_args([])
    assert config_from_args(plain).pipeline_stages == 0
    assert "--pipeline-stages" not in training_argv(plain)


def test_cli_refuses_before_launching(capsys):
    """``netdist demo`` checks the world size against the stages before starting ranks."""
    assert netdist_main(["demo", "-n", "3", "--pipeline-stages", "2"]) == 2
    assert ("netdist demo: error: --pipeline-stages 2 needs a world size that is a "
            "multiple of 2") in capsys.readouterr().err
    assert netdist_main(["demo", "-n", "2", "--pipeline-stages", "2",
                         "--aggregator", "ps"]) == 2
    assert "--aggregator ps cannot be combined" in capsys.readouterr().err
    assert netdist_main(["worker", "--pipeline-stages", "2", "--checkpoint-dir", "/tmp/x"]) == 2
    assert "cannot checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_netdist_demo_pipelined_over_tcp():
    """``netdist demo -n 2 --pipeline-stages 2`` runs two real worker processes."""
    env = {**os.environ,
           "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "netdist", "demo", "-n", "2", "--pipeline-stages", "2",
         "--epochs", "2", "--timeout", "30", "--job-timeout", "100"],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "[rank 0] netdist demo: pipeline of 2 stages x 1 replicas (2 ranks)" in out
    assert re.search(r"^\[rank 0\] epoch  2/2  step    90/90  loss ", out, re.M), out
    match = re.search(r"^\[rank 0\] final test accuracy: (\d+\.\d)%$", out, re.M)
    assert match, out
    assert float(match.group(1)) >= 90.0  # 96.4% with seed 0, as in one process
    assert "[rank 1] epoch" not in out and "[rank 1] final" not in out
