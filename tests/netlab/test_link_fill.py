"""``benchmarks/link_fill.py --quick`` keeps running, so it cannot rot: every variant
moves its bytes over a delayed netlab link and reports a rate and the windows it read
back. No speed is asserted (speed claims live in the benchmark's own output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_harness import run_benchmark
from tests.netlab import require_netlab

pytestmark = pytest.mark.slow

BOUND = 180.0


@pytest.mark.timeout(BOUND + 30)
def test_link_fill_quick_reports_every_variant(tmp_path: Path) -> None:
    require_netlab()
    out = tmp_path / "link_fill.json"
    done = run_benchmark("link_fill", ["--quick", "--transfer-timeout", "30", "--json",
                                       str(out)], timeout=BOUND, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["failed"] == []
    assert len(result["capacity_mbit"]) == 2 and min(result["capacity_mbit"]) > 0
    rows = [r for r in result["rows"] if r["delay_ms"] == 25.0]
    assert [r["variant"] for r in rows] == ["netdist", "both", "autotune", "sndbuf", "big",
                                            "stripe", "transport"]
    for row in rows:
        assert row["rate_mbit"] > 0 and row["sndbuf"] > 0 and row["rcvbuf"] > 0, row
        if row["variant"] != "transport":
            assert row["min_rtt_ms"] >= 50.0 and row["bound_mbit"] > 0, row
    assert {r["streams"] for r in rows if r["variant"] == "stripe"} == {2}
    assert "median steady rate" in done.stdout
