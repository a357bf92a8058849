"""Real processes on 127.0.0.1: all-pairs exchange, and losing a rank to SIGKILL/SIGSTOP.

Each rank is ``python -m tests.transport.mp_worker`` with NETDIST_* set, as a launcher
would start it. Every wait on a subprocess is bounded.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.transport.util import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


class Rank:
    """One worker process; reads its combined output line by line with deadlines."""

    def __init__(self, rank: int, world_size: int, port: int, token: str, job: str,
                 args: list[str], timeout: float = 20.0) -> None:
        env = dict(os.environ)
        for name in list(env):
            if name.startswith("NETDIST_") or name in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                       "MASTER_PORT"):
                del env[name]
        env.update(NETDIST_RANK=str(rank), NETDIST_WORLD_SIZE=str(world_size),
                   NETDIST_COORDINATOR=f"127.0.0.1:{port}", NETDIST_TOKEN=token,
                   NETDIST_JOB_ID=job, NETDIST_TIMEOUT=str(timeout),
                   PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.transport.mp_worker", *args], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0)
        self.output = b""
        self._pending = b""

    def expect(self, prefix: str, timeout: float) -> str:
        """The first output line starting with ``prefix``; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.decode(errors="replace").startswith(prefix):
                    return line.decode()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                pytest.fail(f"rank {self.rank}: no {prefix!r} line within {timeout}s; "
                            f"output:\n{self.output.decode(errors='replace')}")
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    self.proc.wait(timeout=10)
                    pytest.fail(f"rank {self.rank} exited ({self.proc.returncode}) before "
                                f"printing {prefix!r}; output:\n"
                                f"{self.output.decode(errors='replace')}")
                self.output += chunk
                self._pending += chunk

    def finish(self, timeout: float) -> int:
        """Wait for exit (bounded); return the exit code."""
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"rank {self.rank} did not exit within {timeout}s; output:\n"
                        f"{self.output.decode(errors='replace')}")
        self.output += rest or b""
        return self.proc.returncode

    def kill(self) -> None:
        """Kill if still running, reap, and close the pipe (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def text(self) -> str:
        return self.output.decode(errors="replace")


def start_job(world_size: int, args: list[str], timeout: float = 20.0) -> list[Rank]:
    port = free_port()
    token = secrets.token_hex(16)
    job = f"mp-{secrets.token_hex(3)}"
    return [Rank(rank, world_size, port, token, job, args, timeout)
            for rank in range(world_size)]


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
