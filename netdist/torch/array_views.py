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

import contextlib
import ctypes
import functools
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from netdist.tensors import TensorRules, check_tensor
from netdist.tensors import as_array as core_as_array

__all__ = ["Staged", "stage", "as_array", "as_bytes", "check_cpu", "ViewCache"]


_BACKEND_RULES = TensorRules(
    not_tensor="{what}: expected a torch.Tensor, got {kind}",
    off_cpu=("{what}: the netdist backend works on CPU tensors, got one on {device}; use a "
             "'cpu:netdist,cuda:nccl' backend string or move it to the CPU"),
    not_dense="{what}: the netdist backend needs dense tensors, got {layout}",
)
"""How the backend words ``check_tensor``'s refusals (it names the backend string)."""


def check_cpu(tensor: torch.Tensor, op: str) -> None:
    """``TensorDeviceError`` (a ``ValueError``) unless ``tensor`` is a dense CPU tensor
    (the netdist backend's device); ``TypeError`` if it is not a tensor."""
    check_tensor(tensor, op, rules=_BACKEND_RULES)


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


_Signature = tuple[int, bool, torch.Size, tuple[int, ...], torch.dtype]


def _signature(tensor: torch.Tensor) -> _Signature:
    """What a cached view depends on: the memory address (on the CPU), shape, strides and
    dtype."""
    return tensor.data_ptr(), tensor.is_cpu, tensor.shape, tensor.stride(), tensor.dtype


class ViewCache:
    """NumPy views of the contiguous CPU tensors a process group is handed again and again
    (DDP's gradient buckets, a training loop's buffers, a latency loop's tensor).

    Checking a tensor and viewing it costs a dozen torch calls, which after a network
    round trip run on cold caches: about 20 us of an 8-byte all-reduce's 140. A hit costs
    three (``data_ptr``, ``shape``, ``stride``) and is only taken for the very tensor
    object seen before, at the same address with the same shape, strides and dtype.
    Entries hold the tensor weakly, and the cached view reads its memory without a
    reference to it, so the cache never keeps a tensor alive: an entry whose tensor has
    died is dropped, and a view is only handed out while its tensor is alive (the caller
    holds it for the whole operation). At most ``capacity`` entries, least recently used
    first out. Torch calls the backend from more than one thread (the caller's, autograd's,
    DDP's hooks): every change here is one atomic dict operation, and one that finds its
    entry gone (evicted or dropped meanwhile) is simply skipped.
    """

    def __init__(self, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[weakref.ref[torch.Tensor], _Signature,
                                              np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tensor: torch.Tensor) -> np.ndarray | None:
        """The cached view of ``tensor`` if it was stored and has not changed, else None."""
        key = id(tensor)
        entry = self._entries.get(key)
        if entry is None:
            return None
        ref, signature, view = entry
        if ref() is tensor and signature == _signature(tensor):
            with contextlib.suppress(KeyError):  # evicted by another thread meanwhile
                self._entries.move_to_end(key)
            return view
        self._entries.pop(key, None)
        return None

    def store(self, tensor: torch.Tensor, array: np.ndarray) -> None:
        """Remember ``array`` (``as_array(tensor)`` of a checked, contiguous CPU tensor) as
        a view that holds no reference to ``tensor``."""
        if not array.nbytes or not array.flags.c_contiguous or not tensor.is_contiguous():
            return
        key = id(tensor)
        memory = (ctypes.c_char * array.nbytes).from_address(tensor.data_ptr())
        view = np.frombuffer(memoryview(memory), dtype=array.dtype).reshape(array.shape)
        entries = self._entries
        entries[key] = (weakref.ref(tensor, functools.partial(self._drop, key)),
                        _signature(tensor), view)
        with contextlib.suppress(KeyError):  # each step is atomic; another thread may
            entries.move_to_end(key)         # evict or drop meanwhile, which is harmless
            while len(entries) > self.capacity:
                entries.popitem(last=False)

    def _drop(self, key: int, _: object = None) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is None:
            self._entries.pop(key, None)
