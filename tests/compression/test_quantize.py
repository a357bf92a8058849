"""``netdist.compression.quantize``: the format byte by byte (hand-computed codes pinned),
the error bound on random, adversarial, constant, tiny and huge inputs for every
bits x scaling, the refusal of values it cannot represent, and error feedback."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from netdist.compression import (
    ErrorFeedback,
    Quantization,
    Scaling,
    dequantize,
    error_bound,
    quantize,
)
from netdist.compression.quantize import MAX_MAGNITUDE, is_poisoned, poisoned_buffer
from netdist.errors import ConfigError, QuantizationError

FORMATS = [Quantization(bits, scaling, chunk)
           for bits, scaling, chunk in itertools.product((8, 4), Scaling, (2, 64, 1024))]
FORMAT_IDS = [str(q) for q in FORMATS]
TINY = np.float32(2.0 ** -149)  # the smallest subnormal


def _round_trip(x: np.ndarray, q: Quantization) -> np.ndarray:
    buf = quantize(x, q)
    assert buf.dtype == np.uint8 and buf.shape == (q.wire_bytes(x.size),)
    return dequantize(buf, x.size, q)


def _check_bound(x: np.ndarray, q: Quantization) -> None:
    y = _round_trip(x, q)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.isfinite(y).all()
    error = np.abs(y.astype(np.float64) - x.astype(np.float64))
    bound = error_bound(x, q)
    worst = int(np.argmax(error - bound)) if x.size else 0
    assert (error <= bound).all(), (
        f"{q}: element {worst} = {x[worst]!r} decoded to {y[worst]!r}, error "
        f"{error[worst]!r} > bound {bound[worst]!r}")


def _inputs(q: Quantization) -> dict[str, np.ndarray]:
    """Named inputs for the bound: random at many scales, adversarial, edge cases."""
    rng = np.random.default_rng(q.bits * 1000 + q.chunk)
    n = 5 * q.chunk + 3  # a partial last chunk
    cases: dict[str, np.ndarray] = {}
    for scale in (1e-30, 1e-3, 1.0, 1e3, 1e30):
        cases[f"normal*{scale:g}"] = (rng.standard_normal(n) * scale).astype(np.float32)
    cases["positive"] = rng.uniform(1000, 1001, n).astype(np.float32)  # far from zero
    cases["heavy tails"] = (rng.standard_cauchy(n)).astype(np.float32)
    cases["wide exponents"] = (np.sign(rng.standard_normal(n))
                               * 10.0 ** rng.uniform(-38, 37, n)).astype(np.float32)
    # values exactly halfway between two levels of every chunk, the extremes present
    levels = q.levels
    k = np.arange(n) % levels
    half = (k + 0.5).astype(np.float32)
    if q.scaling is Scaling.ABSMAX:
        half = np.where(np.arange(n) % 2 == 0, half, -half)
    half[::q.chunk] = levels
    cases["midpoints"] = (half * np.float32(0.37)).astype(np.float32)
    cases["constant"] = np.full(n, 3.7, np.float32)
    cases["zeros"] = np.zeros(n, np.float32)
    cases["negative zeros"] = np.full(n, -0.0, np.float32)
    cases["one spike"] = np.where(np.arange(n) == 7, 1e6, 1e-3).astype(np.float32)
    cases["subnormal"] = (rng.integers(-300, 300, n) * TINY).astype(np.float32)
    cases["smallest"] = (rng.integers(-2, 3, n) * TINY).astype(np.float32)
    cases["near the limit"] = (rng.uniform(-1, 1, n) * MAX_MAGNITUDE).astype(np.float32)
    limit = np.float32(MAX_MAGNITUDE)
    cases["at the limit"] = np.where(np.arange(n) % 2 == 0, limit, -limit).astype(np.float32)
    cases["limit and tiny"] = np.where(np.arange(n) % 3 == 0, limit, TINY).astype(np.float32)
    cases["empty"] = np.zeros(0, np.float32)
    cases["one"] = np.array([-2.5], np.float32)
    return cases


@pytest.mark.parametrize("q", FORMATS, ids=FORMAT_IDS)
def test_round_trip_is_within_the_error_bound(q: Quantization) -> None:
    for name, x in _inputs(q).items():
        try:
            _check_bound(x, q)
        except AssertionError as exc:
            raise AssertionError(f"input {name!r}: {exc}") from None


@pytest.mark.parametrize("q", FORMATS, ids=FORMAT_IDS)
def test_the_bound_is_about_half_a_step(q: Quantization) -> None:
    """The bound is not loose: random data reaches most of it, and it is about half the
    step, the quantization error itself (chunks of 2 hold only their own extremes,
    which MINMAX represents almost exactly: not this test's case)."""
    if q.chunk == 2:
        q = Quantization(q.bits, q.scaling, 16)
    x = np.random.default_rng(1).standard_normal(50 * q.chunk).astype(np.float32)
    error = np.abs(_round_trip(x, q).astype(np.float64) - x)
    assert (error / error_bound(x, q)).max() > 0.8


@pytest.mark.parametrize("q", FORMATS, ids=FORMAT_IDS)
def test_zero_chunks_round_trip_exactly_and_constant_chunks_under_minmax(
        q: Quantization) -> None:
    zeros = np.zeros(3 * q.chunk + 1, np.float32)
    assert np.array_equal(_round_trip(zeros, q), zeros)
    for value in (3.7, -1e-40, 1e30, -MAX_MAGNITUDE):
        constant = np.full(2 * q.chunk + 1, value, np.float32)
        y = _round_trip(constant, q)
        if q.scaling is Scaling.MINMAX:
            assert np.array_equal(y, constant), value
        else:
            _check_bound(constant, q)


def test_hand_computed_int8_absmax_codes() -> None:
    """max|x| = 127, so the scale is exactly 1; halves round to even; codes are stored
    as code + 128."""
    q = Quantization(8, "absmax", 8)
    x = np.array([-127, 0, 2.5, 3.5, 127, -0.5, 0.5, 1.5], np.float32)
    buf = quantize(x, q)
    assert buf[:8].tolist() == [1, 128, 130, 132, 255, 128, 128, 130]
    assert buf[8:].tobytes() == np.array([1.0], "<f4").tobytes()
    assert dequantize(buf, 8, q).tolist() == [-127, 0, 2, 4, 127, 0, 0, 2]


def test_hand_computed_int4_minmax_codes_odd_length() -> None:
    """lo 0, hi 15: scale 1; two codes per byte, the first in the low nibble; the odd
    last code is padded with a 0 nibble; then the scale and the offset."""
    q = Quantization(4, "minmax", 6)
    x = np.array([0, 15, 7.5, 8.5, 1.5], np.float32)
    buf = quantize(x, q)
    assert q.wire_bytes(5) == 3 + 8 == buf.size
    assert buf[:3].tolist() == [0x0 | 0xF << 4, 0x8 | 0x8 << 4, 0x2]
    assert buf[3:].tobytes() == np.array([1.0, 0.0], "<f4").tobytes()
    assert dequantize(buf, 5, q).tolist() == [0, 15, 8, 8, 2]


def test_hand_computed_int4_absmax_and_int8_minmax_with_two_chunks() -> None:
    q = Quantization(4, "absmax", 2)
    x = np.array([7, -3.5, 0, 0, -14, 1], np.float32)  # scales 1, 0, 2
    buf = quantize(x, q)
    codes = [7, -4, 0, 0, -7, 0]  # -3.5 -> -4 (even); 1/2 = 0.5 -> 0 (even)
    stored = [c + 8 for c in codes]
    assert buf[:3].tolist() == [stored[0] | stored[1] << 4, stored[2] | stored[3] << 4,
                                stored[4] | stored[5] << 4]
    assert buf[3:].view("<f4").tolist() == [1.0, 0.0, 2.0]
    assert dequantize(buf, 6, q).tolist() == [7, -4, 0, 0, -14, 0]

    q8 = Quantization(8, "minmax", 2)
    y = np.array([10, 265, 5, 5, -1], np.float32)  # ranges 255 (scale 1), 0, one element
    buf8 = quantize(y, q8)
    assert buf8[:5].tolist() == [0, 255, 0, 0, 0]
    assert buf8[5:].view("<f4").tolist() == [1.0, 0.0, 0.0, 10.0, 5.0, -1.0]
    assert dequantize(buf8, 5, q8).tolist() == [10, 265, 5, 5, -1]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 1023, 1025])
def test_int4_packs_any_length(n: int) -> None:
    q = Quantization(4, "minmax", 8)
    x = (np.arange(n) % 16).astype(np.float32)
    x[0] = 0
    buf = quantize(x, q)
    assert buf.size == (n + 1) // 2 + 8 * -(-n // 8)
    if n % 2:
        assert buf[n // 2] >> 4 == 0  # the pad nibble
    _check_bound(x, q)


@pytest.mark.parametrize("q", FORMATS, ids=FORMAT_IDS)
def test_wire_bytes(q: Quantization) -> None:
    per_chunk = 4 if q.scaling is Scaling.ABSMAX else 8
    for n in (0, 1, 2, q.chunk - 1, q.chunk, q.chunk + 1, 10 * q.chunk + 5):
        codes = n if q.bits == 8 else (n + 1) // 2
        assert q.wire_bytes(n) == codes + per_chunk * -(-n // q.chunk)
        assert quantize(np.ones(n, np.float32), q).size == q.wire_bytes(n)
    # ~1/4 (int8) or ~1/8 (int4) of float32 for large n
    ratio = q.wire_bytes(1 << 20) / (4 << 20)
    assert ratio == pytest.approx(q.bits / 32 + per_chunk / (4 * q.chunk))


@pytest.mark.parametrize("q", FORMATS[:4], ids=FORMAT_IDS[:4])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 2.0 ** 127, -3e38])
def test_values_it_cannot_represent_raise(q: Quantization, bad: float) -> None:
    x = np.zeros(100, np.float32)
    x[37] = bad
    with pytest.raises(QuantizationError, match="element 37 of 100"):
        quantize(x, q)
    with pytest.raises(QuantizationError, match="element 37"):
        error_bound(x, q)


def test_arguments_are_checked() -> None:
    q = Quantization()
    with pytest.raises(TypeError, match="float32"):
        quantize(np.zeros(4), q)
    with pytest.raises(ValueError, match="1-D"):
        quantize(np.zeros((2, 2), np.float32), q)
    buf = quantize(np.ones(10, np.float32), q)
    with pytest.raises(ValueError, match="take 18 bytes, the buffer holds 17"):
        dequantize(buf[:-1], 10, q)
    with pytest.raises(ValueError, match="out must be"):
        dequantize(buf, 10, q, out=np.empty(9, np.float32))
    out = np.empty(10, np.float32)
    assert dequantize(buf, 10, q, out=out) is out and (out == 1).all()


@pytest.mark.parametrize("fields, match", [
    ({"bits": 16}, "bits must be 8 or 4, got 16"),
    ({"bits": True}, "got True"),
    ({"scaling": "log"}, "'log'"),
    ({"scaling": 3}, "got 3"),
    ({"chunk": 7}, "got 7"),
    ({"chunk": 0}, "got 0"),
    ({"chunk": 1.5}, "got 1.5"),
])
def test_bad_quantization_is_a_config_error(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Quantization(**fields)  # type: ignore[arg-type]


def test_parse_and_str() -> None:
    assert Quantization.parse("int8") == Quantization(8)
    assert Quantization.parse("int4") == Quantization(4)
    assert Quantization.parse("int8:absmax") == Quantization(8, Scaling.ABSMAX)
    assert Quantization.parse("int4:minmax:256") == Quantization(4, Scaling.MINMAX, 256)
    assert Quantization.parse(" INT4:AbsMax:8 ") == Quantization(4, "absmax", 8)
    assert Quantization(8, "absmax").scaling is Scaling.ABSMAX
    for q in FORMATS:
        assert Quantization.parse(str(q)) == q
    for junk in ("", "int16", "int8:", "int8:log", "int8:minmax:x", "int8:minmax:7",
                 "int8:minmax:256:1", "fp8", "int8:256"):
        with pytest.raises(ConfigError, match="quantization|chunk"):
            Quantization.parse(junk)


def test_poisoned_buffers_are_told_apart() -> None:
    q = Quantization(4, "absmax", 4)
    assert is_poisoned(poisoned_buffer(9, q), 9, q)
    assert not is_poisoned(quantize(np.ones(9, np.float32), q), 9, q)
    assert np.isnan(dequantize(poisoned_buffer(9, q), 9, q)).all()


# --------------------------------------------------------------------------- feedback


def test_error_feedback_loses_no_mass() -> None:
    """sum(applied) + residual == sum(inputs), up to the float32 rounding of the sums."""
    q = Quantization(4, "absmax", 32)
    feedback = ErrorFeedback()
    rng = np.random.default_rng(2)
    raw = np.zeros(1000)
    applied = np.zeros(1000)
    for _ in range(50):
        g = rng.standard_normal(1000).astype(np.float32)
        sent = feedback.compensate("w", g)
        decoded = dequantize(quantize(sent, q), sent.size, q)
        feedback.record("w", sent, decoded)
        raw += g
        applied += decoded
    residual = feedback.residual("w")
    assert residual is not None
    assert np.abs(applied + residual - raw).max() < 1e-4
    assert np.abs(residual).max() <= error_bound(sent, q).max()  # one step's error left


def test_error_feedback_keys_shapes_and_state() -> None:
    feedback = ErrorFeedback()
    x = np.arange(6, dtype=np.float32)
    first = feedback.compensate("a", x)
    assert first is not x and np.array_equal(first, x)  # a copy, never the input
    feedback.record("a", x, x - 0.5)
    assert np.array_equal(feedback.compensate("a", x), x + 0.5)
    assert feedback.keys() == ["a"] and "a" in feedback
    with pytest.raises(ConfigError, match=r"'a'.*\(6,\).*\(2, 3\)"):
        feedback.compensate("a", x.reshape(2, 3))
    with pytest.raises(ConfigError, match=r"'a'.*\(6,\).*\(5,\)"):
        feedback.record("a", x[:5], x[:5])
    state = feedback.state_dict()
    state["a"][0] = 99  # a copy
    restored = ErrorFeedback()
    restored.load_state_dict(feedback.state_dict())
    assert np.array_equal(restored.residual("a"), np.full(6, 0.5, np.float32))
    restored.reset("a")
    assert restored.residual("a") is None and restored.keys() == []
