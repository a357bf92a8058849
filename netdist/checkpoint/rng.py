"""``RNGState``: the process-wide random generators as one entry of a checkpointed state.

A resumed run continues bitwise only if every generator it draws from continues where
it stopped: dropout masks and ``torch.randint`` batch indices come from torch's global
CPU generator, ``np.random.*`` from NumPy's legacy global ``RandomState``, ``random.*``
from Python's. Put an ``RNGState()`` into the state::

    state = {"model": model, "optim": optimizer, "rng": RNGState(), "step": step}
    await save(state, "ckpt", group)
    await load("ckpt", group, like=state)       # generators continue where they were

It is a *stateful* object: ``save`` stores its ``state_dict()`` (plain values only -
bytes and integers in the metadata, no tensors - so ranks seeded differently are stored
per rank, see ``rank_objects``), and ``load`` calls its ``load_state_dict()``. Torch's
generator is captured only when torch is already imported (netdist never imports it for
this) and restored when the checkpoint holds it. ``np.random.Generator`` objects need no
helper: put them in the state and they are restored in place.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["RNGState"]


class RNGState:
    """Saves and restores Python's, NumPy's (legacy global) and torch's CPU generator.

    ``python``, ``numpy`` and ``torch`` choose which ones; ``torch=None`` (default)
    means "if torch is imported". CUDA generators are not included.
    """

    def __init__(self, *, python: bool = True, numpy: bool = True,
                 torch: bool | None = None) -> None:
        self.python = python
        self.numpy = numpy
        self.torch = torch

    def __repr__(self) -> str:
        return f"RNGState(python={self.python}, numpy={self.numpy}, torch={self.torch})"

    def state_dict(self) -> dict[str, Any]:
        """The current state of the selected generators, as plain values."""
        state: dict[str, Any] = {}
        if self.python:
            state["python"] = random.getstate()
        if self.numpy:
            legacy = np.random.get_state(legacy=False)
            state["numpy"] = {
                "bit_generator": legacy["bit_generator"],
                "key": np.asarray(legacy["state"]["key"], dtype="<u4").tobytes(),
                "pos": int(legacy["state"]["pos"]),
                "has_gauss": int(legacy["has_gauss"]),
                "gauss": float(legacy["gauss"]),
            }
        torch = sys.modules.get("torch") if self.torch is None else _import_torch(self.torch)
        if torch is not None:
            state["torch"] = bytes(torch.get_rng_state().numpy().tobytes())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put every generator the state holds (and this object selects) back."""
        if self.python and "python" in state:
            version, internal, gauss = state["python"]
            random.setstate((version, tuple(internal), gauss))
        if self.numpy and "numpy" in state:
            saved = state["numpy"]
            key = np.frombuffer(saved["key"], dtype="<u4").astype(np.uint32)
            np.random.set_state((saved["bit_generator"], key, saved["pos"],
                                 saved["has_gauss"], saved["gauss"]))
        if "torch" in state and self.torch is not False:
            torch = _import_torch(True)
            raw = bytearray(state["torch"])
            torch.set_rng_state(torch.frombuffer(raw, dtype=torch.uint8).clone())


def _import_torch(wanted: bool) -> Any:
    if not wanted:
        return None
    import torch

    return torch
