"""Hostile checkpoints built on disk: every reader refuses them with a ``CheckpointError``
naming the file, without blocking, without leaving the checkpoint directory, and on every
rank of a collective load (issue 12, items 3, 4 and 5)."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdist.checkpoint import (
    ShardedArray,
    TensorShardSpec,
    consolidate,
    flat_shard_metadata,
    load,
    load_distributed,
    save,
    save_distributed,
    shard_state_dict,
    verify_checkpoint,
)
from netdist.checkpoint.metadata import METADATA_FILE, ShardMetadata
from netdist.checkpoint.storage import (
    BlockChecksum,
    ShardFile,
    open_checkpoint_file,
    read_metadata,
)
from netdist.collectives import Group
from netdist.errors import CheckpointCorruptError, CheckpointError
from netdist.sharding import Replicate, Shard
from tests.ranks import run_ranks

pytestmark = pytest.mark.timeout(60)  # a regression that blocks fails instead of hanging

OP_TIMEOUT = 5.0
FULL: dict[str, np.ndarray] = {
    "w": np.arange(8 * 3, dtype=np.float32).reshape(8, 3),
    "b": np.arange(3, dtype=np.float64),
}


def _per_rank_checkpoint(directory: Path) -> Path:
    """A 2-rank checkpoint in ``directory``: ``w`` sharded along dim 0, ``b`` replicated."""
    meta = flat_shard_metadata(FULL, 2)
    specs = dict(meta.tensor_specs)
    specs["b"] = TensorShardSpec.replicated((3,), "float64")
    meta = ShardMetadata(2, specs)
    for rank in range(2):
        save_distributed(shard_state_dict(FULL, meta, rank), directory, rank, 2, meta)
    return directory


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    return _per_rank_checkpoint(tmp_path / "ck")


def _edit_metadata(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((directory / METADATA_FILE).read_text())
    edit(doc)
    (directory / METADATA_FILE).write_text(json.dumps(doc))


def _metadata_text_edit(directory: Path, old: str, new: str) -> None:
    text = (directory / METADATA_FILE).read_text()
    assert old in text
    (directory / METADATA_FILE).write_text(text.replace(old, new, 1))


def _replace_shard(directory: Path, rank: int, raw: bytes) -> Path:
    """Put ``raw`` in place of ``rank``'s file, with a matching size and checksums in the
    metadata, so that only the content itself is hostile."""
    name = f"rank_{rank:05d}.safetensors"
    (directory / name).write_bytes(raw)

    def edit(doc: dict[str, Any]) -> None:
        record = doc["files"][rank]
        checksum = BlockChecksum(record["checksum"]["block_size"])
        checksum.update(raw)
        record["size"] = len(raw)
        record["checksum"]["blocks"] = checksum.hexdigest()

    _edit_metadata(directory, edit)
    return directory / name


def _safetensors(header: str, data: bytes = b"") -> bytes:
    text = header.encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _every_reader_refuses(directory: Path, *needles: str) -> None:
    """Loads that touch both files (rank 1 of 2 reads its shard and rank 0's copy of ``b``;
    a 1-rank load reads everything), verify and consolidate all refuse with a
    CheckpointError whose message holds every needle."""
    for rank, world in ((1, 2), (0, 1)):
        with pytest.raises(CheckpointError) as info:
            load_distributed(directory, rank, world)
        for needle in needles:
            assert needle in str(info.value)
    try:
        report = verify_checkpoint(directory)
    except CheckpointError as exc:
        text = str(exc)
    else:
        assert not report.ok
        text = " | ".join(report.problems)
    for needle in needles:
        assert needle in text
    with pytest.raises(CheckpointError):
        consolidate(directory, directory.parent / "all.safetensors")
    assert not (directory.parent / "all.safetensors").exists()


# --------------------------------------------------------------------------- item 3


def test_fifo_in_place_of_a_shard_is_refused_without_blocking(ck: Path) -> None:
    shard = ck / "rank_00001.safetensors"
    os.unlink(shard)
    os.mkfifo(shard)
    _every_reader_refuses(ck, str(shard), "is a FIFO, not a regular file")
    with pytest.raises(CheckpointCorruptError, match="is a FIFO"):
        ShardFile(shard)


def test_fifo_named_by_the_metadata_is_refused(ck: Path) -> None:
    os.mkfifo(ck / "pipe")
    _edit_metadata(ck, lambda doc: doc["files"][1].update(name="pipe"))
    _every_reader_refuses(ck, str(ck / "pipe"), "is a FIFO")


def test_symlink_to_a_fifo_and_a_directory_are_refused(ck: Path, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    os.symlink("../pipe", ck / "via_link")
    with pytest.raises(CheckpointCorruptError, match="outside the checkpoint directory"):
        open_checkpoint_file(ck, "via_link")
    os.mkfifo(ck / "inner_pipe")
    os.symlink("inner_pipe", ck / "inner_link")
    with pytest.raises(CheckpointCorruptError, match="inner_link is a FIFO"):
        open_checkpoint_file(ck, "inner_link")
    (ck / "adir").mkdir()
    with pytest.raises(CheckpointCorruptError, match="adir is a directory"):
        open_checkpoint_file(ck, "adir")


def test_a_regular_file_opens_blocking(ck: Path) -> None:
    fd = open_checkpoint_file(ck, "rank_00000.safetensors")
    try:
        assert os.get_blocking(fd)
        assert os.pread(fd, 8, 0) == (ck / "rank_00000.safetensors").read_bytes()[:8]
    finally:
        os.close(fd)


async def _collective_checkpoint(root: Path) -> Path:
    async def body(g: Group) -> Any:
        lo, hi = (0, 4) if g.rank == 0 else (4, 8)
        state = {"w": ShardedArray(FULL["w"][lo:hi].copy()), "b": FULL["b"],
                 "cursor": g.rank * 10, "step": 5}
        return await save(state, root, g, timeout=OP_TIMEOUT)

    results = await run_ranks(2, body, op_timeout=OP_TIMEOUT, guard=30,
                              return_exceptions=True)
    assert all(not isinstance(r, BaseException) for r in results), results
    return root / "step_000000"


async def test_collective_load_with_a_fifo_shard_fails_on_every_rank(tmp_path: Path) -> None:
    directory = await _collective_checkpoint(tmp_path)
    shard = directory / "rank_00001.safetensors"
    os.unlink(shard)
    os.mkfifo(shard)
    errors = await run_ranks(2, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT),
                            op_timeout=OP_TIMEOUT, guard=30, return_exceptions=True)
    assert all(isinstance(e, CheckpointCorruptError) for e in errors), errors
    assert all("rank_00001.safetensors is a FIFO" in str(e) for e in errors)


# --------------------------------------------------------------------------- item 4


@pytest.mark.parametrize("name", ["../evil.safetensors", "ABSOLUTE", "sub/rank_00001.safetensors",
                                  "..", ""])
def test_file_names_leaving_the_directory_are_refused(ck: Path, name: str) -> None:
    evil = ck.parent / "evil.safetensors"
    os.replace(ck / "rank_00001.safetensors", evil)  # a valid file, just elsewhere
    if name == "ABSOLUTE":
        name = str(evil)
    _edit_metadata(ck, lambda doc: doc["files"][1].update(name=name))
    _every_reader_refuses(ck, str(ck / METADATA_FILE), "is not a plain file name")


def test_symlinked_shard_leading_outside_is_refused(ck: Path) -> None:
    evil = ck.parent / "evil.safetensors"
    os.replace(ck / "rank_00001.safetensors", evil)
    os.symlink(evil, ck / "rank_00001.safetensors")
    _every_reader_refuses(ck, f"resolves to {evil}, outside the checkpoint directory")


def test_a_symlinked_checkpoint_directory_still_loads(ck: Path, tmp_path: Path) -> None:
    os.symlink(ck, tmp_path / "alias")
    np.testing.assert_array_equal(load_distributed(tmp_path / "alias", 1, 2)["w"], FULL["w"][4:])
    assert verify_checkpoint(tmp_path / "alias").ok


# --------------------------------------------------------------------------- item 5


def test_deeply_nested_metadata_is_corrupt_not_recursion(ck: Path) -> None:
    _metadata_text_edit(ck, '"extra": {}', '"extra": ' + "[" * 100_000 + "]" * 100_000)
    _every_reader_refuses(ck, METADATA_FILE, "nested deeper than 128 levels")
    _metadata_text_edit(ck, "[" * 100_000 + "]" * 100_000, "[" * 129 + "]" * 129)
    with pytest.raises(CheckpointCorruptError, match=f"{ck / METADATA_FILE}: JSON nested"):
        read_metadata(ck)


def test_metadata_nested_just_within_the_limit_loads(ck: Path) -> None:
    # extra (depth 2) holding a list 126 deep: 128 levels in all, the limit
    _metadata_text_edit(ck, '"extra": {}', '"extra": {"x": ' + "[" * 126 + "]" * 126 + "}")
    assert json.loads((ck / METADATA_FILE).read_text())
    meta = read_metadata(ck)
    depth, value = 0, meta.extra["x"]
    while value:
        depth, value = depth + 1, value[0]
    assert depth == 125  # the innermost [] is empty
    np.testing.assert_array_equal(load_distributed(ck, 0, 1)["w"], FULL["w"])


def test_deeply_nested_safetensors_header_is_corrupt(ck: Path) -> None:
    header = '{"w": {"dtype": "F32", "shape": ' + "[" * 50_000 + "]" * 50_000 + "}}"
    path = _replace_shard(ck, 0, _safetensors(header))
    _every_reader_refuses(ck, f"{path}: header", "nested deeper than 128 levels")


def test_metadata_shape_past_int64_is_corrupt_not_numpy_error(ck: Path) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"]["w"].update(shape=[2**40, 2**40], shard_sizes=[2**39, 2**39])

    _edit_metadata(ck, edit)
    _every_reader_refuses(ck, METADATA_FILE, "past the int64 range")


def test_metadata_shape_larger_than_the_files_is_corrupt(ck: Path) -> None:
    # 2**30 x 3 float32 = 12 GiB claimed, in files of a few hundred bytes: no allocation
    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"]["w"].update(shape=[2**30, 3], shard_sizes=[2**29, 2**29])

    _edit_metadata(ck, edit)
    _every_reader_refuses(ck, METADATA_FILE,
                          "rank 0's tensors need 6442450968 bytes, but its file "
                          "rank_00000.safetensors has")


def test_forged_file_sizes_are_refused_before_any_buffer_is_allocated(ck: Path) -> None:
    # metadata consistent with itself (16 GiB files recorded, one checksum block each,
    # 6 GiB of tensors per rank) but not with the few hundred bytes on disk: the loaders
    # must compare with the files before sizing a buffer from the shapes
    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"]["w"].update(shape=[2**30, 3], shard_sizes=[2**29, 2**29])
        for record in doc["files"]:
            record["size"] = 2**34
            record["checksum"].update(block_size=2**34, blocks="00000000")

    _edit_metadata(ck, edit)
    tracemalloc.start()
    try:
        for rank, world in ((1, 2), (0, 1)):
            with pytest.raises(CheckpointCorruptError, match=r"rank_0000[01]\.safetensors "
                               r"holds \d+ bytes but the metadata records 17179869184"):
                load_distributed(ck, rank, world)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak} bytes allocated while refusing"


def test_header_element_count_does_not_wrap(ck: Path) -> None:
    # 2**32 * 2**32 elements wrap to 0 in int64: "0 bytes" must not match them
    header = ('{"w": {"dtype": "F32", "shape": [4294967296, 4294967296], '
              '"data_offsets": [0, 0]}}')
    path = _replace_shard(ck, 0, _safetensors(header))
    with pytest.raises(CheckpointCorruptError,
                       match=r"offsets 0\.\.0 do not hold float32 \(4294967296, 4294967296\)"):
        ShardFile(path)
    _every_reader_refuses(ck, str(path), "bad header entry")


@pytest.mark.parametrize("entry, needle", [
    ('{"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}', "is not an integer"),
    ('{"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}', "is not an integer"),
    ('{"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}', "is not an integer >= 0"),
    ('{"dtype": "F32", "shape": [1], "data_offsets": [4]}', "data_offsets must be"),
    ('{"dtype": "F32", "shape": ' + str([1] * 65) + ', "data_offsets": [0, 4]}',
     "at most 64 dims"),
    ('[1]', "entry is not an object"),
])
def test_malformed_header_entries_are_corrupt(tmp_path: Path, entry: str, needle: str) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(_safetensors('{"w": ' + entry + "}", b"\0" * 4))
    with pytest.raises(CheckpointCorruptError, match=needle):
        ShardFile(path)


def test_header_metadata_must_be_strings(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(_safetensors('{"__metadata__": [1]}'))
    with pytest.raises(CheckpointCorruptError, match="__metadata__ is not an object"):
        ShardFile(path)


async def test_truncated_rank_objects_fail_on_every_rank(tmp_path: Path) -> None:
    directory = await _collective_checkpoint(tmp_path)
    _edit_metadata(directory, lambda doc: doc["state"]["rank_objects"]["cursor"].pop())
    errors = await run_ranks(2, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT),
                            op_timeout=OP_TIMEOUT, guard=30, return_exceptions=True)
    assert all(isinstance(e, CheckpointCorruptError) for e in errors), errors
    assert all(METADATA_FILE in str(e) and "per-rank value 'cursor' has 1 entries for 2 ranks"
               in str(e) for e in errors)
    with pytest.raises(CheckpointCorruptError, match="'cursor' has 1 entries"):
        load_distributed(tmp_path, 0, 2)


async def test_state_skeleton_naming_unknown_leaves_is_corrupt(tmp_path: Path) -> None:
    directory = await _collective_checkpoint(tmp_path)

    def edit(doc: dict[str, Any]) -> None:
        doc["state"]["skeleton"]["items"].append([{"$nd": "tuple", "v": []},
                                                  {"t": "object", "k": "cursor"}])
        doc["state"]["skeleton"]["items"].append(["ghost", {"t": "tensor", "k": "ghost"}])

    _edit_metadata(directory, edit)
    errors = await run_ranks(2, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT),
                            op_timeout=OP_TIMEOUT, guard=30, return_exceptions=True)
    assert all(isinstance(e, CheckpointCorruptError) for e in errors), errors
    assert "is not a str or int" in str(errors[0])


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["files"].pop(), "num_ranks is 2, with 1 file records"),
    (lambda d: d["files"][1].update(rank=0), "file records are for ranks [0, 0]"),
    (lambda d: d.update(num_ranks=10**12), "num_ranks is 1000000000000"),
    (lambda d: d.update(num_ranks=float("inf")), "num_ranks must be an integer"),
    (lambda d: d.update(generation=float("inf")), "generation must be an integer"),
    (lambda d: d.update(step=[1]), "step must be an integer"),
    (lambda d: d["tensors"]["b"].pop("writer"), "replicated tensor 'b' has no writer"),
    (lambda d: d["tensors"]["w"].update(dtype=None), "tensor 'w' has no dtype"),
    (lambda d: d["files"][0]["checksum"].update(blocks="zzzzzzzz"), "not hex digits"),
    (lambda d: d["files"][0]["checksum"].update(block_size=1.5), "block_size must be an"),
    (lambda d: d["files"][0].update(size="12"), "file size must be an integer"),
    (lambda d: d.update(tensors=[]), "tensors must be an object"),
    (lambda d: d.update(extra={"$nd": "scalar", "dtype": "int8", "v": 1000}),
     "malformed encoded value"),
])
def test_malformed_metadata_is_corrupt_naming_the_file(ck: Path, edit: Any, needle: str) -> None:
    _edit_metadata(ck, edit)
    with pytest.raises(CheckpointCorruptError) as info:
        read_metadata(ck)
    assert str(info.value).startswith(f"{ck / METADATA_FILE}: ")
    assert needle in str(info.value)
    with pytest.raises(CheckpointCorruptError, match="metadata.json"):
        load_distributed(ck, 0, 2)


@pytest.mark.parametrize("step", [None, 3])
def test_a_save_over_a_fifo_metadata_does_not_block(tmp_path: Path, step: int | None) -> None:
    # the saver reads the previous metadata (its generation) and the other ranks'
    # manifests: through the safe reader, so a FIFO there cannot block it
    root = tmp_path / "root"
    target = root if step is None else root / f"step_{step:08d}"
    target.mkdir(parents=True)
    os.mkfifo(target / METADATA_FILE)
    meta = flat_shard_metadata(FULL, 1)
    result = save_distributed(FULL, root, 0, 1, meta, step=step)
    assert result.committed
    loaded = load_distributed(root, 0, 1, step=step)
    assert all(loaded[k].tobytes() == v.tobytes() for k, v in FULL.items())


# --------------------------------------------------------------------------- mesh placements

MESH_FULL: dict[str, np.ndarray] = {
    "m": np.arange(4 * 6, dtype=np.float32).reshape(4, 6),   # (Replicate(), Shard(1))
    "x": np.arange(5 * 3, dtype=np.int64).reshape(5, 3),     # (Shard(0), Shard(1))
}


@pytest.fixture
def mesh_ck(tmp_path: Path) -> Path:
    """A 4-rank checkpoint on a dp=2 x tp=2 mesh, saved rank by rank."""
    specs = {"m": TensorShardSpec.on_mesh((4, 6), (2, 2), (Replicate(), Shard(1)), dtype="float32"),
             "x": TensorShardSpec.on_mesh((5, 3), (2, 2), (Shard(0), Shard(1)), dtype="int64")}
    meta = ShardMetadata(4, specs, mesh={"shape": [2, 2], "names": ["dp", "tp"]})
    directory = tmp_path / "mesh"
    for rank in range(4):
        save_distributed(shard_state_dict(MESH_FULL, meta, rank), directory, rank, 4, meta)
    return directory


def test_a_mesh_checkpoint_loads_at_any_world_size(mesh_ck: Path) -> None:
    assert read_metadata(mesh_ck).writers["m"] in ((0, 1), (0, 3), (2, 1), (2, 3))
    for world in (1, 3, 4):
        parts = [load_distributed(mesh_ck, rank, world) for rank in range(world)]
        for name, full in MESH_FULL.items():
            if world == 1:
                assert parts[0][name].tobytes() == full.tobytes()


def _set_entry(name: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["tensors"][name].update(fields)


@pytest.mark.parametrize("edit, needle", [
    (_set_entry("m", extents=[[4], [3, 2]]), "extents [3, 2] along dim 1 sum to 5, but dim 1"),
    (_set_entry("m", extents=[[4], [-1, 7]]), "must hold ints >= 0"),
    (_set_entry("m", extents=[[4], [6]]), "cut dim 1 into 2 pieces, but 1 extents are given"),
    (_set_entry("m", extents=[[4], [3, 3], [1]]), "mesh extents describe 3 dimensions"),
    (_set_entry("m", placements=["R", "S(1)", "R"]), "3 placements for a mesh of shape (2, 2)"),
    (_set_entry("m", placements=["R", "S(2)"]), "placement Shard(2) of mesh dim 1 names dim 2 "
                                                "of a 2-d tensor"),
    (_set_entry("m", placements=["R", "Shard(1)"]), "is neither \"R\" nor \"S(<dim>)\""),
    (_set_entry("m", writers=[1, 0]), "writer 1 of piece 0 of tensor 'm' does not hold that "
                                      "piece (ranks 0, 2 do)"),
    (_set_entry("m", writers=[0]), "tensor 'm' has 2 pieces, but its writers are (0,)"),
    (_set_entry("m", writers=["0", 1]), "a writer must be an integer"),
    (_set_entry("x", writers=[0, 1, 2, 2]), "writer 2 of piece 3 of tensor 'x'"),
    (lambda d: d["tensors"]["m"].pop("writers"), "mesh-placed tensor 'm' has no writer"),
    (lambda d: d["mesh"].update(shape=[2, 3]), "tensor 'm' is placed on a mesh, but the mesh "
                                               "of shape [2, 3] has 6 ranks, the checkpoint "
                                               "was saved by 4"),
    (lambda d: d["mesh"].update(names=["dp", "dp"]), "tensor 'm' is placed on a mesh, but mesh "
                                                     "names ['dp', 'dp'] are not 2 distinct"),
    (lambda d: d.update(mesh=None), "tensor 'm' is placed on a mesh, but the mesh must be"),
    (lambda d: d.update(mesh={"shape": [4], "names": ["dp"]}),
     "tensor 'm': 2 placements for a mesh of shape (4,)"),
])
def test_hostile_mesh_placements_are_corrupt_naming_the_tensor(mesh_ck: Path, edit: Any,
                                                               needle: str) -> None:
    _edit_metadata(mesh_ck, edit)
    with pytest.raises(CheckpointCorruptError) as info:
        read_metadata(mesh_ck)
    assert str(info.value).startswith(f"{mesh_ck / METADATA_FILE}: "), info.value
    assert needle in str(info.value)
    with pytest.raises(CheckpointCorruptError, match="metadata.json"):
        load_distributed(mesh_ck, 0, 4)
    with pytest.raises(CheckpointCorruptError, match="metadata.json"):
        consolidate(mesh_ck, mesh_ck.parent / "all.safetensors")


async def test_collective_load_of_a_hostile_mesh_checkpoint_fails_on_every_rank(
        mesh_ck: Path) -> None:
    _edit_metadata(mesh_ck, _set_entry("x", extents=[[3, 3], [2, 1]]))
    errors = await run_ranks(4, lambda g: load(mesh_ck, g, timeout=OP_TIMEOUT),
                             op_timeout=OP_TIMEOUT, guard=30, return_exceptions=True)
    assert all(isinstance(e, CheckpointCorruptError) for e in errors), errors
    assert all("tensor 'x'" in str(e) and "sum to 6, but dim 0" in str(e) for e in errors)
