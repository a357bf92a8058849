"""PURE message plans of the parameter servers: how tensors are cut into messages.

Every parameter-server exchange moves a list of flat element ranges. ``pack_runs`` is the
one packer that cuts them into messages: a large range travels alone, straight from the
sender's tensor memory into the receiver's (``direct``), in chunks of at most
``chunk_bytes`` when the caller wants early chunks to overlap later ones; runs of small
ranges of one dtype are packed into one message. Both sides of the wire derive the same
messages from the same inputs, so nothing about the cut is sent. Its two users:

- ``plan_segments``: a sharded server's flat buffer (its ``ShardSlice`` s), as
  ``Segment`` s (``netdist.ps.client`` / ``netdist.ps.server``);
- ``plan_pieces``: the tensors of a sync round laid out by ``FlatLayout`` (one flat
  buffer per dtype, ``netdist.sharding.flat_slots``), as ``Piece`` s (``netdist.ps.parameter_server``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.ps.placement import ShardPlan, ShardSlice
from netdist.sharding import chunk_bounds, flat_slots
from netdist.types import dtype_from_wire, dtype_to_wire

__all__ = [
    "DIRECT_SEGMENT_BYTES",
    "Run",
    "pack_runs",
    "Segment",
    "plan_segments",
    "FlatLayout",
    "Piece",
    "plan_pieces",
]

DIRECT_SEGMENT_BYTES = 256 * 1024
"""Slices of at least this many bytes travel as their own message, straight from the
gradient tensor and straight into the parameter tensor; smaller ones are packed."""


@dataclass(frozen=True, slots=True)
class Run:
    """One message cut by ``pack_runs``: ``(item, start, stop)`` element ranges of the
    items, concatenated in order; a ``direct`` run is one range of one large item."""

    parts: tuple[tuple[int, int, int], ...]
    direct: bool

    @property
    def size(self) -> int:
        return sum(stop - start for _, start, stop in self.parts)


def pack_runs(sizes: Sequence[int], dtypes: Sequence[str], *, direct_bytes: int,
              chunk_bytes: int | None = None) -> tuple[Run, ...]:
    """Cut items of ``sizes`` elements (wire dtypes ``dtypes``) into messages, in order.

    An item of at least ``direct_bytes`` travels alone: one direct run, or direct runs of
    at most ``chunk_bytes`` each (``chunk_bounds`` over the item, so the chunks differ by
    at most one element). Consecutive smaller items of one dtype are packed into one
    run, closed when the dtype changes or (with ``chunk_bytes``) when the next item
    would take it past ``chunk_bytes``; an item alone larger than that still goes whole.
    """
    if chunk_bytes is not None and chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    runs: list[Run] = []
    run: list[tuple[int, int, int]] = []
    run_dtype = ""
    run_bytes = 0

    def flush() -> None:
        nonlocal run_bytes
        if run:
            runs.append(Run(tuple(run), False))
            run.clear()
        run_bytes = 0

    for item, (size, dtype) in enumerate(zip(sizes, dtypes, strict=True)):
        itemsize = dtype_from_wire(dtype).itemsize
        nbytes = size * itemsize
        if nbytes >= direct_bytes:
            flush()
            chunks = 1 if chunk_bytes is None else -(-size // max(1, chunk_bytes // itemsize))
            runs.extend(Run(((item, start, stop),), True)
                        for start, stop in chunk_bounds(size, chunks))
            continue
        if run and (dtype != run_dtype or (chunk_bytes is not None
                                           and run_bytes + nbytes > chunk_bytes)):
            flush()
        run_dtype = dtype
        run.append((item, 0, size))
        run_bytes += nbytes
    flush()
    return tuple(runs)


@dataclass(frozen=True, slots=True)
class Segment:
    """One message between a worker and a server: a run of the server's flat buffer.

    ``direct`` segments are a single large slice, sent from the worker's tensor memory
    and received into it without packing; the others pack consecutive small slices.
    """

    index: int
    offset: int
    size: int
    slices: tuple[ShardSlice, ...]
    direct: bool


def plan_segments(plan: ShardPlan, server: int, *,
                  direct_bytes: int = DIRECT_SEGMENT_BYTES) -> tuple[Segment, ...]:
    """Cut ``server``'s buffer into messages: big slices alone, small ones packed together.

    Both sides of the wire derive the same segments from the same plan.
    """
    slices = plan.slices_of(server)
    runs = pack_runs([s.size for s in slices], [plan.dtype] * len(slices),
                     direct_bytes=direct_bytes)
    return tuple(Segment(index, slices[run.parts[0][0]].offset, run.size,
                         tuple(slices[item] for item, _, _ in run.parts), run.direct)
                 for index, run in enumerate(runs))


# -- the sync server's rounds -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Tensors packed into one flat buffer per dtype (groups in order of first use)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    """Wire dtype name per tensor."""
    group_dtypes: tuple[str, ...]
    group_sizes: tuple[int, ...]
    placement: tuple[tuple[int, int, int], ...]
    """Per tensor: ``(group, offset, size)``."""

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray]) -> FlatLayout:
        """The layout of ``arrays``: each dtype's tensors back to back (``flat_slots``)."""
        if isinstance(arrays, np.ndarray):
            raise TypeError("expected a list of arrays, got a single numpy.ndarray")
        shapes, dtypes = [], []
        for index, array in enumerate(arrays):
            if not isinstance(array, np.ndarray):
                raise TypeError(f"tensor {index} must be a numpy.ndarray, "
                                f"got {type(array).__name__}")
            dtypes.append(dtype_to_wire(array.dtype))
            shapes.append(tuple(int(d) for d in array.shape))
        group_dtypes = tuple(dict.fromkeys(dtypes))
        placement: list[tuple[int, int, int]] = [(0, 0, 0)] * len(shapes)
        sizes = []
        for group, dtype in enumerate(group_dtypes):
            members = [i for i, d in enumerate(dtypes) if d == dtype]
            slots = flat_slots([str(i) for i in members], [shapes[i] for i in members])
            for index, slot in zip(members, slots):
                placement[index] = (group, slot.offset, slot.numel)
            sizes.append(slots[-1].stop)
        return cls(tuple(shapes), tuple(dtypes), group_dtypes, tuple(sizes), tuple(placement))

    def signature(self) -> list[Any]:
        """A msgpack-able description two ranks can compare."""
        return [[list(s) for s in self.shapes], list(self.dtypes)]

    def group_dtype(self, group: int) -> np.dtype[Any]:
        return dtype_from_wire(self.group_dtypes[group])

    def empty(self) -> list[np.ndarray]:
        """Fresh (uninitialised) flat buffers, one per group."""
        return [np.empty(size, dtype=self.group_dtype(g))
                for g, size in enumerate(self.group_sizes)]

    def check(self, arrays: Sequence[np.ndarray]) -> None:
        """``ValueError`` unless ``arrays`` match this layout tensor by tensor."""
        if len(arrays) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors, got {len(arrays)}")
        for index, (array, shape, dtype) in enumerate(zip(arrays, self.shapes, self.dtypes)):
            if array.shape != shape or dtype_to_wire(array.dtype) != dtype:
                raise ValueError(f"tensor {index} is {array.dtype}{list(array.shape)}, "
                                 f"expected {dtype}{list(shape)}")

    def flatten(self, arrays: Sequence[np.ndarray],
                out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Copy ``arrays`` into flat group buffers (fresh ones unless ``out`` is given)."""
        self.check(arrays)
        flats = self.empty() if out is None else list(out)
        for array, (group, offset, size) in zip(arrays, self.placement):
            flats[group][offset:offset + size] = np.ravel(array)
        return flats

    def unflatten(self, flats: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Views of ``flats`` shaped like the original tensors (no copy)."""
        return [flats[group][offset:offset + size].reshape(shape)
                for (group, offset, size), shape in zip(self.placement, self.shapes)]

    def copy_into(self, flats: Sequence[np.ndarray], arrays: Sequence[np.ndarray]) -> None:
        """Copy ``flats`` into ``arrays`` in place."""
        self.check(arrays)
        for array, view in zip(arrays, self.unflatten(flats)):
            np.copyto(array, view)


@dataclass(frozen=True, slots=True)
class Piece:
    """One message of a sync round: elements of one tensor, or several small tensors.

    ``parts`` are ``(tensor, start, stop)`` flat element ranges, concatenated in order.
    A ``direct`` piece is one range of one large tensor: it is sent from the tensor's own
    memory and received straight into the result tensor, never packed.
    """

    index: int
    dtype: str
    size: int
    parts: tuple[tuple[int, int, int], ...]
    direct: bool

    def view(self, arrays: Sequence[np.ndarray]) -> np.ndarray | None:
        """For a direct piece of a C-contiguous tensor: a view of its elements, else None."""
        if not self.direct:
            return None
        tensor, start, stop = self.parts[0]
        array = arrays[tensor]
        if not array.flags.c_contiguous:
            return None
        return array.reshape(-1)[start:stop]

    def pack(self, arrays: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
        """Copy the piece's elements of ``arrays`` into ``out`` (``size`` elements)."""
        offset = 0
        for tensor, start, stop in self.parts:
            out[offset:offset + stop - start] = np.ravel(arrays[tensor])[start:stop]
            offset += stop - start
        return out

    def unpack(self, flat: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
        """Copy ``flat`` back into the piece's elements of ``arrays`` (C-contiguous)."""
        offset = 0
        for tensor, start, stop in self.parts:
            arrays[tensor].reshape(-1)[start:stop] = flat[offset:offset + stop - start]
            offset += stop - start



def plan_pieces(layout: FlatLayout, chunk_bytes: int, *,
                direct_bytes: int = DIRECT_SEGMENT_BYTES) -> tuple[Piece, ...]:
    """Cut a tensor list into the messages of a sync round, in tensor order.

    Tensors of at least ``direct_bytes`` are split into direct pieces of at most
    ``chunk_bytes`` (so the server can sum and return early chunks while later ones
    arrive); runs of smaller tensors of one dtype are packed into pieces of at most
    ``chunk_bytes``. Both sides derive the same pieces from the same layout.
    """
    runs = pack_runs([math.prod(shape) for shape in layout.shapes], layout.dtypes,
                     direct_bytes=direct_bytes, chunk_bytes=chunk_bytes)
    return tuple(Piece(index, layout.dtypes[run.parts[0][0]], run.size, run.parts, run.direct)
                 for index, run in enumerate(runs))
