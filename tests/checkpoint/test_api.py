"""The per-rank API on the seeds' cases, plus layout, dedup, integrity and errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from netdist.checkpoint import (
    ShardMetadata,
    TensorShardSpec,
    flat_shard_metadata,
    list_checkpoints,
    load_distributed,
    load_metadata,
    reshard,
    save_distributed,
    shard_state_dict,
)
from netdist.checkpoint.metadata import FORMAT_VERSION
from netdist.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)


def _full_state(rows: int = 10, cols: int = 6) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "layer.weight": rng.standard_normal((rows, cols)).astype(np.float32),
        "layer.bias": rng.standard_normal(rows),
        "embed": rng.integers(-5, 5, (rows + 3, 4)).astype(np.int64),
    }


def _save_all(full: dict[str, np.ndarray], directory: Path, world_size: int,
              meta: ShardMetadata | None = None) -> ShardMetadata:
    meta = meta or flat_shard_metadata(full, world_size)
    for rank in range(world_size):
        save_distributed(shard_state_dict(full, meta, rank), directory, rank, world_size, meta)
    return meta


def _assert_share(got: dict[str, np.ndarray], full: dict[str, np.ndarray], world_size: int,
                  rank: int, shard_dim: int = 0) -> None:
    expected = shard_state_dict(full, flat_shard_metadata(full, world_size, shard_dim=shard_dim),
                                rank)
    assert set(got) == set(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype
        np.testing.assert_array_equal(got[name], expected[name])


def test_save_load_single_rank(tmp_path: Path) -> None:
    full = _full_state()
    result = save_distributed(full, tmp_path, 0, 1, flat_shard_metadata(full, 1))
    assert result.committed and result.rank == 0 and result.path == tmp_path
    assert sorted(os.listdir(tmp_path)) == ["metadata.json", "rank_00000.manifest.json",
                                            "rank_00000.safetensors"]
    _assert_share(load_distributed(tmp_path, 0, 1), full, 1, 0)


def test_save_load_single_rank_without_spec_is_replicated(tmp_path: Path) -> None:
    full = _full_state()
    save_distributed(full, tmp_path, 0, 1)
    meta = load_metadata(tmp_path)
    assert all(spec.is_replicated for spec in meta.tensor_specs.values())
    got = load_distributed(tmp_path, 0, 1)
    for name in full:
        np.testing.assert_array_equal(got[name], full[name])


def test_save_load_two_ranks(tmp_path: Path) -> None:
    full = _full_state()
    meta = flat_shard_metadata(full, 2)
    first = save_distributed(shard_state_dict(full, meta, 0), tmp_path, 0, 2, meta)
    assert not first.committed and not (tmp_path / "metadata.json").exists()
    second = save_distributed(shard_state_dict(full, meta, 1), tmp_path, 1, 2, meta)
    assert second.committed
    for rank in range(2):
        _assert_share(load_distributed(tmp_path, rank, 2), full, 2, rank)
    # each file holds exactly that rank's shards
    f1 = safetensors.numpy.load_file(tmp_path / "rank_00001.safetensors")
    np.testing.assert_array_equal(f1["layer.weight"], full["layer.weight"][5:])


@pytest.mark.parametrize("old, new", [(2, 4), (4, 2), (3, 2), (2, 3), (1, 5), (5, 1)])
def test_reshard_matches_fresh_split(tmp_path: Path, old: int, new: int) -> None:
    full = _full_state(rows=11)  # 11 rows: uneven for every world size here
    _save_all(full, tmp_path, old)
    for rank in range(new):
        _assert_share(reshard(tmp_path, old, new, rank), full, new, rank)
        _assert_share(load_distributed(tmp_path, rank, new), full, new, rank)


def test_reshard_3_to_2_uneven_exact_values(tmp_path: Path) -> None:
    full = {"x": np.arange(10, dtype=np.int32)}
    meta = _save_all(full, tmp_path, 3)
    assert meta.tensor_specs["x"].shard_sizes == (4, 3, 3)
    assert reshard(tmp_path, 3, 2, 0)["x"].tolist() == [0, 1, 2, 3, 4]
    assert reshard(tmp_path, 3, 2, 1)["x"].tolist() == [5, 6, 7, 8, 9]


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("old, new", [(2, 4), (4, 2), (3, 2)])
def test_2d_reshard_along_dim(tmp_path: Path, dim: int, old: int, new: int) -> None:
    full = {"m": np.arange(9 * 14, dtype=np.float64).reshape(9, 14)}
    _save_all(full, tmp_path, old, flat_shard_metadata(full, old, shard_dim=dim))
    for rank in range(new):
        got = reshard(tmp_path, old, new, rank)["m"]
        _assert_share({"m": got}, full, new, rank, shard_dim=dim)


def test_reshard_checks_old_world_size(tmp_path: Path) -> None:
    _save_all(_full_state(), tmp_path, 2)
    with pytest.raises(CheckpointMismatchError, match="saved by 2 ranks"):
        reshard(tmp_path, 3, 4, 0)


def test_metadata_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    full = _full_state()
    meta = flat_shard_metadata(full, 2)
    meta = ShardMetadata(2, meta.tensor_specs, mesh={"shape": [2]}, extra={"epoch": 4})
    _save_all(full, tmp_path, 2, meta)
    back = load_metadata(tmp_path)
    assert back.num_ranks == 2 and back.version == FORMAT_VERSION
    assert back.tensor_specs == {n: s.with_dtype(full[n].dtype) for n, s in
                                 meta.tensor_specs.items()}
    assert back.mesh == {"shape": [2]} and back.extra == {"epoch": 4}
    assert [f.name for f in back.files] == ["rank_00000.safetensors", "rank_00001.safetensors"]
    assert ShardMetadata.loads(back.dumps()) == back


def test_uneven_first_ranks_larger() -> None:
    meta = flat_shard_metadata({"x": np.zeros((7, 2)), "s": np.float64(1.0)}, 3)
    assert meta.tensor_specs["x"].shard_sizes == (3, 2, 2)
    assert meta.tensor_specs["s"].is_replicated


def test_bad_rank(tmp_path: Path) -> None:
    full = _full_state()
    with pytest.raises(ValueError, match="out of range"):
        save_distributed(full, tmp_path, 2, 2, flat_shard_metadata(full, 2))
    with pytest.raises(ValueError, match="out of range"):
        save_distributed(full, tmp_path, -1, 2)
    with pytest.raises(ValueError, match="out of range"):
        load_distributed(tmp_path, 3, 3)
    with pytest.raises(TypeError):
        load_distributed(tmp_path, "0", 1)  # type: ignore[arg-type]


def test_wrong_local_shape_or_names(tmp_path: Path) -> None:
    full = _full_state()
    meta = flat_shard_metadata(full, 2)
    local = shard_state_dict(full, meta, 0)
    with pytest.raises(ValueError, match="spec says"):
        save_distributed(local, tmp_path, 1, 2, meta)  # rank 0's shapes claimed by rank 1
    with pytest.raises(ValueError, match="missing arrays"):
        save_distributed({"embed": local["embed"]}, tmp_path, 0, 2, meta)
    with pytest.raises(ValueError, match="for 3 ranks"):
        save_distributed(local, tmp_path, 0, 2, flat_shard_metadata(full, 3))


def test_missing_metadata(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_distributed(tmp_path / "nowhere", 0, 1)
    full = _full_state()
    meta = flat_shard_metadata(full, 2)
    save_distributed(shard_state_dict(full, meta, 0), tmp_path, 0, 2, meta)  # rank 1 never ran
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        load_distributed(tmp_path, 0, 2)


def test_missing_shard(tmp_path: Path) -> None:
    _save_all(_full_state(), tmp_path, 2)
    os.unlink(tmp_path / "rank_00001.safetensors")
    _assert_share(load_distributed(tmp_path, 0, 2), _full_state(), 2, 0)  # rank 0 unaffected
    with pytest.raises(CheckpointNotFoundError, match="rank_00001.safetensors is missing"):
        load_distributed(tmp_path, 1, 2)
    with pytest.raises(CheckpointNotFoundError):
        load_distributed(tmp_path, 0, 1)  # resharding needs both files


def test_flipped_byte_and_truncation_detected(tmp_path: Path) -> None:
    full = _full_state()
    _save_all(full, tmp_path, 2)
    path = tmp_path / "rank_00000.safetensors"
    original = path.read_bytes()
    raw = bytearray(original)
    raw[-3] ^= 0x10
    path.write_bytes(raw)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        load_distributed(tmp_path, 0, 2)
    load_distributed(tmp_path, 0, 2, verify=False)  # skipping verification reads anyway
    path.write_bytes(original[:-16])
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        load_distributed(tmp_path, 0, 2)
    path.write_bytes(original)
    _assert_share(load_distributed(tmp_path, 0, 2), full, 2, 0)


def test_format_version_from_the_future(tmp_path: Path) -> None:
    _save_all(_full_state(), tmp_path, 1)
    doc = json.loads((tmp_path / "metadata.json").read_text())
    doc["version"] = FORMAT_VERSION + 1
    (tmp_path / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointVersionError, match="newer"):
        load_distributed(tmp_path, 0, 1)


def test_dtype_and_shape_mismatch_against_destination(tmp_path: Path) -> None:
    full = _full_state()
    _save_all(full, tmp_path, 2)
    out = {"layer.weight": np.empty((5, 6), np.float64)}
    with pytest.raises(CheckpointMismatchError, match="dtype float32"):
        load_distributed(tmp_path, 0, 2, out=out)
    out = {"layer.weight": np.empty((6, 6), np.float32)}
    with pytest.raises(CheckpointMismatchError, match="shape"):
        load_distributed(tmp_path, 0, 2, out=out)
    with pytest.raises(CheckpointMismatchError, match="no tensors named"):
        load_distributed(tmp_path, 0, 2, out={"nope": np.empty(1)})


def test_load_into_preallocated_arrays_in_place(tmp_path: Path) -> None:
    full = _full_state()
    _save_all(full, tmp_path, 2)
    out = {"layer.weight": np.zeros((3, 6), np.float32)}
    got = load_distributed(tmp_path, 1, 4, out=out)
    assert got["layer.weight"] is out["layer.weight"]
    np.testing.assert_array_equal(out["layer.weight"], full["layer.weight"][3:6])


def test_replicated_tensors_are_written_once_by_the_lightest_rank(tmp_path: Path) -> None:
    full = {"big": np.zeros((8, 100), np.float32), "r1": np.ones(50, np.float32),
            "r2": np.full(10, 2.0, np.float32)}
    specs = {"big": TensorShardSpec((8, 100), 0, (6, 2), "float32"),
             "r1": TensorShardSpec.replicated((50,), "float32"),
             "r2": TensorShardSpec.replicated((10,), "float32")}
    meta = ShardMetadata(2, specs)
    _save_all(full, tmp_path, 2, meta)
    files = [safetensors.numpy.load_file(tmp_path / f"rank_0000{r}.safetensors") for r in range(2)]
    assert set(files[0]) == {"big"}
    assert set(files[1]) == {"big", "r1", "r2"}  # rank 1 had 800 B planned, rank 0 2400 B
    assert load_metadata(tmp_path).writers == {"r1": 1, "r2": 1}
    for rank in range(2):
        got = load_distributed(tmp_path, rank, 2)
        np.testing.assert_array_equal(got["r1"], full["r1"])


def test_step_layout_latest_and_keep_last(tmp_path: Path) -> None:
    full = _full_state()
    meta = flat_shard_metadata(full, 2)
    for step in (10, 20, 30):
        scaled = {k: (v * step).astype(v.dtype) for k, v in full.items()}
        for rank in range(2):
            result = save_distributed(shard_state_dict(scaled, meta, rank), tmp_path, rank, 2,
                                      meta, step=step, keep_last=2)
        assert result.path == tmp_path / f"step_{step:06d}" and result.step == step
    assert (tmp_path / "latest").read_text() == "step_000030\n"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 30]
    got = load_distributed(tmp_path, 0, 2)
    np.testing.assert_array_equal(got["embed"], (full["embed"] * 30)[:7])
    older = load_distributed(tmp_path, 1, 2, step=20)
    np.testing.assert_array_equal(older["layer.bias"], full["layer.bias"][5:] * 20)
    assert load_metadata(tmp_path).step == 30


def test_incomplete_step_is_never_loaded_and_is_cleaned_up(tmp_path: Path) -> None:
    full = _full_state()
    meta = flat_shard_metadata(full, 2)
    for rank in range(2):
        save_distributed(shard_state_dict(full, meta, rank), tmp_path, rank, 2, meta, step=1)
    # step 2: only rank 0 gets there (a crash)
    save_distributed(shard_state_dict(full, meta, 0), tmp_path, 0, 2, meta, step=2)
    (tmp_path / "latest").write_text("step_000002\n")  # even a stale pointer is not trusted
    assert load_metadata(tmp_path).step == 1
    for rank in range(2):
        save_distributed(shard_state_dict(full, meta, rank), tmp_path, rank, 2, meta, step=3)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001", "step_000003"]


def test_resaving_a_directory_replaces_it(tmp_path: Path) -> None:
    full = _full_state()
    meta = flat_shard_metadata(full, 2)
    _save_all(full, tmp_path, 2, meta)
    doubled = {k: v * 2 for k, v in full.items()}
    _save_all(doubled, tmp_path, 2, meta)
    assert load_metadata(tmp_path).generation == 2
    _assert_share(load_distributed(tmp_path, 1, 2), doubled, 2, 1)


def test_stale_latest_falls_back_to_newest_complete(tmp_path: Path) -> None:
    full = _full_state()
    for step in (1, 2):
        save_distributed(full, tmp_path, 0, 1, step=step)
    (tmp_path / "latest").write_text("garbage")
    assert load_metadata(tmp_path).step == 2


def test_zero_size_shards_empty_state_and_scalars(tmp_path: Path) -> None:
    full = {"few": np.arange(2 * 3, dtype=np.float32).reshape(2, 3),  # 2 rows over 4 ranks
            "none": np.zeros((0, 5), np.int8), "scalar": np.array(7.5)}
    meta = flat_shard_metadata(full, 4)
    assert meta.tensor_specs["few"].shard_sizes == (1, 1, 0, 0)
    _save_all(full, tmp_path / "a", 4, meta)
    for rank in range(4):
        _assert_share(load_distributed(tmp_path / "a", rank, 4), full, 4, rank)
    for rank in range(3):
        _assert_share(load_distributed(tmp_path / "a", rank, 3), full, 3, rank)
    save_distributed({}, tmp_path / "b", 0, 1)
    assert load_distributed(tmp_path / "b", 0, 1) == {}


def test_all_wire_dtypes_round_trip(tmp_path: Path) -> None:
    from netdist.types import WIRE_DTYPES

    full = {name: (np.arange(12) % 2).astype(dtype).reshape(4, 3)
            for name, dtype in WIRE_DTYPES.items()}
    _save_all(full, tmp_path, 2)
    for rank in range(2):
        got = load_distributed(tmp_path, rank, 2)
        for name, array in full.items():
            assert got[name].dtype == array.dtype, name
            np.testing.assert_array_equal(got[name], array[2 * rank:2 * rank + 2])
