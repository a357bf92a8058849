"""Reduction operators and the table of dtypes netdist carries on the wire.

The dtype table is the single source of truth for which element types may cross the
network or land in a checkpoint; the wire codec, collectives and checkpoint all use it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "thread_safe",
    "THREAD_SAFE_ATTRIBUTE",
    "ReduceOp",
    "WIRE_DTYPES",
    "dtype_to_wire",
    "dtype_from_wire",
    "reduce_into",
    "combine",
    "check_reduce_dtype",
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


def check_reduce_dtype(op: ReduceOp, dtype: np.dtype[Any], what: str) -> None:
    """Raise ``TypeError`` when ``op`` is undefined for ``dtype``.

    MEAN needs a floating dtype (an integer mean would silently truncate); the bitwise
    ops need an integer or bool dtype.
    """
    if op is ReduceOp.MEAN and dtype.kind != "f" and dtype.name != "bfloat16":
        raise TypeError(f"{what} MEAN needs a floating dtype, got {dtype.name} "
                        "(reduce with SUM and divide as you see fit)")
    if op in _BITWISE_OPS and dtype.kind not in "iub":
        raise TypeError(f"{what} {op.name} needs an integer or bool dtype, got {dtype.name}")


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

def dtype_to_wire(dtype: np.dtype[Any] | type | str) -> str:
    """Return the wire name of ``dtype``; ``TypeError`` if netdist cannot carry it."""
    dt = np.dtype(dtype)
    name = dt.name  # independent of byte order: np.dtype(">f4").name == "float32"
    if name not in WIRE_DTYPES:
        supported = ", ".join(WIRE_DTYPES)
        raise TypeError(f"dtype {dt} is not supported on the wire (supported: {supported})")
    return name


def dtype_from_wire(name: str) -> np.dtype[Any]:
    """Return the little-endian dtype for a wire name; ``KeyError`` if unknown."""
    return WIRE_DTYPES[name]


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


def reduce_into(op: ReduceOp, acc: np.ndarray, incoming: np.ndarray) -> None:
    """Combine ``incoming`` into ``acc`` in place (``acc = acc (op) incoming``).

    For ``bool`` arrays SUM/MEAN/PROD become logical or/or/and, as NumPy defines them.
    MEAN accumulates a sum; divide by the group size once all contributions are in.
    """
    if acc.shape != incoming.shape:
        raise ValueError(f"cannot reduce shape {incoming.shape} into shape {acc.shape}")
    _BINARY_UFUNC[op](acc, incoming, out=acc)


def combine(op: ReduceOp, low: np.ndarray, high: np.ndarray, out: np.ndarray) -> None:
    """``out = low (op) high`` with a fixed operand order, so every rank gets equal bits."""
    _BINARY_UFUNC[op](low, high, out=out)


THREAD_SAFE_ATTRIBUTE = "__netdist_thread_safe__"
"""Set on methods that may be called from any thread (see ``thread_safe``)."""

_F = TypeVar("_F", bound=Callable[..., Any])


def thread_safe(fn: _F) -> _F:
    """Mark a plain method as safe to call from any thread.

    Such a method hands its work to the event loop itself (``call_soon_threadsafe``), so
    the blocking API's proxies (``netdist.progress``) call it directly from the caller's
    thread instead of making a round trip to the progress thread.
    """
    setattr(fn, THREAD_SAFE_ATTRIBUTE, True)
    return fn
