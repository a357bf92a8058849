"""PyTorch Lightning's ``DDPStrategy`` on the netdist backend, against Gloo (issue 27).

Lightning syncs ``self.log(..., sync_dist=True)`` with ``ReduceOp.AVG`` on every backend
but Gloo (on Gloo: SUM, then a division), and one of the tensors it averages is an int64
batch-size count; netdist used to refuse integer AVG, crashing both ranks in the sanity
check. The test runs the documented recipe, ``examples/ecosystem/lightning_ddp.py``
under ``netdist launch -n 2`` exactly as ``docs/ecosystem.md`` shows it (real
processes on 127.0.0.1, Lightning finding the ranks from the launcher's ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``), once per backend, and compares: the trained weights
bit for bit, every logged metric bit for bit, and the int64 mean Lightning takes through
``strategy.reduce(..., reduce_op="mean")``. The shards are uneven (rank 0 holds one
sample more), so the integer averages leave a remainder: 13 samples over 2 ranks average
to 6 on both backends.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import require_in_ci
from tests.torch.torch_ranks import assert_bitwise_equal

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE = REPO_ROOT / "examples" / "ecosystem" / "lightning_ddp.py"
BOUND = 150.0  # seconds one launch (two ranks, Lightning's imports, 4 steps) may take

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * BOUND + 30)]


def _launch(backend: str, out: Path) -> subprocess.CompletedProcess[str]:
    """``netdist launch -n 2 -- python lightning_ddp.py`` as the page shows it, with the
    backend and an output folder; ranks die with the launcher, which ``--timeout`` bounds."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NETDIST_", "MASTER_", "TORCHELASTIC_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    command = [sys.executable, "-m", "netdist", "launch", "-n", "2", "--timeout",
               str(BOUND - 10), "--", sys.executable, str(RECIPE), "--backend", backend,
               "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, timeout=BOUND, env=env,
                          cwd=out)


def test_lightning_fit_with_sync_dist_on_netdist_equals_gloo(tmp_path: Path) -> None:
    if importlib.util.find_spec("lightning") is None:
        require_in_ci("lightning is not installed: pip install -e '.[test]'")
    runs = {}
    for backend in ("gloo", "netdist"):
        result = _launch(backend, tmp_path)
        assert result.returncode == 0, \
            f"{backend}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        runs[backend] = [torch.load(tmp_path / f"{backend}-rank{rank}.pt", weights_only=True)
                         for rank in range(2)]
        lines = [line for line in result.stdout.splitlines() if f" on {backend}: " in line]
        assert len(lines) == 2, result.stdout
        assert len({line.split(": ", 1)[1] for line in lines}) == 1, lines  # ranks agree
    for rank in range(2):
        ours, gloo = runs["netdist"][rank], runs["gloo"][rank]
        assert sorted(ours["metrics"]) == ["train_loss", "train_loss_epoch", "train_loss_step",
                                           "val_loss"], sorted(ours["metrics"])
        assert_bitwise_equal(ours["weights"], gloo["weights"], f"rank {rank} weights")
        assert_bitwise_equal(ours["metrics"], gloo["metrics"], f"rank {rank} metrics")
        assert ours["mean_seen"].dtype == torch.int64
        assert ours["mean_seen"].item() == gloo["mean_seen"].item() == 6  # 13 // 2
        assert_bitwise_equal(ours["weights"], runs["netdist"][0]["weights"], "ranks' weights")
        assert_bitwise_equal(ours["metrics"], runs["netdist"][0]["metrics"], "ranks' metrics")
    assert torch.isfinite(runs["netdist"][0]["metrics"]["val_loss"])
