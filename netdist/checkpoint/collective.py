"""Collective checkpoints over a ``Group``: ``await save(state, dir, group)`` / ``await load``.

``state`` is any tree of dicts, lists and tuples holding model parameters (arrays,
replicated on every rank, or :class:`ShardedArray` shards), optimizer state (moments,
step counts, param groups), step/epoch counters and NumPy RNGs (``np.random.Generator``
objects or ``bit_generator.state`` dicts; 128-bit integers are stored exactly).

Save protocol (every rank calls ``save`` with the same tree structure; the commit
itself, its crash points and the recovery rules are in :mod:`netdist.checkpoint.commit`):

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

A failure on any rank (bad input, full disk, too many open files) is reported on every
rank, naming the rank(s), their errors and, for OS errors, the file; nothing is
committed and the previous checkpoint of every step stays as it was. A SIGKILL at any
moment has the same effect, or leaves the new checkpoint committed.

Per-rank plain values (policy on a world-size change): values that are equal on every
rank (step, epoch, param groups, a shared RNG) are stored once and every rank of any
world size gets them. Values that differ between ranks (a per-rank RNG, a per-rank data
cursor) are stored per rank; a load with the same world size gives each rank its own;
with a different world size ``rank_objects`` decides: ``"error"`` (default) refuses and
names the keys, ``"like"`` keeps the caller's current value from ``like`` (e.g. freshly
seeded per-rank RNGs), ``"modulo"`` gives new rank ``r`` old rank ``r % old_size``'s value,
``"rank0"`` gives everyone old rank 0's value.
"""

from __future__ import annotations

import asyncio
import enum
import os
import secrets
import shutil
import time
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from netdist import errors
from netdist.checkpoint.api import (
    CheckpointReader,
    SaveResult,
    check_keep_last,
    resolve_checkpoint,
    write_rank_file,
)
from netdist.checkpoint.commit import commit_step, create_staging, os_errors, tidy_root
from netdist.checkpoint.dtypes import dtype_name
from netdist.checkpoint.metadata import (
    METADATA_FILE,
    FileRecord,
    ShardMetadata,
    StateLayout,
    TensorShardSpec,
    rank_file_name,
    step_dir_name,
)
from netdist.checkpoint.planner import assign_writers, plan_reads
from netdist.checkpoint.restore import (
    RANK_OBJECT_POLICIES,
    check_rank_objects,
    leaf_array,
    plan_restore,
)
from netdist.checkpoint.state import (ShardedArray, flatten_state, merge_summaries,
                                      state_summary)
from netdist.checkpoint.storage import check_file_sizes, read_metadata_text
from netdist.errors import CheckpointError, CheckpointMismatchError

__all__ = ["save", "load", "RANK_OBJECT_POLICIES", "ReplicaCheck", "ReplicaDivergenceWarning"]

class ReplicaCheck(str, enum.Enum):
    """What a collective ``save`` does about replicated tensors (plain arrays and torch
    tensors, assumed equal on every rank and written once) that differ between ranks,
    such as BatchNorm running statistics that no collective keeps in sync.

    ``WARN`` (default) and ``ERROR`` compare a CRC-32 of every replicated tensor across
    ranks (one extra pass over the bytes of each, no extra communication beyond the
    plan's ``all_gather_object``). ``WARN`` issues a :class:`ReplicaDivergenceWarning`
    on every rank naming the tensors and the ranks that differ, and saves **rank 0's**
    copy of each; ``ERROR`` raises ``CheckpointMismatchError`` on every rank and writes
    nothing. ``OFF`` skips the comparison (the writer rank's copy is saved unchecked).
    """

    OFF = "off"
    WARN = "warn"
    ERROR = "error"


class ReplicaDivergenceWarning(UserWarning):
    """A replicated tensor differed between ranks at save time (``ReplicaCheck.WARN``)."""


def _replica_check(value: ReplicaCheck | str | bool) -> ReplicaCheck:
    """``True``/``False`` are shorthands for ``ERROR``/``OFF``."""
    if value is True:
        return ReplicaCheck.ERROR
    if value is False:
        return ReplicaCheck.OFF
    try:
        return ReplicaCheck(value)
    except ValueError:
        raise ValueError(f"check_replicated must be one of "
                         f"{[c.value for c in ReplicaCheck]} or a bool, got {value!r}") from None


def _describe(exc: BaseException) -> dict[str, str]:
    return {"error": f"{exc}", "type": type(exc).__name__}


def _raise_gathered(op: str, statuses: list[Any], rank: int,
                    local: BaseException | None) -> None:
    """Fail together: if any rank reported an error, raise on every rank."""
    failed = [(r, s) for r, s in enumerate(statuses) if isinstance(s, dict) and "error" in s]
    if not failed:
        return
    if local is not None:
        raise local
    names = ", ".join(str(r) for r, _ in failed)
    detail = "; ".join(f"rank {r}: {s['type']}: {s['error']}" for r, s in failed)
    cls = getattr(errors, failed[0][1].get("type", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = CheckpointError
    raise cls(f"{op} failed on rank(s) {names} (seen from rank {rank}): {detail}")


def _prepare_root(root: Path, step: int | None, overwrite: bool) -> tuple[int, str]:
    """Rank 0, before anyone writes: recover and clean up after crashed saves, pick the
    step, create its staging directory; returns the step and the staging name."""
    with os_errors(0, f"prepare checkpoint root {root}"):
        root.mkdir(parents=True, exist_ok=True)
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


def _local_summary(state: Any, check: ReplicaCheck) -> tuple[dict[str, Any], Any]:
    flat = flatten_state(state)
    tensors = {}
    arrays: dict[str, np.ndarray] = {}
    for name, value in flat.tensors.items():
        if isinstance(value, ShardedArray):
            array, dim = leaf_array(value.data, name), value.shard_dim
        else:
            array, dim = leaf_array(value, name), None
        entry: list[Any] = [dtype_name(array.dtype), list(array.shape), dim]
        if check is not ReplicaCheck.OFF and dim is None:
            entry.append(zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data))
        tensors[name] = entry
        arrays[name] = array
    return {"tensors": tensors, **state_summary(flat)}, arrays


def _merge(summaries: list[dict[str, Any]], check: ReplicaCheck = ReplicaCheck.OFF
           ) -> tuple[dict[str, TensorShardSpec], StateLayout, dict[str, list[int]]]:
    """Every rank's summary -> one set of specs, the state layout and the replicated
    tensors whose copies differ (name -> the ranks whose copy differs from rank 0's);
    the same on all ranks. ``ReplicaCheck.ERROR`` raises on a difference instead."""
    layout = merge_summaries(summaries)
    first = summaries[0]
    specs = {}
    diverged: dict[str, list[int]] = {}
    for name, (dtype, shape, dim, *_) in first["tensors"].items():
        entries = [s["tensors"][name] for s in summaries]
        for rank, (d2, s2, dim2, *_) in enumerate(entries):
            if d2 != dtype or dim2 != dim:
                raise CheckpointMismatchError(
                    f"{name!r}: rank {rank} has dtype {d2} shard_dim {dim2}, rank 0 has "
                    f"dtype {dtype} shard_dim {dim}")
        if dim is None:
            for rank, (_, s2, _, *crc) in enumerate(entries):
                if s2 != shape:
                    raise CheckpointMismatchError(f"replicated {name!r}: rank {rank} has "
                                                  f"shape {s2}, rank 0 has {shape}")
                if crc and crc != entries[0][3:]:
                    diverged.setdefault(name, []).append(rank)
            specs[name] = TensorShardSpec.replicated(shape, dtype)
            continue
        for rank, (_, s2, _, *_) in enumerate(entries):
            if len(s2) != len(shape) or any(a != b for i, (a, b) in enumerate(zip(s2, shape))
                                             if i != dim):
                raise CheckpointMismatchError(f"sharded {name!r}: rank {rank} has shape {s2}, "
                                              f"incompatible with rank 0's {shape} "
                                              f"(only dim {dim} may differ)")
        sizes = tuple(e[1][dim] for e in entries)
        full = list(shape)
        full[dim] = sum(sizes)
        specs[name] = TensorShardSpec(tuple(full), dim, sizes, dtype)
    if diverged and check is ReplicaCheck.ERROR:
        raise CheckpointMismatchError(
            f"replicated tensors differ between ranks: {_describe_diverged(diverged)}; "
            f"nothing was saved (sync them first, e.g. broadcast or all-reduce buffers, "
            f"shard them with ShardedArray, or pass check_replicated='warn' to save rank "
            f"0's copy)")
    return specs, layout, diverged


def _describe_diverged(diverged: Mapping[str, list[int]], limit: int = 8) -> str:
    names = sorted(diverged)
    parts = [f"{name!r} differs between rank 0 and "
             f"{'rank' if len(diverged[name]) == 1 else 'ranks'} "
             f"{', '.join(str(r) for r in diverged[name])}" for name in names[:limit]]
    if len(names) > limit:
        parts.append(f"and {len(names) - limit} more")
    return "; ".join(parts)


async def save(state: Any, dir: str | os.PathLike[str], group: Any, *, step: int | None = None,
               keep_last: int | None = None, overwrite: bool = False,
               extra: Mapping[str, Any] | None = None, mesh: Mapping[str, Any] | None = None,
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
    each collective step. Returns this rank's :class:`SaveResult`; raises ``CheckpointError`` (or a subclass) on every rank if any
    rank fails, and then nothing is committed. Cancelling (or a timeout) before the
    commit leaves a hidden staging directory, which is never loaded and is removed by
    the next save (a shard write already running in its thread completes in the
    background).
    """
    started = time.perf_counter()
    check_keep_last(keep_last)
    check = _replica_check(check_replicated)
    root = Path(dir)
    rank, world_size = group.rank, group.world_size
    local_error: BaseException | None = None
    arrays: dict[str, np.ndarray] = {}
    summary: dict[str, Any]
    try:
        # in a thread: the replica check reads every replicated tensor once
        summary, arrays = await asyncio.to_thread(_local_summary, state, check)
        if rank == 0:
            summary["step"], summary["staging"] = await asyncio.to_thread(
                _prepare_root, root, step, overwrite)
    except Exception as exc:  # reported to every rank below
        local_error = exc
        summary = _describe(exc)
    summaries = await group.all_gather_object(summary, timeout=timeout)
    if rank == 0 and "staging" in summary and any("error" in s for s in summaries):
        await _discard(root / summary["staging"])
    _raise_gathered("checkpoint save", summaries, rank, local_error)
    chosen = summaries[0]["step"]
    staging = root / summaries[0]["staging"]
    final = root / step_dir_name(chosen)
    try:
        specs, layout, diverged = _merge(summaries, check)
    except CheckpointError:
        if rank == 0:
            await _discard(staging)
        raise
    writers = assign_writers(specs, world_size)
    if diverged:  # ReplicaCheck.WARN: every rank warns, rank 0's copy is the one saved
        writers.update((name, 0) for name in diverged)
        warnings.warn(ReplicaDivergenceWarning(
            f"checkpoint step {chosen}: replicated tensors differ between ranks: "
            f"{_describe_diverged(diverged)}; saving rank 0's copy of each "
            f"(check_replicated='error' refuses instead)"), stacklevel=2)

    record: FileRecord | None = None
    manifest: dict[str, Any]
    try:
        with os_errors(rank, f"write {rank_file_name(rank)} of checkpoint {final}"):
            record = await asyncio.to_thread(write_rank_file, staging, rank, world_size,
                                             specs, writers, arrays)
        manifest = record.to_json()
    except Exception as exc:
        local_error = exc
        manifest = _describe(exc)
    manifests = await group.all_gather_object(manifest, timeout=timeout)
    if rank == 0 and any("error" in m for m in manifests):
        await _discard(staging)
    _raise_gathered("checkpoint save", manifests, rank, local_error)

    status: dict[str, Any] = {"ok": True}
    if rank == 0:
        try:
            metadata = ShardMetadata(
                num_ranks=world_size, tensor_specs=specs, mesh=mesh, extra=dict(extra or {}),
                step=chosen, writers=writers,
                files=tuple(FileRecord.from_json(m) for m in manifests), state=layout)
            with os_errors(rank, f"commit checkpoint {final}"):
                await asyncio.to_thread(commit_step, root, staging, metadata,
                                        keep_last=keep_last, exclusive=False)
        except Exception as exc:
            local_error = exc
            status = _describe(exc)
    status = await group.broadcast_object(status, 0, timeout=timeout)
    _raise_gathered("checkpoint commit", [status], rank, local_error)
    if record is None:  # pragma: no cover - every path without a record raised above
        raise CheckpointError("no shard file was written")
    return SaveResult(final, rank, final / rank_file_name(rank), record.size,
                      rank == 0, chosen, time.perf_counter() - started)


# --------------------------------------------------------------------------- load


async def load(dir: str | os.PathLike[str], group: Any, *, like: Any = None,
               step: int | None = None, verify: bool = True, strict: bool = True,
               rank_objects: str = "error", timeout: float | None = None,
               threads: int | None = None) -> Any:
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
    ``chunk_sizes`` as ``ShardedArray``. ``rank_objects`` is the world-size-change policy
    for per-rank values (module docstring). Errors on any rank are raised on every rank.
    """
    check_rank_objects(rank_objects)
    rank, world_size = group.rank, group.world_size
    found: dict[str, Any]
    local_error: BaseException | None = None
    if rank == 0:
        try:
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

    extents: dict[str, list[int]] = {}
    status: dict[str, Any] = {"ok": True}
    metadata: ShardMetadata | None = None
    try:
        metadata = ShardMetadata.loads(found["metadata"], str(directory / METADATA_FILE))
        if like is not None:
            for name, value in flatten_state(like, keep_statefuls=True).tensors.items():
                if isinstance(value, ShardedArray):
                    extents[name] = [value.shard_dim, int(value.data.shape[value.shard_dim])]
    except Exception as exc:
        local_error, status = exc, _describe(exc)
    gathered = await group.all_gather_object({"extents": extents, **status}, timeout=timeout)
    _raise_gathered("checkpoint load", gathered, rank, local_error)
    if metadata is None:  # pragma: no cover - a failed parse raised above
        raise CheckpointError("metadata missing")

    result: Any = None
    try:
        # every rank file must hold what the metadata records before buffers are sized
        await asyncio.to_thread(check_file_sizes, directory, metadata,
                                [record.rank for record in metadata.files])
        restore = plan_restore(metadata, like, rank, world_size, strict=strict,
                               rank_objects=rank_objects,
                               extents=[g["extents"] for g in gathered])
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
