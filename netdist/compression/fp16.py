"""PURE float16 cast compression (Horovod's ``Compression.fp16``), saturating, with
optional pre-scaling and error feedback.

Half precision halves the bytes of float32 gradients (quarters float64). Values beyond
float16's range (+-65504) saturate to +-65504 instead of becoming infinities, and an
optional ``scale`` is applied before the cast -- an all-reduce of ``n`` ranks passes
``1/n`` so the float16 *sum* is already the mean and cannot overflow where the mean
would not. NaN stays NaN.

With ``error_feedback=True`` the rounding error of each step (what float16 could not
represent) is carried into the next step, as for top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from netdist.tensors import as_array, is_tensor
from netdist.bfloat16 import bfloat16_to_float32
from netdist.types import is_bfloat16

__all__ = ["FP16_MAX", "cast_to_fp16", "Fp16Compressor", "float_input"]


def float_input(array: Any, what: str) -> np.ndarray:
    """``array`` as compression reads it: a CPU torch tensor through a NumPy view of its
    memory, bfloat16 (torch's or ``ml_dtypes``') widened exactly to a float32 copy,
    anything else through ``np.asarray``."""
    if not isinstance(array, np.ndarray) and is_tensor(array):
        array = as_array(array, what)
    array = np.asarray(array)
    if array.dtype.kind == "V" and is_bfloat16(array.dtype):
        return bfloat16_to_float32(np.ascontiguousarray(array))
    return array

FP16_MAX = float(np.finfo(np.float16).max)  # 65504.0


def cast_to_fp16(array: np.ndarray, *, scale: float = 1.0,
                 out: np.ndarray | None = None) -> np.ndarray:
    """``array * scale`` rounded to float16, saturating at +-65504; into ``out`` if given.

    ``array`` may be a CPU torch tensor (read through a view of its memory) and may be
    bfloat16 (widened to float32 exactly, then scaled and rounded once).
    """
    array = float_input(array, "cast_to_fp16")
    if array.dtype.kind != "f":
        raise TypeError(f"fp16 compression needs a floating array, got {array.dtype}")
    if out is None:
        out = np.empty(array.shape, dtype=np.float16)
    elif out.dtype != np.float16 or out.size != array.size:
        raise ValueError(f"out must be float16 with {array.size} elements, "
                         f"got {out.dtype}[{out.size}]")
    target = out.reshape(array.shape)
    with np.errstate(over="ignore"):
        if scale == 1.0:
            np.copyto(target, array, casting="same_kind")
        else:
            np.multiply(array, scale, out=target, casting="same_kind")
    np.clip(target, -FP16_MAX, FP16_MAX, out=target)
    return out


class Fp16Compressor:
    """Cast gradients to float16 for the wire and back to their own dtype afterwards."""

    def __init__(self, error_feedback: bool = False) -> None:
        self.error_feedback = bool(error_feedback)
        self.residuals: list[np.ndarray] = []

    def reset(self) -> None:
        """Forget carried rounding errors."""
        self.residuals = []

    def compress(self, grads: Sequence[np.ndarray], *, scale: float = 1.0) -> list[np.ndarray]:
        """float16 copies of ``grads * scale`` (plus the carried error, if enabled).

        Gradients may be CPU torch tensors; bfloat16 ones are widened to float32 first
        (so are their residuals)."""
        arrays = [float_input(g, f"gradient {i}") for i, g in enumerate(grads)]
        if not self.error_feedback:
            return [cast_to_fp16(g, scale=scale) for g in arrays]
        if not self.residuals:
            self.residuals = [np.zeros(g.shape, dtype=g.dtype) for g in arrays]
        elif len(self.residuals) != len(arrays) or any(
                r.shape != g.shape for r, g in zip(self.residuals, arrays)):
            raise ValueError("gradient layout changed; call reset() first")
        out = []
        for g, r in zip(arrays, self.residuals):
            r += g * scale if scale != 1.0 else g
            half = cast_to_fp16(r)
            r -= half
            out.append(half)
        return out

    @staticmethod
    def decompress(compressed: Sequence[np.ndarray], dtypes: Sequence[Any],
                   *, scale: float = 1.0) -> list[np.ndarray]:
        """Cast each float16 array back to its dtype, multiplied by ``scale``."""
        if len(compressed) != len(dtypes):
            raise ValueError(f"{len(compressed)} arrays but {len(dtypes)} dtypes")
        out = []
        for half, dt in zip(compressed, dtypes):
            full = np.asarray(half).astype(np.dtype(dt))
            if scale != 1.0:
                full *= scale
            out.append(full)
        return out
