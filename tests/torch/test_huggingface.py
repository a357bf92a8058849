"""Hugging Face's Trainer and accelerate on netdist: the documented recipes, run as written,
train bit for bit as on Gloo; what fails, fails with the message the page shows.

``docs/ecosystem.md`` shows three examples, and the slow tests here launch
exactly those files from ``examples/`` with exactly their ``# run:`` line (``netdist launch
-n 2``, real processes, real TCP on 127.0.0.1), then once more on Gloo:

- ``hf_trainer.py``: ``init_process_group("netdist")`` before a stock ``TrainingArguments(
  use_cpu=True)``, the route that needs nothing from netdist but an optional check;
- ``hf_trainer_args.py --ddp_backend=netdist``: ``HfArgumentParser(NetdistTrainingArguments)``,
  which initialises the group itself; its Gloo run (``--ddp_backend=gloo --use_cpu``) is
  stock transformers and accelerate making their own Gloo group, the reference for both;
- ``accelerate_netdist.py``: ``Accelerator(cpu=True)`` on an existing netdist group, and
  the same file on Gloo (only the backend name and the netdist check changed).

At 2 ranks a sum of two floats does not depend on the order it is taken in, so the saved
``model.safetensors`` must be bitwise equal across backends; each rank prints whether the
SHA-256 of its weights matches every other rank's, and the ranks' losses differ (each rank
trains on its own shard), so identical weights mean the gradients were averaged.

``test_what_fails_and_why`` runs, on a real 2-rank netdist group and then a Gloo one,
every failure the page lists and the checks that catch the silent ones. Measured on a
2-core machine shared with other jobs: each launch takes 13-30 s, most of it importing
transformers and accelerate in every rank (training is about 1 s); the whole file 107-148 s.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from netdist.errors import ConfigError
from netdist.torch.data_parallel_check import check_data_parallel, diagnose

from .torch_ranks import assert_bitwise_equal, free_port, init_process_group, run_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples" / "ecosystem"
LAUNCH_BOUND = 240.0  # seconds a launched example may run before it is killed
JOB_BOUND = 240.0  # seconds the failure-mode job may run
_LINE = re.compile(r"^\[rank (\d)\] rank (\d): (\w+), 2 ranks, loss ([\d.]+), "
                   r"weights identical: True$")


# ------------------------------------------------------------------------ launched examples


def _env() -> dict[str, str]:
    """This environment without any launcher's variables, as a user's shell would be."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NETDIST_", "MASTER_", "TORCHELASTIC_", "OMPI_", "ACCELERATE_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["OMP_NUM_THREADS"] = "1"  # both backends take the same floating-point paths
    return env


def _run_line(name: str) -> list[str]:
    """The example's ``# run:`` line, with this interpreter for ``netdist`` and ``python``."""
    line = (EXAMPLES / name).read_text(encoding="utf-8").splitlines()[1]
    assert line.startswith("# run: netdist launch -n 2 -- python "), line
    words = line[len("# run: "):].split()
    return [sys.executable, "-m", "netdist", *words[1:words.index("python")],
            sys.executable, *words[words.index("python") + 1:]]


GLOO_EXIT_ABORT = "terminate called without an active exception"
"""What a Gloo rank prints when its C++ threads are torn down in the wrong order at
interpreter exit (SIGABRT, after the script's last line): Gloo's teardown, not training."""


def _launch(workdir: Path, name: str, code: str, argv: list[str], *,
            gloo_reference: bool = False) -> list[str]:
    """Write ``code`` as ``workdir/name``, run ``argv`` there; the lines it printed.

    A ``gloo_reference`` run (the baseline, on stock Gloo) may also end in Gloo's abort at
    exit, once every rank has printed its result line (its weights are saved before
    that, and compared by the caller); anything else is a failure."""
    workdir.mkdir()
    (workdir / name).write_text(code, encoding="utf-8")
    result = subprocess.run(argv, cwd=workdir, env=_env(), capture_output=True, text=True,
                            timeout=LAUNCH_BOUND)
    lines = sorted(result.stdout.splitlines())
    aborted_after_work = (gloo_reference and GLOO_EXIT_ABORT in result.stdout + result.stderr
                          and all(any(line.startswith(f"[rank {r}] rank {r}: ")
                                      for line in lines) for r in range(2)))
    assert result.returncode == 0 or aborted_after_work, (
        f"{argv} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return [line for line in lines if line.startswith("[rank ") and ": " in line
            and line.split("] ", 1)[1].startswith("rank ")] if aborted_after_work else lines


def _on_gloo(code: str) -> str:
    """The example with its netdist process group made on Gloo instead."""
    line = 'dist.init_process_group("netdist")'
    assert code.count(line) == 1
    return code.replace(line, 'dist.init_process_group("gloo")')


def _weights(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(path)


def _trainer_losses(lines: list[str], backend: str) -> list[str]:
    """Each rank's loss from ``rank R: BACKEND, 2 ranks, loss L, weights identical: True``."""
    assert len(lines) == 2, lines
    matches = [_LINE.match(line) for line in lines]
    assert all(matches), lines
    assert [(m[1], m[2], m[3]) for m in matches if m] == [("0", "0", backend),
                                                         ("1", "1", backend)], lines
    losses = [m[4] for m in matches if m]
    assert losses[0] != losses[1], "both ranks trained on the same data"
    return losses


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_BOUND + 60)
def test_trainer_on_netdist_is_bitwise_gloo(tmp_path: Path) -> None:
    plain = (EXAMPLES / "hf_trainer.py").read_text(encoding="utf-8")
    adapter = (EXAMPLES / "hf_trainer_args.py").read_text(encoding="utf-8")
    runs = {
        "plain": _launch(tmp_path / "plain", "hf_trainer.py", plain,
                         _run_line("hf_trainer.py")),
        "adapter": _launch(tmp_path / "adapter", "hf_trainer_args.py", adapter,
                           _run_line("hf_trainer_args.py")),
        # stock transformers + accelerate: they make the Gloo group themselves
        "gloo": _launch(tmp_path / "gloo", "hf_trainer_args.py", adapter,
                        _run_line("hf_trainer_args.py")[:-1] + ["--ddp_backend=gloo",
                                                                "--use_cpu"],
                        gloo_reference=True),
    }
    losses = {run: _trainer_losses(lines, "gloo" if run == "gloo" else "netdist")
              for run, lines in runs.items()}
    assert losses["plain"] == losses["adapter"] == losses["gloo"], losses
    reference = _weights(tmp_path / "gloo" / "hf_trainer_args" / "model.safetensors")
    assert_bitwise_equal(_weights(tmp_path / "plain" / "hf_trainer" / "model.safetensors"),
                         reference, "hf_trainer.py on netdist vs Trainer on gloo")
    assert_bitwise_equal(
        _weights(tmp_path / "adapter" / "hf_trainer_args" / "model.safetensors"),
        reference, "hf_trainer_args.py --ddp_backend=netdist vs --ddp_backend=gloo")


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_BOUND + 60)
def test_accelerate_on_netdist_is_bitwise_gloo(tmp_path: Path) -> None:
    code = (EXAMPLES / "accelerate_netdist.py").read_text(encoding="utf-8")
    check = "check_data_parallel(accelerator)"
    assert code.count(check) == 1  # netdist's check refuses a Gloo group, by design
    gloo_code = _on_gloo(code).replace(check, "pass")
    argv = _run_line("accelerate_netdist.py")
    outputs = {"netdist": _launch(tmp_path / "netdist", "accelerate_netdist.py", code, argv),
               "gloo": _launch(tmp_path / "gloo", "accelerate_netdist.py", gloo_code, argv,
                               gloo_reference=True)}
    for backend, lines in outputs.items():
        assert len(lines) == 2 and all(
            line.startswith(f"[rank {r}] rank {r}: {backend}, last losses [")
            and line.endswith("], weights identical: True") for r, line in enumerate(lines)), lines
    assert ([line.replace("netdist", "gloo") for line in outputs["netdist"]]
            == outputs["gloo"]), outputs
    assert_bitwise_equal(
        _weights(tmp_path / "netdist" / "accelerate_netdist" / "model.safetensors"),
        _weights(tmp_path / "gloo" / "accelerate_netdist" / "model.safetensors"),
        "accelerate_netdist.py on netdist vs on gloo")


# ------------------------------------------------------------------ what fails, and why


def _argparse_error(parser: Any, argv: list[str]) -> str:
    """The last line argparse prints when it refuses ``argv``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        parser.parse_known_args(argv)
    return err.getvalue().strip().splitlines()[-1]


def _error(fn: Callable[[], Any], kind: type[Exception] = ConfigError) -> str:
    """``fn()``'s ``kind`` message, or ``"ok"``."""
    try:
        fn()
    except kind as exc:
        return str(exc)
    return "ok"


def _failure_modes(rank: int, world_size: int, backend: str, init_method: str,
                   out_dir: str, gloo_port: int) -> dict[str, Any]:
    """One rank of a 2-rank job trying everything the page says fails or is caught.

    Where accelerate makes the process group itself it uses ``env://``: ``MASTER_PORT``
    is ``init_method``'s port for its netdist group and ``gloo_port`` for its Gloo one.
    """
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=init_method.rsplit(":", 1)[1])  # what a launcher sets
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import HfArgumentParser, TrainingArguments

    from netdist.torch.huggingface import NetdistTrainingArguments

    seen: dict[str, Any] = {
        "stock parser": _argparse_error(HfArgumentParser(TrainingArguments),
                                        ["--ddp_backend", "netdist"]),
        "adapter parser": HfArgumentParser(NetdistTrainingArguments).parse_known_args(
            ["--ddp_backend", "netdist"])[0].ddp_backend,
    }
    common: dict[str, Any] = {"output_dir": out_dir, "report_to": [], "save_strategy": "no"}
    # no use_cpu: accelerate makes the netdist group itself, then trains each rank alone
    alone = TrainingArguments(**common, ddp_backend="netdist")
    seen["stock ddp_backend, no use_cpu"] = [
        dist.get_backend(), alone.parallel_mode.value, alone.world_size,
        _error(lambda: check_data_parallel(alone))]
    seen["stock ddp_backend"] = _error(
        lambda: TrainingArguments(**common, use_cpu=True, ddp_backend="netdist"), ValueError)
    alone = TrainingArguments(**common)
    seen["no use_cpu"] = [alone.parallel_mode.value, alone.world_size,
                          _error(lambda: check_data_parallel(alone))]
    args = TrainingArguments(**common, use_cpu=True)
    seen["use_cpu"] = [args.parallel_mode.value, args.world_size,
                       args.distributed_state.backend, _error(lambda: check_data_parallel(args))]
    adapter = NetdistTrainingArguments(**common, ddp_backend="netdist")
    seen["adapter"] = [adapter.ddp_backend, adapter.use_cpu, adapter.parallel_mode.value,
                       adapter.world_size]
    # accelerate's state is a process-wide singleton: start each Accelerator afresh
    AcceleratorState._reset_state(reset_partial_state=True)
    seen["Accelerator()"] = _error(lambda: check_data_parallel(Accelerator()))
    AcceleratorState._reset_state(reset_partial_state=True)
    seen["Accelerator(cpu=True)"] = _error(lambda: check_data_parallel(Accelerator(cpu=True)))
    dist.destroy_process_group()
    # TrainingArguments first: accelerate makes a Gloo group, too late for netdist
    os.environ["MASTER_PORT"] = str(gloo_port)
    TrainingArguments(**common, use_cpu=True)
    seen["TrainingArguments first"] = [
        dist.get_backend(),
        _error(lambda: NetdistTrainingArguments(**common, ddp_backend="netdist")),
        _error(lambda: dist.init_process_group("netdist"), ValueError)]
    return seen


@pytest.mark.slow
@pytest.mark.timeout(JOB_BOUND + 30)
def test_what_fails_and_why(tmp_path: Path) -> None:
    results = run_ranks(_failure_modes, 2, "netdist", tmp_path, timeout=JOB_BOUND,
                        gloo_port=free_port())
    assert results[0] == results[1]
    seen = results[0]
    assert seen["stock parser"].endswith(
        "error: argument --ddp_backend/--ddp-backend: invalid choice: 'netdist' (choose from "
        "'nccl', 'gloo', 'mpi', 'xccl', 'hccl', 'cncl', 'mccl')"), seen["stock parser"]
    assert seen["adapter parser"] == "netdist"
    assert seen["stock ddp_backend, no use_cpu"] == [
        "netdist", "not_parallel", 2,
        "TrainingArguments trains each of the 2 ranks of the netdist group alone (accelerate's "
        "distributed type is NO, so the model is not wrapped in DDP): on a machine without "
        "GPUs accelerate uses an existing process group only with use_cpu=True "
        "(TrainingArguments) or cpu=True (Accelerator)"]
    assert seen["stock ddp_backend"] == (
        "Your assigned backend netdist is not available, please use gloo")
    assert seen["no use_cpu"] == [
        "not_parallel", 1,
        "TrainingArguments trains each of the 2 ranks of the netdist group alone (accelerate's "
        "distributed type is NO, so the model is not wrapped in DDP): on a machine without "
        "GPUs accelerate uses an existing process group only with use_cpu=True "
        "(TrainingArguments) or cpu=True (Accelerator)"]
    # accelerate labels every CPU job "gloo"; the group it runs on is netdist's
    assert seen["use_cpu"] == ["distributed", 2, "gloo", "ok"]
    assert seen["adapter"] == ["netdist", True, "distributed", 2]
    assert seen["Accelerator()"].startswith("Accelerator trains each of the 2 ranks of the "
                                            "netdist group alone"), seen["Accelerator()"]
    assert seen["Accelerator(cpu=True)"] == "ok"
    assert seen["TrainingArguments first"] == [
        "gloo",
        "NetdistTrainingArguments: the default process group runs on 'gloo', not 'netdist'; "
        "call torch.distributed.init_process_group('netdist') before creating "
        "TrainingArguments or an Accelerator (accelerate keeps a group that exists, and "
        "makes its own otherwise)",
        "trying to initialize the default process group twice!"]


# ------------------------------------------------------------- the check, without processes


def test_check_without_a_process_group() -> None:
    assert not dist.is_initialized()
    state = SimpleNamespace(distributed_type="MULTI_CPU", num_processes=2,
                            device=SimpleNamespace(type="cpu"))
    with pytest.raises(ConfigError, match=r"^SimpleNamespace: torch.distributed's default "
                       r"process group is not initialised; call torch.distributed."
                       r"init_process_group\('netdist'\) before creating SimpleNamespace, "
                       r"otherwise accelerate initialises Gloo itself$"):
        check_data_parallel(state)


@pytest.mark.parametrize(("backend", "world", "distributed", "processes", "device", "expected"), [
    ("netdist", 2, True, 2, "cpu", None),
    ("netdist", 1, False, 1, "cpu", None),  # one rank: nothing to make parallel
    ("netdist", 2, False, 1, "cpu", "X trains each of the 2 ranks of the netdist group alone"),
    ("netdist", 2, True, 4, "cpu", "X counts 4 processes, but the netdist group has 2 ranks"),
    ("netdist", 2, True, 2, "cuda", "X trains on 'cuda', but netdist carries CPU tensors only"),
    ("gloo", 2, True, 2, "cpu", "X: the default process group runs on 'gloo', not 'netdist'"),
    (None, 1, False, 1, "cpu", "X: torch.distributed's default process group is not "
                               "initialised"),
])
def test_diagnose(backend: str | None, world: int, distributed: bool, processes: int,
                  device: str, expected: str | None) -> None:
    problem = diagnose("X", backend, world, distributed, processes, device)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(expected), problem
