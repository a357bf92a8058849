"""``netdist launch`` names the rank that went away, and its ranks die with it.

Real launcher processes and real ranks: netdist ranks over TCP on 127.0.0.1, Python
ranks that wait for a sibling's real exit or stop (its ``/proc`` entry, polled with a
bound), and ``bash`` ranks for the parent-death signal. The summary must be the last
thing the launcher prints, every line of it prefixed ``netdist launch: ``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli.test_launch import BOUND, REPO_ROOT, netdist_cmd, run_launch, wait_dead

pytestmark = pytest.mark.slow

PREFIX = "netdist launch: "

WAIT_GONE = r'''
def read_pid(name):
    path = os.path.join(TMP, name)
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{name} never appeared")
        time.sleep(0.01)
    with open(path) as f:
        return int(f.read())

def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None

def wait_state(pid, wanted):
    """Poll (bounded) until /proc/<pid> is in one of `wanted` states (None: gone)."""
    deadline = time.monotonic() + 30
    while proc_state(pid) not in wanted:
        if time.monotonic() > deadline:
            sys.exit(f"process {pid} never reached {wanted}")
        time.sleep(0.01)
'''


def summary(stderr: str) -> list[str]:
    """The launcher's summary: from its first line to the end of stderr, all prefixed."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(PREFIX + "job failed")),
                 None)
    assert start is not None, f"no failure summary in:\n{stderr}"
    tail = lines[start:]
    assert all(line.startswith(PREFIX) for line in tail), tail  # nothing after it
    return [line[len(PREFIX):] for line in tail]


def test_first_failing_rank_is_shown_with_its_own_error(tmp_path: Path) -> None:
    # Rank 1 raises; ranks 0 and 2 are then in an all_reduce with it and lose it: each
    # prints a long chained PeerLostError traceback (or is terminated first).
    script = tmp_path / "job.py"
    script.write_text(
        "import asyncio\n"
        "import numpy as np\n"
        "import netdist\n"
        "from netdist.collectives import Group\n"
        "\n"
        "async def main():\n"
        "    async with netdist.init() as transport:\n"
        "        async with Group(transport, 30.0) as group:\n"
        "            await group.all_reduce(np.ones(4, dtype=np.float32))\n"
        "            if transport.rank == 1:\n"
        "                raise RuntimeError('boom in rank 1 after step 1')\n"
        "            await group.all_reduce(np.ones(4, dtype=np.float32))\n"
        "\n"
        "asyncio.run(main())\n")
    env = dict(os.environ)
    env.pop("NETDIST_TOKEN", None)
    result = subprocess.run(netdist_cmd("launch", "-n", "3", "--", sys.executable, str(script)),
                            capture_output=True, text=True, timeout=BOUND, env=env,
                            cwd=REPO_ROOT)
    assert result.returncode == 1, result.stderr
    lines = summary(result.stderr)
    # rank 1 may still be shutting down when a faster consequence makes the launcher
    # send SIGTERM; it is named either way
    assert re.fullmatch(r"job failed; first failure: rank 1 (exited with code 1|failed with "
                        r"its own error \(then .* after the launcher's SIGTERM\)):",
                        lines[0]), result.stderr
    then = lines.index("then, in the order they exited:")
    block = lines[1:then]
    assert block[0] == "  rank 1 | Traceback (most recent call last):"
    assert block[-3:] == [
        f'  rank 1 |   File "{script}", line 11, in main',
        "  rank 1 |     raise RuntimeError('boom in rank 1 after step 1')",
        "  rank 1 | RuntimeError: boom in rank 1 after step 1",
    ]
    assert len(block) <= 10
    others = lines[then + 1:]
    consequence = re.compile(r"^  rank ([02]): ((PeerLostError: |lost rank )"
                             r".*; a consequence\)|terminated by the launcher \(SIGTERM\))$")
    matches = [consequence.match(line) for line in others]
    assert all(matches), others
    assert sorted(int(m.group(1)) for m in matches if m) == [0, 2]


def test_rank_that_exits_0_while_others_run_is_named(tmp_path: Path) -> None:
    # Rank 2 leaves with code 0 once everyone is up; rank 0 notices only after rank 2 is
    # really gone (reaped by the launcher) and fails with a lost peer; rank 1 keeps going.
    body = WAIT_GONE + (
        "if RANK == 2:\n"
        "    write_pid('pid-2', os.getpid())\n"
        "    wait_for_ranks(WORLD - 1)\n"
        "    sys.exit(0)\n"
        "signal_ready()\n"
        "if RANK == 0:\n"
        "    wait_state(read_pid('pid-2'), (None,))\n"
        "    print('netdist worker: error: PeerLostError: lost connection to rank 2',\n"
        "          file=sys.stderr, flush=True)\n"
        "    sys.exit(1)\n"
        "sleep_forever()\n"
    )
    result, _ = run_launch(tmp_path, ["-n", "3"], body)
    assert result.returncode == 1, result.stderr
    assert summary(result.stderr) == [
        "job failed; first to go: rank 2 exited (code 0) while ranks 0, 1 were still running",
        "first error: rank 0 exited with code 1:",
        "  rank 0 | PeerLostError: lost connection to rank 2",
        "then, in the order they exited:",
        "  rank 1: terminated by the launcher (SIGTERM)",
    ]


def test_stopped_rank_is_named_and_continued_so_sigterm_ends_it(tmp_path: Path) -> None:
    # Rank 1 stops itself (as under SIGSTOP); rank 0 sees it stopped and fails. The
    # launcher names rank 1, and SIGCONT after SIGTERM ends it without waiting out the
    # (long) grace period for SIGKILL.
    body = WAIT_GONE + (
        "if RANK == 1:\n"
        "    write_pid('pid-1', os.getpid())\n"
        "    signal_ready()\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "    sleep_forever()\n"
        "wait_for_ranks(1)\n"
        "wait_state(read_pid('pid-1'), ('T',))\n"
        "print('netdist worker: error: PeerLostError: rank 1 sent no heartbeat for 30 s',\n"
        "      file=sys.stderr, flush=True)\n"
        "sys.exit(1)\n"
    )
    result, _ = run_launch(tmp_path, ["-n", "2", "--grace-period", "40"], body)
    assert result.returncode == 1, result.stderr
    assert "sent SIGKILL" not in result.stderr
    assert summary(result.stderr) == [
        "job failed; first to go: rank 1 was stopped (process state T, e.g. SIGSTOP) "
        "while rank 0 ran",
        "first error: rank 0 exited with code 1:",
        "  rank 0 | PeerLostError: rank 1 sent no heartbeat for 30 s",
    ]


# --------------------------------------------------------------------------- parent death


def _stat(pid: int) -> tuple[str, int, int]:
    """``(state, ppid, pgrp)`` of ``pid`` from ``/proc``."""
    with open(f"/proc/{pid}/stat") as f:
        state, ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
    return state, int(ppid), int(pgrp)


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``predicate`` (bounded) until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.01)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_ranks_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    # Non-Python ranks: bash writes its pid, then becomes `sleep` (same pid).
    script = ('echo $$ > "$0/pid-$NETDIST_RANK.tmp" && mv "$0/pid-$NETDIST_RANK.tmp" '
              '"$0/pid-$NETDIST_RANK" && exec sleep 1000')
    env = dict(os.environ)
    env.pop("NETDIST_TOKEN", None)
    launcher = subprocess.Popen(
        netdist_cmd("launch", "-n", "2", "--", "bash", "-c", script, str(tmp_path)),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO_ROOT)
    pids: list[int] = []
    try:
        files = [tmp_path / f"pid-{rank}" for rank in range(2)]
        _wait_for(lambda: all(f.exists() for f in files), "both ranks writing their pid")
        pids = [int(f.read_text()) for f in files]

        def comm(pid: int) -> str:
            return Path(f"/proc/{pid}/comm").read_text().strip()

        _wait_for(lambda: all(comm(pid) == "sleep" for pid in pids), "both ranks exec'ing sleep")
        for pid in pids:
            _, ppid, pgrp = _stat(pid)
            assert ppid == launcher.pid  # the wrapper exec'd: no extra process in between
            assert pgrp == pid  # each rank leads its own process group
        launcher.kill()
        launcher.wait(timeout=BOUND)
        for pid in pids:
            wait_dead(pid, timeout=30.0)  # fails (and kills it) if it outlived the launcher
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=BOUND)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
