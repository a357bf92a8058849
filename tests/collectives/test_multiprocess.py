"""Collectives between real processes on 127.0.0.1 (``tests/collectives/mp_worker.py``).

Every subprocess wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(rank: int, n: int, port: int, token: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("NETDIST_") or k == "NETDIST_SHM")
           and k not in ("RANK", "WORLD_SIZE")}
    env.update(NETDIST_RANK=str(rank), NETDIST_WORLD_SIZE=str(n),
               NETDIST_COORDINATOR=f"127.0.0.1:{port}", NETDIST_TOKEN=token,
               NETDIST_JOB_ID=f"coll-{token[:6]}", NETDIST_TIMEOUT="30",
               PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **extra)
    return env


def _spawn(n: int, args: list[str], hosts: int = 1,
           **extra: str) -> list[subprocess.Popen[str]]:
    """``n`` ranks; with ``hosts`` > 1 they pretend to be on that many hosts
    (``NETDIST_HOST_ID``), consecutive ranks together."""
    port, token = _free_port(), secrets.token_hex(16)
    per_host = -(-n // hosts)
    return [subprocess.Popen(
        [sys.executable, "-m", "tests.collectives.mp_worker", *args], cwd=REPO,
        env=_env(rank, n, port, token, **extra,
                 **({"NETDIST_HOST_ID": f"h{rank // per_host}"} if hosts > 1 else {})),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(n)]


def _expected_mode(n: int, hosts: int = 1) -> str:
    if os.environ.get("NETDIST_SHM", "1") == "0" or n // hosts < 2:
        return "tcp"
    return "single-host" if hosts == 1 else "hierarchical"


def _collect(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((proc.returncode, out))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        outputs = [p.communicate(timeout=10)[0] for p in procs]
        pytest.fail(f"ranks did not finish within {timeout}s:\n" + "\n".join(
            f"--- rank {i}\n{o}" for i, o in enumerate(outputs)))
    return results


@pytest.mark.parametrize("hosts", [1, 2])
def test_four_processes_collectives_exact(hosts: int) -> None:
    results = _collect(_spawn(4, ["check"], hosts=hosts), timeout=120)
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{out}"
        assert f"OK rank {rank}" in out
        assert f"MODE {_expected_mode(4, hosts)}" in out, out


def test_four_processes_under_the_launcher() -> None:
    from netdist.launcher import launch

    code = launch([sys.executable, "-m", "tests.collectives.mp_worker", "check"], 3,
                  env={"PYTHONPATH": str(REPO)}, timeout=120)
    assert code == 0


def test_sigkill_mid_all_reduce_fails_every_survivor_within_timeout() -> None:
    n, victim, op_timeout = 4, 2, 8.0
    started = time.monotonic()
    results = _collect(_spawn(n, ["kill", str(victim)], MP_OP_TIMEOUT=str(op_timeout)),
                       timeout=90)
    code, out = results[victim]
    assert code == -9, f"victim should have been SIGKILLed:\n{out}"
    for rank, (code, out) in enumerate(results):
        if rank == victim:
            continue
        assert code == 3, f"rank {rank} did not fail as expected ({code}):\n{out}"
        error = next(line for line in out.splitlines() if line.startswith("ERROR"))
        assert "all_reduce" in error and f"rank {victim}" in error, error
        assert ("PeerLostError" in error or "NetdistTimeoutError" in error), error
    # start-up takes a few seconds; the failure itself is bounded by the op timeout
    assert time.monotonic() - started < op_timeout + 45


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_sigkill_mid_shared_memory_all_reduce_fails_survivors_and_leaks_nothing() -> None:
    n, victim, op_timeout = 4, 1, 8.0
    before = _shm_entries()
    results = _collect(_spawn(n, ["shmkill", str(victim)], MP_OP_TIMEOUT=str(op_timeout)),
                       timeout=90)
    code, out = results[victim]
    assert code == -9, f"victim should have been SIGKILLed:\n{out}"
    for rank, (code, out) in enumerate(results):
        assert f"MODE {_expected_mode(n)}" in out, out
        if rank == victim:
            continue
        assert code == 3, f"rank {rank} did not fail as expected ({code}):\n{out}"
        error = next(line for line in out.splitlines() if line.startswith("ERROR"))
        assert "all_reduce" in error and f"rank {victim}" in error, error
        assert ("PeerLostError" in error or "NetdistTimeoutError" in error), error
    # every process of the job has exited: nothing of it is left in /dev/shm
    assert _shm_entries() - before == set()
