"""The model cut into FSDP units, and the flat storage each unit holds on this rank.

``build_units`` cuts a Sequential-style module (a ``layers`` list of Module-API layers,
or one layer) into units of consecutive layers (``plan_units``), flattens each unit's
parameters into one ``FlatParamLayout`` buffer and places this rank's storage as the
``ShardingPolicy`` says: the whole flat buffer when parameters are not sharded (its
shard a view of it), else only the shard; a whole gradient buffer when gradients are
not sharded, else a gradient shard. ``ModuleView`` hands that storage to the module in
the kind its parameters hold (NumPy arrays, or torch tensors over them).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netdist.parallel.flat_param import FlatParamLayout, dtype_name, layout_dtype, plan_units
from netdist.parallel.fsdp_stats import MemoryTracker
from netdist.parallel.fsdp_strategy import ShardingPolicy
from netdist.parallel.tensor_kind import array_of, holds_tensors, tensor_of
from netdist.tensors import is_tensor, to_tensor
from netdist.types import is_bfloat16

__all__ = ["Unit", "ForwardCtx", "ModuleView", "build_units", "forward_layers",
           "backward_layers"]


@dataclass(slots=True, eq=False)
class Unit:
    """One wrapped unit: its layers, parameters, flat layout and local storage."""

    index: int
    layer_range: tuple[int, int]
    layers: list[Any]
    params: list[Any]
    layout: FlatParamLayout
    shard: np.ndarray                      # this rank's slice (a view of `full` if persistent)
    full: np.ndarray | None                # whole padded flat params when kept between steps
    grad: np.ndarray                       # grad shard (whole flat grad under NO_SHARD)
    valid: int                             # real elements at the front of `shard`
    crc: int
    state: dict[str, np.ndarray] | None = None
    gather_buf: np.ndarray | None = None
    gather_work: Any = None


@dataclass(slots=True, eq=False)
class ForwardCtx:
    """What ``forward`` keeps for ``backward``: per unit, its layers' contexts."""

    owner: int
    ctxs: list[Any] = field(default_factory=list)


class ModuleView:
    """Storage as the module sees it: tensors over FSDP's arrays for a module whose
    parameters are torch tensors, else the arrays themselves."""

    __slots__ = ("tensors", "_empty")

    def __init__(self, tensors: bool) -> None:
        self.tensors = tensors
        self._empty: dict[str, Any] = {}

    def expose(self, array: np.ndarray) -> Any:
        """``array`` as the module sees its storage."""
        return to_tensor(array) if self.tensors else array

    def placeholder(self, dtype: Any) -> Any:
        """The empty ``p.data`` / ``p.grad`` of a parameter whose storage is elsewhere."""
        name = dtype_name(dtype)
        if name not in self._empty:
            self._empty[name] = self.expose(np.empty(0, layout_dtype(dtype)))
        return self._empty[name]

    def to_layers(self, obj: Any, what: str) -> Any:
        """An input or gradient as the layers take it (the module's kind)."""
        return tensor_of(obj, what) if self.tensors else array_of(obj, what)


def forward_layers(layers: Sequence[Any], x: np.ndarray) -> tuple[np.ndarray, list[Any]]:
    ctxs = []
    for layer in layers:
        x, ctx = layer.forward(x)
        ctxs.append(ctx)
    return x, ctxs


def backward_layers(layers: Sequence[Any], ctxs: Sequence[Any], grad: np.ndarray) -> np.ndarray:
    for layer, ctx in zip(reversed(layers), reversed(ctxs)):
        grad = layer.backward(ctx, grad)
    return grad


def build_units(module: Any, min_params: int, policy: ShardingPolicy, memory: MemoryTracker,
                check_module_states: bool) -> tuple[list[Unit], ModuleView]:
    """Cut ``module`` into units and move its parameters into their flat storage.

    ``ValueError``/``TypeError`` for layers without the Module API, parameters shared
    between layers or with duplicate names, a unit mixing dtypes or holding integers.
    """
    layered = getattr(module, "layers", None) is not None
    layers = list(module.layers) if layered else [module]
    per_layer = [_layer_params(layer, i) for i, layer in enumerate(layers)]
    view = ModuleView(holds_tensors((p for params in per_layer for p in params),
                                    "FSDP: the module"))
    names = _param_names(layers, per_layer, layered)
    counts = [sum(int(np.prod(p.data.shape, dtype=np.int64)) for p in params)
              for params in per_layer]
    units = []
    for index, (start, stop) in enumerate(plan_units(counts, min_params)):
        params = [p for params in per_layer[start:stop] for p in params]
        placer = _Placer(policy, memory, view, check_module_states)
        units.append(placer.unit(index, (start, stop), layers[start:stop], params,
                                 [names[id(p)] for p in params]))
    return units, view


def _param_names(layers: list[Any], per_layer: list[list[Any]], layered: bool
                 ) -> dict[int, str]:
    """Names as Sequential gives them: ``"<layer index>.<name inside the layer>"``."""
    names: dict[int, str] = {}
    for i, (layer, params) in enumerate(zip(layers, per_layer)):
        named = getattr(layer, "named_parameters", None)
        local = {id(p): str(n) for n, p in named()} if callable(named) else {}
        for j, p in enumerate(params):
            if id(p) in names:
                raise ValueError(f"parameter {names[id(p)]!r} appears again in layer {i}: "
                                 "parameters shared between layers are not supported")
            inner = local.get(id(p)) or str(getattr(p, "name", None) or j)
            names[id(p)] = f"{i}.{inner}" if layered else inner
    if len(set(names.values())) != len(names):
        dupes = sorted({n for n in names.values() if list(names.values()).count(n) > 1})
        raise ValueError(f"parameter names must be unique, got duplicates {dupes}")
    return names


@dataclass(slots=True)
class _Placer:
    """Places one unit's parameters and gradients in storage the policy chooses."""

    policy: ShardingPolicy
    memory: MemoryTracker
    view: ModuleView
    check_module_states: bool

    def unit(self, index: int, layer_range: tuple[int, int], layers: list[Any],
             params: list[Any], names: list[str]) -> Unit:
        arrays = [array_of(p.data, f"parameter {name!r}") for p, name in zip(params, names)]
        dtype = _unit_dtype(index, layer_range, arrays)
        layout = FlatParamLayout.build(names, [a.shape for a in arrays], dtype,
                                       self.policy.num_shards)
        flat = layout.flatten(arrays)
        del arrays
        crc = zlib.crc32(flat.view(np.uint8).data) if self.check_module_states else 0
        shard_index = self.policy.shard_index
        shard, full = self._params(params, layout, flat, shard_index)
        del flat
        grad = self._grads(params, layout, shard_index)
        return Unit(index, layer_range, list(layers), params, layout, shard, full, grad,
                    layout.valid_numel(shard_index), crc)

    def _params(self, params: list[Any], layout: FlatParamLayout, flat: np.ndarray,
                shard_index: int) -> tuple[np.ndarray, np.ndarray | None]:
        lo, hi = layout.shard_bounds(shard_index)
        dtype = layout.np_dtype
        if self.policy.shards_parameters:
            shard = self.memory.alloc("params", hi - lo, dtype, zero=False)
            shard[...] = flat[lo:hi]
            for p in params:
                p.data = self.view.placeholder(dtype)
            return shard, None
        full = self.memory.alloc("params", layout.padded_numel, dtype, zero=False)
        full[...] = flat
        for p, array in zip(params, layout.views(full)):
            p.data = self.view.expose(array)
        return full[lo:hi], full

    def _grads(self, params: list[Any], layout: FlatParamLayout, shard_index: int
               ) -> np.ndarray:
        dtype = layout.np_dtype
        if self.policy.shards_gradients:
            lo, hi = layout.shard_bounds(shard_index)
            for p in params:
                p.grad = self.view.placeholder(dtype)
            return self.memory.alloc("grads", hi - lo, dtype)
        grad = self.memory.alloc("grads", layout.padded_numel, dtype)
        for p, array in zip(params, layout.views(grad)):
            p.grad = self.view.expose(array)
        return grad


def _unit_dtype(index: int, layer_range: tuple[int, int], arrays: list[np.ndarray]
                ) -> np.dtype[Any]:
    dtypes = {dtype_name(a.dtype) for a in arrays}
    if len(dtypes) > 1:
        raise TypeError(f"unit {index} (layers {layer_range[0]}..{layer_range[1] - 1}) "
                        f"mixes dtypes {sorted(dtypes)}; one flat buffer needs one dtype")
    dtype = layout_dtype(dtypes.pop()) if dtypes else np.dtype(np.float64)
    if dtype.kind != "f" and not is_bfloat16(dtype):
        raise TypeError(f"unit {index}: FSDP averages gradients, so parameters must be "
                        f"floating point, got {dtype}")
    return dtype


def _layer_params(layer: Any, index: int) -> list[Any]:
    for method in ("forward", "backward"):
        if not callable(getattr(layer, method, None)):
            raise TypeError(f"layer {index} ({type(layer).__name__}) has no {method}(); "
                            "expected the netdist.train Module API")
    getter = getattr(layer, "parameters", None)
    params = list(getter()) if callable(getter) else []
    for p in params:
        data = getattr(p, "data", None)
        if not isinstance(data, np.ndarray) and not is_tensor(data):
            raise TypeError(f"layer {index}: parameter {getattr(p, 'name', '?')!r} has no "
                            "ndarray or torch.Tensor .data")
    return params
