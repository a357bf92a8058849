"""Collective checkpoints over a ``Group``: ``await save(state, dir, group)`` / ``await load``.

``state`` is any tree of dicts, lists and tuples holding model parameters (arrays,
replicated on every rank, or :class:`ShardedArray` shards), optimizer state (moments,
step counts, param groups), step/epoch counters and NumPy RNGs (``np.random.Generator``
objects or ``bit_generator.state`` dicts; 128-bit integers are stored exactly).

Save protocol (every rank calls ``save`` with the same tree structure; the commit
itself, its crash points and the recovery rules are in :mod:`netdist.checkpoint.commit`;
the steps are those of the one save path, :mod:`netdist.checkpoint.writing`'s
``run_save``, with this module supplying the gathers, the broadcast and rank 0's part):

1. rank 0 renames back a checkpoint a crashed save left aside, removes the rest of what
   crashed saves left behind (staging directories, incomplete ``step_*`` directories,
   trash, temp files), picks the step and creates a staging directory
   ``.step_N.tmp-<random>``; every rank describes its tensors and plain values; one
   ``all_gather_object`` gives every rank the same picture, from which each computes the
   same shard specs and dedup plan;
2. each rank writes its ``rank_XXXXX.safetensors`` into the staging directory (temp,
   fsync, rename, fsync dir) in a worker thread while the event loop keeps running;
3. a second ``all_gather_object`` brings every file's size and checksums to rank 0,
   which writes ``metadata.json`` into the staging directory, renames it to ``step_N``
   - the commit point; an existing ``step_N`` is renamed aside just before and deleted
   just after - then rewrites ``latest`` and rotates to ``keep_last``; a
   ``broadcast_object`` tells everyone.

A failure on any rank before the commit point (bad input, full disk, too many open
files) is reported on every rank, naming the rank(s), their errors and, for OS errors,
the file; nothing is committed and the previous checkpoint of every step stays as it
was. A failure after it (``latest`` or rotation, e.g. a disk that filled up just then)
does not fail the save: every rank's ``SaveResult`` says what was skipped
(``latest_updated``, ``warnings``) and rank 0 logs it. A SIGKILL at any moment leaves
the previous checkpoint or the new one committed.

Per-rank plain values (policy on a world-size change): values that are equal on every
rank (step, epoch, param groups, a shared RNG) are stored once and every rank of any
world size gets them. Values that differ between ranks (a per-rank RNG, a per-rank data
cursor) are stored per rank; a load with the same world size gives each rank its own;
with a different world size ``rank_objects`` (:class:`RankObjects`, or its string value)
decides: ``ERROR`` (``"error"``, default) refuses and names the keys, ``LIKE`` keeps the
caller's current value from ``like`` (e.g. freshly seeded per-rank RNGs), ``MODULO`` gives
new rank ``r`` old rank ``r % old_size``'s value, ``RANK0`` gives everyone old rank 0's
value.

What the ranks exchange is in :mod:`netdist.checkpoint.summary`; what ``group`` must
offer is :class:`netdist.checkpoint.group_like.GroupLike`.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from netdist import errors
from netdist.checkpoint.commit import (CommitOutcome, commit_step, create_staging,
                                       describe_os_error, ensure_root, os_errors, tidy_root)
from netdist.checkpoint.dtypes import dtype_name
from netdist.checkpoint.group_like import GroupLike
from netdist.checkpoint.metadata import (
    METADATA_FILE,
    FileRecord,
    ShardMetadata,
    StateLayout,
    step_dir_name,
)
from netdist.checkpoint.options import RankObjects, ReplicaCheck, parse_option
from netdist.checkpoint.planner import Piece, plan_reads
from netdist.checkpoint.reading import CheckpointReader, resolve_checkpoint
from netdist.checkpoint.restore import (
    RANK_OBJECT_POLICIES,
    check_rank_objects,
    plan_restore,
)
from netdist.checkpoint.state import (ShardedArray, flatten_state, leaf_array, mesh_position,
                                     state_summary)
from netdist.checkpoint.storage import check_file_sizes, read_metadata_text
from netdist.checkpoint.summary import (
    MeshPlace,
    RankFailure,
    RankSummary,
    TensorSummary,
    checkpoint_mesh,
    describe_diverged,
    extent_from_wire,
    merge_rank_summaries,
    shard_extent,
)
from netdist.checkpoint.writing import (SaveCoordinator, SaveResult, SaveTarget,
                                        check_keep_last, recorder_of, run_save)
from netdist.errors import CheckpointError, CheckpointMismatchError, ConfigError
from netdist.sharding import Replicate, TensorShardSpec

__all__ = ["save", "load", "GroupLike", "RankObjects", "RANK_OBJECT_POLICIES", "ReplicaCheck",
           "ReplicaDivergenceWarning"]

T = TypeVar("T")


class ReplicaDivergenceWarning(UserWarning):
    """A replicated tensor differed between ranks at save time (``ReplicaCheck.WARN``)."""


def _replica_check(value: ReplicaCheck | str | bool) -> ReplicaCheck:
    """``True``/``False`` are shorthands for ``ERROR``/``OFF``."""
    if value is True:
        return ReplicaCheck.ERROR
    if value is False:
        return ReplicaCheck.OFF
    try:
        return parse_option(value, ReplicaCheck, "check_replicated", "save")
    except ConfigError as exc:
        raise ConfigError(f"{exc}; True and False stand for 'error' and 'off'") from None


def _describe(exc: BaseException) -> dict[str, str]:
    return RankFailure.of(exc).to_wire()


def _raise_gathered(op: str, statuses: Sequence[Any], rank: int,
                    local: BaseException | None) -> None:
    """Fail together: if any rank reported an error, raise on every rank.

    The failing rank raises its own exception (an ``OSError`` as the ``CheckpointError``
    it causes, naming the rank and the file: every phase that touches files runs under
    ``os_errors``, and this is the backstop); the others raise the failing rank's
    ``CheckpointError`` subclass, naming every failed rank.
    """
    reported = [(r, RankFailure.from_wire(s)) for r, s in enumerate(statuses)]
    failed = [(r, f) for r, f in reported if f is not None]
    if not failed:
        return
    if isinstance(local, OSError) and not isinstance(local, errors.NetdistError):
        raise CheckpointError(f"rank {rank}: {op} failed: {describe_os_error(local)}") \
            from local
    if local is not None:
        raise local
    names = ", ".join(str(r) for r, _ in failed)
    detail = "; ".join(f"rank {r}: {f.type}: {f.message}" for r, f in failed)
    cls = getattr(errors, failed[0][1].type, None)
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = CheckpointError
    raise cls(f"{op} failed on rank(s) {names} (seen from rank {rank}): {detail}")


def _prepare_root(root: Path, step: int | None, overwrite: bool) -> tuple[int, str]:
    """Rank 0, before anyone writes: recover and clean up after crashed saves, pick the
    step, create its staging directory; returns the step and the staging name."""
    with os_errors(0, f"prepare checkpoint root {root}"):
        ensure_root(root)
        scan = tidy_root(root)
    newest = scan.newest()
    if step is None:
        step = newest + 1 if newest is not None else 0
    elif step in scan.committed and not overwrite:
        raise CheckpointError(
            f"{scan.committed[step]} already holds a complete checkpoint (the newest "
            f"complete step in {root} is {newest}); pass overwrite=True to replace it")
    elif newest is not None and step < newest and not overwrite:
        raise CheckpointError(
            f"step {step} is older than the newest complete checkpoint in {root} (step "
            f"{newest}): a resumed job continues from step {newest} and would never load "
            f"this one; save a step after {newest}, or pass overwrite=True to save it anyway")
    with os_errors(0, f"prepare checkpoint {root / step_dir_name(step)}"):
        staging = create_staging(root, step, secrets.token_hex(8))
    return step, staging.name


async def _discard(staging: Path) -> None:
    """Rank 0, once every rank is done with it: delete a save's staging directory."""
    await asyncio.to_thread(shutil.rmtree, staging, True)


def _shared(value: Any) -> bool:
    """Whether other ranks hold the same piece as this leaf (a replicated tensor, or a
    mesh piece replicated along a mesh dim of more than one rank)."""
    if not isinstance(value, ShardedArray):
        return True
    return value.on_mesh and any(isinstance(p, Replicate) and n > 1 for p, n in
                                 zip(value.placements or (), value.mesh.shape))


def _local_summary(state: Any, check: ReplicaCheck
                   ) -> tuple[RankSummary, dict[str, np.ndarray]]:
    """This rank's :class:`RankSummary` of ``state`` and its tensors as arrays by name
    (a torch ``DTensor`` as its local tensor, placed on its mesh)."""
    flat = flatten_state(state)
    tensors = {}
    arrays: dict[str, np.ndarray] = {}
    for name, value in flat.tensors.items():
        place = None
        if isinstance(value, ShardedArray):
            array, dim = leaf_array(value.data, name), value.shard_dim
            place = MeshPlace.of(value) if value.on_mesh else None
        else:
            array, dim = leaf_array(value, name), None
        crc = None
        if check is not ReplicaCheck.OFF and _shared(value):
            crc = zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        tensors[name] = TensorSummary(dtype_name(array.dtype), tuple(array.shape), dim, crc,
                                      place)
        arrays[name] = array
    return RankSummary(tensors, state_summary(flat)), arrays


def _mesh_record(mesh: Any) -> Mapping[str, Any] | None:
    """``save``'s ``mesh=`` as ``metadata.json`` records it: a mapping as it is, a
    ``MeshPosition`` (or a ``DeviceMesh``, by its ``position``) as ``{"shape", "names"}``."""
    if mesh is None or isinstance(mesh, Mapping):
        return mesh
    position = mesh_position(mesh)
    return {"shape": list(position.shape), "names": list(position.names)}


def _saved_mesh(summaries: Sequence[RankSummary], given: Mapping[str, Any] | None
                ) -> Mapping[str, Any] | None:
    """The mesh ``metadata.json`` records: the one the mesh-placed tensors sit on (which
    a ``mesh=`` given to ``save`` must then name alike), else ``given`` as it is."""
    found = checkpoint_mesh(summaries)
    if found is None:
        return given
    if given is not None and dict(given) != found:
        raise CheckpointMismatchError(f"save(mesh={dict(given)!r}) differs from the mesh the "
                                      f"tensors are placed on, {found}")
    return found


def _pin_diverged(specs: Mapping[str, TensorShardSpec], diverged: Mapping[str, list[int]],
                  num_ranks: int) -> dict[Piece, int]:
    """Every shared piece of a tensor whose copies differ is saved from the lowest rank
    holding it (rank 0 for a replicated tensor)."""
    pinned: dict[Piece, int] = {}
    for name in diverged:
        for piece, holders in enumerate(specs[name].piece_holders(num_ranks)):
            if len(holders) > 1:
                pinned[name, piece] = holders[0]
    return pinned


async def save(state: Any, dir: str | os.PathLike[str], group: GroupLike, *,
               step: int | None = None,
               keep_last: int | None = None, overwrite: bool = False,
               extra: Mapping[str, Any] | None = None, mesh: Any = None,
               check_replicated: ReplicaCheck | str | bool = ReplicaCheck.WARN,
               timeout: float | None = None) -> SaveResult:
    """Save ``state`` collectively as ``dir/step_N`` (every rank of ``group`` calls this).

    ``step`` defaults to one past the newest complete checkpoint - the step ``load``
    resumes from - so a restarted job always saves forward. An explicit ``step`` that
    already holds a complete checkpoint, or that is older than the newest complete one
    (a resumed job would never load it), raises ``CheckpointError`` unless
    ``overwrite=True``; with it, the old ``step_N`` stays loadable and unchanged until
    the new one is committed. ``keep_last=K`` keeps the K newest complete checkpoints
    (and the one just saved). Plain arrays and torch tensors are replicated (equal on all
    ranks, written once; torch tensors that are the same view of one memory, like tied
    weights, are one tensor); ``check_replicated`` (:class:`ReplicaCheck`, default
    ``WARN``) says what happens when their copies differ; wrap a shard in
    :class:`ShardedArray`. Stateful objects (a torch module or optimizer,
    :class:`RNGState`) are saved as their ``state_dict()``; torch tensors are written
    from their own memory (CPU only; no copy unless non-contiguous). ``timeout`` bounds
    each collective step. ``group`` is a :class:`netdist.Group` or anything else
    :class:`GroupLike`. Returns this rank's :class:`SaveResult`; raises
    ``CheckpointError`` (or a subclass) on every rank if any rank fails (an OS error
    names the rank and the file; a ``dir`` that is a file says it is not a directory),
    and then nothing is committed. A ``ShardedArray`` placed on a mesh (or a torch
    ``DTensor``) is saved with its placements; each distinct piece is written once, by
    one of the ranks holding it, and ``metadata.json`` records the mesh (``mesh``, when
    given, must then name the same ``{"shape", "names"}``; a ``MeshPosition`` or a
    ``DeviceMesh`` stands for its shape and names). Once the checkpoint is committed it
    returns: a ``latest`` that could not be rewritten or an old checkpoint that could not
    be rotated away is in the result's ``latest_updated`` / ``warnings``. Cancelling (or a
    timeout) before the commit leaves a hidden staging directory, which is never loaded
    and is removed by the next save (a shard write already running in its thread
    completes in the background).
    """
    started = time.perf_counter()
    check_keep_last(keep_last)
    check = _replica_check(check_replicated)
    coordinator = _GroupSave(state, Path(dir), group, step=step, keep_last=keep_last,
                             overwrite=overwrite, extra=extra, mesh=_mesh_record(mesh),
                             check=check, timeout=timeout)
    return await run_save(coordinator, started)


class _GroupSave(SaveCoordinator):
    """The collective save's part of the one save path (:func:`run_save`; the protocol
    is the module docstring's): rank 0 prepares the root and the staging directory, one
    ``all_gather_object`` gives every rank the same specs before the plan and another
    brings every file record to rank 0, which commits and broadcasts the outcome. A
    failure on any rank is sent in place of its contribution, so every rank fails
    together. Blocking steps run in worker threads while the event loop keeps running."""

    def __init__(self, state: Any, root: Path, group: GroupLike, *, step: int | None,
                 keep_last: int | None, overwrite: bool, extra: Mapping[str, Any] | None,
                 mesh: Mapping[str, Any] | None, check: ReplicaCheck,
                 timeout: float | None) -> None:
        super().__init__(group.rank, group.world_size, recorder_of(group))
        self.state = state
        self.root = root
        self.group = group
        self.step = step
        self.keep_last = keep_last
        self.overwrite = overwrite
        self.extra = extra
        self.mesh = mesh
        self.check = check
        self.timeout = timeout
        self.layout: StateLayout | None = None

    async def run(self, fn: Callable[..., T], /, *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    async def settle(self) -> SaveTarget:
        root, rank = self.root, self.rank
        local_error: BaseException | None = None
        arrays: dict[str, np.ndarray] = {}
        mine: dict[str, Any]
        created: str | None = None  # rank 0: the staging directory it made
        try:
            with os_errors(rank, "describe the state to save"):
                # in a thread: the replica check reads every replicated tensor once
                summary, arrays = await asyncio.to_thread(_local_summary, self.state,
                                                          self.check)
            if rank == 0:
                chosen_step, created = await asyncio.to_thread(_prepare_root, root,
                                                               self.step, self.overwrite)
                summary = replace(summary, step=chosen_step, staging=created)
            mine = summary.to_wire()
        except Exception as exc:  # reported to every rank below
            local_error = exc
            mine = _describe(exc)
        gathered = await self.group.all_gather_object(mine, timeout=self.timeout)
        if created is not None and any(RankFailure.from_wire(g) for g in gathered):
            await _discard(root / created)
        _raise_gathered("checkpoint save", gathered, rank, local_error)
        summaries = [RankSummary.from_wire(g) for g in gathered]
        chosen, staged_as = summaries[0].step, summaries[0].staging
        if chosen is None or staged_as is None:  # pragma: no cover - rank 0 always sends them
            raise CheckpointError("checkpoint save: rank 0 sent no step or staging directory")
        staging = root / staged_as
        try:
            specs, self.layout, diverged = merge_rank_summaries(summaries, self.check)
            mesh = _saved_mesh(summaries, self.mesh)
        except CheckpointError:
            if rank == 0:
                await _discard(staging)
            raise
        # ReplicaCheck.WARN: every rank warns, rank 0's copy (the lowest holder's of each
        # mesh piece) is the one saved
        pinned = _pin_diverged(specs, diverged, self.world_size)
        if diverged:
            placed = {name for name in diverged if specs[name].mesh is not None}
            warnings.warn(ReplicaDivergenceWarning(
                f"checkpoint step {chosen}: replicated tensors differ between ranks: "
                f"{describe_diverged(diverged, placed=placed)}; saving rank 0's copy of each "
                f"(of a mesh-placed tensor, the lowest holding rank's copy of each piece; "
                f"check_replicated='error' refuses instead)"),
                stacklevel=4)  # the caller of save (through run_save)
        return SaveTarget(specs, arrays, staging, root / step_dir_name(chosen), chosen,
                          self.extra or {}, mesh=mesh, pinned=pinned)

    async def share(self, target: SaveTarget, written: FileRecord | BaseException
                    ) -> list[Any] | None:
        local_error: BaseException | None = None
        if isinstance(written, BaseException):
            local_error, manifest = written, _describe(written)
        else:
            manifest = written.to_json()
        manifests = await self.group.all_gather_object(manifest, timeout=self.timeout)
        if self.rank == 0 and any(RankFailure.from_wire(m) for m in manifests):
            await _discard(target.directory)
        _raise_gathered("checkpoint save", manifests, self.rank, local_error)
        return manifests if self.rank == 0 else None

    def contents(self, found: Sequence[Any]
                 ) -> tuple[tuple[FileRecord, ...], StateLayout | None]:
        return tuple(FileRecord.from_json(m) for m in found), self.layout

    async def commit(self, target: SaveTarget, metadata: ShardMetadata) -> CommitOutcome:
        return await asyncio.to_thread(commit_step, self.root, target.directory, metadata,
                                       keep_last=self.keep_last, exclusive=False)

    async def announce(self, outcome: CommitOutcome, error: BaseException | None
                       ) -> CommitOutcome:
        status: dict[str, Any] = {"ok": True}
        if error is not None:
            status = _describe(error)
        elif self.rank == 0:
            # committed: what the housekeeping after the commit skipped goes to every rank
            status = {"ok": True, "latest_updated": outcome.latest_updated,
                      "warnings": list(outcome.warnings)}
        status = await self.group.broadcast_object(status, 0, timeout=self.timeout)
        _raise_gathered("checkpoint commit", [status], self.rank, error)
        return CommitOutcome(self.rank == 0,
                             bool(status.get("latest_updated", False)),
                             tuple(str(w) for w in status.get("warnings", ())))


# --------------------------------------------------------------------------- load


async def load(dir: str | os.PathLike[str], group: GroupLike, *, like: Any = None,
               step: int | None = None, verify: bool = True, strict: bool = True,
               rank_objects: RankObjects | str = RankObjects.ERROR,
               timeout: float | None = None, threads: int | None = None) -> Any:
    """Load a checkpoint collectively, resharding to ``group``'s world size.

    ``dir`` is a checkpoint root (``latest`` or ``step`` picks the checkpoint) or a
    checkpoint directory. With ``like`` (this rank's current state), arrays and torch
    tensors are filled **in place** (a ``ShardedArray`` receives the region its rank
    covers in the new layout, so shards may be uneven or along another dim than saved),
    generators are restored in place, stateful objects (a torch module or optimizer,
    :class:`RNGState`) get the saved state through ``load_state_dict()`` - tensors they
    hold filled in place, lazily created ones (an optimizer's momentum buffers) created -
    and the result has ``like``'s structure (:mod:`netdist.checkpoint.restore`). Without
    it the saved structure is rebuilt with fresh arrays (torch tensors where torch
    tensors were saved; tied ones as one tensor), sharded tensors re-split with
    ``chunk_sizes`` as ``ShardedArray``. ``rank_objects`` (:class:`RankObjects`) is the
    world-size-change policy for per-rank values (module docstring). Errors on any rank
    are raised on every rank (an OS error as ``CheckpointError`` naming the rank and the
    file).
    """
    policy = check_rank_objects(rank_objects)
    rank, world_size = group.rank, group.world_size
    found: dict[str, Any]
    local_error: BaseException | None = None
    if rank == 0:
        try:
            with os_errors(rank, f"read the checkpoint metadata in {dir}"):
                directory = await asyncio.to_thread(resolve_checkpoint, dir, step)
                text = await asyncio.to_thread(read_metadata_text, directory)
            found = {"path": str(directory), "metadata": text}
        except Exception as exc:
            local_error = exc
            found = _describe(exc)
    else:
        found = {}
    found = await group.broadcast_object(found, 0, timeout=timeout)
    _raise_gathered("checkpoint load", [found], rank, local_error)
    directory = Path(found["path"])

    status: dict[str, Any] = {"ok": True}
    metadata: ShardMetadata | None = None
    try:
        metadata = ShardMetadata.loads(found["metadata"], str(directory / METADATA_FILE))
        extents = {}
        if like is not None:  # stateful objects expanded: shards they hold count too
            leaves = flatten_state(like, merge_views=False).tensors
            extents = {name: shard_extent(value) for name, value in leaves.items()
                       if isinstance(value, ShardedArray)}
        status = {"extents": {name: e.to_wire() for name, e in extents.items()}}
    except Exception as exc:
        local_error, status = exc, _describe(exc)
    gathered = await group.all_gather_object(status, timeout=timeout)
    _raise_gathered("checkpoint load", gathered, rank, local_error)
    status = {"ok": True}
    if metadata is None:  # pragma: no cover - a failed parse raised above
        raise CheckpointError("metadata missing")

    result: Any = None
    try:
        every_extent = [{name: extent_from_wire(e) for name, e in g["extents"].items()}
                        for g in gathered]
        with os_errors(rank, f"read checkpoint {directory}"):
            # every rank file must hold what the metadata records before buffers are sized
            await asyncio.to_thread(check_file_sizes, directory, metadata,
                                    [record.rank for record in metadata.files])
            restore = plan_restore(metadata, like, rank, world_size, strict=strict,
                                   rank_objects=policy, extents=every_extent)
            plan = plan_reads(metadata.tensor_specs, metadata.writers, restore.wanted)
            await asyncio.to_thread(_read, directory, metadata, plan, restore.dests, verify,
                                    threads)
            result = await asyncio.to_thread(restore.complete)
    except Exception as exc:
        local_error, status = exc, _describe(exc)
    statuses = await group.all_gather_object(status, timeout=timeout)
    _raise_gathered("checkpoint load", statuses, rank, local_error)
    return result


def _read(directory: Path, metadata: ShardMetadata, plan: Any, dests: Any, verify: bool,
          threads: int | None) -> None:
    with CheckpointReader(directory, metadata, verify=verify) as reader:
        reader.read(plan, dests, threads=threads)
