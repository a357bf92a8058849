"""PURE: bfloat16 arithmetic as torch's CPU kernels do it, with or without ``ml_dtypes``.

bfloat16 is the upper half of a float32, so widening is exact (``bfloat16_to_float32``)
and every operation is one float32 operation rounded back to nearest even
(``float32_to_bfloat16``, torch's ``round_to_nearest_even``). The arrays have dtype
``netdist.types.BFLOAT16`` (``ml_dtypes.bfloat16`` where installed) or ``BFLOAT16_RAW``
(the raw 16 bits), and the bits are the same for both.
"""

from __future__ import annotations

import numpy as np

from netdist.types import BFLOAT16, is_bfloat16

__all__ = ["bfloat16_to_float32", "cast_into", "float32_to_bfloat16", "scaled",
           "widen_bfloat16"]


def bfloat16_to_float32(array: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The float32 values of bfloat16 ``array`` (exact: bfloat16 is the upper half of a
    float32), in ``out`` (float32, same shape) or a new array. ``array`` has dtype
    ``BFLOAT16`` or ``BFLOAT16_RAW``."""
    bits = array.view(np.uint16)
    if out is None:
        out = np.empty(bits.shape, np.float32)
    np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def widen_bfloat16(array: np.ndarray) -> np.ndarray:
    """bfloat16 ``array`` as float32 (exact, a new array of the same shape); an array of
    any other dtype as it is."""
    return bfloat16_to_float32(array) if is_bfloat16(array.dtype) else array


def cast_into(target: np.ndarray, source: np.ndarray) -> None:
    """``target[...] = source`` across floating dtypes, as torch's ``copy_`` casts: into
    bfloat16 through float32, rounded to nearest even; out of bfloat16 exactly."""
    if is_bfloat16(target.dtype):
        float32_to_bfloat16(widen_bfloat16(source), out=target)
    else:
        np.copyto(target, widen_bfloat16(source), casting="same_kind")


def scaled(array: np.ndarray, factor: float, out: np.ndarray | None = None) -> np.ndarray:
    """``array * factor`` in ``array``'s dtype, into ``out`` (a new array when None; pass
    ``array`` itself to scale in place): bfloat16 through one float32 multiply, rounded
    to nearest even, as torch multiplies a bfloat16 tensor by a number."""
    if is_bfloat16(array.dtype):
        wide = bfloat16_to_float32(array)
        wide *= factor
        return float32_to_bfloat16(wide, out=np.empty(array.shape, array.dtype)
                                   if out is None else out)
    return np.multiply(array, factor, out=out)


_BF16_NAN = 0x7FC0  # the quiet NaN torch's bfloat16 kernels produce


def float32_to_bfloat16(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Round float32 ``values`` to bfloat16, to nearest even, as torch does.

    Exactly torch's ``round_to_nearest_even``: ``(bits + 0x7FFF + lsb) >> 16``; so
    subnormals stay subnormal, values beyond bfloat16's largest finite value round to
    infinity, and NaN stays NaN (always the quiet NaN ``0x7FC0``; torch's own NaN bits
    depend on which kernel ran, ``0x7FC0`` or ``0xFFFF``). Writes into ``out`` (a bfloat16
    array of the same size, ``BFLOAT16`` or ``BFLOAT16_RAW``) if given, else returns a
    new ``BFLOAT16`` array.
    """
    f32 = np.asarray(values, dtype=np.float32)
    u = f32.view(np.uint32)
    rounded = np.right_shift(u, 16)
    np.bitwise_and(rounded, 1, out=rounded)
    rounded += 0x7FFF
    rounded += u  # wraps only for negative NaNs, replaced below
    if out is None:
        out = np.empty(f32.shape, BFLOAT16)
    bits = out.view(np.uint16)
    if bits.shape != f32.shape:
        if not bits.flags.c_contiguous:  # reshaping would copy, and the result be lost
            raise ValueError(f"out= of shape {out.shape} must have the shape of the values "
                             f"{f32.shape} or be C-contiguous")
        bits = bits.reshape(f32.shape)
    np.right_shift(rounded, 16, out=bits, casting="unsafe")
    nan = np.isnan(f32)
    if nan.any():
        bits[nan] = _BF16_NAN
    return out
