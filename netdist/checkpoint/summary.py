"""PURE what the ranks of a collective save or load tell each other, and its wire form.

A collective ``save`` (:mod:`netdist.checkpoint.collective`) starts with one
``all_gather_object`` of every rank's :class:`RankSummary` (its tensors as
:class:`TensorSummary`, the summary of its plain values, and on rank 0 the step and
staging directory it picked); every rank then computes the same shard specs, state layout
and replica verdict with :func:`merge_rank_summaries`. A collective ``load`` gathers
every rank's :class:`ShardExtent` (or :class:`MeshExtent`) of each ``ShardedArray`` it
passed in ``like``. A mesh-placed tensor's summary carries its :class:`MeshPlace`, and
:func:`mesh_sharding_of` builds its placement from every rank's place and local shape,
at save and at load alike. A rank that failed sends a :class:`RankFailure` instead, so
every rank fails together.

Each message is a plain msgpack-able mapping (``to_wire`` / ``from_wire``), never a
positional list: a field is found by its name.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from netdist.checkpoint.metadata import StateLayout, TensorShardSpec
from netdist.checkpoint.options import ReplicaCheck
from netdist.checkpoint.state import ShardedArray, merge_summaries
from netdist.errors import CheckpointMismatchError
from netdist.sharding import (
    MeshPlacement,
    MeshPosition,
    MeshSharding,
    mesh_label,
    parse_placement,
    placement_label,
)

__all__ = [
    "MeshPlace",
    "TensorSummary",
    "RankSummary",
    "ShardExtent",
    "MeshExtent",
    "shard_extent",
    "extent_from_wire",
    "mesh_sharding_of",
    "checkpoint_mesh",
    "RankFailure",
    "merge_rank_summaries",
    "describe_diverged",
]


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True, slots=True)
class MeshPlace:
    """Where a rank's piece of a mesh-placed tensor sits: the tensor's placements (one
    per mesh dim) and the rank's :class:`MeshPosition` (mesh shape, names, coordinate)."""

    placements: tuple[MeshPlacement, ...]
    position: MeshPosition

    @classmethod
    def of(cls, value: ShardedArray) -> MeshPlace:
        """The place of a ``ShardedArray`` on a mesh."""
        if value.placements is None or not isinstance(value.mesh, MeshPosition):
            raise ValueError("the ShardedArray is not placed on a mesh")
        return cls(value.placements, value.mesh)

    def describe(self) -> str:
        """``(R, S(0)) on dp=2 x tp=2``."""
        labels = ", ".join(placement_label(p) for p in self.placements)
        return f"({labels}) on {mesh_label(self.position.shape, self.position.names)}"

    def to_wire(self) -> dict[str, Any]:
        return {"placements": [placement_label(p) for p in self.placements],
                "shape": list(self.position.shape), "names": list(self.position.names),
                "coordinate": list(self.position.coordinate)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> MeshPlace:
        position = MeshPosition(tuple(int(n) for n in data["shape"]),
                                tuple(str(n) for n in data["names"]),
                                tuple(int(c) for c in data["coordinate"]))
        return cls(tuple(parse_placement(p) for p in data["placements"]), position)


@dataclass(frozen=True, slots=True)
class TensorSummary:
    """One tensor as a rank holds it: dtype name, local shape, the dim it is sharded
    along (None: replicated or on a mesh), its :class:`MeshPlace` on a mesh and, for a
    piece other ranks hold too, under a replica check, the CRC-32 of its bytes."""

    dtype: str
    shape: tuple[int, ...]
    shard_dim: int | None
    crc32: int | None = None
    mesh: MeshPlace | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape),
                                "shard_dim": self.shard_dim, "crc32": self.crc32}
        if self.mesh is not None:
            wire["mesh"] = self.mesh.to_wire()
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> TensorSummary:
        mesh = data.get("mesh")
        return cls(str(data["dtype"]), tuple(int(n) for n in data["shape"]),
                   _optional_int(data["shard_dim"]), _optional_int(data.get("crc32")),
                   None if mesh is None else MeshPlace.from_wire(mesh))


@dataclass(frozen=True, slots=True)
class RankSummary:
    """What one rank tells every other before a collective save writes anything.

    ``state`` is :func:`netdist.checkpoint.state.state_summary` of its nested state (the
    skeleton and every plain value as canonical JSON text). Rank 0 also sends the
    ``step`` it picked and the name of the ``staging`` directory it created.
    """

    tensors: dict[str, TensorSummary]
    state: dict[str, Any]
    step: int | None = None
    staging: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"tensors": {name: t.to_wire() for name, t in self.tensors.items()},
                "state": self.state, "step": self.step, "staging": self.staging}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> RankSummary:
        staging = data.get("staging")
        return cls({str(name): TensorSummary.from_wire(t) for name, t in data["tensors"].items()},
                   dict(data["state"]), _optional_int(data.get("step")),
                   None if staging is None else str(staging))


@dataclass(frozen=True, slots=True)
class ShardExtent:
    """How much of a tensor a rank's ``ShardedArray`` in ``like`` holds: ``extent``
    entries along ``shard_dim`` (a collective load places each rank's shard by them)."""

    shard_dim: int
    extent: int

    def to_wire(self) -> dict[str, int]:
        return {"shard_dim": self.shard_dim, "extent": self.extent}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ShardExtent:
        return cls(int(data["shard_dim"]), int(data["extent"]))


@dataclass(frozen=True, slots=True)
class MeshExtent:
    """A rank's ``ShardedArray`` on a mesh in ``like``: its place and local shape (a
    collective load places each rank's piece on the new mesh by them)."""

    place: MeshPlace
    shape: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"mesh": self.place.to_wire(), "shape": list(self.shape)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> MeshExtent:
        return cls(MeshPlace.from_wire(data["mesh"]), tuple(int(n) for n in data["shape"]))


def shard_extent(value: ShardedArray) -> ShardExtent | MeshExtent:
    """What a rank tells the others about a ``ShardedArray`` of its ``like``."""
    if value.on_mesh:
        return MeshExtent(MeshPlace.of(value), tuple(int(n) for n in value.data.shape))
    dim = int(value.shard_dim or 0)
    return ShardExtent(dim, int(value.data.shape[dim]))


def extent_from_wire(data: Mapping[str, Any]) -> ShardExtent | MeshExtent:
    """Invert ``to_wire`` of either kind."""
    return MeshExtent.from_wire(data) if "mesh" in data else ShardExtent.from_wire(data)


def mesh_sharding_of(name: str, places: Sequence[MeshPlace | None],
                     shapes: Sequence[Sequence[int]]) -> MeshSharding:
    """The placement of ``name`` from every rank's place and local shape (by rank).

    ``CheckpointMismatchError`` naming the tensor and the rank unless every rank places
    it alike on one mesh of as many ranks as the group has, each rank sits at the mesh
    coordinate of its rank (row-major), and ranks holding the same piece hold the same
    shape."""
    first = places[0]
    if first is None:
        raise CheckpointMismatchError(f"{name!r}: rank 0 does not place it on a mesh, "
                                      f"other ranks do")
    for rank, place in enumerate(places):
        if place is None:
            raise CheckpointMismatchError(f"{name!r}: rank {rank} does not place it on a "
                                          f"mesh, rank 0 places it {first.describe()}")
        if (place.placements != first.placements or place.position.shape != first.position.shape
                or place.position.names != first.position.names):
            raise CheckpointMismatchError(f"{name!r}: rank {rank} places it "
                                          f"{place.describe()}, rank 0 {first.describe()}")
        if place.position.rank != rank:
            raise CheckpointMismatchError(
                f"{name!r}: rank {rank} sits at mesh coordinate "
                f"{list(place.position.coordinate)}, which is mesh rank {place.position.rank} "
                f"(row-major); the mesh rank must be the rank in the group")
    if first.position.size != len(places):
        raise CheckpointMismatchError(f"{name!r}: the mesh {first.describe()} has "
                                      f"{first.position.size} ranks, the group {len(places)}")
    try:
        return MeshSharding.from_local_shapes(first.position.shape, first.placements, shapes)
    except ValueError as exc:
        raise CheckpointMismatchError(f"{name!r}: {exc}") from None


def checkpoint_mesh(summaries: Sequence[RankSummary]) -> dict[str, list[Any]] | None:
    """The one mesh of every mesh-placed tensor of a save (``{"shape", "names"}``, as
    ``metadata.json`` records it), None when no tensor is placed on a mesh;
    ``CheckpointMismatchError`` naming two tensors placed on different meshes."""
    found: tuple[str, MeshPosition] | None = None
    for name, entry in summaries[0].tensors.items():
        if entry.mesh is None:
            continue
        position = entry.mesh.position
        if found is None:
            found = (name, position)
        elif (position.shape, position.names) != (found[1].shape, found[1].names):
            raise CheckpointMismatchError(
                f"{name!r} is placed on a mesh {mesh_label(position.shape, position.names)}, "
                f"{found[0]!r} on {mesh_label(found[1].shape, found[1].names)}: a "
                f"checkpoint has one mesh (replicate along the dims a tensor does not use)")
    if found is None:
        return None
    return {"shape": list(found[1].shape), "names": list(found[1].names)}


@dataclass(frozen=True, slots=True)
class RankFailure:
    """A rank's error, sent in place of its contribution: the exception's class name
    (``type``, re-raised as that ``CheckpointError`` subclass when it is one) and its
    message."""

    type: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> RankFailure:
        return cls(type(exc).__name__, f"{exc}")

    def to_wire(self) -> dict[str, str]:
        return {"error": self.message, "type": self.type}

    @classmethod
    def from_wire(cls, data: Any) -> RankFailure | None:
        """The failure ``data`` reports, or None when it is a rank's ordinary message."""
        if not isinstance(data, Mapping) or "error" not in data:
            return None
        return cls(str(data.get("type", "")), str(data["error"]))


def merge_rank_summaries(summaries: Sequence[RankSummary],
                         check: ReplicaCheck = ReplicaCheck.OFF
                         ) -> tuple[dict[str, TensorShardSpec], StateLayout, dict[str, list[int]]]:
    """Every rank's summary -> one set of specs, the state layout and the replicated
    tensors whose copies differ (name -> the ranks whose copy differs from that of the
    lowest rank holding the same piece: rank 0's for a replicated tensor); the same on
    all ranks. ``ReplicaCheck.ERROR`` raises on a difference instead, and any dtype,
    shard dim, placement or shape the ranks disagree on is a ``CheckpointMismatchError``
    naming the tensor and the rank."""
    layout = merge_summaries([s.state for s in summaries])
    specs = {}
    diverged: dict[str, list[int]] = {}
    for name, first in summaries[0].tensors.items():
        entries = [s.tensors[name] for s in summaries]
        dtype, shape, dim = first.dtype, list(first.shape), first.shard_dim
        for rank, entry in enumerate(entries):
            if entry.dtype != dtype or entry.shard_dim != dim:
                raise CheckpointMismatchError(
                    f"{name!r}: rank {rank} has dtype {entry.dtype} shard_dim "
                    f"{entry.shard_dim}, rank 0 has dtype {dtype} shard_dim {dim}")
        if any(entry.mesh is not None for entry in entries):
            sharding = mesh_sharding_of(name, [e.mesh for e in entries],
                                        [e.shape for e in entries])
            specs[name] = TensorShardSpec(sharding.full_shape, None, (), dtype, sharding)
            for holders in sharding.piece_holders():
                differ = [r for r in holders[1:] if entries[r].crc32 is not None
                          and entries[r].crc32 != entries[holders[0]].crc32]
                if differ:
                    diverged.setdefault(name, []).extend(differ)
            continue
        if dim is None:
            for rank, entry in enumerate(entries):
                if list(entry.shape) != shape:
                    raise CheckpointMismatchError(f"replicated {name!r}: rank {rank} has "
                                                  f"shape {list(entry.shape)}, rank 0 has "
                                                  f"{shape}")
                if entry.crc32 is not None and entry.crc32 != first.crc32:
                    diverged.setdefault(name, []).append(rank)
            specs[name] = TensorShardSpec.replicated(tuple(shape), dtype)
            continue
        for rank, entry in enumerate(entries):
            other = list(entry.shape)
            if len(other) != len(shape) or any(a != b for i, (a, b) in
                                               enumerate(zip(other, shape)) if i != dim):
                raise CheckpointMismatchError(f"sharded {name!r}: rank {rank} has shape "
                                              f"{other}, incompatible with rank 0's {shape} "
                                              f"(only dim {dim} may differ)")
        sizes = tuple(e.shape[dim] for e in entries)
        full = list(shape)
        full[dim] = sum(sizes)
        specs[name] = TensorShardSpec(tuple(full), dim, sizes, dtype)
    if diverged and check is ReplicaCheck.ERROR:
        raise CheckpointMismatchError(
            f"replicated tensors differ between ranks: "
            f"{describe_diverged(diverged, placed=_placed(specs))}; "
            f"nothing was saved (sync them first, e.g. broadcast or all-reduce buffers, "
            f"shard them with ShardedArray, or pass check_replicated='warn' to save rank "
            f"0's copy)")
    return specs, layout, diverged


def _placed(specs: Mapping[str, TensorShardSpec]) -> set[str]:
    return {name for name, spec in specs.items() if spec.mesh is not None}


def describe_diverged(diverged: Mapping[str, list[int]], limit: int = 8,
                      placed: Collection[str] = ()) -> str:
    """``'w' differs between rank 0 and ranks 1, 2; ...`` for up to ``limit`` tensors;
    for the mesh-placed tensors ``placed``, between the lowest rank holding a piece and
    the ranks listed."""
    names = sorted(diverged)
    parts = [f"{name!r} differs between "
             f"{'the lowest rank holding each piece' if name in placed else 'rank 0'} and "
             f"{'rank' if len(diverged[name]) == 1 else 'ranks'} "
             f"{', '.join(str(r) for r in diverged[name])}" for name in names[:limit]]
    if len(names) > limit:
        parts.append(f"and {len(names) - limit} more")
    return "; ".join(parts)
