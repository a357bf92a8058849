"""Where a load puts each saved tensor and value, and how it rebuilds the result.

Shared by the collective ``load`` and the per-rank ``load_distributed(like=...)``:
:func:`plan_restore` turns a checkpoint's metadata and the caller's ``like`` (or none)
into the boxes to read, the arrays to read them into, and a ``finish`` step that builds
the result once the bytes are in. No I/O happens here.

With ``like``:

- every tensor leaf (NumPy array, torch tensor, ``ShardedArray``) is filled **in place**:
  a torch tensor through a NumPy view of its memory, so a model's ``state_dict()`` views
  restore its parameters directly;
- a *stateful* object (``state_dict()`` + ``load_state_dict()``: a module, an optimizer,
  ``RNGState``) receives the **saved** sub-tree at its position: the tensors its current
  ``state_dict()`` already holds (same path, dtype and shape) are filled in place, the ones
  it lacks (an optimizer's lazily created momentum buffers, ``exp_avg``, ``step``) are
  created, and the whole sub-tree is handed to its ``load_state_dict()`` after reading
  (``strict`` is passed on to modules);
- tied tensors come back tied: names the checkpoint stores once are read once, and a
  rebuilt sub-tree holds one tensor under every name;
- a tensor saved as a view (a window into a tensor stored once for several partly
  overlapping ones, :mod:`netdist.checkpoint.views`) is copied out of the stored tensor
  after reading, which is nothing to do when ``like`` holds it as that same window of
  the stored tensor's destination (a model whose slice is a view of its weight: the
  weight is read in place and the slice, sharing its memory, with it).

A ``ShardedArray`` on a mesh in ``like`` (a torch ``DTensor`` too: its local tensor) is
filled with the piece its placements give its rank on the *new* mesh
(PURE :mod:`netdist.checkpoint.regions` says which region each leaf receives). Any saved
placement reads into any other: the pieces that overlap the wanted region are read,
nothing else.

Without ``like`` the saved tree is rebuilt with fresh arrays; leaves that were torch
tensors come back as torch tensors (when torch is importable), views as views of their
stored tensor's fresh array (sharing its memory, as they did), and bfloat16 without
``ml_dtypes`` comes back as ``torch.bfloat16`` or, without torch either, as a clear
``CheckpointMismatchError`` raised before any byte is read. A mesh-placed tensor comes
back, at the world size that saved it, as this rank's saved piece in a ``ShardedArray``
on the saved mesh (its placements, a ``MeshPosition`` with this rank's coordinate; a
``DTensor`` cannot be rebuilt without torch's device mesh); at another world size as a
``ShardedArray`` split evenly along the first dim its placements shard (replicated when
they shard none).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netdist.checkpoint.dtypes import (
    CHECKPOINT_DTYPES,
    dtype_name,
    is_raw_bfloat16,
    unrepresentable,
)
from netdist.checkpoint.metadata import ShardMetadata, StateLayout, TensorShardSpec
from netdist.checkpoint.options import LOAD_RANK_OBJECTS, RankObjects, parse_option
from netdist.checkpoint.planner import Box, box_shape
from netdist.checkpoint.state import (
    SEPARATOR,
    ShardedArray,
    flatten_state,
    is_torch_tensor,
    leaf_array,
    skeleton_subtree,
    skeleton_tensors,
    subtree_objects,
    unflatten_state,
)
from netdist.checkpoint.regions import Extent, full_box, like_region
from netdist.checkpoint.views import VIEW_NODE, TensorView, numpy_view, same_memory
from netdist.errors import CheckpointCorruptError, CheckpointMismatchError
from netdist.sharding import MeshPosition, mesh_coordinate

Place = Callable[[str, str, Any], tuple[Box, np.ndarray]]
"""``place(name, path, leaf)``: the box of saved tensor ``name`` that ``like``'s leaf at
``path`` receives, and the array it is read into."""

__all__ = [
    "RANK_OBJECT_POLICIES",
    "check_rank_objects",
    "RestorePlan",
    "plan_restore",
    "check_destination",
    "apply_state",
    "full_box",
    "pick_object",
    "per_rank_error",
    "view_leaf",
]


RANK_OBJECT_POLICIES: tuple[str, ...] = tuple(p.value for p in LOAD_RANK_OBJECTS)
"""The string spellings of the :class:`RankObjects` policies a load accepts."""


def check_rank_objects(policy: RankObjects | str, where: str = "load") -> RankObjects:
    """``policy`` as a :class:`RankObjects` a load accepts; ``ConfigError`` (a
    ``ValueError``) naming ``where`` and the allowed values otherwise."""
    return parse_option(policy, RankObjects, "rank_objects", where, LOAD_RANK_OBJECTS)


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What one rank reads (``wanted`` box of each tensor, into ``dests``), the extra
    destinations that receive a copy of a tensor read once (``copies``) or of a view
    into one (``view_copies``), and ``finish``, which builds the result after reading."""

    wanted: dict[str, Box]
    dests: dict[str, np.ndarray]
    copies: list[tuple[str, np.ndarray]]
    finish: Callable[[], Any]
    view_copies: list[tuple[TensorView, np.ndarray]] = field(default_factory=list)

    def complete(self) -> Any:
        """Copy tied destinations and views, then build the result (calls
        ``load_state_dict``)."""
        for name, dest in self.copies:
            np.copyto(dest, self.dests[name])
        for view, dest in self.view_copies:
            source = numpy_view(np.ascontiguousarray(self.dests[view.base]), view)
            if not same_memory(source, dest):  # a view of the destination already
                np.copyto(dest, source)
        return self.finish()


def _dtype_text(dtype: np.dtype[Any]) -> str:
    try:
        return dtype_name(dtype)
    except TypeError:
        return str(dtype)


def check_destination(name: str, spec: TensorShardSpec, box: Box, dest: np.ndarray) -> None:
    """Raise ``CheckpointMismatchError`` unless ``dest`` can receive ``box`` of ``name``."""
    want_dtype = CHECKPOINT_DTYPES[spec.dtype] if spec.dtype is not None else None
    if want_dtype is not None and dest.dtype != want_dtype:
        raise CheckpointMismatchError(
            f"tensor {name!r}: checkpoint has dtype {spec.dtype}, target has "
            f"{_dtype_text(dest.dtype)}")
    if tuple(dest.shape) != box_shape(box):
        raise CheckpointMismatchError(
            f"tensor {name!r}: target shape {tuple(dest.shape)} does not match the "
            f"{box_shape(box)} region expected (full shape {spec.full_shape})")


def _is_module(obj: Any) -> bool:
    """True for a ``torch.nn.Module`` (without importing torch)."""
    torch = sys.modules.get("torch")
    module_type = getattr(getattr(torch, "nn", None), "Module", None)
    return isinstance(module_type, type) and isinstance(obj, module_type)


def apply_state(obj: Any, state: Any, current: Any, *, strict: bool, path: str) -> None:
    """Hand a restored sub-tree to ``obj.load_state_dict`` (``strict`` for torch modules).

    ``current`` is the ``state_dict()`` taken before loading; its ``_metadata`` (module
    versions, which modules read to migrate old state) is carried over.
    """
    if isinstance(state, dict) and hasattr(current, "_metadata"):
        state = OrderedDict(state)
        state._metadata = current._metadata  # type: ignore[attr-defined]
    load_state_dict: Callable[..., Any] = obj.load_state_dict
    try:
        if _is_module(obj):
            load_state_dict(state, strict=strict)
        else:
            load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointMismatchError(f"{path!r}: {type(obj).__name__}.load_state_dict "
                                      f"refused the saved state: {exc}") from exc


def per_rank_error(keys: list[str], num_ranks: int, world_size: int) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"values {', '.join(repr(k) for k in sorted(keys))} differed between the {num_ranks} "
        f"ranks that saved the checkpoint and cannot be mapped onto {world_size} ranks; "
        f"pass rank_objects='like' (keep the current value), 'modulo' or 'rank0'")


def pick_object(key: str, layout: StateLayout, rank: int, world_size: int, num_ranks: int,
                policy: RankObjects, like_objects: Mapping[str, Any] | None) -> Any:
    """The saved value of ``key`` for ``rank`` (per-rank values mapped by ``policy``)."""
    if key in layout.objects:
        return layout.objects[key]
    values = layout.rank_objects[key]
    if world_size == num_ranks:
        return values[rank]
    if policy is RankObjects.MODULO:
        return values[rank % num_ranks]
    if policy is RankObjects.RANK0:
        return values[0]
    if policy is RankObjects.LIKE and like_objects is not None and key in like_objects:
        return like_objects[key]
    raise per_rank_error([key], num_ranks, world_size)


def _restore_object(current: Any, loaded: Any) -> Any:
    """Generators in ``like`` are restored in place, so references to them stay valid."""
    if isinstance(current, np.random.Generator) and isinstance(loaded, np.random.Generator):
        if type(current.bit_generator) is type(loaded.bit_generator):
            current.bit_generator.state = loaded.bit_generator.state
            return current
    if isinstance(current, np.random.BitGenerator) and isinstance(loaded, np.random.BitGenerator):
        if type(current) is type(loaded):
            current.state = loaded.state
            return current
    return loaded


def _as_torch(array: np.ndarray) -> Any:
    """``array`` as a torch tensor (no copy) when torch is importable, else unchanged."""
    if not _torch_importable():
        return array
    from netdist.checkpoint.torch_state import array_tensor

    return array_tensor(array)


def _torch_importable() -> bool:
    try:
        import torch  # noqa: F401  (only when a load must hand out torch tensors)
    except ImportError:
        return False
    return True


def _under(key: str, prefixes: list[str]) -> bool:
    return any(key == p or key.startswith(p + SEPARATOR) for p in prefixes)


def view_leaf(leaf: Any, view: TensorView) -> Any:
    """``view`` of a restored stored tensor ``leaf``: a tensor or array sharing its memory
    (of a contiguous copy when ``leaf`` is not contiguous)."""
    if isinstance(leaf, ShardedArray):  # one that covers the whole tensor
        leaf = leaf.data
    if is_torch_tensor(leaf):
        from netdist.checkpoint.torch_state import torch_view

        return torch_view(leaf if leaf.is_contiguous() else leaf.contiguous(), view)
    return numpy_view(np.ascontiguousarray(leaf), view)


class _Targets:
    """Destinations by saved tensor name; a name claimed twice is read once and copied."""

    def __init__(self, specs: Mapping[str, TensorShardSpec]) -> None:
        self.specs = specs
        self.wanted: dict[str, Box] = {}
        self.dests: dict[str, np.ndarray] = {}
        self.copies: list[tuple[str, np.ndarray]] = []
        self.view_copies: list[tuple[TensorView, np.ndarray]] = []
        self.leaves: dict[str, Any] = {}

    def claim(self, name: str, box: Box, dest: np.ndarray, leaf: Any) -> None:
        check_destination(name, self.specs[name], box, dest)
        if name in self.wanted:
            if self.wanted[name] != box:
                raise CheckpointMismatchError(
                    f"tensor {name!r} is wanted as two different regions by `like`")
            if not same_memory(self.dests[name], dest):
                self.copies.append((name, dest))
            return
        self.wanted[name], self.dests[name] = box, dest
        self.leaves[name] = leaf

    def fresh(self, name: str, box: Box, as_torch: bool) -> Any:
        """Allocate a destination for ``box`` of ``name``; return the leaf handed out."""
        spec = self.specs[name]
        if spec.dtype is None:
            raise CheckpointCorruptError(f"tensor {name!r} has no dtype in the metadata")
        dtype = CHECKPOINT_DTYPES[spec.dtype]
        raw_bf16 = is_raw_bfloat16(dtype)
        if raw_bf16 and not _torch_importable():
            raise unrepresentable(name, spec.dtype)
        dest = np.empty(box_shape(box), dtype=dtype)
        leaf: Any = dest
        if as_torch or raw_bf16:
            leaf = _as_torch(dest)
        self.claim(name, box, dest, leaf)
        return leaf

    def base(self, view: TensorView, path: str, as_torch: bool) -> Any:
        """The leaf the stored tensor of ``view`` is read into whole (claimed fresh, as
        scratch, when nothing claimed it yet)."""
        box = full_box(self.specs[view.base].full_shape)
        if view.base not in self.wanted:
            return self.fresh(view.base, box, as_torch)
        if self.wanted[view.base] != box:
            raise CheckpointMismatchError(
                f"{path!r} is saved as a view of {view.base!r}, which `like` holds only "
                f"in part; hold {view.base!r} whole (not as a ShardedArray)")
        return self.leaves[view.base]

    def view_into(self, path: str, view: TensorView, value: Any) -> None:
        """Have ``like``'s tensor ``value`` at ``path`` receive the saved view ``view``."""
        if isinstance(value, ShardedArray):
            raise CheckpointMismatchError(
                f"{path!r} is saved as a view of {view.base!r}: `like` must hold it whole, "
                f"not as a ShardedArray")
        dest = leaf_array(value, path)
        spec = self.specs[view.base]
        if spec.dtype is not None and dest.dtype != CHECKPOINT_DTYPES[spec.dtype]:
            raise CheckpointMismatchError(
                f"tensor {path!r}: checkpoint has dtype {spec.dtype}, target has "
                f"{_dtype_text(dest.dtype)}")
        if tuple(dest.shape) != view.shape:
            raise CheckpointMismatchError(
                f"tensor {path!r}: target shape {tuple(dest.shape)} does not match the "
                f"saved {view.shape}")
        if not dest.flags.writeable:
            raise CheckpointMismatchError(f"{path!r}: `like` must hold writeable arrays")
        self.base(view, path, as_torch=False)
        self.view_copies.append((view, dest))


def _saved_paths(metadata: ShardMetadata) -> dict[str, dict[str, Any]]:
    """Every saved tensor path (aliases included) -> its skeleton node."""
    if metadata.state is None:
        return {name: {"t": "tensor", "k": name} for name in metadata.tensor_specs}
    return dict(skeleton_tensors(metadata.state.skeleton))


def _view(node: Mapping[str, Any]) -> TensorView | None:
    return TensorView.from_node(node) if node.get("t") == VIEW_NODE else None


def _torch_names(metadata: ShardMetadata) -> set[str]:
    if metadata.state is None:
        return set()
    return {node["k"] for _, node in skeleton_tensors(metadata.state.skeleton)
            if node.get("torch")}


def plan_restore(metadata: ShardMetadata, like: Any, rank: int, world_size: int, *,
                 strict: bool, rank_objects: RankObjects | str,
                 extents: Sequence[Mapping[str, Extent]] | None = None) -> RestorePlan:
    """Plan ``rank``'s share of a load at ``world_size`` (module docstring).

    ``extents`` (collective loads) holds every rank's :class:`ShardExtent` or
    :class:`MeshExtent` by path for the ``ShardedArray`` leaves of its ``like`` (stateful
    objects' included), which places each rank's shard; without it (per-rank loads) a
    ``ShardedArray`` must cover exactly this rank's part of the even re-split
    (``chunk_sizes``; on a mesh, netdist's or torch's even split). Raises
    ``CheckpointMismatchError`` for anything ``like`` cannot receive, before any byte
    is read.
    """
    policy = check_rank_objects(rank_objects)
    specs = metadata.tensor_specs
    layout = metadata.state
    targets = _Targets(specs)
    if (layout is not None and layout.rank_objects and world_size != metadata.num_ranks
            and policy in (RankObjects.ERROR, RankObjects.LIKE)):
        mapped: set[str] = set()
        if like is not None and policy is RankObjects.LIKE:
            mapped = set(flatten_state(like, merge_views=False).objects)
        unmapped = sorted(set(layout.rank_objects) - mapped)
        if unmapped:
            raise per_rank_error(unmapped, metadata.num_ranks, world_size)
    if like is None:
        return _plan_fresh(metadata, targets, rank, world_size, policy)

    def pick(key: str, like_objects: Mapping[str, Any] | None) -> Any:
        if layout is None:  # only keys of a saved layout are ever picked
            raise CheckpointCorruptError(f"the checkpoint records no value {key!r}")
        return pick_object(key, layout, rank, world_size, metadata.num_ranks, policy,
                           like_objects)

    flat = flatten_state(like, keep_statefuls=True, merge_views=False)
    saved = _saved_paths(metadata)
    stateful_paths = [slot.path for slot in flat.statefuls]

    def place(name: str, path: str, value: Any) -> tuple[Box, np.ndarray]:
        return like_region(name, path, specs[name], value, rank, world_size, extents)

    # 1. tensor leaves of `like` outside stateful objects: filled in place
    like_paths = [*flat.tensors, *flat.aliases]
    missing = sorted(p for p in like_paths if p not in saved)
    if missing:
        raise CheckpointMismatchError(f"the checkpoint has no tensors named {missing}")
    if strict:
        unexpected = sorted(p for p in saved if p not in flat.tensors
                            and p not in flat.aliases and not _under(p, stateful_paths))
        if unexpected:
            raise CheckpointMismatchError(
                f"the checkpoint has tensors that `like` lacks: {unexpected} (pass "
                f"strict=False to ignore them; to have an optimizer's state created, put "
                f"the optimizer itself in `like`, not its state_dict())")
    views: list[tuple[str, TensorView, Any]] = []
    for path in like_paths:
        value = flat.tensors[flat.aliases.get(path, path)]
        view = _view(saved[path])
        if view is not None:  # once every stored tensor has its destination
            views.append((path, view, value))
            continue
        name = saved[path]["k"]
        box, dest = place(name, path, value)
        targets.claim(name, box, dest, value)
    for path, view, value in views:
        targets.view_into(path, view, value)

    # 2. plain values outside stateful objects
    loaded_objects: dict[str, Any] = {}
    saved_keys = set() if layout is None else {*layout.objects, *layout.rank_objects}
    for key, current in flat.objects.items():
        if key in saved_keys:
            loaded_objects[key] = _restore_object(current, pick(key, flat.objects))
        elif strict and layout is not None:
            raise CheckpointMismatchError(f"the checkpoint holds no value for {key!r}")
        else:
            loaded_objects[key] = current
    if strict and layout is not None:
        unexpected = sorted(k for k in saved_keys - set(flat.objects)
                            if not _under(k, stateful_paths))
        if unexpected:
            raise CheckpointMismatchError(f"the checkpoint has values that `like` lacks: "
                                          f"{unexpected} (pass strict=False to ignore them)")

    # 3. stateful objects: the saved sub-tree, in place where they hold the tensor already
    appliers: list[Callable[[], None]] = []
    for slot in flat.statefuls:
        sub = skeleton_subtree(layout.skeleton, slot.keys) if layout is not None else None
        if sub is None:
            raise CheckpointMismatchError(f"the checkpoint holds no state for {slot.path!r} "
                                          f"({type(slot.obj).__name__})")
        appliers.append(_plan_stateful(slot.path, slot.obj, sub, targets, pick, place,
                                       strict))

    def finish() -> Any:
        for apply in appliers:
            apply()
        return unflatten_state(flat.skeleton, flat.leaves(), loaded_objects,
                               {slot.path: slot.obj for slot in flat.statefuls})

    return RestorePlan(targets.wanted, targets.dests, targets.copies, finish,
                       targets.view_copies)


def _plan_stateful(path: str, obj: Any, sub: Any, targets: _Targets,
                   pick: Callable[[str, Mapping[str, Any] | None], Any], place: Place,
                   strict: bool) -> Callable[[], None]:
    """Claim destinations for the saved sub-tree ``sub`` of a stateful at ``path``;
    return the step that hands the rebuilt sub-tree to its ``load_state_dict``. Shards
    it holds (a module's ``DTensor`` parameters) are filled in place where ``place``
    puts them, and handed back as the ``DTensor``s they are."""
    current_state = obj.state_dict()
    current = flatten_state(current_state, prefix=path, merge_views=False)
    saved_here = dict(skeleton_tensors(sub, path))
    if strict:
        held = [*current.tensors, *current.aliases]
        lacking = sorted(p for p in held if p not in saved_here)
        if lacking:
            raise CheckpointMismatchError(
                f"{path!r} ({type(obj).__name__}) holds tensors the checkpoint lacks: "
                f"{lacking} (pass strict=False to keep their current values)")
        unexpected = sorted(set(saved_here) - set(held)) if _is_module(obj) else []
        if unexpected:  # a module never grows state (an optimizer does, lazily)
            raise CheckpointMismatchError(
                f"the checkpoint has tensors that {path!r} ({type(obj).__name__}) lacks: "
                f"{unexpected} (pass strict=False to ignore them)")
    views: list[tuple[str, TensorView, Any, bool]] = []
    holds_torch = any(is_torch_tensor(v) for v in current.tensors.values())
    for tensor_path, node in saved_here.items():
        value = current.tensors.get(current.aliases.get(tensor_path, tensor_path))
        as_torch = bool(node.get("torch")) or holds_torch
        view = _view(node)
        if view is not None:  # once every stored tensor has its destination
            views.append((tensor_path, view, value, as_torch))
            continue
        name = node["k"]
        if name in targets.leaves:
            continue
        box = full_box(targets.specs[name].full_shape)
        if isinstance(value, ShardedArray):
            box, dest = place(name, tensor_path, value)
            targets.claim(name, box, dest, current.dtensors.get(tensor_path, value.data))
        elif value is not None:
            targets.claim(name, box, leaf_array(value, name), value)
        else:
            targets.fresh(name, box, as_torch)
    view_leaves: dict[str, Any] = {}
    lacking_views: list[tuple[str, TensorView]] = []
    for tensor_path, view, value, as_torch in views:
        if value is not None and not isinstance(value, ShardedArray):
            targets.view_into(tensor_path, view, value)  # filled in place
            view_leaves[tensor_path] = value
        else:  # state the object lacks (lazily created): a view of the stored tensor
            targets.base(view, tensor_path, as_torch)
            lacking_views.append((tensor_path, view))
    objects = {key: pick(key, current.objects) for key in subtree_objects(sub)}

    def apply() -> None:
        for tensor_path, view in lacking_views:  # after reading: the base holds its bytes
            view_leaves[tensor_path] = view_leaf(targets.leaves[view.base], view)
        tree = unflatten_state(sub, targets.leaves, objects, views=view_leaves, prefix=path)
        apply_state(obj, tree, current_state, strict=strict, path=path)

    return apply


def _plan_fresh(metadata: ShardMetadata, targets: _Targets, rank: int, world_size: int,
                rank_objects: RankObjects) -> RestorePlan:
    """No ``like``: the saved structure, fresh arrays (torch tensors where saved so),
    sharded tensors re-split evenly as ``ShardedArray``."""
    layout = metadata.state
    torch_names = _torch_names(metadata)
    leaves: dict[str, Any] = {}
    for name, spec in metadata.rebalanced(world_size).items():
        leaf = targets.fresh(name, spec.box(rank), name in torch_names)
        if spec.mesh is not None and metadata.mesh is not None:
            shape = tuple(metadata.mesh["shape"])
            position = MeshPosition(shape, tuple(metadata.mesh["names"]),
                                    mesh_coordinate(shape, rank))
            leaf = ShardedArray(leaf, placements=spec.mesh.placements, mesh=position)
        elif spec.shard_dim is not None:
            leaf = ShardedArray(leaf, spec.shard_dim)
        leaves[name] = leaf
    if layout is None:
        return RestorePlan(targets.wanted, targets.dests, targets.copies,
                           lambda: dict(leaves))
    objects = {key: pick_object(key, layout, rank, world_size, metadata.num_ranks,
                                rank_objects, None)
               for key in [*layout.objects, *layout.rank_objects]}
    views = {}  # views share the memory of their stored tensor's fresh leaf
    for path, node in skeleton_tensors(layout.skeleton):
        view = _view(node)
        if view is not None:
            views[path] = view_leaf(leaves[view.base], view)
    return RestorePlan(targets.wanted, targets.dests, targets.copies,
                       lambda: unflatten_state(layout.skeleton, leaves, objects, views=views))
