"""The demo job in one process (InProcessTransport), its CLI flags, and one real
multi-process run of ``netdist demo`` over TCP (slow)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from netdist.checkpoint import list_checkpoints
from netdist.cli.worker import add_training_flags, config_from_args, training_argv
from netdist.errors import ConfigError
from netdist.train.digits_job import DemoConfig, DemoResult, train_worker, update_factories
from netdist.transport.inprocess import InProcessTransport
from tests.ranks import run_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]


async def run_job(n: int, config: DemoConfig, lines: list[str] | None = None) -> list[DemoResult]:
    log = lines.append if lines is not None else None
    return await run_ranks(n, lambda t: train_worker(t, config, log=log), as_groups=False,
                           op_timeout=30.0, guard=100)


@pytest.mark.parametrize("aggregator", ["ring", "topk"])
async def test_demo_reaches_95_percent(aggregator):
    lines: list[str] = []
    results = await run_job(4, DemoConfig(aggregator=aggregator), lines)
    accuracies = {r.test_accuracy for r in results}
    assert len(accuracies) == 1  # every rank holds the same parameters
    assert results[0].test_accuracy >= 0.95
    assert results[0].steps == 20 * 12
    assert lines[-1] == f"final test accuracy: {results[0].test_accuracy:.1%}"
    assert lines[0].startswith("netdist demo: 4 training ranks, aggregator ")  # said once
    epoch_lines = [line for line in lines if line.startswith("epoch")]
    assert len(epoch_lines) == 20
    assert re.match(r"epoch  1/20  step    12/240  loss \d+\.\d{4}  samples/s [\d,]+  "
                    r"comm \d+\.\d%  sent [\d.]+ (B|KiB|MiB)/step$", epoch_lines[0])
    if aggregator == "topk":
        # ceil(1%) of each of the 17,226 float32 parameters' tensors, int32 index + value
        assert results[0].bytes_sent / results[0].steps == (82 + 2 + 82 + 1 + 7 + 1) * 8
        assert results[0].bytes_sent / results[0].steps <= 0.025 * 17_226 * 4


@pytest.mark.parametrize("aggregator", ["ps", "ps-sharded", "ps-async", "fp16"])
async def test_other_update_paths_train(aggregator):
    lines: list[str] = []
    results = await run_job(3, DemoConfig(aggregator=aggregator, epochs=3), lines)
    assert all(r.steps == 3 * 15 for r in results)  # every rank trains
    if aggregator != "ps-async":  # synchronous modes keep the replicas identical
        assert len({r.test_accuracy for r in results}) == 1
    assert results[0].test_accuracy > 0.8
    assert results[0].final_loss < 1.0
    assert results[0].bytes_sent > 0
    assert lines[-1].startswith("final test accuracy: ")


@pytest.mark.parametrize("aggregator", ["ring", "topk"])
async def test_resume_mid_epoch_is_bitwise_identical(tmp_path, aggregator):
    config = DemoConfig(aggregator=aggregator, epochs=2, topk_ratio=0.1)
    straight = await run_job(2, config)
    ckpt = tmp_path / "ckpt"
    with_ckpt = DemoConfig(aggregator=aggregator, epochs=2, topk_ratio=0.1,
                           checkpoint_dir=str(ckpt), checkpoint_every=9, keep_last=10)
    await run_job(2, with_ckpt)
    steps = [s for s, _ in list_checkpoints(ckpt)]
    assert steps == [9, 18, 27, 36, 45, 46]  # 23 steps per epoch, plus the final save
    for step, directory in list_checkpoints(ckpt):
        if step > 27:  # pretend the job died after step 27 (epoch 2, batch 4)
            for f in directory.iterdir():
                f.unlink()
            directory.rmdir()
    lines: list[str] = []
    resumed = await run_job(2, DemoConfig(aggregator=aggregator, epochs=2, topk_ratio=0.1,
                                          checkpoint_dir=str(ckpt), resume=True), lines)
    assert lines[0].startswith(f"resumed from {ckpt} at step 27 (epoch 2, batch 4)")
    assert resumed[0].resumed_from_step == 27 and resumed[0].steps == 46
    for a, b in zip(straight, resumed):
        assert a.test_accuracy == b.test_accuracy


async def test_resume_without_checkpoint_starts_fresh(tmp_path):
    lines: list[str] = []
    results = await run_job(1, DemoConfig(epochs=1, checkpoint_dir=str(tmp_path / "none"),
                                          resume=True), lines)
    assert lines[0].startswith("no checkpoint in")
    assert results[0].steps == 45
    assert [s for s, _ in list_checkpoints(tmp_path / "none")] == [45]


async def test_custom_update_path_table():
    table = update_factories()
    called = []

    async def traced(group, model, config):
        called.append(group.world_size)
        return await table["ring"](group, model, config)

    transports = InProcessTransport.create_group(2, timeout=30.0)
    cfg = DemoConfig(epochs=1)
    await asyncio.gather(*(train_worker(t, cfg, log=None, factories={"ring": traced})
                           for t in transports))
    assert called == [2, 2]
    with pytest.raises(ConfigError, match="no update path"):
        await train_worker(InProcessTransport.create_group(1)[0], DemoConfig(aggregator="topk"),
                           log=None, factories={"ring": traced})


def test_config_validation():
    with pytest.raises(ConfigError, match="unknown aggregator"):
        DemoConfig(aggregator="nccl")
    with pytest.raises(ConfigError, match="checkpoint-dir"):
        DemoConfig(resume=True)
    with pytest.raises(ConfigError, match="cannot checkpoint"):
        DemoConfig(aggregator="ps-async", checkpoint_dir="/tmp/x")
    with pytest.raises(ConfigError):
        DemoConfig(epochs=0)


def test_cli_flags_round_trip():
    parser = argparse.ArgumentParser()
    add_training_flags(parser)
    args = parser.parse_args(["--aggregator", "topk", "--epochs", "3", "--lr", "0.1",
                              "--hidden", "32,16", "--topk-ratio", "0.05", "--timeout", "9",
                              "--checkpoint-dir", "/tmp/x", "--checkpoint-every", "5",
                              "--resume"])
    config = config_from_args(args)
    assert config == DemoConfig(aggregator="topk", epochs=3, lr=0.1, hidden=(32, 16),
                                topk_ratio=0.05, timeout=9.0, checkpoint_dir="/tmp/x",
                                checkpoint_every=5, resume=True)
    again = config_from_args(parser.parse_args(training_argv(args)))
    assert again == config
    with pytest.raises(ConfigError, match="--hidden"):
        config_from_args(parser.parse_args(["--hidden", "a,b"]))


@pytest.mark.slow
def test_netdist_demo_over_tcp():
    """``netdist demo -n 2 --epochs 1`` launches two real worker processes over TCP."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "netdist.cli.main", "demo", "-n", "2", "--epochs", "2",
         "--timeout", "30", "--job-timeout", "100"],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "[rank 0] netdist demo: 2 training ranks, aggregator ring" in out
    assert re.search(r"^\[rank 0\] epoch  2/2  step    46/46  loss ", out, re.M), out
    match = re.search(r"^\[rank 0\] final test accuracy: (\d+\.\d)%$", out, re.M)
    assert match, out
    assert float(match.group(1)) > 80.0
    assert "[rank 1] epoch" not in out  # only rank 0 reports


async def test_serving_rank_hook():
    """A factory may make a rank serve instead of train (dedicated-server modes)."""
    from netdist.parallel.aggregators import LocalAggregator
    from netdist.train.digits_job import UpdatePath
    from netdist.train.optimizers import SGD

    served = []

    async def factory(group, model, config):
        if group.rank == 0:
            async def serve():
                served.append(await group.broadcast_object(None, 1, timeout=10))
            return UpdatePath(None, None, -1, 1, False, serve=serve)
        opt = SGD(model.parameters(), lr=config.lr)

        def apply(grads):
            opt.step()

        async def close():
            await group.broadcast_object("done", 1, timeout=10)

        return UpdatePath(LocalAggregator(), apply, 0, 1, True, optimizer=opt, close=close)

    lines: list[str] = []
    transports = InProcessTransport.create_group(2, timeout=30.0)
    cfg = DemoConfig(epochs=1, batch_size=64)
    server, trainer = await asyncio.wait_for(asyncio.gather(
        *(train_worker(t, cfg, log=lines.append, factories={"ring": factory})
          for t in transports)), timeout=60)
    assert served == ["done"]
    assert server.steps == 0 and server.test_accuracy != server.test_accuracy  # NaN
    assert trainer.steps == 23 and trainer.test_accuracy > 0.2  # chance is 0.1
    assert lines[0].startswith("netdist demo: 1 training rank and 1 parameter server (2 in "
                               "the job), ")


async def run_job_errors(n: int, config: DemoConfig, lines: list[str]) -> list[BaseException]:
    """Run every rank to the end; return what each raised (all must raise)."""
    results = await run_ranks(n, lambda t: train_worker(t, config, log=lines.append),
                              as_groups=False, op_timeout=30.0, guard=100,
                              return_exceptions=True)
    assert all(isinstance(r, BaseException) for r in results), results
    return [r for r in results if isinstance(r, BaseException)]


async def test_unusable_checkpoint_dir_fails_on_every_rank_before_the_first_step(tmp_path):
    lines: list[str] = []
    errors = await run_job_errors(2, DemoConfig(epochs=1, checkpoint_dir="/proc/nope"), lines)
    assert [type(e) for e in errors] == [ConfigError, ConfigError]
    assert {str(e) for e in errors} == {
        "checkpoint directory unusable on ranks 0, 1: cannot create /proc/nope: "
        "No such file or directory"}
    assert lines == []  # not a single step, not even the header


async def test_one_rank_that_cannot_write_is_named_on_every_rank(tmp_path, monkeypatch):
    # Ranks on different hosts may see different file systems: only rank 1 fails here,
    # and rank 0 is told instead of waiting for it at the first save.
    import netdist.train.digits_job as demo

    real = demo.checkpoint_dir_problem

    def probe(directory, *, tag=""):
        if tag == "-rank1":
            return f"cannot write to {directory}: Read-only file system"
        return real(directory, tag=tag)

    monkeypatch.setattr(demo, "checkpoint_dir_problem", probe)
    ckpt = tmp_path / "ckpt"
    lines: list[str] = []
    errors = await run_job_errors(2, DemoConfig(epochs=1, checkpoint_dir=str(ckpt)), lines)
    assert [str(e) for e in errors] == [
        f"checkpoint directory unusable on rank 1: cannot write to {ckpt}: "
        "Read-only file system"] * 2
    assert lines == []
    assert list(ckpt.iterdir()) == []  # rank 0's probe file is gone


async def test_resume_with_another_model_names_every_parameter_and_shape(tmp_path):
    ckpt = tmp_path / "ckpt"
    await run_job(2, DemoConfig(epochs=1, batch_size=256, checkpoint_dir=str(ckpt)))
    lines: list[str] = []
    errors = await run_job_errors(
        2, DemoConfig(epochs=2, batch_size=256, hidden=(32,), checkpoint_dir=str(ckpt),
                      resume=True), lines)
    assert [type(e) for e in errors] == [ConfigError, ConfigError]
    assert {str(e) for e in errors} == {
        f"cannot resume from {ckpt} (step 3): the checkpoint holds another model: "
        "0.weight is (128, 64) in the checkpoint but (32, 64) in this model; "
        "0.bias is (128,) in the checkpoint but (32,) in this model; "
        "2.weight is (64, 128) in the checkpoint but (10, 32) in this model; "
        "2.bias is (64,) in the checkpoint but (10,) in this model; "
        "4.weight (10, 64) is in the checkpoint but not in this model; "
        "4.bias (10,) is in the checkpoint but not in this model "
        "(written with --hidden 128,64, this run has --hidden 32; resume with the same "
        "--hidden or use another --checkpoint-dir)"}
    assert not [line for line in lines if line.startswith("epoch")]


@pytest.mark.parametrize("aggregator,quantize,fragments", [
    ("diloco", "int8", 1), ("diloco", None, 4), ("local-sgd", "int4", 1)])
async def test_periodic_modes_end_on_one_model_and_learn(aggregator, quantize, fragments):
    """diloco / local-sgd: every rank ends with the same (global) model after the last
    synchronisation, it has learnt, and the exchanges sent far less than per-step
    all-reduce would (20 epochs x 12 steps of 4 ranks, H = 20)."""
    lines: list[str] = []
    config = DemoConfig(aggregator=aggregator, sync_every=20, quantize=quantize,
                        fragments=fragments, fragment_sync_delay=2 if fragments > 1 else 0,
                        outer_lr=1.0, outer_momentum=0.5)
    results = await run_job(4, config, lines)
    assert len({r.test_accuracy for r in results}) == 1
    assert results[0].test_accuracy >= 0.93
    assert results[0].steps == 20 * 12
    params = 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10  # the MLP 64-128-64-10
    dense = 20 * 12 * params * 4  # float32 gradients handed to a per-step all-reduce
    assert 0 < results[0].bytes_sent < dense / 10
    assert lines[-1] == f"final test accuracy: {results[0].test_accuracy:.1%}"


def test_periodic_mode_flags_round_trip_and_are_checked():
    parser = argparse.ArgumentParser()
    add_training_flags(parser)
    args = parser.parse_args(["--aggregator", "diloco", "--sync-every", "30", "--quantize",
                              "int4:absmax", "--fragments", "3", "--fragment-sync-delay", "4",
                              "--fragment-mixing", "0.5", "--outer-lr", "0.9",
                              "--outer-momentum", "0.8"])
    config = config_from_args(args)
    assert config == DemoConfig(aggregator="diloco", sync_every=30, quantize="int4:absmax",
                                fragments=3, fragment_sync_delay=4, fragment_mixing=0.5,
                                outer_lr=0.9, outer_momentum=0.8)
    assert config_from_args(parser.parse_args(training_argv(args))) == config
    with pytest.raises(ConfigError, match="fragment_sync_delay"):
        DemoConfig(aggregator="diloco", sync_every=10, fragments=2, fragment_sync_delay=5)
    with pytest.raises(ConfigError, match="int3|bits"):
        DemoConfig(aggregator="diloco", quantize="int3")
    with pytest.raises(ConfigError, match="does not checkpoint"):
        DemoConfig(aggregator="local-sgd", checkpoint_dir="/tmp/x")
