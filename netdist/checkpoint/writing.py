"""The one checkpoint save path: argument checks, the orchestrator, a rank's file, result.

Every save runs :func:`run_save`: settle what and where (the specs of the tensors, this
rank's arrays, the staging directory), plan once (``plan_writes`` of
:mod:`netdist.checkpoint.planner`: which rank's file holds each tensor), write this
rank's file (temp, fsync, rename), share its record, commit (``metadata.json``, then the
rename of :mod:`netdist.checkpoint.commit`) on the rank that commits, and report the
outcome. The entry points are thin :class:`SaveCoordinator` subclasses over it,
differing only where the design does:

- the collective ``save`` (:mod:`netdist.checkpoint.collective`): rank 0 prepares the
  root, an ``all_gather_object`` gives every rank the same specs before the plan and
  another brings the file records to rank 0, which commits and broadcasts the outcome;
  diverged replicas are pinned to rank 0; blocking steps run in worker threads;
- the per-rank ``save_distributed`` (:mod:`netdist.checkpoint.api`, also what
  ``AsyncCheckpointer`` runs in its writer thread): no communication; every rank stages
  into a directory derived alike, leaves a manifest there, and the rank that completes
  the set commits under a lock; every step is a blocking call made in place, so the save
  runs without an event loop (:func:`run_inline`).

The offline tools (:mod:`netdist.checkpoint.consolidate`) stamp their rank files with the
same header (:func:`rank_file_metadata`).
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from netdist.checkpoint.commit import CommitOutcome, os_errors
from netdist.checkpoint.dtypes import dtype_name
from netdist.checkpoint.metadata import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FileRecord,
    ShardMetadata,
    StateLayout,
    TensorShardSpec,
    rank_file_name,
)
from netdist.checkpoint.planner import Piece, WritePlan, assign_writers, plan_writes
from netdist.checkpoint.storage import TensorSource, write_safetensors
from netdist.errors import CheckpointError
from netdist.trace.recorder import Recorder

__all__ = [
    "SaveResult",
    "SaveTarget",
    "SaveCoordinator",
    "run_save",
    "run_inline",
    "check_rank",
    "check_keep_last",
    "rank_file_metadata",
    "write_rank_file",
    "recorder_of",
]

T = TypeVar("T")


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


def write_rank_file(directory: Path, rank: int, plan: WritePlan,
                    arrays: Mapping[str, np.ndarray],
                    syncing: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
                    ) -> FileRecord:
    """Write ``rank``'s file as ``plan`` lists it (its shards and the replicated tensors
    assigned to it), from ``arrays`` by name; ``syncing`` as for ``write_safetensors``."""
    sources = []
    for item in plan.for_rank(rank):
        array = arrays[item.name]
        dtype = item.dtype or dtype_name(array.dtype)
        sources.append(TensorSource(item.name, dtype, tuple(array.shape), data=array))
    name = rank_file_name(rank)
    size, checksum = write_safetensors(directory / name, sources,
                                       metadata=rank_file_metadata(rank, plan.num_ranks),
                                       syncing=syncing)
    return FileRecord(rank, name, size, checksum)


# --------------------------------------------------------------------------- the save path


def recorder_of(group: Any) -> Recorder | None:
    """The trace recorder of ``group``'s transport (``group.transport.recorder``: a
    ``netdist.Group``'s), or ``None`` for a group-like object without one."""
    recorder = getattr(getattr(group, "transport", None), "recorder", None)
    return recorder if isinstance(recorder, Recorder) else None


@dataclass(frozen=True, slots=True)
class SaveTarget:
    """What one rank's save writes and where, as its coordinator settled it.

    ``specs`` (the same on every rank) and ``arrays`` (this rank's local arrays, by name)
    are the tensors; ``pinned`` names the pieces (``(tensor, piece)``) whose writer is
    fixed (a collective save's diverged replicas, saved from the lowest rank holding
    each): the dedup planner assigns the others. The rank files go into ``directory``
    (a staging directory, or the checkpoint itself when it is written in place), which
    is ``final`` once committed;
    ``step``, ``extra``, ``mesh`` and ``generation`` go into the metadata.
    """

    specs: Mapping[str, TensorShardSpec]
    arrays: Mapping[str, np.ndarray]
    directory: Path
    final: Path
    step: int | None
    extra: Mapping[str, Any]
    mesh: Mapping[str, Any] | None = None
    generation: int = 0
    pinned: Mapping[Piece, int] = field(default_factory=dict)


class SaveCoordinator(abc.ABC):
    """The part of a save that differs between its entry points (module docstring): who
    stages, how the ranks agree on the specs and share their file records, who commits
    and who learns the outcome. :func:`run_save` calls :meth:`settle`, :meth:`run` (to
    write the rank file), :meth:`share`, on the committing rank :meth:`contents` and
    :meth:`commit`, and :meth:`announce`, in that order."""

    def __init__(self, rank: int, world_size: int, recorder: Recorder | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.recorder = recorder
        """Where the save's stages are traced (a ``netdist.trace.Recorder``: the group's
        transport's), or ``None``: not traced."""

    def span(self, name: str, **args: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
        """A trace span (category ``"checkpoint"``) around one stage of the save; the
        block may add to the dict it gets. Nothing without a recorder."""
        if self.recorder is None:
            return contextlib.nullcontext(args)
        return self.recorder.span("checkpoint", name, **args)

    @abc.abstractmethod
    async def run(self, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)``, a blocking call: in a worker thread, or in place."""

    @abc.abstractmethod
    async def settle(self) -> SaveTarget:
        """Prepare the root and the staging directory and agree on what is saved; a
        failure raises (on every rank that has to know)."""

    @abc.abstractmethod
    async def share(self, target: SaveTarget, written: FileRecord | BaseException
                    ) -> Sequence[Any] | None:
        """Make this rank's file record known, or the error its write raised (``written``).
        Raises if a rank's write failed; returns every rank's contribution on the rank
        that commits, ``None`` on the others."""

    @abc.abstractmethod
    def contents(self, found: Sequence[Any]
                 ) -> tuple[tuple[FileRecord, ...], StateLayout | None]:
        """The file records and the state layout that ``metadata.json`` records, from
        what :meth:`share` returned."""

    @abc.abstractmethod
    async def commit(self, target: SaveTarget, metadata: ShardMetadata) -> CommitOutcome:
        """Commit the files in ``target.directory`` with ``metadata``."""

    @abc.abstractmethod
    async def announce(self, outcome: CommitOutcome, error: BaseException | None
                       ) -> CommitOutcome:
        """Tell the ranks what the commit did (``outcome``, or the ``error`` it raised on
        the committing rank); return this rank's outcome, or raise where the save failed."""


async def run_save(coordinator: SaveCoordinator, started: float) -> SaveResult:
    """One rank's save, whatever its entry point: settle, plan once, write, share, commit,
    announce (module docstring). ``started`` (a ``perf_counter`` time) is where
    ``SaveResult.seconds`` counts from."""
    rank, world_size = coordinator.rank, coordinator.world_size
    with coordinator.span("stage") as args:
        target = await coordinator.settle()
        args.update(step=target.step, tensors=len(target.specs))
    with coordinator.span("plan", step=target.step, tensors=len(target.specs)):
        writers = assign_writers(target.specs, world_size, target.pinned)
        plan = plan_writes(target.specs, world_size, writers)  # the one plan of this save
    written: FileRecord | BaseException
    name = rank_file_name(rank)
    try:
        with os_errors(rank, f"write {name} of checkpoint {target.final}"), \
                coordinator.span("write", step=target.step, file=name) as args:
            written = await coordinator.run(
                write_rank_file, target.directory, rank, plan, target.arrays,
                None if coordinator.recorder is None else
                lambda: coordinator.span("fsync", step=target.step, file=name))
            args["bytes"] = written.size
    except Exception as exc:  # the coordinator reports it (to every rank) in share
        written = exc
    found = await coordinator.share(target, written)
    if not isinstance(written, FileRecord):  # pragma: no cover - share raised it
        raise CheckpointError("no shard file was written")
    record = written
    outcome = CommitOutcome(committed=False)
    error: BaseException | None = None
    if found is not None:
        try:
            files, layout = coordinator.contents(found)
            metadata = ShardMetadata(
                num_ranks=world_size, tensor_specs=target.specs, mesh=target.mesh,
                extra=dict(target.extra), step=target.step, writers=plan.writers,
                files=files, generation=target.generation, state=layout)
            with os_errors(rank, f"commit checkpoint {target.final}"), \
                    coordinator.span("commit", step=target.step, files=len(files)):
                outcome = await coordinator.commit(target, metadata)
        except Exception as exc:  # the coordinator reports it in announce
            error = exc
    outcome = await coordinator.announce(outcome, error)
    return SaveResult(target.final, rank, target.final / record.name, record.size,
                      outcome.committed, target.step, time.perf_counter() - started,
                      latest_updated=outcome.latest_updated, warnings=outcome.warnings)


def run_inline(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to its end in the calling thread, without an event loop.

    For a save whose coordinator never waits for anything (the per-rank API: every step
    is a blocking call made in place), so that synchronous callers, event loop or not,
    share the one save path. A coroutine that does suspend is closed and raises
    ``RuntimeError``.
    """
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise RuntimeError("a checkpoint save run in place tried to wait for an event loop")
