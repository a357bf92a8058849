"""Per-rank checkpoint API: each rank saves and loads its own share, no group needed.

``save_distributed(state_dict, dir, rank, world_size, shard_spec)`` writes this rank's
file; ``load_distributed(dir, rank, world_size)`` reads this rank's share back, resharding
automatically when ``world_size`` differs from the one that saved; ``reshard`` is the
same with the old world size checked; ``flat_shard_metadata`` builds the usual layout
(every tensor split along dim 0, first ``total % n`` ranks one larger).

Commit without a group (``step=N``): every rank writes its shard file (temp, fsync,
rename) into the staging directory of that step's next generation, then a small manifest
with the file's size and checksums; the rank that completes the set (finds every rank's
manifest of the same generation) commits it as described in
:mod:`netdist.checkpoint.commit` (``metadata.json`` into staging, rename to ``step_N``,
``latest``, rotation), holding a lock on the root so that two ranks finishing together
commit once. Without a step the directory given is written in place (tools). The save
itself is the one save path of :mod:`netdist.checkpoint.writing` (``run_save``, run in
place: no event loop needed); this module holds the per-rank part of it (validating and
flattening the state, the staging tag, the manifests, the exclusive commit). The
collective ``netdist.checkpoint.save`` (rank 0 gathers manifests over a ``Group``) is
the recommended entry point for jobs; this API is for tools, tests and jobs without one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from netdist.checkpoint.commit import (
    CommitOutcome,
    commit_step,
    create_staging,
    ensure_root,
    metadata_generation,
    os_errors,
    step_generation,
)
from netdist.checkpoint.dtypes import (CHECKPOINT_DTYPES, dtype_name, is_raw_bfloat16,
                                       unrepresentable)
from netdist.checkpoint.metadata import (
    MAX_METADATA_BYTES,
    METADATA_FILE,
    FileRecord,
    ShardMetadata,
    StateLayout,
    TensorShardSpec,
    parse_json,
    rank_file_name,
    step_dir_name,
)
from netdist.checkpoint.options import RankObjects
from netdist.checkpoint.planner import box_shape, plan_reads, read_ranks
from netdist.checkpoint.reading import (
    CheckpointReader,
    box_index,
    list_checkpoints,
    load_metadata,
    read_plan_into,
    resolve_checkpoint,
)
from netdist.checkpoint.restore import (
    check_destination,
    check_rank_objects,
    plan_restore,
)
from netdist.checkpoint.state import (
    ShardedArray,
    flatten_state,
    is_stateful,
    is_torch_tensor,
    leaf_array,
    merge_summaries,
    state_summary,
)
from netdist.checkpoint.storage import (
    check_file_sizes,
    read_checkpoint_file,
    write_bytes_atomic,
)
from netdist.checkpoint.writing import (
    SaveCoordinator,
    SaveResult,
    SaveTarget,
    check_keep_last,
    check_rank,
    run_inline,
    run_save,
)
from netdist.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
)

__all__ = [
    "SaveResult",
    "PreparedShare",
    "prepare_share",
    "write_share",
    "save_distributed",
    "load_distributed",
    "reshard",
    "flat_shard_metadata",
    "shard_state_dict",
    "load_metadata",
    "resolve_checkpoint",
    "list_checkpoints",
    "CheckpointReader",
]

T = TypeVar("T")


# --------------------------------------------------------------------------- validation


def _as_array(value: Any, name: str) -> np.ndarray:
    """An array leaf as NumPy: arrays as they are, torch tensors as a view of their
    memory (no copy; CPU only), anything else through ``np.asarray``."""
    return leaf_array(value, name)


def _specs_for(state_dict: Mapping[str, Any],
               shard_spec: ShardMetadata | Mapping[str, TensorShardSpec] | None,
               rank: int, world_size: int) -> tuple[dict[str, TensorShardSpec], dict[str, np.ndarray]]:
    """Validate local arrays against the spec; fill dtypes in from the arrays."""
    arrays = {}
    for name, value in state_dict.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"state_dict keys must be non-empty strings, got {name!r}")
        arrays[name] = _as_array(value, name)
    if shard_spec is None:
        given: Mapping[str, TensorShardSpec] = {
            name: TensorShardSpec.replicated(a.shape) for name, a in arrays.items()}
    elif isinstance(shard_spec, ShardMetadata):
        if shard_spec.num_ranks != world_size:
            raise ValueError(f"shard_spec is for {shard_spec.num_ranks} ranks, "
                             f"world_size is {world_size}")
        given = shard_spec.tensor_specs
    else:
        given = shard_spec
        placed = sorted(name for name, spec in given.items() if spec.mesh is not None)
        if placed:
            raise ValueError(f"{placed[0]!r} is placed on a mesh: pass a ShardMetadata that "
                             f"records the mesh (ShardMetadata(world_size, specs, mesh="
                             f"{{'shape': [...], 'names': [...]}})) as shard_spec")
    missing = sorted(set(given) - set(arrays))
    unknown = sorted(set(arrays) - set(given))
    if missing or unknown:
        raise ValueError(f"state_dict and shard_spec disagree: missing arrays {missing}, "
                         f"arrays without a spec {unknown}")
    specs = {}
    for name, spec in given.items():
        array = arrays[name]
        if spec.num_ranks is not None and spec.num_ranks != world_size:
            raise ValueError(f"{name!r} is split over {spec.num_ranks} ranks, world_size "
                             f"is {world_size}")
        expected = spec.local_shape(rank)
        if tuple(array.shape) != expected:
            raise ValueError(f"{name!r}: rank {rank} holds shape {tuple(array.shape)}, the "
                             f"spec says {expected}")
        dtype = dtype_name(array.dtype)
        if spec.dtype is not None and spec.dtype != dtype:
            raise ValueError(f"{name!r}: array dtype {dtype}, spec dtype {spec.dtype}")
        specs[name] = spec if spec.dtype is not None else spec.with_dtype(dtype)
    return specs, arrays


# --------------------------------------------------------------------------- writing


def _manifest_name(rank: int) -> str:
    return f"rank_{rank:05d}.manifest.json"


def _read_json(path: Path) -> Any:
    """A small JSON file another rank wrote, read the safe way; None if unreadable."""
    try:
        return parse_json(read_checkpoint_file(path.parent, path.name,
                                               max_bytes=MAX_METADATA_BYTES), str(path))
    except CheckpointError:
        return None


def _staging_tag(generation: int, run_id: str | None) -> str:
    """The staging tag every rank of one per-rank save derives alike: ``g<generation>``,
    plus a digest of ``run_id`` so that attempts with different ids never share files."""
    if run_id is None:
        return f"g{generation}"
    return f"g{generation}-{hashlib.sha256(run_id.encode('utf-8')).hexdigest()[:12]}"


def _is_structured(state: Any) -> bool:
    """True unless ``state`` is the classic flat mapping of names to NumPy arrays (or
    values ``np.asarray`` turns into arrays), which is saved exactly as before."""
    if not isinstance(state, Mapping):
        return True
    return any(isinstance(v, (Mapping, list, tuple, ShardedArray)) or is_torch_tensor(v)
               or is_stateful(v) for v in state.values())


def _flatten_for_save(state: Any, shard_spec: object) -> tuple[dict[str, np.ndarray],
                                                                dict[str, Any]]:
    """A nested state (torch state dicts, stateful objects, plain values) as named local
    arrays plus the summary of its structure and plain values."""
    flat = flatten_state(state)
    arrays = {}
    for name, value in flat.tensors.items():
        if isinstance(value, ShardedArray):
            if shard_spec is None:
                raise ValueError(f"{name!r} is a ShardedArray: the per-rank API cannot see "
                                 f"the other ranks' shards, pass a shard_spec describing it")
            value = value.data
        arrays[name] = leaf_array(value, name)
    return arrays, state_summary(flat)


def _layout_of(summaries: list[Any]) -> StateLayout | None:
    if all(s is None for s in summaries):
        return None
    if any(s is None for s in summaries):
        flat = [r for r, s in enumerate(summaries) if s is None]
        raise CheckpointMismatchError(f"rank(s) {flat} saved a flat mapping of arrays, the "
                                      f"others a nested state")
    return merge_summaries(summaries)


@dataclass(frozen=True, slots=True)
class PreparedShare:
    """One rank's share of a per-rank save, validated and ready to write: the specs of
    its tensors, the arrays to write them from (by name) and, for a nested state, the
    summary of its structure and plain values (taken when prepared: later changes to
    the state's plain values do not reach it)."""

    specs: dict[str, TensorShardSpec]
    arrays: dict[str, np.ndarray]
    summary: dict[str, Any] | None

    def with_arrays(self, arrays: dict[str, np.ndarray]) -> PreparedShare:
        """The same share written from ``arrays`` (a staged copy, same names and shapes)."""
        return PreparedShare(self.specs, arrays, self.summary)


def prepare_share(state_dict: Any,
                  shard_spec: ShardMetadata | Mapping[str, TensorShardSpec] | None,
                  rank: int, world_size: int) -> PreparedShare:
    """Validate and flatten what :func:`save_distributed` writes (see there for what
    ``state_dict`` may hold); raises for invalid input before anything is written."""
    check_rank(rank, world_size)
    summary: dict[str, Any] | None = None
    flat: Mapping[str, Any] = state_dict
    if _is_structured(state_dict):
        flat, summary = _flatten_for_save(state_dict, shard_spec)
    specs, arrays = _specs_for(flat, shard_spec, rank, world_size)
    return PreparedShare(specs, arrays, summary)


def save_distributed(state_dict: Any, dir: str | os.PathLike[str], rank: int,
                     world_size: int,
                     shard_spec: ShardMetadata | Mapping[str, TensorShardSpec] | None = None,
                     *, step: int | None = None, keep_last: int | None = None,
                     extra: Mapping[str, Any] | None = None,
                     run_id: str | None = None) -> SaveResult:
    """Save this rank's share of a checkpoint; no communication between ranks.

    ``state_dict`` maps names to this rank's local arrays; ``shard_spec`` (usually from
    :func:`flat_shard_metadata`) says how each is placed; ``None`` means every array is
    replicated (written once, by the rank the dedup planner picks).

    It may also be a nested state as the collective ``save`` takes it: a torch
    ``state_dict()`` (tensors written from their own memory, tied ones once), an
    optimizer's (``param_groups`` and other plain values go to the metadata), stateful
    objects, dicts and lists of these; tensors are then named by their path
    (``"optim.state.0.exp_avg"``, the names ``shard_spec`` uses) and
    :func:`load_distributed` with ``like=`` restores the tree. Plain values that differ
    between ranks are stored per rank.

    With ``step=N`` the checkpoint goes to ``dir/step_N``: the ranks write into a staging
    directory and the rank that completes the set commits it by rename
    (:mod:`netdist.checkpoint.commit`), so an existing ``step_N`` stays loadable and
    unchanged until the new one replaces it, and a crash at any moment leaves one of
    the two. That rank then rewrites ``dir/latest`` and keeps the newest ``keep_last``
    checkpoints. Without a step, ``dir`` itself is the checkpoint, written in place:
    saving into it again replaces it file by file, and until every rank has rewritten
    its file it fails verification (never silently mixes).

    Without a group, ranks cannot tell a peer's file left by a crashed earlier attempt at
    the same step from a fresh one; pass the same ``run_id`` (e.g. a job id) on every
    rank to tell attempts apart, or use the collective ``save``. An OS error (full disk,
    too many open files) raises ``CheckpointError`` naming the rank and the file, and
    nothing is committed; a ``dir`` that is a file (or lies under one) raises
    ``CheckpointError`` saying it is not a directory. After the commit point a ``latest``
    that cannot be rewritten or an old checkpoint that cannot be deleted does not fail
    the save: the committing rank's result reports it (``latest_updated``, ``warnings``).
    """
    started = time.perf_counter()
    check_rank(rank, world_size)
    check_keep_last(keep_last)
    share = prepare_share(state_dict, shard_spec, rank, world_size)
    return write_share(share, dir, rank, world_size, shard_spec, step=step,
                       keep_last=keep_last, extra=extra, run_id=run_id, started=started)


def write_share(share: PreparedShare, dir: str | os.PathLike[str], rank: int,
                world_size: int,
                shard_spec: ShardMetadata | Mapping[str, TensorShardSpec] | None = None,
                *, step: int | None = None, keep_last: int | None = None,
                extra: Mapping[str, Any] | None = None, run_id: str | None = None,
                started: float | None = None) -> SaveResult:
    """Write a :func:`prepare_share` result and commit as :func:`save_distributed`
    describes (which is ``prepare_share`` + ``write_share``; ``AsyncCheckpointer`` runs
    this in its writer thread on a staged copy). ``started`` (a ``perf_counter`` time)
    is where ``SaveResult.seconds`` counts from."""
    if started is None:
        started = time.perf_counter()
    coordinator = _PerRankSave(share, Path(dir), rank, world_size, shard_spec, step=step,
                               keep_last=keep_last, extra=extra, run_id=run_id)
    return run_inline(run_save(coordinator, started))


class _PerRankSave(SaveCoordinator):
    """The per-rank API's part of the one save path (:func:`run_save`): no communication.
    Every rank stages into the directory of its step's next generation (or writes in
    place without a step) and leaves a manifest there; the rank that finds every rank's
    manifest of the same generation and run commits, under :func:`root_lock`. Every step
    is a blocking call made in place, and an error raises at once, on this rank only."""

    def __init__(self, share: PreparedShare, root: Path, rank: int, world_size: int,
                 shard_spec: ShardMetadata | Mapping[str, TensorShardSpec] | None, *,
                 step: int | None, keep_last: int | None,
                 extra: Mapping[str, Any] | None, run_id: str | None) -> None:
        super().__init__(rank, world_size)
        self.prepared = share
        self.root = root
        self.base = shard_spec if isinstance(shard_spec, ShardMetadata) else None
        self.step = step
        self.keep_last = keep_last
        self.extra = extra
        self.run_id = run_id

    async def run(self, fn: Callable[..., T], /, *args: Any) -> T:
        return fn(*args)

    async def settle(self) -> SaveTarget:
        root, step, base, rank = self.root, self.step, self.base, self.rank
        final = root / step_dir_name(step) if step is not None else root
        with os_errors(rank, f"prepare checkpoint {final}"):
            if step is None:
                ensure_root(root)
                generation = metadata_generation(root) + 1
                directory = root
            else:
                generation = step_generation(root, step) + 1
                directory = create_staging(root, step, _staging_tag(generation, self.run_id),
                                           shared=True)
        extra = self.extra if self.extra is not None else (
            base.extra if base is not None else {})
        return SaveTarget(self.prepared.specs, self.prepared.arrays, directory, final, step,
                          extra, mesh=base.mesh if base is not None else None,
                          generation=generation)

    async def share(self, target: SaveTarget, written: FileRecord | BaseException
                    ) -> list[tuple[FileRecord, Any]] | None:
        """Write this rank's manifest next to its file; return the record and state
        summary of every rank when all of their manifests of this generation and run
        are there."""
        if isinstance(written, BaseException):
            raise written
        record = written
        rank, generation, run_id = self.rank, target.generation, self.run_id
        manifest: dict[str, Any] = {"generation": generation, "run_id": run_id,
                                    "file": record.to_json()}
        if self.prepared.summary is not None:
            manifest["state"] = self.prepared.summary
        # Not fsynced: its content ends up in metadata.json, which is; losing it in a crash
        # only means that save is not committed, which a crash does anyway.
        with os_errors(rank, f"write {_manifest_name(rank)} of checkpoint {target.final}"):
            write_bytes_atomic(target.directory / _manifest_name(rank),
                               json.dumps(manifest).encode(), durable=False)
        records = []
        for other in range(self.world_size):
            found = _read_json(target.directory / _manifest_name(other))
            if (not isinstance(found, dict) or found.get("generation") != generation
                    or found.get("run_id") != run_id):
                break
            records.append((FileRecord.from_json(found["file"]), found.get("state")))
        return records if len(records) == self.world_size else None

    def contents(self, found: Sequence[Any]
                 ) -> tuple[tuple[FileRecord, ...], StateLayout | None]:
        return tuple(r for r, _ in found), _layout_of([s for _, s in found])

    async def commit(self, target: SaveTarget, metadata: ShardMetadata) -> CommitOutcome:
        if target.step is None:
            write_bytes_atomic(self.root / METADATA_FILE, metadata.dumps().encode("utf-8"))
            return CommitOutcome(committed=True)
        return commit_step(self.root, target.directory, metadata, keep_last=self.keep_last,
                           exclusive=True)

    async def announce(self, outcome: CommitOutcome, error: BaseException | None
                       ) -> CommitOutcome:
        if error is not None:
            raise error
        return outcome


# --------------------------------------------------------------------------- reading


def load_distributed(dir: str | os.PathLike[str], rank: int, world_size: int, *,
                     step: int | None = None, verify: bool = True,
                     out: Mapping[str, Any] | None = None, like: Any = None,
                     strict: bool = True,
                     rank_objects: RankObjects | str = RankObjects.ERROR,
                     threads: int | None = None) -> Any:
    """Load ``rank``'s share of a checkpoint for a job of ``world_size`` ranks.

    Same world size as the save: each rank gets exactly the shards it saved (plus the
    replicated tensors, wherever dedup stored them; a mesh-placed tensor: its rank's
    piece). Different world size: every sharded tensor is re-split along its saved dim
    with ``chunk_sizes`` (a mesh-placed one along the first dim its placements shard)
    and only the byte ranges covering this rank's new shard are read. Returns a flat dict of tensor names to
    NumPy arrays (bfloat16 without ``ml_dtypes``: ``torch.bfloat16`` tensors, or a
    ``CheckpointMismatchError`` naming the dtype when torch is missing too). ``out`` may
    supply preallocated destination arrays or CPU torch tensors (filled in place; no
    second copy in memory); a dtype or shape that does not match raises
    ``CheckpointMismatchError``. ``verify`` checks the CRC of every block read.

    ``like`` restores a nested state in place instead and returns it, with the rules of
    the collective ``load`` (:mod:`netdist.checkpoint.restore`): torch tensors and arrays
    filled in place, stateful objects (a module, an optimizer, ``RNGState``) given the
    saved state through ``load_state_dict()`` with lazily created optimizer state created,
    ``strict`` and ``rank_objects`` (:class:`RankObjects`) as there; a ``ShardedArray``
    in ``like`` must hold this rank's part of the even re-split.
    """
    check_rank(rank, world_size)
    policy = check_rank_objects(rank_objects, "load_distributed")
    if like is not None and out is not None:
        raise ValueError("pass either out= (flat arrays) or like= (a nested state), not both")
    directory = resolve_checkpoint(dir, step)
    metadata = load_metadata(directory)
    if like is not None:
        check_file_sizes(directory, metadata, [record.rank for record in metadata.files])
        restore = plan_restore(metadata, like, rank, world_size, strict=strict,
                               rank_objects=policy)
        plan = plan_reads(metadata.tensor_specs, metadata.writers, restore.wanted)
        read_plan_into(directory, metadata, plan, restore.dests, verify=verify,
                       threads=threads)
        return restore.complete()
    targets = metadata.rebalanced(world_size)
    wanted = {name: spec.box(rank) for name, spec in targets.items()}
    plan = plan_reads(metadata.tensor_specs, metadata.writers, wanted)
    check_file_sizes(directory, metadata, read_ranks(plan))  # before sizing any buffer
    dests: dict[str, np.ndarray] = {}
    results: dict[str, Any] = {}
    for name, box in wanted.items():
        spec = metadata.tensor_specs[name]
        if out is not None and name in out:
            leaf = out[name]
            dest = leaf_array(leaf, name)
            check_destination(name, spec, box, dest)
        else:
            if spec.dtype is None:
                raise CheckpointCorruptError(f"tensor {name!r} has no dtype in the metadata")
            dest = np.empty(box_shape(box), dtype=CHECKPOINT_DTYPES[spec.dtype])
            leaf = _bfloat16_tensor(name, dest) if is_raw_bfloat16(dest.dtype) else dest
        dests[name], results[name] = dest, leaf
    if out is not None:
        unknown = sorted(set(out) - set(wanted))
        if unknown:
            raise CheckpointMismatchError(f"the checkpoint has no tensors named {unknown}")
    read_plan_into(directory, metadata, plan, dests, verify=verify, threads=threads)
    return results


def _bfloat16_tensor(name: str, dest: np.ndarray) -> Any:
    """A ``torch.bfloat16`` tensor over a raw bf16 buffer (no ``ml_dtypes``); without
    torch, the error naming the dtype."""
    try:
        from netdist.checkpoint.torch_state import array_tensor
    except ImportError:
        raise unrepresentable(name, "bfloat16") from None
    return array_tensor(dest)


def reshard(dir: str | os.PathLike[str], old_world_size: int, new_world_size: int,
            new_rank: int, *, step: int | None = None, verify: bool = True,
            out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Load ``new_rank``'s share for ``new_world_size`` ranks from a checkpoint saved by
    ``old_world_size`` ranks (checked against the metadata)."""
    check_rank(new_rank, new_world_size)
    metadata = load_metadata(dir, step)
    if metadata.num_ranks != old_world_size:
        raise CheckpointMismatchError(f"checkpoint was saved by {metadata.num_ranks} ranks, "
                                      f"not {old_world_size}")
    return load_distributed(dir, new_rank, new_world_size, step=step, verify=verify, out=out)


def flat_shard_metadata(state_dict: Mapping[str, Any], world_size: int, *,
                        shard_dim: int = 0) -> ShardMetadata:
    """Metadata that splits every full array of ``state_dict`` along ``shard_dim``.

    Uneven extents give the first ``total % world_size`` ranks one more row (the
    ``netdist.sharding.chunk_sizes`` rule); arrays with fewer dims than ``shard_dim + 1``
    (scalars) are replicated.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    specs = {}
    for name, value in state_dict.items():
        array = _as_array(value, name)
        if array.ndim <= shard_dim:
            specs[name] = TensorShardSpec.replicated(array.shape, array.dtype)
        else:
            specs[name] = TensorShardSpec.even(array.shape, world_size, shard_dim, array.dtype)
    return ShardMetadata(world_size, specs)


def shard_state_dict(state_dict: Mapping[str, Any], metadata: ShardMetadata | Mapping[str, TensorShardSpec],
                     rank: int) -> dict[str, np.ndarray]:
    """``rank``'s local views of full arrays under ``metadata`` (what it should save)."""
    specs = metadata.tensor_specs if isinstance(metadata, ShardMetadata) else metadata
    out = {}
    for name, spec in specs.items():
        array = _as_array(state_dict[name], name)
        if tuple(array.shape) != spec.full_shape:
            raise ValueError(f"{name!r}: full shape {array.shape}, spec says {spec.full_shape}")
        out[name] = array[box_index(spec.box(rank))]
    return out


