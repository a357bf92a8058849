"""Real processes on 127.0.0.1: all-pairs exchange, and losing a rank to SIGKILL/SIGSTOP.

Each rank is ``python -m tests.transport.mp_worker`` with NETDIST_* set, as a launcher
would start it. Every wait on a subprocess is bounded.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.ranks import RankProcess, start_ranks

pytestmark = pytest.mark.slow


def start_job(world_size: int, args: list[str], timeout: float = 20.0) -> list[RankProcess]:
    return start_ranks(world_size, "tests.transport.mp_worker", args, timeout=timeout)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_all_pairs_exchange(world_size):
    ranks = start_job(world_size, ["allpairs"])
    try:
        lines = [rank.expect("OK ", timeout=90.0) for rank in ranks]
        codes = [rank.finish(timeout=30.0) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert codes == [0] * world_size, [rank.text() for rank in ranks]
    assert [int(line.split()[1]) for line in lines] == list(range(world_size))


def test_sigkill_makes_every_other_rank_raise_peer_lost_naming_it():
    victim = 2
    ranks = start_job(4, ["watch", str(victim), "2.0"], timeout=30.0)
    try:
        for rank in ranks:
            rank.expect("READY", timeout=90.0)
        killed_at = time.monotonic()
        ranks[victim].proc.send_signal(signal.SIGKILL)
        survivors = [r for r in ranks if r.rank != victim]
        for rank in survivors:
            line = rank.expect("PEERLOST", timeout=25.0)
            assert line.startswith(f"PEERLOST {victim} ")
            # EOF normally; a reset if a heartbeat was still unread when it was killed
            assert (f"rank {victim} closed the connection (EOF)" in line
                    or f"connection to rank {victim} was lost (ConnectionResetError" in line)
        assert time.monotonic() - killed_at < 25.0  # well within NETDIST_TIMEOUT
        assert [rank.finish(timeout=30.0) for rank in survivors] == [0, 0, 0]
    finally:
        for rank in ranks:
            rank.kill()


def test_a_frozen_rank_is_declared_lost_by_missed_heartbeats():
    victim = 1
    ranks = start_job(3, ["watch", str(victim), "0.2"], timeout=30.0)
    try:
        for rank in ranks:
            rank.expect("READY", timeout=90.0)
        ranks[victim].proc.send_signal(signal.SIGSTOP)  # alive, connected, silent
        for rank in (ranks[0], ranks[2]):
            line = rank.expect("PEERLOST", timeout=25.0)
            assert line.startswith(f"PEERLOST {victim} ")
            assert f"rank {victim} sent nothing for" in line
        assert [ranks[0].finish(timeout=30.0), ranks[2].finish(timeout=30.0)] == [0, 0]
    finally:
        if ranks[victim].proc.poll() is None:
            ranks[victim].proc.send_signal(signal.SIGCONT)
        for rank in ranks:
            rank.kill()
