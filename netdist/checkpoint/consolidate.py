"""Offline checkpoint tools: inspect, verify, consolidate into one file, reshard to N ranks.

All of them stream: a tensor is assembled chunk by chunk (``chunk_bytes`` of full rows at
a time) from the byte ranges of the shard files that hold it, and each chunk is written
before the next is read, so memory stays at one chunk however large the model is. The
consolidated file is plain safetensors (``safetensors.numpy.load_file`` /
``safetensors.torch.load_file`` read it); its ``__metadata__`` carries the checkpoint's
non-tensor values as JSON under ``netdist.extra`` and ``netdist.state``.

Every source file is opened through ``storage.open_checkpoint_file`` (regular files inside
the checkpoint directory only). Output paths are checked before any work: an output that
is a directory, lies in a missing directory, or overlaps the source is a ``ConfigError``
(the CLI's usage error); an OS error while writing is a ``CheckpointError`` naming the
output.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from netdist.checkpoint.dtypes import CHECKPOINT_DTYPES
from netdist.checkpoint.metadata import (
    METADATA_FILE,
    FileRecord,
    ShardMetadata,
    StateLayout,
    TensorShardSpec,
    check_mesh,
    encode_json_value,
    parse_step_dir_name,
    rank_file_name,
)
from netdist.checkpoint.options import (RESHARD_RANK_OBJECTS, RankObjects, TiedTensors,
                                        parse_option)
from netdist.checkpoint.planner import (Box, assign_writers, box_shape, box_size, plan_reads,
                                       plan_writes)
from netdist.checkpoint.reading import CheckpointReader, resolve_checkpoint
from netdist.checkpoint.state import skeleton_tensors
from netdist.checkpoint.storage import (
    ShardFile,
    TensorSource,
    read_metadata,
    write_bytes_atomic,
    write_safetensors,
)
from netdist.checkpoint.views import VIEW_NODE, TensorView, numpy_view
from netdist.checkpoint.writing import rank_file_metadata
from netdist.errors import CheckpointError, CheckpointMismatchError, ConfigError
from netdist.sharding import Shard, placement_label

__all__ = [
    "TensorRow",
    "VerifyReport",
    "mesh_of",
    "inspect_checkpoint",
    "verify_checkpoint",
    "consolidate",
    "reshard_checkpoint",
    "DEFAULT_CHUNK_BYTES",
]

DEFAULT_CHUNK_BYTES = 64 << 20

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``."""


@dataclass(frozen=True, slots=True)
class TensorRow:
    """One line of ``netdist ckpt inspect``."""

    name: str
    dtype: str
    full_shape: tuple[int, ...]
    layout: str
    nbytes: int
    ranks: tuple[int, ...]


def _nbytes(spec: TensorShardSpec) -> int:
    itemsize = CHECKPOINT_DTYPES[spec.dtype].itemsize if spec.dtype else 1
    return math.prod(spec.full_shape) * itemsize


def _is_within(path: Path, other: Path) -> bool:
    """``path`` is ``other`` or inside it, symlinks resolved."""
    real, base = Path(os.path.realpath(path)), Path(os.path.realpath(other))
    return real == base or base in real.parents


def _check_output_file(out: Path, directory: Path) -> None:
    """``ConfigError`` unless ``out`` can become a new file outside the checkpoint."""
    if out.is_dir():
        raise ConfigError(f"output {out} is a directory; give a file name such as "
                          f"{out / 'model.safetensors'}")
    if not out.parent.is_dir():
        raise ConfigError(f"output directory {out.parent} does not exist")
    if _is_within(out, directory):
        raise ConfigError(f"output {out} is inside the checkpoint {directory} it is read "
                          f"from")


def _check_output_dir(out: Path, source: Path, directory: Path) -> None:
    """``ConfigError`` unless ``out`` can hold a new checkpoint without touching the one
    read: not the source (as given or resolved), not inside it, not the root holding it."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {out} exists and is not a directory")
    for src in dict.fromkeys((source, directory)):
        if _is_within(out, src):
            raise ConfigError(f"output {out} is inside the source {src}, which would be "
                              f"rewritten while it is read; choose a directory outside it")
    holder = directory.parent
    if (parse_step_dir_name(directory.name) is not None
            and os.path.realpath(out) == os.path.realpath(holder)):
        raise ConfigError(f"output {out} is the root that holds the source checkpoint "
                          f"{directory}; choose another directory")


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[None]:
    """Turn an OS error while writing ``out`` into a ``CheckpointError`` naming it."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"cannot write {out}: {exc.strerror or exc}") from exc


def mesh_of(metadata: ShardMetadata) -> dict[str, list[Any]] | None:
    """The checkpoint's mesh as ``{"shape": [...], "names": [...]}``, or None when it
    records none (or only a free-form value, as checkpoints before mesh placements could)."""
    try:
        return check_mesh(metadata.mesh, metadata.num_ranks)
    except ValueError:
        return None


def _mesh_layout(spec: TensorShardSpec, writers: tuple[int, ...]) -> str:
    """``mesh (R, S(0)) dim 0 [4,4]`` (and who stores a piece every rank holds)."""
    mesh = spec.mesh
    if mesh is None:  # pragma: no cover - called for mesh-placed tensors only
        raise ValueError("not a mesh-placed tensor")
    labels = ", ".join(placement_label(p) for p in mesh.placements)
    dims = sorted({p.dim for p in mesh.placements if isinstance(p, Shard)})
    cuts = " ".join(f"dim {d} [{','.join(str(n) for n in mesh.extents[d])}]" for d in dims)
    if not cuts:
        cuts = f"replicated (stored by rank {writers[0]})"
    return f"mesh ({labels}) {cuts}"


def inspect_checkpoint(path: str | os.PathLike[str], step: int | None = None
                       ) -> tuple[Path, ShardMetadata, list[TensorRow]]:
    """The checkpoint directory, its metadata and one row per tensor (``ranks``: the
    ranks whose files hold some of its bytes)."""
    directory = resolve_checkpoint(path, step)
    metadata = read_metadata(directory)
    rows = []
    for name, spec in metadata.tensor_specs.items():
        if spec.mesh is not None:
            writers = metadata.piece_writers(name)
            layout = _mesh_layout(spec, writers)
            ranks: tuple[int, ...] = tuple(sorted({
                rank for piece, rank in enumerate(writers) if box_size(spec.piece_box(piece))}))
        elif spec.shard_dim is None:
            writer = metadata.writers.get(name)
            layout = f"replicated (stored by rank {writer})"
            ranks = (writer,) if isinstance(writer, int) else ()
        else:
            sizes = ",".join(str(s) for s in spec.shard_sizes)
            layout = f"dim {spec.shard_dim} [{sizes}]"
            ranks = tuple(r for r, s in enumerate(spec.shard_sizes) if s)
        rows.append(TensorRow(name, spec.dtype or "?", spec.full_shape, layout, _nbytes(spec),
                              ranks))
    return directory, metadata, rows


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`: ``problems`` is empty when all is well."""

    path: Path
    files: int
    nbytes: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(path: str | os.PathLike[str], step: int | None = None, *,
                      progress: Progress | None = None) -> VerifyReport:
    """Check every shard file: present, right size, header matching the metadata, and
    every block's CRC. Unreadable metadata raises; file problems are collected."""
    directory = resolve_checkpoint(path, step)
    metadata = read_metadata(directory)
    plan = plan_writes(metadata.tensor_specs, metadata.num_ranks, metadata.writers)
    total = sum(record.size for record in metadata.files)
    problems: list[str] = []
    done = 0
    checked = 0
    for rank in range(metadata.num_ranks):
        record = metadata.file_for(rank)
        if record is None:
            problems.append(f"rank {rank}: no file record in {METADATA_FILE}")
            continue
        base = done
        try:
            with ShardFile(directory / record.name, record, verify=True) as shard_file:
                for item in plan.for_rank(rank):
                    entry = shard_file.entry(item.name)
                    if entry.shape != item.shape or entry.dtype != item.dtype:
                        problems.append(f"{record.name}: {item.name!r} is {entry.dtype} "
                                        f"{entry.shape}, metadata says {item.dtype} {item.shape}")
                expected = {item.name for item in plan.for_rank(rank)}
                stray = sorted(set(shard_file.entries) - expected)
                if stray:
                    problems.append(f"{record.name}: unexpected tensors {stray}")
                shard_file.verify_all(
                    None if progress is None else lambda n: progress(base + n, total))
            checked += 1
        except CheckpointError as exc:
            problems.append(str(exc))
        done = base + record.size
        if progress is not None:
            progress(done, total)
    return VerifyReport(directory, checked, done, tuple(problems))


def _chunks(reader: CheckpointReader, name: str, box: Box, dtype: np.dtype[Any],
            chunk_bytes: int) -> Callable[[], Iterator[np.ndarray]]:
    """A producer yielding ``stored[box]`` of ``name`` in row chunks (one reused buffer)."""
    metadata = reader.metadata
    shape = box_shape(box)

    def produce() -> Iterator[np.ndarray]:
        if not shape:
            dest = np.empty((), dtype=dtype)
            reader.read(plan_reads(metadata.tensor_specs, metadata.writers, {name: box}),
                        {name: dest})
            yield dest
            return
        rows = shape[0]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        per = max(1, chunk_bytes // max(row_bytes, 1))
        buffer = np.empty((min(per, rows), *shape[1:]), dtype=dtype)
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            sub: Box = ((box[0][0] + r0, box[0][0] + r1), *box[1:])
            dest = buffer[:r1 - r0]
            reader.read(plan_reads(metadata.tensor_specs, metadata.writers, {name: sub}),
                        {name: dest})
            yield dest

    return produce


def _objects_metadata(metadata: ShardMetadata, *, whole: bool) -> dict[str, str]:
    out = {"format": "netdist-consolidated", "num_ranks": str(metadata.num_ranks)}
    if metadata.step is not None:
        out["step"] = str(metadata.step)
    if metadata.extra:
        out["netdist.extra"] = json.dumps(encode_json_value(dict(metadata.extra)))
    if metadata.state is not None and whole:
        out["netdist.state"] = json.dumps(metadata.state.to_json())
    return out


Row = tuple[str, str, bool, TensorView | None]
"""``(output name, stored tensor, is torch, the view of it the path holds, if any)``."""


def _selected(metadata: ShardMetadata, prefix: str) -> list[Row]:
    """A row for every tensor path under ``prefix``, aliases (tied weights) and views
    (windows into a tensor stored once for several overlapping ones) included, in the
    saved order."""
    rows: list[Row]
    if metadata.state is None:
        rows = [(name, name, False, None) for name in metadata.tensor_specs]
    else:
        rows = [(path, node["k"], bool(node.get("torch")),
                 TensorView.from_node(node) if node["t"] == VIEW_NODE else None)
                for path, node in skeleton_tensors(metadata.state.skeleton)]
    return [(path[len(prefix):], stored, is_torch, view)
            for path, stored, is_torch, view in rows
            if path.startswith(prefix) and len(path) > len(prefix)]


def _view_chunks(reader: CheckpointReader, name: str, view: TensorView,
                 dtype: np.dtype[Any]) -> Callable[[], Iterator[np.ndarray]]:
    """A producer yielding ``view`` of the stored tensor ``name`` in one piece (the
    stored tensor is read whole once; views are small windows in practice)."""
    metadata = reader.metadata

    def produce() -> Iterator[np.ndarray]:
        spec = metadata.tensor_specs[name]
        box = tuple((0, n) for n in spec.full_shape)
        base = np.empty(spec.full_shape, dtype=dtype)
        reader.read(plan_reads(metadata.tensor_specs, metadata.writers, {name: box}),
                    {name: base})
        yield np.ascontiguousarray(numpy_view(base, view))

    return produce


def consolidate(path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                step: int | None = None, verify: bool = True, progress: Progress | None = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, prefix: str = "",
                tied: TiedTensors | str = TiedTensors.COPY) -> Path:
    """Write the whole checkpoint as one safetensors file holding every full tensor.

    Streams tensor by tensor (``chunk_bytes`` at a time), writing the header first; the
    output appears atomically (temp, fsync, rename). Returns the output path. An output
    that is a directory, in a missing directory or inside the checkpoint is refused with
    ``ConfigError`` before anything is read.

    ``prefix`` keeps only the tensors whose path starts with it and strips it, so
    ``prefix="model."`` turns ``{"model": model.state_dict(), "optim": ...}`` into the
    file ``safetensors.torch.load_file`` + ``model.load_state_dict(strict=True)`` expect.
    A tensor saved as a view of one stored for several overlapping tensors is written
    as its own copy (safetensors has no views; ``load_state_dict`` puts the values back
    into a model's shared memory).
    A tied tensor (stored once in the checkpoint) is written under each of its names
    with ``tied=TiedTensors.COPY`` (``"copy"``, what ``load_state_dict(strict=True)``
    needs), or under its first name only with ``TiedTensors.DROP`` (``"drop"``, as
    ``save_pretrained`` does; ``from_pretrained`` ties it again; the dropped names are
    listed in ``__metadata__["netdist.tied"]``). A file
    of torch tensors says ``"format": "pt"`` in its ``__metadata__``, as torch's
    safetensors files do (``from_pretrained`` requires it).
    """
    tied = parse_option(tied, TiedTensors, "tied", "consolidate")
    directory = resolve_checkpoint(path, step)
    out = Path(out)
    _check_output_file(out, directory)
    metadata = read_metadata(directory)
    rows = _selected(metadata, prefix)
    if prefix and not rows:
        raise ConfigError(f"no tensor of {directory} has a name starting with {prefix!r}")
    first_name: dict[Any, str] = {}
    dropped: dict[str, str] = {}
    for name, stored, _, view in rows:
        key = (stored, view)  # the same window of the same stored tensor: a tie
        if key in first_name and tied is TiedTensors.DROP:
            dropped[name] = first_name[key]
        first_name.setdefault(key, name)
    rows = [row for row in rows if row[0] not in dropped]
    file_metadata = _objects_metadata(metadata, whole=not prefix)
    if rows and all(is_torch for _, _, is_torch, _ in rows):
        file_metadata["format"] = "pt"
        file_metadata["netdist.format"] = "netdist-consolidated"
    if dropped:
        file_metadata["netdist.tied"] = json.dumps(dropped)
    total = 0
    for _, stored, _, view in rows:
        spec = metadata.tensor_specs[stored]
        total += _nbytes(spec) if view is None else \
            view.numel * (CHECKPOINT_DTYPES[spec.dtype].itemsize if spec.dtype else 1)
    with CheckpointReader(directory, metadata, verify=verify) as reader:
        sources = []
        for name, stored, _, view in rows:
            spec = metadata.tensor_specs[stored]
            if spec.dtype is None:
                raise CheckpointError(f"tensor {stored!r} has no dtype in the metadata")
            dtype = CHECKPOINT_DTYPES[spec.dtype]
            if view is not None:
                sources.append(TensorSource(name, spec.dtype, view.shape,
                                            chunks=_view_chunks(reader, stored, view, dtype)))
                continue
            box = tuple((0, n) for n in spec.full_shape)
            sources.append(TensorSource(name, spec.dtype, spec.full_shape,
                                        chunks=_chunks(reader, stored, box, dtype,
                                                       chunk_bytes)))
        with _writing(out):
            write_safetensors(out, sources, metadata=file_metadata,
                              progress=None if progress is None else
                              lambda n: progress(n, total))
    return out


def _remap_state(state: StateLayout | None, old: int, new: int, policy: RankObjects
                 ) -> StateLayout | None:
    if state is None or not state.rank_objects or old == new:
        return state
    if policy is RankObjects.DROP:
        return replace(state, rank_objects={})
    if policy is RankObjects.MODULO:
        return replace(state, rank_objects={k: tuple(v[r % old] for r in range(new))
                                            for k, v in state.rank_objects.items()})
    if policy is RankObjects.RANK0:
        return replace(state, rank_objects={k: tuple(v[0] for _ in range(new))
                                            for k, v in state.rank_objects.items()})
    raise CheckpointMismatchError(
        f"values {sorted(state.rank_objects)} differ per rank and cannot be mapped from "
        f"{old} to {new} ranks; choose rank_objects='modulo', 'rank0' or 'drop'")


def _new_mesh(metadata: ShardMetadata, sizes: Mapping[str, int], world_size: int | None
              ) -> dict[str, list[Any]]:
    """The mesh ``sizes`` (name -> size) gives the checkpoint's mesh; ``ConfigError``
    unless it names exactly the saved mesh's dims, each >= 1 (and has ``world_size``
    ranks, when given)."""
    saved = mesh_of(metadata)
    if saved is None:
        raise ConfigError("the checkpoint has no mesh (no tensor is placed on one); "
                          "reshard it to a world size instead")
    names = saved["names"]
    if set(sizes) != set(names):
        raise ConfigError(f"the new mesh names dims {sorted(sizes)}, the checkpoint's mesh "
                          f"has {names}; give a size for each of {', '.join(names)}")
    shape = [sizes[n] for n in names]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
        raise ConfigError(f"mesh sizes must be ints >= 1, got {dict(sizes)}")
    if world_size is not None and math.prod(shape) != world_size:
        raise ConfigError(f"the mesh {dict(sizes)} has {math.prod(shape)} ranks, not the "
                          f"{world_size} of world_size")
    return {"shape": shape, "names": list(names)}


def reshard_checkpoint(path: str | os.PathLike[str], out: str | os.PathLike[str],
                       world_size: int | None = None, *, mesh: Mapping[str, int] | None = None,
                       step: int | None = None, verify: bool = True,
                       rank_objects: RankObjects | str = RankObjects.ERROR,
                       progress: Progress | None = None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ShardMetadata:
    """Rewrite a checkpoint for ``world_size`` ranks, or for the device mesh ``mesh``,
    into the directory ``out``.

    Sharded tensors are re-split along their dim with ``chunk_sizes``; replicated ones are
    re-assigned by the dedup planner. ``mesh`` (dim name -> size, the saved mesh's dims,
    e.g. ``{"dp": 1, "tp": 4}``) keeps every mesh-placed tensor's placements on a mesh of
    those sizes (split evenly, netdist's rule); with ``world_size`` alone a mesh-placed
    tensor is split along the first dim its placements shard (replicated if none), as a
    load without a mesh gives it. Streams chunk by chunk; ``metadata.json`` is written
    last. ``rank_objects`` (:class:`RankObjects`) maps per-rank values: ``ERROR``,
    ``MODULO``, ``RANK0`` or ``DROP`` (or their strings, ``"error"``, ...).
    ``out`` must not overlap the source (``ConfigError``, checked before anything is
    written): a checkpoint rewritten into itself would be corrupted.
    """
    if world_size is not None and (not isinstance(world_size, int)
                                   or isinstance(world_size, bool) or world_size < 1):
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    policy = parse_option(rank_objects, RankObjects, "rank_objects", "reshard_checkpoint",
                          RESHARD_RANK_OBJECTS)
    directory = resolve_checkpoint(path, step)
    out = Path(out)
    _check_output_dir(out, Path(path), directory)
    metadata = read_metadata(directory)
    new_mesh: dict[str, list[Any]] | None = None
    if mesh is not None:
        new_mesh = _new_mesh(metadata, mesh, world_size)
        ranks = math.prod(new_mesh["shape"])
        specs = metadata.remeshed(new_mesh["shape"])
    elif world_size is not None:
        ranks = world_size
        specs = metadata.rebalanced(ranks)
        if any(spec.mesh is not None for spec in specs.values()):  # the same world size
            new_mesh = mesh_of(metadata)
    else:
        raise ConfigError("reshard_checkpoint needs a world_size or a mesh")
    state = _remap_state(metadata.state, metadata.num_ranks, ranks, policy)
    if (out / METADATA_FILE).exists():
        raise CheckpointError(f"{out} already holds a checkpoint")
    with _writing(out):
        out.mkdir(parents=True, exist_ok=True)
    writers = assign_writers(specs, ranks)
    plan = plan_writes(specs, ranks, writers)
    total = sum(plan.bytes_per_rank)
    records = []
    written = 0
    with CheckpointReader(directory, metadata, verify=verify) as reader:
        for rank in range(ranks):
            sources = []
            for item in plan.for_rank(rank):
                spec = specs[item.name]
                box = spec.box(rank)  # this rank's piece: a shard, the whole, a mesh piece
                dtype = CHECKPOINT_DTYPES[spec.dtype or "uint8"]
                sources.append(TensorSource(item.name, spec.dtype or "uint8", item.shape,
                                            chunks=_chunks(reader, item.name, box, dtype,
                                                           chunk_bytes)))
            base = written
            name = rank_file_name(rank)
            with _writing(out / name):
                size, checksum = write_safetensors(
                    out / name, sources, metadata=rank_file_metadata(rank, ranks),
                    progress=None if progress is None else
                    lambda n: progress(base + n, total))
            records.append(FileRecord(rank, name, size, checksum))
            written = base + plan.bytes_per_rank[rank]
    new = ShardMetadata(num_ranks=ranks, tensor_specs=specs, mesh=new_mesh,
                        extra=metadata.extra, step=metadata.step, writers=writers,
                        files=tuple(records), state=state)
    with _writing(out / METADATA_FILE):
        write_bytes_atomic(out / METADATA_FILE, new.dumps().encode("utf-8"))
    return new

