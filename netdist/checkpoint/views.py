"""PURE views: a saved tensor that is a strided window into another saved tensor.

Torch tensors that partly overlap in memory (a weight ``w`` and a slice ``w[2:5]`` of it,
two overlapping windows ``s[0:6]`` and ``s[4:10]`` of one storage) are stored once: the
memory they cover together is one stored tensor, and each of them is a *view* of it, a
skeleton node (``docs/PROTOCOL.md``, "State layout")::

    {"t": "view", "k": "<stored tensor>", "offset": o, "shape": [...], "strides": [...]}

``offset`` and ``strides`` count elements of the stored tensor in its flat C order, as
torch's ``as_strided`` does, so element ``(i, j, ...)`` of the view is element ``offset +
i * strides[0] + j * strides[1] + ...`` of the stored tensor. The stored tensor is either
one of the overlapping tensors (the one covering the whole region, C-contiguous: it keeps
its own name and shape) or, when none does, the region itself as a 1-d tensor under a
name of its own (``<first path>#storage``). Views only ever point into replicated
tensors, which every loader reads whole, so resharding and the per-block CRC checks are
those of the stored tensor.

This module holds the node codec, its validation against the stored tensor's shape
(a view that reaches past the end is ``ValueError``, which a metadata parse reports as
corrupt), and the NumPy side of restoring one (:func:`numpy_view`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["VIEW_NODE", "TensorView", "numpy_view", "same_memory"]

VIEW_NODE = "view"
"""The ``"t"`` of a view node in a state skeleton."""


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"view {what} must be a list of ints, got {value!r:.60}")
    out = []
    for item in value:
        if not isinstance(item, (int, np.integer)) or isinstance(item, bool) or item < 0:
            raise ValueError(f"view {what} must hold ints >= 0, got {value!r:.80}")
        out.append(int(item))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class TensorView:
    """``shape``/``strides`` elements starting at element ``offset`` of stored tensor ``base``."""

    base: str
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.base, str) or not self.base:
            raise TypeError(f"a view's stored tensor must be a non-empty name, got "
                            f"{self.base!r:.60}")
        (offset,) = _int_list([self.offset], "offset")
        shape = _int_list(self.shape, "shape")
        strides = _int_list(self.strides, "strides")
        if len(strides) != len(shape):
            raise ValueError(f"view of {self.base!r}: {len(shape)}-d shape with "
                             f"{len(strides)} strides")
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "strides", strides)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def end(self) -> int:
        """One past the last element of the stored tensor the view touches (``offset``
        for a view holding no element), counted exactly in Python ints."""
        if self.numel == 0:
            return self.offset
        return self.offset + 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides))

    def check(self, base_shape: Sequence[int]) -> None:
        """``ValueError`` unless the view lies inside a stored tensor of ``base_shape``."""
        size = math.prod(base_shape)
        if self.offset > size or self.end() > size:
            raise ValueError(f"a view of {self.base!r} reaches element {self.end()}, "
                             f"past its {size} elements")

    def to_node(self, torch: bool) -> dict[str, Any]:
        node: dict[str, Any] = {"t": VIEW_NODE, "k": self.base, "offset": self.offset,
                                "shape": list(self.shape), "strides": list(self.strides)}
        if torch:
            node["torch"] = True
        return node

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> TensorView:
        """Parse a view node (``TypeError``/``ValueError``/``KeyError`` when malformed)."""
        return cls(node["k"], node["offset"], _int_list(node["shape"], "shape"),
                   _int_list(node["strides"], "strides"))


def numpy_view(base: np.ndarray, view: TensorView) -> np.ndarray:
    """The view as a NumPy array over ``base``'s memory (``base`` C-contiguous)."""
    if not base.flags.c_contiguous:
        raise ValueError("numpy_view needs a C-contiguous base array")
    view.check(base.shape)
    flat = base.reshape(-1)[view.offset:]
    itemsize = base.dtype.itemsize
    return np.lib.stride_tricks.as_strided(
        flat, view.shape, tuple(s * itemsize for s in view.strides),
        writeable=bool(base.flags.writeable))


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """True when ``a`` and ``b`` are the same window of the same memory (nothing to copy)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.strides == b.strides and a.shape == b.shape and a.dtype == b.dtype)
