"""PURE shard vocabulary shared by collectives, FSDP, the parameter server and checkpoints.

One rule everywhere: splitting ``total`` items over ``n`` owners gives the first
``total % n`` owners one extra item. Keeping a single definition means a reduce-scatter
shard, an FSDP flat-parameter shard and a checkpoint shard of the same tensor agree.

Built on it, the two descriptions the layers above exchange:

- ``TensorShardSpec``: how one tensor is placed over ranks -- split along one dimension
  with explicit per-rank extents, or replicated -- with its plain-data (JSON) form. FSDP
  describes the pieces it holds with it, the checkpoint layer writes and reshards by it.
- ``FlatSlot`` / ``flat_slots``: the flat layout, tensors back to back in one 1-D buffer
  (C order), each at ``flat[offset:offset + numel]``; ``FlatSlot.overlap`` is the part of
  a tensor a flat range (a shard, a message) holds. FSDP's flat parameters and the
  parameter server's per-dtype buffers are such layouts.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.types import CARRIED_DTYPES, dtype_to_wire

__all__ = [
    "chunk_sizes",
    "chunk_bounds",
    "padded_size",
    "shard_tensor",
    "gather_shards",
    "MAX_NDIM",
    "Placement",
    "TensorShardSpec",
    "Shard",
    "Replicate",
    "MeshPlacement",
    "MeshPosition",
    "mesh_rank",
    "mesh_coordinate",
    "FlatSlot",
    "flat_slots",
]

MAX_NDIM = 64
"""Most dimensions a tensor described by a ``TensorShardSpec`` may have (NumPy's own
limit)."""

_INT64_MAX = 2**63 - 1


def chunk_sizes(total: int, n: int) -> list[int]:
    """Sizes of ``n`` contiguous chunks of ``total`` items, the first ``total % n`` larger."""
    if n < 1:
        raise ValueError(f"number of chunks must be >= 1, got {n}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    base, extra = divmod(total, n)
    return [base + 1 if i < extra else base for i in range(n)]


def chunk_bounds(total: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of ``n`` contiguous chunks of ``total`` items."""
    bounds = []
    start = 0
    for size in chunk_sizes(total, n):
        bounds.append((start, start + size))
        start += size
    return bounds


def padded_size(total: int, multiple: int) -> int:
    """Smallest size >= ``total`` that ``multiple`` divides (for flat-parameter padding)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    return -(-total // multiple) * multiple


def shard_tensor(array: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Split ``array`` along dim 0 into ``num_shards`` views, earlier shards one row longer.

    A 0-d array cannot be split: with ``num_shards == 1`` it is returned as the only
    shard, anything else is a ``ValueError``.
    """
    if not isinstance(num_shards, (int, np.integer)) or isinstance(num_shards, bool):
        raise TypeError(f"num_shards must be an int, got {type(num_shards).__name__}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    array = np.asarray(array)
    if array.ndim == 0:
        if num_shards != 1:
            raise ValueError(f"a 0-d array cannot be split into {num_shards} shards")
        return [array]
    rows = array.shape[0]
    if num_shards > max(rows, 1):
        raise ValueError(f"cannot split {rows} rows into {num_shards} non-empty shards")
    return [array[start:stop] for start, stop in chunk_bounds(rows, num_shards)]


def gather_shards(shards: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate shards along dim 0 (the inverse of ``shard_tensor``)."""
    if len(shards) == 0:
        raise ValueError("gather_shards needs at least one shard")
    arrays = [np.asarray(s) for s in shards]
    if len(arrays) == 1 and arrays[0].ndim == 0:
        return arrays[0].copy()
    trailing = arrays[0].shape[1:]
    for index, shard in enumerate(arrays):
        if shard.ndim == 0:
            raise ValueError(f"shard {index} is 0-d; only a single 0-d shard can be gathered")
        if shard.shape[1:] != trailing:
            raise ValueError(
                f"shard {index} has trailing shape {shard.shape[1:]}, expected {trailing}")
    return np.concatenate(arrays, axis=0)



# -- placement of one tensor over ranks ---------------------------------------------------


class Placement(str, enum.Enum):
    """How a tensor is laid out over the ranks that hold it."""

    SHARDED = "sharded"
    REPLICATED = "replicated"


def _as_shape(shape: Any, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of Python ints, each >= 0 and within int64."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {shape!r}") from None
    if len(dims) > MAX_NDIM:
        raise ValueError(f"{what} has {len(dims)} dimensions, more than {MAX_NDIM}")
    for dim in dims:
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim < 0:
            raise ValueError(f"{what} must hold ints >= 0, got {shape!r:.80}")
        if dim > _INT64_MAX:
            raise ValueError(f"{what} has a dimension of {dim}, past the int64 range")
    return tuple(int(d) for d in dims)


def _dtype_label(dtype: Any) -> str:
    """The carried dtype name of ``dtype`` (``"float32"``, ``"bfloat16"``); ``TypeError``
    for a dtype netdist cannot carry. A known name is kept as it is, so ``"bfloat16"``
    is accepted without ``ml_dtypes``."""
    if isinstance(dtype, str) and dtype in CARRIED_DTYPES:
        return dtype
    try:
        return dtype_to_wire(dtype)
    except TypeError:
        raise TypeError(f"dtype {dtype!r} cannot be described by a shard spec (supported: "
                        f"{', '.join(CARRIED_DTYPES)})") from None


def _json_list(value: Any, what: str) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise TypeError(f"{what} must be a list, got {value!r:.60}")
    return tuple(value)


def _json_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got {value!r:.60}")
    return value


@dataclass(frozen=True, slots=True)
class TensorShardSpec:
    """Placement of one tensor: sharded along ``shard_dim`` or replicated.

    ``shard_sizes[r]`` is the extent of rank ``r``'s shard along ``shard_dim`` (shards
    are contiguous and in rank order). ``shard_dim=None`` with no sizes is the explicit
    replicated placement (every rank holds the full tensor; it is written once), best
    built with :meth:`replicated`. ``dtype`` is a wire dtype name (``"float32"``);
    ``None`` means "take it from the array at save time".

    A flattened tensor split by a flat layout is ``TensorShardSpec((numel,), 0, sizes,
    dtype)``, ``sizes`` from ``FlatSlot.overlap`` per shard. ``to_json`` / ``from_json``
    are its plain-data form (the checkpoint's ``metadata.json`` entry); ``from_json``
    raises ``TypeError`` / ``ValueError`` / ``KeyError`` on malformed input, for the
    reader to name the file.
    """

    full_shape: tuple[int, ...]
    shard_dim: int | None = 0
    shard_sizes: tuple[int, ...] = ()
    dtype: str | None = None

    def __post_init__(self) -> None:
        shape = _as_shape(self.full_shape, "full_shape")
        if math.prod(shape) > _INT64_MAX:
            raise ValueError(f"full_shape {shape} has {math.prod(shape)} elements, past the "
                             f"int64 range")
        object.__setattr__(self, "full_shape", shape)
        sizes = _as_shape(self.shard_sizes, "shard_sizes")
        object.__setattr__(self, "shard_sizes", sizes)
        if self.dtype is not None:
            object.__setattr__(self, "dtype", _dtype_label(self.dtype))
        if self.shard_dim is None:
            if sizes:
                raise ValueError("a replicated spec (shard_dim=None) takes no shard_sizes")
            return
        dim = self.shard_dim
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
            raise TypeError(f"shard_dim must be an int or None, got {dim!r}")
        if not 0 <= dim < len(shape):
            raise ValueError(f"shard_dim {dim} is out of range for shape {shape}")
        object.__setattr__(self, "shard_dim", int(dim))
        if not sizes:
            raise ValueError("a sharded spec needs shard_sizes (one per rank)")
        if sum(sizes) != shape[dim]:
            raise ValueError(f"shard_sizes {sizes} sum to {sum(sizes)}, but dim {dim} of "
                             f"{shape} has {shape[dim]}")

    @classmethod
    def replicated(cls, full_shape: Sequence[int], dtype: Any = None) -> TensorShardSpec:
        """The replicated placement: every rank holds the whole tensor."""
        return cls(tuple(full_shape), None, (), None if dtype is None else _dtype_label(dtype))

    @classmethod
    def even(cls, full_shape: Sequence[int], num_ranks: int, shard_dim: int = 0,
             dtype: Any = None) -> TensorShardSpec:
        """Shard along ``shard_dim`` with ``chunk_sizes`` (first ``total % n`` one larger)."""
        shape = _as_shape(full_shape, "full_shape")
        if not 0 <= shard_dim < len(shape):
            raise ValueError(f"shard_dim {shard_dim} is out of range for shape {shape}")
        return cls(shape, shard_dim, tuple(chunk_sizes(shape[shard_dim], num_ranks)),
                   None if dtype is None else _dtype_label(dtype))

    @property
    def placement(self) -> Placement:
        return Placement.REPLICATED if self.shard_dim is None else Placement.SHARDED

    @property
    def is_replicated(self) -> bool:
        return self.shard_dim is None

    @property
    def num_shards(self) -> int | None:
        """Number of ranks the tensor is split over; ``None`` when replicated."""
        return None if self.shard_dim is None else len(self.shard_sizes)

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of ``rank``'s shard along ``shard_dim``."""
        if self.shard_dim is None:
            raise ValueError("a replicated tensor has no shard bounds")
        if not 0 <= rank < len(self.shard_sizes):
            raise ValueError(f"rank {rank} out of range for {len(self.shard_sizes)} shards")
        start = sum(self.shard_sizes[:rank])
        return start, start + self.shard_sizes[rank]

    def box(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The region of the full tensor ``rank`` holds, as ``(start, stop)`` per dim."""
        full = [(0, n) for n in self.full_shape]
        if self.shard_dim is not None:
            full[self.shard_dim] = self.shard_bounds(rank)
        return tuple(full)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local array."""
        return tuple(stop - start for start, stop in self.box(rank))

    def with_dtype(self, dtype: Any) -> TensorShardSpec:
        return TensorShardSpec(self.full_shape, self.shard_dim, self.shard_sizes,
                               _dtype_label(dtype))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.full_shape),
                               "placement": self.placement.value}
        if self.shard_dim is not None:
            out["shard_dim"] = self.shard_dim
            out["shard_sizes"] = list(self.shard_sizes)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorShardSpec:
        placement = Placement(data["placement"])
        shape = _json_list(data["shape"], "shape")
        if placement is Placement.REPLICATED:
            return cls(shape, None, (), data.get("dtype"))
        return cls(shape, _json_int(data["shard_dim"], "shard_dim"),
                   _json_list(data["shard_sizes"], "shard_sizes"), data.get("dtype"))


# -- placements on a device mesh ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shard:
    """Along one mesh dimension, the tensor is split along its own dimension ``dim``
    (contiguous pieces in the order of the mesh coordinate)."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, (int, np.integer)) or isinstance(self.dim, bool) \
                or self.dim < 0:
            raise ValueError(f"Shard(dim) needs an int dim >= 0, got {self.dim!r}")
        object.__setattr__(self, "dim", int(self.dim))

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Along one mesh dimension, every rank holds the same piece."""

    def __repr__(self) -> str:
        return "Replicate()"


MeshPlacement = Shard | Replicate
"""How a tensor is laid out along one mesh dimension."""


@dataclass(frozen=True, slots=True)
class MeshPosition:
    """Where one rank sits on a device mesh: the mesh's ``shape`` and dimension
    ``names`` (``("dp", "tp")``) and this rank's ``coordinate`` (one index per
    dimension). Ranks are laid out row-major: the last dimension varies fastest.
    Plain data, so the checkpoint layer can take it without importing the collectives
    (``netdist.collectives.mesh.DeviceMesh.position`` builds it)."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    coordinate: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = _as_shape(self.shape, "mesh shape")
        names = tuple(self.names)
        coordinate = _as_shape(self.coordinate, "mesh coordinate")
        if not shape or any(n < 1 for n in shape):
            raise ValueError(f"a mesh needs at least one dimension, each >= 1, got {shape}")
        if len(names) != len(shape) or len(set(names)) != len(names) or not all(
                isinstance(n, str) and n for n in names):
            raise ValueError(f"mesh names {names!r} must be {len(shape)} distinct non-empty "
                             f"strings, one per dimension of shape {shape}")
        if len(coordinate) != len(shape) or any(c >= n for c, n in zip(coordinate, shape)):
            raise ValueError(f"coordinate {coordinate} is not on a mesh of shape {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "coordinate", coordinate)

    @property
    def size(self) -> int:
        """Ranks on the mesh."""
        return math.prod(self.shape)

    @property
    def rank(self) -> int:
        """This position's rank on the mesh (row-major)."""
        return mesh_rank(self.shape, self.coordinate)


def mesh_rank(shape: Sequence[int], coordinate: Sequence[int]) -> int:
    """Row-major rank of ``coordinate`` on a mesh of ``shape``."""
    rank = 0
    for c, n in zip(coordinate, shape):
        rank = rank * n + c
    return rank


def mesh_coordinate(shape: Sequence[int], rank: int) -> tuple[int, ...]:
    """Row-major coordinate of ``rank`` on a mesh of ``shape`` (inverse of ``mesh_rank``)."""
    if not 0 <= rank < math.prod(shape):
        raise ValueError(f"rank {rank} is not on a mesh of shape {tuple(shape)}")
    out = []
    for n in reversed(tuple(shape)):
        rank, c = divmod(rank, n)
        out.append(c)
    return tuple(reversed(out))


# -- the flat layout ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FlatSlot:
    """Where one tensor lives in a flat buffer: ``flat[offset:offset + numel]``, C order."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def stop(self) -> int:
        """One past the tensor's last element in the flat buffer."""
        return self.offset + self.numel

    def view(self, flat: np.ndarray) -> np.ndarray:
        """The tensor inside ``flat``, shaped like it (a view, no copy)."""
        return flat[self.offset:self.stop].reshape(self.shape)

    def overlap(self, start: int, stop: int) -> tuple[int, int]:
        """Which of the tensor's (flattened) elements the flat range ``[start, stop)``
        holds, as ``(lo, hi)``: they sit at ``flat[offset + lo : offset + hi]``. Empty
        (``lo == hi``) when the range misses the tensor."""
        lo = min(max(start, self.offset), self.stop)
        hi = max(min(stop, self.stop), lo)
        return lo - self.offset, hi - self.offset


def flat_slots(names: Sequence[str], shapes: Sequence[Sequence[int]], *,
               start: int = 0) -> tuple[FlatSlot, ...]:
    """Lay tensors ``names`` / ``shapes`` back to back in one flat buffer, from ``start``.

    ``ValueError`` for a count mismatch or a negative dimension; the buffer holds
    ``slots[-1].stop - start`` elements (padding, if any, is the caller's: ``padded_size``).
    """
    if len(names) != len(shapes):
        raise ValueError(f"{len(names)} names for {len(shapes)} shapes")
    slots = []
    offset = start
    for name, shape in zip(names, shapes):
        dims = _as_shape(shape, f"shape of {name!r}")
        numel = math.prod(dims)
        slots.append(FlatSlot(str(name), dims, offset, numel))
        offset += numel
    return tuple(slots)
