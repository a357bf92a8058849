"""Top-k: exact selection against a sorted reference, ties, error feedback, wire size."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netdist.compression import (
    CompressedGradient,
    TopKCompressor,
    compress_gradients,
    decompress_gradients,
    index_dtype,
    topk_count,
    topk_indices,
)


def reference_topk(flat: np.ndarray, k: int) -> np.ndarray:
    """Full stable sort by (-|x|, index): the documented rule, the slow way."""
    order = np.lexsort((np.arange(flat.size), -np.abs(flat)))
    return np.sort(order[:k])


@pytest.mark.parametrize("n,k", [(1, 1), (10, 1), (10, 3), (1000, 10), (1000, 999), (5, 5)])
def test_topk_matches_sorted_reference(n, k):
    rng = np.random.default_rng(n * 31 + k)
    flat = rng.normal(size=n)
    np.testing.assert_array_equal(topk_indices(flat, k), reference_topk(flat, k))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=60), st.data())
def test_topk_ties_lower_index_wins(values, data):
    """Many equal magnitudes (including +x/-x and 0/-0): the reference rule holds exactly."""
    flat = np.array(values, dtype=np.float64)
    k = data.draw(st.integers(0, flat.size))
    got = topk_indices(flat, k)
    np.testing.assert_array_equal(got, reference_topk(flat, k))
    assert got.dtype == np.int32


def test_topk_tie_rule_example():
    flat = np.array([1.0, -2.0, 2.0, 0.5, -2.0, 2.0])
    np.testing.assert_array_equal(topk_indices(flat, 2), [1, 2])
    np.testing.assert_array_equal(topk_indices(flat, 3), [1, 2, 4])
    np.testing.assert_array_equal(topk_indices(np.zeros(5), 2), [0, 1])


def test_topk_rejects_nan_and_bad_k():
    with pytest.raises(ValueError, match="NaN"):
        topk_indices(np.array([1.0, np.nan, 0.0]), 1)
    with pytest.raises(ValueError, match="NaN"):
        topk_indices(np.array([5.0, 4.0, np.nan, np.nan]), 1)
    with pytest.raises(ValueError):
        topk_indices(np.zeros(3), 4)
    with pytest.raises(ValueError):
        topk_indices(np.zeros((2, 2)), 1)


def test_topk_count():
    assert topk_count(0, 0.5) == 0
    assert topk_count(1, 0.01) == 1
    assert topk_count(99, 0.01) == 1
    assert topk_count(100, 0.01) == 1
    assert topk_count(101, 0.01) == 2
    assert topk_count(100, 0.07) == 7  # not 8, although 0.07 * 100 > 7 in binary
    assert topk_count(10, 1.0) == 10
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError):
            topk_count(10, bad)
    with pytest.raises(TypeError):
        TopKCompressor(True)  # type: ignore[arg-type]


def test_index_dtype_switches_at_int32_limit():
    assert index_dtype(2**31) == np.int32
    assert index_dtype(2**31 + 1) == np.int64


def test_compress_decompress_round_trip():
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(20, 30)).astype(np.float32), rng.normal(size=7)]
    compressed = compress_gradients(grads, 0.1)
    assert [c.original_len for c in compressed] == [600, 7]
    assert [c.indices.size for c in compressed] == [60, 1]
    assert compressed[0].values.dtype == np.float32
    dense = decompress_gradients(compressed, [g.shape for g in grads])
    for g, d, c in zip(grads, dense, compressed):
        assert d.shape == g.shape and d.dtype == g.dtype
        kept = np.zeros(g.size, dtype=bool)
        kept[c.indices] = True
        np.testing.assert_array_equal(d.reshape(-1)[kept], g.reshape(-1)[kept])
        assert not d.reshape(-1)[~kept].any()
        # everything kept is at least as large as everything dropped
        assert np.abs(g.reshape(-1)[kept]).min() >= np.abs(g.reshape(-1)[~kept]).max()
    with pytest.raises(ValueError, match="does not hold"):
        decompress_gradients(compressed, [(5,), (7,)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ratio_001_wire_bytes_at_most_2_5_percent(dtype):
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=n).astype(dtype) for n in (10_000, 54_321, 100_000, 4096)]
    compressed = compress_gradients(grads, 0.01)
    wire = sum(c.nbytes for c in compressed)
    dense = sum(g.nbytes for g in grads)
    assert all(c.indices.dtype == np.int32 for c in compressed)
    assert wire <= 0.025 * dense
    assert wire / dense == pytest.approx(0.01 * (4 + np.dtype(dtype).itemsize)
                                         / np.dtype(dtype).itemsize, rel=0.01)


def test_error_feedback_conserves_mass_exactly():
    """sum(applied) + residual == sum(raw) exactly: integer-valued float64 is exact."""
    rng = np.random.default_rng(2)
    comp = TopKCompressor(0.05, error_feedback=True)
    shapes = [(10, 10), (37,)]
    raw_sum = [np.zeros(s) for s in shapes]
    applied_sum = [np.zeros(s) for s in shapes]
    for _ in range(25):
        grads = [rng.integers(-1000, 1000, size=s).astype(np.float64) for s in shapes]
        before = [g.copy() for g in grads]
        out = comp.compress(grads)
        for g, b in zip(grads, before):
            np.testing.assert_array_equal(g, b)  # inputs untouched
        for i, (g, d) in enumerate(zip(grads, decompress_gradients(out, shapes))):
            raw_sum[i] += g
            applied_sum[i] += d
    for i, s in enumerate(shapes):
        np.testing.assert_array_equal(applied_sum[i] + comp.residuals[i].reshape(s), raw_sum[i])
    assert comp.residual_norm() > 0


def test_error_feedback_conservation_with_random_floats():
    rng = np.random.default_rng(3)
    comp = TopKCompressor(0.01)
    raw = np.zeros(5000)
    applied = np.zeros(5000)
    for _ in range(50):
        g = rng.normal(size=5000)
        raw += g
        applied += decompress_gradients(comp.compress([g]), [(5000,)])[0]
    np.testing.assert_allclose(applied + comp.residuals[0], raw, rtol=0, atol=1e-12)


def test_error_feedback_eventually_sends_small_coordinates():
    """A coordinate too small to win alone is sent once its residual has grown."""
    comp = TopKCompressor(0.5)
    sent_small = False
    for _ in range(4):
        (cg,) = comp.compress([np.array([1.0, 0.3])])
        if 1 in cg.indices:
            sent_small = True
            assert cg.values[list(cg.indices).index(1)] > 0.3
    assert sent_small


def test_without_error_feedback_is_stateless():
    comp = TopKCompressor(0.5, error_feedback=False)
    a = comp.compress([np.array([3.0, 1.0, 2.0, 0.0])])
    b = comp.compress([np.array([3.0, 1.0, 2.0, 0.0])])
    np.testing.assert_array_equal(a[0].indices, b[0].indices)
    np.testing.assert_array_equal(a[0].indices, [0, 2])
    assert comp.residuals == []


def test_momentum_correction_follows_dgc():
    """u = m*u + g; v += u; send top-k of v; clear u and v where sent (reference loop)."""
    rng = np.random.default_rng(4)
    comp = TopKCompressor(0.1, momentum=0.9)
    u = np.zeros(50)
    v = np.zeros(50)
    for _ in range(10):
        g = rng.normal(size=50)
        (cg,) = comp.compress([g])
        u = 0.9 * u + g
        v = v + u
        idx = reference_topk(v, 5)
        np.testing.assert_array_equal(cg.indices, idx)
        np.testing.assert_array_equal(cg.values, v[idx])
        u[idx] = 0
        v[idx] = 0
        np.testing.assert_array_equal(comp.residuals[0], v)
        np.testing.assert_array_equal(comp.velocities[0], u)


def test_layout_change_is_reported_and_state_round_trips():
    comp = TopKCompressor(0.5)
    comp.compress([np.ones(4), np.ones(2)])
    with pytest.raises(ValueError, match="reset"):
        comp.compress([np.ones(4)])
    with pytest.raises(ValueError, match="reset"):
        comp.compress([np.ones(5), np.ones(2)])
    state = comp.state_dict()
    other = TopKCompressor(0.5)
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.residuals[1], comp.residuals[1])
    comp.reset()
    comp.compress([np.ones(5)])
    with pytest.raises(TypeError):
        comp.compress([np.ones(5, dtype=np.int64)])


def test_compressed_gradient_is_frozen_plain_data():
    cg = CompressedGradient(np.array([1], np.int32), np.array([2.0]), 3)
    with pytest.raises(AttributeError):
        cg.original_len = 4  # type: ignore[misc]
    np.testing.assert_array_equal(cg.to_dense(), [0.0, 2.0, 0.0])
    assert cg.nbytes == 12
    assert math.isclose(cg.to_dense((3, 1))[1, 0], 2.0)
