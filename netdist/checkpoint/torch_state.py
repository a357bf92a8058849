"""Torch tensors, modules and optimizers in checkpoints.

Imported only once a torch object has been seen in a state (``netdist.checkpoint.state``
detects tensors through ``sys.modules`` without importing torch), or when a bfloat16
tensor has to be handed out without ``ml_dtypes``; importing netdist never imports torch.

- :func:`tensor_array`: a NumPy view of a CPU tensor's memory (no copy, also for
  non-contiguous tensors and bfloat16; ``netdist.tensors.as_array`` under the
  checkpoint's rules), which is what the checkpoint code writes from and reads into, so
  a load with ``like`` fills parameters and optimizer state in place;
- :func:`array_tensor`: the inverse, a tensor over a NumPy buffer (no copy);
- :func:`alias_key`: identifies tensors that are the same view of the same storage (tied
  weights), which are stored once and restored as one tensor;
- :func:`overlap_groups`: finds tensors that partly overlap in one storage (a tensor and
  a slice of it), which are stored once as one region with the others as views of it
  (:mod:`netdist.checkpoint.views`); :func:`torch_view` rebuilds such a view.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from netdist.checkpoint.dtypes import is_raw_bfloat16
from netdist.checkpoint.views import TensorView
from netdist.tensors import TensorRules, as_array

__all__ = ["tensor_array", "array_tensor", "alias_key", "OverlapGroup", "overlap_groups",
           "torch_view"]

_CHECKPOINT_RULES = TensorRules(
    off_cpu=("{what}: the tensor is on device {device}; checkpoints read and write CPU "
             "memory: pass tensor.cpu() (a copy) instead"),
    not_dense=("{what}: a {layout} tensor cannot be checkpointed; convert it to a dense "
               "tensor first"),
    dtypes=frozenset({
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
        torch.float32, torch.float64,
    }),
    bad_dtype=("{what}: torch dtype {dtype} cannot be stored in a checkpoint (safetensors "
               "codes exist for bool, (u)int8-64, float16, bfloat16, float32 and float64)"),
    no_view="{what}: cannot address the memory of this {kind} directly ({error})",
)
"""What a checkpoint takes: dense CPU tensors of a dtype with a safetensors code."""


def tensor_array(tensor: torch.Tensor, name: str) -> np.ndarray:
    """A NumPy array sharing ``tensor``'s memory (strides included, autograd detached):
    ``netdist.tensors.as_array`` under the checkpoint's rules.

    Raises an error naming ``name`` for a tensor a checkpoint cannot address directly:
    ``TensorDeviceError`` (a ``ValueError``) when it is not on the CPU (move it with
    ``.cpu()``, an explicit copy) or not strided (sparse, nested), ``TypeError`` for a
    dtype without a safetensors code (complex, float8, quantized).
    """
    return as_array(tensor, repr(name), rules=_CHECKPOINT_RULES)


def array_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array``'s buffer (no copy); bfloat16 arrays (NumPy ``ml_dtypes``
    or the raw stand-in) become ``torch.bfloat16`` tensors."""
    if array.dtype.name == "bfloat16" or is_raw_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def alias_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Equal for two tensors that are the same view of the same memory (tied weights:
    ``state_dict()`` returns one detached view per name); None for tensors that hold no
    element, which may share a null pointer without being related."""
    if tensor.numel() == 0 or tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return None
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


@dataclass(frozen=True, slots=True)
class OverlapGroup:
    """Tensors that overlap in one storage, stored as one tensor.

    ``base`` names the stored tensor and ``stored`` is it: one of the group's tensors
    when that one covers the whole region C-contiguously (``region`` false: it is stored
    as itself, under its own path), else a 1-d tensor over the region (``region`` true)
    under a name of its own. ``views`` gives every other path's window into it.
    """

    base: str
    stored: torch.Tensor
    region: bool
    views: dict[str, TensorView]


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` of the storage elements ``tensor`` touches."""
    start = int(tensor.storage_offset())
    return start, start + 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))


Member = tuple[int, int, str, torch.Tensor]
"""``(first element, one past the last, path, tensor)``."""


def overlap_groups(tensors: Mapping[str, Any],
                   region_name: Callable[[str], str]) -> list[OverlapGroup]:
    """Group the torch tensors of ``tensors`` (path -> tensor; other values are skipped)
    whose memory ranges intersect within one storage and one dtype.

    A group is kept only when storing its region once takes no more bytes than storing
    each of its tensors (``w`` and ``w[2:5]``, ``s[0:6]`` and ``s[4:10]``: yes; two
    columns ``w[:, 0]`` and ``w[:, 1]`` of a large ``w``, whose ranges interleave: no,
    they stay separate tensors). Tensors that hold no element, are not on the CPU, are
    not strided, or are in different storages are never grouped (memory shared across
    storages, e.g. two ``from_numpy`` views of one array, is not detected). Identical
    views (tied weights) must already be folded by :func:`alias_key`.
    ``region_name(first path)`` names a region that no tensor of the group covers.
    Groups come in the order of their first path in ``tensors``.
    """
    by_storage: dict[tuple[int, torch.dtype], list[Member]] = {}
    for path, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            continue
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
            continue
        start, stop = _span(tensor)
        key = (tensor.untyped_storage().data_ptr(), tensor.dtype)
        by_storage.setdefault(key, []).append((start, stop, path, tensor))
    order = {path: i for i, path in enumerate(tensors)}
    clusters: list[list[Member]] = []
    for members in by_storage.values():
        members.sort(key=lambda m: (m[0], -m[1], order[m[2]]))
        stop = -1
        run: list[Member] = []
        for member in members:
            if run and member[0] < stop:
                run.append(member)
                stop = max(stop, member[1])
                continue
            if len(run) > 1:
                clusters.append(run)
            run, stop = [member], member[1]
        if len(run) > 1:
            clusters.append(run)
    clusters.sort(key=lambda c: min(order[m[2]] for m in c))
    groups = [_group(cluster, order, region_name) for cluster in clusters]
    return [group for group in groups if group is not None]


def _group(cluster: list[Member], order: Mapping[str, int],
           region_name: Callable[[str], str]) -> OverlapGroup | None:
    start = min(m[0] for m in cluster)
    stop = max(m[1] for m in cluster)
    if stop - start > sum(m[3].numel() for m in cluster):
        return None  # the region holds more than the tensors: store them separately
    cluster = sorted(cluster, key=lambda m: order[m[2]])
    covering = [m for m in cluster if m[0] == start and m[1] == stop
                and m[3].numel() == stop - start and m[3].is_contiguous()]
    if covering:
        base, stored, region = covering[0][2], covering[0][3], False
    else:
        base, region = region_name(cluster[0][2]), True
        stored = cluster[0][3].detach().as_strided((stop - start,), (1,), start)
    views = {path: TensorView(base, int(tensor.storage_offset()) - start, tuple(tensor.shape),
                              tuple(tensor.stride()))
             for _, _, path, tensor in cluster if path != base}
    return OverlapGroup(base, stored, region, views)


def torch_view(base: torch.Tensor, view: TensorView) -> torch.Tensor:
    """The view as a tensor sharing ``base``'s storage (``base`` contiguous)."""
    if not base.is_contiguous():
        raise ValueError("torch_view needs a contiguous base tensor")
    view.check(tuple(base.shape))
    return base.as_strided(view.shape, view.strides, base.storage_offset() + view.offset)
