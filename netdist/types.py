"""PURE: reduction operators and the table of dtypes netdist carries on the wire.

The dtype table is the single source of truth for which element types may cross the
network or land in a checkpoint; the wire codec, collectives and checkpoint all use it.

bfloat16 always crosses the wire (wire name ``"bfloat16"``, 2 bytes, the upper half of a
float32). Where ``ml_dtypes`` is installed it is ``ml_dtypes.bfloat16`` and appears in
``WIRE_DTYPES``, the table of dtypes NumPy programs can compute with. Without it, netdist
carries it as ``BFLOAT16_RAW``, a 2-byte structured dtype that holds the raw bits (torch
bfloat16 tensors arrive this way through ``netdist.tensors``); ``CARRIED_DTYPES`` is
``WIRE_DTYPES`` plus that fallback, and is what the wire codec accepts. Either way netdist's
reductions compute bfloat16 as torch's CPU kernels do: each operand widened to float32,
one float32 operation, the result rounded back to bfloat16 to nearest even
(``netdist.bfloat16``), so every pairwise step rounds, and with or without ``ml_dtypes``
the bits are the same. The kernels that reduce arrays are ``netdist.reduce_kernels``.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

__all__ = [
    "ReduceOp",
    "WIRE_DTYPES",
    "dtype_to_wire",
    "dtype_from_wire",
    "check_reduce_dtype",
    "BFLOAT16_RAW",
    "BFLOAT16",
    "CARRIED_DTYPES",
    "BF16_EXTRA_HINT",
    "is_bfloat16",
]


class ReduceOp(enum.Enum):
    """How values from different ranks are combined."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    BAND = "band"
    """Bitwise and (logical and for bool); integer and bool dtypes only."""
    BOR = "bor"
    """Bitwise or (logical or for bool); integer and bool dtypes only."""
    BXOR = "bxor"
    """Bitwise exclusive or (logical xor for bool); integer and bool dtypes only."""

    @property
    def is_bitwise(self) -> bool:
        """True for BAND, BOR and BXOR, which are defined for integers and bool only."""
        return self in _BITWISE_OPS


_BITWISE_OPS = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


def check_reduce_dtype(op: ReduceOp, dtype: np.dtype[Any], what: str,
                       name: str | None = None) -> None:
    """Raise ``TypeError`` when ``op`` is undefined for ``dtype``.

    MEAN needs a number: floating (bfloat16 included) or integer, where it is NCCL's
    average (the wrapped sum divided with truncation toward zero, see
    ``netdist.reduce_kernels``); bool has no mean (nor has NCCL). The bitwise ops need
    an integer or bool dtype. ``name`` is the op as the caller spelled it, for the
    message (torch's ``AVG`` for ``MEAN``); ``op.name`` by default.
    """
    said = op.name if name is None else name
    if op is ReduceOp.MEAN and dtype.kind not in "iuf" and not is_bfloat16(dtype):
        raise TypeError(f"{what} {said} needs a floating or integer dtype, got {dtype.name} "
                        "(a mean of booleans is undefined: reduce them as integers, "
                        "or with BOR/BAND)")
    if op in _BITWISE_OPS and dtype.kind not in "iub":
        raise TypeError(f"{what} {said} needs an integer or bool dtype, got {dtype.name}")


def _bfloat16() -> np.dtype[Any] | None:
    try:
        import ml_dtypes  # optional extra: netdist[bf16]
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def _build_wire_dtypes() -> dict[str, np.dtype[Any]]:
    names = [
        "bool", "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64",
    ]
    table = {name: np.dtype(name).newbyteorder("<") if np.dtype(name).itemsize > 1
             else np.dtype(name) for name in names}
    bf16 = _bfloat16()
    if bf16 is not None:
        table["bfloat16"] = bf16
    return table


WIRE_DTYPES: dict[str, np.dtype[Any]] = _build_wire_dtypes()
"""Wire name -> little-endian NumPy dtype. bfloat16 is present only with ml_dtypes."""

BFLOAT16_RAW: np.dtype[Any] = np.dtype([("bfloat16", "<u2")])
"""bfloat16 as raw bits, where ``ml_dtypes`` is missing: a structured dtype with one
little-endian ``uint16`` field, so it can never be mistaken for ``uint16`` data and NumPy
refuses arithmetic on it (netdist's reductions handle it, see ``reduce_into``)."""

BFLOAT16: np.dtype[Any] = WIRE_DTYPES.get("bfloat16", BFLOAT16_RAW)
"""The dtype bfloat16 data has in this process: ``ml_dtypes.bfloat16`` if installed,
else ``BFLOAT16_RAW``."""

CARRIED_DTYPES: dict[str, np.dtype[Any]] = {**WIRE_DTYPES, "bfloat16": BFLOAT16}
"""Wire name -> dtype of every element type netdist carries: ``WIRE_DTYPES`` plus
bfloat16 (as ``BFLOAT16``). The wire codec and the collectives accept these."""

BF16_EXTRA_HINT = "pip install 'netdist[bf16]'"
"""How to get a NumPy bfloat16 type (ml_dtypes)."""


def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """True for ``ml_dtypes.bfloat16`` and for ``BFLOAT16_RAW``."""
    return dtype.kind == "V" and (dtype.name == "bfloat16" or dtype == BFLOAT16_RAW)


def dtype_to_wire(dtype: np.dtype[Any] | type | str) -> str:
    """Return the wire name of ``dtype``; ``TypeError`` if netdist cannot carry it.

    ``"bfloat16"`` (the string) and ``BFLOAT16_RAW`` name bfloat16 even without
    ``ml_dtypes``.
    """
    if isinstance(dtype, str) and dtype == "bfloat16":
        return "bfloat16"
    dt = np.dtype(dtype)
    name = dt.name  # independent of byte order: np.dtype(">f4").name == "float32"
    if name not in WIRE_DTYPES:
        if dt == BFLOAT16_RAW:
            return "bfloat16"
        supported = ", ".join(CARRIED_DTYPES)
        raise TypeError(f"dtype {dt} is not supported on the wire (supported: {supported})")
    return name


def dtype_from_wire(name: str) -> np.dtype[Any]:
    """Return the little-endian dtype for a wire name; ``KeyError`` if unknown.

    ``"bfloat16"`` gives ``BFLOAT16`` (``BFLOAT16_RAW`` without ``ml_dtypes``).
    """
    return CARRIED_DTYPES[name]
