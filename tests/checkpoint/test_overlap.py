"""Torch tensors that partly overlap in memory are stored once and restored as views.

A weight and a window of it (``w`` and ``w[2:5]``), and two overlapping windows of one
storage, used to be written once per name. They are now one stored tensor (the weight
itself, or the region the windows cover) plus view nodes in the state skeleton
(``docs/PROTOCOL.md``, "State layout"); a load gives views sharing memory again. Real
files, ranks on an in-process ``Group``; resharding and CRC checks go through the stored
tensor.
"""

from __future__ import annotations

import copy
import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

from netdist.checkpoint import (
    ShardedArray,
    consolidate,
    load,
    load_distributed,
    load_metadata,
    reshard_checkpoint,
    save,
    save_distributed,
    verify_checkpoint,
)
from netdist.checkpoint.metadata import METADATA_FILE, ShardMetadata
from netdist.checkpoint.state import flatten_state
from netdist.errors import CheckpointCorruptError, CheckpointMismatchError
from tests.checkpoint.test_torch_state import assert_bitwise, data_bytes, safetensors_header
from tests.ranks import run_ranks

OP_TIMEOUT = 20.0
ROWS, COLS = 16, 8
STORAGE = 40  # head = storage[0:24], tail = storage[16:40]: 8 elements shared


class Windowed(torch.nn.Module):
    """A weight with a buffer that is rows 2..4 of it, and two buffers that are
    overlapping windows of one storage: every overlap in one small module."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(ROWS, COLS, generator=gen))
        self.register_buffer("rows", self.weight.data[2:5])
        storage = torch.randn(STORAGE, generator=gen)
        self.register_buffer("head", storage[0:24])
        self.register_buffer("tail", storage[16:40])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.rows.sum() + self.head.sum() * self.tail.sum()


def shares(a: torch.Tensor, b: torch.Tensor, offset: int) -> bool:
    """``b`` starts ``offset`` elements after ``a`` in the same storage."""
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() - a.storage_offset() == offset)


def assert_windows(model: Windowed) -> None:
    """The module's buffers are still the windows of its memory they were built as."""
    assert shares(model.weight, model.rows, 2 * COLS)
    assert shares(model.head, model.tail, 16)


def stored_names(path: Path) -> list[str]:
    return list(load_metadata(path).tensor_specs)


# --------------------------------------------------------------------------- storage


async def test_overlapping_tensors_are_stored_once(tmp_path: Path) -> None:
    model = Windowed(0)
    await run_ranks(2, lambda g: save({"model": model.state_dict()}, tmp_path / "views", g,
                                      timeout=OP_TIMEOUT))
    # the same values without shared memory: every name stored on its own, as before
    copies = {k: v.clone() for k, v in model.state_dict().items()}
    await run_ranks(2, lambda g: save({"model": copies}, tmp_path / "copies", g,
                                      timeout=OP_TIMEOUT))
    views_dir = tmp_path / "views" / "step_000000"
    copies_dir = tmp_path / "copies" / "step_000000"
    # one copy: the weight and the storage the two windows cover, nothing more
    assert data_bytes(views_dir) == (ROWS * COLS + STORAGE) * 4
    assert data_bytes(copies_dir) == (ROWS * COLS + 3 * COLS + 24 + 24) * 4
    assert stored_names(views_dir) == ["model.weight", "model.head#storage"]
    meta = load_metadata(views_dir)
    nodes = {key: node for key, node in meta.state.skeleton["items"][0][1]["items"]}
    assert nodes["rows"] == {"t": "view", "k": "model.weight", "offset": 2 * COLS,
                             "shape": [3, COLS], "strides": [COLS, 1], "torch": True}
    assert nodes["head"] == {"t": "view", "k": "model.head#storage", "offset": 0,
                             "shape": [24], "strides": [1], "torch": True}
    assert nodes["tail"]["offset"] == 16
    # the metadata still parses as written (the reader validates every view)
    text = (views_dir / METADATA_FILE).read_text()
    assert ShardMetadata.loads(text).state == meta.state


def test_what_is_grouped_and_what_is_not() -> None:
    big = torch.arange(100 * 100, dtype=torch.float32).reshape(100, 100)
    # interleaved columns of a large matrix: storing the region would take 50x the bytes
    flat = flatten_state({"c0": big[:, 0], "c1": big[:, 1]})
    assert list(flat.tensors) == ["c0", "c1"] and not flat.views
    # a transposed and a flattened view of a weight are views of it
    w = torch.randn(4, 6)
    flat = flatten_state({"t": w.t(), "w": w, "f": w.view(-1), "other": torch.ones(3)})
    assert list(flat.tensors) == ["w", "other"]
    assert flat.views["t"].strides == (1, 6) and flat.views["f"].shape == (24,)
    # different dtypes over one storage, NumPy arrays, shards: never grouped
    raw = torch.zeros(8)
    a = np.zeros(10)
    flat = flatten_state({"f": raw, "i": raw.view(torch.int32)[0:4], "n": a, "m": a[2:5],
                          "s": ShardedArray(raw[0:4])})
    assert list(flat.tensors) == ["f", "i", "n", "m", "s"] and not flat.views
    # ties stay aliases; a tie of a view is the same view
    flat = flatten_state({"w": w, "part": w[1:3], "again": w[1:3]})
    assert list(flat.tensors) == ["w"]
    assert flat.views["again"] == flat.views["part"] and not flat.aliases
    # a region name never collides with a path of the state
    s = torch.arange(10.0)
    flat = flatten_state({"a": s[0:6], "b": s[4:10], "a#storage": torch.ones(2)})
    assert list(flat.tensors) == ["a#storage2", "a#storage"]
    assert flat.views["a"].base == "a#storage2"


# --------------------------------------------------------------------------- loading


async def test_round_trip_without_like_restores_the_sharing(tmp_path: Path) -> None:
    model = Windowed(0)
    expected = copy.deepcopy(model.state_dict())
    await run_ranks(2, lambda g: save({"model": model.state_dict(), "step": 4}, tmp_path, g,
                                      timeout=OP_TIMEOUT))
    for got in await run_ranks(3, lambda g: load(tmp_path, g, timeout=OP_TIMEOUT)):
        state = got["model"]
        assert_bitwise(state, expected, "model")
        assert shares(state["weight"], state["rows"], 2 * COLS)
        assert shares(state["head"], state["tail"], 16)
        state["weight"][3, 0] = 100.0  # one memory: a write shows through the view
        assert state["rows"][1, 0] == 100.0
        state["tail"][0] = -7.0
        assert state["head"][16] == -7.0
        fresh = Windowed(5)
        fresh.load_state_dict(state, strict=True)
        assert_windows(fresh)


async def test_in_place_load_keeps_the_model_sharing_memory(tmp_path: Path) -> None:
    model = Windowed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, COLS)).sum().backward()
    optimizer.step()
    expected = copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict()})
    await run_ranks(2, lambda g: save({"model": model, "optim": optimizer}, tmp_path, g,
                                      timeout=OP_TIMEOUT))
    targets = []
    for rank in range(3):
        target = Windowed(100 + rank)  # other values, no optimizer state yet
        targets.append((target, torch.optim.Adam(target.parameters(), lr=0.1)))
    pointers = [[t.data_ptr() for t in target.state_dict().values()] for target, _ in targets]
    await run_ranks(3, lambda g: load(tmp_path, g, like={"model": targets[g.rank][0],
                                                         "optim": targets[g.rank][1]},
                                      timeout=OP_TIMEOUT))
    for (target, optimizer2), before in zip(targets, pointers):
        assert_bitwise(target.state_dict(), expected["model"], "model")
        assert_bitwise(optimizer2.state_dict(), expected["optim"], "optim")
        assert [t.data_ptr() for t in target.state_dict().values()] == before  # in place
        assert_windows(target)
        with torch.no_grad():
            target.weight[2, 1] = 42.0
        assert target.rows[0, 1] == 42.0

    # a like whose tensors do not share memory gets every value all the same
    separate = {k: torch.zeros_like(v) for k, v in expected["model"].items()}
    got = await run_ranks(1, lambda g: load(tmp_path, g, like={"model": separate},
                                            strict=False, timeout=OP_TIMEOUT))
    assert all(got[0]["model"][k] is v for k, v in separate.items())
    assert_bitwise(separate, expected["model"], "separate tensors")
    # a like holding only the windows (not the weight) reads the weight as scratch
    only = {"rows": torch.zeros(3, COLS), "tail": torch.zeros(24)}
    await run_ranks(1, lambda g: load(tmp_path, g, like={"model": only}, strict=False,
                                      timeout=OP_TIMEOUT))
    assert_bitwise(only, {k: expected["model"][k] for k in only}, "windows only")


class Holder:
    """A stateful object whose state appears only when loaded (like an optimizer's)."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.state = dict(state or {})

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


async def test_state_created_by_the_load_shares_memory_as_saved(tmp_path: Path) -> None:
    buffer = torch.arange(12, dtype=torch.float64)
    holder = Holder({"buffer": buffer, "window": buffer[3:9].view(2, 3), "n": 1})
    await run_ranks(2, lambda g: save({"h": holder}, tmp_path, g, timeout=OP_TIMEOUT))
    empty = Holder()
    await run_ranks(1, lambda g: load(tmp_path, g, like={"h": empty}, timeout=OP_TIMEOUT))
    assert_bitwise(empty.state, holder.state, "created state")
    assert shares(empty.state["buffer"], empty.state["window"], 3)
    assert empty.state["window"].stride() == (3, 1)


async def test_a_like_that_cannot_receive_a_view_is_refused(tmp_path: Path) -> None:
    model = Windowed(0)
    await run_ranks(1, lambda g: save({"model": model.state_dict()}, tmp_path, g,
                                      timeout=OP_TIMEOUT))
    cases = [
        ({"rows": torch.zeros(4, COLS)}, r"'model.rows': target shape \(4, 8\) does not "
                                          r"match the saved \(3, 8\)"),
        ({"rows": torch.zeros(3, COLS, dtype=torch.float64)},
         r"'model.rows': checkpoint has dtype float32, target has float64"),
        ({"rows": ShardedArray(torch.zeros(3, COLS))}, r"'model.rows' is saved as a view of "
                                                       r"'model.weight'"),
    ]
    for like, message in cases:
        errors = await run_ranks(1, lambda g: load(tmp_path, g, like={"model": like},
                                                   strict=False, timeout=OP_TIMEOUT),
                                 return_exceptions=True)
        assert isinstance(errors[0], CheckpointMismatchError), errors[0]
        assert re.search(message, str(errors[0])), str(errors[0])


def test_per_rank_api_stores_views_once(tmp_path: Path) -> None:
    model = Windowed(0)
    for rank in range(2):
        save_distributed({"model": model.state_dict()}, tmp_path, rank, 2, step=1)
    assert data_bytes(tmp_path / "step_000001") == (ROWS * COLS + STORAGE) * 4
    target = Windowed(9)
    got = load_distributed(tmp_path, 1, 3, like={"model": target})
    assert got["model"] is target
    assert_bitwise(target.state_dict(), model.state_dict())
    assert_windows(target)


async def test_resharding_and_crc_checks_stay_correct(tmp_path: Path) -> None:
    """Shards next to views: a 2-rank save reads back at 3 ranks exactly, and a flipped
    byte inside a stored region is caught by the block CRC."""
    full = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    model = Windowed(0)

    def state(rank: int, n: int) -> dict[str, Any]:
        lo, hi = [(0, 6), (6, 12)][rank] if n == 2 else [(0, 4), (4, 8), (8, 12)][rank]
        return {"model": model.state_dict(), "shard": ShardedArray(full[lo:hi].clone())}

    await run_ranks(2, lambda g: save(state(g.rank, 2), tmp_path, g, timeout=OP_TIMEOUT))
    likes = [{"model": Windowed(50 + r), "shard": ShardedArray(torch.zeros(4, 5))}
             for r in range(3)]
    await run_ranks(3, lambda g: load(tmp_path, g, like=likes[g.rank], timeout=OP_TIMEOUT))
    for rank, like in enumerate(likes):
        assert torch.equal(like["shard"].data, full[4 * rank:4 * rank + 4])
        assert_bitwise(like["model"].state_dict(), model.state_dict())
        assert_windows(like["model"])

    # flip one byte of the stored storage region (it holds the `tail` view's bytes)
    step_dir = tmp_path / "step_000000"
    meta = load_metadata(step_dir)
    writer = meta.writers["model.head#storage"]
    path = step_dir / f"rank_{writer:05d}.safetensors"
    header = safetensors_header(path)
    begin, _ = header["model.head#storage"]["data_offsets"]
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    raw[8 + length + begin + 30 * 4] ^= 0x40  # element 30: in `tail` only
    path.write_bytes(bytes(raw))
    errors = await run_ranks(2, lambda g: load(tmp_path, g, like={"model": Windowed(1),
                                                                  "shard": state(g.rank, 2)
                                                                  ["shard"]},
                                               timeout=OP_TIMEOUT), return_exceptions=True)
    for error in errors:
        assert isinstance(error, CheckpointCorruptError), error
        assert f"rank_{writer:05d}.safetensors: checksum mismatch" in str(error), str(error)


async def test_a_view_past_its_stored_tensor_is_corrupt(tmp_path: Path) -> None:
    """Views in a hostile metadata.json are checked before anything is read."""
    model = Windowed(0)
    await run_ranks(1, lambda g: save({"model": model.state_dict(),
                                       "s": ShardedArray(torch.zeros(4, 2))}, tmp_path, g,
                                      timeout=OP_TIMEOUT))
    doc = json.loads((tmp_path / "step_000000" / METADATA_FILE).read_text())
    assert ShardMetadata.from_json(doc).state is not None

    def rows_node(document: dict[str, Any]) -> dict[str, Any]:
        model_node = document["state"]["skeleton"]["items"][0][1]
        return dict(model_node["items"])["rows"]

    bad = [("offset", 14 * COLS, "a view of 'model.weight' reaches element 136, past its "
                                 "128 elements"),
           ("strides", [COLS, 20], "reaches element 173"),
           ("shape", [3, -1], "view shape must hold ints >= 0"),
           ("offset", True, "view offset must hold ints >= 0"),
           ("k", "s", "a view of 's', which is sharded"),
           ("k", "nothing", "names tensor 'nothing', which the checkpoint does not hold"),
           ("strides", [COLS], "2-d shape with 1 strides")]
    for field, value, message in bad:
        document = json.loads(json.dumps(doc))
        rows_node(document)[field] = value
        with pytest.raises(CheckpointCorruptError, match=re.escape(message)):
            ShardMetadata.from_json(document)
    document = json.loads(json.dumps(doc))
    del rows_node(document)["strides"]
    with pytest.raises(CheckpointCorruptError, match="missing key 'strides'"):
        ShardMetadata.from_json(document)


async def test_consolidated_file_holds_each_view_as_a_tensor(tmp_path: Path) -> None:
    model = Windowed(0)
    await run_ranks(2, lambda g: save({"model": model}, tmp_path / "ckpt", g,
                                      timeout=OP_TIMEOUT))
    out = tmp_path / "model.safetensors"
    consolidate(tmp_path / "ckpt", out, prefix="model.")
    tensors = safetensors.torch.load_file(out)
    assert sorted(tensors) == ["head", "rows", "tail", "weight"]
    assert_bitwise(tensors, dict(sorted(model.state_dict().items())))
    target = Windowed(3)
    target.load_state_dict(tensors, strict=True)
    assert_bitwise(target.state_dict(), model.state_dict())
    assert_windows(target)
    # the offline tools carry the views along: rewritten for 3 ranks, verified, loaded
    reshard_checkpoint(tmp_path / "ckpt", tmp_path / "three", 3)
    assert verify_checkpoint(tmp_path / "three").ok
    targets = [Windowed(10 + rank) for rank in range(3)]
    await run_ranks(3, lambda g: load(tmp_path / "three", g, like={"model": targets[g.rank]},
                                      timeout=OP_TIMEOUT))
    for target in targets:
        assert_bitwise(target.state_dict(), model.state_dict())
        assert_windows(target)
