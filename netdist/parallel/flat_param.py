"""PURE flat-parameter arithmetic for FSDP: wrap units, flat layouts and shard ownership.

FSDP flattens the parameters of each *unit* (a run of consecutive layers) into one 1-D
buffer, pads it to a multiple of the shard-group size ``S`` and gives shard ``k`` the
contiguous slice ``[k * s, (k + 1) * s)`` with ``s = padded / S``. Padding sits at the end
of the buffer and is always zero, so no size has to divide evenly and every shard has the
same length (which is also what ``chunk_bounds(padded, S)`` -- the reduce-scatter and
all-gather split rule -- gives for a padded buffer)::

    params   | w0 (6) | b0 (3) | w1 (4) |            numel = 13, S = 4
    flat     |0 ....................12|pad pad pad|  padded = 16, s = 4
    shards   |  k=0   |  k=1   |  k=2   |  k=3   |   k=3 holds 1 real element, 3 padding

Everything here is a pure function of shapes: every rank builds the same layout, which is
what lets the ranks issue their collectives in the same order. Nothing here imports
``asyncio`` or ``socket``.

dtypes: a layout names its dtype by its wire name (``"float32"``, ``"bfloat16"``, ...);
``np_dtype`` is the NumPy dtype of its buffers. bfloat16 needs no extra package: its
buffers are ``netdist.types.BFLOAT16`` (``ml_dtypes.bfloat16``, or the raw bits without
it), and ``flatten`` takes CPU torch tensors (``netdist.tensors``) as well as arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.sharding import FlatSlot, chunk_bounds, flat_slots, padded_size
from netdist.tensors import as_array, is_tensor
from netdist.types import BFLOAT16, is_bfloat16

__all__ = [
    "layout_dtype",
    "dtype_name",
    "ParamSlot",
    "ShardPiece",
    "FlatParamLayout",
    "plan_units",
]


def _check_int(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


def layout_dtype(dtype: Any) -> np.dtype[Any]:
    """The NumPy dtype of flat buffers for ``dtype`` (a dtype or a layout's dtype name):
    any bfloat16 (``"bfloat16"``, ``ml_dtypes.bfloat16``, ``BFLOAT16_RAW``) is
    ``BFLOAT16``, whether ``ml_dtypes`` is installed or not."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return BFLOAT16
    dt = np.dtype(dtype)
    return BFLOAT16 if is_bfloat16(dt) else dt


def dtype_name(dtype: Any) -> str:
    """The name a layout records for ``dtype``: ``"bfloat16"`` for any bfloat16, else
    NumPy's name."""
    dt = layout_dtype(dtype)
    return "bfloat16" if is_bfloat16(dt) else dt.name


def plan_units(param_counts: Sequence[int], min_params: int = 0) -> tuple[tuple[int, int], ...]:
    """Group consecutive layers into FSDP units by parameter count (the auto-wrap policy).

    ``param_counts[i]`` is the number of parameters of layer ``i``. Layers are added to
    the current unit until it holds at least ``min_params`` parameters; the next layer
    *with* parameters then starts a new unit. Parameter-free layers (activations) always
    ride along with the unit before them (leading ones with the first unit), so a unit
    never consists of activations only unless the whole model does. ``min_params <= 1``
    gives one unit per layer with parameters. Returns ``(start, stop)`` layer ranges
    covering ``0 .. len(param_counts)`` in order; an empty model gives no units.
    """
    counts = [_check_int(c, "param_counts entry", 0) for c in param_counts]
    threshold = _check_int(min_params, "min_params", 0)
    units: list[tuple[int, int]] = []
    start, held = 0, 0
    for index, count in enumerate(counts):
        if count > 0 and held > 0 and held >= threshold:
            units.append((start, index))
            start, held = index, 0
        held += count
    if counts:
        units.append((start, len(counts)))
    return tuple(units)


ParamSlot = FlatSlot
"""Where one parameter lives in its unit's flat buffer: ``flat[offset:offset+numel]``
(the shared flat layout's ``netdist.sharding.FlatSlot``)."""


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """The part of parameter ``slot`` that one shard holds.

    ``flat(param)[param_start:param_stop]`` (the parameter flattened in C order) sits at
    ``shard[shard_start : shard_start + (param_stop - param_start)]``.
    """

    slot: int
    param_start: int
    param_stop: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_stop - self.param_start


@dataclass(frozen=True, slots=True)
class FlatParamLayout:
    """The flat buffer of one unit: parameter slots, padding and the ``S`` equal shards."""

    slots: tuple[ParamSlot, ...]
    dtype: str
    num_shards: int
    numel: int
    padded_numel: int
    shard_numel: int

    @classmethod
    def build(cls, names: Sequence[str], shapes: Sequence[Sequence[int]], dtype: Any,
              num_shards: int) -> FlatParamLayout:
        """Lay out parameters ``names``/``shapes`` back to back, padded for ``num_shards``."""
        shards = _check_int(num_shards, "num_shards", 1)
        if len(names) != len(shapes):
            raise ValueError(f"{len(names)} names for {len(shapes)} shapes")
        dims = [tuple(_check_int(d, f"dimension of {name!r}", 0) for d in shape)
                for name, shape in zip(names, shapes)]
        slots = flat_slots(names, dims)
        numel = slots[-1].stop if slots else 0
        padded = padded_size(numel, shards)
        return cls(slots, dtype_name(dtype), shards, numel, padded, padded // shards)

    @property
    def np_dtype(self) -> np.dtype[Any]:
        """The dtype of this layout's buffers (``layout_dtype(self.dtype)``)."""
        return layout_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    @property
    def padding(self) -> int:
        """Zero elements appended so that ``num_shards`` divides the buffer."""
        return self.padded_numel - self.numel

    def shard_bounds(self, shard: int) -> tuple[int, int]:
        """``(start, stop)`` of shard ``shard`` in the padded flat buffer."""
        self._check_shard(shard)
        return chunk_bounds(self.padded_numel, self.num_shards)[shard]

    def valid_numel(self, shard: int) -> int:
        """Real (non-padding) elements in shard ``shard``: always a prefix of the shard."""
        start, stop = self.shard_bounds(shard)
        return max(0, min(stop, self.numel) - start)

    def pieces(self, shard: int) -> tuple[ShardPiece, ...]:
        """The parameter pieces shard ``shard`` holds, in flat order (padding excluded)."""
        start, stop = self.shard_bounds(shard)
        out = []
        for index, slot in enumerate(self.slots):
            lo, hi = slot.overlap(start, stop)
            if hi > lo:
                out.append(ShardPiece(index, lo, hi, slot.offset + lo - start))
        return tuple(out)

    def param_shard_sizes(self, slot: int) -> tuple[int, ...]:
        """How many elements of parameter ``slot`` each shard holds (sums to its numel).

        Shards are contiguous and in shard order, so these sizes describe the parameter,
        flattened, as a dim-0 sharded 1-D tensor (the checkpoint ``TensorShardSpec``).
        """
        if not 0 <= slot < len(self.slots):
            raise ValueError(f"slot {slot} is outside 0..{len(self.slots) - 1}")
        entry = self.slots[slot]
        bounds = chunk_bounds(self.padded_numel, self.num_shards)
        return tuple(hi - lo for lo, hi in (entry.overlap(start, stop) for start, stop in bounds))

    def flatten(self, arrays: Sequence[Any], out: np.ndarray | None = None) -> np.ndarray:
        """Copy ``arrays`` (one per slot, matching shapes; NumPy arrays or CPU tensors)
        into a padded flat buffer.

        Values are converted to the layout's dtype as NumPy assigns them, except that
        bfloat16 goes only to and from bfloat16 (``TypeError`` naming the parameter
        otherwise: a silent cast of float bits to bfloat16 or back would be a rounding
        nobody asked for).
        """
        if len(arrays) != len(self.slots):
            raise ValueError(f"{len(arrays)} arrays for {len(self.slots)} parameter slots")
        dtype = self.np_dtype
        if out is None:
            out = np.zeros(self.padded_numel, dtype)
        elif out.shape != (self.padded_numel,):
            raise ValueError(f"out has shape {out.shape}, expected ({self.padded_numel},)")
        bf16 = is_bfloat16(dtype)
        for slot, array in zip(self.slots, arrays):
            what = f"parameter {slot.name!r}"
            value = as_array(array, what) if is_tensor(array) else np.asarray(array)
            if value.shape != slot.shape:
                raise ValueError(f"{what}: shape {value.shape}, layout has {slot.shape}")
            if is_bfloat16(value.dtype) != bf16:
                raise TypeError(f"{what}: dtype {dtype_name(value.dtype)}, layout has "
                                f"{self.dtype}; convert it first (bfloat16 is never cast "
                                "implicitly)")
            target = out[slot.offset:slot.stop]
            if bf16:  # copy the bits: ml_dtypes' type and the raw bits are the same data
                target.view(np.uint16)[...] = value.view(np.uint16).reshape(-1)
            else:
                target[...] = value.reshape(-1)
        out[self.numel:] = 0
        return out

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """Per-parameter views (original shapes) into a flat buffer of ``numel`` or more."""
        if flat.ndim != 1 or flat.size < self.numel:
            raise ValueError(f"flat buffer of shape {flat.shape} is smaller than {self.numel}")
        return [slot.view(flat) for slot in self.slots]

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard {shard} is outside 0..{self.num_shards - 1}")
