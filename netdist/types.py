"""Reduction operators and the table of dtypes netdist carries on the wire.

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
(``float32_to_bfloat16``), so every pairwise step rounds, and with or without
``ml_dtypes`` the bits are the same.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "thread_safe",
    "THREAD_SAFE_ATTRIBUTE",
    "EAGER_ATTRIBUTE",
    "eager_start",
    "ReduceOp",
    "WIRE_DTYPES",
    "dtype_to_wire",
    "dtype_from_wire",
    "reduce_into",
    "combine",
    "divide_into",
    "check_reduce_dtype",
    "BFLOAT16_RAW",
    "BFLOAT16",
    "CARRIED_DTYPES",
    "BF16_EXTRA_HINT",
    "is_bfloat16",
    "bfloat16_to_float32",
    "float32_to_bfloat16",
    "widen_bfloat16",
    "cast_into",
    "scaled",
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
    if op is ReduceOp.MEAN and dtype.kind != "f" and not is_bfloat16(dtype):
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
    and one rounding, as torch divides a bfloat16 tensor by a number."""
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


THREAD_SAFE_ATTRIBUTE = "__netdist_thread_safe__"
"""Set on methods that may be called from any thread (see ``thread_safe``)."""

EAGER_ATTRIBUTE = "__netdist_eager__"
"""Set on coroutine methods that have an eager companion (see ``eager_start``)."""

_F = TypeVar("_F", bound=Callable[..., Any])


def thread_safe(fn: _F) -> _F:
    """Mark a plain method as safe to call from any thread.

    Such a method hands its work to the event loop itself (``call_soon_threadsafe``), so
    the blocking API's proxies (``netdist.progress``) call it directly from the caller's
    thread instead of making a round trip to the progress thread.
    """
    setattr(fn, THREAD_SAFE_ATTRIBUTE, True)
    return fn


def eager_start(companion: str) -> Callable[[_F], _F]:
    """Mark a coroutine method whose blocking calls may start on the caller's thread.

    ``companion`` names a plain method of the same object taking the same arguments,
    which the blocking API (``netdist.progress``) calls first, holding the event loop
    (``ProgressThread.try_call``): it returns ``None`` having done nothing (the coroutine
    then runs as usual) or an ``EagerStart`` (``netdist.collectives.work``), the call
    begun, and possibly finished, without an event-loop iteration.
    """
    def mark(fn: _F) -> _F:
        setattr(fn, EAGER_ATTRIBUTE, companion)
        return fn

    return mark
