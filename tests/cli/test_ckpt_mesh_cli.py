"""``netdist ckpt`` on a checkpoint of tensors placed on a device mesh (issue 30, item 4):
``inspect`` shows the mesh and every placement, ``consolidate`` writes the full tensors,
``reshard`` rewrites it for a plain world size or for the mesh with other sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from netdist.checkpoint import (
    ShardMetadata,
    TensorShardSpec,
    load_distributed,
    load_metadata,
    save_distributed,
    shard_state_dict,
    verify_checkpoint,
)
from netdist.cli.main import main
from netdist.sharding import MeshPlacement, MeshSharding, Replicate, Shard, chunk_bounds

pytestmark = pytest.mark.timeout(120)

FULL: dict[str, np.ndarray] = {
    "col": np.arange(7 * 6, dtype=np.float32).reshape(7, 6),   # (Replicate(), Shard(0))
    "row": np.arange(4 * 5, dtype=np.float64).reshape(4, 5),   # (Replicate(), Shard(1))
    "grid": np.arange(5 * 3, dtype=np.int32).reshape(5, 3),    # (Shard(0), Shard(1))
    "norm": np.linspace(0, 1, 6),                              # replicated
}
PLACEMENTS: dict[str, tuple[MeshPlacement, ...]] = {
    "col": (Replicate(), Shard(0)), "row": (Replicate(), Shard(1)), "grid": (Shard(0), Shard(1))}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root holding ``step_000002``, saved by 4 ranks on a dp=2 x tp=2 mesh."""
    specs = {name: TensorShardSpec.on_mesh(FULL[name].shape, (2, 2), placements,
                                           dtype=FULL[name].dtype)
             for name, placements in PLACEMENTS.items()}
    specs["norm"] = TensorShardSpec.replicated((6,), "float64")
    meta = ShardMetadata(4, specs, mesh={"shape": [2, 2], "names": ["dp", "tp"]})
    for rank in range(4):
        save_distributed(shard_state_dict(FULL, meta, rank), tmp_path / "ck", rank, 4, meta,
                         step=2)
    return tmp_path / "ck"


def _region(full: np.ndarray, box: Any) -> np.ndarray:
    return full[tuple(slice(lo, hi) for lo, hi in box)]


def test_inspect_shows_the_mesh_and_each_placement(root: Path, capsys: Any) -> None:
    assert main(["ckpt", "inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "  format version 1, saved by 4 rank(s), step 2\n  mesh dp=2 x tp=2 (ranks " \
           "row-major)\n" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line[:1] not in (" ", "-")}
    assert "mesh (R, S(0)) dim 0 [4,3]" in rows["col"]
    assert "mesh (R, S(1)) dim 1 [3,2]" in rows["row"]
    assert "mesh (S(0), S(1)) dim 0 [3,2] dim 1 [2,1]" in rows["grid"]
    assert rows["grid"].rstrip().endswith("0,1,2,3")  # every piece in its own rank's file
    assert "replicated (stored by rank" in rows["norm"]


def test_consolidate_writes_the_full_tensors(root: Path, tmp_path: Path) -> None:
    out = tmp_path / "all.safetensors"
    assert main(["ckpt", "consolidate", str(root), str(out)]) == 0
    tensors = safetensors.numpy.load_file(out)
    assert sorted(tensors) == sorted(FULL)
    for name, full in FULL.items():
        assert tensors[name].tobytes() == full.tobytes() and tensors[name].dtype == full.dtype


def test_reshard_to_a_world_size_splits_along_the_first_sharded_dim(root: Path,
                                                                     tmp_path: Path,
                                                                     capsys: Any) -> None:
    out = tmp_path / "ck3"
    assert main(["ckpt", "reshard", str(root), "--world-size", "3", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}: 3 ranks, 4 tensors\n"
    meta = load_metadata(out)
    assert meta.mesh is None and meta.num_ranks == 3
    assert {n: s.shard_dim for n, s in meta.tensor_specs.items()} == \
        {"col": 0, "row": 1, "grid": 0, "norm": None}
    for rank in range(3):
        got = load_distributed(out, rank, 3)
        for name, full in FULL.items():
            dim = meta.tensor_specs[name].shard_dim
            want = full if dim is None else np.take(
                full, range(*chunk_bounds(full.shape[dim], 3)[rank]), axis=dim)
            assert got[name].tobytes() == want.tobytes(), (rank, name)


def test_reshard_to_another_mesh_keeps_the_placements(root: Path, tmp_path: Path,
                                                      capsys: Any) -> None:
    out = tmp_path / "tp4"
    assert main(["ckpt", "reshard", str(root), "--mesh", "tp=4,dp=1", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}: 4 ranks (mesh dp=1 x tp=4), 4 tensors\n"
    meta = load_metadata(out)
    assert meta.mesh == {"shape": [1, 4], "names": ["dp", "tp"]}
    assert verify_checkpoint(out).ok
    for name, placements in PLACEMENTS.items():
        spec = meta.tensor_specs[name]
        assert spec.mesh == MeshSharding.even(FULL[name].shape, (1, 4), placements)
    for rank in range(4):
        got = load_distributed(out, rank, 4)
        for name, full in FULL.items():
            want = _region(full, meta.tensor_specs[name].box(rank))
            assert got[name].tobytes() == want.tobytes(), (rank, name)
    # and on to one rank, still a mesh (of one) with its placements
    one = tmp_path / "one"
    assert main(["ckpt", "reshard", str(out), "--mesh", "dp=1,tp=1", str(one)]) == 0
    grid = load_metadata(one).tensor_specs["grid"].mesh
    assert grid is not None and grid.placements == PLACEMENTS["grid"]
    got = load_distributed(one, 0, 1)
    assert all(got[name].tobytes() == full.tobytes() for name, full in FULL.items())


@pytest.mark.parametrize("args, needle", [
    (["--mesh", "dp=2,pp=2"], "the new mesh names dims ['dp', 'pp'], the checkpoint's mesh "
                              "has ['dp', 'tp']"),
    (["--mesh", "dp=2"], "give a size for each of dp, tp"),
    (["--mesh", "dp=2,tp=0"], "is not NAME=SIZE"),
    (["--mesh", "dp:2"], "is not NAME=SIZE"),
    (["--mesh", "dp=1,tp=2", "--world-size", "2"], "not allowed with argument"),
])
def test_bad_meshes_are_one_line_usage_errors(root: Path, tmp_path: Path, capsys: Any,
                                              args: list[str], needle: str) -> None:
    out = tmp_path / "new"
    with pytest.raises(SystemExit) as info:
        code = main(["ckpt", "reshard", str(root), *args, str(out)])
        raise SystemExit(code)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (out / "metadata.json").exists()


def test_a_mesh_for_a_checkpoint_without_one_is_refused(tmp_path: Path, capsys: Any) -> None:
    from netdist.checkpoint import flat_shard_metadata

    meta = flat_shard_metadata(FULL, 1)
    save_distributed(FULL, tmp_path / "plain", 0, 1, meta)
    assert main(["ckpt", "reshard", str(tmp_path / "plain"), "--mesh", "dp=2",
                 str(tmp_path / "new")]) == 2
    assert "the checkpoint has no mesh" in capsys.readouterr().err
