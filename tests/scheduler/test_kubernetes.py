"""The Kubernetes manifests of docs/kubernetes.md, run as their controllers would run them.

No kubelet runs here, so the test does the controllers' part (``tests.scheduler.k8s_pods``):
every pod's command, as the manifest under ``examples/kubernetes/`` says it, runs as a
local process with the environment the controller gives that pod. The only change is
where the pods meet: each pod's DNS name becomes 127.0.0.1, and the port a free one (the
test checks first that the manifest's address is the name Kubernetes gives the pod). The
job completes when every pod exits 0.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import yaml  # a dependency of mkdocs, which the test extra installs

from netdist.netlab.processes import RankProcess, RankResult, wait_all
from tests.ranks import free_port
from tests.scheduler.ddp_reference import DDP_SCRIPT, parse_ddp_lines, reference_weights_sum
from tests.scheduler.k8s_pods import Pod, indexed_job_pods, pytorchjob_pods

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "examples" / "kubernetes"
DOCS_PAGE = REPO / "docs" / "kubernetes.md"
JOB_TIMEOUT = 100.0
SECRET = ("netdist-token", "token")  # kubectl create secret generic netdist-token ...


def _documents(name: str) -> list[object]:
    return list(yaml.safe_load_all((MANIFESTS / name).read_text(encoding="utf-8")))


def _argv(command: Sequence[str]) -> list[str]:
    """The pod's command on this machine: the image's ``netdist`` and ``python3`` are
    this interpreter's."""
    head, *rest = command
    if head == "netdist":
        return [sys.executable, "-m", "netdist", *rest]
    if head in ("python", "python3"):
        return [sys.executable, *rest]
    return list(command)


def _image_env() -> dict[str, str]:
    """What the image provides beneath the pod's variables: a PATH and netdist."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    return env


def _run_pods(pods: Sequence[Pod], env: Mapping[str, Mapping[str, str]], cwd: Path
              ) -> list[RankResult]:
    """Start every pod's command with its environment (``env[pod.name]`` overriding the
    meeting point), wait for all with one deadline; a failing pod ends the others."""
    started: list[RankProcess] = []
    try:
        for index, pod in enumerate(pods):
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            process = subprocess.Popen(_argv(pod.command), cwd=cwd,
                                       env={**_image_env(), **pod.env, **env[pod.name]},
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                       start_new_session=True)
            started.append(RankProcess(index, pod.name, process, out, err))
    except BaseException:
        wait_all(started, 0.0)
        raise
    return wait_all(started, JOB_TIMEOUT)


def _report(results: Sequence[RankResult]) -> str:
    return "\n".join(f"--- {r.host}: exit {r.returncode}{' (killed)' if r.killed else ''}\n"
                     f"{r.stdout}{r.stderr}" for r in results)


def test_docs_show_the_manifests() -> None:
    text = DOCS_PAGE.read_text(encoding="utf-8")
    for name in ("indexed-job.yaml", "pytorchjob.yaml"):
        assert f'--8<-- "examples/kubernetes/{name}"' in text, name
    assert '--8<-- "examples/slurm/ddp_train.py"' in (REPO / "docs" / "slurm.md").read_text()


def test_indexed_job_trains_the_demo(tmp_path: Path) -> None:
    """4 pods of the indexed Job, rank = JOB_COMPLETION_INDEX: every pod exits 0 and pod
    0 prints the demo's epochs and its usual accuracy (>= 95%)."""
    token = secrets.token_hex(32)
    pods = indexed_job_pods(_documents("indexed-job.yaml"), {SECRET: token})
    assert [p.env["JOB_COMPLETION_INDEX"] for p in pods] == ["0", "1", "2", "3"]
    assert {p.env["NETDIST_WORLD_SIZE"] for p in pods} == {"4"}
    assert {p.env["NETDIST_TOKEN"] for p in pods} == {token}
    coordinator = {p.env["NETDIST_COORDINATOR"] for p in pods}
    assert coordinator == {f"{pods[0].hostname}:29400"}  # pod 0, through the headless Service
    here = f"127.0.0.1:{free_port()}"
    results = _run_pods(pods, {p.name: {"NETDIST_COORDINATOR": here} for p in pods}, tmp_path)
    assert all(r.ok for r in results), _report(results)
    out = results[0].stdout
    assert "netdist demo: 4 training ranks, aggregator ring" in out, _report(results)
    assert re.search(r"^epoch 20/20  step   240/240  loss ", out, re.M), out
    match = re.search(r"^final test accuracy: (\d+\.\d)%$", out, re.M)
    assert match and float(match.group(1)) >= 95.0, out
    assert all(r.stdout == "" for r in results[1:]), _report(results)  # rank 0 reports


def test_pytorchjob_runs_ddp_on_netdist(tmp_path: Path) -> None:
    """The PyTorchJob's master and worker run ddp_train.py with the operator's variables:
    DDP on backend netdist over 2 ranks, replicas identical, equal to one process."""
    token = secrets.token_hex(32)
    pods = pytorchjob_pods(_documents("pytorchjob.yaml"), {SECRET: token})
    assert [p.name for p in pods] == ["netdist-ddp-master-0", "netdist-ddp-worker-0"]
    for rank, pod in enumerate(pods):
        assert {k: pod.env[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                        "PET_NODE_RANK", "PET_NNODES", "PET_MASTER_ADDR",
                                        "PET_MASTER_PORT", "NETDIST_TOKEN")} == {
            "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": pods[0].hostname,
            "MASTER_PORT": "23456", "PET_NODE_RANK": str(rank), "PET_NNODES": "2",
            "PET_MASTER_ADDR": pods[0].hostname, "PET_MASTER_PORT": "23456",
            "NETDIST_TOKEN": token}
        assert pod.working_dir == "/workspace" and pod.command == ("python3", "ddp_train.py")
    shutil.copy2(DDP_SCRIPT, tmp_path / "ddp_train.py")  # the image's /workspace
    port = str(free_port())
    meet = {"MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "PET_MASTER_PORT": port}
    results = _run_pods(pods, {p.name: meet for p in pods}, tmp_path)
    assert all(r.ok for r in results), _report(results)
    lines = parse_ddp_lines("".join(r.stdout for r in results))
    assert [(line.rank, line.world, line.backend, line.identical) for line in lines] == [
        (0, 2, "netdist", True), (1, 2, "netdist", True)], _report(results)
    assert lines[0].weights_sum == lines[1].weights_sum
    assert lines[0].weights_sum == pytest.approx(reference_weights_sum(2), abs=1e-4)
