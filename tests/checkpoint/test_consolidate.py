"""Offline tools (inspect, verify, consolidate, reshard) and the ``netdist ckpt`` CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from netdist.checkpoint import (
    ShardMetadata,
    TensorShardSpec,
    consolidate,
    flat_shard_metadata,
    inspect_checkpoint,
    load_distributed,
    reshard_checkpoint,
    save_distributed,
    shard_state_dict,
    verify_checkpoint,
)
from netdist.checkpoint.metadata import StateLayout
from netdist.cli.main import build_parser
from netdist.errors import CheckpointError, CheckpointMismatchError


def _full() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {
        "w": rng.standard_normal((37, 29)).astype(np.float32),
        "m": rng.integers(0, 9, (5, 13, 7)).astype(np.int16),
        "b": rng.standard_normal(29),
        "s": np.array(4, np.int64),
    }


def _save(full: dict[str, np.ndarray], root: Path, n: int, dim: int,
          state: StateLayout | None = None) -> ShardMetadata:
    meta = flat_shard_metadata(full, n, shard_dim=dim)
    specs = dict(meta.tensor_specs)
    specs["b"] = TensorShardSpec.replicated((29,), "float64")
    meta = ShardMetadata(n, specs, extra={"epoch": 2})
    for rank in range(n):
        save_distributed(shard_state_dict(full, meta, rank), root, rank, n, meta, step=9)
    if state is not None:  # as a collective save would record it
        from netdist.checkpoint.api import load_metadata
        from netdist.checkpoint.storage import write_bytes_atomic

        stored = load_metadata(root)
        updated = ShardMetadata(stored.num_ranks, stored.tensor_specs, extra=stored.extra,
                                step=stored.step, writers=stored.writers, files=stored.files,
                                state=state)
        write_bytes_atomic(root / "step_000009" / "metadata.json", updated.dumps().encode())
    return meta


@pytest.mark.parametrize("dim", [0, 1])
def test_consolidate_streams_into_one_plain_file(tmp_path: Path, dim: int) -> None:
    full = _full()
    _save(full, tmp_path / "ck", 3, dim)
    seen: list[tuple[int, int]] = []
    out = consolidate(tmp_path / "ck", tmp_path / "all.safetensors", chunk_bytes=1000,
                      progress=lambda done, total: seen.append((done, total)))
    loaded = safetensors.numpy.load_file(out)
    assert set(loaded) == set(full)
    for name, array in full.items():
        np.testing.assert_array_equal(loaded[name], array)
    assert len(seen) > 5 and seen[-1][0] >= seen[-1][1]
    from safetensors import safe_open

    with safe_open(out, "np") as f:
        meta = f.metadata()
    assert meta["format"] == "netdist-consolidated" and meta["step"] == "9"
    assert json.loads(meta["netdist.extra"]) == {"epoch": 2}


def test_consolidated_file_loads_in_torch(tmp_path: Path) -> None:
    torch_st = pytest.importorskip("safetensors.torch")
    full = _full()
    _save(full, tmp_path / "ck", 2, 0)
    out = consolidate(tmp_path / "ck", tmp_path / "all.safetensors")
    loaded = torch_st.load_file(str(out))
    for name, array in full.items():
        np.testing.assert_array_equal(loaded[name].numpy(), array)


def test_reshard_checkpoint_to_new_world_size(tmp_path: Path) -> None:
    full = _full()
    _save(full, tmp_path / "ck", 3, 1)
    new = reshard_checkpoint(tmp_path / "ck", tmp_path / "ck4", 4, chunk_bytes=512)
    assert new.num_ranks == 4 and new.step == 9 and new.extra == {"epoch": 2}
    assert sorted(os.listdir(tmp_path / "ck4")) == ["metadata.json"] + [
        f"rank_{r:05d}.safetensors" for r in range(4)]
    for rank in range(4):
        got = load_distributed(tmp_path / "ck4", rank, 4)
        expected = shard_state_dict(full, flat_shard_metadata(full, 4, shard_dim=1), rank)
        for name in ("w", "m"):
            np.testing.assert_array_equal(got[name], expected[name])
        np.testing.assert_array_equal(got["b"], full["b"])
    assert verify_checkpoint(tmp_path / "ck4").ok
    with pytest.raises(CheckpointError, match="already holds"):
        reshard_checkpoint(tmp_path / "ck", tmp_path / "ck4", 2)


def test_reshard_checkpoint_per_rank_values_policy(tmp_path: Path) -> None:
    layout = StateLayout({"t": "object", "k": "cursor"}, {}, {"cursor": (0, 10, 20)})
    _save(_full(), tmp_path / "ck", 3, 0, state=layout)
    with pytest.raises(CheckpointMismatchError, match="cursor"):
        reshard_checkpoint(tmp_path / "ck", tmp_path / "a", 2)
    new = reshard_checkpoint(tmp_path / "ck", tmp_path / "b", 4, rank_objects="modulo")
    assert new.state is not None and new.state.rank_objects == {"cursor": (0, 10, 20, 0)}


def test_verify_reports_every_problem(tmp_path: Path) -> None:
    _save(_full(), tmp_path, 3, 0)
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.files == 3
    step = tmp_path / "step_000009"
    raw = bytearray((step / "rank_00000.safetensors").read_bytes())
    raw[len(raw) // 2] ^= 0x04
    (step / "rank_00000.safetensors").write_bytes(raw)
    os.truncate(step / "rank_00001.safetensors", 100)
    os.unlink(step / "rank_00002.safetensors")
    report = verify_checkpoint(tmp_path)
    assert not report.ok and report.files == 0
    assert len(report.problems) == 3
    assert "checksum mismatch" in report.problems[0]
    assert "truncated" in report.problems[1]
    assert "missing" in report.problems[2]
    with pytest.raises(CheckpointError):  # corrupt or missing, whichever is read first
        consolidate(tmp_path, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_inspect_rows(tmp_path: Path) -> None:
    _save(_full(), tmp_path, 3, 0)
    directory, meta, rows = inspect_checkpoint(tmp_path)
    assert directory == tmp_path / "step_000009" and meta.num_ranks == 3
    by_name = {r.name: r for r in rows}
    assert by_name["w"].layout == "dim 0 [13,12,12]" and by_name["w"].ranks == (0, 1, 2)
    assert by_name["w"].nbytes == 37 * 29 * 4 and by_name["w"].dtype == "float32"
    writer = meta.writers["b"]
    assert by_name["b"].layout == f"replicated (stored by rank {writer})"
    assert by_name["b"].ranks == (writer,)


def _cli(argv: list[str]) -> int:
    parser = build_parser(("ckpt",))
    args = parser.parse_args(["ckpt", *argv])
    return int(args._netdist_run(args))


def test_cli_inspect_verify_consolidate_reshard(tmp_path: Path, capsys: Any) -> None:
    full = _full()
    _save(full, tmp_path / "ck", 2, 0)
    assert _cli(["inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "saved by 2 rank(s), step 9" in out
    assert "tensor  dtype" in out and "w       float32  (37, 29)" in out
    assert "rank_00001.safetensors" in out

    assert _cli(["verify", str(tmp_path / "ck")]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("OK: ") and "verify:" in captured.err

    assert _cli(["consolidate", str(tmp_path / "ck"), str(tmp_path / "all.safetensors")]) == 0
    captured = capsys.readouterr()
    assert "consolidate:" in captured.err and "100.0%" in captured.err
    np.testing.assert_array_equal(
        safetensors.numpy.load_file(tmp_path / "all.safetensors")["m"], full["m"])

    assert _cli(["reshard", str(tmp_path / "ck"), "--world-size", "3", str(tmp_path / "r")]) == 0
    assert "3 ranks" in capsys.readouterr().out
    np.testing.assert_array_equal(load_distributed(tmp_path / "r", 2, 3)["w"], full["w"][25:])

    raw = bytearray((tmp_path / "r" / "rank_00001.safetensors").read_bytes())
    raw[-1] ^= 1
    (tmp_path / "r" / "rank_00001.safetensors").write_bytes(raw)
    assert _cli(["verify", str(tmp_path / "r")]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_cli_errors_are_netdist_errors(tmp_path: Path) -> None:
    from netdist.errors import CheckpointNotFoundError, ConfigError

    with pytest.raises(CheckpointNotFoundError):
        _cli(["inspect", str(tmp_path / "missing")])
    with pytest.raises(ConfigError):
        _cli(["reshard", str(tmp_path), "--world-size", "0", str(tmp_path / "o")])


def test_netdist_main_dispatches_ckpt(tmp_path: Path, capsys: Any) -> None:
    from netdist.cli.main import main

    _save(_full(), tmp_path, 2, 0)
    assert main(["ckpt", "verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("OK: ")
    assert main(["ckpt", "inspect", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
