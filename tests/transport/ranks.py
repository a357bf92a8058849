"""Real rank processes for the multi-process transport tests.

``start_ranks(n, module, args)`` starts ``python -m MODULE ARGS`` once per rank with
NETDIST_* set, as a launcher would; ``RankProcess.expect`` reads its combined output line
by line, every wait bounded.
"""

from __future__ import annotations

import os
import secrets
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.transport.util import free_port

REPO = Path(__file__).resolve().parents[2]


class RankProcess:
    """One worker process (stdin piped); reads its combined output with deadlines."""

    def __init__(self, rank: int, world_size: int, port: int, token: str, job: str,
                 module: str, args: list[str], timeout: float = 20.0) -> None:
        env = {name: value for name, value in os.environ.items()
               if not name.startswith("NETDIST_")
               and name not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env.update(NETDIST_RANK=str(rank), NETDIST_WORLD_SIZE=str(world_size),
                   NETDIST_COORDINATOR=f"127.0.0.1:{port}", NETDIST_TOKEN=token,
                   NETDIST_JOB_ID=job, NETDIST_TIMEOUT=str(timeout),
                   PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            bufsize=0)
        self.output = b""
        self._pending = b""

    def expect(self, prefix: str, timeout: float) -> str:
        """The first output line starting with ``prefix``; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.decode(errors="replace").startswith(prefix):
                    return line.decode()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                pytest.fail(f"rank {self.rank}: no {prefix!r} line within {timeout}s; "
                            f"output:\n{self.text()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    self.proc.wait(timeout=10)
                    pytest.fail(f"rank {self.rank} exited ({self.proc.returncode}) before "
                                f"printing {prefix!r}; output:\n{self.text()}")
                self.output += chunk
                self._pending += chunk

    def send_line(self, line: str) -> None:
        """Write ``line`` to the process's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float) -> int:
        """Wait for exit (bounded), collecting the rest of the output; the exit code."""
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"rank {self.rank} did not exit within {timeout}s; output:\n"
                        f"{self.text()}")
        self.output += rest or b""
        return self.proc.returncode

    def kill(self) -> None:
        """Kill if still running (stopped ones too), reap, close the pipes. Idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()

    def text(self) -> str:
        return self.output.decode(errors="replace")


def start_ranks(world_size: int, module: str, args: list[str], *, timeout: float = 20.0,
              job_prefix: str = "mp") -> list[RankProcess]:
    """Start ``world_size`` ranks of ``python -m module args`` for one fresh job."""
    port, token = free_port(), secrets.token_hex(16)
    job = f"{job_prefix}-{secrets.token_hex(3)}"
    return [RankProcess(rank, world_size, port, token, job, module, args, timeout)
            for rank in range(world_size)]
