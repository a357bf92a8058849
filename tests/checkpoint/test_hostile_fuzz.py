"""Fuzz rule of the checkpoint readers: after any mutation of ``metadata.json`` or of a
safetensors header, a load / verify / inspect either succeeds or raises a
``netdist.errors.CheckpointError`` subclass, never anything else."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netdist.checkpoint import (
    ShardMetadata,
    TensorShardSpec,
    flat_shard_metadata,
    inspect_checkpoint,
    load_distributed,
    save_distributed,
    shard_state_dict,
    verify_checkpoint,
)
from netdist.checkpoint.metadata import METADATA_FILE
from netdist.checkpoint.storage import BlockChecksum
from netdist.errors import CheckpointError

pytestmark = pytest.mark.timeout(300)

FULL: dict[str, np.ndarray] = {
    "w": np.arange(6 * 4, dtype=np.float32).reshape(6, 4),
    "b": np.arange(3, dtype=np.int16),
    "s": np.array(2.5),
}

_EDGE_INTS = st.sampled_from([0, 1, 2, 3, -1, 2**31, 2**32, 2**40, 2**63 - 1, 2**63, 2**64,
                              -(2**63), 10**30])
_LEAVES = st.one_of(
    st.none(), st.booleans(), _EDGE_INTS, st.integers(-5, 50),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "..", "../evil", "/etc/passwd", "rank_00000.safetensors",
                     "metadata.json", "F32", "float32", "sharded", "replicated", "$nd",
                     "int", "tuple", "array", "crc32-blocks", "zz", "0000000a"]),
    st.text(max_size=8),
)
_VALUES = st.recursive(_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["$nd", "v", "t", "k", "items", "dtype", "shape",
                                     "data_offsets", "x"]), inner, max_size=4)),
    max_leaves=12)
_DEEP_MARK = "@deep@"
_DEEP = st.integers(100, 5000).map(lambda n: f"{_DEEP_MARK}{n}")
"""Stands for ``n`` nested arrays (too deep to build or dump in Python): see _dumps."""
_REPLACEMENTS = st.one_of(_VALUES, _DEEP)


def _dumps(doc: Any) -> str:
    text = json.dumps(doc)
    while (start := text.find(f'"{_DEEP_MARK}')) >= 0:
        end = text.index('"', start + 1)
        n = int(text[start + 1 + len(_DEEP_MARK):end])
        text = text[:start] + "[" * n + "]" * n + text[end + 1:]
    return text


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fuzz") / "ck"
    meta = flat_shard_metadata(FULL, 2)
    specs = dict(meta.tensor_specs)
    specs["b"] = TensorShardSpec.replicated((3,), "int16")
    meta = ShardMetadata(2, specs, extra={"epoch": 1, "seed": 2**70, "t": (1, 2.5)})
    for rank in range(2):
        save_distributed(shard_state_dict(FULL, meta, rank), directory, rank, 2, meta)
    return directory


def _paths(doc: Any) -> list[tuple[Any, ...]]:
    """Every path into a JSON document (the root is ``()``), found without recursion."""
    out: list[tuple[Any, ...]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), doc)]
    while stack:
        path, node = stack.pop()
        out.append(path)
        if isinstance(node, dict):
            stack.extend((path + (k,), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((path + (i,), v) for i, v in enumerate(node))
    return sorted(out, key=repr)


def _mutate(doc: Any, path: tuple[Any, ...], op: str, value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if op == "delete":
        del parent[last]
    elif op == "append" and isinstance(parent, list):
        parent.append(value)
    else:
        parent[last] = value
    return doc


def _copy(base: Path) -> Path:
    work = Path(tempfile.mkdtemp(dir=base.parent))
    shutil.copytree(base, work / "ck")
    return work / "ck"


def _exercise(directory: Path) -> None:
    """Every reader: success or a CheckpointError, nothing else."""
    for rank, world in ((0, 1), (1, 2), (2, 3)):
        try:
            load_distributed(directory, rank, world)
        except CheckpointError:
            pass
    for call in (verify_checkpoint, inspect_checkpoint):
        try:
            call(directory)
        except CheckpointError:
            pass


_SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(data=st.data(), op=st.sampled_from(["replace", "delete", "append"]),
       value=_REPLACEMENTS)
def test_mutated_metadata_loads_or_raises_a_checkpoint_error(base: Path, data: st.DataObject,
                                                             op: str, value: Any) -> None:
    directory = _copy(base)
    try:
        doc = json.loads((directory / METADATA_FILE).read_text())
        paths = _paths(doc)
        path = paths[data.draw(st.integers(0, len(paths) - 1), label="path")]
        doc = _mutate(doc, path, op, value)
        (directory / METADATA_FILE).write_text(_dumps(doc))
        _exercise(directory)
    finally:
        shutil.rmtree(directory.parent)


@_SETTINGS
@given(data=st.data(), rank=st.integers(0, 1), op=st.sampled_from(["replace", "delete",
                                                                   "append"]),
       value=_REPLACEMENTS)
def test_mutated_header_loads_or_raises_a_checkpoint_error(base: Path, data: st.DataObject,
                                                           rank: int, op: str,
                                                           value: Any) -> None:
    directory = _copy(base)
    try:
        shard = directory / f"rank_{rank:05d}.safetensors"
        raw = shard.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + length])
        paths = _paths(header)
        path = paths[data.draw(st.integers(0, len(paths) - 1), label="path")]
        header = _mutate(header, path, op, value)
        text = _dumps(header).encode()
        text += b" " * (-(len(text) + 8) % 8)
        new = struct.pack("<Q", len(text)) + text + raw[8 + length:]
        shard.write_bytes(new)
        doc = json.loads((directory / METADATA_FILE).read_text())
        record = doc["files"][rank]
        checksum = BlockChecksum(record["checksum"]["block_size"])
        checksum.update(new)
        record.update(size=len(new))
        record["checksum"]["blocks"] = checksum.hexdigest()
        (directory / METADATA_FILE).write_text(json.dumps(doc))
        _exercise(directory)
    finally:
        shutil.rmtree(directory.parent)
