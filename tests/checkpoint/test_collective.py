"""Collective save/load over an in-process Group: training state, resharding, failures."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from netdist.checkpoint import (
    ShardedArray,
    flat_shard_metadata,
    list_checkpoints,
    load,
    load_distributed,
    load_metadata,
    save,
    save_distributed,
    shard_state_dict,
)
from netdist.checkpoint import collective as collective_module
from netdist.collectives import Group
from netdist.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from netdist.sharding import chunk_bounds
from tests.ranks import run_ranks

OP_TIMEOUT = 10.0

W = np.arange(11 * 6, dtype=np.float32).reshape(11, 6)   # sharded weight, 11 rows: uneven
M = np.linspace(-1, 1, 11 * 6).reshape(11, 6)             # its Adam moment
BIAS = np.arange(6, dtype=np.float64)


def train_state(rank: int, n: int, *, scale: float = 1.0) -> dict[str, Any]:
    lo, hi = chunk_bounds(11, n)[rank]
    rng = np.random.default_rng(1000 + rank)  # a per-rank RNG stream
    rng.random(rank + 1)
    return {
        "model": {"w": ShardedArray((W[lo:hi] * scale).astype(np.float32)),
                  "b": BIAS * scale},
        "optim": {
            "state": {0: {"exp_avg": ShardedArray(M[lo:hi] * scale), "step": 17},
                      1: {"exp_avg": BIAS * 2 * scale, "step": np.int64(17)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "step": 100, "epoch": 3,
        "rng": rng,
        "data_rng_state": np.random.default_rng(7).bit_generator.state,  # shared
        "cursor": rank * 10,
    }


def blank_like(rank: int, n: int) -> dict[str, Any]:
    state = train_state(rank, n, scale=0.0)
    state.update(step=0, epoch=0, cursor=-1, rng=np.random.default_rng(99))
    state["optim"]["param_groups"] = [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]
    state["data_rng_state"] = np.random.default_rng(0).bit_generator.state
    return state


def assert_state(got: dict[str, Any], rank: int, n: int, *, saved_ranks: int) -> None:
    lo, hi = chunk_bounds(11, n)[rank]
    w = got["model"]["w"]
    assert isinstance(w, ShardedArray) and w.shard_dim == 0
    np.testing.assert_array_equal(w.data, W[lo:hi])
    np.testing.assert_array_equal(got["model"]["b"], BIAS)
    np.testing.assert_array_equal(got["optim"]["state"][0]["exp_avg"].data, M[lo:hi])
    np.testing.assert_array_equal(got["optim"]["state"][1]["exp_avg"], BIAS * 2)
    assert got["optim"]["state"][0]["step"] == 17
    assert type(got["optim"]["state"][1]["step"]) is np.int64
    assert got["optim"]["param_groups"] == [{"lr": 1e-3, "betas": (0.9, 0.999),
                                            "params": [0, 1]}]
    assert (got["step"], got["epoch"]) == (100, 3)
    assert got["data_rng_state"] == np.random.default_rng(7).bit_generator.state


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_save_load_same_world_size_in_place(tmp_path: Path, n: int) -> None:
    async def body(g: Group) -> tuple[Any, Any, Any]:
        result = await save(train_state(g.rank, n), tmp_path, g, step=5, timeout=OP_TIMEOUT)
        like = blank_like(g.rank, n)
        got = await load(tmp_path, g, like=like, timeout=OP_TIMEOUT)
        return result, like, got

    outcomes = await run_ranks(n, body)
    for rank, (result, like, got) in enumerate(outcomes):
        assert result.step == 5 and result.committed == (rank == 0)
        assert result.path == tmp_path / "step_000005"
        assert_state(got, rank, n, saved_ranks=n)
        # arrays and generators were restored in place
        assert got["model"]["w"] is like["model"]["w"]
        assert got["model"]["b"] is like["model"]["b"]
        assert got["rng"] is like["rng"]
        assert got["rng"].random() == train_state(rank, n)["rng"].random()
        assert got["cursor"] == rank * 10  # per-rank value, same world size
    assert (tmp_path / "latest").read_text() == "step_000005\n"
    assert sorted(os.listdir(tmp_path / "step_000005")) == (
        ["metadata.json"] + [f"rank_{r:05d}.safetensors" for r in range(n)])


@pytest.mark.parametrize("old, new", [(2, 3), (3, 2), (3, 1), (1, 4)])
async def test_load_into_a_different_world_size(tmp_path: Path, old: int, new: int) -> None:
    await run_ranks(old, lambda g: save(train_state(g.rank, old), tmp_path, g,
                                        timeout=OP_TIMEOUT))

    async def body(g: Group) -> tuple[Any, Any]:
        like = blank_like(g.rank, new)
        got = await load(tmp_path, g, like=like, rank_objects="modulo", timeout=OP_TIMEOUT)
        fresh = await load(tmp_path, g, rank_objects="rank0", timeout=OP_TIMEOUT)
        return got, fresh

    for rank, (got, fresh) in enumerate(await run_ranks(new, body)):
        assert_state(got, rank, new, saved_ranks=old)
        assert got["cursor"] == (rank % old) * 10
        expected_rng = train_state(rank % old, old)["rng"]
        assert got["rng"].bit_generator.state == expected_rng.bit_generator.state
        assert_state(fresh, rank, new, saved_ranks=old)  # rebuilt without `like`
        assert fresh["cursor"] == 0
        assert isinstance(fresh["rng"], np.random.Generator)


async def test_per_rank_values_refuse_a_world_size_change_by_default(tmp_path: Path) -> None:
    await run_ranks(2, lambda g: save(train_state(g.rank, 2), tmp_path, g, timeout=OP_TIMEOUT))

    async def refuse(g: Group) -> Any:
        return await load(tmp_path, g, like=blank_like(g.rank, 3), timeout=OP_TIMEOUT)

    errors = await run_ranks(3, refuse, return_exceptions=True)
    assert all(isinstance(e, CheckpointMismatchError) for e in errors)
    assert "values 'cursor', 'rng' differed" in str(errors[0]) and "rank_objects" in str(errors[0])

    async def keep_current(g: Group) -> Any:
        return await load(tmp_path, g, like=blank_like(g.rank, 3), rank_objects="like",
                          timeout=OP_TIMEOUT)

    for rank, got in enumerate(await run_ranks(3, keep_current)):
        assert_state(got, rank, 3, saved_ranks=2)
        assert got["cursor"] == -1  # kept from `like`
        assert got["rng"].bit_generator.state == np.random.default_rng(99).bit_generator.state


async def test_shards_along_another_dim_and_uneven_like(tmp_path: Path) -> None:
    full = np.arange(4 * 10, dtype=np.int64).reshape(4, 10)

    async def saver(g: Group) -> Any:
        lo, hi = chunk_bounds(4, 2)[g.rank]
        return await save({"x": ShardedArray(full[lo:hi])}, tmp_path, g, timeout=OP_TIMEOUT)

    await run_ranks(2, saver)
    widths = [(0, 7), (7, 8), (8, 10)]  # arbitrary uneven split along dim 1

    async def loader(g: Group) -> Any:
        lo, hi = widths[g.rank]
        like = {"x": ShardedArray(np.zeros((4, hi - lo), np.int64), shard_dim=1)}
        return await load(tmp_path, g, like=like, timeout=OP_TIMEOUT)

    for rank, got in enumerate(await run_ranks(3, loader)):
        lo, hi = widths[rank]
        np.testing.assert_array_equal(got["x"].data, full[:, lo:hi])


async def test_replicated_tensors_written_once_and_rotation(tmp_path: Path) -> None:
    async def body(g: Group) -> list[int]:
        steps = []
        for _ in range(4):
            result = await save(train_state(g.rank, 2), tmp_path, g, keep_last=2,
                                timeout=OP_TIMEOUT)
            steps.append(result.step)
        return steps

    assert await run_ranks(2, body) == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    meta = load_metadata(tmp_path)
    files = [safetensors.numpy.load_file(tmp_path / "step_000003" / f"rank_0000{r}.safetensors")
             for r in range(2)]
    replicated = [n for n, s in meta.tensor_specs.items() if s.is_replicated]
    assert sorted(replicated) == ["model.b", "optim.state.1.exp_avg"]
    for name in replicated:
        assert sum(name in f for f in files) == 1
        assert name in files[meta.writers[name]]
    assert set(meta.state.objects) >= {"step", "epoch", "optim.param_groups", "data_rng_state"}
    assert set(meta.state.rank_objects) == {"rng", "cursor"}


async def test_a_failing_rank_fails_every_rank_and_commits_nothing(tmp_path: Path) -> None:
    await run_ranks(2, lambda g: save(train_state(g.rank, 2), tmp_path, g, step=1,
                                      timeout=OP_TIMEOUT))

    class Opaque:
        pass

    async def body(g: Group) -> Any:
        state = train_state(g.rank, 2)
        if g.rank == 1:
            state["bad"] = Opaque()  # cannot be stored: no pickle
        else:
            state["bad"] = 1
        return await save(state, tmp_path, g, step=2, timeout=OP_TIMEOUT)

    errors = await run_ranks(2, body, return_exceptions=True)
    assert isinstance(errors[1], TypeError) and "Opaque" in str(errors[1])
    assert isinstance(errors[0], CheckpointError) and "rank(s) 1" in str(errors[0])
    assert load_metadata(tmp_path).step == 1

    async def mismatched(g: Group) -> Any:
        state = train_state(g.rank, 2)
        if g.rank == 0:
            state["extra_tensor"] = np.ones(2)
        return await save(state, tmp_path, g, step=3, timeout=OP_TIMEOUT)

    errors = await run_ranks(2, mismatched, return_exceptions=True)
    assert all(isinstance(e, CheckpointMismatchError) for e in errors)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]


async def test_existing_step_needs_overwrite(tmp_path: Path) -> None:
    await run_ranks(2, lambda g: save(train_state(g.rank, 2), tmp_path, g, step=4,
                                      timeout=OP_TIMEOUT))
    errors = await run_ranks(2, lambda g: save(train_state(g.rank, 2, scale=2.0), tmp_path, g,
                                               step=4, timeout=OP_TIMEOUT),
                             return_exceptions=True)
    assert all(isinstance(e, CheckpointError) for e in errors)
    assert "overwrite=True" in str(errors[0])
    await run_ranks(2, lambda g: save(train_state(g.rank, 2, scale=2.0), tmp_path, g, step=4,
                                      overwrite=True, timeout=OP_TIMEOUT))
    got = load_distributed(tmp_path, 0, 1)
    np.testing.assert_array_equal(got["model.w"], W * 2)


async def test_crash_leftovers_are_cleaned_on_next_save(tmp_path: Path) -> None:
    (tmp_path / "step_000007").mkdir(parents=True)
    (tmp_path / "step_000007" / "rank_00000.safetensors").write_bytes(b"partial")
    (tmp_path / ".trash-step_000001-abcd").mkdir()
    (tmp_path / ".latest.tmp.1.ab").write_bytes(b"x")
    (tmp_path / ".step_000003.tmp-0123abcd").mkdir()  # a staging directory
    (tmp_path / ".step_000003.tmp-0123abcd" / "rank_00001.safetensors").write_bytes(b"x")
    (tmp_path / ".step_000009.old-0123abcd").mkdir()  # an aside, half deleted
    await run_ranks(2, lambda g: save(train_state(g.rank, 2), tmp_path, g,
                                      timeout=OP_TIMEOUT))
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000000"]


async def test_load_failures_are_raised_on_every_rank(tmp_path: Path) -> None:
    errors = await run_ranks(2, lambda g: load(tmp_path / "none", g, timeout=OP_TIMEOUT),
                             return_exceptions=True)
    assert all(isinstance(e, CheckpointNotFoundError) for e in errors)

    await run_ranks(2, lambda g: save(train_state(g.rank, 2), tmp_path, g, timeout=OP_TIMEOUT))
    path = tmp_path / "step_000000" / "rank_00000.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)

    errors = await run_ranks(
        2, lambda g: load(tmp_path, g, like=blank_like(g.rank, 2), timeout=OP_TIMEOUT),
        return_exceptions=True)
    assert isinstance(errors[0], CheckpointCorruptError) and "checksum" in str(errors[0])
    assert isinstance(errors[1], CheckpointCorruptError) and "rank(s) 0" in str(errors[1])

    async def wrong_dtype(g: Group) -> Any:
        like = blank_like(g.rank, 2)
        like["model"]["b"] = like["model"]["b"].astype(np.float32)
        return await load(tmp_path, g, like=like, verify=False, timeout=OP_TIMEOUT)

    errors = await run_ranks(2, wrong_dtype, return_exceptions=True)
    assert all(isinstance(e, CheckpointMismatchError) for e in errors)
    assert "dtype float64" in str(errors[0])


async def test_an_os_error_on_one_rank_is_a_checkpoint_error_naming_rank_and_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await run_ranks(2, lambda g: save(train_state(g.rank, 2), tmp_path, g, timeout=OP_TIMEOUT))
    directory = tmp_path / "step_000000"
    original = collective_module.check_file_sizes
    lock = threading.Lock()
    calls: list[int] = []

    def refused_once(path: Any, *args: Any) -> None:
        with lock:
            calls.append(len(calls))
            first = len(calls) == 1
        if first:  # whichever rank checks first cannot read a rank file
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES),
                                  str(path / "rank_00001.safetensors"))
        original(path, *args)

    monkeypatch.setattr(collective_module, "check_file_sizes", refused_once)
    errors = await run_ranks(
        2, lambda g: load(tmp_path, g, like=blank_like(g.rank, 2), timeout=OP_TIMEOUT),
        return_exceptions=True)
    assert len(calls) == 2 and all(type(e) is CheckpointError for e in errors), errors
    failed = [r for r, e in enumerate(errors) if isinstance(e.__cause__, PermissionError)]
    assert len(failed) == 1, errors
    rank, other = failed[0], 1 - failed[0]
    assert str(errors[rank]) == (
        f"rank {rank} could not read checkpoint {directory}: [Errno {errno.EACCES}] "
        f"{os.strerror(errno.EACCES)}: '{directory / 'rank_00001.safetensors'}'")
    assert str(errors[other]).startswith(
        f"checkpoint load failed on rank(s) {rank} (seen from rank {other}): rank {rank}: "
        f"CheckpointError: rank {rank} could not read checkpoint {directory}")


async def test_check_replicated_catches_diverged_copies(tmp_path: Path) -> None:
    async def body(g: Group) -> Any:
        return await save({"b": BIAS + g.rank}, tmp_path, g, check_replicated=True,
                          timeout=OP_TIMEOUT)

    errors = await run_ranks(2, body, return_exceptions=True)
    assert all(isinstance(e, CheckpointMismatchError) for e in errors)
    assert "differs between rank 0 and rank 1" in str(errors[0])


async def test_collective_load_of_a_per_rank_checkpoint(tmp_path: Path) -> None:
    full = {"w": W, "b": BIAS}
    meta = flat_shard_metadata(full, 2)
    for rank in range(2):
        save_distributed(shard_state_dict(full, meta, rank), tmp_path, rank, 2, meta)
    got = await run_ranks(3, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT))
    for rank in range(3):
        lo, hi = chunk_bounds(11, 3)[rank]
        np.testing.assert_array_equal(got[rank]["w"].data, W[lo:hi])
