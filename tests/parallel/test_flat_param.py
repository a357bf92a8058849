"""PURE flat-parameter layouts and the auto-wrap policy (``netdist.parallel.flat_param``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from netdist.parallel.flat_param import FlatParamLayout, ShardPiece, plan_units
from netdist.sharding import chunk_bounds

# --------------------------------------------------------------------------- plan_units


@pytest.mark.parametrize(("counts", "min_params", "units"), [
    # mlp: L R L R L  -> one unit per Linear, activations ride with the unit before them
    ([104, 0, 154, 0, 60], 0, ((0, 2), (2, 4), (4, 5))),
    ([104, 0, 154, 0, 60], 1, ((0, 2), (2, 4), (4, 5))),
    # small layers grouped until the unit reaches the threshold
    ([104, 0, 154, 0, 60], 200, ((0, 4), (4, 5))),
    ([10, 10, 10, 10, 10], 25, ((0, 3), (3, 5))),
    ([104, 0, 154, 0, 60], 10_000, ((0, 5),)),
    # leading parameter-free layers join the first unit; trailing ones the last
    ([0, 0, 5, 0, 7, 0], 0, ((0, 4), (4, 6))),
    ([0, 0], 0, ((0, 2),)),
    ([], 0, ()),
])
def test_plan_units(counts, min_params, units):
    assert plan_units(counts, min_params) == units


def test_plan_units_rejects_bad_input():
    with pytest.raises(ValueError, match="min_params"):
        plan_units([1, 2], -1)
    with pytest.raises(ValueError, match="param_counts"):
        plan_units([1, -2])
    with pytest.raises(TypeError):
        plan_units([1.5])


@given(st.lists(st.integers(0, 50), max_size=12), st.integers(0, 120))
def test_plan_units_covers_layers_in_order(counts, min_params):
    units = plan_units(counts, min_params)
    if not counts:
        assert units == ()
        return
    assert units[0][0] == 0 and units[-1][1] == len(counts)
    for (a, b), (c, _) in zip(units, units[1:]):
        assert b == c and a < b
        # a unit is closed only once it reached the threshold
        assert sum(counts[a:b]) >= max(min_params, 1)
        # and the next unit starts with a layer that has parameters
        assert counts[c] > 0


# --------------------------------------------------------------------------- layouts


def layout_13_over_4() -> FlatParamLayout:
    return FlatParamLayout.build(["w0", "b0", "w1"], [(2, 3), (3,), (4,)], np.float64, 4)


def test_layout_pads_to_a_multiple_of_the_shard_count():
    layout = layout_13_over_4()
    assert (layout.numel, layout.padded_numel, layout.shard_numel, layout.padding) == (13, 16, 4, 3)
    assert [s.offset for s in layout.slots] == [0, 6, 9]
    assert [layout.shard_bounds(k) for k in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    # the collectives' split rule agrees on a padded buffer
    assert chunk_bounds(16, 4) == [layout.shard_bounds(k) for k in range(4)]
    assert [layout.valid_numel(k) for k in range(4)] == [4, 4, 4, 1]


def test_layout_pieces_and_param_shard_sizes():
    layout = layout_13_over_4()
    assert layout.pieces(0) == (ShardPiece(0, 0, 4, 0),)
    assert layout.pieces(1) == (ShardPiece(0, 4, 6, 0), ShardPiece(1, 0, 2, 2))
    assert layout.pieces(2) == (ShardPiece(1, 2, 3, 0), ShardPiece(2, 0, 3, 1))
    assert layout.pieces(3) == (ShardPiece(2, 3, 4, 0),)
    assert layout.param_shard_sizes(0) == (4, 2, 0, 0)
    assert layout.param_shard_sizes(1) == (0, 2, 1, 0)
    assert layout.param_shard_sizes(2) == (0, 0, 3, 1)
    with pytest.raises(ValueError, match="slot"):
        layout.param_shard_sizes(3)
    with pytest.raises(ValueError, match="shard 4"):
        layout.shard_bounds(4)


def test_flatten_and_views_round_trip_with_zero_padding():
    layout = layout_13_over_4()
    arrays = [np.arange(6.0).reshape(2, 3), np.array([6.0, 7, 8]), np.array([9.0, 10, 11, 12])]
    flat = layout.flatten(arrays)
    np.testing.assert_array_equal(flat, np.r_[np.arange(13.0), 0, 0, 0])
    views = layout.views(flat)
    for view, array in zip(views, arrays):
        np.testing.assert_array_equal(view, array)
        assert np.shares_memory(view, flat)
    with pytest.raises(ValueError, match="shape"):
        layout.flatten([np.zeros((3, 2)), arrays[1], arrays[2]])
    with pytest.raises(ValueError, match="3 parameter slots"):
        layout.flatten(arrays[:2])


def test_seed_case_10_20_30_40_over_two_shards():
    layout = FlatParamLayout.build(["b"], [(4,)], np.float64, 2)
    flat = layout.flatten([np.array([10.0, 20, 30, 40])])
    shards = [flat[a:b] for a, b in (layout.shard_bounds(0), layout.shard_bounds(1))]
    np.testing.assert_array_equal(shards[0], [10, 20])
    np.testing.assert_array_equal(shards[1], [30, 40])
    assert layout.padding == 0


def test_empty_layout_and_more_shards_than_elements():
    empty = FlatParamLayout.build([], [], np.float32, 3)
    assert (empty.numel, empty.padded_numel, empty.shard_numel) == (0, 0, 0)
    assert [empty.valid_numel(k) for k in range(3)] == [0, 0, 0]
    tiny = FlatParamLayout.build(["s"], [()], np.float32, 3)  # a 0-d parameter
    assert (tiny.numel, tiny.padded_numel, tiny.shard_numel) == (1, 3, 1)
    assert [tiny.valid_numel(k) for k in range(3)] == [1, 0, 0]
    assert tiny.param_shard_sizes(0) == (1, 0, 0)


@given(st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), max_size=5),
       st.integers(1, 7))
def test_pieces_partition_every_parameter(shapes, shards):
    names = [f"p{i}" for i in range(len(shapes))]
    layout = FlatParamLayout.build(names, shapes, np.float32, shards)
    assert layout.padded_numel % shards == 0
    assert 0 <= layout.padding < shards
    assert sum(layout.valid_numel(k) for k in range(shards)) == layout.numel
    flat = np.arange(layout.padded_numel, dtype=np.float32)
    for index, slot in enumerate(layout.slots):
        sizes = layout.param_shard_sizes(index)
        assert sum(sizes) == slot.numel
        rebuilt = []
        for k in range(shards):
            start, _ = layout.shard_bounds(k)
            for piece in layout.pieces(k):
                if piece.slot == index:
                    assert piece.numel == sizes[k]
                    rebuilt.append(flat[start + piece.shard_start:
                                        start + piece.shard_start + piece.numel])
        got = np.concatenate(rebuilt) if rebuilt else np.empty(0, np.float32)
        np.testing.assert_array_equal(got, flat[slot.offset:slot.offset + slot.numel])
