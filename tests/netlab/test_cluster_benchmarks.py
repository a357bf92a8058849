"""The benchmarks that run their ranks on netlab hosts keep running, so they cannot rot:
``benchmarks/multihost.py --quick`` (every column, Gloo, netdist through torch and
netdist's own API, measures every op on a 2x1 cluster and netdist's results pass their
check; the bounds and targets are checked on their own) and ``benchmarks/torch_ddp.py
--quick --layout``. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_harness import load_benchmark, run_benchmark
from tests.netlab import require_netlab

pytestmark = pytest.mark.slow

BOUND = 240.0


@pytest.mark.timeout(BOUND + 30)
def test_multihost_quick_measures_every_column(tmp_path: Path) -> None:
    require_netlab()
    pytest.importorskip("torch")
    out = tmp_path / "multihost.json"
    done = run_benchmark("multihost", ["--quick", "--child-timeout", str(BOUND / 4),
                                       "--json", str(out)], timeout=BOUND, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["layouts"] == ["2x1"] and result["quick"] is True
    assert result["failed_jobs"] == [] and result["failed_checks"] == []
    columns = ["gloo", "netdist-torch", "netdist"]
    assert result["columns"] == columns
    ops = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]
    assert [(row["op"], row["size"]) for row in result["rows"]] == [
        (op, size) for op in ops for size in (4096, 65536)]
    for row in result["rows"]:
        assert row["bound"] > 0
        for column in columns:
            assert row[column]["time"] > 0 and row[column]["rounds"] == 1, (row, column)
        assert row["netdist"]["check"] == "ok"
    table = [line.split() for line in done.stdout.splitlines()]
    assert sum(1 for words in table if words[:1] == ["2x1"]) == 8
    # sizes under 16 MiB at 2x1: only "never slower than gloo" applies, and only from 1 MiB
    assert result["targets"] == []


def test_bounds_and_targets() -> None:
    """The bounds of the module docstring, and which measured rows each target judges."""

    multihost = load_benchmark("multihost")
    mib = 1024 * 1024
    link = 1000e6 / 8
    assert multihost.bound_seconds("all_reduce", 4, 64 * mib, 1000) == pytest.approx(
        1.5 * 64 * mib / link)
    assert multihost.bound_seconds("reduce_scatter", 2, 64 * mib, 1000) == pytest.approx(
        0.5 * 64 * mib / link)
    assert multihost.bound_seconds("broadcast", 2, 64 * mib, 1000) == pytest.approx(
        64 * mib / link)
    assert multihost.bound_seconds("all_reduce", 1, 64 * mib, 1000) is None
    assert multihost.layout_texts("2x1,2x2") == ["2x1", "2x2"]
    assert multihost.layout_texts("2x2;1,2,3") == ["2x2", "1,2,3"]

    def row(layout: str, op: str, size: int, share: float, gloo: float) -> dict[str, object]:
        return {"layout": layout, "op": op, "size": size,
                "netdist": {"time": 1.0, "of_bound": share},
                "gloo": {"time": gloo, "of_bound": None}}

    rows = [row("2x2", "all_reduce", 16 * mib, 0.9, 1.2),
            row("4x2", "all_reduce", 64 * mib, 0.8, 1.1),
            row("2x2", "broadcast", 64 * mib, 0.85, 0.9),
            row("2x1", "all_gather", 16 * mib, 0.95, 2.0),
            row("2x1", "all_gather", 1 * mib, 0.5, 2.0)]  # under 16 MiB: no link target
    verdicts = [(t["name"], t["pass"]) for t in multihost.judge(rows, ["gloo", "netdist"])]
    assert verdicts == [
        ("netdist all_reduce 16M at 2x2 >= 85% of bound", True),
        ("netdist all_reduce 64M at 4x2 >= 85% of bound", False),
        ("netdist broadcast 64M at 2x2 >= 80% of bound", True),
        ("netdist all_gather 16M at 2x1 >= 90% of the link", True),
        ("netdist all_reduce never slower than gloo from 1M up (worst 0.91x, 64M at 4x2)",
         True)]


@pytest.mark.timeout(BOUND + 30)
def test_torch_ddp_runs_its_ranks_on_cluster_hosts(tmp_path: Path) -> None:
    require_netlab()
    pytest.importorskip("torch")
    out = tmp_path / "torch_ddp.json"
    done = run_benchmark("torch_ddp", ["--quick", "--layout", "1,2", "--rate-mbit", "1000",
                                       "--child-timeout", str(BOUND / 3), "--json", str(out)],
                         timeout=BOUND, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cluster 1,2 (2 hosts, 1000 Mbit/s links)" in done.stdout
    result = json.loads(out.read_text())
    assert (result["layout"], result["rate_mbit"], result["failed_jobs"]) == ("1,2", 1000.0, [])
    (ddp,) = result["ddp"]
    assert ddp["world_size"] == 3 and ddp["losses_equal"] is True
    assert [(row["world_size"], row["size"]) for row in result["all_reduce"]] == [
        (3, 8), (3, 1024 * 1024)]
