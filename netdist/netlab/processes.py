"""The processes of a test cluster's ranks: start them, wait for all with one deadline.

Each rank runs in its own session (so the whole process tree can be killed) with its
output in temporary files, not pipes: a rank that prints a lot never blocks on a pipe
nobody is reading while another rank is waited for. ``wait_all`` waits on every rank at
once (``pidfd``s in one ``select``), and the first rank that fails, or the deadline,
ends the others: a job never hangs on the survivors of a crash.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

__all__ = ["enter_host", "NETNS_DIR", "RankProcess", "RankResult", "start_rank", "wait_all"]

NETNS_DIR = "/run/netns"
"""Where ``ip netns add`` names its namespaces."""

_REAP_TIMEOUT = 30.0
"""How long a killed process may take to be reaped."""


@dataclass(frozen=True, slots=True)
class RankResult:
    """How one rank ended."""

    rank: int
    host: str
    returncode: int
    """Its exit status; ``-N`` when signal N ended it."""
    stdout: str
    stderr: str
    killed: bool
    """Whether it was killed: by the deadline, or because another rank failed first."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.killed


@dataclass(slots=True)
class RankProcess:
    """A started rank: its process and where its output goes."""

    rank: int
    host: str
    process: subprocess.Popen[bytes]
    stdout: IO[bytes] | None = field(default=None, repr=False)
    stderr: IO[bytes] | None = field(default=None, repr=False)

    def kill(self) -> None:
        """SIGKILL the rank's whole session (its children too)."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def result(self, killed: bool) -> RankResult:
        """The rank's result once it has ended; closes its output files."""
        code = self.process.wait(_REAP_TIMEOUT)
        return RankResult(self.rank, self.host, code, _drain(self.stdout),
                          _drain(self.stderr), killed)


def _drain(stream: IO[bytes] | None) -> str:
    if stream is None:
        return ""
    try:
        stream.seek(0)
        return stream.read().decode(errors="replace")
    finally:
        stream.close()


def enter_host(host: str, argv: Sequence[str]) -> list[str]:
    """The command line running ``argv`` in network namespace ``host``.

    ``nsenter --net`` enters the network namespace only. ``ip netns exec`` would also
    give every process a mount namespace of its own, and a rank's host key includes its
    mount namespace (``netdist.transport.host_identity``: ranks that cannot see each
    other's ``/proc`` cannot share memory): the ranks of one test host would then look
    like ranks of different machines, as they never do on a real one.
    """
    return ["nsenter", f"--net={NETNS_DIR}/{host}", *argv]


def start_rank(rank: int, host: str, argv: Sequence[str], env: Mapping[str, str], *,
               capture: bool = True, cwd: str | None = None) -> RankProcess:
    """Start ``argv`` in network namespace ``host`` (``enter_host``, which execs it: the
    process is the rank's), in a session of its own. With ``capture`` its output goes
    to temporary files that ``RankResult`` returns; without, to this process's."""
    out = tempfile.TemporaryFile() if capture else None
    err = tempfile.TemporaryFile() if capture else None
    try:
        process = subprocess.Popen(enter_host(host, argv), env=dict(env),
                                   cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                   start_new_session=True)
    except BaseException:
        for stream in (out, err):
            if stream is not None:
                stream.close()
        raise
    return RankProcess(rank, host, process, out, err)


def wait_all(ranks: Sequence[RankProcess], timeout: float) -> list[RankResult]:
    """Wait up to ``timeout`` seconds for every rank; results in the order given.

    When a rank exits with a non-zero status, or the deadline passes, the ranks still
    running are killed (``RankResult.killed``).
    """
    deadline = time.monotonic() + timeout
    fds = {os.pidfd_open(r.process.pid): r for r in ranks if r.process.poll() is None}
    killed: set[int] = set()
    try:
        failed = any(r.process.returncode not in (None, 0) for r in ranks)
        while fds and not failed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, _, _ = select.select(list(fds), [], [], remaining)
            for fd in ready:
                rank = fds.pop(fd)
                os.close(fd)
                if rank.process.wait(_REAP_TIMEOUT) != 0:
                    failed = True
        for fd, rank in fds.items():
            if rank.process.poll() is None:
                rank.kill()
                killed.add(rank.rank)
    finally:
        for fd in fds:
            os.close(fd)
    return [r.result(r.rank in killed) for r in ranks]
