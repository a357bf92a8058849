"""The half of the bf16/fp16 tests that runs without ``ml_dtypes`` (and maybe torch).

``test_torch_state.py`` runs ``python -c "<hide modules>; runpy.run_module(...)" MODE DIR``
with ``sys.modules["ml_dtypes"] = None`` (and ``sys.modules["torch"] = None`` for
``no-torch``) set before anything is imported, so ``import ml_dtypes`` fails exactly as
on a machine without it. Prints ``OK`` when every check passed; a failed check raises.

- ``no-ml-dtypes``: writes torch bf16/fp16 state into ``DIR/mine`` (collective, two
  in-process ranks) and ``DIR/mine_per_rank`` (per-rank API), reads both back at three
  ranks and through the per-rank API (torch bf16 tensors, bit for bit), reads the
  checkpoint the parent wrote from ``ml_dtypes`` arrays (``DIR/parent``), and consolidates
  ``DIR/mine`` into ``DIR/mine.safetensors`` for ``safetensors.torch.load_file``;
- ``no-torch``: reading ``DIR/parent`` (which holds bf16) is a ``CheckpointMismatchError``
  naming the tensor and ``bfloat16``, never "corrupt"; verify and inspect still work; a
  NumPy checkpoint saves and loads; torch is never imported.

The expected values are defined here as raw bits (NumPy only), with the special values
(signed zeros, infinities, a NaN with a payload, subnormals) that a lossy path would
change.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tests import ranks

BF16_SPECIAL = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x8001, 0x3F80]
FP16_SPECIAL = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0x0001, 0x8001, 0x3C00]


def bf16_bits() -> np.ndarray:
    bits = np.random.default_rng(5).integers(0, 1 << 16, (7, 5), dtype=np.uint16)
    bits.reshape(-1)[:len(BF16_SPECIAL)] = BF16_SPECIAL
    return bits


def fp16_bits() -> np.ndarray:
    bits = np.random.default_rng(6).integers(0, 1 << 16, (9,), dtype=np.uint16)
    bits[:len(FP16_SPECIAL)] = FP16_SPECIAL
    return bits


def f32_values() -> np.ndarray:
    return np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)


def torch_state() -> dict[str, Any]:
    """The state the bf16 tests save (torch tensors)."""
    import torch

    return {"model": {"w": torch.from_numpy(bf16_bits().view(np.int16)).view(torch.bfloat16),
                      "h": torch.from_numpy(fp16_bits().view(np.float16)),
                      "f": torch.from_numpy(f32_values())},
            "step": 3}


def raw_bits(value: Any) -> np.ndarray:
    """The uint16 bits of a 2-byte tensor or array (torch, ml_dtypes or raw stand-in)."""
    if type(value).__module__.startswith("torch"):
        import torch

        return value.contiguous().view(torch.int16).numpy().view(np.uint16)
    return np.ascontiguousarray(value).view(np.uint16)


def check_torch_state(got: dict[str, Any], what: str) -> None:
    import torch

    w, h, f = got["model"]["w"], got["model"]["h"], got["model"]["f"]
    assert isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16, (what, type(w), w.dtype)
    assert isinstance(h, torch.Tensor) and h.dtype == torch.float16, (what, h.dtype)
    assert np.array_equal(raw_bits(w), bf16_bits()), what
    assert np.array_equal(raw_bits(h), fp16_bits()), what
    assert np.array_equal(f.numpy().view(np.uint32), f32_values().view(np.uint32)), what
    assert got["step"] == 3, what


run_ranks = functools.partial(ranks.run_ranks, op_timeout=20.0, return_exceptions=True)
"""Every rank in this process over in-process transports; a rank's exception is its result."""


def no_ml_dtypes(root: Path) -> None:
    import safetensors.torch
    import torch

    from netdist.checkpoint import (consolidate, load, load_distributed, save,
                                    save_distributed)
    from netdist.types import WIRE_DTYPES

    assert sys.modules.get("ml_dtypes") is None and "bfloat16" not in WIRE_DTYPES
    # collective save at 2 ranks, loads at 3
    outcomes = asyncio.run(run_ranks(2, lambda g: save(torch_state(), root / "mine", g)))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    for got in asyncio.run(run_ranks(3, lambda g: load(root / "mine", g))):
        assert not isinstance(got, BaseException), got
        check_torch_state(got, "collective load without like")

    def blank() -> dict[str, Any]:
        return {"model": {"w": torch.zeros(7, 5, dtype=torch.bfloat16),
                          "h": torch.zeros(9, dtype=torch.float16),
                          "f": torch.zeros(3, 4)}, "step": 0}

    likes = [blank() for _ in range(3)]
    results = asyncio.run(run_ranks(3, lambda g: load(root / "mine", g, like=likes[g.rank])))
    for like, got in zip(likes, results):
        assert not isinstance(got, BaseException), got
        assert got["model"]["w"] is like["model"]["w"]  # filled in place
        check_torch_state(got, "collective load into like")
    flat = load_distributed(root / "mine", 0, 1)
    assert flat["model.w"].dtype == torch.bfloat16
    assert np.array_equal(raw_bits(flat["model.w"]), bf16_bits())
    assert flat["model.h"].dtype == np.float16  # NumPy has float16: the flat API stays NumPy
    assert np.array_equal(raw_bits(flat["model.h"]), fp16_bits())
    # the per-rank API with a nested torch state
    for rank in range(2):
        save_distributed(torch_state(), root / "mine_per_rank", rank, 2)
    check_torch_state(load_distributed(root / "mine_per_rank", 1, 3, like=blank()),
                      "per-rank load into like")
    # the parent's checkpoint, written with ml_dtypes
    flat = load_distributed(root / "parent", 0, 1)
    assert flat["model.w"].dtype == torch.bfloat16
    assert np.array_equal(raw_bits(flat["model.w"]), bf16_bits())
    for got in asyncio.run(run_ranks(2, lambda g: load(root / "parent", g))):
        assert not isinstance(got, BaseException), got
        assert np.array_equal(raw_bits(got["model"]["w"]), bf16_bits())
    # consolidated: safetensors' own BF16, read by safetensors.torch
    consolidate(root / "mine", root / "mine.safetensors")
    tensors = safetensors.torch.load_file(root / "mine.safetensors")
    assert tensors["model.w"].dtype == torch.bfloat16
    assert np.array_equal(raw_bits(tensors["model.w"]), bf16_bits())
    assert np.array_equal(raw_bits(tensors["model.h"]), fp16_bits())


def no_torch(root: Path) -> None:
    from netdist.checkpoint import (inspect_checkpoint, load, load_distributed, save,
                                    save_distributed, verify_checkpoint)
    from netdist.errors import CheckpointMismatchError

    def check_error(exc: BaseException, what: str) -> None:
        text = str(exc)
        assert isinstance(exc, CheckpointMismatchError), (what, type(exc), text)
        assert "bfloat16" in text and "'model.w'" in text, (what, text)
        assert "corrupt" not in text.lower(), (what, text)
        assert "ml_dtypes" in text and "torch" in text, (what, text)  # says what to install

    try:
        load_distributed(root / "parent", 0, 1)
    except CheckpointMismatchError as exc:
        check_error(exc, "load_distributed")
    else:
        raise AssertionError("load_distributed of bf16 without ml_dtypes or torch succeeded")
    for outcome in asyncio.run(run_ranks(2, lambda g: load(root / "parent", g))):
        assert isinstance(outcome, BaseException), outcome
        if "seen from rank" not in str(outcome):  # the rank's own error, not a relay
            check_error(outcome, "collective load")
        assert isinstance(outcome, CheckpointMismatchError), outcome
    assert verify_checkpoint(root / "parent").ok
    rows = {row.name: row for row in inspect_checkpoint(root / "parent")[2]}
    assert rows["model.w"].dtype == "bfloat16" and rows["model.h"].dtype == "float16"
    # NumPy state (float16 included) is untouched by any of this
    state = {"w": np.arange(6, dtype=np.float16), "n": {"b": np.ones(3)}, "step": 4}
    save_distributed(state, root / "numpy_ckpt", 0, 1)
    got = load_distributed(root / "numpy_ckpt", 0, 1, like={"w": np.zeros(6, np.float16),
                                                           "n": {"b": np.zeros(3)},
                                                           "step": 0})
    assert got["step"] == 4 and np.array_equal(got["w"], state["w"])
    outcomes = asyncio.run(run_ranks(2, lambda g: save(state, root / "numpy_coll", g)))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert "torch" not in sys.modules or sys.modules["torch"] is None


if __name__ == "__main__":
    mode, directory = sys.argv[1], Path(sys.argv[2])
    {"no-ml-dtypes": no_ml_dtypes, "no-torch": no_torch}[mode](directory)
    print("OK", flush=True)
