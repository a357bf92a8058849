"""Fully sharded data parallelism (FSDP / ZeRO) over a ``Group``, for NumPy modules.

``FSDP(module, group, strategy)`` wraps a Sequential-style model (anything with a
``layers`` list of Module-API layers: ``forward(x) -> (y, ctx)``, ``backward(ctx, g) ->
g_in`` adding into ``param.grad``, ``parameters()``), cut into *units* of consecutive
layers by parameter count (``auto_wrap_min_params``, see
``netdist.parallel.flat_param.plan_units``). Each unit's parameters are flattened into
one buffer padded to a multiple of the shard-group size; shard-group rank ``k`` owns the
contiguous slice ``k`` (``FlatParamLayout``)::

    fsdp = FSDP(model, group, ShardingStrategy.FULL_SHARD, optimizer=ShardedAdam(lr=1e-3))
    for x, y in batches:                       # every rank: its own slice of the batch
        fsdp.zero_grad()
        logits = await fsdp.forward(x)
        loss, grad = softmax_cross_entropy(logits, y)
        await fsdp.backward(grad)
        await fsdp.clip_grad_norm(1.0)         # optional; global norm across shards
        await fsdp.step()

Strategies (``ShardingStrategy``), gradients always averaged (``ReduceOp.MEAN``) as DDP:

=============  ============================  =============================================
strategy       held between steps            communication per step
=============  ============================  =============================================
FULL_SHARD     param, grad, optim shards     all-gather params before each unit's forward
(ZeRO-3)                                     and again before its backward (freed after
                                             each), reduce-scatter its gradient
SHARD_GRAD_OP  whole params; grad and        reduce-scatter gradients; after the step the
(ZeRO-2)       optim shards                  updated shards are all-gathered
NO_SHARD       whole params, grads, optim    all-reduce of each unit's gradient
(DDP)
HYBRID_SHARD   FULL_SHARD inside each node   FULL_SHARD traffic inside the node group of
               of ``intra_node_size`` ranks  ``intra_node_size`` ranks, then an all-reduce
                                             of the gradient shards across the replicas
=============  ============================  =============================================

HYBRID_SHARD rank layout: world rank ``r`` is rank ``r % s`` of node ``r // s``
(``s = intra_node_size``; the world size must be a multiple of ``s``). Ranks with the
same ``r % s`` hold the same shard and form a replica group.

Overlap. Collectives are issued with ``async_op=True`` and layers run in a worker thread
(``compute_in_thread``; NumPy releases the GIL), so the event loop moves bytes while a
unit computes. With ``prefetch_depth = d`` the all-gathers of units ``i+1 .. i+d``
(forward) or ``i-1 .. i-d`` (backward) are in flight while unit ``i`` computes, one
gradient reduction stays in flight while the next unit's backward runs, and the last
unit stays gathered from the end of forward into backward (which starts with it);
``d = 0`` gathers strictly before each use, frees right after and waits for every
collective right away (least memory, no overlap). Every collective is
issued from the calling coroutine at a point that depends only on the unit index and
``d``, so all ranks issue them in the same order (as every group requires). The first
call checks that all ranks agree on strategy, units, dtypes, prefetch depth and (unless
``check_module_states=False``) the initial parameter values, raising
``CollectiveMismatchError`` on every rank otherwise.

Parameters in between. Under FULL_SHARD / HYBRID_SHARD a ``Parameter.data`` points at
gathered storage only while its unit computes and is an empty array otherwise; read
values with ``full_state_dict``. ``Parameter.grad`` is empty outside backward for the
sharded strategies (the reduced gradient lives in the shard, ``local_grad_shards``).

Optimizer. ``ShardedSGD`` / ``ShardedAdam`` (``netdist.parallel.sharded_optim``) apply
``netdist.train``'s update rules to each rank's flat shard (real elements only: the
padding is never read or written, so it stays zero). Optimizer state is allocated on the
first step, shard-sized.

Memory. ``memory_stats()`` measures the bytes FSDP holds on this rank (every buffer it
allocates is counted by category: params, grads, optimizer state, gathered params and
transient gradient buffers, with peaks); ``memory_estimate(strategy)`` predicts the same
categories for any strategy from the unit layouts, so the saving can be read off.

Checkpoints. ``sharded_state_dict()`` returns this rank's pieces as 1-D views of each
flattened parameter (and optimizer state ``"optim.<param>.<key>"``) with per-tensor specs
whose keys are exactly ``netdist.checkpoint.TensorShardSpec``'s constructor arguments
(this package does not import the checkpoint layer)::

    sd = fsdp.sharded_state_dict()
    # per rank, no communication (save_distributed):
    specs = {name: TensorShardSpec(**kw) for name, kw in sd.specs.items()}
    save_distributed(sd.tensors, path, group.rank, group.world_size, specs)
    # collectively; the load reshards into any world size / strategy, in place:
    state = {"tensors": {k: ShardedArray(v) if sd.specs[k]["shard_dim"] == 0 else v
                         for k, v in sd.tensors.items()}, "step": sd.step}
    await checkpoint.save(state, path, group)
    loaded = await checkpoint.load(path, group, like=state)    # fills sd.tensors' views
    await fsdp.load_sharded_state_dict(sd.tensors, step=loaded["step"])
    # (re-syncs what views cannot: HYBRID replicas, SHARD_GRAD_OP whole params)

Parameters are always saved flattened (``shapes`` gives the original shapes), so a
checkpoint written under any strategy or world size loads under any other.
``full_state_dict(rank0_only=True)`` gathers whole parameters (original shapes).

Torch tensors. Wherever FSDP takes or gives arrays it takes CPU torch tensors too,
through ``netdist.tensors`` (zero-copy views; a non-CPU tensor is a ``ValueError`` naming
its device):

- ``forward(x)`` and ``backward(grad)`` give back the kind they were given: a tensor for
  a tensor, an array for an array.
- A module whose parameters hold tensors (``p.data`` a ``torch.Tensor``: layers that
  compute with torch under the Module API) stays a torch module: ``p.data`` and
  ``p.grad`` become tensors over FSDP's flat buffers (views, so backward's in-place
  ``p.grad += g`` lands in them), its layers get tensors (a NumPy input is wrapped,
  copied first only if it is read-only), and ``full_state_dict``,
  ``full_optim_state_dict``, ``sharded_state_dict`` (views, so in-place loads still
  land), ``local_shards`` and ``local_grad_shards`` return tensors. All parameters of
  a module must be of one kind.
- ``load_full_state_dict`` and ``load_sharded_state_dict`` take tensors (a
  ``state_dict()``, ``dict(named_parameters())``) whatever the module holds.

bfloat16 parameters (``torch.bfloat16`` tensors, or ``ml_dtypes.bfloat16`` arrays) need
no extra package: FSDP gathers them, averages their gradients as torch rounds (float32
per step, rounded to nearest even), clips them and steps them (``ShardedOptimizer.apply``:
float32 arithmetic, rounded back once per step). bfloat16 is never cast implicitly: a
state dict must hold bfloat16 for bfloat16 parameters.

Failure: a collective that times out or loses a peer raises its ``netdist.errors``
exception; outstanding collectives issued by FSDP are cancelled, gathered buffers
released, and the group's tag stream is out of step (treat the group as broken).
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from netdist.collectives import CollectiveMismatchError
from netdist.parallel.flat_param import FlatParamLayout, dtype_name, layout_dtype, plan_units
from netdist.parallel.sharded_optim import ShardedOptimizer, sharded_optimizer_from
from netdist.parallel.tensor_kind import array_of, holds_tensors, tensor_of
from netdist.tensors import as_array, is_tensor, to_tensor
from netdist.types import (
    ReduceOp,
    bfloat16_to_float32,
    float32_to_bfloat16,
    is_bfloat16,
    reduce_into,
)

if TYPE_CHECKING:
    from netdist.collectives import Group

__all__ = [
    "ShardingStrategy",
    "FSDP",
    "MemoryEstimate",
    "MemoryStats",
    "FSDPTimings",
    "ShardedStateDict",
]

_CATEGORIES = ("params", "grads", "optimizer", "gathered", "grad_buffers")


class ShardingStrategy(enum.Enum):
    """What FSDP shards (see the module docstring's table)."""

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"

    @classmethod
    def parse(cls, value: ShardingStrategy | str) -> ShardingStrategy:
        """Accept a member, its name (``"FULL_SHARD"``) or its value (``"full_shard"``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value.lower() in (member.value, member.name.lower()):
                    return member
        names = ", ".join(m.name for m in cls)
        raise ValueError(f"unknown sharding strategy {value!r} (expected one of {names})")


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes one rank is expected to hold under ``strategy`` (from the unit layouts).

    ``params``/``grads``/``optimizer`` are held between steps; ``peak_gathered`` is the
    most gathered parameter memory alive at once (``prefetch_depth + 1`` units under
    FULL_SHARD/HYBRID_SHARD); ``peak_grad_buffers`` bounds the transient full-size
    gradient buffers of backward (the computing unit plus reductions in flight).
    """

    strategy: ShardingStrategy
    params: int
    grads: int
    optimizer: int
    peak_gathered: int
    peak_grad_buffers: int

    @property
    def persistent(self) -> int:
        """``params + grads + optimizer``."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        """Upper bound on everything at once."""
        return self.persistent + self.peak_gathered + self.peak_grad_buffers


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Bytes FSDP actually holds on this rank now, and the peaks since the last reset."""

    params: int
    grads: int
    optimizer: int
    gathered: int
    grad_buffers: int
    peak_gathered: int
    peak_grad_buffers: int
    peak_total: int

    @property
    def persistent(self) -> int:
        """``params + grads + optimizer`` currently held."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.persistent + self.gathered + self.grad_buffers


@dataclass(frozen=True, slots=True)
class FSDPTimings:
    """Where time went since the last ``reset_timings()`` (seconds, this rank).

    ``allgather_wait`` is time the caller was blocked waiting for parameter all-gathers
    (the part prefetch did *not* hide); ``reduce_wait`` the same for gradient
    reductions; ``step_allgather_wait`` for the post-step all-gathers of SHARD_GRAD_OP.
    """

    forward: float
    backward: float
    step: float
    compute: float
    allgather_wait: float
    reduce_wait: float
    step_allgather_wait: float
    allgathers: int
    allgather_bytes: int


@dataclass(frozen=True, slots=True)
class ShardedStateDict:
    """What this rank owns: local 1-D pieces of each flattened tensor, and their specs.

    ``tensors[name]`` views live storage (writing into it, e.g. by an in-place
    checkpoint load, changes the model): NumPy views, or tensors over them for a module
    whose parameters are tensors. ``specs[name]`` holds ``full_shape``,
    ``shard_dim`` (0, or None for replicated), ``shard_sizes`` (per *world* rank) and
    ``dtype``: the arguments of ``netdist.checkpoint.TensorShardSpec``. ``shapes`` maps
    each parameter to its original shape; ``step`` and ``hyperparams`` describe the
    optimizer (``hyperparams`` is empty without one).
    """

    tensors: dict[str, Any]
    specs: dict[str, dict[str, Any]]
    shapes: dict[str, tuple[int, ...]]
    step: int
    hyperparams: dict[str, Any]


class _MemoryTracker:
    """Counts the bytes of every buffer FSDP allocates, by category, with peaks."""

    __slots__ = ("current", "peak", "peak_total", "_live")

    def __init__(self) -> None:
        self.current = dict.fromkeys(_CATEGORIES, 0)
        self.peak = dict.fromkeys(_CATEGORIES, 0)
        self.peak_total = 0
        self._live: dict[int, tuple[str, int]] = {}

    def alloc(self, category: str, numel: int, dtype: Any, *, zero: bool = True) -> np.ndarray:
        array = np.zeros(numel, dtype) if zero else np.empty(numel, dtype)
        self._live[id(array)] = (category, array.nbytes)
        self.current[category] += array.nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        self.peak_total = max(self.peak_total, sum(self.current.values()))
        return array

    def free(self, array: np.ndarray | None) -> None:
        if array is None:
            return
        entry = self._live.pop(id(array), None)
        if entry is not None:
            self.current[entry[0]] -= entry[1]

    def free_category(self, category: str) -> None:
        """Forget every live buffer of ``category`` (after an aborted step)."""
        self._live = {k: v for k, v in self._live.items() if v[0] != category}
        self.current[category] = 0

    def reset_peaks(self) -> None:
        self.peak = dict(self.current)
        self.peak_total = sum(self.current.values())


@dataclass(slots=True)
class _Timings:
    forward: float = 0.0
    backward: float = 0.0
    step: float = 0.0
    compute: float = 0.0
    allgather_wait: float = 0.0
    reduce_wait: float = 0.0
    step_allgather_wait: float = 0.0
    allgathers: int = 0
    allgather_bytes: int = 0


@dataclass(slots=True, eq=False)
class _Unit:
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
class _GradJob:
    unit: _Unit
    work: Any
    buffer: np.ndarray | None              # full-size gradient buffer being reduced
    result: np.ndarray | None              # this rank's reduced shard


@dataclass(slots=True, eq=False)
class _ForwardCtx:
    owner: int
    ctxs: list[Any] = field(default_factory=list)


def _forward_layers(layers: Sequence[Any], x: np.ndarray) -> tuple[np.ndarray, list[Any]]:
    ctxs = []
    for layer in layers:
        x, ctx = layer.forward(x)
        ctxs.append(ctx)
    return x, ctxs


def _backward_layers(layers: Sequence[Any], ctxs: Sequence[Any], grad: np.ndarray) -> np.ndarray:
    for layer, ctx in zip(reversed(layers), reversed(ctxs)):
        grad = layer.backward(ctx, grad)
    return grad


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


def _copy_into(target: np.ndarray, value: Any, what: str) -> None:
    """``target[...] = value`` for a state-dict entry (array or tensor); bfloat16 only
    from bfloat16, copied as bits (``TypeError`` otherwise, naming ``what``)."""
    array = as_array(value, what) if is_tensor(value) else np.asarray(value)
    if array.shape != target.shape:
        raise ValueError(f"{what}: local shape {array.shape}, this rank holds {target.shape}")
    if is_bfloat16(array.dtype) != is_bfloat16(target.dtype):
        raise TypeError(f"{what}: dtype {dtype_name(array.dtype)}, FSDP holds "
                        f"{dtype_name(target.dtype)} (bfloat16 is never cast implicitly)")
    if target.size and not np.shares_memory(array, target):
        if is_bfloat16(target.dtype):
            target.view(np.uint16)[...] = array.view(np.uint16)
        else:
            target[...] = array


def _widened(array: np.ndarray) -> np.ndarray:
    """bfloat16 as float32 (exact); other dtypes as they are."""
    return bfloat16_to_float32(array) if is_bfloat16(array.dtype) else array


class FSDP:
    """Shard a Sequential-style ``module`` over ``group`` (see the module docstring).

    Every rank of ``group`` builds ``FSDP`` with the same model (same seed), strategy and
    options; construction does no communication (the first async call checks agreement).

    - ``optimizer``: a ``ShardedOptimizer``, or a ``netdist.train`` ``SGD``/``Adam``
      whose hyper-parameters are copied (its own state is not used).
    - ``auto_wrap_min_params``: a unit grows over consecutive layers until it holds at
      least this many parameters (0: one unit per layer with parameters).
    - ``prefetch_depth``: all-gathers kept in flight ahead of the computing unit (0:
      none, and gradient reductions are waited for at once; each extra unit of depth
      costs one more unit's gathered parameters).
    - ``intra_node_size``: ranks per node, HYBRID_SHARD only.
    - ``compute_in_thread``: run the layers in a worker thread so the event loop keeps
      moving bytes meanwhile (NumPy releases the GIL); False runs them on the loop.
    - ``check_module_states``: compare a CRC of the initial parameters across ranks.
    - ``timeout``: deadline of each collective in seconds (default: the group's).

    The module's parameters are moved into FSDP's flat buffers at construction: under
    NO_SHARD and SHARD_GRAD_OP ``Parameter.data`` stays a view of the whole flat
    buffer; under FULL_SHARD / HYBRID_SHARD it is an empty array except while its unit
    computes.
    """

    def __init__(self, module: Any, group: Group,
                 strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD, *,
                 optimizer: Any = None, auto_wrap_min_params: int = 0,
                 prefetch_depth: int = 1, intra_node_size: int | None = None,
                 compute_in_thread: bool = True, check_module_states: bool = True,
                 timeout: float | None = None) -> None:
        self.strategy = ShardingStrategy.parse(strategy)
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) \
                or prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be an int >= 0, got {prefetch_depth!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if not getattr(group, "is_member", True):
            raise ValueError("FSDP needs a group this rank is a member of")
        self.module = module
        self.group = group
        self.prefetch_depth = prefetch_depth
        self.compute_in_thread = bool(compute_in_thread)
        self.check_module_states = bool(check_module_states)
        self.timeout = timeout
        self.optimizer: ShardedOptimizer | None = None
        if optimizer is not None:
            self.set_optimizer(optimizer)
        self._memory = _MemoryTracker()
        self._timings = _Timings()
        self._step = 0
        self._ready = False
        self._closed = False
        self._ctx: _ForwardCtx | None = None
        self._pending: list[Any] = []
        self._empty: dict[str, Any] = {}
        self._tensors = False
        """The module's parameters hold torch tensors (see the module docstring)."""

        world = group.world_size
        self.intra_node_size = self._setup_groups(world, intra_node_size)
        shard_group = self._shard_group
        self._num_shards = shard_group.world_size if shard_group is not None else 1
        self._shard_index = shard_group.rank if shard_group is not None else 0
        self._gather_params = (self.strategy in (ShardingStrategy.FULL_SHARD,
                                                 ShardingStrategy.HYBRID_SHARD)
                               and self._num_shards > 1)
        self._params_persistent = not self._gather_params
        self._units = self._build_units(module, auto_wrap_min_params)

    # -- construction --------------------------------------------------------------------

    def _setup_groups(self, world: int, intra_node_size: int | None) -> int | None:
        group = self.group
        self._shard_group: Group | None = None
        self._replica_group: Group | None = None
        if self.strategy is not ShardingStrategy.HYBRID_SHARD:
            if intra_node_size is not None:
                raise ValueError(f"intra_node_size applies to HYBRID_SHARD only, not "
                                 f"{self.strategy.name}")
            if self.strategy is ShardingStrategy.NO_SHARD:
                self._replica_group = group if world > 1 else None
            else:
                self._shard_group = group
            return None
        if isinstance(intra_node_size, bool) or not isinstance(intra_node_size, int) \
                or intra_node_size < 1:
            raise ValueError("HYBRID_SHARD needs intra_node_size, an int >= 1 (ranks per "
                             f"node), got {intra_node_size!r}")
        if world % intra_node_size:
            raise ValueError(f"HYBRID_SHARD: world size {world} is not a multiple of "
                             f"intra_node_size {intra_node_size}; use a world size of "
                             f"k * {intra_node_size} or another intra_node_size")
        nodes = world // intra_node_size
        node, local = divmod(group.rank, intra_node_size)
        node_groups = [group.new_group(list(range(j * intra_node_size,
                                                  (j + 1) * intra_node_size)))
                       for j in range(nodes)]
        replica_groups = [group.new_group([k + j * intra_node_size for j in range(nodes)])
                          for k in range(intra_node_size)]
        self._shard_group = node_groups[node]
        self._replica_group = replica_groups[local] if nodes > 1 else None
        return intra_node_size

    def _build_units(self, module: Any, min_params: int) -> list[_Unit]:
        layered = getattr(module, "layers", None) is not None
        layers = list(module.layers) if layered else [module]
        per_layer = [_layer_params(layer, i) for i, layer in enumerate(layers)]
        self._tensors = holds_tensors((p for params in per_layer for p in params),
                                      "FSDP: the module")
        # names as Sequential gives them: "<layer index>.<name inside the layer>"
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
        counts = [sum(int(np.prod(p.data.shape, dtype=np.int64)) for p in params)
                  for params in per_layer]
        units = []
        for index, (start, stop) in enumerate(plan_units(counts, min_params)):
            params = [p for params in per_layer[start:stop] for p in params]
            units.append(self._make_unit(index, (start, stop), layers[start:stop], params,
                                         [names[id(p)] for p in params]))
        return units

    def _make_unit(self, index: int, layer_range: tuple[int, int], layers: list[Any],
                   params: list[Any], names: list[str]) -> _Unit:
        arrays = [array_of(p.data, f"parameter {name!r}") for p, name in zip(params, names)]
        dtypes = {dtype_name(a.dtype) for a in arrays}
        if len(dtypes) > 1:
            raise TypeError(f"unit {index} (layers {layer_range[0]}..{layer_range[1] - 1}) "
                            f"mixes dtypes {sorted(dtypes)}; one flat buffer needs one dtype")
        dtype = layout_dtype(dtypes.pop()) if dtypes else np.dtype(np.float64)
        if dtype.kind != "f" and not is_bfloat16(dtype):
            raise TypeError(f"unit {index}: FSDP averages gradients, so parameters must be "
                            f"floating point, got {dtype}")
        layout = FlatParamLayout.build(names, [a.shape for a in arrays], dtype,
                                       self._num_shards)
        flat = layout.flatten(arrays)
        del arrays
        crc = zlib.crc32(flat.view(np.uint8).data) if self.check_module_states else 0
        lo, hi = layout.shard_bounds(self._shard_index)
        mem = self._memory
        full: np.ndarray | None = None
        if self._params_persistent:
            full = mem.alloc("params", layout.padded_numel, dtype, zero=False)
            full[...] = flat
            shard = full[lo:hi]
            for p, view in zip(params, layout.views(full)):
                p.data = self._expose(view)
        else:
            shard = mem.alloc("params", hi - lo, dtype, zero=False)
            shard[...] = flat[lo:hi]
            for p in params:
                p.data = self._placeholder(dtype)
        del flat
        if self.strategy is ShardingStrategy.NO_SHARD:
            grad = mem.alloc("grads", layout.padded_numel, dtype)
            for p, view in zip(params, layout.views(grad)):
                p.grad = self._expose(view)
        else:
            grad = mem.alloc("grads", hi - lo, dtype)
            for p in params:
                p.grad = self._placeholder(dtype)
        return _Unit(index, layer_range, list(layers), params, layout, shard, full, grad,
                     layout.valid_numel(self._shard_index), crc)

    def _placeholder(self, dtype: Any) -> Any:
        """The empty ``p.data`` / ``p.grad`` of a parameter whose storage is elsewhere."""
        name = dtype_name(dtype)
        if name not in self._empty:
            self._empty[name] = self._expose(np.empty(0, layout_dtype(dtype)))
        return self._empty[name]

    def _expose(self, array: np.ndarray) -> Any:
        """``array`` as the module sees its storage: a tensor over it for a module whose
        parameters are tensors, else the array itself."""
        return to_tensor(array) if self._tensors else array

    def _to_layers(self, obj: Any, what: str) -> Any:
        """An input or gradient as the layers take it (the module's kind)."""
        return tensor_of(obj, what) if self._tensors else array_of(obj, what)

    @staticmethod
    def _as_given(obj: Any, tensor: bool, what: str) -> Any:
        """A result in the kind the caller gave: a tensor, or else an array."""
        return tensor_of(obj, what) if tensor else array_of(obj, what)

    def set_optimizer(self, optimizer: Any) -> None:
        """Use ``optimizer`` (``ShardedOptimizer`` or a ``netdist.train`` SGD/Adam)."""
        if not isinstance(optimizer, ShardedOptimizer):
            optimizer = sharded_optimizer_from(optimizer)
        if getattr(self, "_step", 0) > 0 and self.optimizer is not None:
            raise ValueError("cannot replace the optimizer after the first step")
        self.optimizer = optimizer

    # -- introspection -------------------------------------------------------------------

    @property
    def num_units(self) -> int:
        return len(self._units)

    @property
    def unit_layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` layer indices of each unit."""
        return tuple(u.layer_range for u in self._units)

    @property
    def unit_layouts(self) -> tuple[FlatParamLayout, ...]:
        return tuple(u.layout for u in self._units)

    @property
    def shard_group(self) -> Group | None:
        """The group parameters are sharded over (None under NO_SHARD)."""
        return self._shard_group

    def _sharding(self) -> Group:
        """The shard group, where a code path only runs with more than one shard."""
        group = self._shard_group
        if group is None:
            raise RuntimeError(f"FSDP ({self.strategy.name}) has no shard group here "
                               "(internal state error)")
        return group

    @property
    def replica_group(self) -> Group | None:
        """The group gradients are all-reduced over (NO_SHARD, HYBRID_SHARD), if any."""
        return self._replica_group

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def holds_tensors(self) -> bool:
        """True when the module's parameters are torch tensors (what FSDP hands back)."""
        return self._tensors

    def local_shards(self) -> list[Any]:
        """This rank's parameter shard of each unit (real elements, padding excluded;
        views, tensors for a module of tensors)."""
        return [self._expose(u.shard[:u.valid]) for u in self._units]

    def local_grad_shards(self) -> list[Any]:
        """The reduced gradient this rank holds per unit (real elements only; views,
        tensors for a module of tensors)."""
        return [self._expose(u.grad[:u.valid]) for u in self._units]

    def memory_stats(self) -> MemoryStats:
        """Bytes held now by category, and peaks since construction / ``reset_peak_memory``."""
        cur, peak = self._memory.current, self._memory.peak
        return MemoryStats(cur["params"], cur["grads"], cur["optimizer"], cur["gathered"],
                           cur["grad_buffers"], peak["gathered"], peak["grad_buffers"],
                           self._memory.peak_total)

    def reset_peak_memory(self) -> None:
        self._memory.reset_peaks()

    def timings(self) -> FSDPTimings:
        t = self._timings
        return FSDPTimings(t.forward, t.backward, t.step, t.compute, t.allgather_wait,
                           t.reduce_wait, t.step_allgather_wait, t.allgathers,
                           t.allgather_bytes)

    def reset_timings(self) -> None:
        self._timings = _Timings()

    def memory_estimate(self, strategy: ShardingStrategy | str | None = None, *,
                        intra_node_size: int | None = None) -> MemoryEstimate:
        """Expected bytes per rank under ``strategy`` (default: this FSDP's) for this model,
        this group, the optimizer's state and ``prefetch_depth``.

        HYBRID_SHARD needs ``intra_node_size`` unless it is this FSDP's own strategy.
        """
        strat = self.strategy if strategy is None else ShardingStrategy.parse(strategy)
        world, rank = self.group.world_size, self.group.rank
        if strat is ShardingStrategy.HYBRID_SHARD:
            size = intra_node_size or self.intra_node_size
            if size is None or world % size:
                raise ValueError(f"HYBRID_SHARD estimate needs an intra_node_size dividing "
                                 f"the world size {world}, got {size!r}")
            shards, index, replicas = size, rank % size, world // size
        elif strat is ShardingStrategy.NO_SHARD:
            shards, index, replicas = 1, 0, world
        else:
            shards, index, replicas = world, rank, 1
        states = len(self.optimizer.state_keys()) if self.optimizer is not None else 0
        params = grads = optim = 0
        padded, buffers = [], []
        for unit in self._units:
            layout = FlatParamLayout.build([s.name for s in unit.layout.slots],
                                           [s.shape for s in unit.layout.slots],
                                           unit.layout.dtype, shards)
            item = layout.itemsize
            whole = layout.padded_numel * item
            shard = layout.shard_numel * item
            params += whole if strat in (ShardingStrategy.SHARD_GRAD_OP,
                                         ShardingStrategy.NO_SHARD) or shards == 1 else shard
            grads += whole if strat is ShardingStrategy.NO_SHARD else shard
            optim += states * layout.valid_numel(index) * item
            padded.append(whole)
            buffers.append(whole + (shard if shards > 1 else 0))
        gathered = 0
        if strat in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD) \
                and shards > 1 and padded:
            window = min(self.prefetch_depth + 1, len(padded))
            gathered = max(sum(padded[i:i + window]) for i in range(len(padded) - window + 1))
        grad_buffers = 0
        if strat is not ShardingStrategy.NO_SHARD and buffers:
            in_flight = 2 if self.prefetch_depth > 0 else 1
            grad_buffers = in_flight * max(buffers) * (2 if replicas > 1 else 1)
        return MemoryEstimate(strat, params, grads, optim, gathered, grad_buffers)

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> FSDP:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel collectives FSDP still has in flight and release gathered buffers.

        Idempotent; the group and its transport stay open (FSDP does not own them).
        """
        self._closed = True
        await self._abort()

    async def _abort(self) -> None:
        works = [w for w in self._pending if w is not None]
        works += [u.gather_work for u in self._units if u.gather_work is not None]
        for work in works:
            work.cancel()
        for work in works:
            try:
                await work
            except (asyncio.CancelledError, Exception):  # cancelled here, or failed already
                pass
        self._pending.clear()
        for unit in self._units:
            self._release(unit)
            if self.strategy is not ShardingStrategy.NO_SHARD:
                for p in unit.params:
                    p.grad = self._placeholder(unit.layout.np_dtype)
        self._memory.free_category("gathered")
        self._memory.free_category("grad_buffers")

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"FSDP.{what}: this FSDP was closed")

    async def _ensure_ready(self, what: str) -> None:
        """First call: check every rank built the same FSDP (one all_gather_object)."""
        self._check_open(what)
        if self._ready:
            return
        mine: dict[str, Any] = {
            "strategy": self.strategy.value,
            "prefetch_depth": self.prefetch_depth,
            "intra_node_size": self.intra_node_size or 0,
            "units": [[u.layout.numel, u.layout.dtype, u.layer_range[1] - u.layer_range[0]]
                      for u in self._units],
        }
        mine["crc"] = [u.crc for u in self._units] if self.check_module_states else None
        everyone = await self.group.all_gather_object(mine, timeout=self.timeout)
        if any(entry.get("crc") is None for entry in everyone):  # a rank opted out
            for entry in everyone:
                entry["crc"] = None
        for rank, other in enumerate(everyone):
            if other == everyone[0]:
                continue
            first = everyone[0]
            parts = []
            for key in first:
                if other.get(key) == first.get(key):
                    continue
                if key == "crc":
                    units = [i for i, (a, b) in enumerate(zip(first[key], other[key])) if a != b]
                    parts.append(f"initial parameter values of units {units} (build the "
                                 "model with the same seed on every rank)")
                else:
                    parts.append(f"{key} {other.get(key)!r} (group rank 0: {first.get(key)!r})")
            raise CollectiveMismatchError(
                f"FSDP: group rank {rank} differs from group rank 0 in " + "; ".join(parts))
        self._ready = True

    # -- parameter gathering ---------------------------------------------------------------

    async def _issue_gather(self, unit: _Unit) -> None:
        if unit.gather_work is not None or unit.layout.numel == 0:
            return
        buf = self._memory.alloc("gathered", unit.layout.padded_numel, unit.layout.np_dtype,
                                 zero=False)
        unit.gather_buf = buf
        unit.gather_work = await self._sharding().all_gather(
            unit.shard, out=buf, async_op=True, timeout=self.timeout)
        self._timings.allgathers += 1
        self._timings.allgather_bytes += buf.nbytes

    async def _wait_gathered(self, unit: _Unit) -> None:
        if unit.layout.numel == 0:
            return
        if unit.gather_work is None:
            await self._issue_gather(unit)
        started = time.perf_counter()
        await unit.gather_work
        self._timings.allgather_wait += time.perf_counter() - started
        gathered = unit.gather_buf
        if gathered is None:
            raise RuntimeError(f"FSDP unit {unit.index}: all-gather finished without its "
                               "buffer (internal state error)")
        for p, view in zip(unit.params, unit.layout.views(gathered)):
            p.data = self._expose(view)

    def _release_all(self) -> None:
        """Drop every gathered unit (before shards change: step, loads)."""
        for unit in self._units:
            if unit.gather_work is not None and not unit.gather_work.done():
                raise RuntimeError("FSDP: an all-gather is still in flight; finish the "
                                   "forward/backward that issued it first")
            self._release(unit)

    def _release(self, unit: _Unit) -> None:
        if unit.gather_buf is None and unit.gather_work is None:
            return
        for p in unit.params:
            p.data = self._placeholder(unit.layout.np_dtype)
        self._memory.free(unit.gather_buf)
        unit.gather_buf = None
        unit.gather_work = None

    async def _prefetch(self, indices: range) -> None:
        for j in indices:
            await self._issue_gather(self._units[j])

    async def _compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            if self.compute_in_thread:
                return await asyncio.to_thread(fn, *args)
            return fn(*args)
        finally:
            self._timings.compute += time.perf_counter() - started

    # -- forward / backward ----------------------------------------------------------------

    async def forward(self, x: Any, *, requires_grad: bool = True) -> Any:
        """Run the model on ``x``; keep the context for the next ``backward``.

        With ``requires_grad=False`` (inference) no context is kept. Every rank must call
        it (FULL_SHARD/HYBRID_SHARD gather parameters); inputs may differ per rank.
        ``x`` may be an array or a CPU tensor; the output is of the same kind.
        """
        y, ctx = await self._forward(x, keep_last=requires_grad)
        self._ctx = ctx if requires_grad else None
        return y

    async def forward_with_ctx(self, x: Any) -> tuple[Any, Any]:
        """``forward`` returning ``(y, ctx)`` for an explicit ``backward(g, ctx=ctx)``
        (several micro-batches in flight, gradient accumulation)."""
        return await self._forward(x, keep_last=True)

    async def _forward(self, x: Any, keep_last: bool) -> tuple[Any, Any]:
        """Run the units in order. With prefetch on and a backward to follow
        (``keep_last``), the last unit stays gathered: backward starts with it, so its
        all-gather is not repeated (torch FSDP keeps the root unit the same way). It is
        released by backward, ``step`` or any load."""
        await self._ensure_ready("forward")
        started = time.perf_counter()
        keep_last = keep_last and self.prefetch_depth > 0
        ctx = _ForwardCtx(id(self))
        depth, units = self.prefetch_depth, self._units
        given_tensor = is_tensor(x)
        x = self._to_layers(x, "FSDP.forward input")
        try:
            for i, unit in enumerate(units):
                if self._gather_params:
                    await self._prefetch(range(i, min(len(units), i + depth + 1)))
                    await self._wait_gathered(unit)
                x, layer_ctxs = await self._compute(_forward_layers, unit.layers, x)
                if self._gather_params and not (keep_last and i == len(units) - 1):
                    self._release(unit)
                ctx.ctxs.append(layer_ctxs)
        except BaseException:
            await self._abort()
            raise
        finally:
            self._timings.forward += time.perf_counter() - started
        return self._as_given(x, given_tensor, "FSDP.forward output"), ctx

    async def backward(self, grad_out: Any, ctx: Any = None) -> Any:
        """Back-propagate ``grad_out`` through the model; returns d(loss)/d(input).

        Gradients are averaged over the data-parallel ranks and *added* to the local
        gradient (shards), so several backward calls accumulate until ``zero_grad``.
        ``ctx`` defaults to the context kept by the last ``forward``. ``grad_out`` may be
        an array or a CPU tensor; the input gradient is of the same kind.
        """
        await self._ensure_ready("backward")
        if ctx is None:
            ctx, self._ctx = self._ctx, None
            if ctx is None:
                raise RuntimeError("FSDP.backward: no forward context (call forward first, "
                                   "or pass ctx= from forward_with_ctx)")
        if not isinstance(ctx, _ForwardCtx) or ctx.owner != id(self) \
                or len(ctx.ctxs) != len(self._units):
            raise ValueError("FSDP.backward: ctx does not come from this FSDP's forward")
        started = time.perf_counter()
        given_tensor = is_tensor(grad_out)
        try:
            grad = await self._backward(self._to_layers(grad_out, "FSDP.backward gradient"),
                                        ctx)
        except BaseException:
            await self._abort()
            raise
        finally:
            self._timings.backward += time.perf_counter() - started
        return self._as_given(grad, given_tensor, "FSDP.backward input gradient")

    async def _backward(self, grad: Any, ctx: _ForwardCtx) -> Any:
        depth, units = self.prefetch_depth, self._units
        lag = 1 if depth > 0 else 0
        reducing: deque[_GradJob] = deque()
        averaging: deque[_GradJob] = deque()
        no_shard = self.strategy is ShardingStrategy.NO_SHARD
        for i in range(len(units) - 1, -1, -1):
            unit = units[i]
            layout = unit.layout
            if self._gather_params:
                await self._prefetch(range(i, max(-1, i - depth - 1), -1))
                await self._wait_gathered(unit)
            if no_shard:
                grad = await self._compute(_backward_layers, unit.layers, ctx.ctxs[i], grad)
                if self._replica_group is not None and layout.numel:
                    work = await self._replica_group.all_reduce(
                        unit.grad, ReduceOp.MEAN, async_op=True, timeout=self.timeout)
                    self._pending.append(work)
                    averaging.append(_GradJob(unit, work, None, None))
            else:
                buffer = self._memory.alloc("grad_buffers", layout.padded_numel,
                                            layout.np_dtype)
                for p, view in zip(unit.params, layout.views(buffer)):
                    p.grad = self._expose(view)
                try:
                    grad = await self._compute(_backward_layers, unit.layers, ctx.ctxs[i], grad)
                finally:
                    for p in unit.params:
                        p.grad = self._placeholder(layout.np_dtype)
                if self._gather_params:
                    self._release(unit)
                if layout.numel == 0:
                    self._memory.free(buffer)
                elif self._num_shards > 1:
                    result = self._memory.alloc("grad_buffers", layout.shard_numel,
                                                layout.np_dtype, zero=False)
                    work = await self._sharding().reduce_scatter(
                        buffer, ReduceOp.MEAN, out=result, async_op=True, timeout=self.timeout)
                    self._pending.append(work)
                    reducing.append(_GradJob(unit, work, buffer, result))
                else:
                    reducing.append(_GradJob(unit, None, None, buffer))
            while len(reducing) > lag:
                await self._finish_reduce(reducing.popleft(), averaging)
            while len(averaging) > lag:
                await self._finish_average(averaging.popleft())
        while reducing:
            await self._finish_reduce(reducing.popleft(), averaging)
        while averaging:
            await self._finish_average(averaging.popleft())
        self._pending.clear()
        return grad

    async def _finish_reduce(self, job: _GradJob, averaging: deque[_GradJob]) -> None:
        if job.work is not None:
            started = time.perf_counter()
            await job.work
            self._timings.reduce_wait += time.perf_counter() - started
        self._memory.free(job.buffer)
        job.buffer = None
        if self._replica_group is not None:
            if job.result is None:
                raise RuntimeError(f"FSDP unit {job.unit.index}: gradient reduction finished "
                                   "without a reduced shard to average")
            job.work = await self._replica_group.all_reduce(
                job.result, ReduceOp.MEAN, async_op=True, timeout=self.timeout)
            self._pending.append(job.work)
            averaging.append(job)
        else:
            self._accumulate(job)

    async def _finish_average(self, job: _GradJob) -> None:
        started = time.perf_counter()
        await job.work
        self._timings.reduce_wait += time.perf_counter() - started
        if job.result is not None:
            self._accumulate(job)

    def _accumulate(self, job: _GradJob) -> None:
        result = job.result
        if result is None:
            return
        reduce_into(ReduceOp.SUM, job.unit.grad, result)  # bfloat16 rounded as torch adds
        self._memory.free(result)
        job.result = None

    def zero_grad(self) -> None:
        """Zero this rank's gradient (shards) in place."""
        for unit in self._units:
            unit.grad[...] = 0

    # -- optimizer ---------------------------------------------------------------------------

    def _state_for(self, unit: _Unit, optimizer: ShardedOptimizer) -> dict[str, np.ndarray]:
        if unit.state is None:
            unit.state = {key: self._memory.alloc("optimizer", unit.valid, unit.layout.np_dtype)
                          for key in optimizer.state_keys()}
        return unit.state

    async def step(self) -> None:
        """Update this rank's parameter shards with the sharded optimizer.

        Under SHARD_GRAD_OP the updated shards are then all-gathered so every rank holds
        the whole updated parameters again; other strategies need no communication here.
        """
        await self._ensure_ready("step")
        optimizer = self.optimizer
        if optimizer is None:
            raise RuntimeError("FSDP.step: no optimizer (pass optimizer= or call "
                               "set_optimizer)")
        started = time.perf_counter()
        self._release_all()
        self._step += 1
        regather = (self.strategy is ShardingStrategy.SHARD_GRAD_OP and self._num_shards > 1)
        works = []
        try:
            for unit in self._units:
                if unit.valid:
                    state = self._state_for(unit, optimizer)
                    await self._compute(optimizer.apply, unit.shard[:unit.valid],
                                        unit.grad[:unit.valid], state, self._step)
                if regather and unit.layout.numel:
                    work = await self._sharding().all_gather(
                        unit.shard, out=unit.full, async_op=True, timeout=self.timeout)
                    self._pending.append(work)
                    works.append(work)
            waited = time.perf_counter()
            for work in works:
                await work
            self._timings.step_allgather_wait += time.perf_counter() - waited
            self._pending.clear()
        except BaseException:
            await self._abort()
            raise
        finally:
            self._timings.step += time.perf_counter() - started

    async def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the gradients so their global norm is at most ``max_norm``; return the norm.

        The norm is over the whole model's averaged gradient (all shards, padding
        excluded), computed as the sum of the shards' ``|g|^p`` all-reduced over the shard
        group (the maximum for ``norm_type=inf``), identical on every rank. As in torch,
        gradients are multiplied by ``max_norm / (norm + 1e-6)`` when that is below 1
        (bfloat16 gradients in float32, rounded back once).
        """
        await self._ensure_ready("clip_grad_norm")
        if not max_norm >= 0:
            raise ValueError(f"max_norm must be >= 0, got {max_norm}")
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
        total = np.zeros(1, np.float64)
        for unit in self._units:
            g = _widened(unit.grad[:unit.valid]).astype(np.float64, copy=False)
            if g.size == 0:
                continue
            if math.isinf(norm_type):
                total[0] = max(total[0], float(np.abs(g).max()))
            elif norm_type == 2.0:
                total[0] += float(np.dot(g, g))
            else:
                total[0] += float(np.sum(np.abs(g) ** norm_type))
        shard_group = self._shard_group
        if shard_group is not None and shard_group.world_size > 1:
            op = ReduceOp.MAX if math.isinf(norm_type) else ReduceOp.SUM
            await shard_group.all_reduce(total, op, timeout=self.timeout)
        norm = float(total[0]) if math.isinf(norm_type) else float(total[0]) ** (1.0 / norm_type)
        coef = float(max_norm) / (norm + 1e-6)
        if coef < 1.0:
            for unit in self._units:
                g = unit.grad[:unit.valid]
                if is_bfloat16(g.dtype):
                    wide = bfloat16_to_float32(g)
                    wide *= coef
                    float32_to_bfloat16(wide, out=g)
                else:
                    g *= coef
        return norm

    # -- state dicts -----------------------------------------------------------------------

    def _is_primary_replica(self) -> bool:
        """HYBRID_SHARD: only node 0's ranks report shards for checkpoints."""
        if self.strategy is not ShardingStrategy.HYBRID_SHARD:
            return True
        return self.group.rank < (self.intra_node_size or 1)

    def _world_sizes(self, per_shard: tuple[int, ...]) -> tuple[int, ...]:
        world = self.group.world_size
        if self.strategy is ShardingStrategy.HYBRID_SHARD:
            return per_shard + (0,) * (world - len(per_shard))
        return per_shard

    def sharded_state_dict(self) -> ShardedStateDict:
        """This rank's pieces of every (flattened) parameter and optimizer state tensor.

        See ``ShardedStateDict`` and the module docstring for how the checkpoint layer
        consumes it. The tensors are views of live storage (torch tensors over it for a
        module whose parameters are tensors). If an optimizer is set, its state is
        included (allocated zero-filled if no step was taken yet, so an in-place load has
        somewhere to land).
        """
        self._check_open("sharded_state_dict")
        self._release_all()  # the views may be written (in-place load): no stale copies
        local = self._sharded_arrays()
        if not self._tensors:
            return local
        return ShardedStateDict({k: self._expose(v) for k, v in local.tensors.items()},
                                local.specs, local.shapes, local.step, local.hyperparams)

    def _sharded_arrays(self) -> ShardedStateDict:
        """``sharded_state_dict`` with NumPy views, whatever the module holds."""
        tensors: dict[str, np.ndarray] = {}
        specs: dict[str, dict[str, Any]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        replicated = self.strategy is ShardingStrategy.NO_SHARD
        primary = self._is_primary_replica()
        optimizer = self.optimizer
        for unit in self._units:
            layout = unit.layout
            state = self._state_for(unit, optimizer) if optimizer is not None else {}
            pieces = {piece.slot: piece for piece in layout.pieces(self._shard_index)}
            for index, slot in enumerate(layout.slots):
                shapes[slot.name] = slot.shape
                arrays = {slot.name: unit.shard}
                arrays.update({f"optim.{slot.name}.{key}": value for key, value in state.items()})
                spec: dict[str, Any]
                if replicated:
                    spec = {"full_shape": (slot.numel,), "shard_dim": None, "shard_sizes": (),
                            "dtype": layout.dtype}
                    for name, array in arrays.items():
                        tensors[name] = array[slot.offset:slot.offset + slot.numel]
                        specs[name] = dict(spec)
                    continue
                sizes = self._world_sizes(layout.param_shard_sizes(index))
                spec = {"full_shape": (slot.numel,), "shard_dim": 0, "shard_sizes": sizes,
                        "dtype": layout.dtype}
                piece = pieces.get(index)
                for name, array in arrays.items():
                    if piece is None or not primary:
                        tensors[name] = array[0:0]
                    else:
                        tensors[name] = array[piece.shard_start:piece.shard_start + piece.numel]
                    specs[name] = dict(spec)
        hyper = optimizer.hyperparameters() if optimizer is not None else {}
        return ShardedStateDict(tensors, specs, shapes, self._step, hyper)

    async def load_sharded_state_dict(self, tensors: Mapping[str, Any], *,
                                      step: int | None = None) -> None:
        """Copy this rank's pieces (as ``sharded_state_dict`` names and shapes them) in.

        Values may be arrays or CPU tensors. Those that already are the live views (an
        in-place load) are not copied.
        Under HYBRID_SHARD, node 0's pieces are then broadcast to the other replicas.
        ``step`` restores the optimizer step count (Adam bias correction).
        """
        await self._ensure_ready("load_sharded_state_dict")
        self._release_all()
        current = self._sharded_arrays()
        missing = sorted(set(current.tensors) - set(tensors))
        unexpected = sorted(set(tensors) - set(current.tensors))
        if missing or unexpected:
            raise ValueError(f"sharded state dict mismatch: missing {missing}, "
                             f"unexpected {unexpected}")
        for name, target in current.tensors.items():
            _copy_into(target, tensors[name], repr(name))
        if self._replica_group is not None and self.strategy is ShardingStrategy.HYBRID_SHARD:
            for unit in self._units:
                arrays = [unit.shard] + list((unit.state or {}).values())
                for array in arrays:
                    if array.size:
                        await self._replica_group.broadcast(array, 0, timeout=self.timeout)
        if self.strategy is ShardingStrategy.SHARD_GRAD_OP and self._num_shards > 1:
            for unit in self._units:  # whole parameters again from the loaded shards
                if unit.layout.numel:
                    await self._sharding().all_gather(
                        unit.shard, out=unit.full, timeout=self.timeout)
        if step is not None:
            self._step = int(step)

    async def full_state_dict(self, rank0_only: bool = True) -> dict[str, Any]:
        """Whole parameters (original shapes, copies) keyed by parameter name: arrays, or
        torch tensors for a module whose parameters are tensors.

        Every rank must call it (sharded units are all-gathered one at a time). With
        ``rank0_only`` only group rank 0 gets the dict; the others get ``{}``.
        """
        await self._ensure_ready("full_state_dict")
        keep = not rank0_only or self.group.rank == 0
        out: dict[str, Any] = {}
        for unit in self._units:
            flat, temporary = await self._gather_flat(unit, unit.shard, unit.full)
            if keep and flat is not None:
                for slot, view in zip(unit.layout.slots, unit.layout.views(flat)):
                    out[slot.name] = self._expose(view.copy())
            if temporary:
                self._memory.free(flat)
        return out

    async def full_optim_state_dict(self, rank0_only: bool = True) -> dict[str, Any]:
        """The optimizer state gathered whole, in ``netdist.train`` optimizer format.

        ``{"hyperparams": {...}, "state": {param name: {key: array, ["step": int]}}}``
        (Adam entries carry ``"step"``, as ``netdist.train.Adam.state_dict`` does; the
        arrays are torch tensors for a module of tensors). Every rank must call it; with
        ``rank0_only`` the others get ``{}``.
        """
        await self._ensure_ready("full_optim_state_dict")
        optimizer = self.optimizer
        if optimizer is None:
            raise RuntimeError("FSDP.full_optim_state_dict: no optimizer")
        keep = not rank0_only or self.group.rank == 0
        state: dict[str, dict[str, Any]] = {}
        has_step = "exp_avg" in optimizer.state_keys()
        if self._step > 0:
            for unit in self._units:
                for key, value in self._state_for(unit, optimizer).items():
                    local = np.zeros(unit.layout.shard_numel, unit.layout.np_dtype)
                    local[:unit.valid] = value
                    flat, temporary = await self._gather_flat(unit, local, None)
                    if keep and flat is not None:
                        for slot, view in zip(unit.layout.slots, unit.layout.views(flat)):
                            entry = state.setdefault(slot.name, {})
                            entry[key] = self._expose(view.copy())
                            if has_step:
                                entry["step"] = self._step
                    if temporary:
                        self._memory.free(flat)
        if not keep:
            return {}
        return {"hyperparams": optimizer.hyperparameters(), "state": state}

    async def _gather_flat(self, unit: _Unit, local: np.ndarray, whole: np.ndarray | None
                           ) -> tuple[np.ndarray | None, bool]:
        """``(flat, temporary)``: the unit's whole flat buffer of ``local`` shards
        (``whole`` if already held); ``temporary`` buffers are the caller's to free."""
        if unit.layout.numel == 0:
            return None, False
        if whole is not None:
            return whole, False
        if self._num_shards == 1:
            return local, False
        buf = self._memory.alloc("gathered", unit.layout.padded_numel, unit.layout.np_dtype,
                                 zero=False)
        try:
            await self._sharding().all_gather(
                local, out=buf, timeout=self.timeout)
        except BaseException:
            self._memory.free(buf)
            raise
        return buf, True

    def load_full_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy whole parameters (every rank passes the same dict) into local storage.

        No communication: each rank keeps the slice it owns. Names and shapes must match
        ``full_state_dict``'s exactly; values may be arrays or CPU tensors (a
        ``state_dict()``; parameters that require grad are read, not tracked).
        """
        self._check_open("load_full_state_dict")
        self._release_all()
        names = {slot.name for unit in self._units for slot in unit.layout.slots}
        missing = sorted(names - set(state))
        unexpected = sorted(set(state) - names)
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        for unit in self._units:
            layout = unit.layout
            flat = layout.flatten([state[slot.name] for slot in layout.slots])
            if unit.full is not None:
                unit.full[...] = flat
            else:
                lo, hi = layout.shard_bounds(self._shard_index)
                unit.shard[...] = flat[lo:hi]

    def __repr__(self) -> str:
        return (f"<FSDP {self.strategy.name} units={len(self._units)} "
                f"shards={self._num_shards} rank={self.group.rank}>")
