"""Pipeline-parallel training over a ``Transport``: GPipe and 1F1B, optionally 2-D.

Each rank holds one stage: a contiguous slice of the model's layers
(``PipelineStage.select``). A mini-batch is split into ``m`` micro-batches
(``micro_batch_bounds``); activations travel forward ``stage s -> s + 1`` and activation
gradients backward ``s + 1 -> s``, each message on its own transport tag
(``message_tag``: per step, micro-batch and direction, in a tag range the pipeline
reserves from its group, ``Group.reserve_tags``), in the order
fixed up front by the pure schedule (``netdist.parallel.schedule``) and executed through
its ``dispatch``. Sends run as tasks of a ``TaskGroup`` that lives for one step, so a
stage keeps computing while its bytes travel and no send outlives the step; receives
block, and every wait is bounded by ``timeout``.

Gradients accumulate over the micro-batches; micro-batch ``i`` of ``n_i`` rows weighs its
loss by ``n_i / B``, so the accumulated gradient is exactly the gradient of the full
mini-batch mean (``1 / m`` per micro-batch when ``m`` divides ``B``). The loss function
must therefore return the *mean* over its micro-batch, as ``softmax_cross_entropy`` and
``mse_loss`` do. The optimizer steps once per mini-batch.

2-D parallelism: ``data_parallel_size`` replicas of the pipeline, rank layout
``rank = replica * num_stages + stage`` (see ``netdist.parallel.stages``). After the last
backward each stage's gradients are averaged (``ReduceOp.MEAN``) with the same stage of
every other replica, in one flat bucket per dtype, through a ``Group.new_group`` subgroup.

Failure: a timeout or a lost peer raises the transport's own exception
(``NetdistTimeoutError`` / ``PeerLostError``, naming the peer rank) with a note saying
which stage, step and action was running (a failed send raises its own exception, not
an ``ExceptionGroup``); pending sends are cancelled. A stage that
fails stops talking, so its neighbours fail in turn (lost peer when its process exits,
timeout otherwise): no rank waits forever.

This module does not import ``netdist.train``: a stage's layers are anything with the
Module API (``forward(x) -> (y, ctx)``, ``backward(ctx, g) -> g_in``, ``parameters()``).

Torch tensors. Inputs and targets may be CPU torch tensors, and layers and ``loss_fn``
may return tensors (activations, loss gradients, input gradients): they are read
zero-copy through ``netdist.tensors`` and travel as their bytes (bfloat16 included, with
or without ``ml_dtypes``). A stage whose layers compute with torch (``tensors=True``, the
default when its parameters hold tensors) is handed tensors: micro-batches, received
activations and gradients, targets (views, no copies), and ``predict`` returns a tensor
there; a NumPy stage is handed arrays. Loss gradients are weighted by ``n_i / B`` in
their own dtype (bfloat16 in float32, rounded once, as torch multiplies), and the
data-parallel all-reduce averages bfloat16 gradients as torch rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from netdist.collectives.tags import reserve_tags
from netdist.collectives.tags import TagRange
from netdist.errors import PipelineError
from netdist.parallel.schedule import (
    PIPELINE_OWNER,
    VALIDATE_OFFSET,
    Action,
    Direction,
    build_schedule,
    dispatch,
    message_tag,
)
from netdist.parallel.stages import (
    PipelineParallelConfig,
    PipelineStage,
    micro_batch_bounds,
    split_into_stages,
)
from netdist.parallel.tensor_kind import array_of, holds_tensors, tensor_of
from netdist.sharding import chunk_bounds
from netdist.tensors import is_tensor
from netdist.transport.base import Transport
from netdist.bfloat16 import scaled
from netdist.types import ReduceOp

if TYPE_CHECKING:
    from netdist.collectives import Group

__all__ = [
    "PipelineParallel",
    "PipelineStepStats",
    "LossFn",
    "stash_nbytes",
    "measure_layer_costs",
    "train_pipelined",
    "PipelineTrainResult",
]

LossFn = Callable[[Any, Any], tuple[Any, Any]]
"""``loss_fn(prediction, target) -> (mean loss over the micro-batch, d loss / d prediction)``
(arrays, or tensors on a stage of tensors; the loss anything ``float()`` takes)."""

@dataclass(frozen=True, slots=True)
class PipelineStepStats:
    """What one ``train_step`` did on this stage (for benchmarks and logs).

    ``compute_seconds`` is time inside forward, loss and backward; everything else of
    ``wall_seconds`` is waiting (receives, send completion, the data-parallel
    all-reduce), so ``idle_fraction`` is the measured bubble of this stage.
    """

    step: int
    wall_seconds: float
    compute_seconds: float
    """``forward_seconds + backward_seconds``."""
    forward_seconds: float
    """Forwards (and the loss, on the last stage)."""
    backward_seconds: float
    allreduce_seconds: float
    peak_stashed_micro_batches: int
    peak_stash_bytes: int
    bytes_sent: int
    bytes_received: int

    @property
    def idle_fraction(self) -> float:
        """Share of the step's pipeline phase (excluding the all-reduce) spent not computing."""
        pipeline = self.wall_seconds - self.allreduce_seconds
        if pipeline <= 0:
            return 0.0
        return max(0.0, 1.0 - self.compute_seconds / pipeline)


def stash_nbytes(obj: Any) -> int:
    """Bytes of array memory reachable from a forward ``ctx`` (each buffer counted once).

    Walks lists, tuples, dicts and plain objects. An array (or torch tensor) counts its
    own ``nbytes`` (a view of a row slice counts the slice, not the whole batch); the
    same memory reached twice (same address and size) counts once.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [obj]
    visited: set[int] = set()
    while stack:
        item = stack.pop()
        if id(item) in visited:
            continue
        visited.add(id(item))
        if isinstance(item, np.ndarray) or is_tensor(item):
            key = ((item.__array_interface__["data"][0], item.nbytes)
                   if isinstance(item, np.ndarray)
                   else (item.data_ptr(), item.numel() * item.element_size()))
            if key not in seen:
                seen.add(key)
                total += key[1]
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
    return total


class _LayerChain:
    """Apply a stage's layers in order, Module-style (``ctx`` is the list of layer ctxs)."""

    def __init__(self, layers: Sequence[Any]) -> None:
        for index, layer in enumerate(layers):
            for method in ("forward", "backward", "parameters"):
                if not callable(getattr(layer, method, None)):
                    raise TypeError(
                        f"stage layer {index} ({type(layer).__name__}) has no {method}(); "
                        f"expected the netdist.train Module API")
        self.layers = list(layers)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, list[Any]]:
        ctxs = []
        for layer in self.layers:
            x, ctx = layer.forward(x)
            ctxs.append(ctx)
        return x, ctxs

    def backward(self, ctx: list[Any], grad_out: np.ndarray) -> np.ndarray:
        for layer, layer_ctx in zip(reversed(self.layers), reversed(ctx)):
            grad_out = layer.backward(layer_ctx, grad_out)
        return grad_out

    def parameters(self) -> list[Any]:
        return [p for layer in self.layers for p in layer.parameters()]


class PipelineParallel:
    """This rank's stage of a pipelined model; ``await train_step(x, y)`` per mini-batch.

    Build one on every rank of the job with the same ``config``::

        stages = split_into_stages(len(model.layers), config.num_stages)
        stage = stages[config.stage_of(transport.rank)]
        pipe = PipelineParallel(transport, stage.select(model.layers), config,
                                loss_fn=softmax_cross_entropy, optimizer_factory=...)

    ``layers``: this stage's layers (a list of Modules, or one Module such as a
    ``Sequential`` slice). ``loss_fn`` is needed on last-stage ranks only. The optimizer
    is built from this stage's parameters with ``optimizer_factory(params)`` or given
    directly as ``optimizer`` (stepped once per mini-batch; without either, gradients are
    left in ``param.grad``). ``group``: the world this pipeline runs in (default: every
    rank of ``transport``); its size must be ``num_stages * data_parallel_size``. With
    ``data_parallel_size > 1`` a ``netdist.collectives.Group`` is needed (created over
    ``transport`` when ``group`` is None). ``timeout`` bounds every wait (None: the
    transport's default). ``offload_compute`` runs forward, loss and backward in a worker
    thread so the event loop keeps moving this stage's bytes meanwhile (NumPy releases
    the GIL in BLAS calls); off by default, as each call then pays a thread hop.
    ``tensors``: hand this stage's layers and ``loss_fn`` torch tensors (module
    docstring); default: True when the stage's parameters hold tensors, False for NumPy
    parameters or none (pass True for a parameter-free stage of torch layers).
    ``tags``: the transport tags of this pipeline's messages; by default the next range
    reserved among its ranks (``Group.reserve_tags``), so two pipelines over the same
    ranks never share a tag when every rank builds them in the same order.
    """

    def __init__(self, transport: Transport, layers: Sequence[Any] | Any,
                 config: PipelineParallelConfig, *, loss_fn: LossFn | None = None,
                 optimizer: Any | None = None,
                 optimizer_factory: Callable[[list[Any]], Any] | None = None,
                 group: Group | None = None, timeout: float | None = None,
                 tags: TagRange | None = None, offload_compute: bool = False,
                 tensors: bool | None = None) -> None:
        if not isinstance(config, PipelineParallelConfig):
            raise TypeError(f"config must be a PipelineParallelConfig, got "
                            f"{type(config).__name__}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if optimizer is not None and optimizer_factory is not None:
            raise ValueError("pass optimizer or optimizer_factory, not both")
        self.transport = transport
        self.config = config
        self.timeout = timeout
        self.offload_compute = bool(offload_compute)
        if group is not None:
            if not getattr(group, "is_member", True):
                raise PipelineError(
                    f"transport rank {transport.rank} is not a member of the pipeline's "
                    f"group {tuple(group.ranks)}")
            world_rank, world_size = group.rank, group.world_size
            self._global_ranks: tuple[int, ...] = tuple(group.ranks)
        else:
            world_rank, world_size = transport.rank, transport.world_size
            self._global_ranks = tuple(range(world_size))
        config.check_world_size(world_size)
        message_tag(0, config.num_micro_batches - 1, Direction.GRAD,
                    config.num_micro_batches)  # raises if m is too large
        self.tags = reserve_tags(transport, self._global_ranks, PIPELINE_OWNER) \
            if tags is None else tags
        """This pipeline's transport tags (by default the next range reserved among its
        ranks: pipelines built in the same order on every rank agree)."""
        self.rank = world_rank
        self.stage = config.stage_of(world_rank)
        self.replica = config.replica_of(world_rank)
        self.num_stages = config.num_stages
        self.is_first = self.stage == 0
        self.is_last = self.stage == config.num_stages - 1
        if isinstance(layers, (list, tuple)):
            self.module: Any = _LayerChain(layers)
        else:
            self.module = _LayerChain([layers])
        self.parameters: list[Any] = self.module.parameters()
        held = holds_tensors(self.parameters, f"pipeline stage {self.stage}")
        self.tensors = held if tensors is None else bool(tensors)
        """Layers and ``loss_fn`` get torch tensors (see the module docstring)."""
        if self.is_last and loss_fn is None:
            raise PipelineError(
                f"rank {world_rank} holds the last stage ({self.stage}) and computes the "
                f"loss: pass loss_fn")
        self.loss_fn = loss_fn
        # a stage of parameter-free layers (activations only) has nothing to optimise
        self.optimizer = (optimizer_factory(self.parameters)
                          if optimizer_factory is not None and self.parameters else optimizer)
        self.schedule: tuple[Action, ...] = build_schedule(
            config.schedule, config.num_stages, config.num_micro_batches)[self.stage]
        self.prev_rank = (self._global_ranks[config.rank_of(self.stage - 1, self.replica)]
                          if not self.is_first else None)
        self.next_rank = (self._global_ranks[config.rank_of(self.stage + 1, self.replica)]
                          if not self.is_last else None)
        self.dp_group: Group | None = None
        if config.data_parallel_size > 1:
            self.dp_group = self._make_dp_group(group)
        self.step_count = 0
        self._last_loss: float | None = None
        self._validated = False
        self.last_stats: PipelineStepStats | None = None

    # -- set-up ----------------------------------------------------------------------

    def _make_dp_group(self, group: Group | None) -> Group:
        if group is None:
            from netdist.collectives import Group as _Group  # collectives sit below parallel
            group = _Group(self.transport, timeout=self.timeout)
        mine = None
        for stage in range(self.config.num_stages):  # same order on every rank
            sub = group.new_group(list(self.config.data_parallel_ranks(stage)))
            if stage == self.stage:
                mine = sub
        if mine is None:  # pragma: no cover - stage is always in range
            raise PipelineError(f"rank {self.rank}: no data-parallel group for stage {self.stage}")
        return mine

    def _fingerprint(self) -> np.ndarray:
        c = self.config
        return np.array([c.num_stages, c.num_micro_batches, c.schedule_kind.wire_id,
                         c.data_parallel_size, self.stage, self.replica], dtype=np.int64)

    async def validate(self) -> None:
        """Check that both pipeline neighbours run the same configuration (one round trip).

        Called automatically before the first step. Raises ``PipelineError`` naming the
        neighbour and both configurations on a mismatch; a neighbour that never answers
        raises the transport's timeout.
        """
        tag = self.tags.tag(VALIDATE_OFFSET)
        mine = self._fingerprint()
        neighbours = [(peer, offset) for peer, offset in ((self.prev_rank, -1),
                                                          (self.next_rank, +1))
                      if peer is not None]
        try:
            async with _background_sends() as sends:
                for peer, _ in neighbours:
                    sends.create_task(self.transport.send(peer, mine, tag=tag,
                                                          timeout=self.timeout))
                for peer, offset in neighbours:
                    theirs = await self.transport.recv(peer, tag=tag, timeout=self.timeout)
                    self._check_fingerprint(peer, offset, mine, theirs)
        except Exception as exc:
            exc.add_note(f"pipeline rank {self.rank} (stage {self.stage}, replica "
                         f"{self.replica}): configuration handshake with its neighbours")
            raise
        self._validated = True

    def _check_fingerprint(self, peer: int, offset: int, mine: np.ndarray,
                           theirs: np.ndarray) -> None:
        expected = mine.copy()
        expected[4] = self.stage + offset
        if theirs.shape != expected.shape or not np.array_equal(theirs, expected):
            raise PipelineError(
                f"pipeline configuration mismatch between rank {self.rank} (stage "
                f"{self.stage}) and rank {peer}: expected [stages, micro_batches, "
                f"schedule, replicas, stage, replica] = {expected.tolist()}, got "
                f"{np.asarray(theirs).tolist()}")

    # -- one mini-batch ----------------------------------------------------------------

    def _split_batch(self, data: Any, what: str) -> list[np.ndarray] | None:
        if data is None:
            return None
        data = np.asarray(array_of(data, f"pipeline {what}"))
        if data.ndim == 0:
            raise PipelineError(f"{what} must have a batch dimension, got a scalar")
        bounds = micro_batch_bounds(data.shape[0], self.config.num_micro_batches)
        return [data[start:stop] for start, stop in bounds]

    async def train_step(self, inputs: Any = None, targets: Any = None) -> float | None:
        """Run one mini-batch through the pipeline and step the optimizer once.

        ``inputs`` is needed on first-stage ranks, ``targets`` on last-stage ranks (other
        ranks may pass them; they are ignored). Returns this replica's mini-batch mean
        loss on last-stage ranks and ``None`` elsewhere. Zeroes this stage's gradients
        first. On an exception (timeout, lost peer, bad input) no optimizer step happens
        and the gradients are partial; the pipeline should be torn down. Inputs and
        targets may be arrays or CPU tensors.
        """
        await self.forward_backward(inputs, targets, zero_grad=True)
        if self.optimizer is not None:
            self.optimizer.step()
        return self._last_loss

    async def forward_backward(self, inputs: Any = None, targets: Any = None, *,
                               zero_grad: bool = True) -> float | None:
        """``train_step`` without the optimizer step: leaves the averaged gradients in
        ``param.grad`` (accumulating into them when ``zero_grad`` is False)."""
        micro_inputs = self._split_batch(inputs, "inputs") if self.is_first else None
        micro_targets = self._split_batch(targets, "targets") if self.is_last else None
        if self.is_first and micro_inputs is None:
            raise PipelineError(f"rank {self.rank} holds the first stage: pass inputs")
        if self.is_last and micro_targets is None:
            raise PipelineError(f"rank {self.rank} holds the last stage: pass targets")
        if not self._validated:
            await self.validate()
        if zero_grad:
            for p in self.parameters:
                array_of(p.grad, "parameter gradient")[...] = 0
        started = time.perf_counter()
        stats = _StepCounters()
        self._last_loss = await self._run_schedule(micro_inputs, micro_targets, stats)
        reduce_started = time.perf_counter()
        if self.dp_group is not None:
            await self._all_reduce_grads()
        finished = time.perf_counter()
        self.last_stats = PipelineStepStats(
            step=self.step_count,
            wall_seconds=finished - started,
            compute_seconds=stats.forward + stats.backward,
            forward_seconds=stats.forward,
            backward_seconds=stats.backward,
            allreduce_seconds=finished - reduce_started,
            peak_stashed_micro_batches=stats.peak_stashed,
            peak_stash_bytes=stats.peak_bytes,
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
        )
        self.step_count += 1
        return self._last_loss

    async def _run_schedule(self, micro_inputs: list[np.ndarray] | None,
                            micro_targets: list[np.ndarray] | None,
                            stats: _StepCounters) -> float | None:
        """Execute this stage's schedule for one mini-batch (``dispatch`` to a
        ``_StepRun``); on failure, note where on the exception and cancel the sends."""
        action: Action | None = None
        try:
            async with _background_sends() as sends:
                run = _StepRun(self, self.step_count, micro_inputs, micro_targets, stats,
                               sends)
                for action in self.schedule:
                    await dispatch(action, run)
                action = None
        except BaseException as exc:
            where = f"during {action}" if action is not None else "completing sends"
            if isinstance(exc, Exception):
                exc.add_note(f"pipeline rank {self.rank} (stage {self.stage}, replica "
                             f"{self.replica}), step {self.step_count}, {where}")
            raise
        return run.loss_total if self.is_last else None

    def _neighbour(self, offset: int) -> int:
        """The rank of stage ``stage + offset`` (-1: previous, +1: next) in this replica."""
        return self._peer(self.prev_rank if offset < 0 else self.next_rank)

    def _peer(self, rank: int | None) -> int:
        """``prev_rank`` / ``next_rank`` where the schedule needs it (None would be a bug)."""
        if rank is None:
            raise PipelineError(f"rank {self.rank} (stage {self.stage}): the schedule talks "
                                "to a neighbouring stage this rank does not have")
        return rank

    def _for_layers(self, data: np.ndarray) -> Any:
        """An array as this stage's layers take it: a tensor over it on a stage of tensors."""
        return tensor_of(data, "pipeline stage input") if self.tensors else data

    def _forward(self, mb: int, x: Any, target: Any
                 ) -> tuple[np.ndarray, Any, float, np.ndarray | None]:
        """Forward one micro-batch; on the last stage also the loss and its gradient
        (results as arrays, views of any tensors the layers return)."""
        y, ctx = self.module.forward(x)
        if target is None:
            return array_of(y, f"micro-batch {mb} activation"), ctx, 0.0, None
        if len(y) != len(target):
            raise PipelineError(
                f"micro-batch {mb}: the last stage got {len(y)} activation rows for "
                f"{len(target)} target rows; inputs and targets must have the same batch "
                f"size")
        loss_fn = self.loss_fn
        if loss_fn is None:
            raise PipelineError(f"rank {self.rank} (stage {self.stage}) got targets but has "
                                "no loss_fn")
        loss, grad = loss_fn(y, target)
        return (array_of(y, f"micro-batch {mb} prediction"), ctx, float(loss),
                np.asarray(array_of(grad, f"micro-batch {mb} loss gradient")))

    async def _all_reduce_grads(self) -> None:
        """Average this stage's gradients over its replicas: one flat bucket per dtype."""
        if self.dp_group is None:
            return
        by_dtype: dict[np.dtype[Any], list[np.ndarray]] = {}
        for p in self.parameters:
            grad = array_of(p.grad, "parameter gradient")
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for dtype in sorted(by_dtype, key=lambda d: d.str):  # same order on every replica
            grads = by_dtype[dtype]
            flat = np.concatenate([g.reshape(-1) for g in grads]) if grads else \
                np.empty(0, dtype)
            try:
                await self.dp_group.all_reduce(flat, op=ReduceOp.MEAN, timeout=self.timeout)
            except Exception as exc:
                exc.add_note(f"pipeline rank {self.rank} (stage {self.stage}), step "
                             f"{self.step_count}: data-parallel gradient all-reduce")
                raise
            offset = 0
            for g in grads:
                size = g.size
                g[...] = flat[offset:offset + size].reshape(g.shape)
                offset += size

    # -- inference -----------------------------------------------------------------------

    async def predict(self, inputs: Any = None) -> Any:
        """Forward only, micro-batched through the pipeline; the output on the last stage.

        Uses the activation direction of step tags like ``train_step`` and advances the
        step counter. Returns the concatenated output on last-stage ranks (a tensor on a
        stage of tensors, or when ``inputs`` was a tensor), else None.
        """
        if not self._validated:
            await self.validate()
        m = self.config.num_micro_batches
        step = self.step_count
        self.step_count += 1
        micro = self._split_batch(inputs, "inputs") if self.is_first else None
        if self.is_first and micro is None:
            raise PipelineError(f"rank {self.rank} holds the first stage: pass inputs")
        outputs = []
        async with _background_sends() as sends:
            for mb in range(m):
                tag = self.tags.tag(message_tag(step, mb, Direction.ACTIVATION, m))
                if micro is not None:
                    x = micro[mb]
                else:
                    x = await self.transport.recv(self._peer(self.prev_rank), tag=tag,
                                                  timeout=self.timeout)
                y = array_of(self.module.forward(self._for_layers(x))[0],
                             f"micro-batch {mb} activation")
                if self.is_last:
                    outputs.append(y)
                else:
                    sends.create_task(self.transport.send(
                        self._peer(self.next_rank), np.ascontiguousarray(y), tag=tag,
                        timeout=self.timeout))
        if not self.is_last:
            return None
        output = np.concatenate(outputs)
        return tensor_of(output, "predict") if self.tensors or is_tensor(inputs) else output


@dataclass(slots=True)
class _StepCounters:
    forward: float = 0.0
    backward: float = 0.0
    peak_stashed: int = 0
    peak_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass(slots=True, eq=False)
class _StepRun:
    """One mini-batch on one stage: the runtime's ``ActionExecutor`` (see
    ``netdist.parallel.schedule.dispatch``). Holds what travels between actions."""

    pipe: PipelineParallel
    step: int
    micro_inputs: list[np.ndarray] | None
    micro_targets: list[np.ndarray] | None
    stats: _StepCounters
    sends: asyncio.TaskGroup
    received: dict[int, np.ndarray] = field(default_factory=dict)  # incoming act. / grad
    outputs: dict[int, np.ndarray] = field(default_factory=dict)   # activation / grad to send
    stash: dict[int, tuple[Any, int]] = field(default_factory=dict)  # (ctx, bytes)
    loss_grads: dict[int, np.ndarray] = field(default_factory=dict)
    stash_bytes: int = 0
    loss_total: float = 0.0
    batch_rows: int = 0                    # rows of this replica's mini-batch (last stage)

    def __post_init__(self) -> None:
        targets = self.micro_targets
        self.batch_rows = sum(len(t) for t in targets) if targets is not None else 0

    def _tag(self, action: Action, direction: Direction) -> int:
        m = self.pipe.config.num_micro_batches
        return self.pipe.tags.tag(message_tag(self.step, action.micro_batch, direction, m))

    async def recv(self, action: Action, direction: Direction, offset: int) -> None:
        pipe = self.pipe
        peer = pipe._neighbour(offset)
        with pipe.transport.recorder.span("pipeline", action.kind.value, step=self.step,
                                          stage=pipe.stage, micro_batch=action.micro_batch,
                                          peer=peer) as args:
            data = await pipe.transport.recv(peer, tag=self._tag(action, direction),
                                             timeout=pipe.timeout)
            args["bytes"] = data.nbytes
        self.stats.bytes_received += data.nbytes
        self.received[action.micro_batch] = data

    async def send(self, action: Action, direction: Direction, offset: int) -> None:
        pipe = self.pipe
        peer, tag = pipe._neighbour(offset), self._tag(action, direction)
        payload = np.ascontiguousarray(self.outputs.pop(action.micro_batch))
        self.stats.bytes_sent += payload.nbytes
        self.sends.create_task(pipe.transport.send(peer, payload, tag=tag,
                                                   timeout=pipe.timeout))
        # let the send hand its bytes to the socket before the next compute holds the
        # loop (forward/backward run synchronously)
        await asyncio.sleep(0)

    async def forward(self, action: Action) -> None:
        pipe, mb, stats = self.pipe, action.micro_batch, self.stats
        x = pipe._for_layers(self.micro_inputs[mb] if self.micro_inputs is not None
                             else self.received.pop(mb))
        target = (pipe._for_layers(self.micro_targets[mb])
                  if self.micro_targets is not None else None)
        t0 = time.perf_counter()
        with pipe.transport.recorder.span("pipeline", "forward", step=self.step,
                                          stage=pipe.stage, micro_batch=mb) as args:
            if pipe.offload_compute:
                y, ctx, loss, grad = await asyncio.to_thread(pipe._forward, mb, x, target)
            else:
                y, ctx, loss, grad = pipe._forward(mb, x, target)
            args["bytes"] = y.nbytes
        stats.forward += time.perf_counter() - t0
        if target is not None:
            if grad is None:
                raise PipelineError(f"micro-batch {mb}: the last stage computed "
                                    "a loss but no loss gradient")
            weight = len(target) / self.batch_rows
            self.loss_total += weight * loss
            self.loss_grads[mb] = scaled(grad, weight)
        else:
            self.outputs[mb] = y
        nbytes = stash_nbytes(ctx)
        self.stash[mb] = (ctx, nbytes)
        self.stash_bytes += nbytes
        stats.peak_stashed = max(stats.peak_stashed, len(self.stash))
        stats.peak_bytes = max(stats.peak_bytes, self.stash_bytes)

    async def backward(self, action: Action) -> None:
        pipe, mb = self.pipe, action.micro_batch
        ctx, nbytes = self.stash.pop(mb)
        grad_out = pipe._for_layers(self.loss_grads.pop(mb) if pipe.is_last
                                    else self.received.pop(mb))
        t0 = time.perf_counter()
        with pipe.transport.recorder.span("pipeline", "backward", step=self.step,
                                          stage=pipe.stage, micro_batch=mb):
            if pipe.offload_compute:
                grad_in = await asyncio.to_thread(pipe.module.backward, ctx, grad_out)
            else:
                grad_in = pipe.module.backward(ctx, grad_out)
        self.stats.backward += time.perf_counter() - t0
        del ctx
        self.stash_bytes -= nbytes
        if not pipe.is_first:
            self.outputs[mb] = array_of(grad_in, f"micro-batch {mb} input gradient")


@contextlib.asynccontextmanager
async def _background_sends() -> AsyncIterator[asyncio.TaskGroup]:
    """A ``TaskGroup`` for sends that run while the stage goes on: leaving it waits for
    every send; a failure (of a send, or of the body) cancels the others and is raised
    as itself rather than wrapped in an ``ExceptionGroup``, so callers catch the
    transport's own ``PeerLostError`` / ``NetdistTimeoutError``."""
    try:
        async with asyncio.TaskGroup() as group:
            yield group
    except BaseExceptionGroup as failed:
        raise _first_error(failed) from None


def _first_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first failure in ``group`` that is not a cancellation (else the first)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


def measure_layer_costs(layers: Sequence[Any], sample: np.ndarray, *,
                        repeats: int = 3) -> list[float]:
    """Measured forward+backward seconds per layer on ``sample`` (a cost model for
    ``balance_stages``); the minimum over ``repeats`` runs, gradients restored after."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    saved = [[p.grad.copy() for p in layer.parameters()] for layer in layers]
    costs: list[float] = []
    x = np.asarray(sample)
    try:
        for layer in layers:
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                y, ctx = layer.forward(x)
                layer.backward(ctx, np.ones_like(y))
                best = min(best, time.perf_counter() - t0)
            costs.append(best)
            x = layer.forward(x)[0]
    finally:
        for layer, grads in zip(layers, saved):
            for p, g in zip(layer.parameters(), grads):
                p.grad[...] = g
    return costs


@dataclass(frozen=True, slots=True)
class PipelineTrainResult:
    """What ``train_pipelined`` did on this rank."""

    losses: tuple[float | None, ...]
    """Per step: this replica's mini-batch mean loss on last-stage ranks, else None."""
    stage: PipelineStage
    """The layers this rank trained."""
    pipeline: PipelineParallel
    """The runtime, for ``predict`` (evaluation) and ``last_stats``."""


async def train_pipelined(transport: Transport, layers: Sequence[Any],
                          batches: Iterable[tuple[np.ndarray, np.ndarray]],
                          config: PipelineParallelConfig, *, loss_fn: LossFn,
                          optimizer_factory: Callable[[list[Any]], Any],
                          stages: Sequence[PipelineStage] | None = None,
                          group: Group | None = None, timeout: float | None = None,
                          on_step: Callable[[int, float | None], None] | None = None,
                          ) -> PipelineTrainResult:
    """Train the full model ``layers`` pipelined: this rank keeps only its stage's slice.

    The hook for ``netdist demo --pipeline-stages N``. Every rank builds the same full
    layer list (same seed) and calls this with the same global mini-batches ``(x, y)``;
    replica ``r`` trains on rows ``chunk_bounds(B, data_parallel_size)[r]`` of each (the
    result equals single-process training on the full batch when ``data_parallel_size``
    divides ``B``). ``stages`` defaults to ``split_into_stages(len(layers), num_stages)``
    (pass ``balance_stages(...)`` for a cost-balanced cut). ``on_step(step, loss)`` is
    called after each step on every rank (``loss`` is None off the last stage). Layers
    outside this rank's stage are left untouched (stale).
    """
    if stages is None:
        stages = split_into_stages(len(layers), config.num_stages)
    if len(stages) != config.num_stages:
        raise PipelineError(f"{len(stages)} stages given for num_stages={config.num_stages}")
    if stages[-1].end_layer != len(layers) or stages[0].start_layer != 0 or any(
            a.end_layer != b.start_layer for a, b in zip(stages, stages[1:])):
        raise PipelineError(
            f"stages {[(s.start_layer, s.end_layer) for s in stages]} do not cover the "
            f"{len(layers)} layers contiguously")
    world_rank = group.rank if group is not None else transport.rank
    stage = stages[config.stage_of(world_rank)]
    replica = config.replica_of(world_rank)
    pipe = PipelineParallel(transport, stage.select(layers), config, loss_fn=loss_fn,
                            optimizer_factory=optimizer_factory, group=group, timeout=timeout)
    losses: list[float | None] = []
    for index, (x, y) in enumerate(batches):
        rows = len(x)
        if len(y) != rows:
            raise PipelineError(f"batch {index}: {rows} input rows but {len(y)} targets")
        if rows < config.data_parallel_size:
            raise PipelineError(f"batch {index} has {rows} rows for "
                                f"{config.data_parallel_size} replicas")
        start, stop = chunk_bounds(rows, config.data_parallel_size)[replica]
        loss = await pipe.train_step(x[start:stop] if pipe.is_first else None,
                                     y[start:stop] if pipe.is_last else None)
        losses.append(loss)
        if on_step is not None:
            on_step(index, loss)
    return PipelineTrainResult(losses=tuple(losses), stage=stage, pipeline=pipe)
