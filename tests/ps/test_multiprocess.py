"""``netdist ps-server`` ranks and worker processes over real TCP on 127.0.0.1."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest

from netdist.ps import SGDConfig
from tests import ranks
from tests.ps.test_sharded import local_reference

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("netdist.transport.bootstrap")


def job_args(outdir: Path, *extra: str, servers: int = 2) -> list[str]:
    """Arguments of ``python -m netdist.cli.ps_server`` for ``servers`` servers whose
    workers run ``tests.ps._mp_worker`` with ``extra``."""
    return ["--num-servers", str(servers), "--", sys.executable, "-m", "tests.ps._mp_worker",
            str(outdir), *extra]


def job_command(outdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "netdist.cli.ps_server", *job_args(outdir, *extra)]


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
    procs = ranks.start_ranks(4, "netdist.cli.ps_server", job_args(tmp_path, "--die-at", "3"),
                              timeout=30.0, job_prefix="ps-kill-test")
    outputs = ranks.finish_ranks(procs, timeout=60.0)
    codes = [done.returncode for done in outputs]
    assert codes[2] == 3  # the worker that died
    for rank in (0, 1):  # the servers name the lost worker
        assert codes[rank] == 1, outputs[rank].stdout
        assert "worker rank 2" in outputs[rank].stdout, outputs[rank].stdout
    assert codes[3] != 0  # the surviving worker is told why
    assert "worker rank 2" in outputs[3].stdout, outputs[3].stdout
