"""The commit protocol, in process: staging, commit by rename, asides, the newest step.

Crash states are built the way a SIGKILL leaves them (a rename that happened, one that
did not); ``test_commit_crash.py`` kills real processes at each point.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdist.checkpoint import (
    ShardedArray,
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
from netdist.checkpoint import api as api_module
from netdist.checkpoint import writing as writing_module
from netdist.checkpoint.commit import aside_dir_name, scan_root, staging_dir_name
from netdist.collectives import Group
from netdist.errors import CheckpointError
from netdist.sharding import chunk_bounds
from tests.checkpoint.test_collective import OP_TIMEOUT
from tests.ranks import run_ranks

ROWS = 10


def full(version: int) -> dict[str, np.ndarray]:
    return {"w": np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4) + 1000 * version,
            "b": np.arange(3, dtype=np.float64) * version}


def local_state(rank: int, n: int, step: int, version: int) -> dict[str, Any]:
    lo, hi = chunk_bounds(ROWS, n)[rank]
    values = full(version)
    return {"w": ShardedArray(values["w"][lo:hi]), "b": values["b"], "step": step,
            "version": version}


async def save_all(root: Path, step: int | None, version: int, **kwargs: Any) -> list[Any]:
    async def body(g: Group) -> Any:
        return await save(local_state(g.rank, 2, step or 0, version), root, g, step=step,
                          timeout=OP_TIMEOUT, **kwargs)

    return await run_ranks(2, body, return_exceptions=True)


def assert_exact(root: Path, step: int, version: int) -> None:
    """The checkpoint ``root`` resolves to is ``step``, holding ``version``'s bytes."""
    meta = load_metadata(root)
    assert meta.step == step and meta.state is not None
    assert meta.state.objects["version"] == version
    for rank in range(2):
        got = load_distributed(root, rank, 2)
        lo, hi = chunk_bounds(ROWS, 2)[rank]
        np.testing.assert_array_equal(got["w"], full(version)["w"][lo:hi])
        np.testing.assert_array_equal(got["b"], full(version)["b"])


def hidden(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("."))


async def test_resume_after_a_kill_between_commit_and_latest_moves_forward(
        tmp_path: Path) -> None:
    for step in (1, 2):
        assert not any(isinstance(r, BaseException) for r in await save_all(tmp_path, step, step))
    # a kill after step 2 was committed, before `latest` was rewritten, leaves this:
    (tmp_path / "latest").write_text("step_000001\n")

    async def restart(g: Group) -> int:
        resumed = await load(tmp_path, g, timeout=OP_TIMEOUT)
        nxt = resumed["step"] + 1  # what a training job does after resuming
        await save(local_state(g.rank, 2, nxt, nxt), tmp_path, g, step=nxt, timeout=OP_TIMEOUT)
        return int(resumed["step"])

    assert await run_ranks(2, restart) == [2, 2]
    assert_exact(tmp_path, 3, 3)
    assert (tmp_path / "latest").read_text() == "step_000003\n"
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_000003"


async def test_a_checkpoint_left_aside_is_loaded_and_renamed_back_by_the_next_save(
        tmp_path: Path) -> None:
    await save_all(tmp_path, 1, 1)
    # a kill during an overwrite of step 1, after the old one went aside, before the new
    # (complete, staged) one was renamed in:
    aside = tmp_path / aside_dir_name(1, "0123456789abcdef")
    os.rename(tmp_path / "step_000001", aside)
    staging = tmp_path / staging_dir_name(1, "0123456789abcdef")
    staging.mkdir()
    (staging / "metadata.json").write_text("{}")
    assert list_checkpoints(tmp_path) == [(1, aside)]
    assert resolve_checkpoint(tmp_path, step=1) == aside
    assert resolve_checkpoint(tmp_path / "step_000001") == aside
    assert_exact(tmp_path, 1, 1)
    got = await run_ranks(2, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT))
    assert [int(state["version"]) for state in got] == [1, 1]

    assert not any(isinstance(r, BaseException) for r in await save_all(tmp_path, None, 2))
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001", "step_000002"]
    assert_exact(tmp_path, 2, 2)
    assert load_metadata(tmp_path, step=1).state.objects["version"] == 1


async def test_an_uncommitted_staging_directory_is_never_loaded(tmp_path: Path) -> None:
    await save_all(tmp_path, 1, 1)
    # a kill after the new step's metadata.json was staged, before the rename:
    done = tmp_path / "done"
    await save_all(done, 2, 2)
    os.rename(done / "step_000002", tmp_path / staging_dir_name(2, "feedfacecafebeef"))
    assert list_checkpoints(tmp_path) == [(1, tmp_path / "step_000001")]
    assert_exact(tmp_path, 1, 1)
    with pytest.raises(CheckpointError, match="no complete checkpoint for step 2"):
        resolve_checkpoint(tmp_path, step=2)
    await save_all(tmp_path, 2, 3)
    assert hidden(tmp_path) == []
    assert_exact(tmp_path, 2, 3)


async def test_a_failed_overwrite_keeps_the_old_checkpoint_and_names_rank_and_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await save_all(tmp_path, 4, 1)
    original = writing_module.write_safetensors

    def out_of_descriptors(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == "rank_00001.safetensors":
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(writing_module, "write_safetensors", out_of_descriptors)
    errors = await save_all(tmp_path, 4, 2, overwrite=True)
    assert all(type(e) is CheckpointError for e in errors), errors
    assert str(errors[1]).startswith(
        f"rank 1 could not write rank_00001.safetensors of checkpoint {tmp_path}/step_000004: "
        f"[Errno {errno.EMFILE}] Too many open files: ")
    assert isinstance(errors[1].__cause__, OSError)
    assert "failed on rank(s) 1 (seen from rank 0)" in str(errors[0])
    assert "rank_00001.safetensors" in str(errors[0]) and "Too many open files" in str(errors[0])
    assert_exact(tmp_path, 4, 1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000004"]


async def test_a_step_older_than_the_newest_needs_overwrite(tmp_path: Path) -> None:
    await save_all(tmp_path, 5, 5)
    errors = await save_all(tmp_path, 3, 3)
    assert all(isinstance(e, CheckpointError) for e in errors)
    assert "step 3 is older than the newest complete checkpoint" in str(errors[0])
    assert "continues from step 5" in str(errors[0]) and "overwrite=True" in str(errors[0])
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5]

    await save_all(tmp_path, 3, 3, overwrite=True, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 5]  # the newest and this one
    assert_exact(tmp_path, 5, 5)
    assert (tmp_path / "latest").read_text() == "step_000005\n"
    errors = await save_all(tmp_path, 5, 6)
    assert "already holds a complete checkpoint" in str(errors[0])


async def test_keep_last_is_checked_before_anything_is_written(tmp_path: Path) -> None:
    errors = await save_all(tmp_path, 1, 1, keep_last=0)
    assert all(isinstance(e, ValueError) and "keep_last" in str(e) for e in errors)
    assert not tmp_path.joinpath("step_000001").exists() and hidden(tmp_path) == []
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        save_distributed(full(1), tmp_path, 0, 1, step=1, keep_last=0)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ per rank, no group


def per_rank(root: Path, rank: int, step: int, version: int, **kwargs: Any) -> Any:
    values = full(version)
    meta = flat_shard_metadata(values, 2)
    return save_distributed(shard_state_dict(values, meta, rank), root, rank, 2, meta,
                            step=step, extra={"version": version}, **kwargs)


def test_per_rank_resave_keeps_the_old_step_until_the_set_is_complete(tmp_path: Path) -> None:
    for rank in range(2):
        per_rank(tmp_path, rank, 7, 1)
    first = per_rank(tmp_path, 0, 7, 2)  # rank 1 has not saved again (yet, or ever)
    assert not first.committed
    assert load_metadata(tmp_path).extra == {"version": 1}
    for rank in range(2):
        np.testing.assert_array_equal(load_distributed(tmp_path, rank, 2)["w"],
                                      full(1)["w"][5 * rank:5 * rank + 5])
    assert hidden(tmp_path) == [staging_dir_name(7, "g2")]
    second = per_rank(tmp_path, 1, 7, 2)
    assert second.committed and load_metadata(tmp_path).generation == 2
    np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1)["w"], full(2)["w"])
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000007"]


def test_per_rank_run_ids_keep_attempts_apart(tmp_path: Path) -> None:
    per_rank(tmp_path, 0, 1, 1, run_id="job-a")  # job-a crashed after rank 0
    per_rank(tmp_path, 1, 1, 2, run_id="job-b")
    assert list_checkpoints(tmp_path) == []
    stagings = [(s, tag) for s, tag, _ in scan_root(tmp_path).staging]
    assert len(stagings) == 2 and {tag[:3] for _, tag in stagings} == {"g1-"}
    per_rank(tmp_path, 0, 1, 2, run_id="job-b")
    assert load_metadata(tmp_path).extra == {"version": 2}
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001"]


def test_per_rank_ranks_finishing_together_commit_once(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    per_rank(tmp_path, 0, 3, 1)
    per_rank(tmp_path, 1, 3, 1)
    both_wrote = threading.Barrier(2, timeout=30)
    original = api_module.write_bytes_atomic

    def manifest_then_wait(path: Any, data: bytes, **kwargs: Any) -> None:
        original(path, data, **kwargs)
        if str(path).endswith(".manifest.json"):
            both_wrote.wait()  # so that each rank then finds the other's manifest

    monkeypatch.setattr(api_module, "write_bytes_atomic", manifest_then_wait)
    results: list[Any] = [None, None]

    def run(rank: int) -> None:
        results[rank] = per_rank(tmp_path, rank, 3, 2)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(r.committed for r in results) == [False, True]
    assert load_metadata(tmp_path).extra == {"version": 2}
    np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1)["w"], full(2)["w"])
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000003"]
