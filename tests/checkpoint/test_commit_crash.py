"""Real crashes at every commit point: 2 ranks over TCP, rank 0 SIGKILLs itself there.

The job is ``benchmarks/checkpoint_crash.py``'s worker (collective ``load`` to resume,
collective ``save``); ``NETDIST_CHECKPOINT_FAILPOINT`` makes rank 0 kill itself when it
reaches the named point. After each kill the root must load byte-exact as the old or
the new checkpoint (as the protocol says for that point), and a restarted job must
resume from the newest step and save the next one, leaving no crash leftovers.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
from pathlib import Path

import pytest

from netdist.checkpoint import list_checkpoints
from netdist.checkpoint.commit import FAILPOINT_ENV, CommitPoint
from tests.benchmark_harness import load_benchmark

pytestmark = pytest.mark.slow

MIB = 2.0
OLD_POINTS = {CommitPoint.PREPARED, CommitPoint.FILES_DURABLE, CommitPoint.STAGED,
              CommitPoint.ASIDE}
REPLACE_ONLY = {CommitPoint.ASIDE, CommitPoint.OLD_REMOVED}
CASES = [(mode, point) for mode in ("overwrite", "default") for point in CommitPoint
         if mode == "overwrite" or point not in REPLACE_ONLY]


harness = load_benchmark("checkpoint_crash")


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root holding step 1, version 1, saved by a 2-rank job."""
    root = tmp_path_factory.mktemp("seed") / "ckpt"
    for code, out in harness.run_job(str(root), "default", MIB, saves=1, timeout=110):
        assert code == 0, out
    assert harness.check_root(str(root), MIB) == (1, 1)
    return root


def _error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error ")]
    assert len(lines) == 1, output
    return lines[0]


@pytest.mark.parametrize("mode, point", CASES, ids=[f"{m}-{p.value}" for m, p in CASES])
def test_a_kill_at_each_commit_point_leaves_a_loadable_root_that_moves_forward(
        seeded: Path, tmp_path: Path, mode: str, point: CommitPoint) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(seeded, root)
    new = (1, 2) if mode == "overwrite" else (2, 2)
    (code0, out0), (code1, out1) = harness.run_job(
        str(root), mode, MIB, saves=1, rank0_env={FAILPOINT_ENV: point.value}, timeout=100)
    assert code0 == -signal.SIGKILL, out0
    assert f"saving {new[0]} {new[1]}" in out0 and "committed" not in out0
    assert code1 == 3 and "lost" in _error_line(out1), out1  # the survivor fails promptly

    expected = (1, 1) if point in OLD_POINTS else new
    assert harness.check_root(str(root), MIB) == expected
    latest = (root / "latest").read_text()
    if point in (CommitPoint.LATEST, CommitPoint.ROTATED):
        assert latest == f"step_{new[0]:06d}\n"
    else:
        assert latest == "step_000001\n"  # behind when step 2 is committed: not trusted
    if point is CommitPoint.ASIDE:
        assert not (root / "step_000001").exists()
        assert list_checkpoints(root)[0][1].name.startswith(".step_000001.old-")

    (code0, out0), (code1, out1) = harness.run_job(str(root), "default", MIB, saves=1,
                                                  timeout=100)
    assert code0 == 0 and code1 == 0, out0 + out1
    step, version = expected
    assert f"resumed {step} {version}" in out0
    assert f"committed {step + 1} {version + 1}" in out0
    assert harness.check_root(str(root), MIB) == (step + 1, version + 1)
    assert sorted(os.listdir(root)) == ["latest", f"step_{step:06d}", f"step_{step + 1:06d}"]
    assert (root / "latest").read_text() == f"step_{step + 1:06d}\n"


def test_a_rank_out_of_file_descriptors_fails_every_rank_naming_rank_and_file(
        seeded: Path, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(seeded, root)
    (code0, out0), (code1, out1) = harness.run_job(str(root), "overwrite", MIB, saves=1,
                                                  nofile_rank=1, timeout=100)
    assert code0 == 3 and code1 == 3, out0 + out1
    reason = f"[Errno {errno.EMFILE}] Too many open files"
    own = _error_line(out1)
    assert own.startswith(f"error CheckpointError: rank 1 could not write rank_00001.safetensors "
                          f"of checkpoint {root}/step_000001: {reason}: "), own
    seen = _error_line(out0)
    assert seen.startswith("error CheckpointError: checkpoint save failed on rank(s) 1 (seen "
                           "from rank 0): rank 1: CheckpointError: rank 1 could not write "
                           "rank_00001.safetensors"), seen
    assert reason in seen
    # the overwrite failed: step 1 is the old checkpoint, untouched, and nothing is left
    assert harness.check_root(str(root), MIB) == (1, 1)
    assert sorted(os.listdir(root)) == ["latest", "step_000001"]
