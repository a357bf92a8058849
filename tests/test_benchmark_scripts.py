"""The benchmark scripts stay runnable: each parses its options, and the cheapest one
runs end to end (real processes on 127.0.0.1) and checks its own result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "benchmarks").glob("*.py"))


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env, check=False)


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 9


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_parses_its_options(script: Path) -> None:
    done = _run([str(script), "--help"], timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_cpu_budget_runs_and_checks_its_result() -> None:
    done = _run([str(REPO / "benchmarks" / "cpu_budget.py"), "--nprocs", "2",
                 "--size", "1M", "--iters", "2"], timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all_reduce 1 MiB float32, 2 ranks" in done.stdout
    assert "measured busbw" in done.stdout
    lines = [line.split() for line in done.stdout.splitlines()]
    ranks = sorted(int(parts[0]) for parts in lines if len(parts) == 6 and parts[0].isdigit())
    assert ranks == [0, 1]
