"""float16 cast compression: saturation, scaling, error feedback."""

from __future__ import annotations

import numpy as np
import pytest

from netdist.compression import FP16_MAX, Fp16Compressor, cast_to_fp16


def test_cast_saturates_instead_of_overflowing():
    a = np.array([1e6, -1e6, 1.5, np.inf, np.nan], dtype=np.float32)
    h = cast_to_fp16(a)
    assert h.dtype == np.float16
    np.testing.assert_array_equal(h[:4], [FP16_MAX, -FP16_MAX, 1.5, FP16_MAX])
    assert np.isnan(h[4])


def test_cast_with_scale_and_out():
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    out = np.empty(6, dtype=np.float16)
    res = cast_to_fp16(a, scale=0.25, out=out)
    assert res is out
    np.testing.assert_array_equal(out, np.arange(6) * 0.25)
    with pytest.raises(ValueError):
        cast_to_fp16(a, out=np.empty(5, dtype=np.float16))
    with pytest.raises(TypeError):
        cast_to_fp16(np.arange(3))


def test_round_trip_halves_float32_bytes():
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(100, 10)).astype(np.float32), rng.normal(size=10)]
    comp = Fp16Compressor()
    halves = comp.compress(grads)
    assert halves[0].nbytes * 2 == grads[0].nbytes
    back = comp.decompress(halves, [g.dtype for g in grads])
    for g, b in zip(grads, back):
        assert b.dtype == g.dtype and b.shape == g.shape
        np.testing.assert_allclose(b, g, rtol=1e-3, atol=1e-4)


def test_fp16_error_feedback_conserves_mass():
    rng = np.random.default_rng(1)
    comp = Fp16Compressor(error_feedback=True)
    raw = np.zeros(100)
    sent = np.zeros(100)
    for _ in range(20):
        g = rng.normal(size=100) * 1e-3
        raw += g
        sent += comp.compress([g])[0].astype(np.float64)
    np.testing.assert_allclose(sent + comp.residuals[0], raw, rtol=0, atol=1e-15)
    assert np.abs(comp.residuals[0]).max() < 1e-6
