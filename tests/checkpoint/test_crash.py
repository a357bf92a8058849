"""Crash safety: SIGKILL a process mid-save, at random moments; the previous checkpoint
always loads and verifies, and the next save cleans up what the killed one left.

``test_commit_crash.py`` kills at each point of the commit protocol instead; the full
random-kill trials (30 + 30 kills of a 300 MiB save) are ``benchmarks/checkpoint_crash.py``.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from netdist.checkpoint import (
    list_checkpoints,
    load_distributed,
    load_metadata,
    verify_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]
TRIALS = 20
ROWS, COLS = 384, 16384  # per tensor 24 MiB (float32); 2 tensors over 2 ranks = 48 MiB

# Saves steps start, start+1, ... forever, printing "committed N" after each commit.
# Even trials use the collective save (two ranks on an in-process Group), odd ones the
# per-rank API; both keep the newest two checkpoints.
WORKER = r"""
import asyncio, sys
import numpy as np
from netdist.checkpoint import (ShardedArray, flat_shard_metadata, save, save_distributed,
                                shard_state_dict)
from netdist.collectives import Group
from netdist.sharding import chunk_bounds
from netdist.transport import InProcessTransport

root, start, mode, rows, cols = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

def full(step):
    return {"a": np.full((rows, cols), step, np.float32),
            "b": np.full((rows, cols), -step, np.float32),
            "step": np.array(step, np.int64)}

async def collective():
    transports = InProcessTransport.create_group(2, timeout=60)
    groups = [Group(t) for t in transports]
    step = start
    while True:
        state = full(step)
        async def one(g):
            lo, hi = chunk_bounds(rows, 2)[g.rank]
            local = {"a": ShardedArray(state["a"][lo:hi]), "b": ShardedArray(state["b"][lo:hi]),
                     "step": state["step"], "meta": {"step": step}}
            await save(local, root, g, step=step, keep_last=2, timeout=60)
        await asyncio.gather(*(one(g) for g in groups))
        print(f"committed {step}", flush=True)
        step += 1

def per_rank():
    step = start
    while True:
        state = full(step)
        meta = flat_shard_metadata(state, 2)
        for rank in range(2):
            save_distributed(shard_state_dict(state, meta, rank), root, rank, 2, meta,
                             step=step, keep_last=2)
        print(f"committed {step}", flush=True)
        step += 1

if mode == "collective":
    asyncio.run(collective())
else:
    per_rank()
"""


def _read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    assert proc.stdout is not None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError("worker produced no commit in time")
        ready, _, _ = select.select([proc.stdout], [], [], remaining)
        if ready:
            return proc.stdout.readline()


def _check_loadable(root: Path, at_least: int) -> None:
    meta = load_metadata(root)
    step = meta.step
    assert step is not None and step >= at_least
    assert verify_checkpoint(root).ok
    for rank in range(2):
        got = load_distributed(root, rank, 2)
        assert got["a"].shape == (ROWS // 2, COLS)
        assert np.all(got["a"] == step) and np.all(got["b"] == -step)
        assert int(got["step"]) == step
    whole = load_distributed(root, 0, 1)  # resharded read of both files
    assert np.all(whole["a"] == step)


@pytest.mark.slow
def test_sigkill_during_save_never_breaks_the_previous_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(20240601)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    root = tmp_path / "ckpt"
    next_step = 1
    last_committed = 0
    try:
        for trial in range(TRIALS):
            mode = "collective" if trial % 2 == 0 else "per_rank"
            proc = subprocess.Popen(
                [sys.executable, "-c", WORKER, str(root), str(next_step), mode, str(ROWS),
                 str(COLS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=env)
            try:
                line = _read_line(proc, time.monotonic() + 60)
                assert line.startswith("committed"), (line, proc.stderr.read() if proc.poll()
                                                      is not None else "")
                last_committed = int(line.split()[1])
                time.sleep(rng.uniform(0.0, 0.6))  # the kill lands at a random moment
                proc.send_signal(signal.SIGKILL)
                out, _ = proc.communicate(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate(timeout=30)
            for line in out.splitlines():
                if line.startswith("committed"):
                    last_committed = int(line.split()[1])
            assert proc.returncode == -signal.SIGKILL
            _check_loadable(root, last_committed)
            # resume as a restarted job does: after the newest complete step (a kill
            # between its commit and `latest` leaves `latest` one step behind)
            next_step = load_metadata(root).step + 1
            assert next_step == list_checkpoints(root)[-1][0] + 1
        # keep_last=2 plus whatever the last kill left; the next save cleans it up
        leftovers = [p for p in os.listdir(root) if p != "latest"]
        assert len(leftovers) <= 4, leftovers
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_random_kills_of_both_ranks_of_a_tcp_job_leave_an_exact_checkpoint() -> None:
    """A few trials of the benchmark harness: 2 processes over TCP, both SIGKILLed at a
    random moment of a save, with ``overwrite=True`` (same step) and by default (next
    step); every kill must leave a byte-exact checkpoint the next job resumes from."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint_crash.py"), "--trials", "3",
         "--mib", "8", "--seed", "7"], capture_output=True, text=True, timeout=110, env=env,
        cwd=REPO, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("loadable & byte-exact: 3/3") == 2, done.stdout
    assert done.stdout.count("resumed from the newest and saved forward: 3/3") == 2
    assert "overwrite=True: 3 SIGKILLs" in done.stdout and "FAILED" not in done.stdout
