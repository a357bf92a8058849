"""Pure planning: dedup writers, write plans, read plans, contiguous runs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from netdist.checkpoint.metadata import TensorShardSpec
from netdist.checkpoint.planner import (
    assign_writers,
    box_shape,
    box_size,
    intersect,
    plan_reads,
    plan_writes,
    run_layout,
)
from netdist.errors import CheckpointMismatchError


def _rep(*shape: int, dtype: str = "float32") -> TensorShardSpec:
    return TensorShardSpec.replicated(shape, dtype)


def test_dedup_balances_replicated_tensors_largest_first() -> None:
    specs = {"a": _rep(100), "b": _rep(60), "c": _rep(50), "d": _rep(10)}
    writers = assign_writers(specs, 2)
    # 400 B -> rank 0; 240 -> rank 1; 200 -> rank 1 (240 < 400); 40 -> rank 0 (400 < 440)
    assert writers == {"a": 0, "b": 1, "c": 1, "d": 0}
    plan = plan_writes(specs, 2)
    assert plan.bytes_per_rank == (440, 440)
    assert [i.name for i in plan.for_rank(0)] == ["a", "d"]


def test_dedup_accounts_for_sharded_bytes_and_is_not_always_rank0() -> None:
    specs = {"w": TensorShardSpec((10, 4), 0, (7, 3), "float64"),  # rank 0: 224 B, rank 1: 96 B
             "r": _rep(8, dtype="float64")}                            # 64 B
    assert assign_writers(specs, 2) == {"r": 1}
    plan = plan_writes(specs, 2)
    assert plan.bytes_per_rank == (224, 160)
    names = [[(i.name, i.shape, i.replicated) for i in plan.for_rank(r)] for r in range(2)]
    assert names == [[("w", (7, 4), False)], [("w", (3, 4), False), ("r", (8,), True)]]


def test_dedup_is_deterministic_with_ties_to_lowest_rank() -> None:
    specs = {f"t{i}": _rep(4) for i in range(7)}
    first = assign_writers(specs, 3)
    assert first == assign_writers(dict(reversed(list(specs.items()))), 3)
    assert sorted(first.values()) == [0, 0, 0, 1, 1, 2, 2]
    assert first["t0"] == 0 and first["t1"] == 1 and first["t2"] == 2


def test_every_replicated_tensor_written_exactly_once() -> None:
    rng = np.random.default_rng(3)
    specs = {f"r{i}": _rep(int(rng.integers(1, 50))) for i in range(20)}
    specs["s"] = TensorShardSpec((9,), 0, (3, 3, 3, 0))
    plan = plan_writes(specs, 4)
    written = [i.name for r in range(4) for i in plan.for_rank(r) if i.replicated]
    assert sorted(written) == sorted(f"r{i}" for i in range(20))
    assert max(plan.bytes_per_rank) - min(plan.bytes_per_rank) <= 50 * 4


def test_plan_for_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="out of range"):
        plan_writes({}, 2).for_rank(2)


def test_sizes_are_exact_not_int64() -> None:
    # 2**32 x 2**32 elements wrap to 0 in NumPy's int64; plans count them exactly
    assert box_size(((0, 2**32), (0, 2**32))) == 2**64
    spec = TensorShardSpec((2**31, 2**31), 0, (2**30, 2**30), "float32")
    plan = plan_writes({"w": spec}, 2)
    assert plan.bytes_per_rank == (2**63, 2**63)


def test_missing_writer_is_a_corrupt_checkpoint() -> None:
    from netdist.errors import CheckpointCorruptError

    with pytest.raises(CheckpointCorruptError, match="no writer recorded for replicated "
                                                     "tensor 'r'"):
        plan_reads({"r": _rep(2)}, {}, {"r": ((0, 2),)})


def test_intersect_and_box_helpers() -> None:
    assert intersect(((0, 5), (2, 4)), ((3, 9), (0, 3))) == ((3, 5), (2, 3))
    assert intersect(((0, 5),), ((5, 9),)) is None
    assert box_shape(((2, 5), (0, 0))) == (3, 0)
    assert box_size(()) == 1 and box_size(((0, 3), (1, 1))) == 0


def test_read_plan_2_to_3_dim0_tiles_exactly() -> None:
    saved = {"w": TensorShardSpec((10, 3), 0, (5, 5))}
    new = TensorShardSpec((10, 3), 0, (4, 3, 3))
    plan = plan_reads(saved, {}, {"w": new.box(1)})  # rows 4..7
    items = plan["w"]
    assert [(i.src_rank, i.src_box, i.dst_box) for i in items] == [
        (0, ((4, 5), (0, 3)), ((0, 1), (0, 3))),
        (1, ((0, 2), (0, 3)), ((1, 3), (0, 3))),
    ]
    assert all(i.src_shape == (5, 3) for i in items)


def test_read_plan_across_dims_and_replicated() -> None:
    saved = {"w": TensorShardSpec((4, 6), 1, (3, 3)), "r": _rep(2, 2)}
    plan = plan_reads(saved, {"r": 1}, {"w": ((1, 3), (0, 6)), "r": ((0, 2), (0, 2))})
    assert [(i.src_rank, i.src_box, i.dst_box) for i in plan["w"]] == [
        (0, ((1, 3), (0, 3)), ((0, 2), (0, 3))),
        (1, ((1, 3), (0, 3)), ((0, 2), (3, 6))),
    ]
    assert [(i.src_rank, i.src_box) for i in plan["r"]] == [(1, ((0, 2), (0, 2)))]


def test_read_plan_empty_box_and_errors() -> None:
    saved = {"w": TensorShardSpec((4,), 0, (2, 2))}
    assert plan_reads(saved, {}, {"w": ((2, 2),)}) == {"w": ()}
    with pytest.raises(ValueError, match="outside"):
        plan_reads(saved, {}, {"w": ((0, 5),)})
    with pytest.raises(CheckpointMismatchError, match="tensor 'x' is not in the checkpoint"):
        plan_reads(saved, {}, {"x": ((0, 1),)})


@pytest.mark.parametrize("shape, box, expected", [
    ((), (), (0, 1)),
    ((5,), ((1, 4),), (0, 3)),
    ((4, 6), ((1, 3), (0, 6)), (0, 12)),        # whole rows: one run
    ((4, 6), ((1, 3), (2, 5)), (1, 3)),         # a column block: 2 runs of 3
    ((2, 3, 4), ((0, 2), (1, 2), (0, 4)), (1, 4)),
    ((2, 3, 4), ((0, 2), (0, 3), (0, 4)), (0, 24)),
    ((2, 3, 4), ((0, 2), (0, 3), (1, 3)), (2, 2)),
])
def test_run_layout(shape: tuple, box: tuple, expected: tuple) -> None:
    assert run_layout(shape, box) == expected


def test_run_layout_matches_numpy_addresses() -> None:
    shape = (3, 4, 5)
    full = np.arange(60).reshape(shape)
    for box in itertools.product([(0, 3), (1, 2)], [(0, 4), (1, 3)], [(0, 5), (2, 4)]):
        k, run = run_layout(shape, box)
        sub = full[tuple(slice(a, b) for a, b in box)]
        runs = sub.reshape(-1, run) if sub.size else sub
        for row in runs:  # every run is a contiguous range of flat indices
            assert list(row) == list(range(row[0], row[0] + run))
        grid = box_shape(box)[:k]
        assert len(runs) == (int(np.prod(grid)) if grid else 1)


def test_mesh_pieces_go_to_one_holder_each_balanced_over_the_holders() -> None:
    from netdist.sharding import Replicate, Shard

    # dp=2 x tp=2: w's two row pieces are each held by two ranks; e's four pieces by one
    w = TensorShardSpec.on_mesh((8, 4), (2, 2), (Replicate(), Shard(0)), dtype="float32")
    e = TensorShardSpec.on_mesh((4, 2), (2, 2), (Shard(0), Shard(1)), dtype="float32")
    specs = {"w": w, "e": e, "b": _rep(3)}
    writers = assign_writers(specs, 4)
    assert writers == {"w": (0, 1), "e": (0, 1, 2, 3), "b": 2}
    plan = plan_writes(specs, 4)
    assert plan.bytes_per_rank == (72, 72, 20, 8)
    assert sum(plan.bytes_per_rank) == 32 * 4 + 8 * 4 + 12  # every byte once
    assert [(i.name, i.shape, i.replicated) for i in plan.for_rank(1)] == \
        [("w", (4, 4), True), ("e", (2, 1), False)]
    # a read of rows 2..6 of w touches both pieces, from their writers
    reads = plan_reads(specs, writers, {"w": ((2, 6), (0, 4))})["w"]
    assert [(r.src_rank, r.src_box, r.dst_box) for r in reads] == [
        (0, ((2, 4), (0, 4)), ((0, 2), (0, 4))), (1, ((0, 2), (0, 4)), ((2, 4), (0, 4)))]
    assert assign_writers(specs, 4, pinned={("w", 1): 3})["w"] == (0, 3)
