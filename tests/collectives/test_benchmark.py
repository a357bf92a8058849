"""``netdist bench``: pure helpers, the measurement driver in-process, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from netdist.collectives import Group
from netdist.collectives.benchmark import (
    BenchRow,
    busbw_factor,
    format_size,
    format_table,
    parse_size,
    parse_sizes,
    run_benchmark,
)
from tests.ranks import run_ranks

REPO = Path(__file__).resolve().parents[2]


def test_parse_sizes() -> None:
    assert parse_size("8") == 8
    assert parse_size("64K") == 65536
    assert parse_size("1MiB") == parse_size("1M") == 1 << 20
    assert parse_size("256m") == 256 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_sizes("8:64") == [8, 16, 32, 64]
    assert parse_sizes("1M:64M:4") == [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    assert parse_sizes("8, 1M") == [8, 1 << 20]
    for bad in ("", "12Q", "64:8", "8:64:1", "1:2:3:4"):
        with pytest.raises(ValueError):
            parse_sizes(bad)
    assert format_size(1 << 20) == "1M" and format_size(12) == "12"


def test_busbw_factors_match_nccl_tests() -> None:
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("all_reduce", 2) == 1.0
    assert busbw_factor("reduce_scatter", 4) == 0.75
    assert busbw_factor("all_gather", 8) == 0.875
    assert busbw_factor("broadcast", 5) == 1.0
    assert busbw_factor("barrier", 4) == 0.0


def test_format_table() -> None:
    row = BenchRow("all_reduce", 2, 1024, 256, "float32", 5, 100.0, 90.0, 120.0, 0.01024,
                   0.01024, "ok")
    text = format_table([row], "title")
    assert text.splitlines()[0] == "# title"
    assert "busbw" in text and text.splitlines()[-1].split()[0] == "1024"
    assert text.splitlines()[-1].endswith("ok")


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                "barrier"])
async def test_run_benchmark_in_process_checks_results(op: str) -> None:
    seen: list[BenchRow] = []

    async def body(g: Group) -> list[BenchRow]:
        return await run_benchmark(g, op, [8, 4096, 100_000], iters=2, warmup=1, timeout=10,
                                   on_row=seen.append if g.rank == 0 else None)

    results = await run_ranks(3, body, segment_bytes=8192, small_message_bytes=4096)
    rows = results[0]
    assert results[1] == results[2] == []
    assert rows == seen
    assert len(rows) == (1 if op == "barrier" else 3)
    for row in rows:
        assert row.op == op and row.world_size == 3 and row.iters == 2
        assert row.time_min_us <= row.time_median_us <= row.time_max_us
        assert row.check == ("-" if op == "barrier" else "ok")
        if op != "barrier":
            assert row.count * 4 == row.size
            assert row.busbw_gbps == pytest.approx(row.algbw_gbps * busbw_factor(op, 3))
    if op in ("reduce_scatter", "all_gather"):
        assert all(row.count % 3 == 0 for row in rows)  # equal shares per rank


def _cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NETDIST_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "netdist.cli.main", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_cli_bench_all_reduce_launches_ranks_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = _cli(["bench", "all_reduce", "-n", "3", "--sizes", "8,256K", "--iters", "2",
                 "--warmup", "1", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert len(lines) == 2 and all(line.rstrip().endswith("ok") for line in lines)
    data = json.loads(out.read_text())
    assert data["meta"]["world_size"] == 3
    assert [row["size"] for row in data["rows"]] == [8, 256 * 1024]


@pytest.mark.slow
def test_cli_bench_p2p_under_netdist_launch() -> None:
    # the README's first command: netdist launch -n 2 -- netdist bench p2p
    proc = _cli(["launch", "-n", "2", "--", sys.executable, "-m", "netdist.cli.main",
                 "bench", "p2p", "--sizes", "8,64K", "--iters", "3", "--warmup", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines()
            if line.startswith("[rank 0]") and not line.split("]", 1)[1].strip().startswith("#")]
    assert [row.split()[2] for row in rows] == ["8", "65536"]


def test_cli_bench_rejects_bad_flags() -> None:
    proc = _cli(["bench", "all_reduce", "--sizes", "64:8"])
    assert proc.returncode == 2 and "--sizes" in proc.stderr
    proc = _cli(["bench", "p2p", "-n", "1"])
    assert proc.returncode == 2 and "-n must be >= 2" in proc.stderr
