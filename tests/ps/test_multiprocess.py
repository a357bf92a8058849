"""``netdist ps-server`` ranks and worker processes over real TCP on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from netdist.ps import SGDConfig
from tests.ps.test_sharded import local_reference

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("netdist.transport.setup")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_command(outdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "netdist.cli.ps_server", "--num-servers", "2", "--",
            sys.executable, "-m", "tests.ps._mp_worker", str(outdir), *extra]


def expected_digest() -> str:
    params = local_reference(SGDConfig(lr=0.05, momentum=0.9), 2, steps=10)
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p).tobytes())
    return h.hexdigest()


def test_ps_server_job_via_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = pytest.importorskip("netdist.launcher")
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    status = launcher.launch(job_command(tmp_path), 4, timeout=90.0,
                             env={"NETDIST_TIMEOUT": "30"})
    assert status == 0
    digests = {(tmp_path / f"rank{r}.txt").read_text() for r in (2, 3)}
    assert digests == {expected_digest()}


def test_killed_worker_process_fails_servers_and_worker(tmp_path: Path) -> None:
    world = 4
    env = dict(os.environ, PYTHONPATH=str(REPO), NETDIST_WORLD_SIZE=str(world),
               NETDIST_COORDINATOR=f"127.0.0.1:{free_port()}",
               NETDIST_TOKEN=secrets.token_hex(8), NETDIST_JOB_ID="ps-kill-test",
               NETDIST_TIMEOUT="30")
    procs = [subprocess.Popen(job_command(tmp_path, "--die-at", "3"), cwd=REPO,
                              env=dict(env, NETDIST_RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for rank in range(world)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            outputs.append((proc.returncode, out.decode(), err.decode()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    codes = [code for code, _, _ in outputs]
    assert codes[2] == 3  # the worker that died
    for rank in (0, 1):  # the servers name the lost worker
        assert codes[rank] == 1, outputs[rank]
        assert "worker rank 2" in outputs[rank][2], outputs[rank][2]
    assert codes[3] != 0  # the surviving worker is told why
    assert "worker rank 2" in outputs[3][2], outputs[3][2]
