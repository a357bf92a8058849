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
(``netdist.sharding.TensorShardSpec``; this package does not import the checkpoint
layer)::

    sd = fsdp.sharded_state_dict()
    # per rank, no communication (save_distributed):
    save_distributed(sd.tensors, path, group.rank, group.world_size, sd.specs)
    # collectively; the load reshards into any world size / strategy, in place:
    state = {"tensors": {k: ShardedArray(v) if sd.specs[k].shard_dim == 0 else v
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
released, and the group's tag stream is out of step (treat the group as broken). Using
FSDP out of order (after ``aclose``, ``step`` without an optimizer, ``backward`` without
a forward) raises ``FSDPError``.

Structure. This module is the front (``FSDP``); the work is done by flat units:
``fsdp_strategy`` (``ShardingPolicy``: what the strategy shards, and the groups),
``fsdp_units`` (units and their flat storage), ``fsdp_schedule`` (when collectives are
issued and awaited), ``fsdp_state_dict`` (checkpoint adapters) and ``fsdp_stats``
(memory and time accounting).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from netdist.collectives import CollectiveMismatchError
from netdist.errors import FSDPError
from netdist.parallel.flat_param import FlatParamLayout
from netdist.parallel.fsdp_schedule import GatherReduceSchedule
from netdist.parallel.fsdp_state_dict import (
    ShardedStateDict,
    full_optim_state,
    full_params,
    load_full,
    load_sharded_arrays,
    sharded_arrays,
)
from netdist.parallel.fsdp_stats import (
    FSDPTimings,
    MemoryEstimate,
    MemoryStats,
    MemoryTracker,
    Timings,
    estimate_memory,
)
from netdist.parallel.fsdp_strategy import WHOLE_GROUP, ShardingPolicy, ShardingStrategy
from netdist.parallel.fsdp_units import ForwardCtx, Unit, build_units
from netdist.parallel.sharded_optim import ShardedOptimizer, sharded_optimizer_from
from netdist.parallel.tensor_kind import array_of, tensor_of
from netdist.tensors import is_tensor
from netdist.bfloat16 import scaled, widen_bfloat16
from netdist.types import ReduceOp

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
        self._step = 0
        self._ready = False
        self._closed = False
        self._ctx: ForwardCtx | None = None
        self._policy = ShardingPolicy.build(self.strategy, group.world_size, group.rank,
                                            intra_node_size)
        self.intra_node_size = self._policy.intra_node_size
        self._shard_group, self._replica_group = _make_groups(group, self._policy)
        self._memory = MemoryTracker()
        self._units, view = build_units(module, auto_wrap_min_params, self._policy,
                                        self._memory, self.check_module_states)
        self._schedule = GatherReduceSchedule(
            self._policy, self._shard_group, self._replica_group,
            prefetch_depth=prefetch_depth, timeout=timeout,
            compute_in_thread=self.compute_in_thread, memory=self._memory, view=view)

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
    def policy(self) -> ShardingPolicy:
        """What this FSDP's strategy shards on this rank (``ShardingPolicy``)."""
        return self._policy

    @property
    def shard_group(self) -> Group | None:
        """The group parameters are sharded over (None under NO_SHARD)."""
        return self._shard_group

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
        return self._schedule.view.tensors

    def local_shards(self) -> list[Any]:
        """This rank's parameter shard of each unit (real elements, padding excluded;
        views, tensors for a module of tensors)."""
        return [self._schedule.view.expose(u.shard[:u.valid]) for u in self._units]

    def local_grad_shards(self) -> list[Any]:
        """The reduced gradient this rank holds per unit (real elements only; views,
        tensors for a module of tensors)."""
        return [self._schedule.view.expose(u.grad[:u.valid]) for u in self._units]

    def memory_stats(self) -> MemoryStats:
        """Bytes held now by category, and peaks since construction / ``reset_peak_memory``."""
        return self._memory.stats()

    def reset_peak_memory(self) -> None:
        self._memory.reset_peaks()

    def timings(self) -> FSDPTimings:
        return self._schedule.timings.snapshot()

    def reset_timings(self) -> None:
        self._schedule.timings = Timings()

    def memory_estimate(self, strategy: ShardingStrategy | str | None = None, *,
                        intra_node_size: int | None = None) -> MemoryEstimate:
        """Expected bytes per rank under ``strategy`` (default: this FSDP's) for this model,
        this group, the optimizer's state and ``prefetch_depth``.

        HYBRID_SHARD needs ``intra_node_size`` unless it is this FSDP's own strategy.
        """
        strat = self.strategy if strategy is None else ShardingStrategy.parse(strategy)
        world, rank = self.group.world_size, self.group.rank
        size = None
        if strat.per_node:
            size = intra_node_size or self.intra_node_size
            if size is None or world % size:
                raise ValueError(f"{strat.name} estimate needs an intra_node_size dividing "
                                 f"the world size {world}, got {size!r}")
        policy = ShardingPolicy.build(strat, world, rank, size)
        states = len(self.optimizer.state_keys()) if self.optimizer is not None else 0
        return estimate_memory(policy, self.unit_layouts, states, self.prefetch_depth)

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
        await self._schedule.abort(self._units)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise FSDPError(f"FSDP.{what}: this FSDP was closed")

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
        _check_agreement(everyone)
        self._ready = True

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

    async def _forward(self, x: Any, keep_last: bool) -> tuple[Any, ForwardCtx]:
        """Run the units in order (``GatherReduceSchedule.forward``); on failure cancel
        what is in flight."""
        await self._ensure_ready("forward")
        started = time.perf_counter()
        given_tensor = is_tensor(x)
        x = self._schedule.view.to_layers(x, "FSDP.forward input")
        try:
            x, ctxs = await self._schedule.forward(self._units, x, keep_last)
        except BaseException:
            await self._schedule.abort(self._units)
            raise
        finally:
            self._schedule.timings.forward += time.perf_counter() - started
        return _as_given(x, given_tensor, "FSDP.forward output"), ForwardCtx(id(self), ctxs)

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
                raise FSDPError("FSDP.backward: no forward context (call forward first, "
                                "or pass ctx= from forward_with_ctx)")
        if not isinstance(ctx, ForwardCtx) or ctx.owner != id(self) \
                or len(ctx.ctxs) != len(self._units):
            raise ValueError("FSDP.backward: ctx does not come from this FSDP's forward")
        started = time.perf_counter()
        given_tensor = is_tensor(grad_out)
        try:
            grad = await self._schedule.backward(
                self._units, ctx.ctxs,
                self._schedule.view.to_layers(grad_out, "FSDP.backward gradient"))
        except BaseException:
            await self._schedule.abort(self._units)
            raise
        finally:
            self._schedule.timings.backward += time.perf_counter() - started
        return _as_given(grad, given_tensor, "FSDP.backward input gradient")

    def zero_grad(self) -> None:
        """Zero this rank's gradient (shards) in place."""
        for unit in self._units:
            unit.grad[...] = 0

    # -- optimizer ---------------------------------------------------------------------------

    def _state_for(self, unit: Unit) -> dict[str, np.ndarray]:
        """``unit``'s optimizer state, allocated (zeros, shard-sized) on first use."""
        optimizer = self.optimizer
        if unit.state is None:
            keys = optimizer.state_keys() if optimizer is not None else ()
            unit.state = {key: self._memory.alloc("optimizer", unit.valid, unit.layout.np_dtype)
                          for key in keys}
        return unit.state

    def _optimizer(self, what: str) -> ShardedOptimizer:
        optimizer = self.optimizer
        if optimizer is None:
            raise FSDPError(f"FSDP.{what}: no optimizer (pass optimizer= or call "
                            "set_optimizer)")
        return optimizer

    async def step(self) -> None:
        """Update this rank's parameter shards with the sharded optimizer.

        Under SHARD_GRAD_OP the updated shards are then all-gathered so every rank holds
        the whole updated parameters again; other strategies need no communication here.
        """
        await self._ensure_ready("step")
        optimizer = self._optimizer("step")
        started = time.perf_counter()
        schedule = self._schedule
        schedule.release_all(self._units)
        self._step += 1

        async def update(unit: Unit) -> None:
            if unit.valid:
                await schedule.compute(optimizer.apply, unit.shard[:unit.valid],
                                       unit.grad[:unit.valid], self._state_for(unit),
                                       self._step)

        try:
            await schedule.step(self._units, update)
        except BaseException:
            await schedule.abort(self._units)
            raise
        finally:
            schedule.timings.step += time.perf_counter() - started

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
            g = widen_bfloat16(unit.grad[:unit.valid]).astype(np.float64, copy=False)
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
                scaled(unit.grad[:unit.valid], coef, out=unit.grad[:unit.valid])
        return norm

    # -- state dicts -----------------------------------------------------------------------

    def sharded_state_dict(self) -> ShardedStateDict:
        """This rank's pieces of every (flattened) parameter and optimizer state tensor.

        See ``ShardedStateDict`` and the module docstring for how the checkpoint layer
        consumes it. The tensors are views of live storage (torch tensors over it for a
        module whose parameters are tensors). If an optimizer is set, its state is
        included (allocated zero-filled if no step was taken yet, so an in-place load has
        somewhere to land).
        """
        self._check_open("sharded_state_dict")
        self._schedule.release_all(self._units)  # views may be written (in-place load)
        local = self._sharded_arrays()
        view = self._schedule.view
        if not view.tensors:
            return local
        return ShardedStateDict({k: view.expose(v) for k, v in local.tensors.items()},
                                local.specs, local.shapes, local.step, local.hyperparams)

    def _sharded_arrays(self) -> ShardedStateDict:
        """``sharded_state_dict`` with NumPy views, whatever the module holds."""
        optimizer = self.optimizer
        return sharded_arrays(self._units, self._policy,
                              self._state_for if optimizer is not None else None, self._step,
                              optimizer.hyperparameters() if optimizer is not None else {})

    async def load_sharded_state_dict(self, tensors: Mapping[str, Any], *,
                                      step: int | None = None) -> None:
        """Copy this rank's pieces (as ``sharded_state_dict`` names and shapes them) in.

        Values may be arrays or CPU tensors. Those that already are the live views (an
        in-place load) are not copied.
        Under HYBRID_SHARD, node 0's pieces are then broadcast to the other replicas.
        ``step`` restores the optimizer step count (Adam bias correction).
        """
        await self._ensure_ready("load_sharded_state_dict")
        self._schedule.release_all(self._units)
        load_sharded_arrays(self._sharded_arrays(), tensors)
        await self._schedule.sync_loaded(self._units)
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
        return await full_params(self._units, self._schedule, keep)

    async def full_optim_state_dict(self, rank0_only: bool = True) -> dict[str, Any]:
        """The optimizer state gathered whole, in ``netdist.train`` optimizer format.

        ``{"hyperparams": {...}, "state": {param name: {key: array, ["step": int]}}}``
        (Adam entries carry ``"step"``, as ``netdist.train.Adam.state_dict`` does; the
        arrays are torch tensors for a module of tensors). Every rank must call it; with
        ``rank0_only`` the others get ``{}``.
        """
        await self._ensure_ready("full_optim_state_dict")
        optimizer = self._optimizer("full_optim_state_dict")
        keep = not rank0_only or self.group.rank == 0
        state: dict[str, dict[str, Any]] = {}
        if self._step > 0:
            step = self._step if "exp_avg" in optimizer.state_keys() else None
            state = await full_optim_state(self._units, self._schedule, self._state_for,
                                           keep, step)
        if not keep:
            return {}
        return {"hyperparams": optimizer.hyperparameters(), "state": state}

    def load_full_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy whole parameters (every rank passes the same dict) into local storage.

        No communication: each rank keeps the slice it owns. Names and shapes must match
        ``full_state_dict``'s exactly; values may be arrays or CPU tensors (a
        ``state_dict()``; parameters that require grad are read, not tracked).
        """
        self._check_open("load_full_state_dict")
        self._schedule.release_all(self._units)
        load_full(self._units, self._policy, state)

    def __repr__(self) -> str:
        return (f"<FSDP {self.strategy.name} units={len(self._units)} "
                f"shards={self._policy.num_shards} rank={self.group.rank}>")


def _make_groups(group: Group, policy: ShardingPolicy) -> tuple[Group | None, Group | None]:
    """The shard and replica groups of ``policy.group_plan()`` (subgroups created in
    plan order, the same on every rank)."""
    plan = policy.group_plan()
    subgroups = [group.new_group(list(ranks)) for ranks in plan.subgroups]

    def resolve(index: int | None) -> Group | None:
        if index is None:
            return None
        return group if index == WHOLE_GROUP else subgroups[index]

    return resolve(plan.shard), resolve(plan.replica)


def _check_agreement(everyone: list[dict[str, Any]]) -> None:
    """``CollectiveMismatchError`` naming the first rank whose FSDP differs from rank 0's."""
    if any(entry.get("crc") is None for entry in everyone):  # a rank opted out
        for entry in everyone:
            entry["crc"] = None
    first = everyone[0]
    for rank, other in enumerate(everyone):
        if other == first:
            continue
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


def _as_given(obj: Any, tensor: bool, what: str) -> Any:
    """A result in the kind the caller gave: a tensor, or else an array."""
    return tensor_of(obj, what) if tensor else array_of(obj, what)
