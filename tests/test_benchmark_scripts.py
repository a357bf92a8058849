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
                 "--size", "2M", "--iters", "2", "--paths", "shm,staged,tcp"], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all_reduce 2 MiB float32, 2 ranks" in done.stdout
    assert "data path shm (group mode single-host, copy single)" in done.stdout
    assert "data path staged (group mode single-host, copy staged)" in done.stdout
    assert "data path tcp (group mode tcp, copy none)" in done.stdout
    assert done.stdout.count("measured busbw") == 3
    lines = [line.split() for line in done.stdout.splitlines()]
    ranks = [int(parts[0]) for parts in lines if len(parts) == 7 and parts[0].isdigit()]
    assert ranks == [0, 1, 0, 1, 0, 1]


def test_torch_ddp_quick_runs_both_backends(tmp_path: Path) -> None:
    """torch_ddp.py --quick: a tiny DDP model and all_reduce through both backends end to
    end (2 ranks each), the table and the JSON carry netdist and gloo side by side, and
    the 2-rank DDP losses are bitwise equal (no timing is asserted)."""
    import json

    pytest.importorskip("torch")
    out = tmp_path / "torch_ddp.json"
    done = _run([str(REPO / "benchmarks" / "torch_ddp.py"), "--quick", "--json", str(out)],
                 timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    table = [line.split() for line in done.stdout.splitlines()]
    ddp_rows = [row[2] for row in table if len(row) > 2 and row[0] == "2"
                and row[2] in ("netdist", "gloo")]
    assert ddp_rows == ["netdist", "gloo"]
    assert "# ranks   size      gloo time   netdist time" in done.stdout
    result = json.loads(out.read_text())
    assert result["labels"] == ["netdist", "gloo"] and result["quick"] is True
    assert result["failed_jobs"] == []
    (ddp,) = result["ddp"]
    assert ddp["world_size"] == 2 and ddp["rounds"] == 1 and ddp["losses_equal"] is True
    for backend in ("netdist", "gloo"):
        assert ddp[backend]["step"] > 0 and ddp[backend]["compute"] > 0
        assert ddp[backend]["floor"] > 0  # DDP with a comm hook that sends nothing
        assert ddp[backend]["helpers"] > 0  # netdist's progress thread, Gloo's threads
    assert [(row["world_size"], row["size"]) for row in result["all_reduce"]] == [
        (2, 8), (2, 1024 * 1024)]
    for row in result["all_reduce"]:
        assert row["netdist"]["time"] > 0 and row["gloo"]["time"] > 0
    names = [target["name"] for target in result["targets"]]
    assert names == ["DDP step time, 2 ranks: netdist / gloo <= 0.8",
                     "all_reduce 8 B latency, 2 ranks: netdist / gloo <= 0.5"]
    assert sum(line.startswith(("PASS  ", "MISS  ")) for line in done.stdout.splitlines()) == 2
    assert 0 < ddp["floor_ratio"] and "with no communication at all" in done.stdout


def test_scale_runs_small_jobs_and_judges_its_targets(tmp_path: Path) -> None:
    """scale.py at n = 2 and 4 (lazy) and 2 (eager): every job completes with correct
    results, a ring all-reduce leaves each lazy rank exactly its 2 neighbours (1 at n = 2)
    while eager ranks hold everyone from the start, and every PS round completes (no
    timing is asserted: the connect-time line may read PASS or MISS)."""
    import json

    out = tmp_path / "scale.json"
    done = _run([str(REPO / "benchmarks" / "scale.py"), "--sizes", "2,4", "--eager", "2",
                 "--ps-rounds", "2", "--ring-kib", "16", "--ps-kib", "4",
                 "--json", str(out)], timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["plan"] == ["lazy 2", "lazy 4", "eager 2"]
    runs = result["results"]
    for key, joined, ring in (("lazy 2", 0, 1), ("lazy 4", 0, 2), ("eager 2", 1, 1)):
        run = runs[key]
        assert (run["runs"], run["failed"], run["correct"]) == (1, 0, True), key
        assert run["peers_joined"]["max"] == joined and run["peers_ring"]["max"] == ring, key
        assert run["ps"]["completed"] == 2, key
    assert "PASS  connections per rank after a ring all-reduce, lazy n=4: at most 2" in done.stdout
    assert "PASS  sync PS 1 server + 3 workers: 2/2 rounds on every rank" in done.stdout
    assert sum(line.startswith(("PASS  ", "MISS  ")) for line in done.stdout.splitlines()) == 5


@pytest.mark.slow
def test_tensor_parallel_quick_runs_every_variant(tmp_path: Path) -> None:
    """tensor_parallel.py --quick: unsharded, TP and DP at 2 and 4 ranks (real processes
    over TCP) all complete, the unsharded block sends nothing, and each TP step moves
    exactly one all-reduce each way (the script's own byte check; no timing is asserted)."""
    import json

    from tests.benchmark_harness import run_benchmark

    out = tmp_path / "tensor_parallel.json"
    done = run_benchmark("tensor_parallel", ["--quick", "--json", str(out)], timeout=150,
                         cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["quick"] is True
    rows = {row["label"]: row for row in result["rows"]}
    assert list(rows) == ["unsharded", "tp 2", "dp 2", "tp 4", "dp 4"]
    assert rows["unsharded"]["sent_per_rank"] == 0
    for label in ("tp 2", "tp 4"):
        assert rows[label]["check"] is True and rows[label]["sent_per_rank"] > 0
    assert all(row["time"] > 0 for row in rows.values())
    assert "one all-reduce each way" in done.stdout
