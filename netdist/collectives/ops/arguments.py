"""Argument checks shared by the collective families: reduce ops, arrays, tensors, timeouts.

Every check raises before the call takes a tag, so a wrong argument on one rank leaves
the group's tag streams in step (the other ranks then time out naming the missing rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from netdist.tensors import StagedOut, as_array, stage_out
from netdist.types import CARRIED_DTYPES, ReduceOp, dtype_to_wire

__all__ = [
    "WIRE_DTYPES",
    "check_array",
    "contiguous",
    "in_place",
    "reduce_op",
    "subgroup_ranks",
    "tensor_io",
    "timeout_value",
]

WIRE_DTYPES = frozenset(CARRIED_DTYPES.values())
"""The dtypes that travel as they are (native byte order)."""


def reduce_op(op: ReduceOp | str) -> ReduceOp:
    """``op`` as a ``ReduceOp`` (a name in any case is accepted); ``ValueError`` otherwise."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            pass
    names = ", ".join(o.name for o in ReduceOp)
    raise ValueError(f"unknown reduce op {op!r} (expected one of {names})")


def check_array(array: Any, what: str, *, writeable: bool = False) -> np.ndarray:
    """``array`` if it is an ndarray of a dtype the wire carries (and writeable when
    asked); ``TypeError`` / ``ValueError`` naming ``what`` otherwise."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what} needs a numpy.ndarray, got {type(array).__name__}")
    if array.dtype not in WIRE_DTYPES:  # fast path: a set lookup, no name strings
        name = dtype_to_wire(array.dtype)  # raises TypeError for unsupported dtypes
        raise TypeError(f"{what}: dtype {array.dtype.str} is big-endian; pass "
                        f"array.astype('{CARRIED_DTYPES[name].str}')")
    if writeable and not array.flags.writeable:
        raise ValueError(f"{what} works in place but the array is read-only")
    return array


def tensor_io(array: Any, out: Any, what: str
              ) -> tuple[np.ndarray, bool, np.ndarray | None, StagedOut | None]:
    """``(array, wrap, out, staged)``: NumPy views of a tensor input (``wrap``: return a
    tensor) and of a tensor ``out=`` (``staged`` copies a non-contiguous one back)."""
    wrap = False
    if not isinstance(array, np.ndarray):
        array, wrap = as_array(array, what), True
    staged = None
    if out is not None and not isinstance(out, np.ndarray):
        staged = stage_out(out, f"{what} out=")
        out = staged.array
    return array, wrap, out, staged


def in_place(array: Any, what: str, writeable: bool) -> tuple[Any, np.ndarray]:
    """``(tensor, array)`` for a collective that works in place: a tensor input and its
    NumPy view (``tensor`` None for a NumPy input), checked for a wire dtype."""
    tensor = None
    if not isinstance(array, np.ndarray):
        tensor, array = array, as_array(array, what, writeable=writeable)
    return tensor, check_array(array, what, writeable=writeable)


def contiguous(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(work, flat)``: a C-contiguous working array and its 1-D view."""
    work = array if array.flags.c_contiguous else np.ascontiguousarray(array)
    return work, work.reshape(-1)


def timeout_value(timeout: float | None, what: str) -> float | None:
    """``timeout`` as a float (``None`` stays ``None``); ``ValueError`` unless > 0."""
    if timeout is None:
        return None
    if not timeout > 0:
        raise ValueError(f"{what} must be > 0 seconds, got {timeout}")
    return float(timeout)


def subgroup_ranks(ranks: Sequence[int], world_size: int) -> list[int]:
    """``new_group``'s ``ranks`` as a list of distinct group ranks of a group of
    ``world_size``; ``TypeError`` / ``ValueError`` naming what is wrong."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"new_group needs a sequence of ranks, got {type(ranks).__name__}")
    members = []
    for r in ranks:
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool):
            raise TypeError(f"new_group ranks must be ints, got {r!r}")
        if not 0 <= r < world_size:
            raise ValueError(f"new_group: rank {r} is outside 0..{world_size - 1}")
        members.append(int(r))
    if not members:
        raise ValueError("new_group needs at least one rank")
    if len(set(members)) != len(members):
        dups = sorted({r for r in members if members.count(r) > 1})
        raise ValueError(f"new_group: duplicate ranks {dups} in {members}")
    return members
