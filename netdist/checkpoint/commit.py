"""The checkpoint commit protocol: write aside, commit by rename, recover after a crash.

A checkpoint root (the ``dir`` of a save with ``step=N``) holds, besides ``latest``::

    step_000100/                  committed: holds metadata.json, never modified in place
    .step_000100.tmp-<tag>/       staging: a save of step 100 being written
    .step_000100.old-<tag>/       aside: the step 100 checkpoint being replaced
    .trash-<name>-<hex>/          a directory being deleted

A save writes every rank file and then ``metadata.json`` into a fresh staging directory,
each fsynced; the commit is one rename of the staging directory to ``step_N`` followed
by an fsync of the root. Replacing a committed ``step_N`` first renames it aside, and
deletes the aside only after the commit. The points of the protocol, in order, and what
a crash (SIGKILL) at each leaves for the step being saved (:class:`CommitPoint`):

=============  ===============================================  ==============
point          state on disk                                     step N loads as
=============  ===============================================  ==============
PREPARED       an empty staging directory                        the old one
FILES_DURABLE  staging holds every rank file                     the old one
STAGED         staging holds ``metadata.json`` too               the old one
ASIDE          the old checkpoint renamed aside, no ``step_N``   the old one
COMMITTED      ``step_N`` is the new checkpoint, the aside left  the new one
OLD_REMOVED    the aside deleted                                 the new one
LATEST         ``latest`` rewritten                              the new one
ROTATED        checkpoints beyond ``keep_last`` deleted          the new one
=============  ===============================================  ==============

ASIDE and OLD_REMOVED happen only when a committed ``step_N`` is replaced; when step N
is new, "the old one" means none (the newest checkpoint is still the previous step).
Readers take an aside whose ``step_N`` is missing as that step's checkpoint, and the
next save renames it back; staging directories are never read and are deleted by the
next save. Every other step is untouched at every point. Per-rank saves, where two
ranks may finish together, commit under :func:`root_lock`.

The commit point is COMMITTED: the rename of a staging directory holding a durable
``metadata.json`` to ``step_N``, made durable by an fsync of the root. An error before
it (a full disk while a rank file or ``metadata.json`` is written, a failing rename)
fails the save and commits nothing. What follows it - deleting the aside, rewriting
``latest``, rotating to ``keep_last``, removing crash leftovers - is housekeeping: an
error there (``ENOSPC`` creating ``latest``'s temporary file, a checkpoint that cannot
be deleted) does not undo or fail the save. :func:`commit_step` logs a warning on the
``netdist.checkpoint`` logger naming what was skipped (the path and the OS error) and
returns it in :class:`CommitOutcome`, which the saves pass on in their ``SaveResult``
(``latest_updated``, ``warnings``); the next save retries all of it.

The newest complete step - what ``load`` resumes from and what ``save(step=None)``
counts from - is the highest ``N`` whose checkpoint is committed (or recoverable from an
aside), read from the directories themselves. ``latest`` is rewritten after every
commit to name that step for people and outside tools, but netdist never trusts it:
a crash between a commit and the update of ``latest``, or a skipped update, leaves it
one step behind, and a restarted job must still resume from the newest step.

Testing hook: when the environment variable ``NETDIST_CHECKPOINT_FAILPOINT`` names a
point (``"committed"``, ...), the process that reaches it SIGKILLs itself there, so
tests can crash a real save at each point.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import logging
import os
import re
import shutil
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from netdist.checkpoint.metadata import (
    LATEST_FILE,
    METADATA_FILE,
    ShardMetadata,
    parse_json,
    parse_step_dir_name,
    step_dir_name,
)
from netdist.checkpoint.storage import (
    fsync_dir,
    is_temp_name,
    read_metadata_text,
    remove_tree_atomic,
    write_bytes_atomic,
)
from netdist.errors import CheckpointError

__all__ = [
    "CommitPoint",
    "CommitOutcome",
    "FAILPOINT_ENV",
    "RootScan",
    "staging_dir_name",
    "aside_dir_name",
    "scan_root",
    "find_step",
    "step_generation",
    "metadata_generation",
    "create_staging",
    "tidy_root",
    "commit_step",
    "root_lock",
    "os_errors",
    "describe_os_error",
    "reached",
    "ensure_root",
]

logger = logging.getLogger("netdist.checkpoint")

FAILPOINT_ENV = "NETDIST_CHECKPOINT_FAILPOINT"
LOCK_FILE = ".lock"
"""Taken (flock) by per-rank commits only where a directory cannot be flock'ed (NFS)."""

_HIDDEN_RE = re.compile(r"^\.step_(\d+)\.(tmp|old)-([0-9A-Za-z-]+)$")
_GENERATION_TAG_RE = re.compile(r"^g(\d+)(?:-|$)")


class CommitPoint(str, enum.Enum):
    """The points of the commit protocol, in the order a save passes them."""

    PREPARED = "prepared"
    FILES_DURABLE = "files-durable"
    STAGED = "staged"
    ASIDE = "aside"
    COMMITTED = "committed"
    OLD_REMOVED = "old-removed"
    LATEST = "latest"
    ROTATED = "rotated"


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    """What :func:`commit_step` did.

    ``committed``: this call renamed the staging directory to ``step_N`` (False only for
    a per-rank save whose staging another rank had already committed).
    ``latest_updated``: ``latest`` now names the newest complete step. ``warnings``: the
    housekeeping after the commit point that failed and was skipped (``latest`` not
    rewritten, an old checkpoint or a leftover not deleted), each naming the path and
    the OS error; the checkpoint is committed regardless, and the next save retries.
    """

    committed: bool
    latest_updated: bool = False
    warnings: tuple[str, ...] = ()


def reached(point: CommitPoint) -> None:
    """Testing hook: SIGKILL this process if ``NETDIST_CHECKPOINT_FAILPOINT`` names ``point``."""
    if os.environ.get(FAILPOINT_ENV) == point.value:
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- names


def staging_dir_name(step: int, tag: str) -> str:
    """Name of a staging directory of ``step``: ``.step_000100.tmp-<tag>``."""
    return f".{step_dir_name(step)}.tmp-{tag}"


def aside_dir_name(step: int, tag: str) -> str:
    """Name of the aside directory of a replaced ``step``: ``.step_000100.old-<tag>``."""
    return f".{step_dir_name(step)}.old-{tag}"


def _parse_hidden(name: str) -> tuple[str, int, str] | None:
    match = _HIDDEN_RE.match(name)
    if match is None:
        return None
    return match.group(2), int(match.group(1)), match.group(3)


def _tag_generation(tag: str) -> int | None:
    """The generation a per-rank staging tag (``g<G>`` or ``g<G>-<run>``) carries."""
    match = _GENERATION_TAG_RE.match(tag)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------- scanning


@dataclass(frozen=True, slots=True)
class RootScan:
    """What a checkpoint root holds, sorted by role.

    ``committed``: ``step_N`` directories with ``metadata.json``; ``recoverable``: steps
    whose only complete checkpoint is an aside (a crash between ASIDE and COMMITTED);
    ``staging``: staging directories as ``(step, tag, path)``; ``incomplete``: ``step_N``
    directories without ``metadata.json``; ``garbage``: trash and asides that are no
    longer needed; ``temp_files``: temporary files (``latest`` being rewritten).
    """

    root: Path
    committed: Mapping[int, Path]
    recoverable: Mapping[int, Path]
    staging: tuple[tuple[int, str, Path], ...]
    incomplete: Mapping[int, Path]
    garbage: tuple[Path, ...]
    temp_files: tuple[Path, ...]

    def complete(self) -> list[tuple[int, Path]]:
        """Every loadable checkpoint as ``(step, directory)``, by step."""
        found = dict(self.recoverable)
        found.update(self.committed)
        return sorted(found.items())

    def newest(self) -> int | None:
        """The newest complete step, or ``None`` when there is none."""
        steps = [*self.committed, *self.recoverable]
        return max(steps) if steps else None


def _has_metadata(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def scan_root(root: str | os.PathLike[str]) -> RootScan:
    """Sort the entries of ``root``. A missing root (or a file) holds nothing; another
    OS error (permissions, I/O) raises ``CheckpointError`` naming the root."""
    root = Path(root)
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint root {root}: "
                              f"{describe_os_error(exc)}") from exc
    committed: dict[int, Path] = {}
    incomplete: dict[int, Path] = {}
    asides: dict[int, list[Path]] = {}
    staging: list[tuple[int, str, Path]] = []
    garbage: list[Path] = []
    temp_files: list[Path] = []
    for entry in entries:
        path = Path(entry.path)
        if not entry.is_dir():
            if is_temp_name(entry.name) and entry.is_file(follow_symlinks=False):
                temp_files.append(path)
            continue
        step = parse_step_dir_name(entry.name)
        if step is not None:
            (committed if _has_metadata(path) else incomplete)[step] = path
            continue
        if entry.name.startswith(".trash-"):
            garbage.append(path)
            continue
        hidden = _parse_hidden(entry.name)
        if hidden is None:
            continue
        kind, step, tag = hidden
        if kind == "tmp":
            staging.append((step, tag, path))
        elif _has_metadata(path):
            asides.setdefault(step, []).append(path)
        else:
            garbage.append(path)
    recoverable: dict[int, Path] = {}
    for step, paths in asides.items():
        paths.sort()
        if step in committed:
            garbage.extend(paths)  # a crash after COMMITTED, before OLD_REMOVED
        else:
            recoverable[step] = paths[-1]
            garbage.extend(paths[:-1])
    return RootScan(root, committed, recoverable, tuple(sorted(staging)), incomplete,
                    tuple(sorted(garbage)), tuple(sorted(temp_files)))


def find_step(root: str | os.PathLike[str], step: int) -> Path | None:
    """The directory holding step ``step``'s checkpoint (committed or aside), if any."""
    scan = scan_root(root)
    return scan.committed.get(step) or scan.recoverable.get(step)


def step_generation(root: str | os.PathLike[str], step: int) -> int:
    """The ``generation`` of step ``step``'s checkpoint, 0 if there is none."""
    directory = find_step(root, step)
    return 0 if directory is None else metadata_generation(directory)


def metadata_generation(directory: str | os.PathLike[str]) -> int:
    """The ``generation`` recorded in ``directory/metadata.json``; 0 if it is missing or
    unreadable. Read the safe way: a FIFO or a hostile document never blocks or crashes
    the save that asks."""
    try:
        document = parse_json(read_metadata_text(directory),
                              str(Path(directory) / METADATA_FILE))
    except CheckpointError:
        return 0
    value = document.get("generation", 0) if isinstance(document, dict) else 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# --------------------------------------------------------------------------- writing


def ensure_root(root: Path) -> None:
    """Create the checkpoint directory ``root`` (with its parents) unless it exists.

    A path that exists but is not a directory (``root`` itself, or one of its parents)
    raises ``CheckpointError`` saying so, in the words the command-line tools use
    (``<path> exists and is not a directory``), instead of the bare ``[Errno 17] File
    exists`` or ``[Errno 20] Not a directory`` that ``mkdir`` gives. Other OS errors
    (permissions, a full disk) propagate as they are.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        for path in (root, *root.parents):
            if os.path.lexists(path):
                if path.is_dir():
                    break
                if path == root:
                    raise CheckpointError(f"checkpoint directory {root} exists and is not "
                                          f"a directory") from exc
                raise CheckpointError(f"cannot create checkpoint directory {root}: {path} "
                                      f"exists and is not a directory") from exc
        raise


def create_staging(root: Path, step: int, tag: str, *, shared: bool = False) -> Path:
    """Create the staging directory of ``step`` (``shared``: other ranks may have made it)."""
    ensure_root(root)
    staging = root / staging_dir_name(step, tag)
    staging.mkdir(exist_ok=shared)
    reached(CommitPoint.PREPARED)
    return staging


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _recover(scan: RootScan) -> bool:
    """Rename every recoverable aside back to its ``step_N``; True if any was."""
    for step, aside in scan.recoverable.items():
        final = scan.root / step_dir_name(step)
        if step in scan.incomplete:
            remove_tree_atomic(final)
        os.rename(aside, final)
    if scan.recoverable:
        fsync_dir(scan.root)
    return bool(scan.recoverable)


def tidy_root(root: Path, *, current: int | None = None, generation: int | None = None
              ) -> RootScan:
    """Recover asides and delete what crashed saves left behind; return the new scan.

    ``current=None`` (collective save: no other save runs in this root) deletes every
    staging and incomplete directory. A per-rank save passes its step and generation:
    other ranks may be writing newer steps, so only staging of older steps (or of this
    step at generations up to ``generation``) and incomplete steps below ``current``
    are deleted.
    """
    scan = scan_root(root)
    if _recover(scan):
        scan = scan_root(root)
    for path in scan.garbage:
        if path.name.startswith(".trash-"):
            shutil.rmtree(path, ignore_errors=True)
        else:  # an aside: renamed to trash first, so a crash never leaves half of one
            remove_tree_atomic(path)
    for path in scan.temp_files:
        _unlink(path)
    for step, tag, path in scan.staging:
        if current is None or step < current or (
                step == current and (_tag_generation(tag) or 0) <= (generation or 0)):
            shutil.rmtree(path, ignore_errors=True)
    for step, path in scan.incomplete.items():
        if current is None or step < current:
            remove_tree_atomic(path)
    return scan_root(root)


def _publish(root: Path, staging: Path, step: int) -> Path | None:
    """Rename ``staging`` to ``step_N`` (the commit), moving a committed one aside first;
    returns that aside, for the caller to delete (after the commit point)."""
    final = root / step_dir_name(step)
    aside: Path | None = None
    if _has_metadata(final):
        aside = root / aside_dir_name(step, staging.name.rsplit(".tmp-", 1)[1])
        if aside.exists():  # left by an earlier crash after its commit: garbage
            remove_tree_atomic(aside)
        os.rename(final, aside)
        fsync_dir(root)
        reached(CommitPoint.ASIDE)
    elif final.exists():
        remove_tree_atomic(final)  # an incomplete directory: never loadable
    try:
        os.rename(staging, final)
    except BaseException:
        if aside is not None:
            os.rename(aside, final)
        raise
    fsync_dir(root)
    reached(CommitPoint.COMMITTED)
    return aside


class _Housekeeping:
    """The steps after the commit point: each one that fails is logged and recorded as a
    warning instead of failing a save that is already committed."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.warnings: list[str] = []

    def skipped(self, what: str, exc: BaseException) -> None:
        """Record that ``what`` (a phrase naming the path) failed with ``exc``."""
        reason = describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
        message = f"checkpoint {self.final} is committed, but {what}: {reason}"
        logger.warning("%s", message)
        self.warnings.append(message)


def _rotate(scan: RootScan, current: int, keep_last: int | None,
            housekeeping: _Housekeeping) -> None:
    """Delete complete checkpoints but the ``keep_last`` newest and ``current``; one that
    cannot be deleted is a warning and the others are still deleted."""
    if keep_last is None:
        return
    complete = scan.complete()
    keep = {step for step, _ in complete[-keep_last:]} | {current}
    for step, path in complete:
        if step not in keep:
            try:
                remove_tree_atomic(path)
            except OSError as exc:
                housekeeping.skipped(f"the old checkpoint {path} (beyond keep_last="
                                     f"{keep_last}) was not deleted", exc)


def _write_latest(root: Path, step: int) -> None:
    """Point ``root/latest`` at ``step`` (atomically: temp file, fsync, rename)."""
    write_bytes_atomic(root / LATEST_FILE, (step_dir_name(step) + "\n").encode())


def commit_step(root: Path, staging: Path, metadata: ShardMetadata, *,
                keep_last: int | None, exclusive: bool) -> CommitOutcome:
    """Commit the checkpoint written into ``staging`` as ``step_N`` of ``root``.

    Writes ``metadata.json`` into the staging directory, publishes it by rename (moving a
    committed ``step_N`` aside and deleting it afterwards), rewrites ``latest`` to name the
    newest complete step, keeps ``keep_last`` checkpoints and deletes crash leftovers.
    ``exclusive`` (per-rank saves, where two ranks may finish together) holds
    :func:`root_lock` throughout; then a staging directory already gone means another
    rank committed it, and ``CommitOutcome(committed=False)`` is returned.

    A failure before the rename raises and leaves the previous checkpoint as it was.
    After it (the commit point) nothing raises ``OSError`` or ``CheckpointError``: a step
    that fails there - ``latest`` (e.g. no inode left for its temporary file), rotation,
    cleanup - is skipped with a warning (logged, and in the returned outcome), because
    the checkpoint is committed and loadable, and reporting the save as failed would
    make a caller redo or distrust a step that is there.
    """
    step = metadata.step
    if step is None:
        raise ValueError("commit_step needs a checkpoint with a step")
    with root_lock(root) if exclusive else contextlib.nullcontext():
        if not staging.is_dir():
            if exclusive:
                return CommitOutcome(committed=False)
            raise CheckpointError(f"the staging directory {staging} vanished before the "
                                  f"commit: is another save running in {root}?")
        reached(CommitPoint.FILES_DURABLE)
        for entry in os.scandir(staging):  # left by a crashed earlier attempt
            if is_temp_name(entry.name) and entry.is_file(follow_symlinks=False):
                _unlink(Path(entry.path))
        write_bytes_atomic(staging / METADATA_FILE, metadata.dumps().encode("utf-8"))
        reached(CommitPoint.STAGED)
        aside = _publish(root, staging, step)
        # ---- committed: from here on a failure is a warning, never an error
        housekeeping = _Housekeeping(root / step_dir_name(step))
        if aside is not None:
            try:
                remove_tree_atomic(aside)
            except OSError as exc:
                housekeeping.skipped(f"the replaced checkpoint {aside} was not deleted",
                                     exc)
            reached(CommitPoint.OLD_REMOVED)
        latest_updated = False
        scan: RootScan | None = None
        try:
            scan = scan_root(root)
        except CheckpointError as exc:
            housekeeping.skipped(f"{root / LATEST_FILE} was not updated and no old "
                                 f"checkpoint was rotated", exc)
        if scan is not None:
            newest = scan.newest()
            if newest is not None:
                try:
                    _write_latest(root, newest)
                    latest_updated = True
                except OSError as exc:
                    housekeeping.skipped(f"{root / LATEST_FILE} was not updated to name "
                                         f"{step_dir_name(newest)}", exc)
            reached(CommitPoint.LATEST)
            _rotate(scan, step, keep_last, housekeeping)
        try:
            if exclusive:
                tidy_root(root, current=step, generation=metadata.generation)
            else:
                tidy_root(root)
        except (OSError, CheckpointError) as exc:
            housekeeping.skipped(f"leftovers of earlier saves in {root} were not removed",
                                 exc)
        reached(CommitPoint.ROTATED)
    return CommitOutcome(True, latest_updated, tuple(housekeeping.warnings))


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def root_lock(root: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``root`` (released by the kernel if we die).

    Where directories cannot be locked (NFS emulates flock with byte-range locks that
    need a writable descriptor), a ``.lock`` file in ``root`` is locked instead.
    """
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.close(fd)
            fd = -1
            fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd >= 0:
            os.close(fd)


def describe_os_error(exc: OSError) -> str:
    """``[Errno 24] Too many open files: '<file>'`` (the file only when the OS named it)."""
    text = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno is not None else str(exc)
    if exc.filename is not None:
        text += f": {os.fsdecode(exc.filename)!r}"
    return text


@contextlib.contextmanager
def os_errors(rank: int, what: str) -> Iterator[None]:
    """Turn an ``OSError`` inside the block into ``CheckpointError`` naming rank and file.

    ``what`` says what the rank was doing (``"write rank_00001.safetensors of
    /ckpt/step_000002"``); errors that are already ``CheckpointError`` pass unchanged.
    """
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"rank {rank} could not {what}: {describe_os_error(exc)}") \
            from exc
