"""The commit point: a save that committed never reports failure, one that failed commits
nothing; and a checkpoint path that is a file is said to be one.

The commit point is the rename of the staging directory holding a durable
``metadata.json`` to ``step_N``. Before it, a failure (here: a real full disk while
``metadata.json`` is created) fails the save on every rank and leaves the previous
checkpoints as they were. After it, rewriting ``latest`` and rotating to ``keep_last`` are
housekeeping: a failure there (here: a real full disk while ``latest``'s temporary file
is created) is a warning on the ``netdist.checkpoint`` logger and in the ``SaveResult``
(``latest_updated=False``, ``warnings``), for every save entry point.

The full-disk cases run on a small tmpfs whose inode count is measured, not guessed: a
dry run of the same saves on a roomy tmpfs gives the inodes step 1 leaves in use and the
inodes step 2 adds, and the real run gets exactly enough for step 2 (the ``latest``
temporary file is the one inode too many) or one less (``metadata.json`` does not fit).
Mounting needs root: elsewhere those tests skip, and fail when ``CI`` is true.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, NoReturn, Protocol

import numpy as np
import pytest

from netdist.checkpoint import (
    AsyncCheckpointer,
    SaveResult,
    flat_shard_metadata,
    list_checkpoints,
    load,
    load_distributed,
    load_metadata,
    resolve_checkpoint,
    save,
    save_distributed,
    shard_state_dict,
)
from netdist.checkpoint import commit as commit_module
from netdist.collectives import Group
from netdist.errors import CheckpointError
from tests.checkpoint.test_collective import OP_TIMEOUT
from tests.checkpoint.test_commit import assert_exact, full, local_state, per_rank
from tests.ranks import run_ranks

class Saver(Protocol):
    """Saves version ``step`` of the test state as ``root/step_N`` (``keep_last`` and
    such as keywords); every rank's result, or raises the first rank's error."""

    def __call__(self, root: Path, step: int, **kwargs: Any
                 ) -> Awaitable[list[SaveResult]]: ...


def _raise_first(results: list[Any]) -> list[SaveResult]:
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def save_collective(root: Path, step: int, **kwargs: Any) -> list[SaveResult]:
    """The collective ``save`` on 2 in-process ranks."""
    async def body(g: Group) -> SaveResult:
        return await save(local_state(g.rank, 2, step, step), root, g, step=step,
                          timeout=OP_TIMEOUT, **kwargs)

    return _raise_first(await run_ranks(2, body, return_exceptions=True))


async def save_collective_1(root: Path, step: int, **kwargs: Any) -> list[SaveResult]:
    """The collective ``save`` on 1 rank (the whole state replicated)."""
    async def body(g: Group) -> SaveResult:
        return await save({**full(step), "step": step, "version": step}, root, g,
                          step=step, timeout=OP_TIMEOUT, **kwargs)

    return await run_ranks(1, body)


async def save_per_rank(root: Path, step: int, **kwargs: Any) -> list[SaveResult]:
    """``save_distributed`` on rank 0 then rank 1 (rank 1 completes the set, commits)."""
    return [per_rank(root, rank, step, step, **kwargs) for rank in range(2)]


async def save_async(root: Path, step: int, **kwargs: Any) -> list[SaveResult]:
    """``AsyncCheckpointer.save_async`` on rank 0 then rank 1."""
    values = full(step)
    meta = flat_shard_metadata(values, 2)
    results = []
    for rank in range(2):
        async with AsyncCheckpointer(root, rank, 2, meta, **kwargs) as checkpointer:
            future = checkpointer.save_async(shard_state_dict(values, meta, rank), step=step,
                                             extra={"version": step})
            results.append(await future)
    return results


SAVERS: dict[str, Saver] = {"collective": save_collective, "per_rank": save_per_rank,
                            "async": save_async}


def assert_version(root: Path, step: int, kind: str) -> None:
    """``root/step_N`` is complete and holds step ``step``'s bytes exactly (whichever API
    wrote it, read back in one piece)."""
    directory = root / f"step_{step:06d}"
    assert (directory / "metadata.json").is_file()
    meta = load_metadata(directory)
    assert meta.step == step
    if kind.startswith("collective"):
        assert meta.state is not None and meta.state.objects["version"] == step
    else:
        assert meta.extra == {"version": step}
    got = load_distributed(directory, 0, 1)
    assert sorted(got) == sorted(full(step))
    for name, value in full(step).items():
        np.testing.assert_array_equal(got[name], value)
        assert got[name].dtype == value.dtype


def committed_results(results: list[SaveResult], kind: str) -> list[SaveResult]:
    """The results that carry the commit's report: every rank's in a collective save
    (rank 0 broadcasts it), the committing rank's in the per-rank API."""
    if kind.startswith("collective"):
        assert [r.committed for r in results] == [r.rank == 0 for r in results]
        return results
    assert [r.committed for r in results] == [False, True]
    assert (results[0].latest_updated, results[0].warnings) == (False, ())
    return results[1:]


def checkpoint_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings logged on the ``netdist.checkpoint`` logger, in order."""
    return [r.getMessage() for r in caplog.records
            if r.name == "netdist.checkpoint" and r.levelno == logging.WARNING]


# ----------------------------------------------------------------- a real full disk


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _cannot_run(reason: str) -> NoReturn:
    """Skip with ``reason``; in CI (``CI`` true) fail instead: a skipped test is a
    missing one there."""
    if _in_ci():
        pytest.fail(f"CI=true but the full-disk tests cannot run: {reason}", pytrace=False)
    pytest.skip(f"the full-disk tests mount a tmpfs: {reason}")


@contextlib.contextmanager
def tmpfs(where: Path, inodes: int) -> Iterator[Path]:
    """A 16 MiB tmpfs with ``inodes`` inodes (its root directory included) at ``where``,
    unmounted on exit."""
    if os.geteuid() != 0:
        _cannot_run("mounting needs root")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        _cannot_run("no mount/umount command")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=16m,nr_inodes={inodes}",
                           "tmpfs", str(where)], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        _cannot_run(f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True,
                          timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True, timeout=30)


def free_inodes(path: Path) -> int:
    """Inodes still free on the file system holding ``path``."""
    return os.statvfs(path).f_ffree


async def measure(tmp_path: Path, saver: Saver) -> tuple[int, int]:
    """Dry run on a roomy tmpfs: the inodes in use once step 1 is saved (the root
    directory included) and the inodes saving step 2 adds (its directory and files;
    ``latest`` is replaced, not added)."""
    with tmpfs(tmp_path / "dry", 1000) as mount:
        await saver(mount / "ckpt", 1)
        before = free_inodes(mount)
        await saver(mount / "ckpt", 2)
        added = before - free_inodes(mount)
        used = os.statvfs(mount).f_files - before
    assert added > 0 and used > added
    return used, added


@pytest.mark.parametrize("kind", list(SAVERS))
async def test_a_full_disk_after_the_commit_point_is_a_warning_not_a_failure(
        tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    saver = SAVERS[kind]
    used, added = await measure(tmp_path, saver)
    with tmpfs(tmp_path / "full", used + added) as mount:
        root = mount / "ckpt"
        await saver(root, 1)
        assert free_inodes(mount) == added  # step 2 fits; `latest`'s temp file does not
        with caplog.at_level(logging.WARNING, logger="netdist.checkpoint"):
            results = await saver(root, 2)
        assert free_inodes(mount) == 0
        for result in committed_results(results, kind):
            assert result.step == 2 and result.path == root / "step_000002"
            assert result.latest_updated is False
            assert len(result.warnings) == 1
            warning = result.warnings[0]
            assert warning.startswith(f"checkpoint {root}/step_000002 is committed, but "
                                      f"{root}/latest was not updated to name step_000002: "
                                      f"[Errno {errno.ENOSPC}] No space left on device: ")
            assert "/.latest.tmp." in warning
        assert checkpoint_warnings(caplog) == list(committed_results(results, kind)[0].warnings)
        assert_version(root, 2, kind)
        assert_version(root, 1, kind)
        assert (root / "latest").read_text() == "step_000001\n"  # stale, as documented
        assert sorted(os.listdir(root)) == ["latest", "step_000001", "step_000002"]
        # loads go by the directories, not by the stale `latest`
        assert resolve_checkpoint(root) == root / "step_000002"
        assert [step for step, _ in list_checkpoints(root)] == [1, 2]
        if kind == "collective":
            got = await run_ranks(2, lambda g: load(root, g, timeout=OP_TIMEOUT))
            assert [int(state["version"]) for state in got] == [2, 2]
            assert_exact(root, 2, 2)


@pytest.mark.parametrize("kind", list(SAVERS))
async def test_a_full_disk_before_the_commit_point_commits_nothing(
        tmp_path: Path, kind: str) -> None:
    saver = SAVERS[kind]
    used, added = await measure(tmp_path, saver)
    with tmpfs(tmp_path / "full", used + added - 1) as mount:  # metadata.json won't fit
        root = mount / "ckpt"
        await saver(root, 1)
        with pytest.raises(CheckpointError, match=(
                f"{re.escape(str(root))}/step_000002: \\[Errno {errno.ENOSPC}\\] No space "
                f"left on device: '{re.escape(str(root))}/\\.step_000002\\.tmp-[^/]+/"
                f"\\.metadata\\.json\\.tmp\\.")):
            await saver(root, 2)
        assert_only_step_1_committed(root, kind)


def assert_only_step_1_committed(root: Path, kind: str) -> None:
    """A failed save of step 2 left everything as step 1's save made it."""
    assert [step for step, _ in list_checkpoints(root)] == [1]
    assert not (root / "step_000002").exists()
    assert (root / "latest").read_text() == "step_000001\n"
    assert_version(root, 1, kind)


# ----------------------------------------------------------------- injected failures

ALL_SAVERS: dict[str, Saver] = {"collective_1": save_collective_1, **SAVERS}


def fail_writing(monkeypatch: pytest.MonkeyPatch, name: str, code: int) -> None:
    """Make the commit's atomic writes of files called ``name`` fail with ``code``, as
    the OS reports it: naming the temporary file."""
    original = commit_module.write_bytes_atomic

    def failing(path: Any, data: bytes, **kwargs: Any) -> None:
        path = Path(path)
        if path.name == name:
            raise OSError(code, os.strerror(code), str(path.parent / f".{name}.tmp.1.ab"))
        original(path, data, **kwargs)

    monkeypatch.setattr(commit_module, "write_bytes_atomic", failing)


@pytest.mark.parametrize("kind", list(ALL_SAVERS))
async def test_latest_that_cannot_be_written_leaves_the_save_committed(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    saver = ALL_SAVERS[kind]
    root = tmp_path / "ckpt"
    first = await saver(root, 1)
    fail_writing(monkeypatch, "latest", errno.ENOSPC)
    with caplog.at_level(logging.WARNING, logger="netdist.checkpoint"):
        results = await saver(root, 2)  # returns: step 2 is committed
    assert all(r.warnings == () for r in first)
    assert all(r.latest_updated for r in committed_results(first, kind))
    expected = (f"checkpoint {root}/step_000002 is committed, but {root}/latest was not "
                f"updated to name step_000002: [Errno {errno.ENOSPC}] No space left on "
                f"device: '{root}/.latest.tmp.1.ab'")
    for result in committed_results(results, kind):
        assert result.latest_updated is False and result.warnings == (expected,)
    assert checkpoint_warnings(caplog) == [expected]
    assert_version(root, 2, kind)
    assert_version(root, 1, kind)
    assert (root / "latest").read_text() == "step_000001\n"
    assert resolve_checkpoint(root) == root / "step_000002"

    monkeypatch.undo()  # the next save brings `latest` up to date again
    results = await saver(root, 3)
    assert all(r.latest_updated for r in committed_results(results, kind))
    assert (root / "latest").read_text() == "step_000003\n"


@pytest.mark.parametrize("kind", list(ALL_SAVERS))
async def test_a_checkpoint_that_cannot_be_rotated_away_is_a_warning(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    saver = ALL_SAVERS[kind]
    root = tmp_path / "ckpt"
    await saver(root, 1)
    original = commit_module.remove_tree_atomic

    def busy(path: Path) -> None:
        if path.name == "step_000001":
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        original(path)

    monkeypatch.setattr(commit_module, "remove_tree_atomic", busy)
    with caplog.at_level(logging.WARNING, logger="netdist.checkpoint"):
        results = await saver(root, 2, keep_last=1)
    expected = (f"checkpoint {root}/step_000002 is committed, but the old checkpoint "
                f"{root}/step_000001 (beyond keep_last=1) was not deleted: "
                f"[Errno {errno.EBUSY}] Device or resource busy: '{root}/step_000001'")
    for result in committed_results(results, kind):
        assert result.latest_updated is True and result.warnings == (expected,)
    assert checkpoint_warnings(caplog) == [expected]
    assert (root / "latest").read_text() == "step_000002\n"
    assert_version(root, 2, kind)
    assert_version(root, 1, kind)  # still there, still whole


@pytest.mark.parametrize("kind", list(ALL_SAVERS))
async def test_a_failure_before_the_commit_point_commits_nothing(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    saver = ALL_SAVERS[kind]
    root = tmp_path / "ckpt"
    await saver(root, 1)
    fail_writing(monkeypatch, "metadata.json", errno.ENOSPC)
    with pytest.raises(CheckpointError, match=(
            f"could not commit checkpoint {re.escape(str(root))}/step_000002: "
            f"\\[Errno {errno.ENOSPC}\\] No space left on device: "
            f"'{re.escape(str(root))}/\\.step_000002\\.tmp-[^/]+/\\.metadata\\.json\\.tmp")):
        await saver(root, 2)
    assert_only_step_1_committed(root, kind)


# ----------------------------------------------------------------- not a directory


@pytest.mark.parametrize("kind", list(ALL_SAVERS))
async def test_a_checkpoint_directory_that_is_a_file_is_named_as_such(
        tmp_path: Path, kind: str) -> None:
    root = tmp_path / "ckpt"
    root.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=(
            f"^checkpoint directory {re.escape(str(root))} exists and is not a directory$")):
        await ALL_SAVERS[kind](root, 1)
    assert root.read_bytes() == b"not a checkpoint"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("kind", list(ALL_SAVERS))
async def test_a_checkpoint_directory_under_a_file_is_named_as_such(
        tmp_path: Path, kind: str) -> None:
    parent = tmp_path / "file"
    parent.write_bytes(b"x")
    root = parent / "sub" / "ckpt"
    with pytest.raises(CheckpointError, match=(
            f"^cannot create checkpoint directory {re.escape(str(root))}: "
            f"{re.escape(str(parent))} exists and is not a directory$")):
        await ALL_SAVERS[kind](root, 1)
    assert parent.read_bytes() == b"x"


def test_a_stepless_per_rank_save_into_a_file_is_named_as_such(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.write_bytes(b"")
    with pytest.raises(CheckpointError, match=(
            f"^checkpoint directory {re.escape(str(root))} exists and is not a directory$")):
        save_distributed(full(1), root, 0, 1)
