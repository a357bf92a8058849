"""PURE checkpoint metadata: shard specs, file records and the ``metadata.json`` codec.

A checkpoint is described by one :class:`ShardMetadata`: how many ranks wrote it, how
every tensor is placed (sharded along one dimension with explicit per-rank sizes,
replicated, or on the checkpoint's device mesh with one ``Shard``/``Replicate`` per mesh
dimension), which rank's file holds each replicated tensor and each piece of a
mesh-placed one, and one :class:`FileRecord` per rank file with its size and block
checksums. The JSON form is
specified byte by byte in ``docs/PROTOCOL.md`` ("Checkpoint layout").

Parsing is defensive: a checkpoint may come from anywhere, so every document is read by
:func:`parse_json` (nesting bounded by ``MAX_JSON_DEPTH``) and every parsed value is
checked before any of it is used: shapes are exact Python ints within ``MAX_NDIM`` and
the int64 range, every rank's tensors fit in the file its record describes, file names
are plain names inside the checkpoint directory, per-rank value lists have one entry
per rank. Anything else is a ``CheckpointCorruptError`` naming the file.

Non-tensor values (step counters, optimizer hyper-parameters, NumPy RNG states) travel
through :func:`encode_json_value` / :func:`decode_json_value`, a JSON codec that
round-trips the values JSON cannot carry natively: integers outside the signed 64-bit
range (PCG64 states are 128-bit), NaN/infinity, tuples, dicts with non-string keys,
bytes, NumPy scalars and small arrays, and ``np.random.Generator`` objects. (Not to be
confused with the object collectives' msgpack blobs, ``netdist.collectives.objects``.)
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netdist.checkpoint.dtypes import CHECKPOINT_DTYPES, dtype_name
from netdist.checkpoint.views import VIEW_NODE, TensorView
from netdist.errors import CheckpointCorruptError, CheckpointVersionError
from netdist.sharding import (
    MAX_NDIM,
    ChunkRule,
    MeshSharding,
    Placement,
    Shard,
    TensorShardSpec,
    chunk_bounds,
    chunk_sizes,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "LATEST_FILE",
    "CHECKSUM_ALGORITHM",
    "CHECKSUM_BLOCK_SIZE",
    "MAX_JSON_DEPTH",
    "MAX_NDIM",
    "MAX_METADATA_BYTES",
    "Placement",
    "TensorShardSpec",
    "MeshSharding",
    "Writer",
    "check_mesh",
    "without_mesh",
    "FileRecord",
    "StateLayout",
    "ShardMetadata",
    "rank_file_name",
    "step_dir_name",
    "parse_step_dir_name",
    "check_file_name",
    "json_depth",
    "parse_json",
    "encode_json_value",
    "decode_json_value",
]

FORMAT_NAME = "netdist-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
CHECKSUM_ALGORITHM = "crc32-blocks"
CHECKSUM_BLOCK_SIZE = 256 << 10
"""Each rank file is checksummed in blocks of this many bytes (CRC-32 per block), so a
resharding load verifies exactly the blocks it reads instead of whole files; a read
that starts or ends inside a block reads that whole block (at most 2 x 256 KiB extra)."""

MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays/objects accepted in ``metadata.json`` and in a safetensors
header (serde_json's default, which the reference safetensors parser uses). Deeper
documents are refused before anything recurses over them."""
MAX_METADATA_BYTES = 1 << 30
"""Largest ``metadata.json`` a reader accepts."""

_STEP_RE = re.compile(r"^step_(\d+)$")
_HEX_RE = re.compile(r"[0-9a-fA-F]*")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_TAG = "$nd"
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


Writer = int | tuple[int, ...]
"""Who stores a tensor: the rank holding a replicated tensor, or for a mesh-placed one
the rank holding each of its pieces, in piece order. (A sharded tensor's shards are
stored by their own ranks.)"""


def check_mesh(mesh: Any, num_ranks: int | None = None) -> dict[str, list[Any]]:
    """``mesh`` as the checked ``{"shape": [...], "names": [...]}`` of a checkpoint whose
    tensors are placed on it: a shape of ints >= 1 (of ``num_ranks`` ranks in all, when
    given), one distinct non-empty name per dimension. ``ValueError`` otherwise."""
    if not isinstance(mesh, Mapping) or set(mesh) != {"shape", "names"}:
        raise ValueError(f"the mesh must be {{\"shape\": [...], \"names\": [...]}}, got "
                         f"{mesh!r:.80}")
    shape, names = mesh["shape"], mesh["names"]
    if not isinstance(shape, (list, tuple)) or not shape or len(shape) > MAX_NDIM or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
        raise ValueError(f"mesh shape {shape!r:.80} is not a list of 1 to {MAX_NDIM} ints >= 1")
    if not isinstance(names, (list, tuple)) or len(names) != len(shape) or not all(
            isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"mesh names {names!r:.80} are not {len(shape)} distinct non-empty "
                         f"strings, one per dimension of the mesh shape {list(shape)}")
    if num_ranks is not None and math.prod(shape) != num_ranks:
        raise ValueError(f"the mesh of shape {list(shape)} has {math.prod(shape)} ranks, the "
                         f"checkpoint was saved by {num_ranks}")
    return {"shape": [int(n) for n in shape], "names": list(names)}


def without_mesh(spec: TensorShardSpec, num_ranks: int) -> TensorShardSpec:
    """A mesh-placed tensor on ``num_ranks`` ranks without a mesh: split evenly
    (``chunk_sizes``) along the first tensor dim its placements shard, or replicated if
    they shard none. Other specs are returned as they are."""
    if spec.mesh is None:
        return spec
    dims = sorted(p.dim for p in spec.mesh.placements if isinstance(p, Shard))
    if not dims:
        return TensorShardSpec.replicated(spec.full_shape, spec.dtype)
    return TensorShardSpec.even(spec.full_shape, num_ranks, dims[0], spec.dtype)


def rank_file_name(rank: int) -> str:
    """File name of ``rank``'s shard file: ``rank_00003.safetensors``."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return f"rank_{rank:05d}.safetensors"


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint of ``step``: ``step_000100``."""
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step_{int(step):06d}"


def parse_step_dir_name(name: str) -> int | None:
    """Step number of a ``step_N`` directory name, ``None`` for any other name."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def check_file_name(name: object, what: str = "file name") -> str:
    """``name`` if it is a plain file name (one path component); else ``ValueError``.

    Every file of a checkpoint lives directly in its directory, so a name holding a
    separator, ``..``, a drive or a NUL byte can only point somewhere else.
    """
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name
            or "\\" in name or "\0" in name or ":" in name):
        raise ValueError(f"{what} {name!r} is not a plain file name inside the checkpoint "
                         f"directory")
    return name


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, ``[]`` is 1), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return deepest


def parse_json(text: str | bytes | bytearray, source: str, *,
               max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a JSON document read from ``source``, refusing one nested past ``max_depth``.

    Every failure (not JSON, not UTF-8, integers too long, nesting too deep for the
    parser or past the limit) is a ``CheckpointCorruptError`` that names ``source``, so
    nothing that later walks the value recursively can run out of stack.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise CheckpointCorruptError(
            f"{source}: JSON nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"{source} is not JSON: {exc}") from exc
    if json_depth(value) > max_depth:
        raise CheckpointCorruptError(f"{source}: JSON nested deeper than {max_depth} levels")
    return value


def _strict_int(value: Any, what: str) -> int:
    """A JSON integer (not a bool, float or string), as a Python int."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got {value!r:.60}")
    return value


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"missing key {exc.args[0]!r:.60}" if exc.args else "missing key"
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One rank file as committed: name, exact size and per-block CRC-32 checksums.

    ``checksum`` is the concatenation of one 8-hex-digit CRC-32 per ``block_size`` bytes
    of the file (the last block may be shorter), covering header and data alike.
    """

    rank: int
    name: str
    size: int
    checksum: str
    block_size: int = CHECKSUM_BLOCK_SIZE
    algorithm: str = CHECKSUM_ALGORITHM

    def __post_init__(self) -> None:
        check_file_name(self.name, f"rank {self.rank}'s file name")
        if self.size < 0:
            raise ValueError(f"file size must be >= 0, got {self.size}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        expected = -(-self.size // self.block_size) * 8
        if len(self.checksum) != expected:
            raise ValueError(f"{self.name}: {len(self.checksum)} checksum digits for "
                             f"{self.size} bytes, expected {expected}")
        if not _HEX_RE.fullmatch(self.checksum):
            raise ValueError(f"{self.name}: checksum blocks are not hex digits")

    @property
    def num_blocks(self) -> int:
        return len(self.checksum) // 8

    def block_crc(self, index: int) -> int:
        return int(self.checksum[8 * index: 8 * index + 8], 16)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "name": self.name, "size": self.size,
                "checksum": {"algorithm": self.algorithm, "block_size": self.block_size,
                             "blocks": self.checksum}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FileRecord:
        checksum = data["checksum"]
        if checksum["algorithm"] != CHECKSUM_ALGORITHM:
            raise CheckpointVersionError(
                f"{data['name']}: unknown checksum algorithm {checksum['algorithm']!r}")
        blocks = checksum["blocks"]
        if not isinstance(blocks, str):
            raise TypeError(f"checksum blocks must be a string, got {blocks!r:.60}")
        return cls(_strict_int(data["rank"], "file rank"), data["name"],
                   _strict_int(data["size"], "file size"), blocks,
                   _strict_int(checksum["block_size"], "block_size"))


@dataclass(frozen=True, slots=True)
class StateLayout:
    """How a nested state (collective ``save``) maps onto tensors and plain values.

    ``skeleton`` is the JSON tree of containers with tensor and object leaves named by
    key; ``objects`` holds values equal on every rank; ``rank_objects[key][r]`` holds the
    value rank ``r`` had, for values that differed between ranks.
    """

    skeleton: Any
    objects: Mapping[str, Any] = field(default_factory=dict)
    rank_objects: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"skeleton": self.skeleton,
                "objects": {k: encode_json_value(v) for k, v in self.objects.items()},
                "rank_objects": {k: [encode_json_value(v) for v in vs]
                                 for k, vs in self.rank_objects.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StateLayout:
        rank_objects = {}
        for key, values in data.get("rank_objects", {}).items():
            rank_objects[key] = tuple(decode_json_value(v) for v in _json_list(values, key))
        return cls(data["skeleton"],
                   {k: decode_json_value(v) for k, v in data.get("objects", {}).items()},
                   rank_objects)

    def check(self, num_ranks: int, tensors: Mapping[str, TensorShardSpec]) -> None:
        """``ValueError`` unless the layout can be rebuilt: one value per rank for each
        per-rank key, and a skeleton whose leaves name known tensors and values; a view
        must lie inside a replicated tensor."""
        for key, values in self.rank_objects.items():
            if len(values) != num_ranks:
                raise ValueError(f"per-rank value {key!r} has {len(values)} entries for "
                                 f"{num_ranks} ranks")
        for node in _skeleton_nodes(self.skeleton):
            kind = node.get("t")
            if kind in ("tensor", VIEW_NODE) and node.get("k") not in tensors:
                raise ValueError(f"the state names tensor {node.get('k')!r:.60}, which the "
                                 f"checkpoint does not hold")
            if kind == VIEW_NODE:
                view = TensorView.from_node(node)
                spec = tensors[view.base]
                if not spec.is_replicated:
                    raise ValueError(f"a view of {view.base!r}, which is sharded (views "
                                     f"point into replicated tensors only)")
                view.check(spec.full_shape)
            if kind == "object" and (not isinstance(node.get("k"), str) or (
                    node["k"] not in self.objects and node["k"] not in self.rank_objects)):
                raise ValueError(f"the state names value {node.get('k')!r:.60}, which the "
                                 f"checkpoint does not hold")


def _json_list(value: Any, what: str) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise TypeError(f"{what} must be a list, got {value!r:.60}")
    return tuple(value)


def _skeleton_nodes(skeleton: Any) -> Iterator[dict[str, Any]]:
    """Every node of a state skeleton, checking each one's form (no recursion)."""
    stack = [skeleton]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or node.get("t") not in (
                "tensor", VIEW_NODE, "object", "dict", "list", "tuple"):
            raise ValueError(f"malformed state skeleton node {node!r:.80}")
        yield node
        if node["t"] in ("tensor", VIEW_NODE, "object"):
            continue
        items = node.get("items")
        if not isinstance(items, list):
            raise ValueError(f"state skeleton node without items: {node!r:.80}")
        if node["t"] != "dict":
            stack.extend(items)
            continue
        for item in items:
            if not isinstance(item, list) or len(item) != 2:
                raise ValueError(f"malformed state dict item {item!r:.80}")
            key = decode_json_value(item[0])
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise ValueError(f"state dict key {key!r:.60} is not a str or int")
            stack.append(item[1])


@dataclass(frozen=True, slots=True)
class ShardMetadata:
    """Everything needed to read a checkpoint back, at any world size.

    ``num_ranks`` ranks saved it; ``tensor_specs`` maps tensor name to placement;
    ``mesh`` describes the device mesh: when a tensor is placed on it, the checked
    ``{"shape": [2, 2], "names": ["dp", "tp"]}`` (:func:`check_mesh`: ``num_ranks`` ranks,
    and every mesh-placed tensor on that shape); otherwise a free-form value (as
    checkpoints before mesh placements had it) or None. ``extra`` holds free-form
    non-tensor state (encoded with :func:`encode_json_value`). Fields filled in by a save:
    ``writers`` (a :data:`Writer` for every replicated and mesh-placed tensor: who stores
    it, or each of its pieces), ``files`` (one record per rank file), ``step``, ``state``
    (the nested-state layout of a collective save) and ``generation`` (bumped each time a
    directory is saved into again).
    """

    num_ranks: int
    tensor_specs: Mapping[str, TensorShardSpec]
    version: int = FORMAT_VERSION
    mesh: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    step: int | None = None
    writers: Mapping[str, Writer] = field(default_factory=dict)
    files: tuple[FileRecord, ...] = ()
    state: StateLayout | None = None
    generation: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_ranks, (int, np.integer)) or self.num_ranks < 1:
            raise ValueError(f"num_ranks must be an int >= 1, got {self.num_ranks!r}")
        object.__setattr__(self, "num_ranks", int(self.num_ranks))
        specs = dict(self.tensor_specs)
        for name, spec in specs.items():
            if not isinstance(name, str) or not name or name == "__metadata__":
                raise ValueError(f"invalid tensor name {name!r}")
            if not isinstance(spec, TensorShardSpec):
                raise TypeError(f"tensor_specs[{name!r}] must be a TensorShardSpec, "
                                f"got {type(spec).__name__}")
            if spec.num_shards is not None and spec.num_shards != self.num_ranks:
                raise ValueError(f"tensor {name!r} is split over {spec.num_shards} ranks, "
                                 f"but the checkpoint has {self.num_ranks}")
        object.__setattr__(self, "tensor_specs", specs)
        object.__setattr__(self, "extra", dict(self.extra))
        object.__setattr__(self, "writers", dict(self.writers))
        object.__setattr__(self, "files", tuple(self.files))
        placed = [name for name, spec in specs.items() if spec.mesh is not None]
        if placed:
            try:
                mesh = check_mesh(self.mesh, self.num_ranks)
            except ValueError as exc:
                raise ValueError(f"tensor {placed[0]!r} is placed on a mesh, but {exc}") from None
            object.__setattr__(self, "mesh", mesh)
            for name in placed:
                mesh_shape = specs[name].mesh.mesh_shape  # type: ignore[union-attr]
                if list(mesh_shape) != mesh["shape"]:
                    raise ValueError(f"tensor {name!r} is placed on a mesh of shape "
                                     f"{list(mesh_shape)}, the checkpoint's mesh is "
                                     f"{mesh['shape']}")
        for name, writer in self.writers.items():
            self._check_writer(name, writer)

    def _check_writer(self, name: str, writer: Any) -> None:
        spec = self.tensor_specs.get(name)
        if spec is None or spec.num_shards is not None:
            raise ValueError(f"writer given for {name!r}, which is not a replicated or "
                             f"mesh-placed tensor")
        if spec.is_replicated:
            if not isinstance(writer, (int, np.integer)) or not 0 <= writer < self.num_ranks:
                raise ValueError(f"writer {writer!r:.40} of {name!r} is not a rank")
            return
        holders = spec.piece_holders(self.num_ranks)
        if not isinstance(writer, tuple) or len(writer) != len(holders):
            raise ValueError(f"tensor {name!r} has {len(holders)} pieces, but its writers are "
                             f"{writer!r:.60} (one rank per piece)")
        for piece, (rank, held_by) in enumerate(zip(writer, holders)):
            if rank not in held_by:
                raise ValueError(f"writer {rank!r:.20} of piece {piece} of tensor {name!r} "
                                 f"does not hold that piece (ranks "
                                 f"{', '.join(map(str, held_by[:8]))} do)")

    def piece_writers(self, name: str) -> tuple[int, ...]:
        """The rank whose file stores each piece of tensor ``name`` (a sharded tensor's
        shards by their own ranks)."""
        spec = self.tensor_specs[name]
        writer = self.writers.get(name)
        if spec.num_shards is not None:
            return tuple(range(spec.num_shards))
        if writer is None:
            raise ValueError(f"tensor {name!r} has no writer")
        return writer if isinstance(writer, tuple) else (writer,)

    def check_committed(self) -> None:
        """``ValueError`` unless this describes a complete, self-consistent checkpoint.

        One file record per rank; a dtype for every tensor and a writer for every
        replicated one; every rank's tensors (counted exactly, in Python ints) fit in the
        size its file record gives, so no reader sizes a buffer from a shape the files
        cannot hold; the state layout (if any) can be rebuilt. ``from_json`` runs this on
        every ``metadata.json`` it parses.
        """
        ranks = sorted(record.rank for record in self.files)
        if len(ranks) != self.num_ranks or ranks != list(range(self.num_ranks)):
            raise ValueError(f"file records are for ranks {ranks[:16]}, expected one for "
                             f"each of the {self.num_ranks} ranks")
        needed = [0] * self.num_ranks
        for name, spec in self.tensor_specs.items():
            if spec.dtype is None:
                raise ValueError(f"tensor {name!r} has no dtype")
            itemsize = CHECKPOINT_DTYPES[spec.dtype].itemsize
            if spec.num_shards is None and name not in self.writers:
                kind = "replicated" if spec.is_replicated else "mesh-placed"
                raise ValueError(f"{kind} tensor {name!r} has no writer")
            for piece, rank in enumerate(self.piece_writers(name)):
                box = spec.piece_box(piece)
                needed[rank] += math.prod(hi - lo for lo, hi in box) * itemsize
        for record in self.files:
            if needed[record.rank] > record.size:
                raise ValueError(
                    f"rank {record.rank}'s tensors need {needed[record.rank]} bytes, but its "
                    f"file {record.name} has {record.size}")
        if self.state is not None:
            self.state.check(self.num_ranks, self.tensor_specs)

    def file_for(self, rank: int) -> FileRecord | None:
        for record in self.files:
            if record.rank == rank:
                return record
        return None

    def to_json(self) -> dict[str, Any]:
        tensors = {}
        for name, spec in self.tensor_specs.items():
            entry = spec.to_json()
            writer = self.writers.get(name)
            if isinstance(writer, tuple):
                entry["writers"] = list(writer)
            elif writer is not None:
                entry["writer"] = writer
            tensors[name] = entry
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "num_ranks": self.num_ranks,
            "step": self.step,
            "generation": self.generation,
            "mesh": encode_json_value(self.mesh) if self.mesh is not None else None,
            "tensors": tensors,
            "files": [record.to_json() for record in self.files],
            "extra": encode_json_value(dict(self.extra)),
            "state": self.state.to_json() if self.state is not None else None,
        }

    def dumps(self) -> str:
        """The ``metadata.json`` text: one top-level key per line, one tensor or file
        record per line (diff- and grep-friendly), plain JSON all the same. A document
        that readers would refuse as nested too deeply (``MAX_JSON_DEPTH``) is refused
        here, at save time."""
        doc = self.to_json()
        depth = json_depth(doc)
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"the checkpoint metadata would be nested {depth} levels deep; "
                             f"readers accept at most {MAX_JSON_DEPTH} (flatten the state)")

        def compact(value: Any) -> str:
            return json.dumps(value, separators=(", ", ": "), allow_nan=False)

        lines = ["{"]
        keys = list(doc)
        for index, key in enumerate(keys):
            value = doc[key]
            comma = "," if index < len(keys) - 1 else ""
            if key == "tensors" and value:
                lines.append(f" {json.dumps(key)}: {{")
                items = list(value.items())
                for j, (name, entry) in enumerate(items):
                    sep = "," if j < len(items) - 1 else ""
                    lines.append(f"  {json.dumps(name)}: {compact(entry)}{sep}")
                lines.append(" }" + comma)
            elif key == "files" and value:
                lines.append(f" {json.dumps(key)}: [")
                for j, entry in enumerate(value):
                    sep = "," if j < len(value) - 1 else ""
                    lines.append(f"  {compact(entry)}{sep}")
                lines.append(" ]" + comma)
            else:
                lines.append(f" {json.dumps(key)}: {compact(value)}{comma}")
        lines.append("}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_json(cls, data: Any, source: str = METADATA_FILE) -> ShardMetadata:
        """Parse and check (:meth:`check_committed`) the JSON form read from ``source``.

        Malformed or inconsistent documents raise ``CheckpointCorruptError`` naming
        ``source``; newer format versions raise ``CheckpointVersionError``.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise CheckpointCorruptError(f"{source}: not a netdist checkpoint metadata "
                                         f"document")
        version = data.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CheckpointCorruptError(f"{source}: invalid format version {version!r:.40}")
        if version > FORMAT_VERSION:
            raise CheckpointVersionError(
                f"{source}: checkpoint format version {version} is newer than this netdist "
                f"supports ({FORMAT_VERSION}); upgrade netdist to read it")
        try:
            metadata = cls._from_document(data, version)
            metadata.check_committed()
        except CheckpointVersionError as exc:
            raise CheckpointVersionError(f"{source}: {exc}") from exc
        except CheckpointCorruptError as exc:
            raise CheckpointCorruptError(f"{source}: {exc}") from exc
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise CheckpointCorruptError(f"{source}: malformed checkpoint metadata: "
                                         f"{_describe_error(exc)}") from exc
        return metadata

    @classmethod
    def _from_document(cls, data: dict[str, Any], version: int) -> ShardMetadata:
        num_ranks = _strict_int(data["num_ranks"], "num_ranks")
        tensors = data["tensors"]
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors must be an object, got {tensors!r:.60}")
        raw_mesh = data.get("mesh")
        mesh = decode_json_value(raw_mesh) if raw_mesh is not None else None
        placed = [name for name, entry in tensors.items()
                  if isinstance(entry, dict) and entry.get("placement") == Placement.MESH.value]
        if placed:
            try:
                mesh = check_mesh(mesh, num_ranks)
            except ValueError as exc:
                raise ValueError(f"tensor {placed[0]!r} is placed on a mesh, but {exc}") \
                    from None
        specs = {}
        writers: dict[str, Writer] = {}
        for name, entry in tensors.items():
            try:
                specs[name] = TensorShardSpec.from_json(
                    entry, mesh["shape"] if placed and mesh is not None else None)
                if "writer" in entry:
                    writers[name] = _strict_int(entry["writer"], "writer")
                if "writers" in entry:
                    writers[name] = tuple(_strict_int(w, "a writer")
                                          for w in _json_list(entry["writers"], "writers"))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                detail = _describe_error(exc) if isinstance(exc, KeyError) else str(exc)
                raise ValueError(f"tensor {name!r}: {detail}") from exc
        files = tuple(FileRecord.from_json(f) for f in _json_list(data.get("files", []),
                                                                     "files"))
        if num_ranks < 1 or num_ranks != len(files):
            raise ValueError(f"num_ranks is {num_ranks}, with {len(files)} file records")
        step = data.get("step")
        if step is not None and (_strict_int(step, "step") < 0):
            raise ValueError(f"step must be >= 0, got {step}")
        state = data.get("state")
        return cls(
            num_ranks=num_ranks,
            tensor_specs=specs,
            version=version,
            mesh=mesh,
            extra=decode_json_value(data.get("extra", {})),
            step=step,
            writers=writers,
            files=files,
            state=StateLayout.from_json(state) if state is not None else None,
            generation=_strict_int(data.get("generation", 0), "generation"),
        )

    @classmethod
    def loads(cls, text: str | bytes, source: str = METADATA_FILE) -> ShardMetadata:
        """Parse ``metadata.json`` text (read from ``source``, named in every error)."""
        return cls.from_json(parse_json(text, source), source)

    def local_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Shape of every tensor as held by ``rank`` (full shape for replicated ones)."""
        return {name: spec.local_shape(rank) for name, spec in self.tensor_specs.items()}

    def rebalanced(self, num_ranks: int) -> dict[str, TensorShardSpec]:
        """Specs for ``num_ranks`` ranks: same dims, ``chunk_sizes`` split (same layout
        if ``num_ranks`` equals the saved world size). Without a mesh, a mesh-placed
        tensor is split along the first dim its placements shard (:func:`without_mesh`)."""
        if num_ranks == self.num_ranks:
            return dict(self.tensor_specs)
        out = {}
        for name, spec in self.tensor_specs.items():
            if spec.mesh is not None:
                out[name] = without_mesh(spec, num_ranks)
            elif spec.shard_dim is None:
                out[name] = spec
            else:
                sizes = tuple(stop - start for start, stop in
                              chunk_bounds(spec.full_shape[spec.shard_dim], num_ranks))
                out[name] = TensorShardSpec(spec.full_shape, spec.shard_dim, sizes, spec.dtype)
        return out

    def remeshed(self, mesh_shape: Sequence[int],
                 rule: ChunkRule = ChunkRule.NETDIST) -> dict[str, TensorShardSpec]:
        """Specs for a mesh of ``mesh_shape`` (same dimensions as the saved mesh, other
        sizes): mesh-placed tensors keep their placements, split evenly by ``rule``;
        the others are :meth:`rebalanced` over the mesh's ranks."""
        shape = tuple(mesh_shape)
        out = self.rebalanced(math.prod(shape))
        for name, spec in self.tensor_specs.items():
            if spec.mesh is not None:
                out[name] = TensorShardSpec(spec.full_shape, None, (), spec.dtype,
                                            spec.mesh.remeshed(shape, rule))
        return out


# --------------------------------------------------------------------------- object codec


def encode_json_value(obj: Any) -> Any:
    """Encode a plain value into JSON-safe data that :func:`decode_json_value` inverts.

    Supported: None, bool, int (any size), float (incl. NaN/inf), str, bytes, list,
    tuple, dict (any encodable keys), NumPy scalars, small NumPy arrays (inline, base64),
    ``np.random.Generator`` and bit generators. Anything else is a ``TypeError``:
    no pickle, ever.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        if _INT64_MIN <= obj <= _INT64_MAX:
            return obj
        return {_TAG: "int", "v": str(obj)}
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return {_TAG: "float", "v": repr(obj)}
    if isinstance(obj, np.generic):
        dtype = obj.dtype
        if dtype.name not in CHECKPOINT_DTYPES:
            raise TypeError(f"cannot encode NumPy scalar of dtype {dtype}")
        return {_TAG: "scalar", "dtype": dtype.name, "v": encode_json_value(obj.item())}
    if isinstance(obj, np.ndarray):
        name = dtype_name(obj.dtype)
        data = np.ascontiguousarray(obj, dtype=CHECKPOINT_DTYPES[name])
        return {_TAG: "array", "dtype": name, "shape": list(obj.shape),
                "v": base64.b64encode(data.tobytes()).decode("ascii")}
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {_TAG: "bytes", "v": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "v": [encode_json_value(x) for x in obj]}
    if isinstance(obj, list):
        return [encode_json_value(x) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and _TAG not in obj:
            return {k: encode_json_value(v) for k, v in obj.items()}
        return {_TAG: "dict",
                "v": [[encode_json_value(k), encode_json_value(v)] for k, v in obj.items()]}
    if isinstance(obj, np.random.Generator):
        return {_TAG: "generator", "v": encode_json_value(obj.bit_generator.state)}
    if isinstance(obj, np.random.BitGenerator):
        return {_TAG: "bit_generator", "v": encode_json_value(obj.state)}
    raise TypeError(f"cannot store a {type(obj).__name__} in checkpoint metadata "
                    f"(plain values, NumPy scalars/arrays and RNGs only)")


def _bit_generator_from_state(state: Any) -> np.random.BitGenerator:
    if not isinstance(state, dict) or state.get("bit_generator") not in _BIT_GENERATORS:
        raise CheckpointCorruptError(f"unknown bit generator state {state!r:.80}")
    bit_gen = getattr(np.random, state["bit_generator"])()
    bit_gen.state = state
    return bit_gen


def decode_json_value(data: Any) -> Any:
    """Invert :func:`encode_json_value`."""
    if isinstance(data, list):
        return [decode_json_value(x) for x in data]
    if not isinstance(data, dict):
        return data
    tag = data.get(_TAG)
    if tag is None:
        return {k: decode_json_value(v) for k, v in data.items()}
    try:
        value = data["v"]
        if tag == "int":
            return int(value)
        if tag == "float":
            return float(value)
        if tag == "scalar":
            return CHECKPOINT_DTYPES[data["dtype"]].type(decode_json_value(value))
        if tag == "array":
            dtype = CHECKPOINT_DTYPES[data["dtype"]]
            raw = base64.b64decode(value)
            return np.frombuffer(raw, dtype=dtype).reshape(data["shape"]).copy()
        if tag == "bytes":
            return base64.b64decode(value)
        if tag == "tuple":
            return tuple(decode_json_value(x) for x in value)
        if tag == "dict":
            return {_hashable(decode_json_value(k)): decode_json_value(v) for k, v in value}
        if tag == "generator":
            return np.random.Generator(_bit_generator_from_state(decode_json_value(value)))
        if tag == "bit_generator":
            return _bit_generator_from_state(decode_json_value(value))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CheckpointCorruptError(f"malformed encoded value {data!r:.80}: {exc}") from exc
    raise CheckpointCorruptError(f"unknown encoded value tag {tag!r}")


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key
