"""``netdist bench --dtype bfloat16`` in processes without ``ml_dtypes``: every collective
runs on bfloat16's raw bits and passes its exact correctness check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BOUND = 120.0

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
def test_bench_bfloat16_without_ml_dtypes(tmp_path: Path, op: str) -> None:
    # ml_dtypes hidden in this command and in every rank it starts
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['ml_dtypes'] = None\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(tmp_path), str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    for key in ("NETDIST_TOKEN", "NETDIST_JOB_ID", "NETDIST_RANK", "NETDIST_WORLD_SIZE",
                "NETDIST_COORDINATOR"):
        env.pop(key, None)
    rows_file = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "-m", "netdist.cli.main", "bench", op, "-n", "3", "--dtype",
         "bfloat16", "--sizes", "6,96,60K", "--iters", "1", "--warmup", "0",
         "--json", str(rows_file)],
        capture_output=True, text=True, timeout=BOUND, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(rows_file.read_text())
    assert report["meta"]["dtype"] == "bfloat16"
    rows = [(r["dtype"], r["count"], r["check"]) for r in report["rows"]]
    assert rows == [("bfloat16", 3, "ok"), ("bfloat16", 48, "ok"),
                    ("bfloat16", 30720, "ok")], result.stdout
    table = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert "ok" in table[-1]
    assert "# rank 0 total: sent " in result.stdout  # its traffic, after the table
    assert report["meta"]["traffic"]["sent_bytes"] > 0
