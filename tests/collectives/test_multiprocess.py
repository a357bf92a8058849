"""Collectives between real processes on 127.0.0.1 (``tests/collectives/mp_worker.py``).

Every subprocess wait is bounded.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests.ranks import REPO, RankProcess, finish_ranks, start_ranks

from .helpers import assert_survivors_failed_naming

pytestmark = pytest.mark.slow


def _spawn(n: int, args: list[str], hosts: int = 1, **extra: str) -> list[RankProcess]:
    """``n`` ranks; with ``hosts`` > 1 they pretend to be on that many hosts
    (``NETDIST_HOST_ID``), consecutive ranks together. ``NETDIST_SHM`` passes through,
    so the suite's shared-memory setting reaches the workers."""
    per_host = -(-n // hosts)
    return start_ranks(
        n, "tests.collectives.mp_worker", args, timeout=30, job_prefix="coll",
        keep=["NETDIST_SHM"],
        env=lambda rank: {**extra,
                          **({"NETDIST_HOST_ID": f"h{rank // per_host}"} if hosts > 1 else {})})


def _expected_mode(n: int, hosts: int = 1) -> str:
    if os.environ.get("NETDIST_SHM", "1") == "0" or n // hosts < 2:
        return "tcp"
    return "single-host" if hosts == 1 else "hierarchical"


@pytest.mark.parametrize("hosts", [1, 2])
def test_four_processes_collectives_exact(hosts: int) -> None:
    results = finish_ranks(_spawn(4, ["check"], hosts=hosts), timeout=120)
    for rank, (code, out) in enumerate((r.returncode, r.stdout) for r in results):
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
    results = [(r.returncode, r.stdout) for r in finish_ranks(
        _spawn(n, ["kill", str(victim)], MP_OP_TIMEOUT=str(op_timeout)), timeout=90)]
    assert_survivors_failed_naming(results, victim)
    # start-up takes a few seconds; the failure itself is bounded by the op timeout
    assert time.monotonic() - started < op_timeout + 45


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("copy", ["single", "staged"])
def test_sigkill_mid_shared_memory_all_reduce_fails_survivors_and_leaks_nothing(
        copy: str) -> None:
    n, victim, op_timeout = 4, 1, 8.0
    before = _shm_entries()
    results = [(r.returncode, r.stdout) for r in finish_ranks(
        _spawn(n, ["shmkill", str(victim)], MP_OP_TIMEOUT=str(op_timeout),
               NETDIST_SHM_COPY=copy), timeout=90)]
    assert_survivors_failed_naming(results, victim)
    shared = _expected_mode(n) != "tcp"
    for _, out in results:
        assert f"MODE {_expected_mode(n)}" in out, out
        assert f"COPY {copy if shared else None}" in out, out
    # every process of the job has exited: nothing of it is left in /dev/shm
    assert _shm_entries() - before == set()
