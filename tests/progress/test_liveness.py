"""Liveness that compute cannot break, with real processes over real TCP.

With the transport on the progress thread, a rank that computes for three liveness
windows (in pure Python or in GIL-releasing NumPy kernels) between two collectives is
never declared dead; a SIGSTOPped rank still is, naming that rank, from the heartbeat
window rather than the much longer operation timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WAIT = 90.0
"""Outer bound on every wait for a line from a rank."""


def env_for(rank: int, coordinator: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, NETDIST_RANK=str(rank), NETDIST_WORLD_SIZE="2",
               NETDIST_COORDINATOR=coordinator, NETDIST_JOB_ID="liveness",
               NETDIST_TOKEN="liveness-test-token-0123456789",
               PYTHONPATH=str(ROOT), **extra)
    env.pop("NETDIST_SPIN_US", None)
    return env


def read_line(stream: IO[str], prefix: str) -> str:
    """The first line starting with ``prefix`` (bounded by the test's own timeout)."""
    for line in stream:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise AssertionError(f"the rank exited without printing {prefix!r}")


@contextmanager
def two_ranks(mode: list[str], **extra: str) -> Iterator[list[subprocess.Popen[str]]]:
    cmd = [sys.executable, "-m", "tests.progress.liveness_worker", *mode]
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(subprocess.Popen(cmd, env=env_for(0, "127.0.0.1:0", **extra), cwd=ROOT,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        assert procs[0].stdout is not None
        coordinator = read_line(procs[0].stdout, "COORDINATOR ")
        procs.append(subprocess.Popen(cmd, env=env_for(1, coordinator, **extra), cwd=ROOT,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(WAIT)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


@pytest.mark.timeout(180)
def test_a_rank_computing_for_three_liveness_windows_is_never_declared_dead() -> None:
    # window = 0.5 s x 4 = 2 s; rank 0 computes 6 s in Python, then 6 s in NumPy
    with two_ranks(["compute", "6"], NETDIST_HEARTBEAT_INTERVAL="0.5",
                   NETDIST_HEARTBEAT_MISSES="4", NETDIST_TIMEOUT="120") as procs:
        outputs = [proc.communicate(timeout=WAIT)[0] for proc in procs]
        codes = [proc.returncode for proc in procs]
    assert codes == [0, 0], outputs
    for output in outputs:
        assert "DONE 32.0" in output  # 4 x 2 ranks, doubled by the two later all-reduces


@pytest.mark.timeout(120)
def test_a_sigstopped_rank_is_reported_by_name_from_the_liveness_window() -> None:
    with two_ranks(["stop"], NETDIST_HEARTBEAT_INTERVAL="0.5", NETDIST_HEARTBEAT_MISSES="4",
                   NETDIST_TIMEOUT="600") as procs:
        assert procs[0].stdout is not None and procs[1].stdout is not None
        read_line(procs[0].stdout, "READY ")
        pid = int(read_line(procs[1].stdout, "READY "))
        os.kill(pid, signal.SIGSTOP)
        try:
            lost = read_line(procs[0].stdout, "LOST ")
        finally:
            os.kill(pid, signal.SIGKILL)
        assert procs[0].wait(WAIT) == 3
    assert lost.startswith("PeerLostError")
    assert "rank 1" in lost
    assert "presumed dead" in lost  # the heartbeat window fired, not the 600 s timeout


@pytest.mark.timeout(120)
def test_ctrl_c_in_a_blocking_call_interrupts_it_and_the_peer_is_told() -> None:
    with two_ranks(["interrupt"], NETDIST_TIMEOUT="600") as procs:
        assert procs[0].stdout is not None and procs[1].stdout is not None
        read_line(procs[0].stdout, "READY ")  # then it interrupts itself once blocked
        read_line(procs[1].stdout, "READY ")
        read_line(procs[0].stdout, "INTERRUPTED")
        lost = read_line(procs[1].stdout, "LOST ")
        assert procs[0].wait(WAIT) == 130
        assert procs[1].wait(WAIT) == 3
    assert lost.startswith("PeerLostError") and "rank 0" in lost
    assert "KeyboardInterrupt" in lost  # rank 0 said why it left
