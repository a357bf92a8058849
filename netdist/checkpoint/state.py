"""PURE mapping between nested training state and flat tensors + plain values.

A training state is a tree of dicts, lists and tuples whose leaves are tensors -
NumPy arrays and torch tensors (replicated: every rank holds the same values),
:class:`ShardedArray` (this rank's shard of a larger tensor, along one dim or placed on a
device mesh) or torch ``DTensor`` (taken as the ``ShardedArray`` of its local tensor and
placements, :mod:`netdist.checkpoint.dtensor`) - or plain values (ints,
floats, strings, None, NumPy scalars, RNGs, ...). A *stateful* object (anything with
``state_dict()`` and ``load_state_dict()``: a torch module or optimizer, an LR scheduler,
:class:`netdist.checkpoint.RNGState`) stands for its ``state_dict()``.

:func:`flatten_state` names every tensor by its path (``"optim.state.0.exp_avg"``) and
cuts the tree into *objects*: maximal sub-trees that hold no tensor (``"rng"``,
``"step"``, ``"optim.param_groups"``). Objects are compared across ranks at save time:
equal ones are stored once, differing ones per rank (see ``netdist.checkpoint.collective``
for the world-size-change policy). :func:`unflatten_state` rebuilds the tree.

Torch tensors are recognised without importing torch (a tensor can only exist once torch
is in ``sys.modules``); their skeleton node carries ``"torch": true`` so that a load
without ``like`` hands back torch tensors. Torch tensors that are the same view of the
same memory (tied weights: ``state_dict()`` gives each name its own detached view) are
one tensor: the first name holds it, later names are aliases whose skeleton node names
the first (``{"t": "tensor", "k": "<first name>"}``), so it is stored once and a load
rebuilds one tensor under both names. Torch tensors that partly overlap in one storage
(a tensor and a slice of it) are stored once too: the region they cover is one stored
tensor and the others become *view* nodes into it (:mod:`netdist.checkpoint.views`),
which a load turns back into views of one storage. NumPy arrays are never merged this
way.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netdist.checkpoint.metadata import StateLayout, decode_json_value, encode_json_value
from netdist.sharding import MeshPlacement, MeshPosition, MeshSharding
from netdist.checkpoint.views import VIEW_NODE, TensorView
from netdist.errors import CheckpointCorruptError, CheckpointMismatchError

__all__ = [
    "ShardedArray",
    "FlatState",
    "StatefulSlot",
    "flatten_state",
    "unflatten_state",
    "skeleton_tensors",
    "skeleton_subtree",
    "subtree_objects",
    "is_torch_tensor",
    "is_dtensor",
    "mesh_position",
    "leaf_array",
    "is_stateful",
    "state_summary",
    "merge_summaries",
    "SEPARATOR",
]

SEPARATOR = "."


def is_torch_tensor(value: Any) -> bool:
    """True for a ``torch.Tensor`` (``Parameter`` included), without importing torch."""
    torch = sys.modules.get("torch")
    tensor_type = getattr(torch, "Tensor", None)
    return isinstance(tensor_type, type) and isinstance(value, tensor_type)


def is_dtensor(value: Any) -> bool:
    """True for a torch ``DTensor``, without importing torch."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor_type = getattr(module, "DTensor", None)
    return isinstance(dtensor_type, type) and isinstance(value, dtensor_type)


def mesh_position(mesh: Any) -> MeshPosition:
    """``mesh`` as a :class:`MeshPosition`: one already, or an object (a netdist
    ``DeviceMesh``) whose ``position`` is one; ``TypeError`` otherwise."""
    if isinstance(mesh, MeshPosition):
        return mesh
    position = getattr(mesh, "position", None)
    if isinstance(position, MeshPosition):
        return position
    raise TypeError(f"mesh must be a MeshPosition or have a .position that is one (a "
                    f"DeviceMesh), got {type(mesh).__name__}")


def leaf_array(value: Any, name: str) -> np.ndarray:
    """The NumPy array a tensor leaf is written from or read into (a torch tensor's own
    memory, never a copy)."""
    if isinstance(value, np.ndarray):
        return value
    if is_torch_tensor(value):
        from netdist.checkpoint.torch_state import tensor_array

        return tensor_array(value, name)
    try:
        array = np.asarray(value)
    except Exception as exc:
        raise TypeError(f"{name!r}: cannot view {type(value).__name__} as an array") from exc
    if array.dtype == object:
        raise TypeError(f"{name!r}: {type(value).__name__} is not an array")
    return array


@dataclass(frozen=True, slots=True)
class ShardedArray:
    """This rank's piece of a larger tensor: split along ``shard_dim`` over the group's
    ranks, or placed on a device mesh.

    ``data`` is a NumPy array or a CPU torch tensor. Along one dim (``ShardedArray(data,
    shard_dim)``), shards are contiguous and in rank order; sizes may be uneven (the full
    shape is the sum of every rank's extent along ``shard_dim``). On a mesh
    (``ShardedArray(data, placements=(Replicate(), Shard(0)), mesh=position)``: one
    ``Shard(dim)`` / ``Replicate()`` per mesh dim, ``mesh`` a
    :class:`~netdist.sharding.MeshPosition` or a ``DeviceMesh`` whose ``position`` is
    one, stored as the position; ``shard_dim`` is then None), ``data`` is the piece this
    rank's mesh coordinate holds (:class:`~netdist.sharding.MeshSharding`); the mesh rank
    must be the rank in the group that saves or loads. On load, a ``ShardedArray`` in
    ``like`` is filled in place with the region it covers in the new layout.
    """

    data: Any
    shard_dim: int | None = 0
    placements: tuple[MeshPlacement, ...] | None = None
    mesh: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.data, np.ndarray) and not is_torch_tensor(self.data):
            raise TypeError(f"ShardedArray.data must be an ndarray or a torch tensor, got "
                            f"{type(self.data).__name__}")
        ndim = self.data.ndim
        if self.placements is None and self.mesh is None:
            if (not isinstance(self.shard_dim, (int, np.integer))
                    or not 0 <= self.shard_dim < max(ndim, 1) or ndim == 0):
                raise ValueError(f"shard_dim {self.shard_dim} is out of range for a "
                                 f"{ndim}-d array")
            return
        if self.placements is None or self.mesh is None:
            raise ValueError("a ShardedArray on a mesh needs both placements= and mesh=")
        if self.shard_dim not in (0, None):
            raise ValueError(f"a ShardedArray on a mesh takes its dims from its placements, "
                             f"not shard_dim={self.shard_dim}")
        position = mesh_position(self.mesh)
        placements = tuple(self.placements)
        # checks the placements (one per mesh dim, Shard or Replicate, dims of data)
        MeshSharding.even(tuple(self.data.shape), position.shape, placements)
        object.__setattr__(self, "shard_dim", None)
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "mesh", position)

    @property
    def on_mesh(self) -> bool:
        """True for a piece placed on a mesh (``placements`` and ``mesh`` given)."""
        return self.placements is not None


def is_stateful(value: Any) -> bool:
    """True for an object saved through ``state_dict()`` and restored through
    ``load_state_dict()`` (torch modules, optimizers, schedulers, ``RNGState``)."""
    if isinstance(value, (dict, list, tuple, np.ndarray, ShardedArray, type)):
        return False
    if is_torch_tensor(value):
        return False
    return (callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None)))


@dataclass(frozen=True, slots=True)
class StatefulSlot:
    """A stateful object met while flattening ``like`` for a load: where it sits (its
    path and the keys leading to it) and the object itself."""

    path: str
    keys: tuple[Any, ...]
    obj: Any


@dataclass(frozen=True, slots=True)
class FlatState:
    """A flattened state: ``tensors`` by name, ``objects`` by path, and the skeleton.

    ``aliases`` maps the path of every later name of a tied tensor to the name holding
    it; ``views`` maps the path of every tensor stored as a window into another stored
    tensor (partial overlap, ``merge_views``) to that window; ``statefuls`` lists the
    stateful objects left unexpanded (``keep_statefuls``); ``dtensors`` maps the path of
    every torch ``DTensor`` (a :class:`ShardedArray` of its local tensor in ``tensors``)
    to the ``DTensor`` itself, which is what a rebuilt ``like`` holds there.
    """

    tensors: dict[str, Any]
    objects: dict[str, Any]
    skeleton: Any
    aliases: dict[str, str] = field(default_factory=dict)
    statefuls: list[StatefulSlot] = field(default_factory=list)
    views: dict[str, TensorView] = field(default_factory=dict)
    dtensors: dict[str, Any] = field(default_factory=dict)

    def leaves(self) -> dict[str, Any]:
        """``tensors`` with each ``DTensor`` in place of its ``ShardedArray``: the leaves
        as the state held them."""
        return {**self.tensors, **self.dtensors} if self.dtensors else self.tensors


def _is_leaf_tensor(value: Any) -> bool:
    return isinstance(value, (np.ndarray, ShardedArray)) or is_torch_tensor(value)


def _holds_tensor(value: Any) -> bool:
    if _is_leaf_tensor(value) or isinstance(value, StatefulSlot):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _expand(value: Any, keys: tuple[Any, ...], path: str, keep: bool) -> Any:
    """Replace every stateful by its ``state_dict()`` (or, with ``keep``, by a
    :class:`StatefulSlot`), rebuilding only the containers above one."""
    if is_stateful(value):
        if keep:
            return StatefulSlot(path, keys, value)
        return _expand(value.state_dict(), keys, path, keep)
    if isinstance(value, dict):
        out = {k: _expand(v, (*keys, k), _join(path, str(k)), keep) for k, v in value.items()}
        return out if any(out[k] is not value[k] for k in value) else value
    if isinstance(value, (list, tuple)) and not isinstance(value, ShardedArray):
        items = [_expand(v, (*keys, i), _join(path, str(i)), keep) for i, v in enumerate(value)]
        if all(a is b for a, b in zip(items, value)):
            return value
        return tuple(items) if isinstance(value, tuple) else items
    return value


def flatten_state(state: Any, *, keep_statefuls: bool = False, prefix: str = "",
                  merge_views: bool = True) -> FlatState:
    """Split ``state`` into named tensors, named objects and a JSON skeleton.

    Stateful objects are replaced by their ``state_dict()``; with ``keep_statefuls`` they
    are left whole instead (skeleton node ``{"t": "stateful", "k": path}``) and listed in
    ``statefuls`` (a load restores them through ``load_state_dict``). ``prefix`` names
    the position of ``state`` in a larger tree. Raises ``ValueError`` when two paths
    collide (``{"a.b": x, "a": {"b": y}}``). ``merge_views`` (what a save wants) stores
    torch tensors that partly overlap once (module docstring); a load flattens ``like``
    without it, so that every path of ``like`` keeps its own destination.
    """
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    dtensors: dict[str, Any] = {}
    statefuls: list[StatefulSlot] = []
    seen: set[str] = set()
    owners: dict[tuple[Any, ...], str] = {}
    nodes: dict[str, dict[str, Any]] = {}

    def claim(path: str) -> str:
        if path in seen:
            raise ValueError(f"two entries of the state flatten to the same name {path!r}")
        seen.add(path)
        return path

    def tensor_node(value: Any, path: str) -> dict[str, Any]:
        if not path:
            raise TypeError("the state must be a dict, list or tuple, not a bare array")
        claim(path)
        data = value.data if isinstance(value, ShardedArray) else value
        node: dict[str, Any] = {"t": "tensor", "k": path}
        nodes[path] = node
        if is_torch_tensor(data):
            node["torch"] = True
            if not isinstance(value, ShardedArray):
                from netdist.checkpoint.torch_state import alias_key

                key = alias_key(data)
                if key is not None and key in owners:
                    node["k"] = aliases[path] = owners[key]
                    return node
                if key is not None:
                    owners[key] = path
        if isinstance(value, ShardedArray) and value.shard_dim is not None:
            node["dim"] = value.shard_dim
        tensors[path] = value
        return node

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, StatefulSlot):
            claim(path)
            statefuls.append(value)
            return {"t": "stateful", "k": path}
        if is_dtensor(value):
            from netdist.checkpoint.dtensor import dtensor_piece

            dtensors[path] = value
            return tensor_node(dtensor_piece(value, path), path)
        if _is_leaf_tensor(value):
            return tensor_node(value, path)
        if not _holds_tensor(value):
            objects[claim(path)] = value
            return {"t": "object", "k": path}
        if isinstance(value, dict):
            items = []
            for key, child in value.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(f"state dict keys must be str or int, got {key!r} at {path!r}")
                items.append([encode_json_value(key), walk(child, _join(path, str(key)))])
            return {"t": "dict", "items": items}
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {"t": kind, "items": [walk(child, _join(path, str(i)))
                                     for i, child in enumerate(value)]}

    expanded = _expand(state, (), prefix, keep_statefuls)
    skeleton = walk(expanded, prefix)
    views: dict[str, TensorView] = {}
    if merge_views and any(is_torch_tensor(v) for v in tensors.values()):
        tensors = _merge_views(tensors, nodes, aliases, views, seen)
    return FlatState(tensors, objects, skeleton, aliases, statefuls, views, dtensors)


def _merge_views(tensors: dict[str, Any], nodes: Mapping[str, dict[str, Any]],
                 aliases: dict[str, str], views: dict[str, TensorView],
                 seen: set[str]) -> dict[str, Any]:
    """Fold torch tensors that partly overlap into one stored tensor each (their nodes
    become view nodes, in place); return the new ``tensors``, in the old order with a
    region taking the place of its first path."""
    from netdist.checkpoint.torch_state import overlap_groups

    taken = set(seen)

    def region_name(first: str) -> str:
        name, n = f"{first}#storage", 1
        while name in taken:
            n += 1
            name = f"{first}#storage{n}"
        taken.add(name)
        return name

    regions: dict[str, tuple[str, Any]] = {}
    for group in overlap_groups(tensors, region_name):
        if group.region:  # stored where its first path was (views are in path order)
            regions[next(iter(group.views))] = (group.base, group.stored)
        views.update(group.views)
    if not views:
        return tensors
    for alias, owner in list(aliases.items()):
        if owner in views:
            views[alias] = views[owner]
            del aliases[alias]
    for path, view in views.items():
        node = nodes[path]
        torch = bool(node.get("torch"))
        node.clear()
        node.update(view.to_node(torch))
    merged: dict[str, Any] = {}
    for path, value in tensors.items():
        if path in regions:
            name, stored = regions[path]
            merged[name] = stored
        if path not in views:
            merged[path] = value
    return merged


def _join(prefix: str, key: str) -> str:
    return f"{prefix}{SEPARATOR}{key}" if prefix else key


def unflatten_state(skeleton: Any, tensors: Mapping[str, Any], objects: Mapping[str, Any],
                    statefuls: Mapping[str, Any] | None = None,
                    views: Mapping[str, Any] | None = None, prefix: str = "") -> Any:
    """Rebuild the tree described by ``skeleton`` from ``tensors`` and ``objects`` (and,
    for ``stateful`` nodes, ``statefuls`` by path; for view nodes, ``views`` by path, the
    path of ``skeleton`` itself being ``prefix``). Aliases of one tensor come back as
    the same object."""
    kind = skeleton["t"]
    if kind == "tensor":
        return tensors[skeleton["k"]]
    if kind == VIEW_NODE:
        if views is None or prefix not in views:
            raise CheckpointCorruptError(f"no tensor was rebuilt for the view {prefix!r}")
        return views[prefix]
    if kind == "object":
        return objects[skeleton["k"]]
    if kind == "stateful":
        return (statefuls or {})[skeleton["k"]]
    if kind == "dict":
        out = {}
        for k, child in skeleton["items"]:
            key = decode_json_value(k)
            out[key] = unflatten_state(child, tensors, objects, statefuls, views,
                                       _join(prefix, str(key)))
        return out
    children = [unflatten_state(child, tensors, objects, statefuls, views,
                                _join(prefix, str(i)))
                for i, child in enumerate(skeleton["items"])]
    return tuple(children) if kind == "tuple" else children


def skeleton_tensors(skeleton: Any, prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """``(path, node)`` of every tensor node of a skeleton, aliases (their node's ``"k"``
    names the tensor holding the data) and view nodes (``"t": "view"``, a window into
    the tensor ``"k"`` names) included, in the order of the tree."""
    stack: list[tuple[Any, str]] = [(skeleton, prefix)]
    while stack:
        node, path = stack.pop()
        kind = node["t"]
        if kind in ("tensor", VIEW_NODE):
            yield path, node
        elif kind == "dict":
            stack.extend((child, _join(path, str(decode_json_value(key))))
                         for key, child in reversed(node["items"]))
        elif kind in ("list", "tuple"):
            stack.extend((child, _join(path, str(i)))
                         for i, child in reversed(list(enumerate(node["items"]))))


def skeleton_subtree(skeleton: Any, keys: tuple[Any, ...]) -> Any | None:
    """The node reached from ``skeleton`` by following ``keys`` (dict keys, list
    indices), or None when the saved structure has nothing there."""
    node = skeleton
    for key in keys:
        kind = node.get("t")
        if kind == "dict":
            for item_key, child in node["items"]:
                decoded = decode_json_value(item_key)
                if decoded == key and type(decoded) is type(key):
                    node = child
                    break
            else:
                return None
        elif kind in ("list", "tuple") and isinstance(key, int):
            if not 0 <= key < len(node["items"]):
                return None
            node = node["items"][key]
        else:
            return None
    return node


def subtree_objects(skeleton: Any) -> Iterator[str]:
    """Paths of the object nodes below ``skeleton``."""
    stack = [skeleton]
    while stack:
        node = stack.pop()
        kind = node["t"]
        if kind == "object":
            yield node["k"]
        elif kind == "dict":
            stack.extend(child for _, child in node["items"])
        elif kind in ("list", "tuple"):
            stack.extend(node["items"])


def state_summary(flat: FlatState) -> dict[str, Any]:
    """What a rank tells the others (or the committing rank) about its plain values:
    the skeleton and every object as canonical JSON text (compared as text)."""
    return {"skeleton": flat.skeleton,
            "objects": {key: json.dumps(encode_json_value(value), allow_nan=False)
                        for key, value in flat.objects.items()}}


def merge_summaries(summaries: Sequence[Mapping[str, Any]]) -> StateLayout:
    """Every rank's :func:`state_summary` -> the state layout: values equal on every rank
    are stored once, differing ones per rank. ``CheckpointMismatchError`` when the ranks'
    trees differ in structure."""
    first = summaries[0]
    for rank, summary in enumerate(summaries[1:], start=1):
        if summary["skeleton"] != first["skeleton"]:
            raise CheckpointMismatchError(f"rank {rank}'s state has a different structure "
                                          f"from rank 0's (keys, nesting or leaf kinds)")
    objects: dict[str, Any] = {}
    rank_objects: dict[str, tuple[Any, ...]] = {}
    for key, text in first["objects"].items():
        texts = [s["objects"][key] for s in summaries]
        if all(t == text for t in texts):
            objects[key] = decode_json_value(json.loads(text))
        else:
            rank_objects[key] = tuple(decode_json_value(json.loads(t)) for t in texts)
    return StateLayout(first["skeleton"], objects, rank_objects)
