"""PURE: arrays or torch tensors at the boundary of FSDP and the pipeline.

FSDP and the pipeline keep NumPy arrays inside (flat buffers, wire payloads) and hand
their layers, and their callers, what those work with. Two kinds exist: NumPy arrays, and
CPU torch tensors viewed zero-copy through ``netdist.tensors``. A model whose parameters
hold tensors (``p.data`` a ``torch.Tensor``: layers that compute with torch under the
Module API) is given tensors; a NumPy model is given arrays. These helpers convert
between the kinds without copying, and never import torch themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from netdist.tensors import as_array, is_tensor, to_tensor

__all__ = ["array_of", "tensor_of", "holds_tensors"]


def array_of(obj: Any, what: str) -> Any:
    """``obj`` as NumPy sees it: a tensor as a view of its memory (``netdist.tensors``:
    ``ValueError`` off the CPU), anything else unchanged."""
    return as_array(obj, what) if is_tensor(obj) else obj


def tensor_of(obj: Any, what: str) -> Any:
    """``obj`` as a tensor: a CPU tensor unchanged (one off the CPU or not dense is a
    ``ValueError`` naming ``what``, as ``netdist.tensors`` reports it), an array wrapped
    without a copy (a read-only array, which torch cannot wrap, is copied first)."""
    if is_tensor(obj):
        as_array(obj, what)  # checks device, layout and dtype; the tensor goes on as is
        return obj
    array = np.asarray(obj)
    return to_tensor(array if array.flags.writeable else array.copy())


def holds_tensors(params: Iterable[Any], what: str) -> bool:
    """True if every parameter's ``data`` is a torch tensor, False if none is (or there
    are no parameters); ``TypeError`` naming ``what`` for a mix."""
    kinds = {is_tensor(getattr(p, "data", None)) for p in params}
    if len(kinds) > 1:
        raise TypeError(f"{what} mixes parameters holding torch tensors and NumPy arrays; "
                        "use one kind")
    return kinds == {True}
