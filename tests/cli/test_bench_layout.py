"""``netdist bench --layout``: the bench's ranks on netlab hosts (network namespaces on a
switch), and the errors that say why it cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from netdist.cli.main import build_parser
from netdist.errors import ConfigError
from tests.netlab import require_netlab

REPO_ROOT = Path(__file__).resolve().parents[2]
BOUND = 150.0


def _args(*argv: str) -> object:
    return build_parser(("bench",)).parse_args(["bench", *argv])


@pytest.mark.slow
@pytest.mark.timeout(BOUND + 30)
def test_bench_runs_its_ranks_on_cluster_hosts(tmp_path: Path) -> None:
    require_netlab()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NETDIST_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    rows = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "netdist.cli.main", "bench", "all_reduce", "--layout", "1,2",
         "--rate-mbit", "1000", "--sizes", "8,4K", "--iters", "1", "--warmup", "0",
         "--json", str(rows), "--job-timeout", str(BOUND - 30)],
        capture_output=True, text=True, timeout=BOUND, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("# cluster 1,2: 2 hosts (3 ranks) on one switch, "
                                  "1000 Mbit/s links"), done.stdout
    report = json.loads(rows.read_text())
    assert report["meta"]["world_size"] == 3
    assert [(r["size"], r["check"]) for r in report["rows"]] == [(8, "ok"), (4096, "ok")]


@pytest.mark.parametrize("argv, message", [
    (("--layout", "2x0"), "--layout: layout '2x0'"),
    (("--layout", "2x2", "-n", "3"), "-n 3 disagrees with --layout 2x2 (4 ranks)"),
    (("--layout", "2x1", "--rate-mbit", "0"), "--rate-mbit must be positive"),
    (("--rate-mbit", "100"), "--rate-mbit shapes the links of --layout's hosts"),
])
def test_bad_layout_options_are_config_errors(argv: tuple[str, ...], message: str) -> None:
    from netdist.cli.bench import run

    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        run(_args("all_reduce", *argv))  # type: ignore[arg-type]


def test_without_namespaces_it_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from netdist.cli.bench import run
    from netdist.netlab import lab

    monkeypatch.setattr(lab, "netlab_missing", lambda: "network namespaces and tc need root")
    with pytest.raises(ConfigError, match="^--layout runs the ranks in network namespaces: "
                                          "network namespaces and tc need root$"):
        run(_args("all_reduce", "--layout", "2x2"))  # type: ignore[arg-type]
