"""``netdist.sharding``: the one split rule shared by collectives, FSDP, PS and checkpoints."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from netdist.sharding import (
    FlatSlot,
    Placement,
    TensorShardSpec,
    chunk_bounds,
    chunk_sizes,
    flat_slots,
    gather_shards,
    padded_size,
    shard_tensor,
)

# --------------------------------------------------------------------------- chunks


@pytest.mark.parametrize(("total", "n", "sizes"), [
    (10, 3, [4, 3, 3]),
    (9, 3, [3, 3, 3]),
    (11, 3, [4, 4, 3]),
    (2, 4, [1, 1, 0, 0]),
    (0, 3, [0, 0, 0]),
    (5, 1, [5]),
])
def test_chunk_sizes_first_total_mod_n_are_larger(total: int, n: int, sizes: list[int]) -> None:
    assert chunk_sizes(total, n) == sizes


def test_chunk_bounds_seed_case() -> None:
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert chunk_bounds(0, 2) == [(0, 0), (0, 0)]


@given(total=st.integers(0, 10_000), n=st.integers(1, 300))
def test_chunk_bounds_tile_the_range(total: int, n: int) -> None:
    bounds = chunk_bounds(total, n)
    sizes = chunk_sizes(total, n)
    assert len(bounds) == n
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    for (start, stop), (next_start, _) in zip(bounds, bounds[1:]):
        assert stop == next_start
    assert [stop - start for start, stop in bounds] == sizes
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert sum(1 for s in sizes if s == total // n + 1) == total % n


@pytest.mark.parametrize(("total", "n", "message"), [
    (10, 0, "number of chunks must be >= 1, got 0"),
    (10, -2, "number of chunks must be >= 1, got -2"),
    (-1, 2, "total must be >= 0, got -1"),
])
def test_chunk_errors(total: int, n: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chunk_sizes(total, n)
    with pytest.raises(ValueError, match=message):
        chunk_bounds(total, n)


@pytest.mark.parametrize(("total", "multiple", "expected"), [
    (0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 4, 8), (10, 3, 12), (7, 1, 7),
])
def test_padded_size(total: int, multiple: int, expected: int) -> None:
    assert padded_size(total, multiple) == expected


def test_padded_size_rejects_multiple_below_one() -> None:
    with pytest.raises(ValueError, match="multiple must be >= 1, got 0"):
        padded_size(5, 0)


# --------------------------------------------------------------------------- shard / gather


def test_shard_tensor_seed_case_10_rows_over_3() -> None:
    t = np.arange(20, dtype=np.float32).reshape(10, 2)
    shards = shard_tensor(t, 3)
    assert [s.shape for s in shards] == [(4, 2), (3, 2), (3, 2)]
    np.testing.assert_array_equal(shards[0], t[:4])
    np.testing.assert_array_equal(shards[1], t[4:7])
    np.testing.assert_array_equal(shards[2], t[7:])
    assert all(np.shares_memory(s, t) for s in shards)  # views, no copies
    np.testing.assert_array_equal(gather_shards(shards), t)


def test_zero_d_array_round_trips_with_one_shard() -> None:
    t = np.array(3.5)
    shards = shard_tensor(t, 1)
    assert len(shards) == 1 and shards[0].shape == ()
    out = gather_shards(shards)
    assert out.shape == () and out == 3.5
    assert not np.shares_memory(out, t)


@pytest.mark.parametrize("n", [0, 2])
def test_zero_d_array_cannot_be_split(n: int) -> None:
    with pytest.raises(ValueError):
        shard_tensor(np.array(1.0), n)


@pytest.mark.parametrize(("rows", "n", "message"), [
    (5, 0, "num_shards must be >= 1, got 0"),
    (5, -1, "num_shards must be >= 1, got -1"),
    (5, 6, "cannot split 5 rows into 6 non-empty shards"),
    (0, 2, "cannot split 0 rows into 2 non-empty shards"),
])
def test_shard_tensor_errors(rows: int, n: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shard_tensor(np.zeros((rows, 2)), n)


@pytest.mark.parametrize("n", [2.0, "2", True, None])
def test_shard_tensor_needs_an_int(n: object) -> None:
    with pytest.raises(TypeError, match="num_shards must be an int"):
        shard_tensor(np.zeros(4), n)  # type: ignore[arg-type]


def test_shard_tensor_accepts_numpy_integers_and_lists() -> None:
    shards = shard_tensor([1, 2, 3], np.int64(2))
    assert [s.tolist() for s in shards] == [[1, 2], [3]]


def test_gather_shards_errors() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        gather_shards([])
    with pytest.raises(ValueError, match=r"shard 1 has trailing shape \(3,\), expected \(2,\)"):
        gather_shards([np.zeros((2, 2)), np.zeros((1, 3))])
    with pytest.raises(ValueError, match="shard 1 is 0-d"):
        gather_shards([np.zeros(2), np.array(1.0)])
    with pytest.raises(ValueError, match="shard 0 is 0-d"):
        gather_shards([np.array(1.0), np.array(2.0)])


def test_gather_shards_uneven_first_dims() -> None:
    out = gather_shards([np.ones((3, 2)), np.zeros((1, 2)), np.full((2, 2), 7.0)])
    assert out.shape == (6, 2)
    np.testing.assert_array_equal(out[:, 0], [1, 1, 1, 0, 7, 7])


arrays = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float64, np.int8, np.int64, np.uint16, np.bool_]),
    shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=9),
    elements=None,
)


@given(t=arrays, data=st.data())
def test_gather_of_shard_is_identity_for_every_valid_n(t: np.ndarray, data: st.DataObject) -> None:
    rows = t.shape[0]
    n = data.draw(st.integers(1, rows), label="n")
    shards = shard_tensor(t, n)
    assert len(shards) == n
    assert [s.shape[0] for s in shards] == chunk_sizes(rows, n)
    assert all(s.shape[1:] == t.shape[1:] and s.dtype == t.dtype for s in shards)
    out = gather_shards(shards)
    assert out.dtype == t.dtype and out.shape == t.shape
    np.testing.assert_array_equal(out, t)


@given(t=arrays)
def test_every_n_from_1_to_rows_round_trips(t: np.ndarray) -> None:
    for n in range(1, t.shape[0] + 1):
        np.testing.assert_array_equal(gather_shards(shard_tensor(t, n)), t)
    with pytest.raises(ValueError):
        shard_tensor(t, t.shape[0] + 1)


def test_empty_array_is_its_own_single_shard() -> None:
    empty = np.zeros((0, 3))
    (only,) = shard_tensor(empty, 1)
    assert only.shape == (0, 3)
    assert gather_shards([only]).shape == (0, 3)


# --------------------------------------------------------------------------- TensorShardSpec


def test_tensor_shard_spec_even_and_replicated_geometry() -> None:
    spec = TensorShardSpec.even((10, 4), 3, 0, np.float32)
    assert spec.shard_sizes == (4, 3, 3) and spec.dtype == "float32"
    assert spec.placement is Placement.SHARDED and spec.num_shards == 3
    assert spec.shard_bounds(1) == (4, 7)
    assert spec.box(2) == ((7, 10), (0, 4)) and spec.local_shape(2) == (3, 4)
    rep = TensorShardSpec.replicated((5,), "bfloat16")
    assert rep.is_replicated and rep.num_shards is None and rep.dtype == "bfloat16"
    assert rep.box(0) == ((0, 5),) and rep.placement is Placement.REPLICATED
    with pytest.raises(ValueError, match="no shard bounds"):
        rep.shard_bounds(0)


def test_tensor_shard_spec_json_round_trip() -> None:
    for spec in (TensorShardSpec((6, 2), 1, (1, 1), "int64"),
                 TensorShardSpec.replicated((3, 3), "float64"),
                 TensorShardSpec((7,), 0, (4, 3))):
        assert TensorShardSpec.from_json(spec.to_json()) == spec
    assert TensorShardSpec((4,), 0, (2, 2), "float32").to_json() == {
        "dtype": "float32", "shape": [4], "placement": "sharded", "shard_dim": 0,
        "shard_sizes": [2, 2]}
    with pytest.raises(TypeError, match="shard_dim must be an integer"):
        TensorShardSpec.from_json({"placement": "sharded", "shape": [4], "shard_dim": "0",
                                   "shard_sizes": [4]})


@pytest.mark.parametrize(("args", "error", "message"), [
    (((4,), 0, (2, 1)), ValueError, "sum to 3"),
    (((4,), 1, (4,)), ValueError, "out of range"),
    (((4,), 0, ()), ValueError, "needs shard_sizes"),
    (((4,), None, (4,)), ValueError, "takes no shard_sizes"),
    (((4,), True, (4,)), TypeError, "shard_dim must be an int"),
    (((-1,), None, ()), ValueError, "ints >= 0"),
    (((2**62, 4), None, ()), ValueError, "past the int64 range"),
    (((1,) * 65, None, ()), ValueError, "more than 64"),
])
def test_tensor_shard_spec_refuses_bad_placements(args: tuple[Any, ...], error: type,
                                                  message: str) -> None:
    with pytest.raises(error, match=message):
        TensorShardSpec(*args)


def test_tensor_shard_spec_dtype_names() -> None:
    assert TensorShardSpec((2,), None, (), np.dtype(">f4")).dtype == "float32"
    with pytest.raises(TypeError, match="cannot be described by a shard spec"):
        TensorShardSpec((2,), None, (), np.complex128)


# --------------------------------------------------------------------------- flat layout


def test_flat_slots_lay_tensors_back_to_back() -> None:
    slots = flat_slots(["w", "b", "s"], [(2, 3), (4,), ()], start=5)
    assert [(s.name, s.shape, s.offset, s.numel, s.stop) for s in slots] == [
        ("w", (2, 3), 5, 6, 11), ("b", (4,), 11, 4, 15), ("s", (), 15, 1, 16)]
    flat = np.arange(16.0)
    view = slots[0].view(flat)
    assert view.shape == (2, 3) and np.shares_memory(view, flat)
    assert view.tolist() == [[5.0, 6.0, 7.0], [8.0, 9.0, 10.0]]
    with pytest.raises(ValueError, match="2 names for 1 shapes"):
        flat_slots(["a", "b"], [(1,)])
    with pytest.raises(ValueError, match="ints >= 0"):
        flat_slots(["a"], [(2, -1)])


def test_flat_slot_overlap_with_shards() -> None:
    slot = FlatSlot("w", (6,), 3, 6)        # flat[3:9]
    assert slot.overlap(0, 4) == (0, 1)     # first element only
    assert slot.overlap(4, 8) == (1, 5)
    assert slot.overlap(8, 12) == (5, 6)
    assert slot.overlap(0, 3) == (0, 0) and slot.overlap(9, 12) == (6, 6)  # misses: empty
    # the per-shard sizes of a slot sum to its numel (a flattened TensorShardSpec)
    sizes = tuple(hi - lo for lo, hi in (slot.overlap(a, b) for a, b in chunk_bounds(12, 4)))
    assert sizes == (0, 3, 3, 0)
    assert TensorShardSpec((slot.numel,), 0, sizes).local_shape(1) == (3,)


# --------------------------------------------------------------------------- mesh placements


def test_torch_chunk_sizes_are_ceil_sized_with_the_last_smaller_or_empty() -> None:
    from netdist.sharding import torch_chunk_sizes

    assert torch_chunk_sizes(5, 4) == [2, 2, 1, 0]
    assert torch_chunk_sizes(11, 4) == [3, 3, 3, 2]
    assert torch_chunk_sizes(0, 3) == [0, 0, 0]
    assert torch_chunk_sizes(9, 4) == [3, 3, 3, 0]


def test_placement_labels_round_trip_and_refuse_anything_else() -> None:
    from netdist.sharding import Replicate, Shard, parse_placement, placement_label

    for placement in (Shard(0), Shard(17), Replicate()):
        assert parse_placement(placement_label(placement)) == placement
    for bad in ("S(x)", "S(-1)", "S(123)", "Shard(0)", "r", 0, None):
        with pytest.raises(ValueError):
            parse_placement(bad)


def test_mesh_pieces_number_row_major_and_split_dims_mixed_radix() -> None:
    from netdist.sharding import ChunkRule, MeshSharding, Replicate, Shard

    # dp x tp = 2 x 3; dim 0 by dp, dim 1 by tp: piece = dp * 3 + tp, held by its rank
    grid = MeshSharding.even((5, 7), (2, 3), (Shard(0), Shard(1)))
    assert grid.extents == ((3, 2), (3, 2, 2)) and grid.num_pieces == 6
    assert [grid.piece_of(r) for r in range(6)] == list(range(6))
    assert grid.piece_box(4) == ((3, 5), (3, 5))
    # dim 0 by dp and tp at once: dp the more significant digit
    both = MeshSharding.even((9, 2), (2, 2), (Shard(0), Shard(0)))
    assert both.extents == ((3, 2, 2, 2), (2,)) and both.piece_box(2) == ((5, 7), (0, 2))
    assert MeshSharding.even((9, 2), (2, 2), (Shard(0), Shard(0)), ChunkRule.TORCH).extents \
        == ((3, 2, 2, 2), (2,))  # 9 -> 5, 4 -> (3, 2), (2, 2)
    # replicated along dp: ranks (0, 2) and (1, 3) hold the same pieces
    col = MeshSharding.even((4, 6), (2, 2), (Replicate(), Shard(1)))
    assert col.piece_holders() == ((0, 2), (1, 3))
    assert MeshSharding.even((4,), (2, 2), (Replicate(), Replicate())).piece_holders() == \
        ((0, 1, 2, 3),)


def test_mesh_placement_from_local_shapes_and_its_checks() -> None:
    from netdist.sharding import MeshSharding, Replicate, Shard

    got = MeshSharding.from_local_shapes((2, 2), (Replicate(), Shard(0)),
                                         [(2, 3), (5, 3), (2, 3), (5, 3)])
    assert got.extents == ((2, 5), (3,)) and got.full_shape == (7, 3)
    with pytest.raises(ValueError, match="rank 3 holds 4 along dim 0, rank 1 holds 5"):
        MeshSharding.from_local_shapes((2, 2), (Replicate(), Shard(0)),
                                       [(2, 3), (5, 3), (2, 3), (4, 3)])
    with pytest.raises(ValueError, match="rank 1 holds 2 along dim 1, rank 0 holds 3"):
        MeshSharding.from_local_shapes((2,), (Shard(0),), [(2, 3), (5, 2)])
    with pytest.raises(ValueError, match="3 local shapes for a mesh of shape"):
        MeshSharding.from_local_shapes((2, 2), (Replicate(), Shard(0)), [(1,)] * 3)
    with pytest.raises(ValueError, match="names dim 1 of a 1-d tensor"):
        MeshSharding((2,), (Shard(1),), ((4,),))
    with pytest.raises(ValueError, match="cut dim 0 into 2 pieces, but 3 extents"):
        MeshSharding((2,), (Shard(0),), ((1, 1, 1),))
    with pytest.raises(TypeError):
        MeshSharding((2,), ("S(0)",), ((1, 1),))  # type: ignore[arg-type]


def test_mesh_spec_json_round_trip_and_pieces() -> None:
    from netdist.sharding import ChunkRule, MeshSharding, Replicate, Shard

    spec = TensorShardSpec.on_mesh((5, 4), (2, 2), (Shard(1), Shard(0)), dtype=np.int16,
                                   rule=ChunkRule.TORCH)
    assert spec.placement is Placement.MESH and not spec.is_replicated
    assert spec.num_shards is None and spec.num_ranks == 4 and spec.num_pieces == 4
    assert spec.to_json() == {"dtype": "int16", "shape": [5, 4], "placement": "mesh",
                              "placements": ["S(1)", "S(0)"], "extents": [[3, 2], [2, 2]]}
    assert TensorShardSpec.from_json(spec.to_json(), (2, 2)) == spec
    with pytest.raises(ValueError, match="no mesh shape"):
        TensorShardSpec.from_json(spec.to_json())
    assert spec.box(1) == ((3, 5), (0, 2)) and spec.local_shape(2) == (3, 2)
    with pytest.raises(ValueError, match="sum to 4, but dim 0"):
        TensorShardSpec((5, 4), None, (), None, MeshSharding((2,), (Shard(0),), ((2, 2), (4,))))
    with pytest.raises(ValueError, match="shard_dim=None"):
        TensorShardSpec((4,), 0, (), None, MeshSharding((2,), (Replicate(),), ((4,),)))


@given(st.lists(st.integers(1, 3), min_size=1, max_size=3),
       st.lists(st.integers(0, 7), min_size=1, max_size=3), st.data())
def test_mesh_pieces_tile_the_tensor_and_holders_partition_the_ranks(
        mesh: list[int], shape: list[int], data: Any) -> None:
    from netdist.sharding import ChunkRule, MeshSharding, Replicate, Shard

    choices = st.one_of(st.just(Replicate()),
                        st.integers(0, len(shape) - 1).map(Shard))
    placements = tuple(data.draw(choices) for _ in mesh)
    rule = data.draw(st.sampled_from(list(ChunkRule)))
    split = MeshSharding.even(tuple(shape), tuple(mesh), placements, rule)
    cover = np.zeros(shape, dtype=np.int64)
    for piece in range(split.num_pieces):
        cover[tuple(slice(lo, hi) for lo, hi in split.piece_box(piece))] += 1
    assert (cover == 1).all()
    holders = split.piece_holders()
    assert sorted(r for h in holders for r in h) == list(range(split.num_ranks))
    shapes = [tuple(hi - lo for lo, hi in split.piece_box(split.piece_of(r)))
              for r in range(split.num_ranks)]
    assert MeshSharding.from_local_shapes(tuple(mesh), placements, shapes) == split
