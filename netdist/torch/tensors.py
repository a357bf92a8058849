"""Torch tensors as NumPy arrays over the same memory, for netdist's collectives.

The backend never copies a contiguous CPU tensor: ``as_array`` is a NumPy view of its
storage, so a collective that works in place on the array works in place on the tensor.
A non-contiguous tensor is staged through a contiguous copy that ``Staged.finish`` copies
back, as Gloo does. Moving data (broadcast, gathers, all-to-all, send/recv) uses the bytes
of the tensor (``as_bytes``), so every dtype moves, complex and bfloat16 included; reducing
needs the element type (``as_array``): bfloat16 as netdist carries it (no extra needed),
complex as pairs of reals (torch's own frontends pass complex tensors to reductions as ``view_as_real``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from netdist.tensors import as_array as core_as_array

__all__ = ["Staged", "stage", "as_array", "as_bytes", "check_cpu"]


def check_cpu(tensor: torch.Tensor, op: str) -> None:
    """``ValueError`` unless ``tensor`` is a dense CPU tensor (the netdist backend's device)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{op}: the netdist backend works on CPU tensors, got one on "
                         f"{tensor.device}; use a 'cpu:netdist,cuda:nccl' backend string "
                         "or move it to the CPU")
    if tensor.layout is not torch.strided:
        raise ValueError(f"{op}: the netdist backend needs dense tensors, got {tensor.layout}")


def as_array(tensor: torch.Tensor, op: str) -> np.ndarray:
    """A NumPy view of contiguous CPU ``tensor`` with its element type (for reductions).

    bfloat16 comes through ``netdist.tensors`` (ml_dtypes' type when installed, else the
    raw 16-bit type netdist reduces exactly as torch does); complex as pairs of reals.
    """
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return core_as_array(t, op)


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of contiguous CPU ``tensor`` as a flat ``uint8`` view (for data movement)."""
    t = tensor.detach()
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass
class Staged:
    """A tensor as the collective sees it: itself, or a contiguous stand-in to copy back."""

    tensor: torch.Tensor
    work: torch.Tensor

    def finish(self) -> None:
        """Copy the stand-in's result back into a non-contiguous original."""
        if self.work is not self.tensor:
            with torch.no_grad():
                self.tensor.copy_(self.work)


def stage(tensor: torch.Tensor, op: str) -> Staged:
    """Check ``tensor`` and give it a contiguous working copy if it needs one."""
    check_cpu(tensor, op)
    work = tensor if tensor.is_contiguous() else tensor.detach().contiguous()
    return Staged(tensor, work)
