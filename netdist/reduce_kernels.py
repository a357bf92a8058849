"""PURE: the kernels that reduce arrays, for every ``ReduceOp`` and wire dtype.

``reduce_into`` and ``combine`` combine two operands (``combine`` in a fixed operand
order, so every rank gets equal bits); ``divide_into`` is ``MEAN``'s final division.
bfloat16 goes through float32 and one rounding per step (``netdist.bfloat16``), block by
block so the float32 temporaries stay in cache; inf and NaN pass silently, as in torch.

``MEAN`` on integers is NCCL's ``ncclAvg``: the sum in the element type (wrapping around
on overflow, as ``SUM`` does), then one division by the group size in that type with C's
semantics: the quotient truncated toward zero for signed types (-7 / 2 = -3, where
NumPy's ``//`` would floor to -4), plain division for unsigned ones. Integer addition is
associative even when it wraps, so every route (and every rank) gets the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from netdist.bfloat16 import bfloat16_to_float32, float32_to_bfloat16
from netdist.types import ReduceOp

__all__ = ["combine", "divide_into", "reduce_into"]


_BINARY_UFUNC: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MEAN: np.add,  # MEAN sums, then the caller divides once at the end
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.PROD: np.multiply,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


_BF16_BLOCK = 16384
"""Elements per block of the bfloat16 kernels: their float32 temporaries stay in cache."""


def _bf16_binary(op: ReduceOp, low: np.ndarray, high: np.ndarray, out: np.ndarray) -> None:
    """``out = low (op) high`` for bfloat16 as torch computes it: float32, then rounded.

    Runs block by block over the flattened operands (same shape), so the float32
    temporaries stay in cache; ``out`` may be ``low`` or ``high``.
    """
    if not out.flags.c_contiguous:  # flattening would copy: compute, then copy in
        result = np.empty(out.shape, out.dtype)
        _bf16_binary(op, low, high, result)
        out[...] = result
        return
    ufunc = _BINARY_UFUNC[op]
    flat_low, flat_high, flat_out = low.reshape(-1), high.reshape(-1), out.reshape(-1)
    size = flat_out.size
    a = np.empty(min(size, _BF16_BLOCK), np.float32)
    b = np.empty_like(a)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN, silently, as torch
        for start in range(0, size, _BF16_BLOCK):
            stop = min(start + _BF16_BLOCK, size)
            wa, wb = a[:stop - start], b[:stop - start]
            bfloat16_to_float32(flat_low[start:stop], out=wa)
            bfloat16_to_float32(flat_high[start:stop], out=wb)
            ufunc(wa, wb, out=wa)
            float32_to_bfloat16(wa, out=flat_out[start:stop])


def reduce_into(op: ReduceOp, acc: np.ndarray, incoming: np.ndarray) -> None:
    """Combine ``incoming`` into ``acc`` in place (``acc = acc (op) incoming``).

    For ``bool`` arrays SUM/MEAN/PROD become logical or/or/and, as NumPy defines them.
    MEAN accumulates a sum; divide by the group size once all contributions are in.
    bfloat16 (either dtype) is combined in float32 and rounded back after every step.
    """
    if acc.shape != incoming.shape:
        raise ValueError(f"cannot reduce shape {incoming.shape} into shape {acc.shape}")
    if acc.dtype.kind == "V":  # the only wire dtype of kind V is bfloat16
        _bf16_binary(op, acc, incoming, acc)
        return
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN silently, as torch
        _BINARY_UFUNC[op](acc, incoming, out=acc)


def combine(op: ReduceOp, low: np.ndarray, high: np.ndarray, out: np.ndarray) -> None:
    """``out = low (op) high`` with a fixed operand order, so every rank gets equal bits."""
    if out.dtype.kind == "V":
        _bf16_binary(op, low, high, out)
        return
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN silently, as torch
        _BINARY_UFUNC[op](low, high, out=out)


def divide_into(array: np.ndarray, divisor: int) -> None:
    """``array /= divisor`` in place (``MEAN``'s final step); bfloat16 through float32
    and one rounding, as torch divides a bfloat16 tensor by a number; integers as C
    divides them (truncated toward zero, ``_divide_integers``), as NCCL's average does."""
    if array.dtype.kind in "iu":
        _divide_integers(array, divisor)
        return
    if array.dtype.kind == "V":
        if not array.flags.c_contiguous:  # flattening would copy: work on a copy
            work = np.ascontiguousarray(array)
            divide_into(work, divisor)
            array[...] = work
            return
        flat = array.reshape(-1)
        wide = np.empty(min(flat.size, _BF16_BLOCK), np.float32)
        with np.errstate(invalid="ignore"):  # a signalling NaN divides quietly, as in torch
            for start in range(0, flat.size, _BF16_BLOCK):
                stop = min(start + _BF16_BLOCK, flat.size)
                w = bfloat16_to_float32(flat[start:stop], out=wide[:stop - start])
                np.divide(w, divisor, out=w)
                float32_to_bfloat16(w, out=flat[start:stop])
        return
    np.divide(array, divisor, out=array)


def _divide_integers(array: np.ndarray, divisor: int) -> None:
    """``array = trunc(array / divisor)`` in place, exactly, in the array's own type.

    NumPy's ``//`` floors, so for a signed type the floored quotient is raised by one
    where the division left a remainder and the quotient is negative (the quotient is
    negative exactly where the dividend is). Neither step can overflow, not even for the
    type's most negative value (``divisor`` is at least 1). A divisor the type cannot
    hold (an int8 mean over 200 ranks) divides in int64: the quotient's magnitude is
    then at most 1, so it fits back.
    """
    if divisor < 1:
        raise ValueError(f"divide_into: divisor {divisor} must be at least 1")
    if divisor == 1:
        return
    if divisor > np.iinfo(array.dtype).max:
        wide = array.astype(np.int64)
        _divide_integers(wide, divisor)
        array[...] = wide
        return
    d = array.dtype.type(divisor)
    if array.dtype.kind == "u":
        np.floor_divide(array, d, out=array)
        return
    inexact = np.remainder(array, d) != 0
    np.floor_divide(array, d, out=array)
    inexact &= array < 0
    np.add(array, array.dtype.type(1), out=array, where=inexact)
