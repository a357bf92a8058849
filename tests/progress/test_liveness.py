"""Liveness that compute cannot break, with real processes over real TCP.

With the transport on the progress thread, a rank that computes for three liveness
windows (in pure Python or in GIL-releasing NumPy kernels) between two collectives is
never declared dead; a SIGSTOPped rank still is, naming that rank, from the heartbeat
window rather than the much longer operation timeout.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.ranks import RankProcess, finish_ranks, rank_env

pytestmark = pytest.mark.slow

WAIT = 90.0
"""Outer bound on every wait for a line from a rank."""


def read_line(rank: RankProcess, prefix: str) -> str:
    """What follows ``prefix`` on the first line that starts with it (bounded by WAIT)."""
    return rank.expect(prefix, WAIT)[len(prefix):].strip()


@contextmanager
def two_ranks(mode: list[str], **extra: str) -> Iterator[list[RankProcess]]:
    """Rank 0 (its coordinator on a free port it reports), then rank 1 joining it."""
    argv = ["-m", "tests.progress.liveness_worker", *mode]
    token = "liveness-test-token-0123456789"
    procs: list[RankProcess] = []
    try:
        procs.append(RankProcess(0, argv, {**rank_env(0, 2, "127.0.0.1:0", token, "liveness"),
                                           **extra}))
        coordinator = read_line(procs[0], "COORDINATOR ")
        procs.append(RankProcess(1, argv, {**rank_env(1, 2, coordinator, token, "liveness"),
                                           **extra}))
        yield procs
    finally:
        for proc in procs:
            proc.kill()


@pytest.mark.timeout(180)
def test_a_rank_computing_for_three_liveness_windows_is_never_declared_dead() -> None:
    # window = 0.5 s x 4 = 2 s; rank 0 computes 6 s in Python, then 6 s in NumPy
    with two_ranks(["compute", "6"], NETDIST_HEARTBEAT_INTERVAL="0.5",
                   NETDIST_HEARTBEAT_MISSES="4", NETDIST_TIMEOUT="120") as procs:
        done = finish_ranks(procs, WAIT)
        outputs = [d.stdout for d in done]
        codes = [d.returncode for d in done]
    assert codes == [0, 0], outputs
    for output in outputs:
        assert "DONE 32.0" in output  # 4 x 2 ranks, doubled by the two later all-reduces


@pytest.mark.timeout(120)
def test_a_sigstopped_rank_is_reported_by_name_from_the_liveness_window() -> None:
    with two_ranks(["stop"], NETDIST_HEARTBEAT_INTERVAL="0.5", NETDIST_HEARTBEAT_MISSES="4",
                   NETDIST_TIMEOUT="600") as procs:
        assert procs[0].proc.stdout is not None and procs[1].proc.stdout is not None
        read_line(procs[0], "READY ")
        pid = int(read_line(procs[1], "READY "))
        os.kill(pid, signal.SIGSTOP)
        try:
            lost = read_line(procs[0], "LOST ")
        finally:
            os.kill(pid, signal.SIGKILL)
        assert procs[0].finish(WAIT) == 3
    assert lost.startswith("PeerLostError")
    assert "rank 1" in lost
    assert "presumed dead" in lost  # the heartbeat window fired, not the 600 s timeout


@pytest.mark.timeout(120)
def test_ctrl_c_in_a_blocking_call_interrupts_it_and_the_peer_is_told() -> None:
    with two_ranks(["interrupt"], NETDIST_TIMEOUT="600") as procs:
        assert procs[0].proc.stdout is not None and procs[1].proc.stdout is not None
        read_line(procs[0], "READY ")  # then it interrupts itself once blocked
        read_line(procs[1], "READY ")
        read_line(procs[0], "INTERRUPTED")
        lost = read_line(procs[1], "LOST ")
        assert procs[0].finish(WAIT) == 130
        assert procs[1].finish(WAIT) == 3
    assert lost.startswith("PeerLostError") and "rank 0" in lost
    assert "KeyboardInterrupt" in lost  # rank 0 said why it left
