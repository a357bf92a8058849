"""torchrun restarts a DDP job on netdist after a SIGKILL, and it recovers on the FIRST
restart (issue 27, item 3).

Each test runs real ``torchrun --max-restarts 2`` jobs of 2 workers on 127.0.0.1
(``benchmarks/torchrun_restarts.py``'s ``run_job``): the training script
``examples/ecosystem/torchrun_train.py`` saves a DCP checkpoint every step; rank 1 of
attempt 0 says (a file) when step 2's checkpoint is complete and is SIGKILLed on it;
torchrun restarts the group, which resumes from that checkpoint. The job must finish in
attempt 1 (``TORCHELASTIC_RESTART_COUNT`` as the workers recorded it), with the final
weights bitwise those of an uninterrupted run, every rank of each attempt having met at
its own attempt's coordinator. Before the fix, attempt 1 read attempt 0's coordinator
address from torchrun's store and failed (``ConnectError ... (124 attempts)``).
``python benchmarks/torchrun_restarts.py`` runs the same trial 10 times.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.benchmark_harness import load_benchmark

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "ecosystem.md"


harness = load_benchmark("torchrun_restarts")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The same script under torchrun, never killed: the weights to match bit for bit."""
    result = harness.run_job(tmp_path_factory.mktemp("uninterrupted"), pause_after=None)
    assert harness.problems(result, None, restarts=0, pause_after=None) == [], result.log()
    return result


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("rdzv", ["c10d", "standalone"])
def test_a_sigkilled_worker_recovers_on_the_first_restart(
        tmp_path: Path, uninterrupted: Any, rdzv: str) -> None:
    result = harness.run_job(tmp_path, rdzv=rdzv)
    log = result.log()
    assert result.killed_pid is not None, log
    assert result.returncode == 0, log
    # finished on the first restart, both ranks, as the workers recorded it
    assert [(f["rank"], f["attempt"]) for f in result.finals] == [(0, 1), (1, 1)], log
    # resumed from the last complete checkpoint (step 2), and the weights are bitwise
    # those of the uninterrupted run
    assert {j["resumed_after"] for j in result.joined if j["attempt"] == 1} == {2}
    weights = {f["weights"] for f in result.finals}
    assert weights == {uninterrupted.finals[0]["weights"]}
    assert len(weights.pop()) == 2 * 4 * (8 * 16 + 16 + 16 + 1)  # hex of the float32s
    # no stale address: each attempt's ranks met at that attempt's own coordinator
    met = {(j["attempt"], j["rank"]): j["record"] for j in result.joined}
    assert sorted(met) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for attempt in (0, 1):
        assert met[attempt, 0] == met[attempt, 1]
        assert met[attempt, 0]["restart_count"] == attempt
    assert met[1, 0]["nonce"] != met[0, 0]["nonce"]
    assert harness.problems(result, uninterrupted) == []
    assert "ConnectError" not in log and "RendezvousTimeoutError" not in log


def test_the_docs_recipe_is_the_command_the_test_runs() -> None:
    """docs/ecosystem.md shows the torchrun lines ``run_job`` starts (with the
    page's port, ``torchrun`` for ``python -m torch.distributed.run``), and the training
    script's ``# run:`` line is the c10d one."""
    text = DOC.read_text(encoding="utf-8")
    shown = [shlex.split(line.replace("\\\n", " "))
             for line in re.findall(r"^torchrun (?:.+\\\n)*.+$", text, flags=re.M)]
    for rdzv in ("c10d", "standalone"):
        argv = harness.torchrun_argv(rdzv, 29400, Path("OUT"))
        assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
        expected = ["torchrun", *argv[3:-2], "torchrun_train.py", "OUT"]
        assert expected in shown, (rdzv, expected, shown)
    script = harness.TRAIN.read_text(encoding="utf-8").splitlines()
    c10d = harness.torchrun_argv("c10d", 29400, Path("OUT"))
    assert script[1] == "# run: " + shlex.join(["torchrun", *c10d[3:-2],
                                                "torchrun_train.py", "OUT"])
