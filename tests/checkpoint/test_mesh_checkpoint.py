"""Checkpoints of tensors placed on a device mesh (issue 30, item 4): a model state saved
at DP x TP over real TCP groups, loaded on other meshes, into a plain world and back,
byte for byte; each byte stored once; each rank reads only the pieces it needs."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdist.checkpoint import (
    ReplicaDivergenceWarning,
    ShardedArray,
    load,
    load_distributed,
    load_metadata,
    save,
)
from netdist.checkpoint import collective as collective_module
from netdist.checkpoint.reading import CheckpointReader
from netdist.checkpoint.storage import ShardFile
from netdist.collectives import Group
from netdist.errors import CheckpointMismatchError
from netdist.sharding import (
    ChunkRule,
    MeshPlacement,
    MeshPosition,
    MeshSharding,
    Replicate,
    Shard,
    chunk_bounds,
    mesh_coordinate,
)
from tests.ranks import run_ranks

pytestmark = pytest.mark.timeout(180)

OP_TIMEOUT = 20.0
GUARD = 120.0
NAMES = ("dp", "tp")

# Uneven everywhere: 11 rows over tp=2 or 4, 9 columns over 2, 7 x 5 over dp x tp,
# 9 rows over dp and tp at once.
FULL: dict[str, np.ndarray] = {
    "qkv": np.arange(11 * 6, dtype=np.float32).reshape(11, 6) / 7,
    "out": np.arange(6 * 9, dtype=np.float32).reshape(6, 9) - 20.5,
    "norm": np.linspace(-1, 1, 6),
    "emb": np.arange(7 * 5, dtype=np.int64).reshape(7, 5) * 3,
    "moe": np.arange(9 * 4, dtype=np.float32).reshape(9, 4) + 0.25,
}
BIAS = np.arange(6, dtype=np.float64) / 3
PLACED: dict[str, dict[str, MeshPlacement]] = {
    "qkv": {"tp": Shard(0)},                  # column-parallel weight
    "out": {"tp": Shard(1)},                  # row-parallel weight
    "norm": {},                               # replicated on every mesh dim
    "emb": {"dp": Shard(0), "tp": Shard(1)},  # two tensor dims at once
    "moe": {"dp": Shard(0), "tp": Shard(0)},  # one tensor dim by two mesh dims
}
PLAIN_DIMS = {"qkv": 0, "out": 1, "norm": 0, "emb": 1, "moe": 0}
UNIQUE_BYTES = sum(a.nbytes for a in FULL.values()) + BIAS.nbytes


def placements(name: str, names: tuple[str, ...] = NAMES) -> tuple[MeshPlacement, ...]:
    return tuple(PLACED[name].get(dim, Replicate()) for dim in names)


def _region(full: np.ndarray, box: Any) -> np.ndarray:
    return full[tuple(slice(lo, hi) for lo, hi in box)]


def mesh_box(name: str, shape: tuple[int, ...], rank: int, rule: ChunkRule) -> Any:
    sharding = MeshSharding.even(FULL[name].shape, shape, placements(name), rule)
    return sharding.piece_box(sharding.piece_of(rank))


def mesh_state(rank: int, shape: tuple[int, ...], *, rule: ChunkRule = ChunkRule.NETDIST,
               blank: bool = False) -> dict[str, Any]:
    """This rank's state on a ``dp x tp`` mesh of ``shape``: the pieces of ``FULL`` (zeros
    when ``blank``, as a freshly built model to load into) and a plain replicated bias."""
    position = MeshPosition(shape, NAMES, mesh_coordinate(shape, rank))
    model: dict[str, Any] = {}
    for name, full in FULL.items():
        piece = _region(full, mesh_box(name, shape, rank, rule)).copy()
        if blank:
            piece[...] = 0
        model[name] = ShardedArray(piece, placements=placements(name), mesh=position)
    model["bias"] = np.zeros_like(BIAS) if blank else BIAS.copy()
    return {"model": model, "step": 0 if blank else 5}


def plain_state(rank: int, world: int, *, blank: bool = False) -> dict[str, Any]:
    """This rank's state without a mesh: every tensor split along one dim over ``world``
    ranks (``world`` 1: plain replicated arrays)."""
    model: dict[str, Any] = {}
    for name, full in FULL.items():
        if world == 1:
            model[name] = np.zeros_like(full) if blank else full.copy()
            continue
        dim = PLAIN_DIMS[name]
        lo, hi = chunk_bounds(full.shape[dim], world)[rank]
        piece = np.take(full, range(lo, hi), axis=dim).copy()
        if blank:
            piece[...] = 0
        model[name] = ShardedArray(piece, dim)
    model["bias"] = np.zeros_like(BIAS) if blank else BIAS.copy()
    return {"model": model, "step": 0 if blank else 5}


def _bytes_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert (got.dtype, got.shape) == (want.dtype, want.shape), what
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), what


def assert_same(got: Mapping[str, Any], want: Mapping[str, Any], what: str) -> None:
    """``got`` holds exactly ``want``'s values, placements and step."""
    assert got["step"] == want["step"], what
    for name, expected in want["model"].items():
        value = got["model"][name]
        if isinstance(expected, ShardedArray):
            assert isinstance(value, ShardedArray), f"{what}: {name}"
            assert (value.shard_dim, value.placements, value.mesh) == \
                (expected.shard_dim, expected.placements, expected.mesh), f"{what}: {name}"
            value, expected = value.data, expected.data
        _bytes_equal(np.asarray(value), expected, f"{what}: {name}")


async def _on_mesh(root: Path, shape: tuple[int, ...], rule: ChunkRule,
                   save_to: Path | None) -> None:
    """Load ``root`` into blank pieces on a mesh of ``shape`` (every rank checks its
    pieces byte for byte), then save them to ``save_to``."""

    async def body(group: Group) -> None:
        like = mesh_state(group.rank, shape, rule=rule, blank=True)
        got = await load(root, group, like=like, timeout=OP_TIMEOUT)
        assert got["model"]["qkv"] is like["model"]["qkv"]  # filled in place
        assert_same(got, mesh_state(group.rank, shape, rule=rule),
                    f"rank {group.rank} on mesh {shape}")
        if save_to is not None:
            await save(got, save_to, group, timeout=OP_TIMEOUT)

    await run_ranks(math.prod(shape), body, tcp=True, op_timeout=OP_TIMEOUT, guard=GUARD)


async def _save_mesh(root: Path, shape: tuple[int, ...], rule: ChunkRule) -> None:
    async def body(group: Group) -> Any:
        return await save(mesh_state(group.rank, shape, rule=rule), root, group,
                          timeout=OP_TIMEOUT)

    await run_ranks(math.prod(shape), body, tcp=True, op_timeout=OP_TIMEOUT, guard=GUARD)


def _extents(root: Path, name: str) -> tuple[tuple[int, ...], ...]:
    mesh = load_metadata(root).tensor_specs[f"model.{name}"].mesh
    assert mesh is not None
    return mesh.extents


async def test_dp2_tp2_round_trip_through_other_meshes_and_a_plain_world(
        tmp_path: Path) -> None:
    a, b, c, d = (tmp_path / x for x in "abcd")
    await _save_mesh(a, (2, 2), ChunkRule.NETDIST)
    meta = load_metadata(a)
    assert meta.mesh == {"shape": [2, 2], "names": ["dp", "tp"]}
    assert _extents(a, "emb") == ((4, 3), (3, 2))
    assert _extents(a, "moe") == ((3, 2, 2, 2), (4,))
    # TP=4 (torch's split: 9 rows of moe as 3, 3, 3, 0), then TP=1 x DP=4
    await _on_mesh(a, (1, 4), ChunkRule.TORCH, save_to=b)
    assert _extents(b, "moe") == ((3, 3, 3, 0), (4,))
    await _on_mesh(b, (4, 1), ChunkRule.NETDIST, save_to=c)

    # a plain world: split along one dim over 2 ranks, then whole on 1 rank
    async def plain(group: Group) -> None:
        like = plain_state(group.rank, 2, blank=True)
        got = await load(c, group, like=like, timeout=OP_TIMEOUT)
        assert_same(got, plain_state(group.rank, 2), f"plain rank {group.rank}")
        await save(got, d, group, timeout=OP_TIMEOUT)

    await run_ranks(2, plain, tcp=True, op_timeout=OP_TIMEOUT, guard=GUARD)

    async def whole(group: Group) -> None:
        got = await load(c, group, like=plain_state(0, 1, blank=True), timeout=OP_TIMEOUT)
        assert_same(got, plain_state(0, 1), "one rank")

    await run_ranks(1, whole, tcp=True, op_timeout=OP_TIMEOUT, guard=GUARD)
    # and back onto the mesh from the plain checkpoint
    await _on_mesh(d, (2, 2), ChunkRule.NETDIST, save_to=None)


async def test_load_without_like_gives_pieces_on_the_saved_mesh_else_even_shards(
        tmp_path: Path) -> None:
    await _save_mesh(tmp_path, (2, 2), ChunkRule.NETDIST)
    same = await run_ranks(4, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT),
                           op_timeout=OP_TIMEOUT, guard=GUARD)
    for rank, got in enumerate(same):
        assert_same(got, mesh_state(rank, (2, 2)), f"rank {rank}, no like")
    other = await run_ranks(3, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT),
                            op_timeout=OP_TIMEOUT, guard=GUARD)
    for rank, got in enumerate(other):
        for name, full in FULL.items():
            value = got["model"][name]
            dims = sorted(p.dim for p in placements(name) if isinstance(p, Shard))
            if not dims:  # replicated on every mesh dim: whole
                _bytes_equal(value, full, name)
                continue
            assert isinstance(value, ShardedArray) and value.shard_dim == dims[0]
            lo, hi = chunk_bounds(full.shape[dims[0]], 3)[rank]
            _bytes_equal(value.data, np.take(full, range(lo, hi), axis=dims[0]), name)
    flat = load_distributed(tmp_path, 0, 1)
    for name, full in FULL.items():
        _bytes_equal(flat[f"model.{name}"], full, name)


def _tensor_bytes(directory: Path) -> dict[str, int]:
    """Bytes of tensor data in every rank file, by file, from the safetensors headers."""
    out = {}
    for path in sorted(directory.glob("rank_*.safetensors")):
        with ShardFile(path) as shard_file:
            out[path.name] = sum(e.end - e.begin for e in shard_file.entries.values())
    return out


async def test_dp4_tp2_stores_each_byte_once(tmp_path: Path) -> None:
    await _save_mesh(tmp_path, (4, 2), ChunkRule.NETDIST)
    directory = tmp_path / "step_000000"
    per_file = _tensor_bytes(directory)
    assert len(per_file) == 8
    assert sum(per_file.values()) == UNIQUE_BYTES
    meta = load_metadata(tmp_path)
    # the replicated pieces are spread: every rank writes something
    assert all(per_file.values()), per_file
    # qkv's two row pieces, each held by the 4 dp ranks of its tp column, written once
    holders = meta.tensor_specs["model.qkv"].piece_holders(8)
    assert holders == ((0, 2, 4, 6), (1, 3, 5, 7))
    writers = meta.writers["model.qkv"]
    assert isinstance(writers, tuple) and all(w in h for w, h in zip(writers, holders))


class _CountingReader(CheckpointReader):
    """A reader that reports, when closed, the files it opened and the bytes it read."""

    records: list[tuple[Mapping[str, np.ndarray], set[int], int]] = []

    def read(self, plan: Any, dests: Any, **kwargs: Any) -> None:
        self.dests = dests
        super().read(plan, dests, **kwargs)

    def close(self) -> None:
        opened = set(self._files)
        super().close()
        self.records.append((self.dests, opened, self.bytes_read))


def _header_bytes(path: Path) -> int:
    with ShardFile(path) as shard_file:
        return shard_file.data_start


async def test_each_rank_reads_only_the_pieces_overlapping_its_new_shards(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await _save_mesh(tmp_path, (2, 2), ChunkRule.NETDIST)
    meta = load_metadata(tmp_path)
    directory = tmp_path / "step_000000"
    records: list[tuple[Mapping[str, np.ndarray], set[int], int]] = []
    monkeypatch.setattr(_CountingReader, "records", records)
    monkeypatch.setattr(collective_module, "CheckpointReader", _CountingReader)
    likes = [mesh_state(rank, (1, 4), blank=True) for rank in range(4)]

    async def body(group: Group) -> None:
        await load(tmp_path, group, like=likes[group.rank], verify=False, timeout=OP_TIMEOUT)

    await run_ranks(4, body, tcp=True, op_timeout=OP_TIMEOUT, guard=GUARD)
    assert len(records) == 4
    total = sum(r.size for r in meta.files)
    for rank, like in enumerate(likes):
        _, opened, read = next(r for r in records if r[0]["model.qkv"] is
                               like["model"]["qkv"].data)
        bound = sum(_header_bytes(directory / record.name) for record in meta.files
                    if record.rank in opened)
        for name, spec in meta.tensor_specs.items():
            itemsize = np.dtype(spec.dtype).itemsize
            want = (mesh_box(name[len("model."):], (1, 4), rank, ChunkRule.NETDIST)
                    if name != "model.bias" else ((0, 6),))
            for piece in range(spec.num_pieces):
                stored = spec.piece_box(piece)
                if all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(want, stored)):
                    bound += math.prod(hi - lo for lo, hi in stored) * itemsize
        assert read <= bound, (rank, read, bound)
        assert read < total, (rank, read, total)


async def test_mismatched_pieces_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    async def body(group: Group) -> Any:
        state = mesh_state(group.rank, (2, 2))
        if group.rank == 3:  # holds qkv's piece 1 with rank 1, but one row short
            state["model"]["qkv"] = ShardedArray(
                state["model"]["qkv"].data[:-1], placements=placements("qkv"),
                mesh=state["model"]["qkv"].mesh)
        return await save(state, tmp_path, group, timeout=OP_TIMEOUT)

    errors = await run_ranks(4, body, op_timeout=OP_TIMEOUT, guard=GUARD,
                             return_exceptions=True)
    assert all(isinstance(e, CheckpointMismatchError) for e in errors), errors
    assert all("'model.qkv'" in str(e) and "rank 3 holds 4 along dim 0" in str(e)
               for e in errors), errors

    async def wrong_coordinate(group: Group) -> Any:
        state = mesh_state(group.rank, (2, 2))
        swapped = MeshPosition((2, 2), NAMES, mesh_coordinate((2, 2), 3 - group.rank))
        state["model"]["norm"] = ShardedArray(FULL["norm"].copy(),
                                              placements=placements("norm"), mesh=swapped)
        return await save(state, tmp_path, group, timeout=OP_TIMEOUT)

    errors = await run_ranks(4, wrong_coordinate, op_timeout=OP_TIMEOUT, guard=GUARD,
                             return_exceptions=True)
    assert all(isinstance(e, CheckpointMismatchError) for e in errors), errors
    assert "'model.norm': rank 0 sits at mesh coordinate [1, 1]" in str(errors[1])


async def test_diverged_replicated_pieces_warn_and_save_the_lowest_holder(
        tmp_path: Path) -> None:
    async def body(group: Group) -> Any:
        state = mesh_state(group.rank, (2, 2))
        if group.rank == 2:  # qkv's piece 0 is held by ranks 0 and 2
            state["model"]["qkv"].data[...] += 1
        return await save(state, tmp_path, group, timeout=OP_TIMEOUT)

    with pytest.warns(ReplicaDivergenceWarning, match="'model.qkv' differs between the "
                                                      "lowest rank holding each piece and "
                                                      "rank 2"):
        await run_ranks(4, body, op_timeout=OP_TIMEOUT, guard=GUARD)
    assert load_metadata(tmp_path).writers["model.qkv"][0] == 0  # type: ignore[index]
    _bytes_equal(load_distributed(tmp_path, 0, 1)["model.qkv"], FULL["qkv"], "qkv")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tensor-parallel pieces are no replicas
        await _save_mesh(tmp_path / "clean", (1, 4), ChunkRule.NETDIST)


def test_per_rank_load_places_mesh_pieces_by_either_even_split(tmp_path: Path) -> None:
    from netdist.checkpoint import flat_shard_metadata, save_distributed, shard_state_dict

    full = {f"model.{name}": array for name, array in FULL.items()}
    full["model.bias"] = BIAS
    meta = flat_shard_metadata(full, 1)
    save_distributed(shard_state_dict(full, meta, 0), tmp_path, 0, 1, meta)
    for rule in ChunkRule:  # 9 rows of moe over 4: 3,2,2,2 or 3,3,3,0; the rank's shape says
        for rank in range(4):
            like = mesh_state(rank, (1, 4), rule=rule, blank=True)
            like["model"].pop("emb")
            got = load_distributed(tmp_path, rank, 4, like=like, strict=False)
            expected = mesh_state(rank, (1, 4), rule=rule)
            for name in ("qkv", "out", "norm", "moe"):
                _bytes_equal(got["model"][name].data, expected["model"][name].data,
                             f"{rule} rank {rank} {name}")
    # 5 columns of emb over 4: rank 2 holds one in both splits, but another one
    like = mesh_state(2, (1, 4), blank=True)
    with pytest.raises(CheckpointMismatchError, match="'model.emb': netdist's and torch's "
                                                      "even splits give different regions"):
        load_distributed(tmp_path, 2, 4, like=like)
    with pytest.raises(CheckpointMismatchError, match="mesh rank 0 of 4, but this is rank 1"):
        load_distributed(tmp_path, 1, 4, like=mesh_state(0, (1, 4), blank=True))


def test_metadata_records_the_mesh_and_placements() -> None:
    from netdist.checkpoint import ShardMetadata, TensorShardSpec

    spec = TensorShardSpec.on_mesh((5, 4), (2, 2), (Shard(0), Replicate()), dtype="float32")
    meta = ShardMetadata(4, {"w": spec}, mesh={"shape": [2, 2], "names": ["dp", "tp"]},
                         writers={"w": (1, 3)})
    entry = meta.to_json()["tensors"]["w"]
    assert entry == {"dtype": "float32", "shape": [5, 4], "placement": "mesh",
                     "placements": ["S(0)", "R"], "extents": [[3, 2], [4]], "writers": [1, 3]}
    assert meta.to_json()["mesh"] == {"shape": [2, 2], "names": ["dp", "tp"]}
    with pytest.raises(ValueError, match="writer 2 of piece 0 of tensor 'w' does not hold"):
        ShardMetadata(4, {"w": spec}, mesh={"shape": [2, 2], "names": ["dp", "tp"]},
                      writers={"w": (2, 3)})
    with pytest.raises(ValueError, match="'w' is placed on a mesh, but the mesh of shape "
                                         r"\[2, 2\] has 4 ranks, the checkpoint was "
                                         "saved by 2"):
        ShardMetadata(2, {"w": spec}, mesh={"shape": [2, 2], "names": ["dp", "tp"]})


class _DeviceMesh:
    """Stands for netdist's ``DeviceMesh``: all a checkpoint asks of it is its position."""

    def __init__(self, position: MeshPosition) -> None:
        self.position = position


async def test_a_device_mesh_stands_for_its_position(tmp_path: Path) -> None:
    async def body(group: Group) -> Any:
        mesh = _DeviceMesh(MeshPosition((1, 2), NAMES, mesh_coordinate((1, 2), group.rank)))
        state = mesh_state(group.rank, (1, 2))
        state["model"]["qkv"] = ShardedArray(state["model"]["qkv"].data,
                                             placements=placements("qkv"), mesh=mesh)
        assert state["model"]["qkv"].mesh == mesh.position
        return await save(state, tmp_path / "ok", group, mesh=mesh, timeout=OP_TIMEOUT)

    await run_ranks(2, body, op_timeout=OP_TIMEOUT, guard=GUARD)
    assert load_metadata(tmp_path / "ok").mesh == {"shape": [1, 2], "names": ["dp", "tp"]}

    async def other(group: Group) -> Any:
        return await save(mesh_state(group.rank, (1, 2)), tmp_path / "no", group,
                          mesh={"shape": [2, 1], "names": ["dp", "tp"]}, timeout=OP_TIMEOUT)

    errors = await run_ranks(2, other, op_timeout=OP_TIMEOUT, guard=GUARD,
                             return_exceptions=True)
    assert all(isinstance(e, CheckpointMismatchError) and "differs from the mesh" in str(e)
               for e in errors), errors


def test_per_rank_save_of_mesh_specs_needs_the_mesh(tmp_path: Path) -> None:
    from netdist.checkpoint import TensorShardSpec, save_distributed

    spec = TensorShardSpec.on_mesh((4,), (2,), (Shard(0),), dtype="float32")
    with pytest.raises(ValueError, match="'w' is placed on a mesh: pass a ShardMetadata"):
        save_distributed({"w": np.zeros(2, np.float32)}, tmp_path, 0, 2, {"w": spec})
    assert not any(tmp_path.iterdir())
