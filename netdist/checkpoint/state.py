"""PURE mapping between nested training state and flat tensors + plain values.

A training state is a tree of dicts, lists and tuples whose leaves are arrays
(replicated: every rank holds the same values), :class:`ShardedArray` (this rank's shard
of a larger tensor) or plain values (ints, floats, strings, NumPy scalars, RNGs, ...).

:func:`flatten_state` names every array by its path (``"optim.state.0.exp_avg"``) and
cuts the tree into *objects*: maximal sub-trees that hold no array (``"rng"``, ``"step"``,
``"optim.param_groups"``). Objects are compared across ranks at save time: equal ones are
stored once, differing ones per rank (see ``netdist.checkpoint.collective`` for the
world-size-change policy). :func:`unflatten_state` rebuilds the tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.checkpoint.metadata import decode_object, encode_object

__all__ = ["ShardedArray", "FlatState", "flatten_state", "unflatten_state", "SEPARATOR"]

SEPARATOR = "."


@dataclass(frozen=True, slots=True)
class ShardedArray:
    """This rank's shard of a tensor split along ``shard_dim`` over the group's ranks.

    Shards are contiguous and in rank order; sizes may be uneven (the full shape is the
    sum of every rank's extent along ``shard_dim``). On load, a ``ShardedArray`` in
    ``like`` is filled in place with the region it covers in the new layout.
    """

    data: np.ndarray
    shard_dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.data, np.ndarray):
            raise TypeError(f"ShardedArray.data must be an ndarray, got {type(self.data).__name__}")
        if not 0 <= self.shard_dim < max(self.data.ndim, 1) or self.data.ndim == 0:
            raise ValueError(f"shard_dim {self.shard_dim} is out of range for a "
                             f"{self.data.ndim}-d array")


@dataclass(frozen=True, slots=True)
class FlatState:
    """A flattened state: ``tensors`` by path, ``objects`` by path, and the skeleton."""

    tensors: dict[str, np.ndarray | ShardedArray]
    objects: dict[str, Any]
    skeleton: Any


def _is_leaf_tensor(value: Any) -> bool:
    return isinstance(value, (np.ndarray, ShardedArray))


def _holds_tensor(value: Any) -> bool:
    if _is_leaf_tensor(value):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def flatten_state(state: Any) -> FlatState:
    """Split ``state`` into named tensors, named objects and a JSON skeleton.

    Raises ``ValueError`` when two paths collide (``{"a.b": x, "a": {"b": y}}``).
    """
    tensors: dict[str, np.ndarray | ShardedArray] = {}
    objects: dict[str, Any] = {}
    seen: set[str] = set()

    def claim(path: str) -> str:
        if path in seen:
            raise ValueError(f"two entries of the state flatten to the same name {path!r}")
        seen.add(path)
        return path

    def walk(value: Any, path: str) -> Any:
        if _is_leaf_tensor(value):
            if not path:
                raise TypeError("the state must be a dict, list or tuple, not a bare array")
            node: dict[str, Any] = {"t": "tensor", "k": claim(path)}
            if isinstance(value, ShardedArray):
                node["dim"] = value.shard_dim
            tensors[path] = value
            return node
        if not _holds_tensor(value):
            objects[claim(path)] = value
            return {"t": "object", "k": path}
        if isinstance(value, dict):
            items = []
            for key, child in value.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(f"state dict keys must be str or int, got {key!r} at {path!r}")
                items.append([encode_object(key), walk(child, _join(path, str(key)))])
            return {"t": "dict", "items": items}
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {"t": kind, "items": [walk(child, _join(path, str(i)))
                                     for i, child in enumerate(value)]}

    skeleton = walk(state, "")
    return FlatState(tensors, objects, skeleton)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}{SEPARATOR}{key}" if prefix else key


def unflatten_state(skeleton: Any, tensors: Mapping[str, Any], objects: Mapping[str, Any]) -> Any:
    """Rebuild the tree described by ``skeleton`` from ``tensors`` and ``objects``."""
    kind = skeleton["t"]
    if kind == "tensor":
        return tensors[skeleton["k"]]
    if kind == "object":
        return objects[skeleton["k"]]
    if kind == "dict":
        return {decode_object(k): unflatten_state(child, tensors, objects)
                for k, child in skeleton["items"]}
    children = [unflatten_state(child, tensors, objects) for child in skeleton["items"]]
    return tuple(children) if kind == "tuple" else children
