"""The element types a checkpoint stores, with or without ``ml_dtypes``.

A checkpoint stores every dtype of :data:`netdist.types.WIRE_DTYPES` plus ``bfloat16``
always: safetensors has its own ``BF16`` code, and moving bf16 bytes between a file and
memory needs no bf16 arithmetic. When ``ml_dtypes`` is installed, ``bfloat16`` arrays
are ``ml_dtypes.bfloat16`` arrays as before; without it, the checkpoint code carries
them as :data:`BF16_RAW` (a 2-byte structured dtype holding the raw bits), which
:mod:`netdist.checkpoint.torch_state` turns into ``torch.bfloat16`` tensors without a
copy. A reader that can represent bf16 neither way gets :func:`unrepresentable`, an
error naming the tensor and the dtype (never "corrupt": the file is fine).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from netdist.errors import CheckpointMismatchError
from netdist.types import BFLOAT16_RAW, CARRIED_DTYPES

__all__ = [
    "BF16_RAW",
    "CHECKPOINT_DTYPES",
    "dtype_name",
    "has_native_bfloat16",
    "is_raw_bfloat16",
    "unrepresentable",
]

BF16_RAW: np.dtype[Any] = BFLOAT16_RAW
"""Stand-in for bfloat16 when ``ml_dtypes`` is missing: the 16 raw bits per element
(``netdist.types.BFLOAT16_RAW``, the one the wire carries too)."""

CHECKPOINT_DTYPES: dict[str, np.dtype[Any]] = CARRIED_DTYPES
"""Dtype name -> the NumPy dtype checkpoint buffers of that name have (little-endian):
the dtypes netdist carries (``netdist.types.CARRIED_DTYPES``)."""


def has_native_bfloat16() -> bool:
    """True when bfloat16 arrays are real NumPy bf16 arrays (``ml_dtypes`` installed)."""
    return CHECKPOINT_DTYPES["bfloat16"] is not BF16_RAW


def is_raw_bfloat16(dtype: np.dtype[Any]) -> bool:
    """True for the raw-bits stand-in used when ``ml_dtypes`` is missing."""
    return dtype == BF16_RAW


def dtype_name(dtype: np.dtype[Any] | type | str) -> str:
    """The checkpoint name of ``dtype`` (``"float32"``, ``"bfloat16"``); ``TypeError`` for
    a dtype a checkpoint cannot store. A known name is accepted as it is, so a checkpoint
    naming ``"bfloat16"`` parses without ``ml_dtypes``."""
    if isinstance(dtype, str) and dtype in CHECKPOINT_DTYPES:
        return dtype
    if isinstance(dtype, np.dtype) and is_raw_bfloat16(dtype):
        return "bfloat16"
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype {dtype!r} is not supported in checkpoints (supported: "
                        f"{', '.join(CHECKPOINT_DTYPES)})") from None
    if is_raw_bfloat16(dt):
        return "bfloat16"
    name = dt.name  # independent of byte order
    if name not in CHECKPOINT_DTYPES:
        raise TypeError(f"dtype {dt} is not supported in checkpoints (supported: "
                        f"{', '.join(CHECKPOINT_DTYPES)})")
    return name


def unrepresentable(name: str, dtype: str) -> CheckpointMismatchError:
    """The error for a stored tensor this process has no type for (bf16 without
    ``ml_dtypes`` or torch): the file is intact, the reader lacks a package."""
    return CheckpointMismatchError(
        f"tensor {name!r} is stored as {dtype}, which this process cannot represent: "
        f"install ml_dtypes (pip install 'netdist[bf16]') for NumPy {dtype} arrays, or "
        f"torch to get torch.{dtype} tensors (the checkpoint itself is intact)")
