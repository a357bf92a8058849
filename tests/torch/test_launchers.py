"""The launch lines of the README, run as written: torchrun (standalone and with a fixed
master), ``netdist launch`` and Open MPI's ``mpirun``, each starting real processes that
run a netdist script or a DDP script on the ``netdist`` backend.

The DDP script never imports ``netdist.torch``: ``init_process_group("netdist")`` finds
the backend through the ``torch.distributed.backends`` entry point.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_in_ci
from tests.ranks import finish_ranks, free_port, start_processes

REPO_ROOT = Path(__file__).resolve().parents[2]
BOUND = 120.0  # every launcher run is killed after this many seconds
MPIRUN_MISSING = ("mpirun not found: apt-get install openmpi-bin (Debian/Ubuntu) or "
                  "brew install open-mpi (macOS); .ci/run installs it")

pytestmark = pytest.mark.slow

NETDIST_SCRIPT = r'''
import asyncio, json, os, sys
import numpy as np
import netdist
from netdist.collectives import Group

async def main():
    async with netdist.init() as transport:
        total = await Group(transport).all_reduce(np.ones(3))
        return transport.rank, float(total[0])

rank, total = asyncio.run(main())
with open(os.path.join(sys.argv[1], f"netdist-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "sum": total}, f)
'''

DDP_SCRIPT = r'''
import json, os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("netdist")      # found through netdist's entry point
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(100 + rank)
for _ in range(5):
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
weights = [p.detach().double().sum().item() for p in model.parameters()]
with open(os.path.join(sys.argv[1], f"ddp-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "backend": dist.get_backend(),
               "local_rank": os.environ.get("LOCAL_RANK"), "weights": weights}, f)
dist.destroy_process_group()
'''


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NETDIST_", "MASTER_", "TORCHELASTIC_", "OMPI_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=BOUND, env=env,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


def _results(out: Path, prefix: str, n: int) -> list[dict]:
    found = sorted(out.glob(f"{prefix}-*.json"))
    assert len(found) == n, f"expected {n} result files, got {[p.name for p in found]}"
    return [json.loads(p.read_text()) for p in found]


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _assert_ddp(results: list[dict], n: int) -> None:
    assert [r["rank"] for r in results] == list(range(n))
    assert {r["backend"] for r in results} == {"netdist"}
    assert all(r["weights"] == results[0]["weights"] for r in results)  # bitwise


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def test_torchrun_standalone_runs_a_netdist_script(tmp_path: Path) -> None:
    script = _script(tmp_path, "job.py", NETDIST_SCRIPT)
    _run([*_torchrun(), "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)],
         _env(NETDIST_TOKEN=secrets.token_hex(16)))
    assert [r["sum"] for r in _results(tmp_path, "netdist", 2)] == [2.0, 2.0]


def test_torchrun_with_a_fixed_master_runs_a_netdist_script(tmp_path: Path) -> None:
    """The line that failed before: netdist's coordinator must not take torchrun's store port."""
    script = _script(tmp_path, "job.py", NETDIST_SCRIPT)
    port = free_port()
    _run([*_torchrun(), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
          "127.0.0.1", "--master-port", str(port), str(script), str(tmp_path)],
         _env(NETDIST_TOKEN=secrets.token_hex(16)))
    assert [r["sum"] for r in _results(tmp_path, "netdist", 2)] == [2.0, 2.0]


def test_torchrun_standalone_runs_ddp_on_netdist(tmp_path: Path) -> None:
    script = _script(tmp_path, "train.py", DDP_SCRIPT)
    _run([*_torchrun(), "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)],
         _env())
    results = _results(tmp_path, "ddp", 2)
    _assert_ddp(results, 2)
    assert [r["local_rank"] for r in results] == ["0", "1"]


def test_netdist_launch_runs_ddp_on_netdist(tmp_path: Path) -> None:
    script = _script(tmp_path, "train.py", DDP_SCRIPT)
    _run([sys.executable, "-m", "netdist", "launch", "-n", "3", "--", sys.executable,
          str(script), str(tmp_path)], _env())
    results = _results(tmp_path, "ddp", 3)
    _assert_ddp(results, 3)
    assert [r["local_rank"] for r in results] == ["0", "1", "2"]


def test_slurm_environment_runs_ddp_on_netdist(tmp_path: Path) -> None:
    """What ``srun`` gives each task (SLURM_PROCID, SLURM_NTASKS), with the README's
    NETDIST_COORDINATOR and NETDIST_TOKEN lines; torch's own rendezvous needs MASTER_*."""
    script = _script(tmp_path, "train.py", DDP_SCRIPT.replace(
        'dist.init_process_group("netdist")',
        'dist.init_process_group("netdist", init_method="env://", '
        'rank=int(os.environ["SLURM_PROCID"]), world_size=int(os.environ["SLURM_NTASKS"]))'))
    master, coordinator = free_port(), free_port()
    base = _env(SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost",
                NETDIST_COORDINATOR=f"127.0.0.1:{coordinator}",
                NETDIST_TOKEN=secrets.token_hex(32), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master))
    procs = start_processes([[str(script), str(tmp_path)]] * 2, merge_stderr=False,
                            env=lambda r: dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)))
    outputs = [(p.stdout, p.stderr) for p in finish_ranks(procs, BOUND)]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    _assert_ddp(_results(tmp_path, "ddp", 2), 2)


def test_mpirun_line_runs_a_netdist_script(tmp_path: Path) -> None:
    """README: ``mpirun -n 4 -x NETDIST_COORDINATOR=node0:29400 -x NETDIST_TOKEN python
    train.py``, on this host (127.0.0.1, a free port) and with 2 ranks. ``.ci/run``
    installs Open MPI, and with CI=true a missing mpirun fails; elsewhere the test skips,
    saying what is missing and how to get it."""
    if shutil.which("mpirun") is None:
        require_in_ci(MPIRUN_MISSING)
    script = _script(tmp_path, "job.py", NETDIST_SCRIPT)
    coordinator = f"127.0.0.1:{free_port()}"
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    _run(["mpirun", *root, "--oversubscribe", "-n", "2", "-x", f"NETDIST_COORDINATOR={coordinator}",
          "-x", "NETDIST_TOKEN", "-x", "PYTHONPATH", sys.executable, str(script), str(tmp_path)],
         _env(NETDIST_TOKEN=secrets.token_hex(16)))
    assert [r["sum"] for r in _results(tmp_path, "netdist", 2)] == [2.0, 2.0]
