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
import json
import os
import secrets
import shutil
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from netdist import errors
from netdist.checkpoint.api import (
    CheckpointReader,
    SaveResult,
    _as_array,
    check_destination,
    check_keep_last,
    resolve_checkpoint,
    write_rank_file,
)
from netdist.checkpoint.commit import commit_step, create_staging, os_errors, tidy_root
from netdist.checkpoint.metadata import (
    METADATA_FILE,
    FileRecord,
    ShardMetadata,
    StateLayout,
    TensorShardSpec,
    decode_object,
    encode_object,
    rank_file_name,
    step_dir_name,
)
from netdist.checkpoint.planner import Box, assign_writers, box_shape, plan_reads
from netdist.checkpoint.state import ShardedArray, flatten_state, unflatten_state
from netdist.checkpoint.storage import check_file_sizes, read_metadata_text
from netdist.errors import CheckpointError, CheckpointMismatchError
from netdist.types import WIRE_DTYPES, dtype_to_wire

__all__ = ["save", "load", "RANK_OBJECT_POLICIES"]

RANK_OBJECT_POLICIES = ("error", "like", "modulo", "rank0")


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


def _local_summary(state: Any, check_replicated: bool) -> tuple[dict[str, Any], Any]:
    flat = flatten_state(state)
    tensors = {}
    arrays: dict[str, np.ndarray] = {}
    for name, value in flat.tensors.items():
        if isinstance(value, ShardedArray):
            array, dim = _as_array(value.data, name), value.shard_dim
        else:
            array, dim = _as_array(value, name), None
        entry: list[Any] = [dtype_to_wire(array.dtype), list(array.shape), dim]
        if check_replicated and dim is None:
            entry.append(zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data))
        tensors[name] = entry
        arrays[name] = array
    objects = {key: json.dumps(encode_object(value), allow_nan=False)
               for key, value in flat.objects.items()}
    return {"tensors": tensors, "objects": objects, "skeleton": flat.skeleton}, arrays


def _merge(summaries: list[dict[str, Any]]) -> tuple[dict[str, TensorShardSpec], StateLayout]:
    """Every rank's summary -> one set of specs and the state layout (same on all ranks)."""
    first = summaries[0]
    for rank, summary in enumerate(summaries[1:], start=1):
        if summary["skeleton"] != first["skeleton"]:
            raise CheckpointMismatchError(f"rank {rank}'s state has a different structure "
                                          f"from rank 0's (keys, nesting or leaf kinds)")
    specs = {}
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
                    raise CheckpointMismatchError(f"replicated {name!r} differs between rank "
                                                  f"0 and rank {rank}")
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
    objects: dict[str, Any] = {}
    rank_objects: dict[str, tuple[Any, ...]] = {}
    for key, text in first["objects"].items():
        texts = [s["objects"][key] for s in summaries]
        if all(t == text for t in texts):
            objects[key] = decode_object(json.loads(text))
        else:
            rank_objects[key] = tuple(decode_object(json.loads(t)) for t in texts)
    return specs, StateLayout(first["skeleton"], objects, rank_objects)


async def save(state: Any, dir: str | os.PathLike[str], group: Any, *, step: int | None = None,
               keep_last: int | None = None, overwrite: bool = False,
               extra: Mapping[str, Any] | None = None, mesh: Mapping[str, Any] | None = None,
               check_replicated: bool = False, timeout: float | None = None) -> SaveResult:
    """Save ``state`` collectively as ``dir/step_N`` (every rank of ``group`` calls this).

    ``step`` defaults to one past the newest complete checkpoint - the step ``load``
    resumes from - so a restarted job always saves forward. An explicit ``step`` that
    already holds a complete checkpoint, or that is older than the newest complete one
    (a resumed job would never load it), raises ``CheckpointError`` unless
    ``overwrite=True``; with it, the old ``step_N`` stays loadable and unchanged until
    the new one is committed. ``keep_last=K`` keeps the K newest complete checkpoints
    (and the one just saved). Plain arrays are replicated (assumed equal on all ranks,
    written once; ``check_replicated=True`` compares CRCs first); wrap a shard in
    :class:`ShardedArray`. ``timeout`` bounds each collective step. Returns this rank's
    :class:`SaveResult`; raises ``CheckpointError`` (or a subclass) on every rank if any
    rank fails, and then nothing is committed. Cancelling (or a timeout) before the
    commit leaves a hidden staging directory, which is never loaded and is removed by
    the next save (a shard write already running in its thread completes in the
    background).
    """
    started = time.perf_counter()
    check_keep_last(keep_last)
    root = Path(dir)
    rank, world_size = group.rank, group.world_size
    local_error: BaseException | None = None
    arrays: dict[str, np.ndarray] = {}
    summary: dict[str, Any]
    try:
        summary, arrays = _local_summary(state, check_replicated)
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
        specs, layout = _merge(summaries)
    except CheckpointError:
        if rank == 0:
            await _discard(staging)
        raise
    writers = assign_writers(specs, world_size)

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


def _full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def _pick_object(key: str, layout: StateLayout, rank: int, world_size: int, num_ranks: int,
                 policy: str, like_objects: Mapping[str, Any] | None) -> Any:
    if key in layout.objects:
        return layout.objects[key]
    values = layout.rank_objects[key]
    if world_size == num_ranks:
        return values[rank]
    if policy == "modulo":
        return values[rank % num_ranks]
    if policy == "rank0":
        return values[0]
    if policy == "like" and like_objects is not None and key in like_objects:
        return like_objects[key]
    raise _per_rank_error([key], num_ranks, world_size)


def _per_rank_error(keys: list[str], num_ranks: int, world_size: int) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"values {', '.join(repr(k) for k in sorted(keys))} differed between the {num_ranks} "
        f"ranks that saved the checkpoint and cannot be mapped onto {world_size} ranks; "
        f"pass rank_objects='like' (keep the current value), 'modulo' or 'rank0'")


def _restore_object(current: Any, loaded: Any) -> Any:
    """Generators in ``like`` are restored in place, so references to them stay valid."""
    if isinstance(current, np.random.Generator) and isinstance(loaded, np.random.Generator):
        if type(current.bit_generator) is type(loaded.bit_generator):
            current.bit_generator.state = loaded.bit_generator.state
            return current
    if isinstance(current, np.random.BitGenerator) and isinstance(loaded, np.random.BitGenerator):
        if type(current) is type(loaded):
            current.state = loaded.state
            return current
    return loaded


def _prepare_load(metadata: ShardMetadata, like: Any, gathered: list[dict[str, Any]],
                  rank: int, world_size: int, strict: bool, rank_objects: str
                  ) -> tuple[dict[str, Box], dict[str, np.ndarray], Any]:
    """Decide what this rank reads, where it lands, and how to rebuild the result."""
    specs = metadata.tensor_specs
    layout = metadata.state
    if (layout is not None and layout.rank_objects and world_size != metadata.num_ranks
            and rank_objects in ("error", "like")):
        mapped = set() if like is None or rank_objects == "error" else \
            set(flatten_state(like).objects)
        unmapped = sorted(set(layout.rank_objects) - mapped)
        if unmapped:
            raise _per_rank_error(unmapped, metadata.num_ranks, world_size)
    wanted: dict[str, Box] = {}
    dests: dict[str, np.ndarray] = {}
    if like is None:
        targets = metadata.rebalanced(world_size)
        tensors: dict[str, Any] = {}
        for name, spec in targets.items():
            box = spec.box(rank) if spec.shard_dim is not None else _full_box(spec.full_shape)
            dtype = WIRE_DTYPES[spec.dtype or "uint8"]
            dest = np.empty(box_shape(box), dtype=dtype)
            wanted[name], dests[name] = box, dest
            tensors[name] = ShardedArray(dest, spec.shard_dim) if spec.shard_dim is not None \
                else dest
        if layout is None:
            return wanted, dests, lambda objs: dict(tensors)
        objects = {key: _pick_object(key, layout, rank, world_size, metadata.num_ranks,
                                     rank_objects, None)
                   for key in [*layout.objects, *layout.rank_objects]}
        return wanted, dests, lambda objs: unflatten_state(layout.skeleton, tensors, objects)

    flat = flatten_state(like)
    missing = sorted(set(flat.tensors) - set(specs))
    if missing:
        raise CheckpointMismatchError(f"the checkpoint has no tensors named {missing}")
    if strict:
        unexpected = sorted(set(specs) - set(flat.tensors))
        if unexpected:
            raise CheckpointMismatchError(f"the checkpoint has tensors that `like` lacks: "
                                          f"{unexpected} (pass strict=False to ignore them)")
    for name, value in flat.tensors.items():
        spec = specs[name]
        if isinstance(value, ShardedArray):
            dest, dim = value.data, value.shard_dim
            extents = [g[name] for g in gathered]
            offset = sum(e[1] for e in extents[:rank])
            total = sum(e[1] for e in extents)
            if any(e[0] != dim for e in extents) or dim >= len(spec.full_shape) \
                    or total != spec.full_shape[dim]:
                raise CheckpointMismatchError(
                    f"{name!r}: the shards in `like` (dim {dim}, {total} in all) do not "
                    f"tile the checkpoint's full shape {spec.full_shape}")
            corners = list(_full_box(spec.full_shape))
            corners[dim] = (offset, offset + dest.shape[dim])
            box_t: Box = tuple(corners)
        else:
            dest, box_t = value, _full_box(spec.full_shape)
        if not isinstance(dest, np.ndarray) or not dest.flags.writeable:
            raise CheckpointMismatchError(f"{name!r}: `like` must hold writeable arrays")
        check_destination(name, spec, box_t, dest)
        wanted[name], dests[name] = box_t, dest
    like_tensors = dict(flat.tensors)
    loaded_objects: dict[str, Any] = {}
    saved_keys = set() if layout is None else {*layout.objects, *layout.rank_objects}
    for key, current in flat.objects.items():
        if key in saved_keys and layout is not None:
            value = _pick_object(key, layout, rank, world_size, metadata.num_ranks,
                                 rank_objects, flat.objects)
            loaded_objects[key] = _restore_object(current, value)
        elif strict and layout is not None:
            raise CheckpointMismatchError(f"the checkpoint holds no value for {key!r}")
        else:
            loaded_objects[key] = current
    if strict and layout is not None:
        unexpected = sorted(saved_keys - set(flat.objects))
        if unexpected:
            raise CheckpointMismatchError(f"the checkpoint has values that `like` lacks: "
                                          f"{unexpected} (pass strict=False to ignore them)")
    return wanted, dests, lambda objs: unflatten_state(flat.skeleton, like_tensors,
                                                      loaded_objects)


async def load(dir: str | os.PathLike[str], group: Any, *, like: Any = None,
               step: int | None = None, verify: bool = True, strict: bool = True,
               rank_objects: str = "error", timeout: float | None = None,
               threads: int | None = None) -> Any:
    """Load a checkpoint collectively, resharding to ``group``'s world size.

    ``dir`` is a checkpoint root (``latest`` or ``step`` picks the checkpoint) or a
    checkpoint directory. With ``like`` (this rank's current state), arrays are filled
    **in place** (a ``ShardedArray`` receives the region its rank covers in the new
    layout, so shards may be uneven or along another dim than saved), generators are
    restored in place, and the result has ``like``'s structure. Without it the saved
    structure is rebuilt with fresh arrays, sharded tensors re-split with
    ``chunk_sizes`` as ``ShardedArray``. ``rank_objects`` is the world-size-change policy
    for per-rank values (module docstring). Errors on any rank are raised on every rank.
    """
    if rank_objects not in RANK_OBJECT_POLICIES:
        raise ValueError(f"rank_objects must be one of {RANK_OBJECT_POLICIES}, "
                         f"got {rank_objects!r}")
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
            for name, value in flatten_state(like).tensors.items():
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
        wanted, dests, rebuild = _prepare_load(metadata, like,
                                               [g["extents"] for g in gathered], rank,
                                               world_size, strict, rank_objects)
        plan = plan_reads(metadata.tensor_specs, metadata.writers, wanted)
        await asyncio.to_thread(_read, directory, metadata, plan, dests, verify, threads)
        result = rebuild(None)
    except Exception as exc:
        local_error, status = exc, _describe(exc)
    statuses = await group.all_gather_object(status, timeout=timeout)
    _raise_gathered("checkpoint load", statuses, rank, local_error)
    return result


def _read(directory: Path, metadata: ShardMetadata, plan: Any, dests: Any, verify: bool,
          threads: int | None) -> None:
    with CheckpointReader(directory, metadata, verify=verify) as reader:
        reader.read(plan, dests, threads=threads)
