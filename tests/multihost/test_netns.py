"""Across real network stacks: hosts are network namespaces on one switch, each host's
link shaped with ``tc tbf`` (``netdist.netlab.Cluster``), every rank a process in its
host. The two-level collectives give the single-host bits there too, through the API
and torch; a host whose link is cut fails every rank, naming a rank across the cut,
within the documented bound (the liveness window, three times that on a link that was
losing packets). Root only: CI runs these, elsewhere they say what is missing.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

import pytest

from netdist.netlab import Cluster
from netdist.transport.link_stats import LOSSY_LINK_FACTOR
from tests.netlab import require_netlab

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RATE_MBIT = 1000
HEARTBEAT_INTERVAL, HEARTBEAT_MISSES = 0.5, 4
WINDOW = HEARTBEAT_INTERVAL * HEARTBEAT_MISSES
SLACK = 15.0  # process scheduling on a loaded 2-core CI machine, on top of the bound


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


@pytest.mark.parametrize("layout, mode, torch", [
    ("2x2", "MODE hierarchical single", False),
    ("1,2,3", "MODE uneven hosts single", False),
    ("2x2", None, True),
], ids=["2x2", "3x(1,2,3)", "2x2-torch"])
def test_two_level_collectives_across_namespaces_are_bitwise_single_host(
        layout: str, mode: str | None, torch: bool) -> None:
    require_netlab()
    if torch:
        pytest.importorskip("torch")
    elements = "600000" if torch else "100003"
    argv = _python("tests.multihost.two_level_worker", elements,
                   *(["--torch"] if torch else []))
    with Cluster.create(layout, rate_mbit=RATE_MBIT) as cluster:
        results = cluster.run(lambda rank: argv, timeout=300, token="t" * 32, torch=torch,
                              cwd=str(REPO), extra={"PYTHONPATH": str(REPO)})
    for result in results:
        assert result.ok, f"rank {result.rank}: {result.stdout}\n{result.stderr[-3000:]}"
        assert f"OK rank {result.rank}" in result.stdout
        if mode is not None:
            assert mode in result.stdout, result.stdout


def test_a_cut_host_link_fails_every_rank_naming_a_rank_across_the_cut() -> None:
    require_netlab()
    with tempfile.TemporaryDirectory() as ready_dir, \
            Cluster.create("2x2", rate_mbit=RATE_MBIT) as cluster:
        ready = Path(ready_dir)
        cluster.start(lambda rank: _python("tests.multihost.cut_worker", ready_dir),
                      token="t" * 32, cwd=str(REPO),
                      extra={"PYTHONPATH": str(REPO),
                             "NETDIST_HEARTBEAT_INTERVAL": str(HEARTBEAT_INTERVAL),
                             "NETDIST_HEARTBEAT_MISSES": str(HEARTBEAT_MISSES),
                             "NETDIST_TIMEOUT": "120"})
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < 4:  # every rank has finished an all-reduce
            assert time.monotonic() < deadline, "the ranks never all-reduced"
            time.sleep(0.05)  # polling a directory for the ranks' files: bounded above
        cut_at = time.monotonic()
        cluster.cut(1)  # host 1 holds ranks 2 and 3
        results = cluster.wait(timeout=3 * LOSSY_LINK_FACTOR * WINDOW + 120)
    across = {0: {2, 3}, 1: {2, 3}, 2: {0, 1}, 3: {0, 1}}
    for result in results:
        assert result.ok, f"rank {result.rank}: {result.stdout}\n{result.stderr[-3000:]}"
        assert "MODE LocalMode.HIERARCHICAL" in result.stdout
        found = re.search(r"LOST rank=(\d+) origin=(\d+) at=([\d.]+)", result.stdout)
        assert found, result.stdout
        origin, at = int(found.group(2)), float(found.group(3))
        assert origin in across[result.rank], result.stdout
        print(f"rank {result.rank} named rank {origin} lost {at - cut_at:.2f}s after the cut")
        assert at - cut_at <= LOSSY_LINK_FACTOR * WINDOW + SLACK, (
            f"rank {result.rank} took {at - cut_at:.1f}s to name the loss")
