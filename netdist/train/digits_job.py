"""The demo job: a data-parallel MLP on scikit-learn's 8x8 digits.

``train_worker(transport, config)`` runs one rank. Every training rank builds the same
model from the seed, trains on its own disjoint shard of each epoch (``shard_indices``),
and averages gradients through the configured update path, so the replicas stay
identical (exactly so for the synchronous modes). The first training rank prints a
progress line per epoch and the final test accuracy::

    epoch  3/20  step    36/240  loss 0.2134  samples/s 10,234  comm 23.4%  sent 73.1 KiB/step
    final test accuracy: 97.2%

``loss`` is that rank's mean training loss over the epoch, ``samples/s`` counts every
training rank's samples, ``comm`` is the share of the epoch's wall time spent inside the
aggregator, ``sent`` the gradient payload the reporting rank put on the wire per step.

Update paths, chosen by name (``--aggregator``); ``update_factories()`` maps each name to
an async factory returning an ``UpdatePath``, and callers may pass their own table:

- ``ring``: bucketed all-reduce (``AllReduceAggregator``, gradients stored in the
  buckets) + local SGD;
- ``topk``: top-k sparsification with error feedback (``TopKAggregator``) + local SGD;
- ``fp16``: bucketed all-reduce in float16 + local SGD;
- ``ps``: synchronous parameter server on rank 0 (``netdist.ps.ParameterServer``) + local SGD;
- ``ps-sharded`` / ``ps-async``: ``netdist.train.ps_paths.demo_update_path`` -- parameters
  partitioned across servers co-located with the first ``NETDIST_PS_SERVERS`` ranks,
  SGD on the servers; ``ps-async`` with the staleness bound ``NETDIST_PS_MAX_STALENESS``.

Checkpointing (``checkpoint_dir``) saves the model, the optimizer state, the progress
counters and the top-k residuals (per rank) with ``netdist.checkpoint.save`` every
``checkpoint_every`` steps and at the end; ``resume`` continues from the newest complete
checkpoint, on the same data order, so an interrupted run ends where an uninterrupted one
would. Before the first step every rank creates the directory and writes and removes a
probe file there (``checkpoint_dir_problem``), and every rank raises the same
``ConfigError`` naming the ranks, the path and the reason if any could not: an unusable
directory is found before training, not at the first save. A checkpoint written for
another model (another ``hidden``) is refused on resume with a ``ConfigError`` naming
each differing parameter with both shapes. ``ps-sharded`` / ``ps-async`` keep the
optimizer on the servers and cannot checkpoint yet.

Pipeline parallelism (``pipeline_stages`` = P > 0, ``--pipeline-stages``): the world of
``W`` ranks forms ``W / P`` replicas of a P-stage pipeline (``netdist.parallel.pipeline``;
rank layout ``rank = replica * P + stage``). Every rank builds the same seeded MLP and keeps
only its stage's slice of ``model.layers``, cut by parameter count (``balance_stages``,
the default) or by layer count (``split_into_stages``). Each step takes a global
mini-batch of ``batch_size * replicas`` samples from the epoch's seeded permutation;
replica ``r`` trains on rows ``chunk_bounds(rows, replicas)[r]`` of it, split into
``micro_batches`` micro-batches run by the ``gpipe`` or ``1f1b`` schedule, and each
stage's gradients are averaged over its replicas (the runtime's all-reduce) before the
local SGD step. A final batch too small to give every micro-batch of every replica a row
is skipped (it changes from epoch to epoch). The loss lives on the last stages: once per
epoch one all-reduce brings it (averaged over the replicas) to rank 0, which prints::

    epoch  3/20  step   135/900  loss 0.2134  samples/s 10,234  idle 41.2%  sent 16.0 KiB/step

``idle`` is the share of the epoch the ranks spent outside forward/backward compute
(pipeline bubble, transfers and the gradient all-reduce; mean over ranks), ``sent`` the
activation and activation-gradient bytes a rank put on the wire per step (mean over
ranks; the all-reduce not included). The test accuracy is computed on the last stage of
replica 0 (``PipelineParallel.predict``) and broadcast, so every rank returns it.
Pipelined runs average gradients with the runtime's all-reduce only (``--aggregator
ring``) and do not checkpoint: other combinations raise ``ConfigError``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from netdist.compression.topk import TopKCompressor
from netdist.errors import ConfigError
from netdist.launch_report import rank_list
from netdist.parallel.aggregators import (
    AllReduceAggregator,
    Fp16AllReduceAggregator,
    GradientAggregator,
    OverlapAggregator,
    TopKAggregator,
)
from netdist.parallel.stages import (
    SCHEDULES,
    PipelineParallelConfig,
    PipelineStage,
    balance_stages,
    parameter_costs,
    split_into_stages,
)
from netdist.sharding import chunk_bounds
from netdist.train.data import (
    Dataset,
    epoch_permutation,
    iterate_batches,
    load_digits_dataset,
    shard_indices,
)
from netdist.train.losses import softmax_cross_entropy
from netdist.train.nn import Sequential, mlp
from netdist.train.optimizers import SGD, Optimizer
from netdist.train.step import GradReady, distributed_train_step

if TYPE_CHECKING:
    from netdist.collectives import Group
    from netdist.transport.base import Transport

__all__ = [
    "AGGREGATOR_CHOICES",
    "DemoConfig",
    "DemoResult",
    "UpdatePath",
    "UpdateFactory",
    "update_factories",
    "PIPELINE_BALANCE_CHOICES",
    "build_model",
    "pipeline_stages_for",
    "evaluate",
    "checkpoint_dir_problem",
    "train_worker",
]

AGGREGATOR_CHOICES = ("ring", "topk", "fp16", "ps", "ps-sharded", "ps-async", "diloco",
                      "local-sgd")
_PERIODIC_MODES = ("diloco", "local-sgd")
"""Modes that synchronise every ``sync_every`` steps (``netdist.parallel.diloco``)."""
_SERVER_MODES = ("ps-sharded", "ps-async")
PIPELINE_BALANCE_CHOICES = ("params", "layers")
"""How ``--pipeline-stages`` cuts the MLP: equal parameter counts or equal layer counts."""


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Everything one rank of the demo job needs besides its transport."""

    aggregator: str = "ring"
    epochs: int = 20
    batch_size: int = 32
    """Samples per training rank per step; the global batch is that times the ranks.
    Pipelined: samples per pipeline replica per step (times the replicas globally)."""
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    hidden: tuple[int, ...] = (128, 64)
    topk_ratio: float = 0.01
    bucket_mb: float = 25.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    """Save every this many steps (0: only at the end when a directory is given)."""
    resume: bool = False
    keep_last: int = 3
    timeout: float | None = None
    """Bound on every collective (None: the transport's default)."""
    pipeline_stages: int = 0
    """Pipeline stages per replica (0: no pipelining, plain data parallelism). The world
    size must be a multiple; ``batch_size`` then counts samples per replica per step."""
    micro_batches: int = 4
    """Micro-batches per replica mini-batch (pipelined runs only)."""
    schedule: str = "1f1b"
    """Pipeline schedule, ``gpipe`` or ``1f1b`` (pipelined runs only)."""
    pipeline_balance: str = "params"
    """Cut the MLP into stages by ``params`` (equal parameter counts) or ``layers``."""
    sync_every: int = 50
    """``diloco`` / ``local-sgd``: inner steps between synchronisations (DiLoCo's H)."""
    quantize: str | None = None
    """``diloco`` / ``local-sgd``: exchange in ``int8`` or ``int4`` (``Quantization.parse``)."""
    fragments: int = 1
    """``diloco`` / ``local-sgd``: streaming fragments."""
    fragment_sync_delay: int = 0
    """``diloco`` / ``local-sgd``: steps a fragment's exchange runs behind."""
    fragment_mixing: float = 0.0
    """``diloco`` / ``local-sgd``: weight of the local fragment when the global one lands."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.aggregator not in AGGREGATOR_CHOICES:
            raise ConfigError(f"unknown aggregator {self.aggregator!r}; choose from "
                              f"{', '.join(AGGREGATOR_CHOICES)}")
        for name in ("epochs", "batch_size", "keep_last"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if not 0 < self.topk_ratio <= 1:
            raise ConfigError(f"topk ratio must be in (0, 1], got {self.topk_ratio}")
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket size must be > 0 MiB, got {self.bucket_mb}")
        if not self.hidden or any(h < 1 for h in self.hidden):
            raise ConfigError(f"hidden layer sizes must be >= 1, got {self.hidden}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if (self.resume or self.checkpoint_every) and not self.checkpoint_dir:
            raise ConfigError("--resume and --checkpoint-every need --checkpoint-dir")
        if self.checkpoint_dir and self.aggregator in _PERIODIC_MODES:
            raise ConfigError(f"--aggregator {self.aggregator} keeps a global model and outer "
                              "optimizer the demo does not checkpoint yet; use ring, topk, "
                              "fp16 or ps")
        if self.aggregator in _PERIODIC_MODES:
            self.periodic_config()
        if self.checkpoint_dir and self.aggregator in _SERVER_MODES:
            raise ConfigError(f"--aggregator {self.aggregator} keeps the parameters on the "
                              "servers and cannot checkpoint; use ring, topk, fp16 or ps")
        if self.timeout is not None and not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ConfigError(f"timeout must be a finite number of seconds > 0, got "
                              f"{self.timeout}")
        self._check_pipeline()

    def periodic_config(self) -> Any:
        """The ``DiLoCoConfig`` of the ``diloco`` / ``local-sgd`` modes (checked)."""
        from netdist.parallel.diloco import DiLoCoConfig

        return DiLoCoConfig(sync_every=self.sync_every, outer_lr=self.outer_lr,
                            outer_momentum=self.outer_momentum,
                            nesterov=self.outer_momentum > 0, quantization=self.quantize,
                            fragments=self.fragments,
                            fragment_sync_delay=self.fragment_sync_delay,
                            fragment_mixing=self.fragment_mixing, timeout=self.timeout)

    @property
    def num_layers(self) -> int:
        """Layers of the demo MLP (``Linear`` and ``ReLU`` alike): what stages cut."""
        return 2 * len(self.hidden) + 1

    def _check_pipeline(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; choose from "
                              f"{', '.join(SCHEDULES)}")
        if self.pipeline_balance not in PIPELINE_BALANCE_CHOICES:
            raise ConfigError(f"unknown pipeline balance {self.pipeline_balance!r}; choose "
                              f"from {', '.join(PIPELINE_BALANCE_CHOICES)}")
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.pipeline_stages < 0:
            raise ConfigError(f"pipeline_stages must be >= 0 (0: no pipelining), got "
                              f"{self.pipeline_stages}")
        if not self.pipeline_stages:
            defaults = (4, "1f1b", "params")
            if (self.micro_batches, self.schedule, self.pipeline_balance) != defaults:
                raise ConfigError("--micro-batches, --schedule and --pipeline-balance need "
                                  "--pipeline-stages")
            return
        if self.aggregator != "ring":
            raise ConfigError(
                f"--pipeline-stages averages each stage's gradients over its replicas with "
                f"the pipeline's own all-reduce; --aggregator {self.aggregator} cannot be "
                f"combined with it (use the default, ring)")
        if self.checkpoint_dir or self.resume or self.checkpoint_every:
            raise ConfigError("pipelined runs (--pipeline-stages) cannot checkpoint yet; "
                              "drop --checkpoint-dir, --checkpoint-every and --resume")
        if self.pipeline_stages > self.num_layers:
            sizes = ",".join(str(h) for h in self.hidden)
            raise ConfigError(
                f"--pipeline-stages {self.pipeline_stages} needs at least as many layers: "
                f"the MLP with --hidden {sizes} has {self.num_layers} "
                f"({len(self.hidden) + 1} Linear + {len(self.hidden)} ReLU); add hidden "
                f"layers or use fewer stages")
        if self.batch_size < self.micro_batches:
            raise ConfigError(
                f"--batch-size {self.batch_size} cannot be split into --micro-batches "
                f"{self.micro_batches} (every micro-batch needs at least one sample)")

    def check_world_size(self, world_size: int) -> int:
        """Pipeline replicas for ``world_size`` ranks (``ConfigError`` unless a multiple
        of ``pipeline_stages``); ``world_size`` itself when not pipelined."""
        if not self.pipeline_stages:
            return world_size
        if world_size % self.pipeline_stages:
            raise ConfigError(
                f"--pipeline-stages {self.pipeline_stages} needs a world size that is a "
                f"multiple of {self.pipeline_stages} (stages x data-parallel replicas), "
                f"got {world_size} ranks")
        return world_size // self.pipeline_stages


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What one rank observed (the reporting rank's is what the demo prints).

    Server ranks of the dedicated-server modes do not train: their accuracy and loss
    are NaN and their step count 0. In pipelined runs every rank returns replica 0's
    accuracy and the replicas' mean loss of the last epoch; ``comm_fraction`` is this
    rank's share of time outside forward/backward compute and ``bytes_sent`` its
    activation / activation-gradient traffic.
    """

    test_accuracy: float
    final_loss: float
    steps: int
    samples_per_second: float
    comm_fraction: float
    bytes_sent: int
    resumed_from_step: int = 0


@dataclass(frozen=True, slots=True)
class UpdatePath:
    """How this rank takes part in one ``--aggregator`` mode.

    A training rank has an ``aggregator`` (given to ``distributed_train_step``) and an
    ``apply`` (plain or async) that turns the aggregator's output into new parameters in
    place; ``optimizer`` and ``compressor``, when set, are checkpointed. ``data_rank`` /
    ``data_world`` place the rank among the training ranks (for data sharding);
    ``reporter`` marks the rank that prints. A rank that only serves has ``serve`` (run
    until the job ends) and no aggregator. ``close`` (async) releases what the mode
    started, on success and on failure.
    """

    aggregator: GradientAggregator | None
    apply: Callable[[list[np.ndarray]], Any] | None
    data_rank: int
    data_world: int
    reporter: bool
    optimizer: Optimizer | None = None
    compressor: TopKCompressor | None = None
    serve: Callable[[], Awaitable[Any]] | None = None
    close: Callable[[], Awaitable[Any]] | None = None
    finish: Callable[[], Awaitable[Any]] | None = None
    """Run once after the last step, before the model is evaluated (the ``diloco`` modes'
    last synchronisation)."""


UpdateFactory = Callable[["Group", Sequential, DemoConfig], Awaitable[UpdatePath]]


def _local_sgd(model: Sequential, config: DemoConfig) -> tuple[SGD, Callable[[list[np.ndarray]], None]]:
    params = model.parameters()
    optimizer = SGD(params, lr=config.lr, momentum=config.momentum,
                    weight_decay=config.weight_decay)

    def apply(averaged: list[np.ndarray]) -> None:
        for p, g in zip(params, averaged):
            if g is not p.grad:
                np.copyto(p.grad, g)
        optimizer.step()

    return optimizer, apply


async def _ring(group: Group, model: Sequential, config: DemoConfig) -> UpdatePath:
    optimizer, apply = _local_sgd(model, config)
    agg = AllReduceAggregator(group, bucket_mb=config.bucket_mb, timeout=config.timeout)
    params = model.parameters()
    # The gradients live inside the all-reduce buckets: no packing, no unpacking.
    for p, view in zip(params, agg.bucket_views([p.grad for p in params])):
        p.grad = view
    return UpdatePath(agg, apply, group.rank, group.world_size, group.rank == 0, optimizer)


async def _fp16(group: Group, model: Sequential, config: DemoConfig) -> UpdatePath:
    optimizer, apply = _local_sgd(model, config)
    agg = Fp16AllReduceAggregator(group, bucket_mb=config.bucket_mb, timeout=config.timeout)
    return UpdatePath(agg, apply, group.rank, group.world_size, group.rank == 0, optimizer)


async def _topk(group: Group, model: Sequential, config: DemoConfig) -> UpdatePath:
    optimizer, apply = _local_sgd(model, config)
    agg = TopKAggregator(group, ratio=config.topk_ratio, error_feedback=True,
                         timeout=config.timeout)
    return UpdatePath(agg, apply, group.rank, group.world_size, group.rank == 0, optimizer,
                      compressor=agg.compressor)


class _ParameterServerAggregator:
    """``ParameterServer.reduce_gradients`` with the payload this rank sends counted."""

    def __init__(self, server: Any, world_size: int) -> None:
        self.server = server
        self.world_size = world_size
        self.bytes_sent = 0

    async def aggregate(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        nbytes = sum(g.nbytes for g in grads)
        # workers send their gradients once; the server sends the average to every worker
        self.bytes_sent += nbytes * (self.world_size - 1) if self.server.is_server else nbytes
        return list(await self.server.reduce_gradients(grads))


async def _ps_sync(group: Group, model: Sequential, config: DemoConfig) -> UpdatePath:
    from netdist.ps import ParameterServer

    server = ParameterServer(group, timeout=config.timeout)
    await server.broadcast_params([p.data for p in model.parameters()])
    optimizer, apply = _local_sgd(model, config)
    return UpdatePath(_ParameterServerAggregator(server, group.world_size), apply,
                      group.rank, group.world_size, group.rank == 0, optimizer,
                      close=server.aclose)


async def _ps_hook(group: Group, model: Sequential, config: DemoConfig) -> UpdatePath:
    """``ps-sharded`` / ``ps-async``: the parameter-server update path.

    ``netdist.train.ps_paths.demo_update_path`` runs servers co-located with the first
    ``NETDIST_PS_SERVERS`` ranks (every rank trains) with SGD on the servers;
    ``NETDIST_PS_MAX_STALENESS`` bounds ``ps-async``. Its aggregator returns the new
    parameters, which its ``apply`` copies into the model.
    """
    try:
        from netdist.train.ps_paths import demo_update_path
    except ImportError as exc:  # pragma: no cover - netdist.ps ships with netdist
        raise ConfigError(f"--aggregator {config.aggregator} needs netdist.ps: {exc}") from exc
    hooks = await demo_update_path(config.aggregator, group, model, config)
    return UpdatePath(hooks.aggregator, hooks.apply, group.rank, group.world_size,
                      group.rank == 0, close=hooks.close)


class _PeriodicAggregator:
    """The aggregator of the ``diloco`` / ``local-sgd`` modes: nothing per step (each rank
    steps on its own gradients); its bytes and exposed time are the periodic exchanges'."""

    def __init__(self, sync: Any) -> None:
        self.sync = sync

    @property
    def bytes_sent(self) -> int:
        return int(self.sync.bytes_sent)

    @property
    def exposed_seconds(self) -> float:
        return float(sum(r.exposed_s for r in self.sync.records))

    async def aggregate(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        return grads


async def _periodic(group: Group, model: Sequential, config: DemoConfig) -> UpdatePath:
    """``diloco`` / ``local-sgd``: local SGD steps, synchronised every ``sync_every``."""
    from netdist.parallel.diloco import DiLoCo, LocalSGD

    optimizer, sgd = _local_sgd(model, config)
    cls = LocalSGD if config.aggregator == "local-sgd" else DiLoCo
    periodic = config.periodic_config()
    sync = cls(group, model.parameters(), periodic)

    async def apply(grads: list[np.ndarray]) -> None:
        sgd(grads)
        await sync.step()

    async def finish() -> None:
        await sync.finish()
        if periodic.fragments > 1 or sync.inner_step % periodic.sync_every:
            await sync.sync_now()  # every rank ends on the same (global) model

    return UpdatePath(_PeriodicAggregator(sync), apply, group.rank, group.world_size,
                      group.rank == 0, optimizer, finish=finish)


def update_factories() -> dict[str, UpdateFactory]:
    """``--aggregator`` name -> factory. A fresh dict: callers may add or replace modes."""
    return {
        "ring": _ring,
        "topk": _topk,
        "fp16": _fp16,
        "ps": _ps_sync,
        "ps-sharded": _ps_hook,
        "ps-async": _ps_hook,
        "diloco": _periodic,
        "local-sgd": _periodic,
    }


def build_model(config: DemoConfig, dataset: Dataset) -> Sequential:
    """The MLP ``features -> hidden... -> classes``, float32, seeded by ``config.seed``."""
    sizes = [dataset.num_features, *config.hidden, dataset.num_classes]
    return mlp(sizes, rng=np.random.default_rng(config.seed), dtype=np.float32)


def pipeline_stages_for(model: Sequential, config: DemoConfig) -> list[PipelineStage]:
    """How a pipelined run cuts ``model.layers`` into ``config.pipeline_stages`` stages.

    ``pipeline_balance="params"``: ``balance_stages`` over per-layer parameter counts
    (the slowest stage sets the pipeline's pace, and an MLP's compute follows its
    parameters); ``"layers"``: ``split_into_stages`` (equal layer counts).
    """
    if config.pipeline_stages < 1:
        raise ConfigError("pipeline_stages_for needs config.pipeline_stages >= 1")
    layers = model.layers
    if config.pipeline_stages > len(layers):
        raise ConfigError(f"cannot cut {len(layers)} layers into {config.pipeline_stages} "
                          f"pipeline stages")
    if config.pipeline_balance == "params":
        return balance_stages(parameter_costs(layers), config.pipeline_stages)
    return split_into_stages(len(layers), config.pipeline_stages)


def evaluate(model: Sequential, x: np.ndarray, y: np.ndarray) -> float:
    """Classification accuracy of ``model`` on ``(x, y)`` as a fraction."""
    return float(np.mean(np.argmax(model(x), axis=1) == y))


class _TimedAggregator:
    """Measures the wall time the step waits for communication (its exposed share):
    all of ``aggregate``, or, overlapped with backward, what is left in ``finish``."""

    def __init__(self, inner: GradientAggregator) -> None:
        self.inner = inner
        self._seconds = 0.0

    @property
    def seconds(self) -> float:
        """Seconds waited for communication: in ``aggregate``, plus what a periodic mode
        waited for its exchanges."""
        return self._seconds + float(getattr(self.inner, "exposed_seconds", 0.0))

    @property
    def bytes_sent(self) -> int:
        return int(self.inner.bytes_sent)

    def for_step(self) -> GradientAggregator:
        """``self``, or an overlap-capable twin when the inner aggregator can overlap."""
        return _TimedOverlap(self) if isinstance(self.inner, OverlapAggregator) else self

    async def aggregate(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        start = time.perf_counter()
        try:
            return await self.inner.aggregate(grads)
        finally:
            self._seconds += time.perf_counter() - start


class _TimedOverlap:
    """``_TimedAggregator`` for an ``OverlapAggregator``: times ``finish``."""

    def __init__(self, timed: _TimedAggregator) -> None:
        self.timed = timed

    @property
    def bytes_sent(self) -> int:
        return self.timed.bytes_sent

    async def aggregate(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        return await self.timed.aggregate(grads)

    def begin(self, like: Sequence[np.ndarray]) -> Any:
        inner = cast(OverlapAggregator, self.timed.inner)  # for_step() checked it
        return _TimedSession(inner.begin(like), self.timed)


class _TimedSession:
    """An ``OverlapSession`` whose ``finish`` (the exposed communication) is timed."""

    def __init__(self, session: Any, timed: _TimedAggregator) -> None:
        self.session, self.timed = session, timed
        self.ready = session.ready

    @property
    def error(self) -> BaseException | None:
        error: BaseException | None = self.session.error
        return error

    async def aclose(self) -> None:
        await self.session.aclose()

    async def finish(self, grads: Any = None) -> list[np.ndarray]:
        start = time.perf_counter()
        try:
            averaged: list[np.ndarray] = await self.session.finish(grads)
            return averaged
        finally:
            self.timed._seconds += time.perf_counter() - start


def _human_bytes(n: float) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# -- checkpoints ---------------------------------------------------------------------------


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def checkpoint_dir_problem(directory: str | os.PathLike[str], *, tag: str = "") -> str | None:
    """Why ``directory`` cannot hold checkpoints on this host, or ``None`` when it can.

    Creates the directory (with its parents) and writes and removes a probe file named
    with this process's id and ``tag``, so an unusable ``--checkpoint-dir`` is reported
    before training rather than by the first save, after it. The answer is a phrase
    naming the path and the OS's reason, e.g. ``cannot create /proc/nope: No such file
    or directory``.
    """
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return f"{path} exists and is not a directory"
    except OSError as exc:
        return f"cannot create {path}: {_reason(exc)}"
    probe = path / f".netdist-write-probe-{os.getpid()}{tag}"
    try:
        with open(probe, "xb") as f:
            f.write(b"netdist write probe\n")
        probe.unlink()
    except OSError as exc:
        return f"cannot write to {path}: {_reason(exc)}"
    return None


async def _check_checkpoint_dir(group: Group, directory: str, timeout: float | None) -> None:
    """Every rank probes ``directory``; if any cannot use it, every rank raises the same
    ``ConfigError`` (naming the ranks) instead of the others losing a peer later."""
    problem = checkpoint_dir_problem(directory, tag=f"-rank{group.rank}")
    problems = await group.all_gather_object(problem, timeout=timeout)
    by_problem: dict[str, list[int]] = {}
    for rank, text in enumerate(problems):
        if text:
            by_problem.setdefault(str(text), []).append(rank)
    if by_problem:
        parts = [f"{rank_list(ranks)}: {text}" for text, ranks in by_problem.items()]
        raise ConfigError(f"checkpoint directory unusable on {'; '.join(parts)}")


def _layer_order(name: str) -> tuple[int, bool, str]:
    """``"2.weight"`` sorts by layer, then weight before bias (``Linear``'s own order)."""
    head, _, rest = name.partition(".")
    return (int(head), rest != "weight", rest) if head.isdigit() else (-1, True, name)


def _hidden_of(shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """The ``--hidden`` an MLP with these parameter shapes was built with, if it is one."""
    ordered = sorted(shapes.items(), key=lambda item: _layer_order(item[0]))
    weights = [shape for name, shape in ordered if name.endswith(".weight") and len(shape) == 2]
    if len(weights) < 2:
        return None
    return ",".join(str(shape[0]) for shape in weights[:-1])


def _check_model_state(saved: Mapping[str, Any], model: Sequential, where: str) -> None:
    """``ConfigError`` naming every parameter whose shape differs between the checkpoint
    (``saved``) and ``model``, with both shapes; nothing when they match."""
    here = {name: tuple(p.data.shape) for name, p in model.named_parameters()}
    there = {name: tuple(np.shape(getattr(v, "data", v))) for name, v in saved.items()}
    if here == there:
        return
    problems = []
    for name in [*here, *sorted(set(there) - set(here), key=_layer_order)]:
        old, new = there.get(name), here.get(name)
        if old == new:
            continue
        if old is None:
            problems.append(f"{name} {new} is not in the checkpoint")
        elif new is None:
            problems.append(f"{name} {old} is in the checkpoint but not in this model")
        else:
            problems.append(f"{name} is {old} in the checkpoint but {new} in this model")
    old_hidden, new_hidden = _hidden_of(there), _hidden_of(here)
    hint = (f" (written with --hidden {old_hidden}, this run has --hidden {new_hidden}; "
            f"resume with the same --hidden or use another --checkpoint-dir)"
            if old_hidden and new_hidden else "")
    raise ConfigError(f"cannot resume from {where}: the checkpoint holds another model: "
                      f"{'; '.join(problems)}{hint}")


def _checkpoint_state(model: Sequential, path: UpdatePath, step: int, epoch: int,
                      batch: int, config: DemoConfig) -> dict[str, Any]:
    from netdist.checkpoint import ShardedArray

    state: dict[str, Any] = {
        "model": {name: p.data for name, p in model.named_parameters()},
        "progress": {"step": step, "epoch": epoch, "batch": batch,
                     "world_size": path.data_world, "batch_size": config.batch_size,
                     "seed": config.seed},
    }
    if path.optimizer is not None:
        state["optimizer"] = path.optimizer.state_dict()
    if path.compressor is not None and path.compressor.residuals:
        # residuals differ per rank: stored as rows of a (world, n) tensor, one per rank
        state["residuals"] = {str(i): ShardedArray(r.reshape(1, -1))
                              for i, r in enumerate(path.compressor.residuals)}
    return state


def _restore(state: dict[str, Any], model: Sequential, path: UpdatePath,
             batch_size: int) -> tuple[int, int, int]:
    """Load ``state`` into the model, optimizer and compressor; ``(step, epoch, batch)``."""
    model.load_state_dict({k: np.asarray(v) for k, v in state["model"].items()})
    if path.optimizer is not None and "optimizer" in state:
        path.optimizer.load_state_dict(state["optimizer"])
    residuals = state.get("residuals")
    if path.compressor is not None and residuals:
        rows = [np.asarray(getattr(residuals[str(i)], "data", residuals[str(i)]))
                for i in range(len(residuals))]
        # With another world size a rank receives several old ranks' rows, or none:
        # summing them keeps the total not-yet-sent gradient mass.
        path.compressor.load_state_dict(
            {f"residual_{i}": r.reshape(-1, r.shape[-1]).sum(axis=0) for i, r in enumerate(rows)})
    progress = state["progress"]
    step, epoch, batch = int(progress["step"]), int(progress["epoch"]), int(progress["batch"])
    old_world, old_batch_size = int(progress["world_size"]), int(progress["batch_size"])
    if (old_world, old_batch_size) != (path.data_world, batch_size):
        # Another world or batch size: continue after the same number of samples.
        batch = batch * old_world * old_batch_size // (path.data_world * batch_size)
    return step, epoch, batch


def _job_size_text(training: int, job: int) -> str:
    """``4 training ranks``; when other ranks only serve (a parameter server), also those
    and the job's size: ``1 training rank and 1 parameter server (2 in the job)``."""
    text = f"{training} training rank{'s' if training != 1 else ''}"
    servers = job - training
    if servers > 0:
        text += (f" and {servers} parameter server{'s' if servers != 1 else ''} "
                 f"({job} in the job)")
    return text


async def train_worker(transport: Transport, config: DemoConfig, *,
                       log: Callable[[str], None] | None = print,
                       factories: dict[str, UpdateFactory] | None = None) -> DemoResult:
    """Train (or serve) one rank of the demo job over ``transport``.

    All ranks must run this with the same ``config``. The reporting rank logs progress
    through ``log``. Returns this rank's result; every training rank evaluates the test
    accuracy on its own parameters (identical across ranks in the synchronous modes).
    With ``config.pipeline_stages`` the run is pipelined (``factories`` is not used):
    rank 0 reports, and every rank returns the accuracy of replica 0's pipeline.
    """
    from netdist.collectives import Group  # the job needs asyncio; the kit does not

    if config.pipeline_stages:
        return await _train_pipelined(transport, config, log)
    table = update_factories() if factories is None else factories
    if config.aggregator not in table:
        raise ConfigError(f"no update path registered for --aggregator {config.aggregator}")
    dataset = load_digits_dataset(seed=config.seed, dtype=np.float32)
    model = build_model(config, dataset)
    params = model.parameters()
    async with Group(transport, timeout=config.timeout) as group:
        path = await table[config.aggregator](group, model, config)
        try:
            if path.serve is not None:
                await path.serve()
                return DemoResult(float("nan"), float("nan"), 0, 0.0, 0.0, 0)
            return await _train(group, config, dataset, model, params, path,
                                log if path.reporter else None)
        finally:
            if path.close is not None:
                await path.close()


async def _train(group: Group, config: DemoConfig, dataset: Dataset, model: Sequential,
                 params: list[Any], path: UpdatePath,
                 say: Callable[[str], None] | None) -> DemoResult:
    if path.aggregator is None or path.apply is None:
        raise ConfigError(f"update path for {config.aggregator} has no aggregator")
    timed = _TimedAggregator(path.aggregator)
    step_aggregator = timed.for_step()
    rank, world = path.data_rank, path.data_world
    num_train = len(dataset.x_train)
    steps_per_epoch = -(-(num_train // world) // config.batch_size)
    total_steps = steps_per_epoch * config.epochs

    step, start_epoch, skip = 0, 0, 0
    if config.checkpoint_dir:
        await _check_checkpoint_dir(group, config.checkpoint_dir, config.timeout)
    if config.resume and config.checkpoint_dir:
        from netdist.checkpoint import list_checkpoints, load

        found = await group.broadcast_object(
            bool(list_checkpoints(config.checkpoint_dir)) if group.rank == 0 else None, 0,
            timeout=config.timeout)
        if found:
            state = await load(config.checkpoint_dir, group, timeout=config.timeout)
            saved_step = state.get("progress", {}).get("step", "?")
            _check_model_state(state["model"], model,
                               f"{config.checkpoint_dir} (step {saved_step})")
            step, start_epoch, skip = _restore(state, model, path, config.batch_size)
            if skip >= steps_per_epoch:
                start_epoch, skip = start_epoch + 1, 0
            if say and start_epoch >= config.epochs:
                # a finished job started again: say so instead of "resuming" into nothing
                say(f"nothing to train: the checkpoint in {config.checkpoint_dir} (step "
                    f"{step}) is the end of epoch {config.epochs} of {config.epochs}; "
                    f"raise the epochs to train longer, or use a new checkpoint "
                    f"directory to start over")
            elif say:
                say(f"resumed from {config.checkpoint_dir} at step {step} "
                    f"(epoch {start_epoch + 1}, batch {skip})")
        elif say:
            say(f"no checkpoint in {config.checkpoint_dir}; starting from scratch")
    resumed_from = step
    total_steps = step + steps_per_epoch * (config.epochs - start_epoch) - skip

    if say:
        sizes = "-".join(str(s) for s in [dataset.num_features, *config.hidden,
                                          dataset.num_classes])
        say(f"netdist demo: {_job_size_text(world, group.world_size)}, "
            f"aggregator {config.aggregator}, MLP {sizes}, {num_train} train / "
            f"{len(dataset.x_test)} test samples, batch {config.batch_size} per rank "
            f"({config.batch_size * world} global), {steps_per_epoch} steps/epoch")

    async def checkpoint(epoch: int, batch: int) -> None:
        from netdist.checkpoint import save

        if epoch < config.epochs and batch >= steps_per_epoch:
            epoch, batch = epoch + 1, 0
        directory = config.checkpoint_dir
        if directory is None:
            raise ConfigError("checkpointing needs checkpoint_dir (DemoConfig validates this)")
        state = _checkpoint_state(model, path, step, epoch, batch, config)
        result = await save(state, directory, group, step=step,
                            keep_last=config.keep_last, overwrite=True, timeout=config.timeout)
        if say:
            say(f"checkpoint: step {step} -> {result.path}")

    last_loss = float("nan")
    total_time = 0.0
    total_samples = 0
    last_saved = step
    for epoch in range(start_epoch, config.epochs):
        indices = shard_indices(num_train, rank, world, epoch, config.seed)
        epoch_start = time.perf_counter()
        comm_before, bytes_before = timed.seconds, timed.bytes_sent
        losses: list[float] = []
        samples = 0
        for b, batch in enumerate(iterate_batches(indices, config.batch_size)):
            if epoch == start_epoch and b < skip:
                continue
            xb, yb = dataset.x_train[batch], dataset.y_train[batch]

            def compute(ready: GradReady, xb: np.ndarray = xb,
                        yb: np.ndarray = yb) -> tuple[float, list[np.ndarray]]:
                model.zero_grad()
                logits, ctx = model.forward(xb)
                loss, grad = softmax_cross_entropy(logits, yb)
                model.backward(ctx, grad, on_grad_ready=ready)
                return loss, [p.grad for p in params]

            # compute runs in a worker thread (the loop keeps moving bytes and heartbeats)
            # and each gradient bucket is all-reduced as soon as backward has filled it
            losses.append(await distributed_train_step(compute, path.apply, step_aggregator,
                                                       overlap=True, params=params))
            samples += len(batch)
            step += 1
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                await checkpoint(epoch, b + 1)
                last_saved = step
        elapsed = time.perf_counter() - epoch_start
        total_time += elapsed
        total_samples += samples
        if losses:
            last_loss = float(np.mean(losses))
        if say and losses:
            comm = (timed.seconds - comm_before) / elapsed if elapsed > 0 else 0.0
            sent = (timed.bytes_sent - bytes_before) / len(losses)
            say(f"epoch {epoch + 1:>2}/{config.epochs}  step {step:>5}/{total_steps}  "
                f"loss {last_loss:.4f}  samples/s {samples * world / elapsed:,.0f}  "
                f"comm {comm:.1%}  sent {_human_bytes(sent)}/step")
    if config.checkpoint_dir and step != last_saved:
        await checkpoint(config.epochs, 0)

    if path.finish is not None:
        await path.finish()
    accuracy = evaluate(model, dataset.x_test, dataset.y_test)
    if say:
        say(f"final test accuracy: {accuracy:.1%}")
    return DemoResult(
        test_accuracy=accuracy,
        final_loss=last_loss,
        steps=step,
        samples_per_second=total_samples * world / total_time if total_time > 0 else 0.0,
        comm_fraction=timed.seconds / total_time if total_time > 0 else 0.0,
        bytes_sent=timed.bytes_sent,
        resumed_from_step=resumed_from,
    )


# -- pipelined runs ------------------------------------------------------------------------


async def _train_pipelined(transport: Transport, config: DemoConfig,
                           log: Callable[[str], None] | None) -> DemoResult:
    """One rank of a pipelined run: this rank's stage of one replica (module docstring)."""
    from netdist.collectives import Group
    from netdist.parallel.pipeline import PipelineParallel
    from netdist.types import ReduceOp

    replicas = config.check_world_size(transport.world_size)
    num_stages = config.pipeline_stages
    dataset = load_digits_dataset(seed=config.seed, dtype=np.float32)
    model = build_model(config, dataset)
    stages = pipeline_stages_for(model, config)
    pp = PipelineParallelConfig(num_stages, config.micro_batches, config.schedule, replicas)
    num_train = len(dataset.x_train)
    global_batch = config.batch_size * replicas
    min_rows = replicas * config.micro_batches  # a row for every micro-batch of every replica
    full, tail = divmod(num_train, global_batch)
    steps_per_epoch = full + (1 if tail >= min_rows else 0)
    if steps_per_epoch == 0:
        raise ConfigError(
            f"{num_train} training samples cannot give each of the {replicas} replicas' "
            f"{config.micro_batches} micro-batches a sample; use fewer --micro-batches")
    total_steps = steps_per_epoch * config.epochs

    async with Group(transport, timeout=config.timeout) as group:
        stage = stages[pp.stage_of(group.rank)]
        replica = pp.replica_of(group.rank)

        def make_optimizer(params: list[Any]) -> SGD:
            return SGD(params, lr=config.lr, momentum=config.momentum,
                       weight_decay=config.weight_decay)

        pipe = PipelineParallel(transport, stage.select(model.layers), pp,
                                loss_fn=softmax_cross_entropy, optimizer_factory=make_optimizer,
                                group=group, timeout=config.timeout)
        say = log if group.rank == 0 else None
        if say:
            sizes = "-".join(str(s) for s in [dataset.num_features, *config.hidden,
                                              dataset.num_classes])
            costs = parameter_costs(model.layers)
            cut = " | ".join(f"[{s.start_layer}:{s.end_layer}] "
                             f"{sum(costs[s.start_layer:s.end_layer]):,} params"
                             for s in stages)
            say(f"netdist demo: pipeline of {num_stages} stages x {replicas} replicas "
                f"({group.world_size} ranks), schedule {pp.schedule}, "
                f"{config.micro_batches} micro-batches, MLP {sizes} cut {cut}, {num_train} "
                f"train / {len(dataset.x_test)} test samples, batch {config.batch_size} per "
                f"replica ({global_batch} global), {steps_per_epoch} steps/epoch")

        step = 0
        last_loss = float("nan")
        total_time = total_compute = 0.0
        total_samples = total_sent = 0
        for epoch in range(config.epochs):
            order = epoch_permutation(num_train, epoch, config.seed)
            epoch_start = time.perf_counter()
            loss_sum, steps, samples, compute, sent = 0.0, 0, 0, 0.0, 0
            for batch in iterate_batches(order, global_batch):
                if len(batch) < min_rows:
                    continue  # only the last batch of an epoch can be this short
                start, stop = chunk_bounds(len(batch), replicas)[replica]
                mine = batch[start:stop]
                loss = await pipe.train_step(
                    dataset.x_train[mine] if pipe.is_first else None,
                    dataset.y_train[mine] if pipe.is_last else None)
                if loss is not None:
                    loss_sum += loss
                stats = pipe.last_stats
                if stats is not None:
                    compute += stats.compute_seconds
                    sent += stats.bytes_sent
                steps += 1
                samples += len(batch)
            elapsed = time.perf_counter() - epoch_start
            step += steps
            total_time += elapsed
            total_compute += compute
            total_samples += samples
            total_sent += sent
            # The loss lives on the last stages: one all-reduce per epoch brings the
            # replicas' mean (and every rank's idle share and traffic) to every rank.
            idle = 1.0 - compute / elapsed if elapsed > 0 else 0.0
            summary = np.array([loss_sum if pipe.is_last else 0.0,
                                steps if pipe.is_last else 0, idle, sent], dtype=np.float64)
            await group.all_reduce(summary, op=ReduceOp.SUM, timeout=config.timeout)
            if summary[1]:
                last_loss = float(summary[0] / summary[1])
            if say and steps:
                world = group.world_size
                say(f"epoch {epoch + 1:>2}/{config.epochs}  step {step:>5}/{total_steps}  "
                    f"loss {last_loss:.4f}  samples/s {samples / elapsed:,.0f}  "
                    f"idle {summary[2] / world:.1%}  "
                    f"sent {_human_bytes(summary[3] / world / steps)}/step")

        # Replicas hold identical parameters: replica 0's pipeline evaluates, its last
        # stage broadcasts the accuracy so every rank (and rank 0, which prints) has it.
        accuracy: float | None = None
        if replica == 0:
            logits = await pipe.predict(dataset.x_test if pipe.is_first else None)
            if logits is not None:
                accuracy = float(np.mean(np.argmax(logits, axis=1) == dataset.y_test))
        accuracy = float(await group.broadcast_object(accuracy, pp.rank_of(num_stages - 1, 0),
                                                      timeout=config.timeout))
        if say:
            say(f"final test accuracy: {accuracy:.1%}")
    return DemoResult(
        test_accuracy=accuracy,
        final_loss=last_loss,
        steps=step,
        samples_per_second=total_samples / total_time if total_time > 0 else 0.0,
        comm_fraction=1.0 - total_compute / total_time if total_time > 0 else 0.0,
        bytes_sent=total_sent,
    )
