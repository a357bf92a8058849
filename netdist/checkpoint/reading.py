"""Finding a committed checkpoint and reading regions of its tensors.

Shared by every load: the per-rank ``load_distributed`` (:mod:`netdist.checkpoint.api`),
the collective ``load`` (:mod:`netdist.checkpoint.collective`) and the offline tools
(:mod:`netdist.checkpoint.consolidate`). :func:`resolve_checkpoint` picks the directory
(never one without ``metadata.json``); :class:`CheckpointReader` executes a read plan
(:func:`netdist.checkpoint.planner.plan_reads`) against its shard files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import EllipsisType

import numpy as np

from netdist.checkpoint.commit import find_step, scan_root
from netdist.checkpoint.metadata import (
    METADATA_FILE,
    ShardMetadata,
    parse_step_dir_name,
    step_dir_name,
)
from netdist.checkpoint.planner import Box, ReadItem
from netdist.checkpoint.storage import ShardFile, read_metadata
from netdist.errors import CheckpointCorruptError, CheckpointNotFoundError

__all__ = [
    "list_checkpoints",
    "resolve_checkpoint",
    "load_metadata",
    "box_index",
    "CheckpointReader",
    "read_plan_into",
]

_PARALLEL_READ_BYTES = 32 << 20


def box_index(box: Box) -> tuple[slice | EllipsisType, ...]:
    """The index selecting ``box`` from an array; the trailing ``...`` keeps a 0-d box a view."""
    return (*(slice(lo, hi) for lo, hi in box), ...)


# --------------------------------------------------------------------------- finding


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, directory)``, by step.

    A step whose ``step_N`` was renamed aside by a save that crashed before renaming the
    new one in is listed with its aside directory (``.step_N.old-<tag>``), which loads
    like any other; the next save renames it back.
    """
    return scan_root(root).complete()


def _recoverable_aside(path: Path) -> Path | None:
    """The aside holding ``path``'s checkpoint when ``path`` is a ``step_N`` being replaced."""
    step = parse_step_dir_name(path.name)
    return scan_root(path.parent).recoverable.get(step) if step is not None else None


def resolve_checkpoint(path: str | os.PathLike[str], step: int | None = None) -> Path:
    """The checkpoint directory that ``path`` designates.

    ``path`` is either a checkpoint directory (holds ``metadata.json``) or a root with
    ``step_N`` directories: then ``step`` picks one, else the newest complete step.
    ``latest`` is not consulted: it may lag one step behind after a crash, and a
    resumed job must continue from the newest step. Directories without
    ``metadata.json`` are never chosen.
    """
    path = Path(path)
    if step is not None:
        step_dir_name(step)  # validates
        found = find_step(path, step)
        if found is None:
            raise CheckpointNotFoundError(f"no complete checkpoint for step {step} in {path}")
        return found
    if (path / METADATA_FILE).is_file():
        return path
    complete = list_checkpoints(path)
    if complete:
        return complete[-1][1]
    aside = _recoverable_aside(path)
    if aside is not None:
        return aside
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
    raise CheckpointNotFoundError(f"no complete checkpoint in {path}: no {METADATA_FILE} "
                                  f"and no complete step_* directory")


def load_metadata(path: str | os.PathLike[str], step: int | None = None) -> ShardMetadata:
    """Read the metadata of the checkpoint ``path`` designates (see ``resolve_checkpoint``)."""
    directory = resolve_checkpoint(path, step)
    return read_metadata(directory)  # safe open, bounded parse, errors name the file


# --------------------------------------------------------------------------- reading


class CheckpointReader:
    """Reads regions of one checkpoint's tensors; shard files are opened on first use.

    Every read goes through :class:`ShardFile`, so with ``verify=True`` each block read is
    checked against the metadata's CRC. Close it (or use ``with``) to release the files.
    ``bytes_read`` counts the bytes read from every file so far (closed ones included).
    """

    def __init__(self, directory: Path, metadata: ShardMetadata, *, verify: bool = True) -> None:
        self.directory = directory
        self.metadata = metadata
        self.verify = verify
        self._files: dict[int, ShardFile] = {}
        self._closed_bytes = 0

    @property
    def bytes_read(self) -> int:
        return self._closed_bytes + sum(f.bytes_read for f in self._files.values())

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        files, self._files = self._files, {}
        for shard_file in files.values():
            self._closed_bytes += shard_file.bytes_read
            shard_file.close()

    def file(self, rank: int) -> ShardFile:
        shard_file = self._files.get(rank)
        if shard_file is None:
            record = self.metadata.file_for(rank)
            if record is None:
                raise CheckpointCorruptError(f"{self.directory}: metadata has no file record "
                                             f"for rank {rank}")
            shard_file = ShardFile(self.directory / record.name, record, verify=self.verify)
            self._files[rank] = shard_file
        return shard_file

    def read(self, plan: Mapping[str, tuple[ReadItem, ...]], dests: Mapping[str, np.ndarray], *,
             threads: int | None = None, progress: Callable[[int], None] | None = None) -> None:
        """Execute a read plan: copy each planned piece into ``dests[name]``."""
        tasks = []
        for name, items in plan.items():
            spec = self.metadata.tensor_specs[name]
            for item in items:
                shard_file = self.file(item.src_rank)
                entry = shard_file.entry(name)
                if entry.shape != item.src_shape or (spec.dtype and entry.dtype != spec.dtype):
                    raise CheckpointCorruptError(
                        f"{shard_file.path}: {name!r} is stored as {entry.dtype} "
                        f"{entry.shape}, metadata says {spec.dtype} {item.src_shape}")
                dest = dests[name][box_index(item.dst_box)]
                tasks.append((item, dest))
        total = sum(d.nbytes for _, d in tasks)
        done = 0

        def run(task: tuple[ReadItem, np.ndarray]) -> int:
            item, dest = task
            self._files[item.src_rank].read_box(item.name, item.src_box, dest)
            return dest.nbytes

        workers = threads if threads is not None else min(4, os.cpu_count() or 1)
        if workers <= 1 or total < _PARALLEL_READ_BYTES or len(tasks) < 2:
            for task in tasks:
                done += run(task)
                if progress is not None:
                    progress(done)
            return
        tasks.sort(key=lambda t: -t[1].nbytes)  # largest first balances the pool
        with ThreadPoolExecutor(workers, thread_name_prefix="netdist-ckpt-read") as pool:
            for nbytes in pool.map(run, tasks):
                done += nbytes
                if progress is not None:
                    progress(done)


def read_plan_into(directory: Path, metadata: ShardMetadata,
                   plan: Mapping[str, tuple[ReadItem, ...]], dests: Mapping[str, np.ndarray], *,
                   verify: bool = True, threads: int | None = None,
                   progress: Callable[[int], None] | None = None) -> None:
    """Execute a read plan against the checkpoint in ``directory``."""
    with CheckpointReader(directory, metadata, verify=verify) as reader:
        reader.read(plan, dests, threads=threads, progress=progress)
