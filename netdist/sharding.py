"""PURE shard vocabulary shared by collectives, FSDP, the parameter server and checkpoints.

One rule everywhere: splitting ``total`` items over ``n`` owners gives the first
``total % n`` owners one extra item. Keeping a single definition means a reduce-scatter
shard, an FSDP flat-parameter shard and a checkpoint shard of the same tensor agree.

Built on it, the two descriptions the layers above exchange:

- ``TensorShardSpec``: how one tensor is placed over ranks -- split along one dimension
  with explicit per-rank extents, replicated, or placed on a device mesh
  (``MeshSharding``) -- with its plain-data (JSON) form. FSDP describes the pieces it
  holds with it, the checkpoint layer writes and reshards by it.
- ``MeshSharding``: a tensor on a device mesh, one ``Shard(dim)`` / ``Replicate()`` per
  mesh dimension, with the explicit extent of every piece along every tensor dimension,
  so that both netdist's even split and torch's (``ChunkRule``) are described exactly.
- ``FlatSlot`` / ``flat_slots``: the flat layout, tensors back to back in one 1-D buffer
  (C order), each at ``flat[offset:offset + numel]``; ``FlatSlot.overlap`` is the part of
  a tensor a flat range (a shard, a message) holds. FSDP's flat parameters and the
  parameter server's per-dtype buffers are such layouts.
"""

from __future__ import annotations

import enum
import math
import re
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
    "mesh_label",
    "ChunkRule",
    "torch_chunk_sizes",
    "placement_label",
    "parse_placement",
    "MeshSharding",
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
    MESH = "mesh"


class ChunkRule(str, enum.Enum):
    """How an even split cuts a tensor dimension into the pieces of a mesh.

    ``NETDIST``: :func:`chunk_sizes` over all the pieces along that dim at once (the first
    ``total % k`` one larger), the rule of every other netdist shard. ``TORCH``: torch
    ``DTensor``'s rule, :func:`torch_chunk_sizes` (pieces of ``ceil(total / k)``, the last
    smaller, trailing ones empty) applied mesh dim by mesh dim in mesh-dim order.
    """

    NETDIST = "netdist"
    TORCH = "torch"


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
    """Placement of one tensor: sharded along ``shard_dim``, replicated, or on a mesh.

    ``shard_sizes[r]`` is the extent of rank ``r``'s shard along ``shard_dim`` (shards
    are contiguous and in rank order). ``shard_dim=None`` with no sizes is the explicit
    replicated placement (every rank holds the full tensor; it is written once), best
    built with :meth:`replicated`. ``dtype`` is a wire dtype name (``"float32"``);
    ``None`` means "take it from the array at save time".

    A flattened tensor split by a flat layout is ``TensorShardSpec((numel,), 0, sizes,
    dtype)``, ``sizes`` from ``FlatSlot.overlap`` per shard. ``mesh`` (with
    ``shard_dim=None``, best built with :meth:`on_mesh`) places the tensor on a device
    mesh instead: rank ``r`` of the mesh (row-major) holds the piece
    ``mesh.piece_of(r)``.

    Every placement is a set of *pieces*, each held by one or more ranks
    (:meth:`piece_holders`): one piece per rank when sharded, one piece held by every rank
    when replicated, a piece per cell of the shard grid on a mesh. A checkpoint writes
    each piece once. ``to_json`` / ``from_json`` are its plain-data form (the
    checkpoint's ``metadata.json`` entry; a mesh entry needs the checkpoint's mesh shape
    to be read back); ``from_json`` raises ``TypeError`` / ``ValueError`` / ``KeyError``
    on malformed input, for the reader to name the file.
    """

    full_shape: tuple[int, ...]
    shard_dim: int | None = 0
    shard_sizes: tuple[int, ...] = ()
    dtype: str | None = None
    mesh: MeshSharding | None = None

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
        if self.mesh is not None:
            self._check_mesh(shape)
            return
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

    def _check_mesh(self, shape: tuple[int, ...]) -> None:
        mesh = self.mesh
        if not isinstance(mesh, MeshSharding):
            raise TypeError(f"mesh must be a MeshSharding, got {type(mesh).__name__}")
        if self.shard_dim is not None or self.shard_sizes:
            raise ValueError("a spec placed on a mesh takes shard_dim=None and no shard_sizes")
        if len(mesh.extents) != len(shape):
            raise ValueError(f"mesh extents describe {len(mesh.extents)} dimensions, the "
                             f"tensor has {len(shape)} ({shape})")
        for dim, (sizes, n) in enumerate(zip(mesh.extents, shape)):
            if sum(sizes) != n:
                raise ValueError(f"extents {list(sizes)[:16]} along dim {dim} sum to "
                                 f"{sum(sizes)}, but dim {dim} of {shape} has {n}")

    @classmethod
    def on_mesh(cls, full_shape: Sequence[int], mesh_shape: Sequence[int],
                placements: Sequence[MeshPlacement],
                extents: Sequence[Sequence[int]] | None = None, dtype: Any = None, *,
                rule: ChunkRule = ChunkRule.NETDIST) -> TensorShardSpec:
        """``full_shape`` placed on a mesh of ``mesh_shape`` by ``placements`` (one per
        mesh dim). ``extents`` gives every piece's extent along every tensor dim (see
        :class:`MeshSharding`); without it the even split of ``rule``."""
        shape = _as_shape(full_shape, "full_shape")
        mesh = (MeshSharding.even(shape, mesh_shape, placements, rule) if extents is None
                else MeshSharding(tuple(mesh_shape), tuple(placements),
                                  tuple(tuple(e) for e in extents)))
        return cls(shape, None, (), None if dtype is None else _dtype_label(dtype), mesh)

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
        if self.mesh is not None:
            return Placement.MESH
        return Placement.REPLICATED if self.shard_dim is None else Placement.SHARDED

    @property
    def is_replicated(self) -> bool:
        """Every rank holds the whole tensor (the explicit replicated placement)."""
        return self.shard_dim is None and self.mesh is None

    @property
    def num_shards(self) -> int | None:
        """Number of ranks the tensor is split over along ``shard_dim``; ``None`` when
        replicated or on a mesh."""
        return None if self.shard_dim is None else len(self.shard_sizes)

    @property
    def num_ranks(self) -> int | None:
        """Number of ranks this placement is laid over (the shards, or the mesh's size);
        ``None`` for a replicated tensor, which fits any number of ranks."""
        if self.mesh is not None:
            return self.mesh.num_ranks
        return self.num_shards

    @property
    def num_pieces(self) -> int:
        """Distinct pieces of the tensor: one per shard, one when replicated, one per cell
        of the shard grid on a mesh."""
        if self.mesh is not None:
            return self.mesh.num_pieces
        return 1 if self.shard_dim is None else len(self.shard_sizes)

    def piece_box(self, piece: int) -> tuple[tuple[int, int], ...]:
        """The region of the full tensor that piece ``piece`` covers."""
        if self.mesh is not None:
            return self.mesh.piece_box(piece)
        if not 0 <= piece < self.num_pieces:
            raise ValueError(f"piece {piece} out of range for {self.num_pieces} pieces")
        return self.box(piece)

    def piece_of(self, rank: int) -> int:
        """The piece ``rank`` holds."""
        if self.mesh is not None:
            return self.mesh.piece_of(rank)
        return 0 if self.shard_dim is None else rank

    def piece_holders(self, num_ranks: int) -> tuple[tuple[int, ...], ...]:
        """For every piece, the ranks (of ``num_ranks``) that hold it, in rank order."""
        if self.mesh is not None:
            return self.mesh.piece_holders()
        if self.shard_dim is None:
            return (tuple(range(num_ranks)),)
        return tuple((rank,) for rank in range(len(self.shard_sizes)))

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
        if self.mesh is not None:
            return self.mesh.piece_box(self.mesh.piece_of(rank))
        full = [(0, n) for n in self.full_shape]
        if self.shard_dim is not None:
            full[self.shard_dim] = self.shard_bounds(rank)
        return tuple(full)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local array."""
        return tuple(stop - start for start, stop in self.box(rank))

    def with_dtype(self, dtype: Any) -> TensorShardSpec:
        return TensorShardSpec(self.full_shape, self.shard_dim, self.shard_sizes,
                               _dtype_label(dtype), self.mesh)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.full_shape),
                               "placement": self.placement.value}
        if self.mesh is not None:
            out.update(self.mesh.to_json())
        elif self.shard_dim is not None:
            out["shard_dim"] = self.shard_dim
            out["shard_sizes"] = list(self.shard_sizes)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any],
                  mesh_shape: Sequence[int] | None = None) -> TensorShardSpec:
        """Invert :meth:`to_json`; a mesh entry is read on a mesh of ``mesh_shape`` (the
        checkpoint's), which it needs."""
        placement = Placement(data["placement"])
        shape = _json_list(data["shape"], "shape")
        if placement is Placement.REPLICATED:
            return cls(shape, None, (), data.get("dtype"))
        if placement is Placement.MESH:
            if mesh_shape is None:
                raise ValueError("a tensor placed on a mesh, but no mesh shape is known")
            return cls(shape, None, (), data.get("dtype"),
                       MeshSharding.from_json(data, mesh_shape))
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


def mesh_label(shape: Sequence[int], names: Sequence[str]) -> str:
    """``dp=2 x tp=2``: a mesh's dimensions and sizes, for messages and tools."""
    return " x ".join(f"{name}={size}" for name, size in zip(names, shape))


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


# -- a tensor cut over a mesh ---------------------------------------------------------


def torch_chunk_sizes(total: int, n: int) -> list[int]:
    """Sizes of ``torch.chunk``'s ``n`` pieces of ``total`` items, padded with empty ones
    to ``n`` as ``DTensor`` does: ``ceil(total / n)`` each, the last smaller."""
    if n < 1:
        raise ValueError(f"number of chunks must be >= 1, got {n}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    step = -(-total // n)
    return [max(0, min(step, total - i * step)) for i in range(n)]


_LABEL = re.compile(r"S\(([0-9]{1,2})\)")


def placement_label(placement: MeshPlacement) -> str:
    """The JSON label of a placement: ``"S(d)"`` for ``Shard(d)``, ``"R"`` for
    ``Replicate()`` (``DTensor``'s short notation)."""
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    raise TypeError(f"a placement is Shard(dim) or Replicate(), got {placement!r:.60}")


def parse_placement(label: Any) -> MeshPlacement:
    """Invert :func:`placement_label`; ``ValueError`` for anything else."""
    if label == "R":
        return Replicate()
    match = _LABEL.fullmatch(label) if isinstance(label, str) else None
    if match is None:
        raise ValueError(f"placement {label!r:.40} is neither \"R\" nor \"S(<dim>)\"")
    return Shard(int(match.group(1)))


@dataclass(frozen=True, slots=True)
class MeshSharding:
    """A tensor placed on a device mesh of ``mesh_shape`` (row-major: rank ``r`` sits at
    ``mesh_coordinate(mesh_shape, r)``), with one placement per mesh dimension.

    ``Shard(d)`` on mesh dim ``m`` splits tensor dim ``d`` over that mesh dim; several
    mesh dims may split one tensor dim (pieces numbered mixed-radix over those mesh dims
    in mesh-dim order, the first the most significant, like ``DTensor``'s default), and
    one tensor may be split along several of its dims. Tensor dim ``d`` is thus cut into
    ``splits(d)`` contiguous pieces whose sizes are ``extents[d]`` (in piece order; a dim
    no mesh dim splits has the one extent ``(n,)``); explicit, so that any split (netdist's
    or torch's, :class:`ChunkRule`) is described exactly. The cells of that grid are the
    tensor's *pieces*, numbered row-major over the tensor dims; a rank holds one piece,
    and the ranks that differ only along ``Replicate()`` mesh dims hold the same one.
    """

    mesh_shape: tuple[int, ...]
    placements: tuple[MeshPlacement, ...]
    extents: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        shape = _as_shape(self.mesh_shape, "mesh shape")
        if not shape or any(n < 1 for n in shape):
            raise ValueError(f"a mesh needs at least one dimension, each >= 1, got {shape}")
        object.__setattr__(self, "mesh_shape", shape)
        placements = tuple(self.placements)
        if len(placements) != len(shape):
            raise ValueError(f"{len(placements)} placements for a mesh of shape {shape} "
                             f"(one per mesh dimension)")
        for placement in placements:
            placement_label(placement)  # TypeError for anything else
        object.__setattr__(self, "placements", placements)
        try:
            extents = tuple(self.extents)
        except TypeError:
            raise TypeError(f"extents must be a list per tensor dim, got "
                            f"{self.extents!r:.60}") from None
        if len(extents) > MAX_NDIM:
            raise ValueError(f"extents describe {len(extents)} dimensions, more than "
                             f"{MAX_NDIM}")
        extents = tuple(_as_shape(e, f"extents of dim {d}") for d, e in enumerate(extents))
        object.__setattr__(self, "extents", extents)
        for m, placement in enumerate(placements):
            if isinstance(placement, Shard) and placement.dim >= len(extents):
                raise ValueError(f"placement {placement!r} of mesh dim {m} names dim "
                                 f"{placement.dim} of a {len(extents)}-d tensor")
        for dim, sizes in enumerate(extents):
            if len(sizes) != self.splits(dim):
                raise ValueError(f"mesh dims {list(self.mesh_dims(dim))} cut dim {dim} into "
                                 f"{self.splits(dim)} pieces, but {len(sizes)} extents are "
                                 f"given")

    # -- the grid
    def mesh_dims(self, dim: int) -> tuple[int, ...]:
        """The mesh dims that split tensor dim ``dim``, in mesh-dim order."""
        return tuple(m for m, p in enumerate(self.placements)
                     if isinstance(p, Shard) and p.dim == dim)

    def splits(self, dim: int) -> int:
        """Number of pieces tensor dim ``dim`` is cut into."""
        return math.prod(self.mesh_shape[m] for m in self.mesh_dims(dim))

    @property
    def full_shape(self) -> tuple[int, ...]:
        return tuple(sum(sizes) for sizes in self.extents)

    @property
    def grid(self) -> tuple[int, ...]:
        """Pieces along each tensor dim."""
        return tuple(len(sizes) for sizes in self.extents)

    @property
    def num_pieces(self) -> int:
        return math.prod(self.grid)

    @property
    def num_ranks(self) -> int:
        return math.prod(self.mesh_shape)

    def piece_index(self, coordinate: Sequence[int]) -> tuple[int, ...]:
        """Along each tensor dim, the index of the piece the mesh ``coordinate`` holds."""
        index = [0] * len(self.extents)
        for m, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                index[placement.dim] = index[placement.dim] * self.mesh_shape[m] + coordinate[m]
        return tuple(index)

    def piece_of(self, rank: int) -> int:
        """The piece mesh rank ``rank`` holds."""
        return mesh_rank(self.grid, self.piece_index(mesh_coordinate(self.mesh_shape, rank)))

    def piece_box(self, piece: int) -> tuple[tuple[int, int], ...]:
        """The region of the full tensor piece ``piece`` covers."""
        box = []
        for sizes, i in zip(self.extents, mesh_coordinate(self.grid, piece)):
            start = sum(sizes[:i])
            box.append((start, start + sizes[i]))
        return tuple(box)

    def piece_holders(self) -> tuple[tuple[int, ...], ...]:
        """For every piece, the mesh ranks holding it, in rank order."""
        holders: list[list[int]] = [[] for _ in range(self.num_pieces)]
        for rank in range(self.num_ranks):
            holders[self.piece_of(rank)].append(rank)
        return tuple(tuple(h) for h in holders)

    # -- building
    @classmethod
    def even(cls, full_shape: Sequence[int], mesh_shape: Sequence[int],
             placements: Sequence[MeshPlacement],
             rule: ChunkRule = ChunkRule.NETDIST) -> MeshSharding:
        """The even split of ``full_shape`` by ``placements`` under ``rule``."""
        shape = _as_shape(full_shape, "full_shape")
        mesh = _as_shape(mesh_shape, "mesh shape")
        rule = ChunkRule(rule)
        extents = []
        for dim, n in enumerate(shape):
            dims = [m for m, p in enumerate(placements)
                    if isinstance(p, Shard) and p.dim == dim]
            if rule is ChunkRule.NETDIST:
                extents.append(tuple(chunk_sizes(n, math.prod(mesh[m] for m in dims))))
                continue
            sizes = [n]
            for m in dims:
                sizes = [part for size in sizes for part in torch_chunk_sizes(size, mesh[m])]
            extents.append(tuple(sizes))
        return cls(mesh, tuple(placements), tuple(extents))

    @classmethod
    def from_local_shapes(cls, mesh_shape: Sequence[int], placements: Sequence[MeshPlacement],
                          shapes: Sequence[Sequence[int]]) -> MeshSharding:
        """The placement whose pieces have the local shapes ``shapes[r]`` of every mesh
        rank ``r``. ``ValueError`` naming the ranks when ranks holding the same piece
        disagree, or shapes of different dimensionality are given."""
        mesh = _as_shape(mesh_shape, "mesh shape")
        if len(shapes) != math.prod(mesh):
            raise ValueError(f"{len(shapes)} local shapes for a mesh of shape {mesh} "
                             f"({math.prod(mesh)} ranks)")
        local = [_as_shape(s, f"rank {r}'s local shape") for r, s in enumerate(shapes)]
        ndim = len(local[0])
        for rank, shape in enumerate(local):
            if len(shape) != ndim:
                raise ValueError(f"rank {rank} holds a {len(shape)}-d piece, rank 0 a "
                                 f"{ndim}-d one")
        probe = cls.even((0,) * ndim, mesh, placements)  # the grid, every extent 0
        extents: list[list[int | None]] = [[None] * n for n in probe.grid]
        owner: list[list[int]] = [[0] * n for n in probe.grid]
        for rank, shape in enumerate(local):
            index = probe.piece_index(mesh_coordinate(mesh, rank))
            for dim, (i, size) in enumerate(zip(index, shape)):
                known = extents[dim][i]
                if known is None:
                    extents[dim][i], owner[dim][i] = size, rank
                elif known != size:
                    raise ValueError(
                        f"rank {rank} holds {size} along dim {dim}, rank {owner[dim][i]} "
                        f"holds {known}, but both hold piece {i} of that dim (placements "
                        f"{list(probe.placements)} on a mesh of shape {mesh})")
        return cls(mesh, probe.placements,
                   tuple(tuple(int(e or 0) for e in sizes) for sizes in extents))

    def remeshed(self, mesh_shape: Sequence[int],
                 rule: ChunkRule = ChunkRule.NETDIST) -> MeshSharding:
        """The same placements on a mesh of ``mesh_shape``, split evenly by ``rule``."""
        return MeshSharding.even(self.full_shape, mesh_shape, self.placements, rule)

    # -- plain data
    def to_json(self) -> dict[str, Any]:
        return {"placements": [placement_label(p) for p in self.placements],
                "extents": [list(sizes) for sizes in self.extents]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], mesh_shape: Sequence[int]) -> MeshSharding:
        placements = tuple(parse_placement(p)
                           for p in _json_list(data["placements"], "placements"))
        extents = tuple(_json_list(e, "extents of a dim")
                        for e in _json_list(data["extents"], "extents"))
        return cls(tuple(mesh_shape), placements, extents)


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
