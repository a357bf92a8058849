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
]


class ReduceOp(enum.Enum):
    """How values from different ranks are combined."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PROD = "prod"


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
}


def reduce_into(op: ReduceOp, acc: np.ndarray, incoming: np.ndarray) -> None:
    """Combine ``incoming`` into ``acc`` in place (``acc = acc (op) incoming``).

    For ``bool`` arrays SUM/MEAN/PROD become logical or/or/and, as NumPy defines them.
    MEAN accumulates a sum; divide by the group size once all contributions are in.
    """
    if acc.shape != incoming.shape:
        raise ValueError(f"cannot reduce shape {incoming.shape} into shape {acc.shape}")
    _BINARY_UFUNC[op](acc, incoming, out=acc)


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
