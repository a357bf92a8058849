"""PURE what the ranks of a collective save or load tell each other, and its wire form.

A collective ``save`` (:mod:`netdist.checkpoint.collective`) starts with one
``all_gather_object`` of every rank's :class:`RankSummary` (its tensors as
:class:`TensorSummary`, the summary of its plain values, and on rank 0 the step and
staging directory it picked); every rank then computes the same shard specs, state layout
and replica verdict with :func:`merge_rank_summaries`. A collective ``load`` gathers
every rank's :class:`ShardExtent` of each ``ShardedArray`` it passed in ``like``. A rank
that failed sends a :class:`RankFailure` instead, so every rank fails together.

Each message is a plain msgpack-able mapping (``to_wire`` / ``from_wire``), never a
positional list: a field is found by its name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from netdist.checkpoint.metadata import StateLayout, TensorShardSpec
from netdist.checkpoint.options import ReplicaCheck
from netdist.checkpoint.state import merge_summaries
from netdist.errors import CheckpointMismatchError

__all__ = [
    "TensorSummary",
    "RankSummary",
    "ShardExtent",
    "RankFailure",
    "merge_rank_summaries",
    "describe_diverged",
]


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True, slots=True)
class TensorSummary:
    """One tensor as a rank holds it: dtype name, local shape, the dim it is sharded
    along (None: replicated) and, for a replicated tensor under a replica check, the
    CRC-32 of its bytes."""

    dtype: str
    shape: tuple[int, ...]
    shard_dim: int | None
    crc32: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "shard_dim": self.shard_dim,
                "crc32": self.crc32}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> TensorSummary:
        return cls(str(data["dtype"]), tuple(int(n) for n in data["shape"]),
                   _optional_int(data["shard_dim"]), _optional_int(data.get("crc32")))


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
    tensors whose copies differ (name -> the ranks whose copy differs from rank 0's);
    the same on all ranks. ``ReplicaCheck.ERROR`` raises on a difference instead, and
    any dtype, shard dim or shape the ranks disagree on is a ``CheckpointMismatchError``
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
            f"replicated tensors differ between ranks: {describe_diverged(diverged)}; "
            f"nothing was saved (sync them first, e.g. broadcast or all-reduce buffers, "
            f"shard them with ShardedArray, or pass check_replicated='warn' to save rank "
            f"0's copy)")
    return specs, layout, diverged


def describe_diverged(diverged: Mapping[str, list[int]], limit: int = 8) -> str:
    """``'w' differs between rank 0 and ranks 1, 2; ...`` for up to ``limit`` tensors."""
    names = sorted(diverged)
    parts = [f"{name!r} differs between rank 0 and "
             f"{'rank' if len(diverged[name]) == 1 else 'ranks'} "
             f"{', '.join(str(r) for r in diverged[name])}" for name in names[:limit]]
    if len(names) > limit:
        parts.append(f"and {len(names) - limit} more")
    return "; ".join(parts)
