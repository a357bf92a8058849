"""What every checkpoint save shares: argument checks, one rank's file, the result.

Both front-ends build on this module: the per-rank ``save_distributed``
(:mod:`netdist.checkpoint.api`, also run by ``AsyncCheckpointer``) and the collective
``save`` (:mod:`netdist.checkpoint.collective`); the offline tools
(:mod:`netdist.checkpoint.consolidate`) stamp their rank files with the same header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from netdist.checkpoint.dtypes import dtype_name
from netdist.checkpoint.metadata import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FileRecord,
    TensorShardSpec,
    rank_file_name,
)
from netdist.checkpoint.planner import plan_writes
from netdist.checkpoint.storage import TensorSource, write_safetensors

__all__ = [
    "SaveResult",
    "check_rank",
    "check_keep_last",
    "rank_file_metadata",
    "write_rank_file",
]


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What one rank's save did: the checkpoint directory, its file and byte count.

    ``committed`` is true on the rank that wrote ``metadata.json`` (rank 0 in a
    collective save, the last rank to finish in the per-rank API).

    A save that returns is committed: the failures it reports by raising all happen
    before the commit point. What comes after it is housekeeping, and a failure there
    is reported here instead (and logged as a warning on the ``netdist.checkpoint``
    logger): ``latest_updated`` says whether the commit rewrote ``latest`` to name the
    newest complete step (False on a disk too full for its temporary file; loads do not
    read ``latest``, so nothing depends on it), and ``warnings`` lists each skipped step
    (``latest`` not rewritten, an old checkpoint beyond ``keep_last`` not deleted),
    naming the path and the OS error. A collective save gives every rank rank 0's
    values; in the per-rank API only the committing rank has them (the others get
    ``False`` and ``()``), and a save without a step keeps no ``latest`` (``False``).
    """

    path: Path
    rank: int
    file: Path
    nbytes: int
    committed: bool
    step: int | None
    seconds: float
    latest_updated: bool = False
    warnings: tuple[str, ...] = ()


def check_rank(rank: int, world_size: int) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``0 <= rank < world_size`` are ints."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world size {world_size}")


def check_keep_last(keep_last: int | None) -> None:
    """Raise ``ValueError`` unless ``keep_last`` is None or an int >= 1 (checked up front,
    not after every byte is written)."""
    if keep_last is None:
        return
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")


def rank_file_metadata(rank: int, world_size: int) -> dict[str, str]:
    """The safetensors ``__metadata__`` of ``rank``'s file (format, version, rank, ranks)."""
    return {"format": FORMAT_NAME, "version": str(FORMAT_VERSION), "rank": str(rank),
            "num_ranks": str(world_size)}


def write_rank_file(directory: Path, rank: int, world_size: int,
                    specs: Mapping[str, TensorShardSpec], writers: Mapping[str, int],
                    arrays: Mapping[str, np.ndarray]) -> FileRecord:
    """Write ``rank``'s file (its shards and the replicated tensors it was assigned)."""
    plan = plan_writes(specs, world_size, writers)
    sources = []
    for item in plan.for_rank(rank):
        array = arrays[item.name]
        dtype = specs[item.name].dtype or dtype_name(array.dtype)
        sources.append(TensorSource(item.name, dtype, tuple(array.shape), data=array))
    name = rank_file_name(rank)
    size, checksum = write_safetensors(directory / name, sources,
                                       metadata=rank_file_metadata(rank, world_size))
    return FileRecord(rank, name, size, checksum)
