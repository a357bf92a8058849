"""AsyncCheckpointer / CheckpointFuture: staging, background writes, idempotent waits."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from netdist.checkpoint import (
    AsyncCheckpointer,
    CheckpointFuture,
    SaveResult,
    flat_shard_metadata,
    load_distributed,
    save_distributed,
    shard_state_dict,
)
from netdist.errors import CheckpointError


def _state(scale: float = 1.0) -> dict[str, np.ndarray]:
    return {"w": np.arange(40, dtype=np.float32).reshape(10, 4) * scale,
            "b": np.arange(10, dtype=np.float64) * scale,
            "step": np.array(int(scale), np.int64)}


async def test_async_basic_round_trip(tmp_path: Path) -> None:
    state = _state()
    async with AsyncCheckpointer(tmp_path, 0, 1) as ckpt:
        future = ckpt.save_async(state)
        assert isinstance(future, CheckpointFuture)
        result = await future
    assert isinstance(result, SaveResult) and result.committed
    got = load_distributed(tmp_path, 0, 1)
    for name in state:
        np.testing.assert_array_equal(got[name], state[name])


async def test_idempotent_wait_and_done(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, 0, 1) as ckpt:
        future = ckpt.save_async(_state())
        first = await future
        assert future.done() and future.is_done()
        assert await future is first
        assert future.wait() is first
        assert future.wait(timeout=1) is first
        assert future.result() is first
        assert future.exception() is None
        assert "done" in repr(future)


def test_sync_wait_without_an_event_loop(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, 0, 1) as ckpt:
        future = ckpt.save_async(_state(), step=3)
        result = future.wait()
        assert future.wait() is result and future.done()
    assert result.step == 3 and (tmp_path / "latest").read_text() == "step_000003\n"


async def test_state_is_staged_before_save_async_returns(tmp_path: Path) -> None:
    state = _state()
    expected = {k: v.copy() for k, v in state.items()}
    with AsyncCheckpointer(tmp_path, 0, 1) as ckpt:
        future = ckpt.save_async(state)
        for array in state.values():  # training goes on and mutates its arrays
            array[...] = -1
        await future
    got = load_distributed(tmp_path, 0, 1)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])


async def test_event_loop_keeps_running_while_writing(tmp_path: Path) -> None:
    big = {"x": np.ones((64, 1 << 20), np.uint8)}  # 64 MiB: the write takes a while
    ticks = 0
    try:
        with AsyncCheckpointer(tmp_path / "ck", 0, 1) as ckpt:
            future = ckpt.save_async(big)

            async def tick() -> None:
                nonlocal ticks
                while not future.done():
                    ticks += 1
                    await asyncio.sleep(0)

            ticker = asyncio.create_task(tick())
            await future
            await ticker
    finally:
        shutil.rmtree(tmp_path / "ck", ignore_errors=True)  # pytest keeps old tmp dirs
    assert ticks > 0


async def test_second_save_waits_for_the_first_and_buffers_are_reused(tmp_path: Path) -> None:
    meta = flat_shard_metadata(_state(), 2)
    with AsyncCheckpointer(tmp_path, 1, 2, meta, keep_last=1) as ckpt:
        first = ckpt.save_async(shard_state_dict(_state(1.0), meta, 1), step=1)
        buffers = dict(ckpt._staging)  # white-box: the staging arrays themselves
        second = ckpt.save_async(shard_state_dict(_state(2.0), meta, 1), step=2)
        assert first.done()  # documented: one save in flight, the second call waited
        assert all(ckpt._staging[name] is buffers[name] for name in buffers)
        assert ckpt.staging_bytes == sum(b.nbytes for b in buffers.values())
        await second
        assert ckpt.in_flight is None
    # rank 0 never saved: nothing committed, files are in place for it
    assert not (tmp_path / "step_000002" / "metadata.json").exists()
    save_distributed(shard_state_dict(_state(2.0), meta, 0), tmp_path, 0, 2, meta, step=2,
                     keep_last=1)
    got = load_distributed(tmp_path, 0, 1)
    np.testing.assert_array_equal(got["w"], _state(2.0)["w"])
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000002"]


async def test_async_result_identical_to_sync_save(tmp_path: Path) -> None:
    state = _state(3.0)
    meta = flat_shard_metadata(state, 2)
    for rank in range(2):
        save_distributed(shard_state_dict(state, meta, rank), tmp_path / "sync", rank, 2, meta)
        with AsyncCheckpointer(tmp_path / "async", rank, 2, meta) as ckpt:
            await ckpt.save_async(shard_state_dict(state, meta, rank))
    for name in ["metadata.json", "rank_00000.safetensors", "rank_00001.safetensors"]:
        assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "async" / name).read_bytes()


async def test_staging_buffers_are_reused_across_saves(tmp_path: Path) -> None:
    # The stall target (0.1 s/GiB) is measured by benchmarks/checkpoint.py; here we check
    # what makes it possible: steady-state saves copy into the same staging memory.
    state = {f"t{i}": np.full((8, 1 << 16), i, np.float32) for i in range(4)}
    try:
        with AsyncCheckpointer(tmp_path / "ck", 0, 1) as ckpt:
            await ckpt.save_async(state)
            first = {name: buf.ctypes.data for name, buf in ckpt._staging.items()}
            staged_bytes = ckpt.staging_bytes
            for step in range(3):
                state["t0"][...] = step
                result = await ckpt.save_async(state)
                assert {name: buf.ctypes.data for name, buf in ckpt._staging.items()} == first
                assert ckpt.staging_bytes == staged_bytes
                assert result is not None
    finally:
        shutil.rmtree(tmp_path / "ck", ignore_errors=True)
    assert staged_bytes == sum(a.nbytes for a in state.values())


async def test_write_errors_surface_through_the_future(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    expected = f"checkpoint directory {blocker} exists and is not a directory"
    with AsyncCheckpointer(blocker, 0, 1) as ckpt:
        future = ckpt.save_async(_state(), step=1)
        with pytest.raises(CheckpointError) as raised:
            await future
        assert str(raised.value) == expected
        assert isinstance(raised.value.__cause__, FileExistsError)
        with pytest.raises(CheckpointError, match="exists and is not a directory"):
            future.wait()
        assert future.done() and type(future.exception()) is CheckpointError
        standalone = ckpt.save_async(_state())  # no step: the directory itself
        with pytest.raises(CheckpointError) as raised:
            await standalone
        assert str(raised.value) == expected
        assert blocker.read_bytes() == b"not a directory"


def test_invalid_input_raises_synchronously(tmp_path: Path) -> None:
    meta = flat_shard_metadata(_state(), 2)
    with AsyncCheckpointer(tmp_path, 0, 2, meta) as ckpt:
        with pytest.raises(ValueError, match="spec says"):
            ckpt.save_async(_state())  # full arrays where rank 0's shards are expected
    with pytest.raises(ValueError, match="out of range"):
        AsyncCheckpointer(tmp_path, 2, 2)
    with pytest.raises(ValueError, match="keep_last must be an int >= 1, got 0"):
        AsyncCheckpointer(tmp_path, 0, 1, keep_last=0)


def test_closed_checkpointer_refuses_and_close_is_idempotent(tmp_path: Path) -> None:
    ckpt = AsyncCheckpointer(tmp_path, 0, 1)
    future = ckpt.save_async(_state())
    ckpt.close()
    assert future.done()
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save_async(_state())


async def test_reserve_preallocates_the_staging_buffers(tmp_path: Path) -> None:
    state = _state()
    with AsyncCheckpointer(tmp_path, 0, 1) as ckpt:
        assert ckpt.staging_bytes == 0
        held = ckpt.reserve(state)
        assert held == sum(a.nbytes for a in state.values()) == ckpt.staging_bytes
        buffers = dict(ckpt._staging)
        await ckpt.save_async(state)
        assert all(ckpt._staging[n] is buffers[n] for n in buffers)
    got = load_distributed(tmp_path, 0, 1)
    np.testing.assert_array_equal(got["w"], state["w"])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_staging_copy_is_exact_for_every_split(tmp_path: Path, threads: int) -> None:
    rng = np.random.default_rng(5)
    base = rng.standard_normal((700, 1500)).astype(np.float32)  # ~4 MiB: split into lanes
    state = {
        "big": base,
        "strided": base[:, ::3],                       # non-contiguous source
        "wide": rng.integers(0, 255, (3, 1 << 20), dtype=np.uint8),  # few, long rows
        "scalar": np.array(3.25),
        "empty": np.zeros((0, 7), np.int32),
        "big_endian": np.arange(300_000, dtype=">f8"),
    }
    with AsyncCheckpointer(tmp_path, 0, 1, staging_threads=threads) as ckpt:
        for scale in (1, 2):  # the second pass reuses the buffers
            current = {k: (v * scale).astype(v.dtype) if v.dtype.kind != "u" else v
                       for k, v in state.items()}
            current["strided"] = (base * scale)[:, ::3]
            ckpt.save_async(current).wait()
            got = load_distributed(tmp_path, 0, 1)
            for name, array in current.items():
                np.testing.assert_array_equal(got[name], array, err_msg=name)
