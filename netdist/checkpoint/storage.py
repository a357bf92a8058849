"""Safetensors shard files: crash-safe streaming writes and verified byte-range reads.

Writing: the safetensors header is built up front from names, dtypes and shapes; the
data is then streamed array by array (or chunk by chunk from a producer) into a
temporary sibling file in 8 MiB pieces, each CRC-32'd just before it is written; the file is fsynced, renamed into place and the directory fsynced. A reader never sees a
partial file under the final name, and an existing file is never written in place (a
rename replaces the name; a reader that has the old file open or mapped keeps the old
bytes).

Opening: every file a reader opens (shard files, ``metadata.json``) goes through
:func:`open_checkpoint_file`: the path must resolve inside the checkpoint directory, must
be a regular file, and is opened with ``O_NONBLOCK`` (cleared once it is known to be a
regular file), so a FIFO, device or socket put in a checkpoint is refused at once instead
of blocking a reader thread forever.

Reading: :class:`ShardFile` parses the header itself and reads with ``os.preadv``
straight into the destination array. With ``verify=True`` every block a read touches is
checked against the CRC recorded in the metadata (whole blocks at the edges go through
a scratch buffer), so a resharding load verifies exactly what it reads and never
loads a whole tensor it does not own.

The file format is plain safetensors (``safetensors.numpy.load_file`` reads every file
netdist writes); ``docs/PROTOCOL.md`` has the byte layout.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import stat
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from netdist.checkpoint.dtypes import CHECKPOINT_DTYPES, dtype_name
from netdist.checkpoint.metadata import (
    CHECKSUM_BLOCK_SIZE,
    MAX_METADATA_BYTES,
    MAX_NDIM,
    METADATA_FILE,
    FileRecord,
    ShardMetadata,
    check_file_name,
    parse_json,
)
from netdist.checkpoint.planner import Box, box_shape, run_layout
from netdist.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

__all__ = [
    "SAFETENSORS_DTYPES",
    "MAX_HEADER_BYTES",
    "TensorSource",
    "HeaderEntry",
    "BlockChecksum",
    "build_header",
    "write_safetensors",
    "write_bytes_atomic",
    "fsync_dir",
    "remove_tree_atomic",
    "temp_name",
    "is_temp_name",
    "open_checkpoint_file",
    "read_checkpoint_file",
    "read_metadata",
    "read_metadata_text",
    "ShardFile",
    "byte_memoryview",
]

SAFETENSORS_DTYPES: dict[str, str] = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
    "float16": "F16", "bfloat16": "BF16", "int32": "I32", "uint32": "U32",
    "float32": "F32", "float64": "F64", "int64": "I64", "uint64": "U64",
}
"""Wire dtype name -> safetensors dtype code."""
_FROM_SAFETENSORS = {code: name for name, code in SAFETENSORS_DTYPES.items()}

MAX_HEADER_BYTES = 100 << 20
"""Safetensors' own limit on the JSON header; a larger length prefix means corruption."""

_WRITE_PIECE = 8 << 20      # bytes per write() call and per CRC task
_SCRATCH_BYTES = 8 << 20    # bounce buffer for strided reads
_DIRECT_RUN_BYTES = 256 << 10  # runs at least this long are read one pread each
_FUSED_READ_BYTES = 1 << 20  # verified reads: bytes per pread, CRC'd while in cache
_TEMP_MARK = ".tmp."


def byte_memoryview(array: np.ndarray) -> memoryview:
    """A flat ``uint8`` ``memoryview`` of a C-contiguous array (any dtype, 0-d included),
    the buffer ``pread``/``write`` take; ``ValueError`` for a strided array. (The
    transport's ``mailbox.byte_view`` is a NumPy ``uint8`` view instead.)"""
    if not array.flags.c_contiguous:
        raise ValueError("byte_memoryview needs a C-contiguous array")
    return array.reshape(-1).view(np.uint8).data


def temp_name(final: str) -> str:
    """A unique temporary sibling name for ``final`` (hidden, recognisable by cleanup)."""
    return f".{final}{_TEMP_MARK}{os.getpid()}.{secrets.token_hex(4)}"


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and _TEMP_MARK in name


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *,
                       durable: bool = True) -> None:
    """Write a small file atomically: temp sibling, fsync, rename, fsync directory.

    ``durable=False`` skips both fsyncs: readers still never see a partial file, but a
    crash may lose it (fine for hints that are rebuilt, like per-rank manifests).
    """
    path = Path(path)
    tmp = path.parent / temp_name(path.name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _write_all(fd, memoryview(data))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def remove_tree_atomic(path: Path) -> None:
    """Remove a checkpoint directory so that it is never seen half-deleted.

    The directory is first renamed to a hidden trash name (one atomic step: the
    checkpoint is either whole under its name or gone), then deleted; a crash in
    between leaves only a trash directory, removed by the next cleanup.
    """
    trash = path.parent / f".trash-{path.name}-{secrets.token_hex(4)}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


# --------------------------------------------------------------------------- safe open

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    for test, name in _FILE_KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _inside(directory: Path, path: Path) -> Path:
    """``path`` with every symlink resolved, refused unless it lies inside ``directory``."""
    root = Path(os.path.realpath(directory))
    real = Path(os.path.realpath(path))
    if real == root or root not in real.parents:
        raise CheckpointCorruptError(f"{path} resolves to {real}, outside the checkpoint "
                                     f"directory {root}")
    return real


def _stat_checkpoint_file(directory: Path, name: str) -> tuple[Path, Path, os.stat_result]:
    """``(path, resolved path, lstat)`` of checkpoint file ``name``, with the checks
    ``open_checkpoint_file`` documents (plain name, inside ``directory``, regular file);
    nothing is opened."""
    try:
        check_file_name(name)
    except ValueError as exc:
        raise CheckpointCorruptError(f"{directory}: {exc}") from None
    path = directory / name
    real = _inside(directory, path)
    try:
        status = os.lstat(real)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"checkpoint file {path} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"cannot open {path}: {exc.strerror}") from exc
    if not stat.S_ISREG(status.st_mode):
        raise CheckpointCorruptError(f"{path} is {_kind(status.st_mode)}, not a regular file")
    return path, real, status


def open_checkpoint_file(directory: str | os.PathLike[str], name: str) -> int:
    """Open the checkpoint file ``name`` of ``directory`` read-only; return the descriptor.

    The one way readers open checkpoint files. ``name`` must be a plain file name, the
    path (symlinks resolved) must lie inside ``directory``, and it must be a regular file:
    checked with ``lstat`` before opening and ``fstat`` after (same inode), the open
    itself non-blocking and not following a final symlink, so neither a FIFO, a device
    nor a file swapped in between can block or redirect the reader. Raises
    ``CheckpointNotFoundError`` when the file is missing, ``CheckpointCorruptError`` for
    a name or file that does not belong, ``CheckpointError`` for other OS errors, each
    naming the path.
    """
    path, real, before = _stat_checkpoint_file(Path(directory), name)
    nonblock = getattr(os, "O_NONBLOCK", 0)
    flags = os.O_RDONLY | nonblock | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"checkpoint file {path} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"cannot open {path}: {exc.strerror}") from exc
    try:
        after = os.fstat(fd)
        if (not stat.S_ISREG(after.st_mode)
                or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino)):
            raise CheckpointCorruptError(f"{path} was replaced while being opened")
        if nonblock:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_checkpoint_file(directory: str | os.PathLike[str], name: str, *,
                         max_bytes: int) -> bytes:
    """The whole content of a small checkpoint file, opened by :func:`open_checkpoint_file`.

    A file larger than ``max_bytes`` is ``CheckpointCorruptError`` (read nothing).
    """
    path = Path(directory) / name
    fd = open_checkpoint_file(directory, name)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise CheckpointCorruptError(f"{path} is {size} bytes, more than the "
                                         f"{max_bytes} a reader accepts")
        chunks = []
        total = 0
        while chunk := os.read(fd, max(size, 1 << 16)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise CheckpointCorruptError(f"{path} grew past {max_bytes} bytes while "
                                             f"being read")
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_metadata_text(directory: str | os.PathLike[str]) -> str:
    """The text of ``directory/metadata.json``, read safely (for sending to other ranks)."""
    raw = read_checkpoint_file(directory, METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(f"{Path(directory) / METADATA_FILE} is not UTF-8: "
                                     f"{exc}") from None


def check_file_sizes(directory: str | os.PathLike[str], metadata: ShardMetadata,
                     ranks: Iterable[int]) -> None:
    """Refuse a load whose rank files (of ``ranks``) do not hold the recorded sizes.

    Readers size their buffers from the metadata's shapes, which ``check_committed``
    bounds by the recorded file sizes; checking those against the files themselves
    (one ``lstat`` each, with the safe opener's checks; the reader opens them later)
    before anything is allocated means a forged or truncated checkpoint costs no more
    memory than its files hold.
    """
    wanted = set(ranks)
    for record in metadata.files:
        if record.rank not in wanted:
            continue
        actual = _stat_checkpoint_file(Path(directory), record.name)[2].st_size
        if actual != record.size:
            raise CheckpointCorruptError(
                f"{Path(directory) / record.name} holds {actual} bytes but the metadata "
                f"records {record.size} (truncated, or not the file that was committed)")


def read_metadata(directory: str | os.PathLike[str]) -> ShardMetadata:
    """Read and check ``directory/metadata.json`` (errors name that path)."""
    return ShardMetadata.loads(read_metadata_text(directory),
                               source=str(Path(directory) / METADATA_FILE))


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class BlockChecksum:
    """Running CRC-32 per ``block_size`` bytes of a stream (zlib, about 3 GB/s)."""

    def __init__(self, block_size: int = CHECKSUM_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.crcs: list[int] = []
        self._crc = 0
        self._fill = 0

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        pos, end = 0, len(view)
        while pos < end:
            take = min(end - pos, self.block_size - self._fill)
            self._crc = zlib.crc32(view[pos:pos + take], self._crc)
            self._fill += take
            pos += take
            if self._fill == self.block_size:
                self.crcs.append(self._crc)
                self._crc = 0
                self._fill = 0

    def hexdigest(self) -> str:
        crcs = self.crcs + ([self._crc] if self._fill else [])
        return "".join(f"{crc:08x}" for crc in crcs)


@dataclass(frozen=True, slots=True)
class TensorSource:
    """An array to write: either ``data`` (an array) or ``chunks`` (a callable yielding
    C-contiguous arrays whose bytes, concatenated, are the tensor in C order).

    A producer may reuse one buffer between chunks: the writer has finished with a chunk
    (written and checksummed) before it asks for the next.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray | None = None
    chunks: Callable[[], Iterable[np.ndarray]] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * CHECKPOINT_DTYPES[self.dtype].itemsize

    def iter_chunks(self) -> Iterator[np.ndarray]:
        if self.data is not None:
            yield self.data
        elif self.chunks is not None:
            yield from self.chunks()


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor in a safetensors file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def itemsize(self) -> int:
        return CHECKPOINT_DTYPES[self.dtype].itemsize


def build_header(sources: Sequence[tuple[str, str, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None,
                 ) -> tuple[bytes, list[HeaderEntry]]:
    """Build the safetensors prefix (8-byte length + padded JSON) and the data layout.

    Tensors are laid out by decreasing item size, then name, so each starts aligned to
    its item size (the header is space-padded to a multiple of 8, as safetensors does).
    Returns the prefix and the entries in file order with absolute offsets.
    """
    order = sorted(range(len(sources)),
                   key=lambda i: (-CHECKPOINT_DTYPES[sources[i][1]].itemsize, sources[i][0]))
    names = set()
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    layout = []
    for index in order:
        name, dtype, shape = sources[index]
        if name in names or name == "__metadata__":
            raise ValueError(f"duplicate or reserved tensor name {name!r}")
        names.add(name)
        nbytes = math.prod(shape) * CHECKPOINT_DTYPES[dtype].itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        layout.append((name, dtype, tuple(shape), offset, offset + nbytes))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    entries = [HeaderEntry(n, d, s, len(prefix) + b, len(prefix) + e)
               for n, d, s, b, e in layout]
    return prefix, entries


def write_safetensors(path: str | os.PathLike[str], sources: Sequence[TensorSource], *,
                      metadata: Mapping[str, str] | None = None,
                      block_size: int = CHECKSUM_BLOCK_SIZE,
                      progress: Callable[[int], None] | None = None,
                      syncing: Callable[[], contextlib.AbstractContextManager[Any]] | None
                      = None) -> tuple[int, str]:
    """Write ``sources`` as one safetensors file at ``path``, crash-safely.

    Returns ``(size, checksum)`` for the :class:`FileRecord`. The bytes go to a temp
    sibling, are fsynced, then renamed over ``path`` and the directory fsynced; on any
    error the temp file is removed and ``path`` is untouched. ``progress(n)`` is called
    with the byte count after each piece; the file's fsync runs inside ``syncing()`` (a
    trace span) when given.
    """
    path = Path(path)
    by_name = {s.name: s for s in sources}
    prefix, entries = build_header([(s.name, s.dtype, tuple(s.shape)) for s in sources],
                                   metadata)
    checksum = BlockChecksum(block_size)
    tmp = path.parent / temp_name(path.name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    written = 0
    try:
        checksum.update(prefix)
        _write_all(fd, memoryview(prefix))
        written = len(prefix)
        for entry in entries:
            source = by_name[entry.name]
            expected = entry.end - entry.begin
            got = 0
            for chunk in source.iter_chunks():
                view = byte_memoryview(_as_le_contiguous(chunk, source.dtype))
                got += len(view)
                if got > expected:
                    raise ValueError(f"{entry.name}: producer gave more than {expected} bytes")
                for start in range(0, len(view), _WRITE_PIECE):
                    # CRC first, then write while the piece is still in cache: as fast as
                    # a plain write here, and it needs no second thread (the CPUs are busy
                    # with the other ranks' saves).
                    piece = view[start:start + _WRITE_PIECE]
                    checksum.update(piece)
                    _write_all(fd, piece)
                    written += len(piece)
                    if progress is not None:
                        progress(written)
            if got != expected:
                raise ValueError(f"{entry.name}: producer gave {got} bytes, expected {expected}")
        with contextlib.nullcontext() if syncing is None else syncing():
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        _unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)
    return written, checksum.hexdigest()


def _as_le_contiguous(array: Any, dtype: str) -> np.ndarray:
    array = np.asarray(array)
    target = CHECKPOINT_DTYPES[dtype]
    if dtype_name(array.dtype) != dtype:
        raise TypeError(f"array of dtype {array.dtype} where {dtype} was declared")
    if array.dtype != target or not array.flags.c_contiguous:
        array = np.ascontiguousarray(array, dtype=target)
    return array


def _header_entry(name: str, info: Any, data_start: int) -> HeaderEntry:
    """One safetensors header entry, checked with exact integers (no int64 wrap-around):
    a known dtype, at most ``MAX_NDIM`` non-negative dims, and offsets spanning exactly
    the tensor's bytes."""
    if not isinstance(info, dict):
        raise TypeError(f"{name!r}: entry is not an object")
    dtype = _FROM_SAFETENSORS[info["dtype"]]
    if dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"{name!r}: dtype {info['dtype']} is not supported here")
    shape = info["shape"]
    offsets = info["data_offsets"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ValueError(f"{name!r}: shape must be a list of at most {MAX_NDIM} dims")
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise ValueError(f"{name!r}: data_offsets must be [begin, end]")
    for value in (*shape, *offsets):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name!r}: {value!r:.40} is not an integer >= 0")
    begin, end = offsets
    nbytes = math.prod(shape) * CHECKPOINT_DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise ValueError(f"{name!r}: offsets {begin}..{end} do not hold {dtype} "
                         f"{tuple(shape)} ({nbytes} bytes)")
    return HeaderEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


class ShardFile:
    """A checkpoint shard file opened for verified random-access reads.

    ``record`` (from the metadata) gives the expected size and block CRCs; with
    ``verify=True`` a size mismatch is reported at open and every block a read touches
    is checked once. The file is opened by :func:`open_checkpoint_file` with its parent
    as the checkpoint directory (a regular file, not reached through a symlink leading
    elsewhere). Thread-safe: reads use ``os.preadv`` on one descriptor. ``bytes_read``
    counts every byte read from the file (header, data, whole edge blocks for
    verification), which is how tests hold a resharding load to the pieces it needs.
    """

    def __init__(self, path: str | os.PathLike[str], record: FileRecord | None = None, *,
                 verify: bool = True) -> None:
        self.path = Path(path)
        self.record = record
        self.verify = verify and record is not None
        self._fd = open_checkpoint_file(self.path.parent, self.path.name)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._verified: set[int] = set()
        self.bytes_read = 0
        self.size = os.fstat(self._fd).st_size
        try:
            if record is not None and self.size != record.size:
                raise CheckpointCorruptError(
                    f"{self.path}: {self.size} bytes on disk, metadata says {record.size} "
                    f"({'truncated' if self.size < record.size else 'extended'})")
            self.entries, self.user_metadata, self.data_start = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    # -- lifecycle
    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- header
    def _read_header(self) -> tuple[dict[str, HeaderEntry], dict[str, str], int]:
        if self.size < 8:
            raise CheckpointCorruptError(f"{self.path}: {self.size} bytes is too short for "
                                         f"a safetensors file")
        length_bytes = bytearray(8)
        self.read_into(0, memoryview(length_bytes))
        (length,) = struct.unpack("<Q", length_bytes)
        if length > MAX_HEADER_BYTES or 8 + length > self.size:
            raise CheckpointCorruptError(f"{self.path}: header length {length} is invalid "
                                         f"for a {self.size}-byte file")
        raw = bytearray(length)
        self.read_into(8, memoryview(raw))
        header = parse_json(raw, f"{self.path}: header")
        if not isinstance(header, dict):
            raise CheckpointCorruptError(f"{self.path}: header is not a JSON object")
        data_start = 8 + length
        user = header.pop("__metadata__", None) or {}
        if not isinstance(user, dict) or not all(isinstance(v, str) for v in user.values()):
            raise CheckpointCorruptError(f"{self.path}: __metadata__ is not an object of "
                                         f"strings")
        entries = {}
        try:
            for name, info in header.items():
                entries[name] = _header_entry(name, info, data_start)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{self.path}: bad header entry: {exc}") from exc
        position = data_start
        for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
            if entry.begin != position:
                raise CheckpointCorruptError(f"{self.path}: data of {entry.name!r} starts at "
                                             f"{entry.begin}, expected {position}")
            position = entry.end
        if position != self.size:
            raise CheckpointCorruptError(f"{self.path}: data ends at {position}, file has "
                                         f"{self.size} bytes (truncated?)")
        return entries, dict(user), data_start

    def entry(self, name: str) -> HeaderEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise CheckpointCorruptError(f"{self.path} does not hold tensor {name!r}") from None

    # -- raw reads
    def _pread(self, offset: int, out: memoryview) -> None:
        got = 0
        total = len(out)
        while got < total:
            try:
                n = os.preadv(self._fd, [out[got:]], offset + got)
            except OSError as exc:
                raise CheckpointError(f"{self.path}: read of {total - got} bytes at "
                                      f"{offset + got} failed: {exc.strerror}") from exc
            if n == 0:
                raise CheckpointCorruptError(f"{self.path}: unexpected end of file at "
                                             f"{offset + got} (truncated)")
            got += n
            with self._lock:
                self.bytes_read += n

    def _check_block(self, index: int, data: memoryview) -> None:
        record = self.record
        if record is None:  # pragma: no cover - verify requires a record
            return
        if zlib.crc32(data) != record.block_crc(index):
            start = index * record.block_size
            raise CheckpointCorruptError(
                f"{self.path}: checksum mismatch in bytes {start}..{start + len(data)} "
                f"(block {index}): the file is corrupted")
        with self._lock:
            self._verified.add(index)

    def _scratch(self, size: int) -> memoryview:
        """A per-thread bounce buffer for edge blocks (reused: no allocation per read)."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < size:
            buffer = bytearray(size)
            self._local.buffer = buffer
        return memoryview(buffer)[:size]

    def read_into(self, offset: int, out: memoryview) -> None:
        """Read ``len(out)`` bytes at ``offset``, verifying every block touched once.

        Runs of unverified whole blocks are read straight into ``out`` up to 1 MiB at a
        time and checked while still in cache; blocks verified earlier are read in one
        call; a partially covered, unverified edge block is read whole into a scratch
        buffer, checked, and the needed part copied.
        """
        out = out.cast("B") if out.format != "B" else out
        end = offset + len(out)
        if end > self.size:
            raise CheckpointCorruptError(f"{self.path}: read of {offset}..{end} is past the "
                                         f"end ({self.size} bytes; truncated?)")
        if not out:
            return
        if not self.verify:
            self._pread(offset, out)
            return
        record = self.record
        if record is None:
            raise ValueError(f"{self.path}: verify is on but there is no checksum record")
        bs = record.block_size
        verified = self._verified
        last = (end - 1) // bs
        fused = max(1, _FUSED_READ_BYTES // bs)

        def whole(index: int) -> bool:
            b_start = index * bs
            return offset <= b_start and min(b_start + bs, self.size) <= end

        index = offset // bs
        while index <= last:
            lo = max(offset, index * bs)
            if index in verified:
                stop = index + 1
                while stop <= last and stop in verified:
                    stop += 1
                hi = min(end, stop * bs)
                self._pread(lo, out[lo - offset:hi - offset])
                index = stop
            elif whole(index):
                stop = index + 1
                while (stop <= last and stop - index < fused and stop not in verified
                       and whole(stop)):
                    stop += 1
                hi = min(end, stop * bs)
                view = out[lo - offset:hi - offset]
                self._pread(lo, view)
                for block in range(index, stop):
                    start = (block - index) * bs
                    self._check_block(block, view[start:start + bs])
                index = stop
            else:
                b_start = index * bs
                b_end = min(b_start + bs, self.size)
                hi = min(end, b_end)
                scratch = self._scratch(b_end - b_start)
                self._pread(b_start, scratch)
                self._check_block(index, scratch)
                out[lo - offset:hi - offset] = scratch[lo - b_start:hi - b_start]
                index += 1

    def verify_all(self, progress: Callable[[int], None] | None = None) -> None:
        """Check every block of the file against the recorded checksums."""
        if self.record is None:
            raise ValueError(f"{self.path}: no checksum record to verify against")
        bs = self.record.block_size
        if self.record.num_blocks != -(-self.size // bs):
            raise CheckpointCorruptError(f"{self.path}: size and checksum count disagree")
        step = max(bs, (_SCRATCH_BYTES // bs) * bs)
        buffer = bytearray(min(step, max(self.size, 1)))
        for start in range(0, self.size, step):
            length = min(step, self.size - start)
            view = memoryview(buffer)[:length]
            self._pread(start, view)
            for off in range(0, length, bs):
                self._check_block((start + off) // bs, view[off:off + bs])
            if progress is not None:
                progress(start + length)

    # -- tensor reads
    def read_tensor(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """Read a whole stored tensor (into ``out`` if given)."""
        entry = self.entry(name)
        box = tuple((0, n) for n in entry.shape)
        if out is None:
            out = np.empty(entry.shape, dtype=CHECKPOINT_DTYPES[entry.dtype])
        self.read_box(name, box, out)
        return out

    def read_box(self, name: str, box: Box, dest: np.ndarray) -> None:
        """Copy ``stored[box]`` of tensor ``name`` into ``dest`` (shape = box shape).

        Reads only the byte ranges the box covers (plus, when verifying, the edge blocks
        needed to check them); memory beyond ``dest`` is at most an 8 MiB bounce buffer.
        """
        entry = self.entry(name)
        dtype = CHECKPOINT_DTYPES[entry.dtype]
        if dest.dtype != dtype:
            raise TypeError(f"{name}: destination dtype {dest.dtype}, stored {dtype}")
        if tuple(dest.shape) != box_shape(box):
            raise ValueError(f"{name}: destination shape {dest.shape} != box {box}")
        if len(box) != len(entry.shape):
            raise ValueError(f"{name}: box {box} does not match stored shape {entry.shape}")
        if dest.size == 0:
            return
        self._read_region(entry.begin, entry.shape, dtype, box, dest)

    def _read_region(self, base: int, shape: tuple[int, ...], dtype: np.dtype[Any], box: Box,
                     dest: np.ndarray) -> None:
        itemsize = dtype.itemsize
        ndim = len(shape)
        strides = [1] * ndim
        for d in range(ndim - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        corner = sum(lo * s for (lo, _), s in zip(box, strides))
        k, run = run_layout(shape, box)
        grid = box_shape(box)[:k]
        n_runs = math.prod(grid)
        if n_runs == 1:  # one contiguous byte range
            offset = base + corner * itemsize
            if dest.flags.c_contiguous:
                self.read_into(offset, byte_memoryview(dest))
            else:
                self._read_contiguous_strided(offset, dtype, dest)
            return
        if run * itemsize >= _DIRECT_RUN_BYTES:
            for index in np.ndindex(*grid):
                element = corner + sum(i * s for i, s in zip(index, strides))
                sub = dest[(*index, ...)]
                offset = base + element * itemsize
                if sub.flags.c_contiguous:
                    self.read_into(offset, byte_memoryview(sub))
                else:
                    self._read_contiguous_strided(offset, dtype, sub)
            return
        # Many short runs: read spans of whole rows (dim 0) through the bounce buffer.
        lo0, hi0 = box[0]
        last_in_row = sum((hi - 1 - lo) * s for (lo, hi), s in zip(box[1:], strides[1:]))
        row_span = (strides[0] if hi0 - lo0 > 1 else last_in_row + 1) * itemsize
        rows_per = _SCRATCH_BYTES // max(row_span, 1)
        if rows_per < 1:
            for i in range(lo0, hi0):
                self._read_region(base + i * strides[0] * itemsize, shape[1:], dtype, box[1:],
                                  dest[i - lo0, ...])
            return
        scratch = np.empty(_SCRATCH_BYTES // itemsize + 1, dtype=dtype)
        byte_strides = tuple(s * itemsize for s in strides)
        for r0 in range(lo0, hi0, rows_per):
            r1 = min(hi0, r0 + rows_per)
            first = corner + (r0 - lo0) * strides[0]
            span = (r1 - 1 - r0) * strides[0] + last_in_row + 1
            self.read_into(base + first * itemsize, byte_memoryview(scratch[:span]))
            view = np.ndarray((r1 - r0, *box_shape(box)[1:]), dtype=dtype,
                              buffer=scratch, offset=0, strides=byte_strides)
            np.copyto(dest[r0 - lo0:r1 - lo0], view)

    def _read_contiguous_strided(self, offset: int, dtype: np.dtype[Any],
                                 dest: np.ndarray) -> None:
        """A contiguous source range into a non-contiguous destination, in pieces."""
        itemsize = dtype.itemsize
        if dest.ndim == 0:
            dest = dest.reshape(1)
        row = math.prod(dest.shape[1:])
        rows_per = _SCRATCH_BYTES // max(row * itemsize, 1)
        if rows_per < 1:
            for i in range(dest.shape[0]):
                self._read_contiguous_strided(offset + i * row * itemsize, dtype, dest[i, ...])
            return
        scratch = np.empty(min(rows_per, dest.shape[0]) * row, dtype=dtype)
        for r0 in range(0, dest.shape[0], rows_per):
            r1 = min(dest.shape[0], r0 + rows_per)
            part = scratch[:(r1 - r0) * row]
            self.read_into(offset + r0 * row * itemsize, byte_memoryview(part))
            np.copyto(dest[r0:r1], part.reshape((r1 - r0, *dest.shape[1:])))
