"""A rank that exits right after its last send loses no byte of it (issue 26, defect 1).

Two hosts (network namespaces) joined by a link limited to 1 Mbit/s each way with
``tc tbf``: rank 0 hands 2 MiB to rank 1 (a ``send``, a ``broadcast``, torch's
``dist.broadcast``) and its process exits the moment the call returns (for torch,
after ``destroy_process_group``). At 1 Mbit/s most of the 2 MiB is still in the
sender's socket buffer and the shaper's queue then: before the fix the sender's close
waited at most 2 s, the process exited, the kernel reset the orphaned socket when the
receiver's next heartbeat arrived, and the receiver got ``PeerLostError ...
ConnectionResetError`` a few hundred kilobytes in. Each mode runs 10 jobs, each on a
link of its own, all at once; every receiver must get every byte, bit for bit.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netdist.netlab import NetLab, rank_env
from tests.netlab import require_netlab
from tests.transport.exit_worker import pattern

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNS = 10
NBYTES = 2 * 1024 * 1024
RATE_MBIT = 1.0
PORT = 29511
TOKEN = "exit-test-token-0123456789abcdef"
DEADLINE = 280.0  # 2 MiB at 1 Mbit/s is 17 s; the rest is start-up on a busy 2-core box


@pytest.mark.timeout(DEADLINE + 60)
@pytest.mark.parametrize("mode", ["send", "broadcast", "torch"])
def test_exit_right_after_sending_delivers_every_byte(mode: str) -> None:
    require_netlab()
    if mode == "torch":
        pytest.importorskip("torch")
    expected = f"RECEIVED {NBYTES} {hashlib.sha256(pattern(NBYTES).tobytes()).hexdigest()}"
    with NetLab() as lab:
        jobs = []
        for run in range(RUNS):
            sender, receiver = lab.host(f"s{run}"), lab.host(f"r{run}")
            link = lab.link(sender, receiver, rate_mbit=RATE_MBIT)
            procs = []
            for rank, host, own in ((0, sender, link.address_a),
                                    (1, receiver, link.address_b)):
                argv = [sys.executable, "-m", "tests.transport.exit_worker", mode, str(rank),
                        link.address_a, str(PORT), str(NBYTES), own]
                procs.append(lab.popen(host, argv, env=rank_env(host, NETDIST_TOKEN=TOKEN), cwd=REPO_ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            jobs.append(procs)
        deadline = time.monotonic() + DEADLINE
        failures = []
        for run, (sender, receiver) in enumerate(jobs):
            outcome = []
            for rank, proc in ((0, sender), (1, receiver)):
                try:
                    out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, err = proc.communicate()
                    outcome.append((rank, "timed out", out, err))
                    continue
                outcome.append((rank, proc.returncode, out, err))
            (_, code0, _, err0), (_, code1, out1, err1) = outcome
            received = out1.decode(errors="replace").strip().splitlines()
            if code0 != 0 or code1 != 0 or received[-1:] != [expected]:
                failures.append(
                    f"run {run}: sender exit {code0}, receiver exit {code1}, receiver said "
                    f"{received[-1:]}\n  sender stderr: {err0.decode(errors='replace')[-800:]}"
                    f"\n  receiver stderr: {err1.decode(errors='replace')[-800:]}")
        assert not failures, f"{len(failures)} of {RUNS} runs lost data:\n" + "\n".join(failures)
