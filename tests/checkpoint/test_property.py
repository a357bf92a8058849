"""Property tests: every reshard equals slicing the full array directly."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netdist.checkpoint import (
    CheckpointReader,
    ShardMetadata,
    TensorShardSpec,
    load_distributed,
    load_metadata,
    save_distributed,
    shard_state_dict,
)
from netdist.checkpoint.metadata import FileRecord
from netdist.checkpoint.planner import box_shape, plan_reads
from netdist.checkpoint.storage import ShardFile, TensorSource, write_safetensors

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int, int, int, str]:
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    dim = draw(st.integers(0, len(shape) - 1))
    new_dim = draw(st.integers(0, len(shape) - 1))
    old = draw(st.integers(1, 5))
    new = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from(["float32", "int16", "uint8", "float64", "bool"]))
    return shape, dim, new_dim, old, new, dtype


def _uneven_sizes(draw: st.DrawFn, total: int, n: int) -> tuple[int, ...]:
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@SETTINGS
@given(layout=layouts(), data=st.data())
def test_every_reshard_equals_slicing(layout: tuple, data: st.DataObject) -> None:
    shape, dim, new_dim, old, new, dtype = layout
    rng = np.random.default_rng(len(shape) * 1000 + old * 10 + new)
    full = (rng.integers(0, 200, shape)).astype(dtype)
    replicated = rng.standard_normal(3)
    uneven = data.draw(st.booleans())
    if uneven:
        saved = TensorShardSpec(shape, dim, _uneven_sizes(data.draw, shape[dim], old), dtype)
    else:
        saved = TensorShardSpec.even(shape, old, dim, dtype)
    meta = ShardMetadata(old, {"x": saved, "r": TensorShardSpec.replicated((3,), "float64")})
    with tempfile.TemporaryDirectory() as tmp:
        for rank in range(old):
            save_distributed(shard_state_dict({"x": full, "r": replicated}, meta, rank), tmp,
                             rank, old, meta)
        # automatic reshard: same dim, chunk_sizes split (saved layout if old == new)
        for rank in range(new):
            got = load_distributed(tmp, rank, new)
            expected = saved if old == new else TensorShardSpec.even(shape, new, dim)
            box = expected.box(rank)
            np.testing.assert_array_equal(got["x"], full[tuple(slice(a, b) for a, b in box)])
            np.testing.assert_array_equal(got["r"], replicated)
        # arbitrary target layout: split along another dim
        stored = load_metadata(tmp)
        target = TensorShardSpec.even(shape, new, new_dim)
        with CheckpointReader(Path(tmp), stored) as reader:
            for rank in range(new):
                box = target.box(rank)
                dest = np.empty(box_shape(box), dtype=dtype)
                reader.read(plan_reads(stored.tensor_specs, stored.writers, {"x": box}),
                            {"x": dest})
                np.testing.assert_array_equal(dest, full[tuple(slice(a, b) for a, b in box)])


@SETTINGS
@given(shape=st.lists(st.integers(1, 12), min_size=1, max_size=3), data=st.data(),
       block=st.integers(1, 97), verify=st.booleans())
def test_verified_box_reads_equal_numpy(shape: list[int], data: st.DataObject, block: int,
                                        verify: bool) -> None:
    full = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    box = tuple(sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
                for n in shape)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.safetensors"
        size, checksum = write_safetensors(
            path, [TensorSource("pad", "uint8", (3,), data=np.zeros(3, np.uint8)),
                   TensorSource("x", "int32", tuple(shape), data=full)], block_size=block)
        record = FileRecord(0, path.name, size, checksum, block_size=block)
        with ShardFile(path, record, verify=verify) as f:
            dest = np.empty(box_shape(box), dtype=np.int32)
            f.read_box("x", box, dest)
            np.testing.assert_array_equal(dest, full[tuple(slice(a, b) for a, b in box)])
            if verify:
                f.verify_all()
